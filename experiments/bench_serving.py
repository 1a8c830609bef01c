"""Serving benchmark of `DynamicGenerator`, in-process, with vLLM `benchmark_serving`'s workloads and metrics.

    python -m experiments.bench_serving --model smollm2-135m --dataset random --num_prompts 64 \\
        --input_len 256 --output_len 64 --max_concurrency 1,4,16 --plot
    python -m experiments.bench_serving --dataset sharegpt --request_rate 2 --burstiness 0.5 --slo ttft:2000,tpot:200
    python -m experiments.bench_serving --dataset prefix --num_prefixes 4 --prefix_len 512 --input_len 64
    python -m experiments.bench_serving --dataset trace --trace_file experiments/data/traces/bursty_example.csv \\
        --trace_speedup 2 --max_concurrency inf

Closed loop (`--max_concurrency N`: N requests in flight), open loop (`--request_rate R` req/s, gamma arrivals with
shape `--burstiness`; with `--dataset trace` the trace's own arrival times, docs/traces.md), or both. Each
concurrency value is one run; each run appends one JSON record to `<output_dir>/<run_name>.jsonl` and prints a
summary table. Compilation (`generator.warmup()`) and `--num_warmup` requests are excluded; the prompt cache is reset
before each measured run. See docs/performance.md, "Serving benchmark", for the metric definitions and the record's
schema. The logic lives in `experiments/lib/serving/`.

`--backend=openai --base_url=http://HOST:PORT` drives any OpenAI-compatible server (this project's
`python -m experiments.serve`, vLLM, SGLang, llama.cpp, ...) with the same workloads, load model and metrics,
measured over HTTP from the streamed chunks (experiments/lib/serving/http_client.py; docs/server.md). `--model`
then only supplies the workload's vocabulary (and, with `--prompt_format=text`, the tokenizer); warm-up requests use
prompts of their own (the server's prompt cache cannot be reset from outside), and the record carries the server's
`/metrics` counters of the run where it has them:
    python -m experiments.bench_serving --backend=openai --base_url=http://127.0.0.1:8000 --max_concurrency 16
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import sys
import time

from absl import app, flags

from experiments.lib import engine_flags
from experiments.lib.common import check_out_flag
from experiments.lib.serving import flags as workload_flags

FLAGS = flags.FLAGS
_BEFORE = set(FLAGS) - set(engine_flags.NAMES)
engine_flags.define()  # --model, --quant, cache and engine flags, --seed, --temperature, --progress, --decode_steps
workload_flags.define()  # --input_len, --output_len, --range_ratio, --num_prefixes, --prefix_len, --burstiness,
# --slo, --trace_file, --trace_speedup, --trace_format, --plot
# workload
flags.DEFINE_enum("dataset", "random", ["random", "sharegpt", "prefix", "trace"], "request workload (trace: the "
                  "lengths and arrival times of --trace_file)")
flags.DEFINE_integer("num_prompts", 32, "measured requests per run")
flags.DEFINE_string("dataset_path", None,
                    "sharegpt: length-pair file (default experiments/data/sharegpt_like_lengths.json)")
# load
flags.DEFINE_list("max_concurrency", ["4"], "requests in flight; a comma list runs a sweep; 'inf' = no limit")
flags.DEFINE_float("request_rate", math.inf, "arrivals per second (inf: all requests at t=0); not with "
                   "--dataset=trace (its own arrival times)")
flags.DEFINE_integer("num_warmup", None, "unmeasured requests run before each measured run, at its concurrency "
                     "(default: max(2, max_concurrency), or max_batch_size without a limit)")
flags.DEFINE_bool("compile_all_buckets", True, "generator.warmup(): compile every step bucket before measuring")
# output
flags.DEFINE_string("output_dir", "experiments/results/serving", "where records (and plots) are written")
check_out_flag("output_dir", folder=True)
flags.DEFINE_string("run_name", None, "file name stem (default: model_dataset_timestamp)")
flags.DEFINE_bool("measure_hardware", True, "measure memory bandwidth and matmul FLOP/s first, for utilisation")
flags.DEFINE_bool("save_detailed", False, "also store every request's token timestamps in the record")
# backend
flags.DEFINE_enum("backend", "inprocess", ["inprocess", "openai"], "inprocess: a DynamicGenerator in this process; "
                  "openai: the OpenAI-compatible server at --base_url, over HTTP")
flags.DEFINE_string("base_url", "http://127.0.0.1:8000", "--backend=openai: the server (its /v1/completions)")
flags.DEFINE_string("served_model", None, "--backend=openai: the model id to request (default: the first of the "
                    "server's /v1/models)")
flags.DEFINE_enum("prompt_format", "ids", ["ids", "text"], "--backend=openai: prompts as token ids (exact lengths) "
                  "or as their decoded text (re-tokenized by the server)")
flags.DEFINE_string("extra_body", '{"ignore_eos": true}', "--backend=openai: JSON object merged into every request "
                    "(the default makes each request produce exactly its output length)")
flags.DEFINE_float("request_timeout_s", 600.0, "--backend=openai: per-request timeout")
# model / engine: experiments/lib/engine_flags.py (--max_penalty_range defaults to 0 here: the benchmark uses no
# penalties)
OUR_FLAGS = sorted(set(FLAGS) - _BEFORE)

SCHEMA = "bench_serving/1"
SEED = lambda: 0 if FLAGS.seed is None else FLAGS.seed  # the shared --seed defaults to None


def parse_concurrency(values) -> list[int | None]:
    """['1', '4', 'inf'] -> [1, 4, None] (None: no limit)."""
    out: list[int | None] = []
    for v in values:
        s = str(v).strip().lower()
        if s in ("inf", "none", "unlimited"):
            out.append(None)
            continue
        try:
            n = int(s)
        except ValueError:
            raise ValueError(f"--max_concurrency: {v!r} is not a positive integer or 'inf'") from None
        if n < 1:
            raise ValueError(f"--max_concurrency values must be >= 1 (or 'inf'), got {n}")
        out.append(n)
    if not out:
        raise ValueError("--max_concurrency needs at least one value")
    return out


def jsonable(x):
    """Floats inf / nan -> strings, tuples -> lists, recursively (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 1) == 0:
        return jsonable(x.item())
    return x


def _label(c: int | None) -> str:
    return "c=inf" if c is None else f"c={c}"


def _compiled_variants() -> int | None:
    """Compiled variants of the jitted step functions so far (None if the engine does not expose the count)."""
    try:
        from paged.device.engine import count_compiles

        return int(sum(count_compiles().values()))
    except Exception:  # a diagnostic only
        return None


def make_workload(trace, tok, vocab_size: int, max_seq_len: int | None, num_prompts: int, seed: int):
    """The flags' workload over this vocabulary, and its arrival times (None: the --request_rate schedule; a trace
    brings its own). app.UsageError when it cannot be made."""
    from experiments.lib.serving import workloads

    special = sorted(getattr(tok, "special_token_ids", ()) or ()) if tok is not None else []
    try:
        if trace is not None:
            return workloads.trace_workload(trace, num_prompts, vocab_size=vocab_size, special_ids=special,
                                            seed=seed, max_seq_len=max_seq_len)
        return workloads.make_workload(
            FLAGS.dataset, num_prompts, vocab_size=vocab_size, special_ids=special, seed=seed,
            max_seq_len=max_seq_len, input_len=FLAGS.input_len, output_len=FLAGS.output_len,
            range_ratio=FLAGS.range_ratio, num_prefixes=FLAGS.num_prefixes, prefix_len=FLAGS.prefix_len,
            dataset_path=FLAGS.dataset_path), None
    except (ValueError, OSError) as e:  # OSError: a --dataset_path that cannot be read
        raise app.UsageError(str(e)) from None


CHECK_VOCAB = 258  # the stand-in vocabulary check_flags() builds the workload over (the model's comes later)


# the length flags each dataset reads (the others are refused when given, not silently ignored)
DATASET_READS = {"random": ("input_len", "output_len", "range_ratio"),
                 "prefix": ("input_len", "output_len", "range_ratio", "num_prefixes", "prefix_len"),
                 "sharegpt": (), "trace": ()}


def check_flags(trace=None) -> None:
    """The flags' problems that would otherwise surface only after the hardware peaks are measured, the model loaded
    and every step bucket compiled: app.UsageError naming the flag. `trace`: --dataset=trace's trace, already read."""
    if FLAGS.num_prompts < 1:
        raise app.UsageError(f"--num_prompts must be >= 1, got {FLAGS.num_prompts}")
    if FLAGS.dataset in ("random", "prefix"):
        for name in ("input_len", "output_len"):
            if FLAGS[name].value < 1:
                raise app.UsageError(f"--{name} must be >= 1 token with --dataset={FLAGS.dataset}, got "
                                     f"{FLAGS[name].value}")
    if FLAGS.dataset_path and FLAGS.dataset != "sharegpt":
        raise app.UsageError(f"--dataset_path is only read with --dataset=sharegpt, not --dataset={FLAGS.dataset}")
    for name in ("input_len", "output_len", "range_ratio", "num_prefixes", "prefix_len"):
        if FLAGS[name].present and name not in DATASET_READS[FLAGS.dataset]:
            users = [d for d, r in DATASET_READS.items() if name in r]
            raise app.UsageError(f"--{name} is not used by --dataset={FLAGS.dataset} (only by --dataset="
                                 f"{' or '.join(users)}): its lengths come from "
                                 f"{'the trace' if FLAGS.dataset == 'trace' else 'the dataset'}")
    if FLAGS.seed is not None and FLAGS.seed < 0:
        raise app.UsageError(f"--seed must be >= 0, got {FLAGS.seed}")
    if FLAGS.run_name is not None and (not FLAGS.run_name.strip() or "/" in FLAGS.run_name or os.sep in FLAGS.run_name
                                       or FLAGS.run_name in (".", "..")):
        raise app.UsageError(f"--run_name is a file name stem (no folders: --output_dir names the folder), got "
                             f"{FLAGS.run_name!r}")
    try:  # the workload over a stand-in vocabulary: its errors (lengths, --dataset_path) now, not after compiling
        make_workload(trace, None, CHECK_VOCAB, FLAGS.max_seq_len, FLAGS.num_prompts, SEED())
    except app.UsageError as e:
        raise app.UsageError(f"--dataset={FLAGS.dataset}: {e}") from None


def main(argv):
    del argv
    run()


def run() -> list:
    """The benchmark with the current FLAGS; returns [(max_concurrency, RunResult, metrics)] per run."""
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from experiments.lib.serving import env, hardware, metrics, runner, traces, workloads

    trace = None
    if FLAGS.dataset != "trace":
        for name in ("trace_file", "trace_speedup", "trace_format"):
            if FLAGS[name].present:
                raise app.UsageError(f"--{name} is read only with --dataset=trace, not --dataset={FLAGS.dataset}")
    else:
        for name in ("request_rate", "burstiness"):
            if FLAGS[name].present:
                raise app.UsageError(f"--{name}: --dataset=trace replays the trace's own arrival times; drop it "
                                     "(--trace_speedup scales them)")
    try:
        slo = metrics.parse_slo(FLAGS.slo)
        concurrencies = parse_concurrency(FLAGS.max_concurrency)
        workloads.arrival_times(0, FLAGS.request_rate, FLAGS.burstiness)  # validates rate / burstiness
        if FLAGS.dataset == "trace":
            if not FLAGS.trace_file:
                raise ValueError("--dataset=trace needs --trace_file (docs/traces.md)")
            trace = traces.read_trace(FLAGS.trace_file, speedup=FLAGS.trace_speedup, format=FLAGS.trace_format)
    except ValueError as e:  # traces.TraceError too: its message names file:line
        raise app.UsageError(str(e)) from None
    if trace is not None:
        print(f"--dataset=trace: {len(trace)} rows of {trace.path} ({trace.format}), mean rate "
              f"{trace.mean_rate:.3g} req/s over {trace.span_s:.1f} s at speedup {trace.speedup:g}: the trace's "
              "arrival times are the schedule", file=sys.stderr)
    engine_flags.validate()
    if FLAGS.num_warmup is not None and FLAGS.num_warmup < 0:
        raise app.UsageError(f"--num_warmup must be >= 0, got {FLAGS.num_warmup}")
    check_flags(trace)
    if FLAGS.backend == "openai":
        return run_openai(slo, concurrencies, trace)

    import jax

    from paged import DynamicGenerator, SamplingSettings

    t_start = time.time()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    model_tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(FLAGS.model)))
    run_name = FLAGS.run_name or f"{model_tag}_{FLAGS.dataset}_{stamp}"
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    out_path = os.path.join(FLAGS.output_dir, f"{run_name}.jsonl")

    env.load_average("at start")
    peaks = None
    if FLAGS.measure_hardware:
        peaks = hardware.measure_peaks()
        print(f"measured peaks: memory {peaks['bandwidth_gbps']:.1f} GB/s, f32 matmul "
              f"{peaks['matmul_gflops']:.1f} GFLOP/s", file=sys.stderr)

    model = engine_flags.load_model()
    finite = [c for c in concurrencies if c is not None]
    max_batch = FLAGS.max_batch_size or (max(finite) if finite else 16)
    gen = DynamicGenerator(model, **engine_flags.generator_kwargs(max_batch, max_penalty_range=0))
    t0 = time.perf_counter()
    buckets = gen.warmup(progress=FLAGS.progress) if FLAGS.compile_all_buckets else 0
    compile_s = time.perf_counter() - t0

    wl, arrivals = make_workload(trace, gen.tokenizer, gen.vocab_size, gen.max_seq_len, FLAGS.num_prompts, SEED())
    if FLAGS.temperature > 0:
        settings = SamplingSettings(temperature=FLAGS.temperature, top_k=0, top_p=1.0, repetition_penalty=1.0)
    else:
        settings = SamplingSettings.greedy()
    cost = hardware.engine_cost(gen.engine)
    cfg = model.config
    static = {
        **_record_header(run_name),
        "model": {"name": FLAGS.model, "source": getattr(model, "source", None),
                  "dtype": str(getattr(model, "dtype", FLAGS.dtype)), "quant": FLAGS.quant,
                  "params_bytes": hardware.leaf_bytes(model.params),
                  "layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                  "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab": cfg.vocab_size},
        "engine": {**gen.config.to_dict(), "usable_pages": gen.pool.num_pages, "policy": FLAGS.policy,
                   "buckets_compiled": buckets, "compile_seconds": compile_s},
        "workload": wl.describe(),
        "sampling": {"temperature": settings.temperature, "greedy": settings.is_greedy},
    }

    runs = []
    for c in concurrencies:
        load_before = env.load_average(f"before the run at {_label(c)}")
        n_warm = FLAGS.num_warmup if FLAGS.num_warmup is not None else max(2, c or gen.max_batch_size)
        warm_s = runner.warm_up(gen, wl.requests[:n_warm], gen_settings=settings, max_concurrency=c, seed=SEED())
        compiled_before = _compiled_variants()
        res = runner.run_benchmark(gen, wl.requests, gen_settings=settings, max_concurrency=c,
                                   request_rate=FLAGS.request_rate, burstiness=FLAGS.burstiness, seed=SEED(),
                                   arrivals=arrivals, progress=FLAGS.progress, desc=f"{run_name} {_label(c)}")
        compiled_after = _compiled_variants()
        compiles = None if compiled_before is None else compiled_after - compiled_before
        if compiles:
            print(f"WARNING: {compiles} step variant(s) compiled during the measured run at {_label(c)}: its "
                  "latencies include compilation (raise --num_warmup, or check that warmup() covers the shapes)",
                  file=sys.stderr)
        load_after = env.load_average()
        m = metrics.compute_metrics(res.records, res.duration, slo)
        cache = metrics.prefix_cache_stats(res.metrics_before, res.metrics_after, res.records)
        util = hardware.utilisation(cost, res.steps, res.duration, peaks)
        rec = {
            **static,
            **_point_fields(c, (load_before, load_after), min(n_warm, len(wl.requests)), warm_s, m, cache),
            "steps": res.step_summary,
            "compiles_during_run": compiles,
            "max_in_flight": res.max_in_flight,
            "max_generator_jobs": res.max_generator_jobs,
            "generator_metrics": {"final": res.metrics_after,
                                  "delta": metrics.metrics_delta(res.metrics_before, res.metrics_after)},
            "hardware": {"peak": peaks, "utilisation": util, "notes": hardware.UTILISATION_NOTES},
            "notes": ("TTFT/E2EL are measured from when a request is sent (its arrival, or when a concurrency slot "
                      "freed); token times are taken in the host loop after each iterate(). " +
                      hardware.UTILISATION_NOTES),
            "per_request": _per_request(res.records),
        }
        with open(out_path, "a") as f:
            f.write(json.dumps(jsonable(rec)) + "\n")
        rate = _rate_label(trace, wl)
        extra = [("Max concurrency:", "inf" if c is None else str(c)),
                 ("Request rate (req/s):", rate),
                 ("Engine steps:", str(res.step_summary["steps"])),
                 ("Mean rows per step:", f"{res.step_summary['mean_rows_per_step']:.2f}"),
                 ("Prefix cache page hit rate:", f"{cache['page_hit_rate']:.3f}"),
                 ("Cached prompt token fraction:", f"{cache['token_hit_rate']:.3f}")]
        if util is not None:
            extra.append(("Achieved bandwidth (GB/s):", f"{util['achieved_gbps']:.2f}"))
            extra.append(("Achieved GFLOP/s:", f"{util['achieved_gflops']:.2f}"))
            if util["bandwidth_fraction"] is not None:
                extra.append(("Fraction of peak bandwidth:", f"{util['bandwidth_fraction']:.3f}"))
                extra.append(("Fraction of peak FLOP/s:", f"{util['flops_fraction']:.3f}"))
        print(metrics.format_table(m, f"Serving Benchmark Result ({_label(c)})", extra))
        runs.append((c, res, m))

    if FLAGS.plot:
        title = f"{FLAGS.model} {FLAGS.dataset}, rate {FLAGS.request_rate if trace is None else 'trace'}"
        _write_plots(runs, run_name, title)
    print(f"wrote {len(runs)} record(s) to {out_path} in {time.time() - t_start:.1f} s "
          f"({jax.default_backend()})", file=sys.stderr)
    return runs


def run_openai(slo: dict, concurrencies: list, trace) -> list:
    """--backend=openai: the benchmark against the server at --base_url (module docstring); the same records, with
    `backend` and the server's counters instead of the engine's steps and utilisation."""
    from experiments.lib.serving import env, http_client, metrics

    try:
        extra_body = json.loads(FLAGS.extra_body)
    except ValueError as e:
        raise app.UsageError(f"--extra_body is not JSON: {e}") from None
    if not isinstance(extra_body, dict):
        raise app.UsageError(f"--extra_body must be a JSON object, got {FLAGS.extra_body!r}")
    try:
        info = http_client.server_info(FLAGS.base_url)
    except Exception as e:  # noqa: BLE001 (any failure to reach it is the same usage error)
        raise app.UsageError(f"--base_url={FLAGS.base_url}: no OpenAI-compatible server answered GET /v1/models "
                             f"({type(e).__name__}: {e})") from None
    served = FLAGS.served_model or info["id"]
    max_seq_len = info.get("max_model_len") or FLAGS.max_seq_len
    model = engine_flags.load_model()  # the workload's vocabulary (and tokenizer, for --prompt_format=text)
    vocab, tok = model.config.vocab_size, model.tokenizer
    del model

    t_start = time.time()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    model_tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(served)))
    run_name = FLAGS.run_name or f"openai_{model_tag}_{FLAGS.dataset}_{stamp}"
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    out_path = os.path.join(FLAGS.output_dir, f"{run_name}.jsonl")
    env.load_average("at start")
    wl, arrivals = make_workload(trace, tok, vocab, max_seq_len, FLAGS.num_prompts, SEED())
    body = dict(temperature=FLAGS.temperature, prompt_format=FLAGS.prompt_format, tokenizer=tok,
                extra_body=extra_body, timeout=FLAGS.request_timeout_s)
    static = {
        **_record_header(run_name),
        "backend": {"name": "openai", "base_url": FLAGS.base_url, "served_model": served, "server_model": info,
                    "prompt_format": FLAGS.prompt_format, "extra_body": extra_body},
        "model": {"name": FLAGS.model, "vocab": vocab, "note": "the workload's vocabulary; the server runs its own"},
        "workload": wl.describe(),
        "sampling": {"temperature": FLAGS.temperature, "greedy": FLAGS.temperature == 0},
    }
    runs = []
    for c in concurrencies:
        load_before = env.load_average(f"before the run at {_label(c)}")
        n_warm = FLAGS.num_warmup if FLAGS.num_warmup is not None else max(2, c or 16)
        t0 = time.perf_counter()
        if n_warm:  # prompts of their own (another seed): the measured ones must not find theirs cached
            warm, _ = make_workload(None if trace is None else trace, tok, vocab, max_seq_len, n_warm, SEED() + 1)
            http_client.run_http_benchmark(FLAGS.base_url, served, warm.requests[:n_warm], max_concurrency=c,
                                           seed=SEED(), **body)
        warm_s = time.perf_counter() - t0
        res = http_client.run_http_benchmark(
            FLAGS.base_url, served, wl.requests, max_concurrency=c, request_rate=FLAGS.request_rate,
            burstiness=FLAGS.burstiness, seed=SEED(), arrivals=arrivals, progress=FLAGS.progress,
            desc=f"{run_name} {_label(c)}", **body)
        load_after = env.load_average()
        m = metrics.compute_metrics(res.records, res.duration, slo)
        cache = metrics.prefix_cache_stats(res.server_before, res.server_after, res.records)
        rec = {
            **static,
            **_point_fields(c, (load_before, load_after), n_warm, warm_s, m, cache),
            "max_in_flight": res.max_in_flight,
            "server_metrics": {"final": res.server_after,
                               "delta": metrics.metrics_delta(res.server_before, res.server_after)},
            "notes": ("Measured over HTTP by the client: TTFT/E2EL from when a request is sent (its arrival, or when a "
                      "concurrency slot freed) to when its first / last token's chunk was read; a chunk of k tokens "
                      "(usage.completion_tokens growth) gives k equal token times."),
            "per_request": _per_request(res.records),
        }
        with open(out_path, "a") as f:
            f.write(json.dumps(jsonable(rec)) + "\n")
        rate = _rate_label(trace, wl)
        extra = [("Backend:", "openai"), ("Max concurrency:", "inf" if c is None else str(c)),
                 ("Request rate (req/s):", rate), ("Max requests in flight:", str(res.max_in_flight)),
                 ("Prefix cache page hit rate:", f"{cache['page_hit_rate']:.3f}"),
                 ("Cached prompt token fraction:", f"{cache['token_hit_rate']:.3f}")]
        print(metrics.format_table(m, f"Serving Benchmark Result ({_label(c)}, HTTP)", extra))
        runs.append((c, res, m))
    if FLAGS.plot:
        title = f"{served} over HTTP, {FLAGS.dataset}, rate {FLAGS.request_rate if trace is None else 'trace'}"
        _write_plots(runs, run_name, title)
    print(f"wrote {len(runs)} record(s) to {out_path} in {time.time() - t_start:.1f} s (over HTTP)",
          file=sys.stderr)
    return runs


def _record_header(run_name: str) -> dict:
    """What every record of this run starts with, whatever the backend."""
    from experiments.lib.serving import env

    return {"schema": SCHEMA, "run_name": run_name, "flags": {k: FLAGS[k].value for k in OUR_FLAGS},
            "git": env.git_info(), "device": env.device_info(), "versions": env.versions()}


def _point_fields(c, loads: tuple, n_warm: int, warm_s: float, m: dict, cache: dict) -> dict:
    """One load point's fields of a record (both backends)."""
    return {"timestamp": datetime.datetime.now().isoformat(timespec="seconds"), "max_concurrency": c,
            "request_rate": FLAGS.request_rate, "burstiness": FLAGS.burstiness, "load_avg_before": loads[0],
            "load_avg_after": loads[1], "warmup_requests": n_warm, "warmup_seconds": warm_s, "metrics": m,
            "prefix_cache": cache}


def _per_request(records) -> list[dict]:
    return [{"index": r.index, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
             "cached_tokens": r.cached_tokens, "prefix_id": r.prefix_id, "priority": r.priority,
             "deadline": r.deadline, "scheduled": r.scheduled,
             "arrival": r.arrival, "ttft": r.ttft if r.token_times else None,
             "e2el": r.e2el if r.token_times else None, "tpot": r.tpot, "error": r.error or None,
             **({"token_times": r.token_times} if FLAGS.save_detailed else {})}
            for r in records]


def _rate_label(trace, wl) -> str:
    return str(FLAGS.request_rate) if trace is None else f"trace ({wl.params['mean_rate']:.3g} mean)"


def _write_plots(runs: list, run_name: str, title: str) -> None:
    """The latency CDFs of every run, and throughput / TPOT against concurrency when several were swept."""
    from experiments.lib.serving import plots

    paths = [plots.plot_latency_cdfs([(_label(c), res.records) for c, res, _ in runs],
                                     os.path.join(FLAGS.output_dir, f"{run_name}_latency_cdf.png"), title)]
    if len(runs) > 1 and all(c is not None for c, _, _ in runs):
        paths.append(plots.plot_sweep([(c, m["output_throughput"], m["tpot_ms"]["median"]) for c, _, m in runs],
                                      os.path.join(FLAGS.output_dir, f"{run_name}_sweep.png"), title))
    for p in paths:
        print(f"wrote {p}", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
