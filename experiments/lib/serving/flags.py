"""Workload and output flags shared by `bench_serving` and `compare_policies` (absl flags live in one process-wide
registry, so a flag both scripts need is defined once, here; `define()` is idempotent). The flags count as the
calling script's own, so its `--help` lists them."""

from __future__ import annotations

import math

from absl import flags

from experiments.lib.serving.traces import FORMATS as TRACE_FORMATS

FLAGS = flags.FLAGS
flags.disclaim_key_flags()  # flags defined by define() belong to the script that calls it


def define() -> None:
    if "input_len" in FLAGS:
        return
    flags.DEFINE_integer("input_len", 128, "random-length workloads: prompt tokens; shared prefixes: suffix tokens "
                         "after the shared prefix")
    flags.DEFINE_integer("output_len", 32, "random-length / shared-prefix workloads: output tokens (exact: no stop "
                         "tokens)")
    flags.DEFINE_float("range_ratio", 0.0, "random-length / shared-prefix workloads: lengths uniform in "
                       "[len*(1-r), len*(1+r)]")
    flags.DEFINE_integer("num_prefixes", 4, "shared-prefix workloads: number of distinct shared prefixes")
    flags.DEFINE_integer("prefix_len", 256, "shared-prefix workloads: tokens per shared prefix")
    flags.DEFINE_float("burstiness", 1.0, "gamma shape of the inter-arrival times (1 = Poisson, < 1 burstier)")
    flags.DEFINE_string("slo", "", "goodput SLOs in ms, e.g. 'ttft:2000,tpot:100,e2el:30000'")
    flags.DEFINE_string("trace_file", None, "trace workloads: a request trace file (native CSV/JSONL, Azure LLM "
                        "inference or BurstGPT CSV; docs/traces.md); its arrival times replace the generated ones")
    flags.DEFINE_float("trace_speedup", 1.0, "trace workloads: divide every arrival time by this (> 1: faster)")
    flags.register_validator("trace_speedup", lambda v: v > 0 and math.isfinite(v),
                             "--trace_speedup must be a finite number > 0")
    flags.DEFINE_enum("trace_format", "auto", list(TRACE_FORMATS), "trace workloads: the trace "
                      "file's layout (auto: from its header or first JSON object)")
    flags.DEFINE_bool("plot", False, "write plots (latency CDFs; bench_serving: throughput / TPOT vs concurrency for "
                      "a sweep; compare_policies: per-policy bars at one rate, latency / goodput against load over "
                      "several)")
