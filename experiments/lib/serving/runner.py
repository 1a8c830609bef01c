"""The benchmark host loop: feed requests to a `DynamicGenerator`-like object on an arrival schedule, with at most
`max_concurrency` in flight, and timestamp every streamed token.

Load model (vLLM semantics): requests arrive at `arrival_times(...)` (rate inf: all at t=0); a request is sent once
it has arrived and fewer than `max_concurrency` requests are in flight (None: no limit). The loop enqueues every
sendable request between two `iterate()` calls, runs one step, timestamps the step's streamed tokens, and, when the
generator is empty and the next arrival is in the future, sleeps until it. Closed loop = `max_concurrency` N with
rate inf; open loop = a finite rate and no limit; both together are allowed.

The generator only needs DynamicGenerator's interface: `enqueue(Job)`, `iterate()`, `metrics()`, `active`,
`pending`, `engine.run` (wrapped by `EngineProbe` to see each step's rows) and, for `warm_up`, `pool.reset_cache()`.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from experiments.lib.serving.metrics import RequestRecord
from experiments.lib.serving.workloads import Request, arrival_times


class StepRecord(NamedTuple):
    """One engine call (a named tuple: cheaper to make, hold and traverse than a dataclass instance)."""

    rows: tuple[tuple[int, int, bool], ...]  # (start_pos, tokens, samples) per row
    num_steps: int
    seconds: float  # the engine's own timing (StepOutput.seconds: device step + host copy of the results)
    wall: float  # the whole engine.run call (batch building included)


class EngineProbe:
    """Context manager that wraps `engine.run` (an instance attribute shadowing the method) to record each step's
    rows and timing; restores the engine on exit."""

    def __init__(self, engine, clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.clock = clock
        self.steps: list[StepRecord] = []
        self._had_attr = False
        self._saved = None

    def __enter__(self) -> EngineProbe:
        self._had_attr = "run" in vars(self.engine)
        self._saved = vars(self.engine).get("run")
        orig = self.engine.run

        def run(rows, *args, **kwargs):
            t0 = self.clock()
            out = orig(rows, *args, **kwargs)
            wall = self.clock() - t0
            # (a tuple of tuples of numbers: the garbage collector stops tracking it, where it would traverse a
            # run's millions of rows at every full collection; the scheduler's rows hold an int and a bool)
            self.steps.append(StepRecord._make((tuple([(r.start_pos, len(r.tokens), r.sample) for r in rows]),
                                                int(kwargs.get("num_steps", 1)),
                                                float(getattr(out, "seconds", 0.0) or 0.0), wall)))
            return out

        self.engine.run = run
        return self

    def __exit__(self, *exc) -> None:
        if self._had_attr:
            self.engine.run = self._saved
        else:
            del self.engine.run

    def summary(self, duration: float | None = None) -> dict:
        steps = self.steps
        num_rows = decode = tokens = processed = max_rows = 0
        for s in steps:  # (one pass: a run may have millions of rows)
            rows = s.rows
            n = len(rows)
            num_rows += n
            if n > max_rows:
                max_rows = n
            step_tokens = 0
            for _, t, sample in rows:
                step_tokens += t
                decode += t == 1 and sample
            tokens += step_tokens
            processed += step_tokens * s.num_steps if s.num_steps > 1 else step_tokens
        out = {
            "steps": len(steps),
            "engine_seconds": sum(s.seconds for s in steps),
            "engine_call_seconds": sum(s.wall for s in steps),
            "mean_rows_per_step": num_rows / len(steps) if steps else 0.0,
            "max_rows_per_step": max_rows,
            # by the rows' shapes, what a step costs: a row of one sampled token is a decode row (a prompt's last
            # chunk of one token too); generator.metrics()["tokens_prefilled"] counts prompt tokens exactly
            "decode_rows": decode,
            "prefill_tokens": tokens - decode,  # (the decode rows' one token each)
            "tokens_processed": processed,
        }
        if duration is not None:
            out["host_seconds_outside_engine"] = duration - out["engine_call_seconds"]
        return out


@dataclasses.dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float
    steps: list[StepRecord]
    step_summary: dict
    trace: list[tuple[float, int, int, int]]  # (t, generator.active, generator.pending, requests in flight)
    metrics_before: dict
    metrics_after: dict
    page_use: list[float] = dataclasses.field(default_factory=list)  # pages referenced / usable, after each step

    @property
    def mean_page_utilisation(self) -> float | None:
        return sum(self.page_use) / len(self.page_use) if self.page_use else None

    @property
    def max_in_flight(self) -> int:
        return max((t[3] for t in self.trace), default=0)

    @property
    def max_generator_jobs(self) -> int:
        return max((t[1] + t[2] for t in self.trace), default=0)


FREEZE_EVERY = 2048  # run_benchmark: iterations between two gc.freeze() calls


def _limit(max_concurrency: int | None) -> float:
    if max_concurrency is None:
        return math.inf
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (or None for no limit), got {max_concurrency}")
    return max_concurrency


def run_benchmark(
    generator,
    requests: Sequence[Request],
    *,
    gen_settings=None,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    arrivals: Sequence[float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    progress: bool = False,
    desc: str = "requests",
    max_stalls: int = 1000,
    deadline: float | None = None,
    oracle_lengths: bool = False,
) -> RunResult:
    """Run `requests` through `generator`; returns per-request records with token timestamps.

    Each request becomes `Job(prompt_ids, output_len, gen_settings=..., seed=seed + index, priority=req.priority)`
    with no stop conditions, so it produces exactly `output_len` tokens; `deadline` (seconds after arrival) is given
    to every job whose request has none of its own (`Request.deadline`, from a trace), and with `oracle_lengths` the
    job's `expected_new_tokens` is its true output length (for `sjf`). `arrivals` overrides the generated schedule.
    Under simulation pass the virtual clock's `clock` and `sleep`."""
    from paged.job import Job
    from paged.settings import SamplingSettings

    if gen_settings is None:
        gen_settings = SamplingSettings.greedy()
    n = len(requests)
    sched = [float(a) for a in (arrival_times(n, request_rate, burstiness, seed) if arrivals is None else arrivals)]
    if len(sched) != n or any(b < a for a, b in zip(sched[:-1], sched[1:])):
        raise ValueError("arrivals must be one non-decreasing time per request")
    limit = _limit(max_concurrency)
    free_slots: list[float] = [0.0] * int(min(limit, n))  # times at which free slots became free
    heapq.heapify(free_slots)
    records: list[RequestRecord] = []
    in_flight: dict[int, RequestRecord] = {}
    trace: list[tuple[float, int, int, int]] = []
    page_use: list[float] = []
    pool = getattr(generator, "pool", None)
    pbar = None
    if progress:
        from tqdm import tqdm

        pbar = tqdm(total=n, desc=desc, unit="req", file=sys.stderr, leave=False)
    metrics_before = dict(generator.metrics())
    next_i = done = stalls = 0
    # The run's own records (token times, steps, the trace: tens of millions of objects over 100,000 requests) leave
    # the garbage collector's view as they pile up (`gc.freeze()` every FREEZE_EVERY iterations, undone at the end),
    # instead of being traversed again at every full collection, a tenth of a long simulated run's time.
    freeze = gc.isenabled() and not gc.get_freeze_count()
    iterations = 0
    t0 = clock()
    try:
        with EngineProbe(generator.engine, clock) as probe:
            while done < n:
                iterations += 1
                if freeze and not iterations % FREEZE_EVERY:
                    gc.freeze()
                now = clock() - t0
                sent = False
                while next_i < n and sched[next_i] <= now and len(in_flight) < limit:
                    req = requests[next_i]
                    slot = heapq.heappop(free_slots)
                    due = deadline if getattr(req, "deadline", None) is None else req.deadline
                    rec = RequestRecord(index=req.index, prompt_len=req.prompt_len, target_output_len=req.output_len,
                                        scheduled=sched[next_i], arrival=max(sched[next_i], slot), enqueued=now,
                                        prefix_id=req.prefix_id, priority=req.priority, deadline=due)
                    job = Job(req.prompt_ids, req.output_len, gen_settings=gen_settings, seed=seed + req.index,
                              identifier=("bench_serving", req.index), priority=req.priority, deadline=due,
                              expected_new_tokens=req.output_len if oracle_lengths else None)
                    generator.enqueue(job)
                    in_flight[id(job)] = rec
                    records.append(rec)
                    next_i += 1
                    sent = True
                if sent:
                    trace.append((now, len(generator.active), len(generator.pending), len(in_flight)))
                if not in_flight:  # idle: wait for the next arrival
                    wait = sched[next_i] - (clock() - t0)
                    if wait > 0:
                        sleep(wait)
                    continue
                results = generator.iterate()
                now = clock() - t0
                if pool is not None:
                    page_use.append(pool.num_referenced / pool.num_pages)
                for r in results:
                    rec = in_flight.get(id(r["job"]))
                    if rec is None:
                        continue  # someone else's job
                    if r["stage"] == "streaming":
                        rec.token_times.append(now)
                    if r["eos"]:
                        rec.cached_tokens = int(r.get("cached_tokens", 0))
                        rec.eos_reason = r.get("eos_reason")
                        rec.preemptions = int(r.get("preemptions", 0))
                        rec.queue_time = r.get("time_enqueued")
                        if rec.output_tokens != rec.target_output_len:
                            rec.error = (f"produced {rec.output_tokens} tokens, expected {rec.target_output_len} "
                                         f"({rec.eos_reason})")
                        del in_flight[id(r["job"])]
                        heapq.heappush(free_slots, now)
                        done += 1
                        if pbar is not None:
                            pbar.update(1)
                trace.append((now, len(generator.active), len(generator.pending), len(in_flight)))
                stalls = 0 if results else stalls + 1
                if stalls > max_stalls:
                    policy = getattr(generator, "policy", None)
                    raise RuntimeError(
                        f"generator made no progress for {max_stalls} iterations with {len(in_flight)} requests in "
                        f"flight ({len(generator.pending)} waiting, {len(generator.active)} running) under policy "
                        f"{policy!r} ({type(policy).__module__}.{type(policy).__qualname__}): its admit() started no "
                        f"waiting job while none was running, or the jobs it started produced nothing")
            duration = clock() - t0
    finally:
        if freeze:
            gc.unfreeze()
        if pbar is not None:
            pbar.close()
    metrics_after = dict(generator.metrics())
    return RunResult(records=records, duration=duration, steps=probe.steps, step_summary=probe.summary(duration),
                     trace=trace, metrics_before=metrics_before, metrics_after=metrics_after, page_use=page_use)


def warm_up(generator, requests: Sequence[Request], *, gen_settings=None, max_concurrency: int | None = None,
            seed: int = 0) -> float:
    """Run `requests` unmeasured (closed loop), then forget the prompt cache so the measured run starts cold.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    if requests:
        run_benchmark(generator, requests, gen_settings=gen_settings, max_concurrency=max_concurrency, seed=seed)
    generator.pool.reset_cache()
    return time.perf_counter() - t0
