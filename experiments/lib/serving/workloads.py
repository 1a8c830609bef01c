"""Seeded request workloads for the serving benchmark: random lengths, ShareGPT-like lengths, shared prefixes, and
the lengths and arrival times of a request trace (`trace_workload`; files are read by `traces.read_trace`).

A `Request` is a list of prompt token ids and an exact output length (the benchmark runs it with no stop tokens and
`max_new_tokens = output_len`). Prompt ids are drawn uniformly from the vocabulary minus the tokenizer's special
tokens. Everything is a pure function of the arguments and `seed` (and of the trace file).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable

import numpy as np

from experiments.lib.serving.traces import Trace, read_trace

DATASETS = ("random", "sharegpt", "prefix")
EXPERIMENTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # experiments/
SHAREGPT_LIKE_PATH = os.path.join(EXPERIMENTS, "data", "sharegpt_like_lengths.json")


@dataclasses.dataclass
class Request:
    index: int
    prompt_ids: list[int]
    output_len: int
    prefix_id: int | None = None  # prefix workload: which shared prefix the prompt starts with
    priority: int = 0  # scheduling priority (higher first), for the `priority` policy
    deadline: float | None = None  # seconds after arrival (from a trace's deadline_s)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclasses.dataclass
class Workload:
    name: str
    requests: list[Request]
    params: dict
    prefixes: list[list[int]] = dataclasses.field(default_factory=list)
    num_clipped: int = 0  # sharegpt, trace: pairs shortened to fit max_seq_len

    def describe(self) -> dict:
        """JSON-able summary: parameters and input/output length statistics."""
        def st(xs: list[int]) -> dict:
            a = np.asarray(xs, dtype=np.float64)
            return {"total": int(a.sum()), "mean": float(a.mean()), "median": float(np.median(a)),
                    "min": int(a.min()), "max": int(a.max())}

        return {"dataset": self.name, **self.params, "num_requests": len(self.requests),
                "input_len": st([r.prompt_len for r in self.requests]),
                "output_len": st([r.output_len for r in self.requests]),
                "num_prefixes_used": len({r.prefix_id for r in self.requests if r.prefix_id is not None}),
                "num_clipped": self.num_clipped}


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive integer bounds of [length * (1 - r), length * (1 + r)], at least 1."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.ceil(length * (1.0 - range_ratio) - 1e-9))
    hi = max(lo, math.floor(length * (1.0 + range_ratio) + 1e-9))
    return lo, hi


def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> np.ndarray:
    """`n` lengths uniform over the integers of [length * (1 - r), length * (1 + r)]."""
    lo, hi = length_bounds(length, range_ratio)
    return rng.integers(lo, hi + 1, size=n)


def allowed_token_ids(vocab_size: int, special_ids: Iterable[int] = ()) -> np.ndarray:
    special = {int(t) for t in special_ids}
    ids = np.asarray([t for t in range(vocab_size) if t not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("no non-special token ids in the vocabulary")
    return ids


def _tokens(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    return [int(t) for t in allowed[rng.integers(0, allowed.size, size=n)]]


def _check_fits(what: str, max_prompt: int, max_output: int, max_seq_len: int | None) -> None:
    if max_seq_len is not None and max_prompt + max_output > max_seq_len:
        raise ValueError(
            f"{what}: the longest request ({max_prompt} prompt + {max_output} output tokens) exceeds "
            f"max_seq_len={max_seq_len}; lower the lengths / range_ratio or raise --max_seq_len")


def random_workload(num_prompts: int, input_len: int, output_len: int, *, vocab_size: int, range_ratio: float = 0.0,
                    special_ids: Iterable[int] = (), seed: int = 0, max_seq_len: int | None = None) -> Workload:
    """Random prompts: lengths uniform within +-range_ratio of input_len / output_len, ids uniform over the
    non-special vocabulary."""
    _check_fits("random workload", length_bounds(input_len, range_ratio)[1], length_bounds(output_len, range_ratio)[1],
                max_seq_len)
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(vocab_size, special_ids)
    ins = sample_lengths(rng, input_len, range_ratio, num_prompts)
    outs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    reqs = [Request(i, _tokens(rng, allowed, int(n)), int(o)) for i, (n, o) in enumerate(zip(ins, outs))]
    return Workload("random", reqs, dict(input_len=input_len, output_len=output_len, range_ratio=range_ratio,
                                         seed=seed))


def prefix_workload(num_prompts: int, num_prefixes: int, prefix_len: int, input_len: int, output_len: int, *,
                    vocab_size: int, range_ratio: float = 0.0, special_ids: Iterable[int] = (), seed: int = 0,
                    max_seq_len: int | None = None) -> Workload:
    """`num_prefixes` random shared prefixes of `prefix_len` tokens; request i = one prefix (each prefix used
    equally often, in a seeded shuffled order) + a random suffix of ~input_len tokens."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError(f"prefix workload needs num_prefixes >= 1 and prefix_len >= 1, got {num_prefixes}, "
                         f"{prefix_len}")
    _check_fits("prefix workload", prefix_len + length_bounds(input_len, range_ratio)[1],
                length_bounds(output_len, range_ratio)[1], max_seq_len)
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(vocab_size, special_ids)
    prefixes = [_tokens(rng, allowed, prefix_len) for _ in range(num_prefixes)]
    which = rng.permutation(np.arange(num_prompts) % num_prefixes)
    ins = sample_lengths(rng, input_len, range_ratio, num_prompts)
    outs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    reqs = [Request(i, prefixes[int(p)] + _tokens(rng, allowed, int(n)), int(o), prefix_id=int(p))
            for i, (p, n, o) in enumerate(zip(which, ins, outs))]
    return Workload("prefix", reqs, dict(num_prefixes=num_prefixes, prefix_len=prefix_len, input_len=input_len,
                                         output_len=output_len, range_ratio=range_ratio, seed=seed),
                    prefixes=prefixes)


def load_length_pairs(path: str = SHAREGPT_LIKE_PATH) -> list[tuple[int, int]]:
    """(input, output) length pairs from a JSON file: {"pairs": [[in, out], ...]} or a bare list of pairs."""
    with open(path) as f:
        doc = json.load(f)
    pairs = doc["pairs"] if isinstance(doc, dict) else doc
    out = [(int(a), int(b)) for a, b in pairs]
    if not out or any(a < 1 or b < 1 for a, b in out):
        raise ValueError(f"{path}: expected a non-empty list of positive (input, output) length pairs")
    return out


def clip_pair(input_len: int, output_len: int, max_seq_len: int) -> tuple[int, int]:
    """Shorten a pair to fit `max_seq_len` (input + output <= max_seq_len): the output keeps up to half the budget
    when both are long, a short side is never cut."""
    if input_len + output_len <= max_seq_len:
        return input_len, output_len
    i = min(input_len, max_seq_len - min(output_len, max(1, max_seq_len // 2)))
    o = min(output_len, max_seq_len - i)
    return max(1, i), max(1, o)


def sharegpt_workload(num_prompts: int, *, vocab_size: int, special_ids: Iterable[int] = (), seed: int = 0,
                      max_seq_len: int | None = None, path: str = SHAREGPT_LIKE_PATH) -> Workload:
    """Length pairs sampled from a ShareGPT-like file (without replacement while it lasts), clipped to
    max_seq_len; prompts are random ids of those lengths."""
    pairs = load_length_pairs(path)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pairs))
    if num_prompts > len(pairs):
        order = np.concatenate([order, rng.integers(0, len(pairs), size=num_prompts - len(pairs))])
    allowed = allowed_token_ids(vocab_size, special_ids)
    reqs, clipped = [], 0
    for i, k in enumerate(order[:num_prompts]):
        a, b = pairs[int(k)]
        if max_seq_len is not None:
            a2, b2 = clip_pair(a, b, max_seq_len)
            clipped += (a2, b2) != (a, b)
            a, b = a2, b2
        reqs.append(Request(i, _tokens(rng, allowed, a), b))
    return Workload("sharegpt", reqs, dict(path=os.path.relpath(path) if os.path.isabs(path) else path,
                                           seed=seed, max_seq_len=max_seq_len), num_clipped=clipped)


def trace_workload(trace: Trace, num_prompts: int | None = None, *, vocab_size: int, special_ids: Iterable[int] = (),
                   seed: int = 0, max_seq_len: int | None = None) -> tuple[Workload, np.ndarray]:
    """The first `num_prompts` rows of `trace` (all of them for None, or when the trace has fewer) as requests, and
    their arrival times in seconds (the trace's own, already divided by its speedup; the first is 0).

    Prompts are random non-special ids of each row's length (seeded, as the other workloads); a row longer than
    `max_seq_len` is shortened with `clip_pair` and counted in `num_clipped`. Rows with the same prefix id start with
    the same `prefix_len` tokens: the first row of an id draws them, and a later row with a longer prefix_len extends
    them, so any two rows of an id share min(their prefix_len) tokens (a row without a prefix_len shares none).
    `Request.prefix_id` numbers the distinct ids 0, 1, ... by first appearance (`Workload.prefixes[k]` holds id k's
    tokens); `priority` (0 where the row has none) and `deadline` come from the row."""
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1 (or None: the whole trace), got {num_prompts}")
    rows = trace.rows if num_prompts is None else trace.rows[:num_prompts]
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(vocab_size, special_ids)
    ids: dict[str | int, int] = {}
    prefixes: list[list[int]] = []
    reqs, clipped = [], 0
    for i, row in enumerate(rows):
        a, b = row.prompt_tokens, row.output_tokens
        if max_seq_len is not None:
            a2, b2 = clip_pair(a, b, max_seq_len)
            clipped += (a2, b2) != (a, b)
            a, b = a2, b2
        pid, shared = None, []
        if row.prefix_id is not None:
            pid = ids.setdefault(row.prefix_id, len(ids))
            if pid == len(prefixes):
                prefixes.append([])
            want = min(row.prefix_len or 0, a)
            if want > len(prefixes[pid]):
                prefixes[pid].extend(_tokens(rng, allowed, want - len(prefixes[pid])))
            shared = prefixes[pid][:want]
        reqs.append(Request(i, shared + _tokens(rng, allowed, a - len(shared)), b, prefix_id=pid,
                            priority=row.priority or 0, deadline=row.deadline_s))
    arrivals = np.fromiter((r.arrival_s for r in rows), dtype=np.float64, count=len(rows))
    params = dict(trace_path=os.path.relpath(trace.path) if os.path.isabs(trace.path) else trace.path,
                  trace_format=trace.format, trace_speedup=trace.speedup, num_prompts_requested=num_prompts,
                  trace_rows=len(trace.rows), trace_skipped=trace.num_skipped, trace_was_sorted=trace.was_sorted,
                  mean_rate=mean_rate(arrivals), seed=seed, max_seq_len=max_seq_len)
    return Workload("trace", reqs, params, prefixes=prefixes, num_clipped=clipped), arrivals


def make_workload(dataset: str, num_prompts: int, *, vocab_size: int, special_ids: Iterable[int] = (),
                  seed: int = 0, max_seq_len: int | None = None, input_len: int = 128, output_len: int = 32,
                  range_ratio: float = 0.0, num_prefixes: int = 4, prefix_len: int = 128,
                  dataset_path: str | None = None) -> Workload:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    special_ids = tuple(special_ids)
    if dataset == "random":
        return random_workload(num_prompts, input_len, output_len, vocab_size=vocab_size, range_ratio=range_ratio,
                               special_ids=special_ids, seed=seed, max_seq_len=max_seq_len)
    if dataset == "prefix":
        return prefix_workload(num_prompts, num_prefixes, prefix_len, input_len, output_len, vocab_size=vocab_size,
                               range_ratio=range_ratio, special_ids=special_ids, seed=seed, max_seq_len=max_seq_len)
    if dataset == "sharegpt":
        return sharegpt_workload(num_prompts, vocab_size=vocab_size, special_ids=special_ids, seed=seed,
                                 max_seq_len=max_seq_len, path=dataset_path or SHAREGPT_LIKE_PATH)
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")


# ------------------------------------------------------------------------------------------------ arrivals
def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds from the start at which each of `n` requests arrives. rate = inf: all at 0. Otherwise the first
    request arrives at 0 and the gaps are Gamma(shape=burstiness, scale=1 / (rate * burstiness)): mean 1/rate,
    squared coefficient of variation 1/burstiness (burstiness 1 = Poisson arrivals; < 1 burstier)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng([seed, 1])  # a stream independent of the workload's (same seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


def mean_rate(arrivals) -> float:
    """Requests per second of an arrival schedule: (n - 1) gaps over the span; inf when the span is 0."""
    a = np.asarray(arrivals, dtype=np.float64)
    span = float(a[-1] - a[0]) if a.size else 0.0
    return (a.size - 1) / span if span > 0 else math.inf


def rescale_arrivals(arrivals, rate: float) -> np.ndarray:
    """`arrivals` (non-decreasing seconds) stretched or compressed about the first so that their mean rate, (n - 1)
    gaps over the span, becomes `rate` requests per second (inf: all at the first arrival). The shape of the
    schedule (bursts, lulls) is kept: for a rate sweep over a trace."""
    a = np.asarray(arrivals, dtype=np.float64)
    if a.ndim != 1 or a.size < 2:
        raise ValueError(f"rescaling arrivals needs at least 2 of them in a 1-D array, got shape {a.shape}")
    if not np.isfinite(a).all() or (np.diff(a) < 0).any():
        raise ValueError("arrivals must be finite and non-decreasing")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    span = float(a[-1] - a[0])
    if span <= 0:
        raise ValueError(f"all {a.size} arrivals are at the same time (a zero span): there is no rate to rescale; "
                         "use the arrivals as they are, or arrival_times() for a synthetic schedule")
    if math.isinf(rate):
        return np.full_like(a, a[0])
    return a[0] + (a - a[0]) * (mean_rate(a) / rate)


# ------------------------------------------------------------------------------------------------ scenarios
SCENARIOS = ("poisson", "gamma", "sharegpt", "shared_prompt", "bursty")  # the synthetic ones
TRACE_SCENARIO = "trace"  # make_scenario's trace replay: needs trace_file
ALL_SCENARIOS = (*SCENARIOS, TRACE_SCENARIO)


def bursty_arrivals(n: int, rate: float, burst_size: int = 16, seed: int = 0) -> np.ndarray:
    """Bursts of `burst_size` requests that all arrive at once; burst starts are a Poisson process with rate
    `rate / burst_size`, so the mean request rate is `rate` but the queue sees `burst_size`-deep spikes."""
    if burst_size < 1:
        raise ValueError(f"burst_size must be >= 1, got {burst_size}")
    starts = arrival_times(-(-n // burst_size), rate / burst_size, 1.0, seed)
    return np.repeat(starts, burst_size)[:n]


def make_scenario(name: str, n: int, *, rate: float, vocab_size: int, special_ids: Iterable[int] = (), seed: int = 0,
                  max_seq_len: int | None = None, input_len: int = 256, output_len: int = 64,
                  range_ratio: float = 0.5, burstiness: float = 0.25, prefix_len: int = 512, num_prefixes: int = 1,
                  burst_size: int = 16, priority_levels: int = 1, trace_file: str | None = None,
                  trace_speedup: float = 1.0, trace_format: str = "auto") -> tuple[Workload, np.ndarray]:
    """A workload and its arrival times (seconds), a pure function of the arguments:

    - `poisson`: random prompts of ~input_len and outputs of ~output_len tokens (+-range_ratio), Poisson arrivals;
    - `gamma`: the same requests, gamma inter-arrival times of shape `burstiness` (< 1: burstier than Poisson);
    - `sharegpt`: ShareGPT-like (input, output) length pairs, Poisson arrivals;
    - `shared_prompt`: `num_prefixes` shared system prompts of `prefix_len` tokens + a random ~input_len suffix
      (the prefix cache's case), Poisson arrivals;
    - `bursty`: the `poisson` requests arriving in bursts of `burst_size` at once;
    - `trace`: the first `n` rows of the trace file `trace_file` (`traces.read_trace` with `trace_speedup` and
      `trace_format`; fewer when the trace is shorter) through `trace_workload`, at the trace's own arrival times.
      `rate`, the length arguments and `burstiness` are ignored for a trace (rescale the arrivals with
      `rescale_arrivals` for a rate sweep). A malformed file raises `traces.TraceError` (a ValueError).

    `priority_levels > 1` gives each request a seeded uniform priority in [0, priority_levels) (for `trace`: only
    when no row of the trace has a priority; otherwise the trace's priorities are kept)."""
    if priority_levels < 1:
        raise ValueError(f"priority_levels must be >= 1, got {priority_levels}")
    lengths = dict(vocab_size=vocab_size, special_ids=special_ids, seed=seed, max_seq_len=max_seq_len)
    trace_priorities = False
    if name == TRACE_SCENARIO:
        if not trace_file:
            raise ValueError("the trace workload needs a trace file (trace_file=..., or --trace_file)")
        trace = read_trace(trace_file, speedup=trace_speedup, format=trace_format)
        wl, arrivals = trace_workload(trace, n, **lengths)
        trace_priorities = any(r.priority is not None for r in trace.rows[:n])
    elif name in ("poisson", "gamma", "bursty"):
        wl = random_workload(n, input_len, output_len, range_ratio=range_ratio, **lengths)
    elif name == "sharegpt":
        wl = sharegpt_workload(n, **lengths)
    elif name == "shared_prompt":
        wl = prefix_workload(n, num_prefixes, prefix_len, input_len, output_len, range_ratio=range_ratio, **lengths)
    else:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(ALL_SCENARIOS)}")
    if name == "gamma":
        arrivals = arrival_times(n, rate, burstiness, seed)
    elif name == "bursty":
        arrivals = bursty_arrivals(n, rate, burst_size, seed)
    elif name != TRACE_SCENARIO:
        arrivals = arrival_times(n, rate, 1.0, seed)
    if priority_levels > 1 and not trace_priorities:
        prio = np.random.default_rng([seed, 2]).integers(0, priority_levels, size=len(wl.requests))
        for r, p in zip(wl.requests, prio):
            r.priority = int(p)
    wl.name = name
    if name == TRACE_SCENARIO:
        wl.params.update(scenario=name, rate=wl.params["mean_rate"], rate_argument_ignored=rate, burstiness=None,
                         burst_size=None, priority_levels=None if trace_priorities else priority_levels)
    else:
        wl.params.update(scenario=name, rate=rate, burstiness=burstiness if name == "gamma" else 1.0,
                         burst_size=burst_size if name == "bursty" else None, priority_levels=priority_levels)
    return wl, arrivals
