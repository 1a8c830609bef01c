"""Compare scheduling policies on one workload, in one process: the real engine (one model load and one warm-up for
every policy) or the simulator (`paged.sim`: the same scheduler and page pool on a virtual clock, with a fitted
`StepTimeModel`).

    python -m experiments.compare_policies --engine=sim --num_requests=10000 --rate=0.3 --workload=sharegpt
    python -m experiments.compare_policies --engine=real --num_requests=48 --rate=1 --page_budget=48 --plot
    python -m experiments.compare_policies --engine=sim --deadline=30 \\
        --policies=vllm,experiments.policies.edf:EarliestDeadlineFirst

For each policy it prints one row (TTFT p50/p99, TPOT p50/p99, E2E latency p50, output throughput, goodput at
`--slo` (default here: `DEFAULT_SLO`), prefix-cache hit rate, preemptions, mean page utilisation; on the real engine
also TTFT in units of the run's median step time, which a loaded machine does not reorder at random) with a progress
bar while it runs, writes one JSON record (`--json_out`: flags, git sha, device, per-policy metrics, per-request
metrics, per-step timings and shapes) and, with `--plot`, TTFT/E2E CDFs and per-policy bars. Every request is a job
with no stop condition that produces exactly its output length; `--page_budget` shrinks the KV cache to force memory
pressure (preemptions for `on_demand` policies, queueing for `reserve` ones). Engine flags:
experiments/lib/engine_flags.py (`--max_batch_size` defaults to 16, `--max_seq_len` to 1024, `--decode_steps` to 1
here).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time

import numpy as np
from absl import app, flags

from experiments.lib import engine_flags
from experiments.lib.common import check_out_flag
from experiments.lib.serving import flags as workload_flags

FLAGS = flags.FLAGS
_BEFORE = set(FLAGS) - set(engine_flags.NAMES)
engine_flags.define()
workload_flags.define()  # --input_len, --output_len, --range_ratio, --num_prefixes, --prefix_len, --burstiness,
# --slo, --plot
FLAGS.set_default("decode_steps", 1)  # the step-time model prices single steps; bursts would blur the comparison
FLAGS.set_default("max_seq_len", 1024)
DEFAULT_POLICIES = ["exllamav2", "fcfs", "sjf", "priority", "vllm", "lpm", "sarathi"]
DEFAULT_STEP_TIME_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                       "step_time_smollm2_cpu.json")
flags.DEFINE_list("policies", DEFAULT_POLICIES, "policies to compare: names or 'module:Class'")
flags.DEFINE_enum("engine", "sim", ["real", "sim"], "real: the model (--model) on this machine; sim: "
                  "paged.sim.SimulatedEngine on a virtual clock priced by --step_time_model")
flags.DEFINE_string("step_time_model", DEFAULT_STEP_TIME_MODEL, "sim: StepTimeModel JSON (experiments/profile_step.py "
                    "--fit_out writes one)")
flags.DEFINE_enum("workload", "poisson", ["poisson", "gamma", "sharegpt", "shared_prompt", "bursty"],
                  "request workload and arrival process (experiments/lib/serving/workloads.py, make_scenario)")
flags.DEFINE_float("rate", 2.0, "mean arrivals per second")
flags.DEFINE_integer("num_requests", 64, "measured requests per policy")
flags.DEFINE_integer("burst_size", 16, "bursty: requests per burst")
flags.DEFINE_integer("priority_levels", 3, "requests get a seeded priority in [0, levels) (for `priority`)")
flags.DEFINE_float("deadline", None, "every job's deadline in seconds after arrival (for deadline-aware policies)")
flags.DEFINE_bool("oracle_lengths", True, "give jobs their true output length as expected_new_tokens (sjf)")
flags.DEFINE_integer("page_budget", None, "usable KV pages (default: max_batch_size full-length sequences); lower "
                     "to force memory pressure")
flags.DEFINE_enum("allocation", None, ["reserve", "on_demand"], "override every policy's page allocation mode")
flags.DEFINE_integer("warmup_requests", 4, "real: unmeasured requests run once after compiling, before all policies")
if "json_out" not in FLAGS:  # other experiment scripts define it too (same meaning)
    flags.DEFINE_string("json_out", None, "write the JSON record here (gzip-compressed if it ends with .gz)")
    check_out_flag("json_out")
flags.DEFINE_bool("save_steps", True, "keep every engine call's shape and time in the JSON record")
flags.DEFINE_string("plot_dir", "experiments/results/policies", "where plots go without --json_out")
check_out_flag("plot_dir", folder=True)
OUR_FLAGS = sorted(set(FLAGS) - _BEFORE)
SCHEMA = "compare_policies/1"
DEFAULT_SLO = "ttft:5000,tpot:500"  # goodput's SLO when --slo is empty
SIM_VOCAB = 258  # the simulated engine's fake model (paged.testing.FakeEngine)


@dataclasses.dataclass
class PolicyRun:
    policy: str
    allocation: str
    result: object  # runner.RunResult
    metrics: dict
    cache: dict
    preemptions: int
    median_step_s: float | None
    mean_step_s: float | None
    row: dict  # the printed summary


def engine_config():
    """The EngineConfig the flags describe, with --page_budget as the pool size."""
    import dataclasses as dc

    cfg = engine_flags.engine_config(16, max_penalty_range=0)
    if FLAGS.page_budget is not None:
        if FLAGS.page_budget < 1:
            raise app.UsageError(f"--page_budget must be >= 1 usable page, got {FLAGS.page_budget}")
        cfg = dc.replace(cfg, num_pages=FLAGS.page_budget + 1)
    return cfg


def build_workload(vocab_size: int, special_ids, max_seq_len: int):
    from experiments.lib.serving import workloads

    try:
        return workloads.make_scenario(
            FLAGS.workload, FLAGS.num_requests, rate=FLAGS.rate, vocab_size=vocab_size, special_ids=special_ids,
            seed=0 if FLAGS.seed is None else FLAGS.seed, max_seq_len=max_seq_len, input_len=FLAGS.input_len,
            output_len=FLAGS.output_len, range_ratio=FLAGS.range_ratio, burstiness=FLAGS.burstiness,
            prefix_len=FLAGS.prefix_len, num_prefixes=FLAGS.num_prefixes, burst_size=FLAGS.burst_size,
            priority_levels=FLAGS.priority_levels)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def validate_flags() -> None:
    engine_flags.validate()
    if not FLAGS.policies:
        raise app.UsageError("--policies needs at least one policy")
    for p in FLAGS.policies:
        engine_flags.check_policy("policies", p)
    if not (FLAGS.rate > 0):
        raise app.UsageError(f"--rate must be > 0 (or inf), got {FLAGS.rate}")
    if FLAGS.num_requests < 1:
        raise app.UsageError(f"--num_requests must be >= 1, got {FLAGS.num_requests}")
    if FLAGS.deadline is not None and not FLAGS.deadline > 0:
        raise app.UsageError(f"--deadline must be > 0 seconds, got {FLAGS.deadline}")
    slo_of_flags()


class RealBackend:
    """One engine (one model load, one compile of every bucket, one warm-up run) shared by every policy."""

    kind = "real"

    def __init__(self):
        from experiments.lib.serving import env
        from paged.device.engine import Engine

        self.model = engine_flags.load_model()
        self.engine = Engine(self.model, engine_config(), compilation_cache_dir=FLAGS.compilation_cache_dir)
        t0 = time.perf_counter()
        self.engine.warmup(progress=FLAGS.progress)
        self.compile_s = time.perf_counter() - t0
        self.config = self.engine.config
        self.vocab_size = self.engine.vocab_size
        tok = getattr(self.model, "tokenizer", None)
        self.special_ids = sorted(getattr(tok, "special_token_ids", ()) or ()) if tok is not None else []
        self.device = env.device_info()

    def generator(self, policy):
        from paged import DynamicGenerator

        return DynamicGenerator(engine=self.engine, policy=policy)

    def clock(self, gen):
        return time.perf_counter, time.sleep

    def warm_up(self, requests) -> None:
        from experiments.lib.serving import runner

        if requests:
            runner.run_benchmark(self.generator("exllamav2"), requests, max_concurrency=self.config.max_batch_size)

    def describe(self) -> dict:
        return {"kind": "real", "model": FLAGS.model, "compile_seconds": self.compile_s, "device": self.device}


class SimBackend:
    """A fresh SimulatedEngine (and virtual clock starting at 0) per policy, all priced by one StepTimeModel."""

    kind = "sim"

    def __init__(self):
        from paged.errors import InvalidConfigError
        from paged.sim import StepTimeModel

        try:
            self.step_time = StepTimeModel.load(FLAGS.step_time_model)
        except InvalidConfigError as e:
            raise app.UsageError(f"--step_time_model: {e}") from None
        self.config = engine_config().resolve()
        self.vocab_size = SIM_VOCAB
        self.special_ids = []

    def generator(self, policy):
        from paged import DynamicGenerator
        from paged.sim import SimulatedEngine

        return DynamicGenerator(engine=SimulatedEngine(self.config, self.step_time, vocab_size=self.vocab_size),
                                policy=policy)

    def clock(self, gen):
        return gen.engine.clock, gen.engine.clock.sleep

    def warm_up(self, requests) -> None:
        pass

    def describe(self) -> dict:
        return {"kind": "sim", "step_time_model": self.step_time.to_dict(),
                "device": f"simulated: {self.step_time.device}", "model": f"simulated: {self.step_time.model}"}


STEP_COLUMNS = ("prefill_tokens", "decode_rows", "kv_tokens", "num_steps", "engine_seconds", "call_seconds")


def step_shapes(res) -> dict[str, list]:
    """Per engine call, column-wise: prefill tokens, decode rows, KV tokens read, decode steps, the engine's own
    seconds and the whole call's seconds (microsecond resolution)."""
    cols: dict[str, list] = {c: [] for c in STEP_COLUMNS}
    for s in res.steps:
        cols["prefill_tokens"].append(sum(n for _, n, samp in s.rows if not (n == 1 and samp)))
        cols["decode_rows"].append(sum(1 for _, n, samp in s.rows if n == 1 and samp))
        cols["kv_tokens"].append(sum(st + n for st, n, _ in s.rows))
        cols["num_steps"].append(s.num_steps)
        cols["engine_seconds"].append(round(s.seconds, 6))
        cols["call_seconds"].append(round(s.wall, 6))
    return cols


def run_policy(backend, spec: str, wl, arrivals, slo: dict, label: str | None = None) -> PolicyRun:
    from experiments.lib.serving import metrics, runner
    from paged.policies import make_policy
    from paged.settings import SamplingSettings

    policy = make_policy(spec, allocation=FLAGS.allocation)
    gen = backend.generator(policy)
    clock, sleep = backend.clock(gen)
    res = runner.run_benchmark(gen, wl.requests, gen_settings=SamplingSettings.greedy(), arrivals=arrivals,
                               clock=clock, sleep=sleep, progress=FLAGS.progress, desc=label or spec,
                               seed=0 if FLAGS.seed is None else FLAGS.seed, deadline=FLAGS.deadline,
                               oracle_lengths=FLAGS.oracle_lengths, max_stalls=100_000)
    m = metrics.compute_metrics(res.records, res.duration, slo)
    cache = metrics.prefix_cache_stats(res.metrics_before, res.metrics_after, res.records)
    per_step = [s.wall / s.num_steps for s in res.steps]
    median_step = float(np.median(per_step)) if per_step else None
    mean_step = float(np.mean(per_step)) if per_step else None
    pre = res.metrics_after.get("preemptions", 0) - res.metrics_before.get("preemptions", 0)
    row = {"policy": label or spec, "ttft_p50_ms": m["ttft_ms"]["median"], "ttft_p99_ms": m["ttft_ms"]["p99"],
           "tpot_p50_ms": m["tpot_ms"]["median"], "tpot_p99_ms": m["tpot_ms"]["p99"],
           "e2el_p50_ms": m["e2el_ms"]["median"], "output_tok_s": m["output_throughput"], "goodput": m["goodput"],
           "prefix_hit": cache["page_hit_rate"], "preemptions": pre, "page_util": res.mean_page_utilisation,
           "median_step_ms": None if median_step is None else 1e3 * median_step}
    ttft = m["ttft_ms"]["median"]
    row["ttft_p50_steps"] = None if ttft is None or not median_step else ttft / (1e3 * median_step)
    return PolicyRun(policy=label or spec, allocation=policy.allocation, result=res, metrics=m, cache=cache,
                     preemptions=pre, median_step_s=median_step, mean_step_s=mean_step, row=row)


COLUMNS = [("policy", "policy", "{}"), ("ttft_p50_ms", "TTFT p50", "{:.0f}"), ("ttft_p99_ms", "TTFT p99", "{:.0f}"),
           ("tpot_p50_ms", "TPOT p50", "{:.1f}"), ("tpot_p99_ms", "TPOT p99", "{:.1f}"),
           ("e2el_p50_ms", "E2E p50", "{:.0f}"), ("output_tok_s", "tok/s", "{:.1f}"),
           ("goodput", "goodput", "{:.3f}"), ("prefix_hit", "prefix hit", "{:.2f}"), ("preemptions", "preempt", "{}"),
           ("page_util", "page util", "{:.2f}"),
           ("ttft_p50_steps", "TTFT p50/step", "{:.1f}")]


def format_table(rows: list[dict], real: bool) -> str:
    cols = [c for c in COLUMNS if real or c[0] != "ttft_p50_steps"]
    cells = [[h for _, h, _ in cols]] + [["n/a" if r.get(k) is None else f.format(r[k]) for k, _, f in cols]
                                         for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return jsonable(x.item())
    return x


def policy_record(run: PolicyRun) -> dict:
    res = run.result
    return {
        "policy": run.policy, "allocation": run.allocation, "summary": run.row, "metrics": run.metrics,
        "prefix_cache": run.cache, "preemptions": run.preemptions, "mean_page_utilisation": res.mean_page_utilisation,
        "median_step_s": run.median_step_s, "mean_step_s": run.mean_step_s, "duration_s": res.duration,
        "step_summary": res.step_summary,
        "per_request": [{"index": r.index, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                         "arrival": r.arrival, "ttft": r.ttft if r.token_times else None,
                         "e2el": r.e2el if r.token_times else None, "tpot": r.tpot, "cached_tokens": r.cached_tokens,
                         "preemptions": r.preemptions, "error": r.error or None} for r in res.records],
        "steps": step_shapes(res) if FLAGS.save_steps else None,
    }


def compare(backend, wl, arrivals) -> list[PolicyRun]:
    return [run_policy(backend, p, wl, arrivals, slo_of_flags()) for p in FLAGS.policies]


def slo_of_flags() -> dict:
    from experiments.lib.serving import metrics

    try:
        return metrics.parse_slo(FLAGS.slo or DEFAULT_SLO)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def make_backend():
    return RealBackend() if FLAGS.engine == "real" else SimBackend()


def write_json(path: str, record: dict) -> None:
    """JSON, gzip-compressed when `path` ends with .gz (a 10,000-request run logs hundreds of thousands of steps)."""
    import gzip

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with (gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")) as f:
        json.dump(jsonable(record), f, separators=(",", ":"))
    print(f"wrote {path}", file=sys.stderr)


def write_outputs(backend, wl, runs: list[PolicyRun], extra: dict | None = None) -> None:
    from experiments.lib.serving import env, plots

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    record = {"schema": SCHEMA, "timestamp": stamp, "flags": {k: FLAGS[k].value for k in OUR_FLAGS},
              "git": env.git_info(), "backend": backend.describe(), "engine": backend.config.to_dict(),
              "workload": wl.describe(), "load_avg": env.load_average(),
              "policies": [policy_record(r) for r in runs], **(extra or {})}
    if FLAGS.json_out:
        write_json(FLAGS.json_out, record)
    if FLAGS.plot:
        base = (FLAGS.json_out.removesuffix(".gz").removesuffix(".json") if FLAGS.json_out
                else os.path.join(FLAGS.plot_dir, f"policies_{FLAGS.engine}_{FLAGS.workload}_{stamp}"))
        os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
        title = f"{FLAGS.engine}: {FLAGS.workload}, {FLAGS.num_requests} requests at {FLAGS.rate}/s"
        for p in (plots.plot_latency_cdfs([(r.policy, r.result.records) for r in runs], base + "_cdf.png", title),
                  plots.plot_policy_bars([r.row for r in runs], base + "_bars.png", title)):
            print(f"wrote {p}", file=sys.stderr)


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from experiments.lib.serving import env

    validate_flags()
    if FLAGS.engine == "real":
        env.load_average("at start")
    backend = make_backend()
    wl, arrivals = build_workload(backend.vocab_size, backend.special_ids, backend.config.max_seq_len)
    backend.warm_up(wl.requests[: FLAGS.warmup_requests])
    t0 = time.perf_counter()
    runs = compare(backend, wl, arrivals)
    print(format_table([r.row for r in runs], FLAGS.engine == "real"))
    print(f"{FLAGS.engine} engine, {len(runs)} policies x {FLAGS.num_requests} requests in "
          f"{time.perf_counter() - t0:.1f} s wall", file=sys.stderr)
    write_outputs(backend, wl, runs)


if __name__ == "__main__":
    app.run(main)
