"""Kernel benchmarks: paged attention (decode and prefill shapes) and dequant-matmul (int8, q4_1) per
implementation, with achieved bandwidth / FLOP/s against this device's measured peaks.

    python -m experiments.bench_kernels --json_out experiments/results/kernels_cpu.json
    python -m experiments.bench_kernels --impls xla,pallas          # on a GPU

Peaks are measured here, in the same run: bandwidth by a large array copy, FLOP/s by a large float32 matmul. On the
CPU the Pallas kernels run interpreted (correctness only), so they are skipped unless asked for explicitly.
"""

from __future__ import annotations

import json
import os
import platform
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("impls", None, "implementations to time (default: xla and reference on CPU, + pallas on GPU)")
flags.DEFINE_integer("iters", 10, "timed calls per point")
flags.DEFINE_string("json_out", None, "write results here")


def timeit(fn, *args, iters: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / iters


def measure_peaks(iters: int) -> dict:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64 * 1024 * 1024 // 4,), jnp.float32)  # 64 MB
    copy = jax.jit(lambda a: a * 1.0001)
    t = timeit(copy, x, iters=iters)
    a = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    tm = timeit(mm, a, iters=iters)
    return {"bandwidth_gbps": 2 * x.nbytes / t / 1e9, "matmul_gflops": 2 * 2048**3 / tm / 1e9}


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.quant import quantize
    from pallas_kernels.dequant_matmul import dequant_matmul
    from pallas_kernels.paged_attention import PrefillDecodeLayout, layout_query_start, paged_attention

    gpu = jax.default_backend() == "gpu"
    impls = FLAGS.impls or (["xla", "pallas"] if gpu else ["xla", "reference"])
    peaks = measure_peaks(FLAGS.iters)
    print(f"device {jax.devices()[0]}: copy {peaks['bandwidth_gbps']:.1f} GB/s, "
          f"f32 matmul {peaks['matmul_gflops']:.1f} GFLOP/s")
    rows = []
    rng = np.random.default_rng(0)
    # ---- paged attention (SmolLM2 heads: 3 KV heads x 3 q heads, D 64)
    kh, g, d, ps = 3, 3, 64, 64
    for name, layout, ctx in (("decode", PrefillDecodeLayout(0, 1, 16), 512),
                              ("decode", PrefillDecodeLayout(0, 1, 16), 2048),
                              ("prefill", PrefillDecodeLayout(1, 256, 0), 512)):
        s = layout.num_rows
        p = -(-ctx // ps)
        num_pages = 1 + s * p
        table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(s, p).astype(np.int32))
        q_lens = jnp.full((s,), layout.max_q_len, jnp.int32)
        kv_lens = jnp.full((s,), ctx, jnp.int32)
        q = jnp.asarray(rng.normal(size=(layout.num_tokens, kh * g, d)).astype(np.float32))
        kp = jnp.asarray(rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32))
        vp = jnp.asarray(rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32))
        qs = layout_query_start(layout)
        kv_bytes = 2 * s * ctx * kh * d * 4
        flops = 4 * layout.num_tokens * ctx * kh * g * d
        for impl in impls:
            fn = jax.jit(lambda q, kp, vp, impl=impl, layout=layout, qs=qs, q_lens=q_lens, kv_lens=kv_lens,
                         table=table: paged_attention(q, kp, vp, qs, q_lens, kv_lens, table, sm_scale=d**-0.5,
                                                      impl=impl, layout=layout))
            t = timeit(fn, q, kp, vp, iters=FLAGS.iters)
            rec = dict(op="paged_attention", shape=f"{name} {s}x{layout.max_q_len} ctx {ctx}", impl=impl,
                       ms=t * 1e3, gbps=kv_bytes / t / 1e9, gflops=flops / t / 1e9)
            rec["bandwidth_frac"] = rec["gbps"] / peaks["bandwidth_gbps"]
            rows.append(rec)
            print(f"attention {rec['shape']:24s} {impl:9s} {rec['ms']:8.2f} ms  {rec['gbps']:6.1f} GB/s "
                  f"({100 * rec['bandwidth_frac']:.0f}% of copy)  {rec['gflops']:6.1f} GFLOP/s")
    # ---- dequant matmul: SmolLM2 MLP shapes
    for k, n in ((576, 1536), (1536, 576)):
        w = jnp.asarray(rng.normal(0, 0.02, size=(k, n)).astype(np.float32))
        for batch in (1, 16):
            x = jnp.asarray(rng.normal(size=(batch, k)).astype(np.float32))
            f32 = jax.jit(lambda x, w: x @ w)
            t = timeit(f32, x, w, iters=FLAGS.iters)
            rows.append(dict(op="matmul", shape=f"{batch}x{k}x{n}", impl="float32", ms=t * 1e3,
                             gbps=w.nbytes / t / 1e9))
            print(f"matmul {batch}x{k}x{n} float32   {t * 1e3:8.3f} ms  {w.nbytes / t / 1e9:6.1f} GB/s")
            for kind in ("int8", "q4_1"):
                qa = quantize(w, kind, 32)
                wbytes = sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(qa))
                for impl in impls:
                    fn = jax.jit(lambda x, qa, impl=impl: dequant_matmul(x, qa, impl=impl))
                    t = timeit(fn, x, qa, iters=FLAGS.iters)
                    rec = dict(op="dequant_matmul", shape=f"{batch}x{k}x{n}", kind=kind, impl=impl, ms=t * 1e3,
                               gbps=wbytes / t / 1e9, gflops=2 * batch * k * n / t / 1e9)
                    rows.append(rec)
                    print(f"matmul {batch}x{k}x{n} {kind:5s} {impl:9s} {t * 1e3:8.3f} ms  {rec['gbps']:6.1f} GB/s")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), backend=jax.default_backend(), machine=platform.machine(),
                           cpus=os.cpu_count(), load_avg=os.getloadavg(), jax=jax.__version__, peaks=peaks,
                           results=rows), f, indent=1)


if __name__ == "__main__":
    app.run(main)
