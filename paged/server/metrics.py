"""The server's Prometheus metrics (`GET /metrics`, text format), in a registry of its own per app.

Read from the generator at scrape time (`generator.metrics()`, without waiting for the step under way): jobs
waiting and running, pages total / used / cached / free, prefix-cache queries and hits, preemptions, steps, tokens
prefilled and generated, failed jobs and steps, speculative drafts, accepted drafts, acceptance rate and mean
accepted length. Kept by the server per request: time to first token, time per output token and end-to-end latency
histograms, prompt and generated token counters, requests by endpoint and outcome, choices by finish reason, open
streams, and the jobs running in each step. Names start with `paged_`; docs/server.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from paged.host.generator import DynamicGenerator

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0)
JOB_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# generator.metrics() key -> (metric name, help); gauges, then counters
_GAUGES = {
    "jobs_pending": ("paged_jobs_waiting", "Jobs waiting for admission"),
    "jobs_active": ("paged_jobs_running", "Jobs admitted and running"),
    "pages_total": ("paged_pages_total", "KV-cache pages jobs can use (the reserved null page excluded)"),
    "pages_used": ("paged_pages_used", "Pages referenced by running jobs"),
    "pages_cached": ("paged_pages_cached", "Pages kept as prompt cache"),
    "pages_free": ("paged_pages_free", "Free pages"),
    "acceptance_rate": ("paged_spec_acceptance_rate", "Speculative decoding: accepted / drafted tokens"),
    "mean_accepted_length": ("paged_spec_mean_accepted_length",
                             "Speculative decoding: tokens emitted per verification row"),
}
_COUNTERS = {
    "prefix_queries": ("paged_prefix_cache_queries", "Full prompt pages looked up in the prefix cache"),
    "prefix_hits": ("paged_prefix_cache_hits", "Full prompt pages found in the prefix cache"),
    "preemptions": ("paged_preemptions", "Jobs preempted by the scheduling policy"),
    "steps": ("paged_steps", "Engine steps"),
    "tokens_prefilled": ("paged_tokens_prefilled", "Prompt tokens run through the model (cache hits excluded)"),
    "tokens_generated": ("paged_tokens_generated", "Tokens sampled"),
    "jobs_completed": ("paged_jobs_completed", "Jobs finished"),
    "jobs_failed": ("paged_jobs_failed", "Jobs that ended with an error of their own"),
    "steps_failed": ("paged_steps_failed", "Steps that failed as a whole"),
    "drafted_tokens": ("paged_spec_draft_tokens", "Speculative decoding: draft tokens verified"),
    "accepted_draft_tokens": ("paged_spec_accepted_tokens", "Speculative decoding: draft tokens accepted"),
}


class _GeneratorCollector:
    def __init__(self, generator: DynamicGenerator, open_streams: Callable[[], int]):
        self.generator = generator
        self.open_streams = open_streams

    def collect(self):
        m = self.generator.metrics()  # without the lock (held for a whole step): counters read between two updates
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(m.get(key, 0) or 0))
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(m.get(key, 0) or 0))
        yield GaugeMetricFamily("paged_requests_open", "HTTP requests with jobs waiting or running",
                                value=float(self.open_streams()))
        host = CounterMetricFamily("paged_host_loop_seconds", "The host loop's cumulative seconds by phase "
                                   "(generator.metrics()'s time_*: schedule, engine, results, and the engine call's "
                                   "engine_build, engine_dispatch, engine_wait)", labels=["phase"])
        for key, value in m.items():
            if key.startswith("time_") and key.endswith("_s"):
                host.add_metric([key[5:-2]], float(value))
        yield host


class ServerMetrics:
    def __init__(self, generator: DynamicGenerator, open_streams: Callable[[], int]):
        disable_created_metrics()  # (process-wide) no `*_created` series: they double the page and say little
        self.generator = generator
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("paged_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("paged_time_per_output_token_seconds", "(last token - first token) / (tokens - 1), "
                              "per choice of more than one token", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("paged_e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("paged_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("paged_generation_tokens", "Tokens generated for requests", registry=r)
        self.requests = Counter("paged_requests", "Requests by endpoint and outcome (cancelled, rejected, error, "
                                "else the first of content_filter, length, stop that one of its choices ended with)",
                                ["endpoint", "outcome"], registry=r)
        self.choices = Counter("paged_choices", "Choices (one per job: a request's n times its prompts) of requests "
                               "that were not rejected, by endpoint and finish reason (stop, length, content_filter, "
                               "error; all cancelled or error when the request was)", ["endpoint", "finish_reason"],
                               registry=r)
        self.step_jobs = Histogram("paged_step_running_jobs", "Jobs running after each engine step",
                                   buckets=JOB_BUCKETS, registry=r)
        r.register(_GeneratorCollector(generator, open_streams))

    def observe_step(self, results: list[dict]) -> None:
        running = len(self.generator.active) + sum(1 for x in results if x["eos"])
        if running:
            self.step_jobs.observe(running)

    def render(self) -> bytes:
        return generate_latest(self.registry)
