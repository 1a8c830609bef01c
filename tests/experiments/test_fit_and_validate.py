"""fit_and_validate's flag checks, before it measures anything (the measurement runs the real model: a benchmark,
not a test). It defines its flags only as a script, so it runs as one here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.compile_settings import script_env


@pytest.mark.parametrize("argv, match", [
    ([], "--name must be a plain name"),
    (["--name=a/b"], "--name must be a plain name"),
    (["--name=cpu_x", "--rates=1"], "--rates takes two rates"),
    (["--name=cpu_x", "--policies=vllm,sjf"], "at least 3 policies"),
    (["--name=cpu_x", "--real_repeats=0"], "--real_repeats must be >= 1"),
])
def test_fit_and_validate_rejects_bad_flags_before_measuring(argv, match):
    r = subprocess.run([sys.executable, "-m", "experiments.fit_and_validate", *argv], capture_output=True, text=True,
                       env=script_env())
    assert r.returncode != 0 and match in r.stderr and f"+ {sys.executable} -m" not in r.stderr  # nothing ran
