"""Shared by the experiment scripts' tests."""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import sys
from types import ModuleType

from absl import flags

from tests.compile_settings import ROOT, script_env


def parse_flags(script: ModuleType, argv: list[str]) -> None:
    """Reset the absl flags and parse `argv` as those of `script` (an experiments module)."""
    flags.FLAGS.unparse_flags()
    flags.FLAGS([script.__name__.rsplit(".", 1)[-1], *argv])


def run_main(script: ModuleType, *argv: str) -> None:
    """Parse `argv` as the absl flags of `script` (an experiments module) and run its `main`; the flags are reset
    before and after, whatever happens."""
    parse_flags(script, list(argv))
    try:
        script.main([])
    finally:
        flags.FLAGS.unparse_flags()


def run_expecting_usage_error(module: str, *argv: str) -> subprocess.CompletedProcess:
    """Run `python -m module argv...` from the repository on the CPU (`script_env`, read when called) and return
    what it did, asserting that it stopped with a usage error: exit status 1, no traceback (what every script's bad
    flag must give). The script runs in this test process's script driver (`tests/experiments/script_driver.py`, one
    process kept for every call with the same environment), as `python -m` runs it: its module code afresh as
    `__main__`, in the environment `script_env` gives now, its output captured at the file descriptors."""
    env = script_env(JAX_PLATFORMS="cpu")
    driver = _driver(env)
    driver.stdin.write(json.dumps({"module": module, "argv": list(argv), "env": env}) + "\n")
    driver.stdin.flush()
    if not select.select([driver.stdout], [], [], RUN_TIMEOUT_S)[0]:
        _stop_driver()
        raise AssertionError(f"python -m {module} {' '.join(argv)} ran past {RUN_TIMEOUT_S} s")
    line = driver.stdout.readline()
    if not line:
        _stop_driver()
        raise AssertionError(f"python -m {module} {' '.join(argv)} ended its process (the script driver)")
    reply = json.loads(line)
    p = subprocess.CompletedProcess([sys.executable, "-m", module, *argv], reply["returncode"], reply["stdout"],
                                    reply["stderr"])
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return p


RUN_TIMEOUT_S = 120
STARTUP_ENV = ("JAX_", "XLA_", "TF_", "PYTHON", "LD_")  # read when a process or JAX starts: a new driver if changed
_DRIVER: dict = {}  # "startup": its environment's STARTUP_ENV variables, "process": the driver


def _driver(env: dict[str, str]) -> subprocess.Popen:
    """The driver for `env`, started in it (each request sets its environment again): a new one when a variable read
    at start-up differs."""
    startup = {k: v for k, v in env.items() if k.startswith(STARTUP_ENV)}
    if _DRIVER and (_DRIVER["startup"] != startup or _DRIVER["process"].poll() is not None):
        _stop_driver()
    if not _DRIVER:
        _DRIVER["startup"] = startup
        _DRIVER["process"] = subprocess.Popen([sys.executable, "-m", "tests.experiments.script_driver"], cwd=ROOT,
                                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return _DRIVER["process"]


@atexit.register
def _stop_driver() -> None:
    if _DRIVER:
        process = _DRIVER.pop("process")
        _DRIVER.clear()
        process.kill()
        process.wait()
