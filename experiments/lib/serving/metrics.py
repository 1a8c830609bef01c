"""Serving metrics from per-request records, with vLLM `benchmark_serving`'s definitions.

Per request (times in seconds from the benchmark start, taken in the host loop when a step's results come back):
- TTFT = first token time - arrival;
- E2EL = last token time - arrival;
- TPOT = (E2EL - TTFT) / (output tokens - 1), only for requests with more than one output token;
- ITL  = the gaps between successive deliveries of a request's tokens, pooled over all requests: tokens that arrive
  together (a decode burst's, one streamed chunk's) are one delivery, as vLLM counts one gap per streamed chunk;
- queue time = the start of the request's first engine step - its enqueue, on the generator's clock (a preempted
  request's later waits are not counted).
`arrival` is when the request is sent: its scheduled arrival, or, when `max_concurrency` held it back, the moment
a slot freed (vLLM starts its clock after the concurrency semaphore is acquired).

Summaries are in milliseconds: mean, median, std (population), p90, p99 (numpy's linear-interpolated percentiles).
Throughputs divide by the benchmark duration. Goodput counts the requests that meet every SLO (a one-token request
has TPOT 0 for this purpose, as in vLLM); SLO attainment is their fraction of all requests (failed ones included).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass
class RequestRecord:
    index: int
    prompt_len: int
    target_output_len: int
    scheduled: float = 0.0  # scheduled arrival (s from the start)
    arrival: float = 0.0  # when the request was sent (>= scheduled; later when the concurrency limit held it)
    enqueued: float | None = None  # when the host loop called enqueue() (>= arrival)
    token_times: list[float] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    eos_reason: str | None = None
    prefix_id: int | None = None
    priority: int = 0  # the request's scheduling priority (the `priority` policy's classes)
    deadline: float | None = None  # its deadline, s after arrival (the `deadline` flag or the trace's), or None
    error: str = ""
    preemptions: int = 0  # times the scheduling policy preempted it (final result's `preemptions`)
    queue_time: float | None = None  # enqueue -> the start of its first step, on the generator's clock (the final
    # result's `time_enqueued`)

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def success(self) -> bool:
        return not self.error and self.output_tokens > 0 and self.eos_reason is not None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        """One gap per delivery after the first (`token_times` repeats a time for tokens that came together)."""
        t = self.token_times
        return [b - a for a, b in zip(t[:-1], t[1:]) if b != a]


def parse_slo(spec: str | None) -> dict[str, float]:
    """'ttft:2000,tpot:100,e2el:30000' (milliseconds) -> {'ttft': 2000.0, ...}. Empty / None -> {}."""
    if spec is None or not spec.strip():
        return {}
    out: dict[str, float] = {}
    for part in spec.split(","):
        part = part.strip()
        key, sep, val = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO entry {part!r} in {spec!r}: expected comma-separated name:milliseconds with "
                             f"names from {', '.join(SLO_KEYS)}, e.g. 'ttft:2000,tpot:100,e2el:30000'")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"bad SLO value {val.strip()!r} for {key} in {spec!r}: expected a number of "
                             "milliseconds") from None
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"SLO {key} must be a positive number of milliseconds, got {val.strip()!r}")
        if key in out:
            raise ValueError(f"SLO {key} given twice in {spec!r}")
        out[key] = ms
    return out


def summarize_ms(values_s: Sequence[float]) -> dict:
    """mean / median / std / p90 / p99 of `values_s` (seconds) in milliseconds; None values when empty."""
    keys = ("mean", "median", "std", "p90", "p99")
    if len(values_s) == 0:
        return {k: None for k in keys} | {"count": 0}
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)), "count": int(a.size)}


def latencies(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Raw latency samples (seconds) of the successful requests: ttft, tpot (>1 token only), itl (pooled), e2el."""
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itls],
        "e2el": [r.e2el for r in ok],
    }


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    vals = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return all(vals[k] * 1e3 <= v for k, v in slo.items())


def compute_metrics(records: Sequence[RequestRecord], duration: float, slo: dict[str, float] | None = None) -> dict:
    """Aggregate metrics of one run. `duration`: seconds from the benchmark start to the last result."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in records if r.success]
    lat = latencies(records)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "slo_ms": dict(slo or {}),
        "goodput": None,
        "good_requests": None,
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in ok)
        out["good_requests"] = good
        out["goodput"] = good / duration
    for name in LATENCIES:
        out[f"{name}_ms"] = summarize_ms(lat[name])
    out["send_delay_ms"] = summarize_ms([r.arrival - r.scheduled for r in ok])  # held by max_concurrency
    out["enqueue_lag_ms"] = summarize_ms([r.enqueued - r.arrival for r in ok if r.enqueued is not None])
    out["queue_ms"] = summarize_ms([r.queue_time for r in ok if r.queue_time is not None])
    out["slo_attainment"] = out["good_requests"] / len(records) if slo and records else None
    prompt = sum(r.prompt_len for r in ok)
    out["cached_tokens"] = sum(r.cached_tokens for r in ok)
    out["cached_token_fraction"] = out["cached_tokens"] / prompt if prompt else 0.0
    return out


def prefix_cache_stats(before: dict, after: dict, records: Sequence[RequestRecord]) -> dict:
    """Prefix-cache hit rate over the run: the delta of the page pool's counters, and cached / prompt tokens."""
    q = after.get("prefix_queries", 0) - before.get("prefix_queries", 0)
    h = after.get("prefix_hits", 0) - before.get("prefix_hits", 0)
    ok = [r for r in records if r.success]
    prompt = sum(r.prompt_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {"prefix_queries": q, "prefix_hits": h, "page_hit_rate": h / q if q else 0.0,
            "cached_tokens": cached, "prompt_tokens": prompt, "token_hit_rate": cached / prompt if prompt else 0.0}


def metrics_delta(before: dict, after: dict) -> dict:
    """after - before for every numeric key present in both (counters; gauges such as pages_used are meaningful
    only in `after`)."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(b, (int, float)):
            out[k] = v - b
    return out


def _fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def format_table(m: dict, title: str = "Serving Benchmark Result", extra: Sequence[tuple[str, str]] = ()) -> str:
    """A vLLM-style plain-text summary of `compute_metrics` output (plus `extra` (label, value) lines)."""
    w = 50
    lines = [f" {title} ".center(w, "=")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<40}{value:>10}")

    row("Successful requests:", str(m["completed"]))
    if m["failed"]:
        row("Failed requests:", str(m["failed"]))
    row("Benchmark duration (s):", _fmt(m["duration_s"]))
    row("Total input tokens:", str(m["total_input_tokens"]))
    row("Total generated tokens:", str(m["total_output_tokens"]))
    row("Request throughput (req/s):", _fmt(m["request_throughput"]))
    if m.get("goodput") is not None:
        row("Request goodput (req/s):", _fmt(m["goodput"]))
    row("Output token throughput (tok/s):", _fmt(m["output_throughput"]))
    row("Total token throughput (tok/s):", _fmt(m["total_token_throughput"]))
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in LATENCIES:
        s = m[f"{name}_ms"]
        lines.append(titles[name].center(w, "-"))
        short = name.upper()
        for stat in ("mean", "median", "std", "p90", "p99"):
            label = {"mean": "Mean", "median": "Median", "std": "Std", "p90": "P90", "p99": "P99"}[stat]
            row(f"{label} {short} (ms):", _fmt(s[stat]))
    if extra:
        lines.append("".center(w, "-"))
        for label, value in extra:
            row(label, value)
    lines.append("=" * w)
    return "\n".join(lines)
