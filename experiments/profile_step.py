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
(`--fit_max_batch_size`, `--fit_max_seq_len`, max_chunk_size 256). What it fits on (`--fit_source`: `both`, the
default, `serving` or `grid`; `--grid_*`, `--serving_*`) is `experiments/lib/calibration.py`'s: every step of the
generator serving a calibration workload, timed where it ran, plus the grid's prefill shapes, each timed alone in
`--grid_passes` passes. `experiments/validate_sim.py --fit_interleaved` measures the same fit in slices between its
real runs instead.

    python -m experiments.profile_step --model smollm2-135m \
        --fit_out experiments/results/step_time_smollm2_cpu.json
"""

from __future__ import annotations

import os
import platform

from absl import app, flags

from experiments.lib import calibration
from experiments.lib.common import check_out_flag, int_list_flag, write_record
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
calibration.define_flags()  # --fit_source, --grid_*, --serving_*: what the fit is measured on
flags.DEFINE_integer("grid_passes", 3, "fit: passes over the grid (a shape's time: the mean of its passes' medians)")
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


def fit_step_time(model):
    """Fit the simulator's step-time model on `--fit_source`'s samples: one slice of `--grid_passes` passes over the
    grid, then the serving workload once."""
    eng = calibration.fit_engine(model, calibration.fit_config(
        page_size=FLAGS.page_size, max_batch_size=FLAGS.fit_max_batch_size, max_seq_len=FLAGS.fit_max_seq_len,
        cache_dtype=FLAGS.cache_dtype))
    cal = calibration.Calibration(model, eng, calibration.plan_of_flags(iters=FLAGS.iters))
    cal.run_slice(grid_passes=FLAGS.grid_passes)
    for point in cal.grid_points()[2]:
        per_pass = point["passes"]
        print(f"prefill {point['prefill']:4d} decode {point['decode']:3d} context {point['context']:5d}/"
              f"{point['other_context']:5d}: {1e3 * point['seconds']:8.2f} ms (passes "
              f"{1e3 * min(per_pass):.2f}-{1e3 * max(per_pass):.2f})")
    name = FLAGS.fit_name or os.path.splitext(os.path.basename(FLAGS.fit_out or "step_time"))[0]
    setup = calibration.fit_setup(eng, name=name, model=FLAGS.model, quantization=FLAGS.quant, dtype=FLAGS.dtype)
    return cal.fit(model_name=FLAGS.model, setup=setup, by="experiments/profile_step.py",
                   narrow_tokens=None if FLAGS.fit_narrow_tokens < 0 else FLAGS.fit_narrow_tokens)


def check_flags() -> None:
    """Every flag checked before the model loads: app.UsageError naming the flag."""
    from experiments.lib.common import check_quant_flag
    from models.loader import DTYPES
    from paged.device.engine import MIN_PAGE_SIZE
    from paged.errors import InvalidConfigError

    for name in ("context", "tokens", "iters"):
        if getattr(FLAGS, name) < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    ps = FLAGS.page_size
    if ps < MIN_PAGE_SIZE or ps & (ps - 1):
        raise app.UsageError(f"--page_size must be a power of two >= {MIN_PAGE_SIZE}, got {ps}")
    if FLAGS.dtype not in DTYPES:
        raise app.UsageError(f"--dtype={FLAGS.dtype} is not one of: {', '.join(DTYPES)}")
    check_quant_flag("quant")
    try:
        if FLAGS.fit_out:
            for name in ("fit_max_batch_size", "fit_max_seq_len", "grid_passes"):
                if getattr(FLAGS, name) < 1:
                    raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
            calibration.plan_of_flags()
            calibration.fit_config(page_size=FLAGS.page_size, max_batch_size=FLAGS.fit_max_batch_size,
                                   max_seq_len=FLAGS.fit_max_seq_len, cache_dtype=FLAGS.cache_dtype)
        else:
            calibration.fit_config(page_size=FLAGS.page_size, max_batch_size=max(int_list_flag("concurrency")),
                                   max_seq_len=FLAGS.context + FLAGS.tokens, cache_dtype=FLAGS.cache_dtype)
    except InvalidConfigError as e:  # the engine's own checks of --page_size, --cache_dtype, ...
        raise app.UsageError(str(e).replace("EngineConfig: ", "--", 1)) from None


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    check_flags()
    import jax

    from experiments.lib.common import load_experiment_model, model_flag

    with model_flag("model", FLAGS.model):
        model = load_experiment_model(FLAGS.model, dtype=FLAGS.dtype,
                                      quant=None if FLAGS.quant == "none" else FLAGS.quant)
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
    for rows in int_list_flag("concurrency"):
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
