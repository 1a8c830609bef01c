"""How XLA's CPU client runs the step's programs: asynchronous dispatch on or off.

By default the CPU client hands every program that its cost analysis does not call cheap (every step program here)
to a worker thread and returns at once ("asynchronous dispatch"); the caller blocks later, when it reads a result.
On a small CPU the Python thread then competes for the cores with the worker and XLA's intra-op threads while it
dispatches the step's second program and lays out the next step. At batch 1 on the 2-core host, one step per
device call (`decode_steps=1`, the library's default), plain greedy decoding ran 6-7% faster with dispatch
synchronous (each program runs in the calling thread), adaptive prompt lookup 2-4% faster (fixed prompt lookup 3%
slower), and a draft model's speculative decoding ~8% slower: it overlaps the draft's burst with the host's work
only when dispatch is asynchronous. With
decode bursts (`decode_steps=4`, the experiment scripts' default) and from batch 4 on, the two modes measured the
same (docs/performance.md, "Synchronous dispatch on the CPU"; `experiments/results/cpu_dispatch_ab/`).

The switch is JAX's `jax_cpu_enable_async_dispatch`: process-wide, and read once, when the CPU backend starts (JAX
ignores a later change without a word). `set_cpu_dispatch` sets it and raises `InvalidConfigError` when the backend
has already started in the other mode; call it first thing in a program, before any JAX computation or model load.
The experiment scripts do that from their `--cpu_dispatch` flag (default `async`, JAX's), and their records say which
mode ran (`runtime_info`, in `experiments.lib.serving.env.device_info`). Only the CPU client reads the setting: on a GPU
it changes nothing.
"""

from __future__ import annotations

import os

import jax

from paged.errors import InvalidConfigError

MODES = ("async", "sync")
_OPTION = "jax_cpu_enable_async_dispatch"


def backend_started() -> bool:
    """Whether a JAX backend has started in this process (after it, the dispatch mode is fixed)."""
    from jax._src import xla_bridge  # (JAX has no public way to ask)

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return started() if started is not None else bool(getattr(xla_bridge, "_backends", None))


def cpu_dispatch() -> str:
    """The CPU dispatch mode in effect ("async" or "sync"): what the CPU backend will start with, or started with as
    long as the option was only changed through `set_cpu_dispatch` (a `jax.config.update` after the start changes
    what this reports, not the backend)."""
    return "async" if jax.config.values[_OPTION] else "sync"


def set_cpu_dispatch(mode: str) -> None:
    """Run the CPU client's programs asynchronously (`"async"`, JAX's default) or in the calling thread (`"sync"`).
    Must come before the backend starts; after it, asking for the mode already in effect is a no-op and asking for
    the other raises `InvalidConfigError`."""
    if mode not in MODES:
        raise InvalidConfigError(f"cpu dispatch mode must be one of {MODES}, got {mode!r}")
    if mode == cpu_dispatch():
        return
    if backend_started():
        raise InvalidConfigError(
            f"cpu dispatch {mode!r}: JAX's backend has already started with {cpu_dispatch()!r} dispatch, and the mode "
            "is fixed from then on; call paged.device.cpu_runtime.set_cpu_dispatch() first thing in the program, "
            "before any JAX computation or model load")
    jax.config.update(_OPTION, mode == "async")


def runtime_info() -> dict:
    """What a results record should say about how the CPU client ran: the dispatch mode and the size of XLA's
    intra-op thread pool (`PJRT_NPROC` or `NPROC` when set, which XLA reads when the backend starts; else the
    cores this process may use)."""
    threads = None
    for var in ("PJRT_NPROC", "NPROC"):  # XLA takes the first that parses as an integer
        try:
            threads = max(0, int(os.environ.get(var, "").strip()))
            break
        except ValueError:
            continue
    if threads is None:
        try:
            threads = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            threads = os.cpu_count() or 1
    return {"cpu_dispatch": cpu_dispatch(), "xla_cpu_pool_threads": threads}
