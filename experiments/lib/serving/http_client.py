"""`bench_serving --backend=openai`: the same workloads and load model as the in-process runner (`runner.py`), sent
to any OpenAI-compatible server's `/v1/completions` as streamed requests, and timed from the streamed chunks, as
vLLM's `benchmark_serving` does.

Load model: request i is sent at its scheduled arrival (`arrival_times`, or a trace's), once fewer than
`max_concurrency` requests are in flight; its `arrival` (the start of its TTFT and E2EL) is when it is sent.

Each request asks for exactly `output_len` tokens (`max_tokens`, and `ignore_eos` unless the extra body says
otherwise), greedy at temperature 0 or sampled with seed `seed + index`, its prompt given as token ids (the
workload's own tokens; `prompt_format="text"` sends their decoded text, which the server re-tokenizes, for servers
that take no ids). Token times, client side, from the run's start: each SSE chunk that carries tokens is stamped when
it is read, and counts as many tokens as its `usage.completion_tokens` grew (`stream_options.continuous_usage_stats`,
which vLLM and this project's server send), else one per chunk with text; tokens the final usage reports beyond
those counted are stamped with the last chunk's time. A chunk of k tokens gives k equal token times, as a decode
burst's tokens share their step's time in the in-process runner, so TTFT, TPOT, ITL and E2EL have the same
definitions over HTTP (metrics.py).

The server's Prometheus page (`/metrics`, when it is this project's server) is read before and after the run, so
the record also carries the prefix-cache and generator counters of the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from experiments.lib.serving.metrics import RequestRecord
from experiments.lib.serving.workloads import Request, arrival_times

# this project's server's Prometheus names -> the generator.metrics() keys the serving records use
PROMETHEUS_KEYS = {
    "paged_prefix_cache_queries_total": "prefix_queries", "paged_prefix_cache_hits_total": "prefix_hits",
    "paged_steps_total": "steps", "paged_tokens_prefilled_total": "tokens_prefilled",
    "paged_tokens_generated_total": "tokens_generated", "paged_jobs_completed_total": "jobs_completed",
    "paged_jobs_failed_total": "jobs_failed", "paged_preemptions_total": "preemptions",
    "paged_pages_total": "pages_total", "paged_pages_used": "pages_used", "paged_pages_cached": "pages_cached",
    "paged_pages_free": "pages_free", "paged_jobs_running": "jobs_active", "paged_jobs_waiting": "jobs_pending",
    "paged_spec_draft_tokens_total": "drafted_tokens", "paged_spec_accepted_tokens_total": "accepted_draft_tokens",
}


@dataclasses.dataclass
class HttpRunResult:
    records: list[RequestRecord]
    duration: float
    max_in_flight: int
    server_before: dict
    server_after: dict


def server_info(base_url: str, timeout: float = 10.0) -> dict:
    """`GET /v1/models`'s first model: `id`, and `max_model_len` where the server reports it (vLLM, this one)."""
    import httpx

    r = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=timeout)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return data[0]


def server_metrics(base_url: str, timeout: float = 10.0) -> dict:
    """The server's `/metrics` as generator.metrics() keys ({} when there is no such page, or no known name)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            key = PROMETHEUS_KEYS.get(s.name)
            if key is not None and not s.labels:
                out[key] = s.value
            elif s.name == "paged_host_loop_seconds_total" and "phase" in s.labels:
                out[f"time_{s.labels['phase']}_s"] = s.value
    return out


def request_body(req: Request, *, model: str, temperature: float, seed: int, prompt_format: str, tokenizer: Any,
                 extra_body: dict, continuous_usage: bool) -> dict:
    if prompt_format == "ids":
        prompt: Any = list(req.prompt_ids)
    else:
        if tokenizer is None:
            raise ValueError("prompt_format='text' needs the model's tokenizer (--model with a tokenizer)")
        prompt = tokenizer.decode(req.prompt_ids)
    body = {"model": model, "prompt": prompt, "max_tokens": req.output_len, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if temperature > 0:
        body["seed"] = seed + req.index
    return {**body, **extra_body}


async def _send(client: Any, url: str, body: dict, rec: RequestRecord, t0: float) -> None:
    """Stream one completion; fill `rec`'s token times, cached tokens, finish reason or error."""
    counted = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = f"stream error: {obj['error'].get('message', obj['error'])}"
                    return
                usage = obj.get("usage") or None
                choices = obj.get("choices") or []
                text = "".join(c.get("text") or "" for c in choices)
                if usage is not None and usage.get("completion_tokens") is not None:
                    k = int(usage["completion_tokens"]) - counted
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = int(details.get("cached_tokens") or 0)
                else:
                    k = 1 if text else 0
                if k > 0 and choices:
                    rec.token_times += [now] * k
                    counted += k
                elif k > 0 and rec.token_times:  # the final usage chunk: tokens no chunk counted
                    rec.token_times += [rec.token_times[-1]] * k
                    counted += k
                for c in choices:
                    if c.get("finish_reason") is not None:
                        rec.eos_reason = c["finish_reason"]
    except Exception as e:  # noqa: BLE001 (recorded per request: a failed request is counted, not fatal)
        rec.error = f"{type(e).__name__}: {e}"
        return
    if rec.eos_reason is None:
        rec.error = "the stream ended without a finish_reason"
    elif rec.output_tokens != rec.target_output_len:
        rec.error = (f"produced {rec.output_tokens} tokens, expected {rec.target_output_len} "
                     f"(finish_reason {rec.eos_reason})")


async def _run(base_url: str, model: str, requests: Sequence[Request], sched: list[float], limit: float,
               body_kw: dict, timeout: float, progress: bool, desc: str) -> tuple[list[RequestRecord], float, int]:
    import httpx

    url = f"{base_url.rstrip('/')}/v1/completions"
    n = len(requests)
    records = [RequestRecord(index=r.index, prompt_len=r.prompt_len, target_output_len=r.output_len,
                             scheduled=sched[i], prefix_id=r.prefix_id, priority=r.priority,
                             deadline=getattr(r, "deadline", None)) for i, r in enumerate(requests)]
    slots = asyncio.Semaphore(int(min(limit, max(n, 1))))
    in_flight = peak = 0
    pbar = None
    if progress:
        from tqdm import tqdm

        pbar = tqdm(total=n, desc=desc, unit="req", file=sys.stderr, leave=False)
    connections = int(min(limit, max(n, 1)))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            nonlocal in_flight, peak
            wait = sched[i] - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            async with slots:
                rec = records[i]
                rec.arrival = rec.enqueued = time.perf_counter() - t0
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    await _send(client, url, request_body(requests[i], model=model, **body_kw), rec, t0)
                finally:
                    in_flight -= 1
                    if pbar is not None:
                        pbar.update(1)

        try:
            await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            if pbar is not None:
                pbar.close()
        ends = [r.token_times[-1] for r in records if r.token_times]
        duration = max(ends) if ends else time.perf_counter() - t0
    return records, duration, peak


def run_http_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[Request],
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    arrivals: Sequence[float] | None = None,
    temperature: float = 0.0,
    prompt_format: str = "ids",
    tokenizer: Any = None,
    extra_body: dict | None = None,
    continuous_usage: bool = True,
    timeout: float = 600.0,
    progress: bool = False,
    desc: str = "requests",
) -> HttpRunResult:
    """Run `requests` against the server at `base_url` (module docstring); per-request records as the in-process
    runner's, the run's duration (start to the last token) and the most requests in flight."""
    if prompt_format not in ("ids", "text"):
        raise ValueError(f"prompt_format must be 'ids' or 'text', got {prompt_format!r}")
    n = len(requests)
    sched = [float(a) for a in (arrival_times(n, request_rate, burstiness, seed) if arrivals is None else arrivals)]
    if len(sched) != n or any(b < a for a, b in zip(sched[:-1], sched[1:])):
        raise ValueError("arrivals must be one non-decreasing time per request")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (or None for no limit), got {max_concurrency}")
    limit = math.inf if max_concurrency is None else max_concurrency
    body_kw = dict(temperature=temperature, seed=seed, prompt_format=prompt_format, tokenizer=tokenizer,
                   extra_body={"ignore_eos": True} if extra_body is None else extra_body,
                   continuous_usage=continuous_usage)
    before = server_metrics(base_url)
    records, duration, peak = asyncio.run(_run(base_url, model, requests, sched, limit, body_kw, timeout,
                                               progress, desc))
    after = server_metrics(base_url)
    return HttpRunResult(records=records, duration=max(duration, 1e-9), max_in_flight=peak, server_before=before,
                         server_after=after)
