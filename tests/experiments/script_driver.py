"""Runs experiment scripts as `python -m MODULE ARGV...` would, many times in one process, for
`tests.experiments.helpers.run_expecting_usage_error`: starting a Python process and importing JAX costs ~1.5 s, so
each bad-flag case had cost ~1.8 s; here a case costs what its script does before it stops.

Protocol: one JSON request per line on stdin, `{"module": ..., "argv": [...], "env": {...}}` (the environment
the run sees; the variables read when a process or JAX starts must be the driver's own); one JSON reply per line on the
original stdout, `{"returncode": int, "stdout": str, "stderr": str}`. Each run executes the module's code afresh as
`__main__` (`runpy`, so its `if __name__ == "__main__"` block and its `app.run`), with file descriptors 1 and 2
captured (Python's and C's output alike). An exception that escapes is printed as the interpreter prints it, with
status 1; a `SystemExit` gives its status. Between runs the flag values are reset and the flags the script itself
defined as `__main__` are removed, so the next script defines its own again; flags defined by library modules
stay, as their modules stay imported."""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback

from absl import flags


def _exit_status(code) -> tuple[int, str]:
    """A SystemExit's code as the process's status, and what the interpreter would print for it."""
    if code is None:
        return 0, ""
    if isinstance(code, int):
        return code, ""
    return 1, f"{code}\n"


def run_one(module: str, argv: list[str]) -> dict:
    """Run `module` as __main__ with `argv`, capturing file descriptors 1 and 2."""
    saved_argv, saved = sys.argv, (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        status, tail = 0, ""
        try:
            sys.argv = [module, *argv]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            status, tail = _exit_status(e.code)
        except BaseException:  # noqa: BLE001 - the interpreter's own behaviour: print it, status 1
            status, tail = 1, traceback.format_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.write(tail)
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sys.argv = saved_argv
            _forget_the_scripts_flags()
        out.seek(0)
        err.seek(0)
        return {"returncode": status, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def _forget_the_scripts_flags() -> None:
    """Reset every flag's value, and remove the flags defined by the module run as __main__ (absl files them under
    its path, `sys.argv[0]`, where an imported module's are under its name in `sys.modules`)."""
    flags.FLAGS.unparse_flags()
    scripts = [flag for key, defined in flags.FLAGS.flags_by_module_dict().items() if key not in sys.modules
               for flag in defined]  # a list first: deleting a flag changes these dicts
    for flag in scripts:
        for name in {flag.name, flag.short_name} - {None}:
            if name in flags.FLAGS:
                delattr(flags.FLAGS, name)


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")  # fd 1 itself is the captured output during a run
    for line in sys.stdin:
        request = json.loads(line)
        os.environ.clear()
        os.environ.update(request["env"])
        replies.write(json.dumps(run_one(request["module"], request["argv"])) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
