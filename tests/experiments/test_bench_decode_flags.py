"""experiments/bench_decode.py: a bad flag is a usage error naming it, before the model loads."""

from __future__ import annotations

import pytest

from tests.experiments.helpers import run_expecting_usage_error


@pytest.mark.parametrize("bad, message", [
    ("--batch_sizes=", "--batch_sizes takes a comma-separated list of integers >= 1"),
    ("--multi_steps=abc", "--multi_steps takes a comma-separated list of integers >= 1"),
    ("--tokens=0", "--tokens must be >= 1"),
])
def test_bad_flags_are_usage_errors_before_the_model_loads(bad, message):
    p = run_expecting_usage_error("experiments.bench_decode", "--model=tiny", bad)
    assert message in p.stderr, p.stderr[-2000:]
