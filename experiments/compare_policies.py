"""Compare scheduling policies on one workload, in one process: the real engine (one model load and one warm-up for
every policy) or the simulator (`paged.sim`: the same scheduler and page pool on a virtual clock, with a fitted
`StepTimeModel`).

    python -m experiments.compare_policies --engine=sim --num_requests=10000 --rate=0.3 --workload=sharegpt
    python -m experiments.compare_policies --engine=real --num_requests=48 --rate=1 --page_budget=48 --plot
    python -m experiments.compare_policies --engine=sim --deadline=30 \\
        --policies=vllm,experiments.policies.edf:EarliestDeadlineFirst

For each policy it prints one row (TTFT p50/p99, TPOT p50/p99, E2E latency p50, output throughput, goodput at
`--slo` (default: `--slo_ttft_ms=5000`, `--slo_tpot_ms=500`), prefix-cache hit rate, preemptions, mean page
utilisation; on the real engine also TTFT in units of the run's median step time, which a loaded machine does not
reorder at random) with a progress bar while it runs, writes one JSON record (`--json_out`: flags, git sha, device,
per-policy metrics, per-request metrics, per-step timings and shapes) and, with `--plot`, TTFT/E2E CDFs and
per-policy bars (at one rate) or latency / goodput against load (over several). Every request is a job
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
import warnings

import numpy as np
from absl import app, flags

from experiments.lib import engine_flags, step_time_fits
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
flags.DEFINE_list("policies", DEFAULT_POLICIES, "policies to compare: names or 'module:Class'")
flags.DEFINE_enum("engine", "sim", ["real", "sim"], "real: the model (--model) on this machine; sim: "
                  "paged.sim.SimulatedEngine on a virtual clock priced by --step_time_model")
flags.DEFINE_string("step_time_model", step_time_fits.DEFAULT_FIT, "sim: the step-time fit: a name in "
                    "experiments/data/step_time/ (hardware_model_setup) or a path to a StepTimeModel JSON "
                    "(experiments/fit_and_validate.py writes one)")
flags.DEFINE_enum("workload", "poisson", ["poisson", "gamma", "sharegpt", "shared_prompt", "bursty", "trace"],
                  "request workload and arrival process (experiments/lib/serving/workloads.py, make_scenario); "
                  "trace: replay --trace_file (docs/traces.md), at its own rate unless --rates rescales it")
flags.DEFINE_float("rate", 2.0, "mean arrivals per second (one load point; --rates sweeps; --rates=auto starts its "
                   "search here)")
flags.DEFINE_list("rates", None, "request rates to sweep (mean arrivals per second), e.g. 0.5,1,2,4,8, or 'auto': per "
                  "policy, a search that brackets its capacity (doubling or halving from --rate, then bisecting)")
flags.DEFINE_float("slo_ttft_ms", 5000.0, "SLO: time to first token, ms (capacity, goodput; --slo overrides both)")
flags.DEFINE_float("slo_tpot_ms", 500.0, "SLO: time per output token, ms")
flags.DEFINE_float("slo_attainment", 0.9, "a rate is sustained when at least this fraction of its requests meet every "
                   "SLO; capacity = the highest rate below the lowest one that is not")
flags.DEFINE_float("capacity_tolerance", 0.1, "--rates=auto: bisect until the bracket's high / low - 1 is at most this")
flags.DEFINE_integer("capacity_max_points", 10, "--rates=auto: at most this many rates per policy")
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
flags.DEFINE_bool("save_requests", True, "keep every request's latencies in the JSON record")
flags.DEFINE_string("plot_dir", "experiments/results/policies", "where plots go without --json_out")
check_out_flag("plot_dir", folder=True)
OUR_FLAGS = sorted(set(FLAGS) - _BEFORE)
SCHEMA = "compare_policies/2"
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
    rate: float | None = None  # the offered load (mean arrivals per second)


def engine_config():
    """The EngineConfig the flags describe, with --page_budget as the pool size."""
    import dataclasses as dc

    cfg = engine_flags.engine_config(16, max_penalty_range=0)
    if FLAGS.page_budget is not None:
        if FLAGS.page_budget < 1:
            raise app.UsageError(f"--page_budget must be >= 1 usable page, got {FLAGS.page_budget}")
        cfg = dc.replace(cfg, num_pages=FLAGS.page_budget + 1)
    return cfg


@dataclasses.dataclass
class Load:
    """The workload and its arrival process, at any rate: `arrivals_at(rate)` scales the base arrivals (drawn at
    `base_rate`) so their mean rate is `rate` (the same seeded gaps, stretched or squeezed)."""

    workload: object  # workloads.Workload
    base: np.ndarray  # arrival times at base_rate
    base_rate: float

    def arrivals_at(self, rate: float) -> np.ndarray:
        if math.isinf(rate):
            return np.zeros_like(self.base)
        return self.base * (self.base_rate / rate)


def build_load(vocab_size: int, special_ids, max_seq_len: int) -> Load:
    from experiments.lib.serving import workloads

    try:
        wl, base = workloads.make_scenario(
            FLAGS.workload, FLAGS.num_requests, rate=1.0, vocab_size=vocab_size, special_ids=special_ids,
            seed=0 if FLAGS.seed is None else FLAGS.seed, max_seq_len=max_seq_len, input_len=FLAGS.input_len,
            output_len=FLAGS.output_len, range_ratio=FLAGS.range_ratio, burstiness=FLAGS.burstiness,
            prefix_len=FLAGS.prefix_len, num_prefixes=FLAGS.num_prefixes, burst_size=FLAGS.burst_size,
            priority_levels=FLAGS.priority_levels, trace_file=FLAGS.trace_file, trace_speedup=FLAGS.trace_speedup,
            trace_format=FLAGS.trace_format)
    except ValueError as e:  # (a TraceError too: it names file:line)
        raise app.UsageError(f"--workload={FLAGS.workload}: {e}") from None
    base = np.asarray(base, np.float64)
    if FLAGS.workload != workloads.TRACE_SCENARIO:
        return Load(wl, base, 1.0)
    rate = workloads.mean_rate(base) if len(base) > 1 else math.inf
    if not (rate > 0 and math.isfinite(rate)):
        if FLAGS.rates:  # (replayed at its own rate it is one burst: the arrivals at rate inf)
            raise app.UsageError(f"--trace_file={FLAGS.trace_file}: its arrivals span no time, so it has no rate "
                                 "for --rates to rescale; drop --rates to replay it, or give a trace whose requests "
                                 "arrive at different times")
        return Load(wl, np.zeros_like(base), math.inf)
    return Load(wl, base, rate)


def is_trace() -> bool:
    return FLAGS.workload == "trace"


def build_workload(vocab_size: int, special_ids, max_seq_len: int):
    """The workload and its arrivals at --rate."""
    load = build_load(vocab_size, special_ids, max_seq_len)
    return load.workload, load.arrivals_at(FLAGS.rate)


def rates_of_flags(load: Load | None = None) -> list[float] | None:
    """--rates as numbers (ascending), None for 'auto'; without --rates, [--rate] (a trace: its own mean rate)."""
    if not FLAGS.rates:
        return [load.base_rate] if load is not None and is_trace() else [FLAGS.rate]
    if [r.strip().lower() for r in FLAGS.rates] == ["auto"]:
        return None
    try:
        rates = [float(r) for r in FLAGS.rates]
    except ValueError:
        raise app.UsageError(f"--rates must be 'auto' or comma-separated request rates, e.g. 0.5,1,2,4; got "
                             f"{','.join(FLAGS.rates)!r}") from None
    if not all(r > 0 for r in rates) or len(set(rates)) != len(rates):
        raise app.UsageError(f"--rates must be distinct rates > 0 (or inf); got {','.join(FLAGS.rates)!r}")
    return sorted(rates)


def validate_flags() -> None:
    engine_flags.validate()
    if not FLAGS.policies:
        raise app.UsageError("--policies needs at least one policy")
    for p in FLAGS.policies:
        engine_flags.check_policy("policies", p)
    dups = sorted({p for p in FLAGS.policies if FLAGS.policies.count(p) > 1})
    if dups:
        raise app.UsageError(f"--policies names {', '.join(dups)} more than once (each policy runs once)")
    if FLAGS.seed is not None and FLAGS.seed < 0:
        raise app.UsageError(f"--seed must be >= 0, got {FLAGS.seed}")
    for name, why in (("policy", "each policy of --policies runs; give them there"),
                      ("temperature", "every request decodes greedily, so that policies differ only in scheduling")):
        if FLAGS[name].present:  # (shared engine flags, read by other scripts: here they had been ignored)
            raise app.UsageError(f"--{name} is not used here: {why}")
    if not (FLAGS.rate > 0):
        raise app.UsageError(f"--rate must be > 0 (or inf), got {FLAGS.rate}")
    if rates_of_flags() is None and not math.isfinite(FLAGS.rate):
        raise app.UsageError("--rates=auto starts its search at --rate, which must be finite")
    if FLAGS.num_requests < 1:
        raise app.UsageError(f"--num_requests must be >= 1, got {FLAGS.num_requests}")
    if FLAGS.deadline is not None and not FLAGS.deadline > 0:
        raise app.UsageError(f"--deadline must be > 0 seconds, got {FLAGS.deadline}")
    if not 0 < FLAGS.slo_attainment <= 1:
        raise app.UsageError(f"--slo_attainment must be a fraction in (0, 1], got {FLAGS.slo_attainment}")
    if not FLAGS.capacity_tolerance > 0 or FLAGS.capacity_max_points < 2:
        raise app.UsageError("--capacity_tolerance must be > 0 and --capacity_max_points >= 2")
    slo_of_flags()
    check_workload_flags()


# the workload flags each workload reads beyond --num_requests, --seed, --priority_levels (others are rejected when
# given, not silently ignored)
WORKLOAD_READS = {"poisson": ("input_len", "output_len", "range_ratio"),
                  "gamma": ("input_len", "output_len", "range_ratio", "burstiness"),
                  "bursty": ("input_len", "output_len", "range_ratio", "burst_size"),
                  "sharegpt": (),
                  "shared_prompt": ("input_len", "output_len", "range_ratio", "prefix_len", "num_prefixes"),
                  "trace": ("trace_file", "trace_speedup", "trace_format")}


def check_workload_flags() -> None:
    """--workload's flags, before a model loads or a bucket compiles: a flag the workload does not read, given
    anyway, is an error (not silently ignored); then the load is built once over the simulator's vocabulary, so
    its errors (lengths, a trace file) name their flag now rather than after the real engine has compiled."""
    reads = WORKLOAD_READS[FLAGS.workload]
    for name in ("input_len", "output_len", "range_ratio", "burstiness", "burst_size", "trace_file", "trace_speedup",
                 "trace_format", "prefix_len", "num_prefixes"):
        if FLAGS[name].present and name not in reads:
            users = [w for w, r in WORKLOAD_READS.items() if name in r]
            raise app.UsageError(f"--{name} is not used by --workload={FLAGS.workload} (only by --workload="
                                 f"{' or '.join(users)})")
    if FLAGS.priority_levels < 1:
        raise app.UsageError(f"--priority_levels must be >= 1, got {FLAGS.priority_levels}")
    for name in ("input_len", "output_len"):
        if name in reads and FLAGS[name].value < 1:
            raise app.UsageError(f"--{name} must be >= 1 token, got {FLAGS[name].value}")
    load = build_load(SIM_VOCAB, [], FLAGS.max_seq_len)
    cfg = engine_config().resolve()  # (--page_budget >= 1 checked there; the default: full-length sequences)
    usable = cfg.num_pages - 1
    longest = max(load.workload.requests, key=lambda r: r.prompt_len + r.output_len)
    need = -(-(longest.prompt_len + longest.output_len) // cfg.page_size)
    if need > usable:  # (the generator had refused it mid-run, after the real engine had compiled, naming num_pages)
        raise app.UsageError(f"--page_budget={usable}: request {longest.index} needs {need} pages of "
                             f"{cfg.page_size} tokens ({longest.prompt_len} prompt + {longest.output_len} output); "
                             f"raise --page_budget to at least {need} or shorten the requests")


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


def setup_mismatches(step_time, setup, what: str, show: bool = True) -> list[str]:
    """How `step_time`'s fit differs from `setup` (`StepTimeModel.differences`), printed as one "warning: ..." line
    on stderr where `show` (the `StepTimeMismatchWarning` it raises is caught: not printed a second time)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mismatches = step_time.warn_differences(setup, what)
    for w in caught if show else ():
        print(f"warning: {w.message}", file=sys.stderr)
    return mismatches


class SimBackend:
    """A fresh SimulatedEngine (and virtual clock starting at 0) per policy, all priced by one StepTimeModel."""

    kind = "sim"

    def __init__(self, step_time=None, warn: bool = True):
        """`step_time`: the `StepTimeModel` to price steps with (default: --step_time_model's). Its setup is checked
        against these flags here, once (`warn`: printed; False where the caller warns a fuller comparison itself, as
        validate_sim does); the generators' engines do not warn it again."""
        from paged.errors import InvalidConfigError
        from paged.sim import StepTimeModel
        from paged.sim import engine_setup as sim_setup

        try:
            self.step_time = step_time or StepTimeModel.load(step_time_fits.fit_path(FLAGS.step_time_model))
        except (InvalidConfigError, ValueError) as e:
            raise app.UsageError(f"--step_time_model: {e}") from None
        self.config = engine_config().resolve()
        self.vocab_size = SIM_VOCAB
        self.special_ids = []
        self.setup = {"model": FLAGS.model, "quantization": FLAGS.quant}  # (the config names the rest)
        # warned once here, not once per policy and rate
        self.mismatches = setup_mismatches(self.step_time, sim_setup(self.config, self.setup), "these flags",
                                           show=warn)

    def generator(self, policy):
        from paged import DynamicGenerator
        from paged.sim import SimulatedEngine

        return DynamicGenerator(engine=SimulatedEngine(self.config, self.step_time, vocab_size=self.vocab_size,
                                                       setup=self.setup, warn_setup=False), policy=policy)

    def clock(self, gen):
        return gen.engine.clock, gen.engine.clock.sleep

    def warm_up(self, requests) -> None:
        pass

    def describe(self) -> dict:
        return {"kind": "sim", "step_time_model": self.step_time.to_dict(), "setup_mismatches": self.mismatches,
                "device": f"simulated: {self.step_time.device}", "model": f"simulated: {self.step_time.model}"}


STEP_COLUMNS = ("prefill_tokens", "decode_rows", "kv_tokens", "num_steps", "engine_seconds", "call_seconds")


def step_shapes(res) -> dict[str, list]:
    """Per engine call, column-wise: prefill tokens, decode rows, KV tokens read, decode steps, the engine's own
    seconds and the whole call's seconds (microsecond resolution). By the rows' shapes: a row of one sampled token
    is a decode row (a prompt's last chunk of one token too, which costs what a decode row does)."""
    cols: dict[str, list] = {c: [] for c in STEP_COLUMNS}
    for s in res.steps:
        cols["prefill_tokens"].append(sum(n for _, n, samp in s.rows if not (n == 1 and samp)))
        cols["decode_rows"].append(sum(1 for _, n, samp in s.rows if n == 1 and samp))
        cols["kv_tokens"].append(sum(st + n for st, n, _ in s.rows))
        cols["num_steps"].append(s.num_steps)
        cols["engine_seconds"].append(round(s.seconds, 6))
        cols["call_seconds"].append(round(s.wall, 6))
    return cols


def run_policy(backend, spec: str, wl, arrivals, slo: dict, label: str | None = None,
               rate: float | None = None) -> PolicyRun:
    from experiments.lib.serving import metrics, runner
    from paged.policies import make_policy
    from paged.settings import SamplingSettings

    policy = make_policy(spec, allocation=FLAGS.allocation)
    gen = backend.generator(policy)
    clock, sleep = backend.clock(gen)
    res = runner.run_benchmark(gen, wl.requests, gen_settings=SamplingSettings.greedy(), arrivals=arrivals,
                               clock=clock, sleep=sleep, progress=FLAGS.progress,
                               desc=(label or spec) + ("" if rate is None else f" @ {rate:g}/s"),
                               seed=0 if FLAGS.seed is None else FLAGS.seed, deadline=FLAGS.deadline,
                               oracle_lengths=FLAGS.oracle_lengths, max_stalls=100_000)
    m = metrics.compute_metrics(res.records, res.duration, slo)
    cache = metrics.prefix_cache_stats(res.metrics_before, res.metrics_after, res.records)
    per_step = [s.wall / s.num_steps for s in res.steps]
    median_step = float(np.median(per_step)) if per_step else None
    mean_step = float(np.mean(per_step)) if per_step else None
    delta = metrics.metrics_delta(res.metrics_before, res.metrics_after)
    pre, recomputed = delta.get("preemptions", 0), delta.get("tokens_recomputed", 0)
    m.update(preemptions=pre, tokens_recomputed=recomputed)
    row = {"policy": label or spec, "rate": rate, "ttft_p50_ms": m["ttft_ms"]["median"],
           "ttft_p90_ms": m["ttft_ms"]["p90"], "ttft_p99_ms": m["ttft_ms"]["p99"],
           "tpot_p50_ms": m["tpot_ms"]["median"], "tpot_p90_ms": m["tpot_ms"]["p90"],
           "tpot_p99_ms": m["tpot_ms"]["p99"], "itl_p50_ms": m["itl_ms"]["median"], "itl_p90_ms": m["itl_ms"]["p90"],
           "itl_p99_ms": m["itl_ms"]["p99"], "e2el_p50_ms": m["e2el_ms"]["median"], "e2el_p90_ms": m["e2el_ms"]["p90"],
           "e2el_p99_ms": m["e2el_ms"]["p99"], "queue_p50_ms": m["queue_ms"]["median"],
           "queue_p99_ms": m["queue_ms"]["p99"], "output_tok_s": m["output_throughput"],
           "request_s": m["request_throughput"], "goodput": m["goodput"], "attainment": m["slo_attainment"],
           "prefix_hit": cache["page_hit_rate"], "preemptions": pre, "recomputed": recomputed,
           "page_util": res.mean_page_utilisation, "median_step_ms": None if median_step is None else 1e3 * median_step}
    ttft = m["ttft_ms"]["median"]
    row["ttft_p50_steps"] = None if ttft is None or not median_step else ttft / (1e3 * median_step)
    return PolicyRun(policy=label or spec, allocation=policy.allocation, result=res, metrics=m, cache=cache,
                     preemptions=pre, median_step_s=median_step, mean_step_s=mean_step, row=row, rate=rate)


def sustained(run: PolicyRun) -> bool:
    """The run met the SLO: at least --slo_attainment of its requests met every SLO."""
    return (run.metrics["slo_attainment"] or 0.0) >= FLAGS.slo_attainment


@dataclasses.dataclass
class Sweep:
    """One policy over the rates: its runs (ascending rate) and its capacity."""

    policy: str
    runs: list[PolicyRun]
    capacity: object  # capacity.Capacity


def sweep_policy(backend, spec: str, load: Load, slo: dict, rates: list[float] | None) -> Sweep:
    """Run `spec` at every rate of `rates`, or (None) search its capacity from --rate."""
    from experiments.lib.serving import capacity

    runs: list[PolicyRun] = []

    def measure(rate: float) -> bool:
        run = run_policy(backend, spec, load.workload, load.arrivals_at(rate), slo, rate=rate)
        runs.append(run)
        r = run.row
        print(f"  {run.policy} @ {rate:.4g}/s: TTFT p50 {_ms(r['ttft_p50_ms'])}, TPOT p50 {_ms(r['tpot_p50_ms'])}, "
              f"SLO attainment {r['attainment']:.1%} -> {'sustained' if sustained(run) else 'not sustained'}",
              file=sys.stderr)
        return sustained(run)

    if rates is None:
        cap = capacity.search_capacity(measure, load.base_rate if is_trace() else FLAGS.rate,
                                       rel_tol=FLAGS.capacity_tolerance,
                                       max_points=FLAGS.capacity_max_points)
    else:
        cap = capacity.capacity_from_points([(r, measure(r)) for r in rates])
    runs.sort(key=lambda r: r.rate)
    return Sweep(policy=runs[0].policy, runs=runs, capacity=cap)


def _ms(x) -> str:
    return "n/a" if x is None else f"{x:.0f} ms"


COLUMNS = [("policy", "policy", "{}"), ("rate", "rate/s", "{:.3g}"), ("ttft_p50_ms", "TTFT p50", "{:.0f}"),
           ("ttft_p90_ms", "p90", "{:.0f}"), ("ttft_p99_ms", "p99", "{:.0f}"), ("tpot_p50_ms", "TPOT p50", "{:.1f}"),
           ("tpot_p99_ms", "p99", "{:.1f}"), ("itl_p99_ms", "ITL p99", "{:.0f}"), ("e2el_p50_ms", "E2E p50", "{:.0f}"),
           ("queue_p50_ms", "queue p50", "{:.0f}"), ("output_tok_s", "tok/s", "{:.1f}"),
           ("goodput", "goodput/s", "{:.3f}"), ("attainment", "SLO met", "{:.1%}"),
           ("prefix_hit", "prefix hit", "{:.2f}"), ("preemptions", "preempt", "{}"),
           ("recomputed", "recomputed", "{}"), ("page_util", "page util", "{:.2f}"),
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


def slo_text(slo: dict) -> str:
    names = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2EL"}
    limits = ", ".join(f"{names[k]} <= {v:g} ms" for k, v in slo.items())
    return f"SLO: {limits}; a rate is sustained when >= {FLAGS.slo_attainment:.0%} of its requests meet it"


def format_capacities(sweeps: list[Sweep], slo: dict) -> str:
    """One capacity line per policy and the ranking line."""
    from experiments.lib.serving import capacity

    caps = {s.policy: s.capacity for s in sweeps}
    width = max(len(p) for p in caps)
    lines = [slo_text(slo)]
    for s in sweeps:
        c = s.capacity
        note = "" if c.bounded else (" (every rate tried met the SLO: raise the rates)" if c.rate is not None
                                     else " (no rate tried met the SLO: lower the rates)")
        lines.append(f"capacity  {s.policy:<{width}}  {c.describe()}{note}")
    lines.append("ranking by capacity: " + capacity.format_ranking(caps))
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
        "policy": run.policy, "rate": run.rate, "allocation": run.allocation, "summary": run.row,
        "metrics": run.metrics, "prefix_cache": run.cache, "preemptions": run.preemptions,
        "tokens_recomputed": run.metrics["tokens_recomputed"], "mean_page_utilisation": res.mean_page_utilisation,
        "median_step_s": run.median_step_s, "mean_step_s": run.mean_step_s, "duration_s": res.duration,
        "step_summary": res.step_summary,
        "per_request": [{"index": r.index, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                         "arrival": r.arrival, "ttft": r.ttft if r.token_times else None,
                         "e2el": r.e2el if r.token_times else None, "tpot": r.tpot, "queue_time": r.queue_time,
                         "cached_tokens": r.cached_tokens, "preemptions": r.preemptions, "priority": r.priority,
                         "deadline": r.deadline, "error": r.error or None}
                        for r in res.records] if FLAGS.save_requests else None,
        "steps": step_shapes(res) if FLAGS.save_steps else None,
    }


def compare(backend, wl, arrivals) -> list[PolicyRun]:
    return [run_policy(backend, p, wl, arrivals, slo_of_flags()) for p in FLAGS.policies]


def slo_of_flags() -> dict:
    """The SLO in ms: --slo when given (any of ttft, tpot, e2el), else --slo_ttft_ms and --slo_tpot_ms."""
    from experiments.lib.serving import metrics

    if FLAGS.slo:
        try:
            return metrics.parse_slo(FLAGS.slo)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if not (FLAGS[name].value > 0 and math.isfinite(FLAGS[name].value)):
            raise app.UsageError(f"--{name} must be a finite number of milliseconds > 0, got {FLAGS[name].value}")
    return {"ttft": FLAGS.slo_ttft_ms, "tpot": FLAGS.slo_tpot_ms}


def make_backend():
    return RealBackend() if FLAGS.engine == "real" else SimBackend()


def write_json(path: str, record: dict) -> None:
    """JSON, gzip-compressed when `path` ends with .gz (a 10,000-request run logs hundreds of thousands of steps)."""
    import gzip

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with (gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")) as f:
        json.dump(jsonable(record), f, separators=(",", ":"))
    print(f"wrote {path}", file=sys.stderr)


def cdf_rate(sweeps: list[Sweep]) -> float:
    """The rate whose latency CDFs are plotted: the lowest rate some policy did not sustain (where policies part),
    else the highest rate run."""
    failing = [r.rate for s in sweeps for r in s.runs if not sustained(r)]
    return min(failing) if failing else max(r.rate for s in sweeps for r in s.runs)


def runs_near(sweeps: list[Sweep], at: float) -> list[PolicyRun]:
    """Each policy's run at `at`, or (where its rates differ: --rates=auto) at its rate nearest to it on a log
    scale: every policy has its CDF (only the policy whose search ran `at` had been drawn)."""
    def distance(r: PolicyRun) -> float:
        if r.rate == at:
            return 0.0
        return abs(math.log(r.rate / at)) if math.isfinite(r.rate) and math.isfinite(at) else math.inf

    return [min(s.runs, key=distance) for s in sweeps if s.runs]


def write_outputs(backend, load: Load, sweeps: list[Sweep], slo: dict, extra: dict | None = None) -> None:
    from experiments.lib.serving import env, plots

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    wl = load.workload
    record = {"schema": SCHEMA, "timestamp": stamp, "flags": {k: FLAGS[k].value for k in OUR_FLAGS},
              "git": env.git_info(), "backend": backend.describe(), "engine": backend.config.to_dict(),
              "workload": wl.describe(), "load_avg": env.load_average(), "slo_ms": slo,
              "slo_attainment": FLAGS.slo_attainment,
              "rates": "auto" if rates_of_flags(load) is None else rates_of_flags(load),
              "capacity": {s.policy: s.capacity.to_dict() for s in sweeps},
              "ranking": _ranking(sweeps),
              "points": [policy_record(r) for s in sweeps for r in s.runs], **(extra or {})}
    if FLAGS.json_out:
        write_json(FLAGS.json_out, record)
    if FLAGS.plot:
        base = (FLAGS.json_out.removesuffix(".gz").removesuffix(".json") if FLAGS.json_out
                else os.path.join(FLAGS.plot_dir, f"policies_{FLAGS.engine}_{FLAGS.workload}_{stamp}"))
        os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
        title = f"{FLAGS.engine}: {FLAGS.workload}, {len(wl.requests)} requests"
        at = cdf_rate(sweeps)
        at_rate = runs_near(sweeps, at)
        same = len({r.rate for r in at_rate}) == 1  # (--rates=auto: each policy's search ran its own rates)
        paths = [plots.plot_latency_cdfs([(r.policy if same else f"{r.policy} @ {r.rate:.3g}/s", r.result.records)
                                          for r in at_rate], base + "_cdf.png",
                                         f"{title} {'at' if same else 'near'} {at:.3g}/s")]
        if len({r.rate for s in sweeps for r in s.runs}) > 1:
            paths.append(plots.plot_load_curves(
                [(s.policy, [r.row for r in s.runs], s.capacity.rate if s.capacity.bounded else None)
                 for s in sweeps], slo, base + "_load.png", title))
        else:
            paths.append(plots.plot_policy_bars([r.row for r in at_rate], base + "_bars.png", f"{title} at {at:.3g}/s"))
        for p in paths:
            print(f"wrote {p}", file=sys.stderr)


def _ranking(sweeps: list[Sweep]) -> list[list[str]]:
    from experiments.lib.serving import capacity

    return capacity.ranking({s.policy: s.capacity for s in sweeps})


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from experiments.lib.serving import env

    validate_flags()
    if FLAGS.engine == "real":
        env.load_average("at start")
    slo = slo_of_flags()
    backend = make_backend()
    load = build_load(backend.vocab_size, backend.special_ids, backend.config.max_seq_len)
    rates = rates_of_flags(load)
    if is_trace():
        print(f"trace {FLAGS.trace_file}: {len(load.workload.requests)} requests at {load.base_rate:.3g}/s on "
              f"average (after --trace_speedup={FLAGS.trace_speedup:g}); --rate is "
              + ("its search's start" if rates is None else "not used"), file=sys.stderr)
    backend.warm_up(load.workload.requests[: FLAGS.warmup_requests])
    t0 = time.perf_counter()
    sweeps = [sweep_policy(backend, p, load, slo, rates) for p in FLAGS.policies]
    print(format_table([r.row for s in sweeps for r in s.runs], FLAGS.engine == "real"))
    print(format_capacities(sweeps, slo))
    points = sum(len(s.runs) for s in sweeps)
    print(f"{FLAGS.engine} engine, {len(sweeps)} policies, {points} load points x {len(load.workload.requests)} "
          f"requests in "
          f"{time.perf_counter() - t0:.1f} s wall", file=sys.stderr)
    write_outputs(backend, load, sweeps, slo)


if __name__ == "__main__":
    app.run(main)
