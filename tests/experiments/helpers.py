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
