"""Timing decode steps through the generator, and splitting their wall time with the generator's and the engine's
timers (`DynamicGenerator.metrics()["time_*"]`). Shared by `experiments.profile_step` and `experiments.bench_e2e`.

The protocol: `prefill(gen, jobs)` enqueues the jobs and steps until every one has sampled its first token (not
timed; the jobs prefilled first decode meanwhile, so their contexts differ by up to the number of prefill steps),
then `time_decode(gen, steps)` runs at least `steps` decode steps with every job decoding and returns a
`DecodeWindow`: wall seconds, the timers' increments, and each row's cached tokens before the first step. A decode
burst (`decode_steps` > 1) counts as that many steps.
"""

from __future__ import annotations

import dataclasses
import time

# the timers that split a step, by the name a record gives them (ms per step) -> the generator's metrics key
TIMERS = {"schedule_ms": "time_schedule_s", "build_ms": "time_engine_build_s",
          "dispatch_ms": "time_engine_dispatch_s", "device_wait_ms": "time_engine_wait_s",
          "results_ms": "time_results_s"}


@dataclasses.dataclass(frozen=True)
class DecodeWindow:
    """Decode steps timed through the generator: `steps` steps (a burst of k counts k) in `calls` `iterate()`s over
    `rows` rows, `tokens` generated in `seconds`; `timers`: the increments of the `time_*` metrics (seconds);
    `kv_positions`: each row's cached tokens before the window's first step (the first step reads one more)."""

    rows: int
    steps: int
    calls: int
    tokens: int
    seconds: float
    timers: dict[str, float]
    kv_positions: tuple[int, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps

    def split_ms(self) -> dict[str, float]:
        """Milliseconds per step: each of `TIMERS`, and the step's wall time in three parts that add up to it:
        `host_ms` (scheduling, building the batch, turning samples into results, and whatever no timer covers),
        `launch_ms` (dispatching the jitted call) and `device_ms` (waiting for its results: the device's time not
        hidden behind the launch, plus the copy of the results to the host)."""
        out = {name: 1e3 * self.timers[key] / self.steps for name, key in TIMERS.items()}
        out["launch_ms"] = out["dispatch_ms"]
        out["device_ms"] = out["device_wait_ms"]
        out["host_ms"] = self.ms_per_step - out["launch_ms"] - out["device_ms"]
        return out


def prefill(gen, jobs: list) -> None:
    """Enqueue `jobs` on `gen` and step until none waits and every active job has sampled a token."""
    gen.enqueue(jobs)
    while gen.pending or any(j.new_tokens == 0 for j in gen.active):
        gen.iterate()


def time_decode(gen, steps: int) -> DecodeWindow:
    """Step `gen`, whose active jobs all decode, until at least `steps` decode steps have run (the last burst may
    go past it); RuntimeError if a job ended or waited inside the window (give the jobs more max_new_tokens)."""
    rows = len(gen.active)
    positions = tuple(j.kv_position for j in gen.active)
    m0 = gen.metrics()
    s0, calls = gen.steps, 0
    t0 = time.perf_counter()
    while gen.steps - s0 < steps:
        gen.iterate()
        calls += 1
    seconds = time.perf_counter() - t0
    m1 = gen.metrics()
    done = gen.steps - s0
    tokens = m1["tokens_generated"] - m0["tokens_generated"]
    if tokens != rows * done or len(gen.active) != rows:
        raise RuntimeError(f"{tokens} tokens in {done} steps of {rows} rows: a job ended or waited inside the "
                           "timed window (give the jobs more max_new_tokens)")
    timers = {k: m1[k] - m0[k] for k in TIMERS.values()}
    return DecodeWindow(rows=rows, steps=done, calls=calls, tokens=tokens, seconds=seconds, timers=timers,
                        kv_positions=positions)
