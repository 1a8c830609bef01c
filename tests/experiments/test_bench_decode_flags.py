"""experiments/bench_decode.py: a bad flag is a usage error naming it, before the model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.compile_settings import script_env


@pytest.mark.parametrize("bad, message", [
    ("--batch_sizes=", "--batch_sizes takes a comma-separated list of integers >= 1"),
    ("--multi_steps=abc", "--multi_steps takes a comma-separated list of integers >= 1"),
    ("--tokens=0", "--tokens must be >= 1"),
])
def test_bad_flags_are_usage_errors_before_the_model_loads(bad, message):
    p = subprocess.run([sys.executable, "-m", "experiments.bench_decode", "--model=tiny", bad], capture_output=True,
                       text=True, timeout=120, env={**script_env(), "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 1 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
