"""How the test processes compile (set up by `tests/conftest.py`; docs in its module docstring), and the environment
of the scripts that tests start in processes of their own, so that they compile the same way.

Compilation is most of a tiny-model test's time. XLA:CPU's fusion emitters (its newer code generator) take about
twice as long to compile the sampler as its classic one, and XLA's expensive optimisations a third more again: on
four speculative end-to-end tests, 100 s -> 70 s (optimisations off) -> 46 s (and the classic emitters). The programs
compute the same things; they run a little slower, which a model of a few thousand weights does not notice (the
real-weights tests, which run optimised, were faster with the classic emitters too: 31 -> 27 s).
`PAGED_TEST_OPTIMIZE=1` compiles every test the way users' programs compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys

QUICK_COMPILE = os.environ.get("PAGED_TEST_OPTIMIZE", "") != "1"
TEST_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false" if QUICK_COMPILE else ""


def script_env(**extra: str) -> dict[str, str]:
    """This process's environment for a script a test starts: `XLA_FLAGS` the tests' own (a user's XLA_FLAGS left
    out: the scripts make their virtual devices themselves), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if TEST_XLA_FLAGS:
        env["XLA_FLAGS"] = TEST_XLA_FLAGS
    return {**env, **extra}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def run_check_script(module: str, tag: str) -> dict:
    """Run `python -m module` from the repository on the CPU (`script_env`) and return the JSON object it printed on
    its line starting with `tag + " "`; the script's stderr tail is the assertion message when it printed none."""
    p = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True,
                       env=script_env(JAX_PLATFORMS="cpu"), cwd=ROOT)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith(tag + " ")), None)
    assert line is not None, p.stderr[-3000:]
    return json.loads(line.removeprefix(tag + " "))
