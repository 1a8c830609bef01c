"""Paged attention: the jnp reference against a plain NumPy loop, and the XLA fast path against the reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    PrefillDecodeLayout,
    layout_query_start,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)


def numpy_attention(q, k_pages, v_pages, qstart, qlens, kvlens, table, scale, window=None, soft_cap=None):
    """Per-token loop: the textbook definition."""
    t_count, nh, d = q.shape
    kh, _, ps, _ = k_pages.shape
    g = nh // kh
    out = np.zeros_like(q)
    for s in range(len(qstart)):
        for i in range(qlens[s]):
            t = qstart[s] + i
            pos = kvlens[s] - qlens[s] + i
            keys = [j for j in range(pos + 1) if window is None or pos - j < window]
            for h in range(nh):
                kv = h // g
                kk = np.stack([k_pages[kv, table[s, j // ps], j % ps] for j in keys])
                vv = np.stack([v_pages[kv, table[s, j // ps], j % ps] for j in keys])
                sc = kk @ q[t, h] * scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                w = np.exp(sc - sc.max())
                out[t, h] = (w / w.sum()) @ vv
    return out


def random_case(rng, layout: PrefillDecodeLayout, ps: int, kh: int, g: int, d: int, max_ctx: int):
    s_count = layout.num_rows
    num_pages = 1 + s_count * (-(-max_ctx // ps))
    k_pages = rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32)
    v_pages = rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32)
    qlens = np.zeros(s_count, np.int32)
    kvlens = np.zeros(s_count, np.int32)
    p = -(-max_ctx // ps)
    table = np.zeros((s_count, p), np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))  # random page permutation; page 0 is the null page
    for s in range(s_count):
        if rng.random() < 0.15:
            continue  # an empty (padding) row
        ql = int(rng.integers(1, layout.max_q_len + 1)) if s < layout.num_prefill_rows else 1
        kv = int(rng.integers(ql, max_ctx + 1))
        qlens[s], kvlens[s] = ql, kv
        for j in range(-(-kv // ps)):
            table[s, j] = free.pop()
    q = rng.normal(size=(layout.num_tokens, kh * g, d)).astype(np.float32)
    return q, k_pages, v_pages, qlens, kvlens, table


CASES = [
    # (num_prefill_rows, max_q_len, num_decode_rows, page_size, kv_heads, q_per_kv, head_dim, max_ctx)
    (0, 1, 3, 8, 2, 2, 16, 40),
    (1, 16, 0, 16, 1, 4, 8, 50),
    (2, 8, 2, 8, 2, 1, 8, 33),
    (1, 4, 5, 64, 3, 3, 16, 130),
    (2, 16, 1, 256, 1, 2, 8, 300),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_numpy_and_xla_matches_reference(case, window):
    sp, qm, sd, ps, kh, g, d, max_ctx = case
    layout = PrefillDecodeLayout(sp, qm, sd)
    rng = np.random.default_rng(sum(case) * 31 + (window or 0))
    q, kp, vp, qlens, kvlens, table = random_case(rng, layout, ps, kh, g, d, max_ctx)
    qstart = np.asarray(layout_query_start(layout))
    scale = d**-0.5
    ref = np.asarray(ragged_paged_attention_reference(
        jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(qstart), jnp.asarray(qlens),
        jnp.asarray(kvlens), jnp.asarray(table), sm_scale=scale, sliding_window=window))
    expected = numpy_attention(q, kp, vp, qstart, qlens, kvlens, table, scale, window)
    np.testing.assert_allclose(ref, expected, atol=2e-5, rtol=2e-5)
    fast = np.asarray(ragged_paged_attention_xla(
        jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(qlens), jnp.asarray(kvlens),
        jnp.asarray(table), layout=layout, sm_scale=scale, sliding_window=window))
    np.testing.assert_allclose(fast, expected, atol=2e-5, rtol=2e-5)


def test_soft_cap():
    layout = PrefillDecodeLayout(1, 8, 2)
    rng = np.random.default_rng(7)
    q, kp, vp, qlens, kvlens, table = random_case(rng, layout, 8, 2, 2, 8, 30)
    q *= 4  # large scores so the cap matters
    qstart = np.asarray(layout_query_start(layout))
    expected = numpy_attention(q, kp, vp, qstart, qlens, kvlens, table, 8**-0.5, soft_cap=2.0)
    for got in (
        ragged_paged_attention_reference(q, kp, vp, qstart, qlens, kvlens, table, sm_scale=8**-0.5, soft_cap=2.0),
        ragged_paged_attention_xla(q, kp, vp, qlens, kvlens, table, layout=layout, sm_scale=8**-0.5, soft_cap=2.0),
    ):
        np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5, rtol=2e-5)
