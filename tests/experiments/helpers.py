"""Shared by the experiment scripts' tests."""

from __future__ import annotations

from types import ModuleType

from absl import flags


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



def run_expecting_usage_error(module: str, *argv: str):
    """Run `python -m module argv...` from the repository on the CPU (`script_env`, read when called) and return
    the finished process, asserting that it stopped with a usage error: exit status 1, no traceback (what every
    script's bad flag must give)."""
    import subprocess
    import sys

    from tests.compile_settings import ROOT, script_env

    p = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=script_env(JAX_PLATFORMS="cpu"))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return p
