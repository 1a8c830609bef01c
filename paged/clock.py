"""Clocks for the generator's timestamps (arrival, first token, last token) and so for every TTFT, ITL and queue
time it reports.

A clock is any zero-argument callable returning seconds (`time.perf_counter` by default). Under simulation the
generator and the workload runner share a `VirtualClock`: the simulated engine advances it by each step's predicted
duration and the runner `sleep`s on it until the next arrival, so every timing is in virtual seconds. The
generator's host-loop profile (`metrics()["time_*"]`) stays on the wall clock: it measures this process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

Clock = Callable[[], float]
wall_clock: Clock = time.perf_counter


class VirtualClock:
    """A clock that moves only when told: `advance(seconds)` (the simulated engine, per step) and `sleep(seconds)`
    (the workload runner, while waiting for the next arrival)."""

    def __init__(self, start: float = 0.0):
        if not math.isfinite(start):
            raise ValueError(f"VirtualClock: start must be a finite number of seconds, got {start}")
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if not seconds >= 0 or not math.isfinite(seconds):
            raise ValueError(f"VirtualClock: cannot advance by {seconds} s; time only moves forward by a finite amount")
        self.t += seconds

    def sleep(self, seconds: float) -> None:
        """Like `time.sleep`: a non-positive duration returns at once."""
        if seconds > 0:
            self.advance(seconds)

    def __repr__(self) -> str:
        return f"VirtualClock(t={self.t:.6f})"
