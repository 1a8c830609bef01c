"""paged.device.cpu_runtime: the CPU client's dispatch mode, set before JAX's backend starts.

The mode is fixed when the backend starts, and this test process's backend has started long before: the checks that
need a fresh backend run in a subprocess each."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from paged.device import cpu_runtime
from paged.errors import InvalidConfigError

# A program far too costly for the CPU client's inline path for cheap programs (a 2048 x 2048 matmul, ~17 GFLOP:
# 100 ms or more on two cores): under synchronous dispatch every call returns only once its result is ready; under
# asynchronous dispatch a call returns long before (three calls, so that a pause of this thread between a call and
# the check cannot pass for inline execution).
_PROBE = """
import jax, jax.numpy as jnp
from paged.device import cpu_runtime
{setup}
f = jax.jit(lambda a: a @ a)
x = jnp.ones((2048, 2048))
f(x).block_until_ready()
ready = []
for _ in range(3):
    y = f(x)
    ready.append(y.is_ready())
    y.block_until_ready()
print(cpu_runtime.cpu_dispatch(), "inline" if all(ready) else "dispatched", flush=True)
"""


def _run(code: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the CPU client, also where a GPU is present
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("setup, expected", [("cpu_runtime.set_cpu_dispatch('sync')", "sync inline"),
                                             ("cpu_runtime.set_cpu_dispatch('async')", "async dispatched"),
                                             ("", "async dispatched")])  # JAX's default
def test_the_mode_decides_whether_a_call_waits_for_its_program(setup, expected):
    assert _run(_PROBE.format(setup=setup)) == expected


def test_engine_flags_set_the_mode_before_the_backend_starts():
    """`validate` sets --cpu_dispatch before it checks the engine flags (which starts the backend)."""
    code = """
    from absl import flags
    from experiments.lib import engine_flags
    from paged.device import cpu_runtime
    engine_flags.define()
    flags.FLAGS(["x"{flag}])
    engine_flags.validate()
    assert cpu_runtime.backend_started()
    print(cpu_runtime.cpu_dispatch())
    """
    assert _run(code.format(flag="")) == "async"  # JAX's default
    assert _run(code.format(flag=', "--cpu_dispatch=sync"')) == "sync"


def test_a_late_change_raises_and_the_same_mode_is_a_no_op():
    import jax

    jax.devices()
    assert cpu_runtime.backend_started()  # this process's backend runs
    current = cpu_runtime.cpu_dispatch()
    other = "sync" if current == "async" else "async"
    cpu_runtime.set_cpu_dispatch(current)
    with pytest.raises(InvalidConfigError, match="already started.*set_cpu_dispatch"):
        cpu_runtime.set_cpu_dispatch(other)
    assert cpu_runtime.cpu_dispatch() == current


@pytest.mark.parametrize("bad", ["Sync", "inline", "", None])
def test_bad_modes_raise(bad):
    with pytest.raises(InvalidConfigError, match="cpu dispatch mode"):
        cpu_runtime.set_cpu_dispatch(bad)


def test_engine_flags_reject_a_late_explicit_mode():
    import jax
    from absl import app, flags
    from absl.testing import flagsaver

    from experiments.lib import engine_flags

    jax.devices()
    engine_flags.define()
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    current = cpu_runtime.cpu_dispatch()
    other = "sync" if current == "async" else "async"
    with flagsaver.flagsaver(cpu_dispatch=other):
        with pytest.raises(app.UsageError, match="--cpu_dispatch=.*already started"):
            engine_flags.apply_cpu_dispatch()
    with flagsaver.flagsaver(cpu_dispatch=current):
        assert engine_flags.apply_cpu_dispatch() == current


def test_runtime_info_reports_the_pool_size(monkeypatch):
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("NPROC", "3")
    assert cpu_runtime.runtime_info() == {"cpu_dispatch": cpu_runtime.cpu_dispatch(), "xla_cpu_pool_threads": 3}
    monkeypatch.setenv("PJRT_NPROC", "1")  # read first, as XLA does
    assert cpu_runtime.runtime_info()["xla_cpu_pool_threads"] == 1
    monkeypatch.setenv("PJRT_NPROC", "two")  # not an integer: XLA goes on to NPROC
    assert cpu_runtime.runtime_info()["xla_cpu_pool_threads"] == 3
    monkeypatch.delenv("PJRT_NPROC")
    monkeypatch.delenv("NPROC")
    assert cpu_runtime.runtime_info()["xla_cpu_pool_threads"] == len(os.sched_getaffinity(0))
