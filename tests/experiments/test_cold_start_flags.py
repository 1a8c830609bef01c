"""experiments/cold_start.py: a bad flag, its own or one it passes to experiments.generate, is a usage error."""

from __future__ import annotations

import pytest

from tests.experiments.helpers import run_expecting_usage_error


@pytest.mark.parametrize("bad, message", [
    ("--max_new_tokens=0", "--max_new_tokens must be >= 1"),
    ("--extra_args=--bogus_flag", "--extra_args: experiments.generate refused its flags: FATAL Flags parsing error"),
])
def test_bad_flags_are_usage_errors(bad, message):
    p = run_expecting_usage_error("experiments.cold_start", bad)
    assert message in p.stderr, p.stderr[-2000:]
