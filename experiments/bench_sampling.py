"""Time `paged.device.sampling.sample` per setting, and its compile time.

    python -m experiments.bench_sampling --rows 64 --vocab 49152 --iters 20
    python -m experiments.bench_sampling --only none --greedy_final_rows 1,5,16 --iters 400 --compile_rows ""

Every row of a batch uses the same setting (so the batch pays for exactly that filter); all sampling settings use
temperature 0.8 and repetition penalty 1.025 over a [rows, 256] history, as the default sampler does. Logits are
Gaussian with a few boosted tokens, roughly like a language model's. Prints milliseconds per call (median and min
of `--iters` timed calls after a warm-up) and the time to lower + compile `jax.jit(sample)` for `--compile_rows`.
`--module` benchmarks another copy of the sampler with the same API (e.g. an older version on PYTHONPATH); settings
that copy does not know are skipped. The full sampler's options run with packed DRY breakers and XTC exempt sets
(`--json_out` writes every figure). Timings on a shared machine are only meaningful when it is idle (check `uptime`).
"""

from __future__ import annotations

import time

from absl import app, flags

from experiments.lib.common import check_out_flag

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 64, "batch rows S")
flags.DEFINE_integer("vocab", 49152, "vocabulary size V")
flags.DEFINE_integer("iters", 20, "timed calls per setting")
flags.DEFINE_integer("history", 256, "penalty history length R")
flags.DEFINE_list("only", [], "run only these settings (names as printed)")
flags.DEFINE_list("compile_rows", ["4", "64"], "batch sizes to time the compilation for")
flags.DEFINE_string("module", "paged.device.sampling", "module providing SamplingRows and sample")
flags.DEFINE_list("greedy_final_rows", [], "also time paged.device.sampling.greedy_final's two formulations alone "
                  "(XLA's ops, the native kernel) at these row counts (the installed sampler's, whatever --module)")
if "json_out" not in FLAGS:
    flags.DEFINE_string("json_out", None, "write the figures here as JSON")
    check_out_flag("json_out")

BASE = {"temperature": 0.8, "repetition_penalty": 1.025}
SETTINGS = {
    "greedy": {"temperature": 0.0, "repetition_penalty": 1.025},
    # nothing adjusts the logits: `greedy_final` (on the CPU the native kernel; JPG_NATIVE_GREEDY=0: XLA's ops)
    "plain greedy": {"temperature": 0.0},
    "temperature": BASE,
    "top_k=50": {**BASE, "top_k": 50},
    "top_p=0.8": {**BASE, "top_p": 0.8},
    "top_k+top_p (default)": {**BASE, "top_k": 50, "top_p": 0.8},
    "min_p=0.05": {**BASE, "min_p": 0.05},
    "typical=0.9": {**BASE, "typical": 0.9},
    "all": {**BASE, "top_k": 50, "top_p": 0.8, "min_p": 0.05, "typical": 0.9},
    # ExLlamaV2's full sampler, each on top of the default truncation
    "dry": {**BASE, "top_k": 50, "top_p": 0.8, "dry_multiplier": 0.8},
    "xtc": {**BASE, "top_k": 50, "top_p": 0.8, "xtc_probability": 0.5, "xtc_threshold": 0.05},
    "mirostat": {**BASE, "top_k": 50, "top_p": 0.8, "mirostat": 1, "mirostat_mu": 3.0},
    "dynamic temperature": {**BASE, "top_k": 50, "top_p": 0.8, "min_temp": 0.5, "max_temp": 1.5},
    "temperature_last": {**BASE, "top_k": 50, "top_p": 0.8, "temperature_last": 1},
    "smoothing": {**BASE, "top_k": 50, "top_p": 0.8, "smoothing_factor": 0.3},
    "top_a": {**BASE, "top_k": 50, "top_p": 0.8, "top_a": 0.1},
    "tfs (with top_k)": {**BASE, "top_k": 50, "tfs": 0.95},
    "skew": {**BASE, "top_k": 50, "top_p": 0.8, "skew": 0.5},
    "decay": {**BASE, "top_k": 50, "top_p": 0.8, "penalty_range": 64, "penalty_decay": 64},
    "full": {**BASE, "top_k": 50, "top_p": 0.8, "top_a": 0.05, "tfs": 0.97, "min_temp": 0.5, "max_temp": 1.5,
             "xtc_probability": 0.5, "xtc_threshold": 0.05, "skew": 0.3, "dry_multiplier": 0.8, "mirostat": 1,
             "mirostat_mu": 6.0},
}


def main(argv):
    del argv
    import importlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    mod = importlib.import_module(FLAGS.module)
    SamplingRows, sample = mod.SamplingRows, mod.sample  # noqa: N806

    v = FLAGS.vocab
    fn = jax.jit(sample, static_argnames="return_top_k")

    import inspect

    full = "dry_breakers" in inspect.signature(sample).parameters

    def batch_args(s: int) -> dict:
        rng = np.random.default_rng(0)
        args = dict(
            positions=jnp.arange(s, dtype=jnp.int32),
            history=jnp.asarray(rng.integers(0, v, size=(s, FLAGS.history)), jnp.int32),
            bias_ids=jnp.full((s, 4), -1, jnp.int32),
            bias_values=jnp.zeros((s, 4), jnp.float32),
        )
        if full:  # a few hundred breaker / exempt tokens per row, as a tokenizer's defaults
            words = -(-v // 32)
            args["dry_breakers"] = jnp.asarray(rng.integers(0, 2**31, size=(s, words)) & 0x01010101, jnp.int32)
            args["xtc_exempt"] = jnp.asarray(rng.integers(0, 2**31, size=(s, words)) & 0x00010000, jnp.int32)
        return args

    record = {"module": FLAGS.module, "rows": FLAGS.rows, "vocab": v, "history": FLAGS.history, "compile_s": {},
              "ms": {}}
    jax.jit(lambda x: x + 1).lower(jnp.zeros(4)).compile()  # one-time compiler start-up, not the sampler's
    for s in (int(r) for r in FLAGS.compile_rows):
        t0 = time.perf_counter()
        fn.lower(jnp.zeros((s, v), jnp.float32), SamplingRows.make(s), **batch_args(s)).compile()
        record["compile_s"][s] = time.perf_counter() - t0
        print(f"compile S={s} V={v}: {record['compile_s'][s]:.2f} s")

    s = FLAGS.rows
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((s, v)).astype(np.float32) * 2.0
    boost = rng.integers(0, v, size=(s, 32))
    np.put_along_axis(logits, boost, rng.uniform(6.0, 12.0, size=(s, 32)).astype(np.float32), axis=-1)
    logits = jnp.asarray(logits)
    args = batch_args(s)
    compiled = fn.lower(logits, SamplingRows.make(s), **args).compile()

    for name, setting in SETTINGS.items():
        if FLAGS.only and name not in FLAGS.only:
            continue
        try:
            params = jax.tree.map(jnp.asarray, SamplingRows.make([{**setting, "seed": i} for i in range(s)]))
        except ValueError:  # an older sampler without this option
            continue
        times = call_times(lambda p=params: compiled(logits, p, **args), FLAGS.iters)
        record["ms"][name] = {"median": 1e3 * float(np.median(times)), "min": 1e3 * float(np.min(times))}
        print(f"{name:24s} {1e3 * np.median(times):9.2f} ms  (min {1e3 * np.min(times):.2f})")
    if FLAGS.greedy_final_rows:
        record["greedy_final_ms"] = time_greedy_final([int(r) for r in FLAGS.greedy_final_rows], v, FLAGS.iters)
    from experiments.lib.common import write_record

    write_record(FLAGS.json_out, record)


def call_times(call, iters: int) -> list[float]:
    """Seconds of each of `iters` calls of `call()`, each waited for, after one untimed call."""
    import jax

    jax.block_until_ready(call())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return times


def time_greedy_final(row_counts: list[int], v: int, iters: int) -> dict:
    """Median ms per call of `paged.device.sampling.greedy_final_xla` and, where it runs, the native kernel
    (`pallas_kernels.native_greedy`), each jitted alone on the same [S, V] logits."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paged.device.sampling import greedy_final_xla
    from pallas_kernels import native_greedy

    impls = {"xla": greedy_final_xla}
    if native_greedy.unavailable_reason() is None:
        impls["native"] = native_greedy.native_greedy_final
    out = {}
    for s in row_counts:
        x = jnp.asarray(np.random.default_rng(s).standard_normal((s, v)).astype(np.float32) * 3)
        out[s] = {}
        for name, f in impls.items():
            g = jax.jit(f)
            out[s][name] = 1e3 * float(np.median(call_times(lambda g=g, x=x: g(x), iters)))
        print(f"greedy_final S={s} V={v}: " + "  ".join(f"{n} {t:.3f} ms" for n, t in out[s].items()))
    return out


if __name__ == "__main__":
    app.run(main)
