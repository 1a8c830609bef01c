"""experiments/cold_start.py: a bad flag, its own or one it passes to experiments.generate, is a usage error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.compile_settings import script_env


@pytest.mark.parametrize("bad, message", [
    ("--max_new_tokens=0", "--max_new_tokens must be >= 1"),
    ("--extra_args=--bogus_flag", "--extra_args: experiments.generate refused its flags: FATAL Flags parsing error"),
])
def test_bad_flags_are_usage_errors(bad, message):
    p = subprocess.run([sys.executable, "-m", "experiments.cold_start", bad], capture_output=True, text=True,
                       timeout=120, env={**script_env(), "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 1 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
