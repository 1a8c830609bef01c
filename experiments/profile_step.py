"""Where a decode step's time goes: the host loop (scheduling, batch building, dispatch, turning samples into
results) against the device (waiting for the jitted step), and inside the device step, the layers' matmuls against
paged attention against logits + sampling.

    python -m experiments.profile_step --model smollm2-135m --concurrency 1,16,64 --context 256 \
        --json_out experiments/results/profile_smollm2_cpu.json

Host loop: `--concurrency` jobs of `--context` prompt tokens each are prefilled, then `--tokens` steps with every
job decoding are timed through `DynamicGenerator` (greedy, no stop tokens), after an untimed run of the same shape;
the generator's and engine's timers (`generator.metrics()["time_*"]`) split the wall time of those steps.
Device: the same decode batch shape is timed as the whole step and as its parts, each jitted alone — the layer
stack with attention replaced by a pass-through (matmuls, norms, rope; KV writes skipped), `num_layers` calls of
paged attention over one layer's cache, and final norm + LM head + the sampler. Parts are timed separately, so
they need not add up exactly to the step (fusion across parts, cache effects).

With `--fit_out PATH` it instead fits the simulator's `StepTimeModel` (`paged.sim`) and saves it as JSON naming the
device, the model and the setup, after compiling every bucket of the engine the policy comparison uses
(`--fit_max_batch_size`, `--fit_max_seq_len`, max_chunk_size 256). What it fits on (`--fit_source`):

- `both` (the default): every step of the generator serving a calibration workload (random prompts of their own
  seed) at each closed-loop concurrency of `--serving_concurrency`, each `Engine.run` timed where it ran, plus the
  grid's shapes with a prefill chunk (below), which serving meets rarely: a decode step in a serving loop costs
  more than the same shape timed alone (~12% on the 2-core CPU host: the host thread's work beside the device's,
  caches no longer warm from an identical previous call), a prefill step the same within ~2%;
- `serving`: the serving steps alone;
- `grid`: a grid of step shapes (`--grid_prefill` tokens of one prefill chunk x `--grid_decode` decode rows x
  `--grid_context` tokens of context per row, plus mixed-context decode steps), each timed alone, in
  `--grid_passes` passes (a shape's time: the mean of its passes' medians; on a shared host the machine's speed
  changes from one ten seconds to the next).

The generator's host overhead per step (outside `Engine.run`) is added to the fit's base.

    python -m experiments.profile_step --model smollm2-135m \
        --fit_out experiments/results/step_time_smollm2_cpu.json
"""

from __future__ import annotations

import os
import platform
import time

from absl import app, flags

from experiments.lib.common import check_out_flag, write_record
from experiments.lib.step_timing import prefill, time_decode

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "'tiny', the embedded name, an HF dir or a .gguf")
flags.DEFINE_string("quant", "keep", "weights: keep (GGUF blocks as stored), none (dequantized), int8, int4")
flags.DEFINE_list("concurrency", ["1", "16"], "decode rows (concurrent jobs)")
flags.DEFINE_integer("context", 256, "prompt tokens per job")
flags.DEFINE_integer("tokens", 32, "decode tokens per job in the measured phase")
flags.DEFINE_integer("page_size", 64, "tokens per page")
flags.DEFINE_string("cache_dtype", "float32", "KV cache dtype")
flags.DEFINE_string("dtype", "float32", "float weights' dtype: float32, bfloat16 or float16")
flags.DEFINE_integer("iters", 5, "timed calls per device part")
flags.DEFINE_string("json_out", None, "write the breakdown here")
check_out_flag("json_out")
flags.DEFINE_string("fit_out", None, "fit the simulator's StepTimeModel over the shape grid and write it here "
                    "(instead of the breakdown)")
check_out_flag("fit_out")
flags.DEFINE_list("grid_prefill", ["0", "16", "64", "128", "256"], "fit: prefill chunk tokens (0 = none)")
flags.DEFINE_list("grid_decode", ["0", "1", "2", "4", "8", "15"], "fit: decode rows")
flags.DEFINE_list("grid_context", ["32", "256", "768"], "fit: context tokens per row before the step")
flags.DEFINE_bool("grid_mixed", True, "fit: also decode steps with one row at each context and the others at "
                  "the shortest (attention reads every row to the longest row's context bucket)")
flags.DEFINE_enum("fit_source", "both", ["both", "serving", "grid"], "fit: what the fit is measured on: "
                  "'serving' (every step of the generator serving a calibration workload, timed where it ran), "
                  "'grid' (the grid's shapes, each timed alone) or 'both' (serving's steps and the grid's shapes "
                  "with a prefill chunk)")
flags.DEFINE_integer("grid_passes", 3, "fit: passes over the grid (a shape's time: the mean of its passes' medians)")
flags.DEFINE_list("serving_concurrency", ["1", "4", "16"], "fit (serving): closed-loop concurrencies to serve at")
flags.DEFINE_list("serving_prompts", ["64", "256"], "fit (serving): prompt lengths to serve at each concurrency "
                  "(+-90%; outputs half as long): short and long contexts, as attention's cost per token differs "
                  "with how many rows share a step")
flags.DEFINE_integer("serving_requests_per_row", 4, "fit (serving): requests per unit of concurrency and prompt "
                     "length")
flags.DEFINE_integer("serving_seed", 1000, "fit (serving): the calibration prompts' seed (apart from the workloads "
                     "a validation replays, seed 0 by default)")
flags.DEFINE_integer("fit_narrow_tokens", -1, "fit: the widest step (token slots) of the narrow matmul path, priced "
                     "apart by the wide_step term; -1: detect (the native CPU kernel's rows for the model's weights, "
                     "else 0: no such term)")
flags.DEFINE_integer("fit_max_batch_size", 16, "fit: the engine's max_batch_size (as compare_policies uses)")
flags.DEFINE_integer("fit_max_seq_len", 1024, "fit: the engine's max_seq_len (as compare_policies uses)")
flags.DEFINE_string("fit_name", None, "fit: its name, e.g. cpu_epyc_smollm2_q4 (hardware + model + setup; default: "
                    "the --fit_out file's stem)")


def host_breakdown(model, rows: int) -> dict:
    """Steady state of `rows` concurrent decoding jobs through the generator: every job is prefilled first, then
    `FLAGS.tokens` steps are timed with all `rows` jobs decoding, and the wall time is split with the timers
    (`experiments.lib.step_timing`)."""
    import numpy as np

    from paged import DynamicGenerator, Job, SamplingSettings

    ctx, n = FLAGS.context, FLAGS.tokens
    budget = rows + 2 * n + 8  # jobs prefill one per step, so the first ones decode while the rest prefill
    ps = FLAGS.page_size
    gen = DynamicGenerator(model, page_size=ps, max_batch_size=rows, max_chunk_size=256,
                           max_seq_len=-(-(ctx + budget) // ps) * ps, cache_dtype=FLAGS.cache_dtype,
                           max_penalty_range=0)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def run():
        prefill(gen, [Job(rng.integers(0, vocab, size=ctx).tolist(), budget, gen_settings=SamplingSettings.greedy())
                      for _ in range(rows)])
        window = time_decode(gen, n)
        gen.clear_queue()
        return window

    run()  # the same run once untimed: compiles every bucket it touches
    w = run()
    split = w.split_ms()
    rec = dict(rows=rows, steps=w.steps, tokens_per_s=w.tokens_per_s, ms_per_step=w.ms_per_step,
               **{k: split[k] for k in ("schedule_ms", "build_ms", "dispatch_ms", "device_wait_ms", "results_ms")})
    rec["host_ms"] = rec["ms_per_step"] - rec["device_wait_ms"]
    rec["host_frac"] = rec["host_ms"] / rec["ms_per_step"]
    return rec


def device_breakdown(model, rows: int) -> dict:
    """Time the decode step for `rows` rows and its parts, each jitted alone."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.lib.serving.hardware import best_time
    from models.llama import compute_logits, embed_tokens, run_layers
    from paged.device.batch import RowInput, build_batch
    from paged.device.engine import Engine
    from paged.device.sampling import sample
    from pallas_kernels.paged_attention import layout_query_start, paged_attention

    cfg, params = model.config, model.params
    ps = FLAGS.page_size
    per_row = -(-(FLAGS.context + 1) // ps)
    eng = Engine(model, num_pages=1 + rows * per_row, page_size=ps, max_batch_size=rows, max_chunk_size=256,
                 max_seq_len=per_row * ps, cache_dtype=FLAGS.cache_dtype, max_penalty_range=0)
    pages = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(rows)]
    row_inputs = [RowInput(tokens=[1], start_pos=FLAGS.context, pages=p) for p in pages]
    shape = eng.shape_for(row_inputs)
    batch, _ = build_batch(row_inputs, shape, ps, eng.vocab_size)

    def full(b):  # the engine's step: forward + sampler, as `Engine.run` dispatches it
        return eng._dispatch(b, shape, False, 1).token

    h0 = embed_tokens(params, batch.token_ids)

    @jax.jit
    def layers_no_attention(params, h, pos):  # params as an argument: closed over, they would become constants
        return run_layers(params, cfg, h, pos, lambda layer, q, k, v, kv: (q, kv), None, eng.matmul_impl)[0]

    lay = shape.layout
    qs = layout_query_start(lay)
    kc, vc = eng.state.k[0], eng.state.v[0]
    q = jnp.zeros((lay.num_tokens, cfg.num_heads, cfg.head_dim), jnp.float32)
    read = -(-(FLAGS.context + 1) // ps)  # attention reads the context bucket holding the rows (run-time choice)
    used_pages = next((p for p in shape.page_buckets if p >= read), shape.pages_per_row)
    table = batch.page_table[:, :used_pages]

    @jax.jit
    def attention_all_layers(q, kc, vc):
        def body(o, _):
            o = paged_attention(o, kc, vc, qs, batch.query_lens, batch.kv_lens, table,
                                sm_scale=cfg.head_dim**-0.5, impl=eng.attn_impl, layout=lay)
            return o, None

        return jax.lax.scan(body, q, None, length=cfg.num_layers)[0]

    @jax.jit
    def logits_and_sample(params, h):
        logits = compute_logits(params, cfg, h, eng.matmul_impl)
        return sample(logits, batch.sampling, positions=batch.kv_lens, history=batch.history,
                      bias_ids=batch.bias_ids, bias_values=batch.bias_values).token

    it = FLAGS.iters
    rec = dict(rows=rows, shape=str(dataclasses.asdict(shape)), pages_read=used_pages,
               step_ms=1e3 * best_time(lambda: full(batch), it),
               layers_without_attention_ms=1e3 * best_time(
                   lambda: layers_no_attention(params, h0, batch.positions), it),
               attention_ms=1e3 * best_time(lambda: attention_all_layers(q, kc, vc), it),
               logits_sampling_ms=1e3 * best_time(lambda: logits_and_sample(params, h0[: shape.num_rows]), it))
    kv_item = np.dtype(eng.state.k.dtype).itemsize
    keys = used_pages * ps
    rec["attention_bytes_per_step"] = 2 * rows * keys * cfg.num_kv_heads * cfg.head_dim * kv_item * cfg.num_layers
    return rec


def fit_setup(eng) -> dict:
    """What the fit is measured on (paged.sim.SETUP_KEYS): host, kernels, model, weights, cache, date, commit."""
    import datetime

    from experiments.lib.serving import env

    c = eng.config
    name = FLAGS.fit_name or os.path.splitext(os.path.basename(FLAGS.fit_out or "step_time"))[0]
    return {"name": name, **env.host_setup(), "model": FLAGS.model, "quantization": FLAGS.quant, "dtype": FLAGS.dtype,
            "attn_impl": c.attn_impl, "matmul_impl": c.matmul_impl, "kernels": env.matmul_auto(),
            "cache_dtype": c.cache_dtype, "page_size": c.page_size, "max_batch_size": c.max_batch_size,
            "max_seq_len": c.max_seq_len, "date": datetime.date.today().isoformat(), "commit": env.git_info()}


def grid_samples(eng, prefill_only: bool = False) -> tuple[list, list[float], list[dict]]:
    """`Engine.run` wall time of every grid shape, each timed alone: `--grid_passes` passes over the whole grid,
    each calling every shape once untimed and `--iters` times timed; a shape's time is the mean over the passes of
    each pass's median. Passes minutes apart average over the machine's speed, which on a shared host changes from
    one ten seconds to the next (the 2-core EPYC VM: a 200-token prefill takes 70 or 86 ms). `prefill_only`: only
    the shapes with a prefill chunk."""
    import numpy as np

    from paged.device.batch import RowInput
    from paged.sim import StepShape

    ps, batch, seq = FLAGS.page_size, FLAGS.fit_max_batch_size, FLAGS.fit_max_seq_len
    per_row = eng.config.max_pages_per_row
    contexts, prefills, decodes = ([int(x) for x in v] for v in (FLAGS.grid_context, FLAGS.grid_prefill,
                                                                   FLAGS.grid_decode))
    # every row at context c; then (--grid_mixed) decode steps whose first row is at c and the others at the
    # shortest context, as in serving, where attention reads every row up to the longest one's context bucket
    grid = [(c, p, d, c) for c in contexts for p in prefills for d in decodes]
    if FLAGS.grid_mixed:
        grid += [(c, 0, d, min(contexts)) for c in contexts if c > min(contexts) for d in decodes if d >= 2]
    cases = []
    for c, p, d, c_rest in grid:
        if (p == 0 and (d == 0 or prefill_only)) or d + (p > 0) > batch or c + max(p, 1) > seq:
            continue
        rows = []
        for r in range(d + (p > 0)):
            n = p if (p and r == 0) else 1
            ctx = c if r == 0 else c_rest
            pages = list(range(1 + r * per_row, 1 + (r + 1) * per_row))[: -(-(ctx + n) // ps)]
            rows.append(RowInput(tokens=[7] * n, start_pos=ctx, pages=pages))
        if 1 + len(rows) * per_row <= eng.config.num_pages:
            cases.append(((p, d, c, c_rest), rows))
    passes = [[] for _ in cases]
    for _ in range(FLAGS.grid_passes):
        for i, (_, rows) in enumerate(cases):
            eng.run(rows)  # untimed: first touch
            times = []
            for _ in range(FLAGS.iters):
                t = time.perf_counter()
                eng.run(rows)
                times.append(time.perf_counter() - t)
            passes[i].append(float(np.median(times)))
    shapes, seconds, points = [], [], []
    for ((p, d, c, c_rest), rows), per_pass in zip(cases, passes):
        shape = StepShape.from_rows(rows, eng.spec)
        shapes.append(shape)
        seconds.append(float(np.mean(per_pass)))
        points.append(dict(prefill=p, decode=d, context=c, other_context=c_rest, seconds=seconds[-1],
                           passes=per_pass, **shape.__dict__))
        print(f"prefill {p:4d} decode {d:3d} context {c:5d}/{c_rest:5d}: {1e3 * seconds[-1]:8.2f} ms (passes "
              f"{1e3 * min(per_pass):.2f}-{1e3 * max(per_pass):.2f})")
    return shapes, seconds, points


def host_per_step(before: dict, after: dict) -> float:
    """The generator's seconds per step outside `Engine.run` (admission and planning, results) between two
    `generator.metrics()`."""
    d = lambda k: after[k] - before[k]
    return (d("time_schedule_s") + d("time_results_s")) / max(d("steps"), 1)


def serving_samples(eng, model) -> tuple[list, list[float], float, list[dict]]:
    """Every step of real serving, timed where it ran: the generator (policy `exllamav2`) serves a calibration
    workload of random prompts (each length of `--serving_prompts`) at each closed-loop concurrency of
    `--serving_concurrency`, and each `Engine.run`'s wall time is recorded with its rows
    (`experiments.lib.serving.runner.EngineProbe`). A step in a serving loop costs more than the same shape timed
    alone in a loop of its own (on the 2-core CPU host, decode steps ~12% more: the host thread's work beside the
    device's, caches no longer warm from the previous identical call), so a fit on these prices what a simulated
    serving run's steps cost. The calibration prompts are drawn from their own
    seed, apart from any workload a validation replays. Returns the step shapes, their seconds, the generator's
    host seconds per step and one summary per (concurrency, prompt length)."""
    import types

    from experiments.lib.serving import runner, workloads
    from paged import DynamicGenerator
    from paged.sim import StepShape

    shapes, seconds, levels = [], [], []
    host_s, host_steps = 0.0, 0
    runs = [(c, int(p)) for c in (int(c) for c in FLAGS.serving_concurrency) for p in FLAGS.serving_prompts]
    for i, (conc, prompt) in enumerate(runs):
        n, output = FLAGS.serving_requests_per_row * conc, max(prompt // 2, 4)
        wl = workloads.random_workload(n, prompt, output, vocab_size=model.config.vocab_size, range_ratio=0.9,
                                       seed=FLAGS.serving_seed + i, max_seq_len=eng.config.max_seq_len)
        gen = DynamicGenerator(engine=eng, policy="exllamav2")
        t0 = time.perf_counter()
        res = runner.run_benchmark(gen, wl.requests, max_concurrency=conc)
        steps = [s for s in res.steps if s.num_steps == 1]
        for s in steps:
            rows = [types.SimpleNamespace(start_pos=st, tokens=range(k), sample=smp) for st, k, smp in s.rows]
            shapes.append(StepShape.from_rows(rows, eng.spec))
            seconds.append(s.wall)
        h = host_per_step(res.metrics_before, res.metrics_after)
        host_s += h * len(res.steps)
        host_steps += len(res.steps)
        walls = [s.wall for s in steps]
        levels.append(dict(concurrency=conc, prompt_tokens=prompt, output_tokens=output, requests=n, steps=len(steps),
                           seconds=time.perf_counter() - t0, mean_step_s=sum(walls) / max(len(walls), 1),
                           host_s_per_step=h))
        print(f"serving at concurrency {conc:3d}, prompts {prompt:4d} +-90%: {n} requests, {len(steps)} steps, mean "
              f"Engine.run {1e3 * levels[-1]['mean_step_s']:.2f} ms + host {1e3 * h:.2f} ms "
              f"({levels[-1]['seconds']:.1f} s)")
    return shapes, seconds, host_s / max(host_steps, 1), levels


def fit_step_time(model) -> dict:
    """Fit the simulator's step-time model on `--fit_source`'s samples, plus the host loop's overhead per step."""
    import numpy as np

    from experiments.lib.serving import env
    from paged import DynamicGenerator, Job, SamplingSettings
    from paged.device.config import EngineConfig
    from paged.device.engine import Engine
    from paged.sim import StepTimeModel

    batch = FLAGS.fit_max_batch_size
    cfg = EngineConfig(page_size=FLAGS.page_size, max_batch_size=batch, max_chunk_size=256,
                       max_seq_len=FLAGS.fit_max_seq_len, cache_dtype=FLAGS.cache_dtype, max_penalty_range=0)
    eng = Engine(model, cfg)
    t0 = time.perf_counter()
    eng.warmup()
    print(f"compiled every bucket in {time.perf_counter() - t0:.1f} s")
    shapes, seconds, points, levels = [], [], [], []
    if FLAGS.fit_source in ("grid", "both"):  # (with serving: its decode steps price decoding, timed where they ran)
        shapes, seconds, points = grid_samples(eng, prefill_only=FLAGS.fit_source == "both")
    if FLAGS.fit_source in ("serving", "both"):
        s, t, host, levels = serving_samples(eng, model)
        shapes, seconds = shapes + s, seconds + t
    else:  # the host loop around the engine call (admission, planning, results) on a short decode-heavy run
        gen = DynamicGenerator(engine=eng)
        rng = np.random.default_rng(0)
        gen.enqueue([Job(rng.integers(0, model.config.vocab_size, 64).tolist(), 48,
                         gen_settings=SamplingSettings.greedy()) for _ in range(batch // 2)])
        m0 = gen.metrics()
        while gen.num_remaining_jobs():
            gen.iterate()
        host = host_per_step(m0, gen.metrics())
    device = env.device_info()
    device_name = f"{device['cpu_model'] or device['device_kind']} ({device['backend']}, {device['cpus_usable']} cores)"
    narrow = FLAGS.fit_narrow_tokens if FLAGS.fit_narrow_tokens >= 0 else env.narrow_path_tokens(model, eng)
    what = {"grid": f"{len(points)} grid shapes, each timed alone",
            "serving": f"{len(shapes)} steps of serving at concurrency {','.join(FLAGS.serving_concurrency)}",
            "both": f"{len(points)} grid shapes with a prefill chunk and {len(shapes) - len(points)} steps of "
                    "serving"}[FLAGS.fit_source]
    fit = StepTimeModel.fit(shapes, seconds, device=device_name, model=FLAGS.model, narrow_tokens=narrow,
                            notes=f"fitted by experiments/profile_step.py on {what}; base_s includes the host "
                            f"loop's {1e3 * host:.2f} ms per step outside Engine.run",
                            setup=fit_setup(eng))
    fit.base_s += host
    fit.fit_stats.update(source=FLAGS.fit_source, host_s_per_step=host, load_avg=env.load_average(), grid=points,
                         serving=levels, engine=eng.config.to_dict())
    return fit


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    import jax

    from experiments.lib.common import load_experiment_model

    model = load_experiment_model(FLAGS.model, dtype=FLAGS.dtype, quant=None if FLAGS.quant == "none" else FLAGS.quant)
    load = os.getloadavg()
    if load[0] > 0.5:
        print(f"warning: load average {load[0]:.2f}; timings are only valid on an idle machine")
    if FLAGS.fit_out:
        fit = fit_step_time(model)
        fit.save(FLAGS.fit_out)
        print(f"fit: base {1e3 * fit.base_s:.2f} ms + " + " + ".join(
            f"{1e6 * c:.2f} us x {f}" for f, c in fit.coef.items()) + f"; mean |rel error| "
            f"{fit.fit_stats['mean_abs_rel_error']:.3f} over {fit.fit_stats['samples']} shapes -> {FLAGS.fit_out}")
        return
    out = []
    for rows in (int(c) for c in FLAGS.concurrency):
        host = host_breakdown(model, rows)
        dev = device_breakdown(model, rows)
        out.append(dict(host=host, device=dev))
        print(f"{rows:3d} rows: {host['tokens_per_s']:7.1f} tok/s, {host['ms_per_step']:6.1f} ms/step = host "
              f"{host['host_ms']:5.1f} (schedule {host['schedule_ms']:.1f}, build {host['build_ms']:.1f}, dispatch "
              f"{host['dispatch_ms']:.1f}, results {host['results_ms']:.1f}) + device wait "
              f"{host['device_wait_ms']:.1f}")
        print(f"          device: step {dev['step_ms']:.1f} ms; parts: layers w/o attention "
              f"{dev['layers_without_attention_ms']:.1f}, attention {dev['attention_ms']:.1f}, logits+sampling "
              f"{dev['logits_sampling_ms']:.1f}")
    if FLAGS.json_out:
        write_record(FLAGS.json_out, dict(
            model=FLAGS.model, quant=FLAGS.quant, context=FLAGS.context, tokens=FLAGS.tokens,
            cache_dtype=FLAGS.cache_dtype, device=str(jax.devices()[0]), machine=platform.machine(),
            cpus=os.cpu_count(), load_avg_before=load, load_avg_after=os.getloadavg(), jax=jax.__version__,
            results=out))


if __name__ == "__main__":
    app.run(main)
