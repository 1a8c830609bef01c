"""Decode attention over paged caches: head-major `[KH, pages, page_size, D]` (what the engine uses) versus
token-major `[pages, page_size, KH, D]`, with the XLA path, on the current backend.

    python -m experiments.bench_attention_layout --seqs 16 --contexts 512,2048

Prints ms per call (one layer) and writes JSON with --json_out. Run on an idle machine.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib.common import check_out_flag, write_record

FLAGS = flags.FLAGS
flags.DEFINE_integer("seqs", 16, "decode rows")
flags.DEFINE_list("contexts", ["512", "2048"], "tokens of context per row")
flags.DEFINE_integer("kv_heads", 3, "KV heads (SmolLM2: 3)")
flags.DEFINE_integer("q_per_kv", 3, "query heads per KV head (SmolLM2: 3)")
flags.DEFINE_integer("head_dim", 64, "head dim")
flags.DEFINE_integer("page_size", 64, "tokens per page")
flags.DEFINE_integer("iters", 20, "timed calls")
flags.DEFINE_string("json_out", None, "write results here")
check_out_flag("json_out")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import PrefillDecodeLayout, ragged_paged_attention_xla

    kh, g, d, ps, s = FLAGS.kv_heads, FLAGS.q_per_kv, FLAGS.head_dim, FLAGS.page_size, FLAGS.seqs
    rows = []

    def bench(ctx: int) -> None:
        p = -(-ctx // ps)
        num_pages = 1 + s * p
        rng = np.random.default_rng(0)
        table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(s, p).astype(np.int32))
        kv_lens = jnp.full((s,), ctx, jnp.int32)
        q_lens = jnp.ones((s,), jnp.int32)
        q = jnp.asarray(rng.normal(size=(s, kh * g, d)).astype(np.float32))
        k_hm = jnp.asarray(rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32))
        v_hm = jnp.asarray(rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32))
        k_tm, v_tm = jnp.transpose(k_hm, (1, 2, 0, 3)), jnp.transpose(v_hm, (1, 2, 0, 3))
        layout = PrefillDecodeLayout(0, 1, s)
        head_major = jax.jit(lambda q, k, v: ragged_paged_attention_xla(
            q, k, v, q_lens, kv_lens, table, layout=layout, sm_scale=d**-0.5))

        def token_major_fn(q, k, v):  # gather [S, P, ps, KH, D] then contract with heads inner
            kg = k[table].reshape(s, p * ps, kh, d)
            vg = v[table].reshape(s, p * ps, kh, d)
            qq = q.reshape(s, kh, g, d)
            sc = jnp.einsum("skgd,slkd->skgl", qq, kg) * d**-0.5
            mask = jnp.arange(p * ps)[None, :] < kv_lens[:, None]
            sc = jnp.where(mask[:, None, None, :], sc, -1e30)
            w = jax.nn.softmax(sc, axis=-1)
            return jnp.einsum("skgl,slkd->skgd", w, vg).reshape(s, kh * g, d)

        token_major = jax.jit(token_major_fn)
        ref = head_major(q, k_hm, v_hm)
        np.testing.assert_allclose(np.asarray(token_major(q, k_tm, v_tm)), np.asarray(ref), atol=1e-4)
        for name, fn, args in (("head_major", head_major, (q, k_hm, v_hm)),
                               ("token_major", token_major, (q, k_tm, v_tm))):
            jax.block_until_ready(fn(*args))
            t0 = time.perf_counter()
            for _ in range(FLAGS.iters):
                jax.block_until_ready(fn(*args))
            ms = (time.perf_counter() - t0) / FLAGS.iters * 1e3
            kv_bytes = 2 * s * ctx * kh * d * 4
            rows.append(dict(layout=name, context=ctx, seqs=s, ms=ms, gbps=kv_bytes / ms / 1e6))
            print(f"{name:12s} ctx {ctx:5d} x {s} rows: {ms:7.2f} ms  ({kv_bytes / ms / 1e6:6.1f} GB/s of KV read)")

    for ctx in FLAGS.contexts:
        bench(int(ctx))
    if FLAGS.json_out:
        write_record(FLAGS.json_out, dict(device=str(jax.devices()[0]), load_avg=os.getloadavg(), rows=rows))


if __name__ == "__main__":
    app.run(main)
