"""Paged attention: the jnp reference against a plain NumPy loop; the XLA fast path and the Pallas kernel
(interpret mode on the CPU, natively on a GPU) against the reference over sampled shapes, ragged mixes and
tunings (checking the kernel runs the blocking the tuning asks for); int8 KV; the `impl` switch (checking which
implementation ran); tuning validation."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native_attention
from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import (
    AttentionTuning,
    PrefillDecodeLayout,
    layout_query_start,
    paged_attention,
    quantize_kv,
    ragged_paged_attention_pallas,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)
from pallas_kernels.tuning import default_tuning
from tests.pallas_kernels.helpers import find, names_of, spy

pytestmark = pytest.mark.fresh_programs  # (counts compiled variants)

# impl -> the function of `pallas_kernels.paged_attention` that runs it
IMPL_FUNCTIONS = {
    "reference": "ragged_paged_attention_reference",
    "xla": "ragged_paged_attention_xla",
    "pallas": "ragged_paged_attention_pallas",
    "native": "native_paged_attention",  # of pallas_kernels.native_attention
}
IMPL_OF = {function: impl for impl, function in IMPL_FUNCTIONS.items()}
NATIVE = native_attention.library_reason() is None  # the native CPU library is here (a failing kernel fails)


def spy_impls(monkeypatch) -> list[tuple[str, tuple, dict]]:
    """Record every call `paged_attention` makes to an implementation, as `(function name, args, kwargs)` (the
    native kernel's windows handed to XLA are XLA's call)."""
    calls = spy(monkeypatch, pa, [f for i, f in IMPL_FUNCTIONS.items() if i != "native"])
    return spy(monkeypatch, native_attention, [IMPL_FUNCTIONS["native"]], calls)


def impls(calls: list[tuple[str, tuple, dict]]) -> list[str]:
    """The implementations ("reference", "xla", "pallas", "native") recorded by `spy_impls`, in order."""
    return [IMPL_OF[name] for name in names_of(calls)]


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



@pytest.mark.parametrize("budget_rows", [1, 2, 4])
@pytest.mark.parametrize("int8", [False, True])
def test_xla_decode_rows_in_cache_sized_groups_match_the_reference(monkeypatch, budget_rows, int8):
    """On the CPU the XLA path maps over groups of decode rows when their gathered pages would not fit in cache;
    a small budget forces groups of 1, 2 and 4 rows here."""
    layout, ps, kh, g, d, max_ctx = PrefillDecodeLayout(1, 8, 8), 8, 2, 2, 16, 40
    row_bytes = -(-max_ctx // ps) * ps * kh * d * 4 * 2
    monkeypatch.setattr(pa, "CPU_DECODE_GATHER_BYTES", budget_rows * row_bytes)
    if jax.default_backend() == "cpu":
        assert pa.decode_chunk_rows(8, row_bytes) == budget_rows
    rng = np.random.default_rng(budget_rows)
    q, kp, vp, qlens, kvlens, table = random_case(rng, layout, ps, kh, g, d, max_ctx)
    scales = {}
    if int8:
        (kp, ks), (vp, vs) = quantize_pages(jnp.asarray(kp)), quantize_pages(jnp.asarray(vp))
        scales = dict(k_scales=ks, v_scales=vs)
    args = [jnp.asarray(a) for a in (q, kp, vp)]
    ref = ragged_paged_attention_reference(*args, layout_query_start(layout), jnp.asarray(qlens),
                                           jnp.asarray(kvlens), jnp.asarray(table), sm_scale=d**-0.5, **scales)
    xla = ragged_paged_attention_xla.__wrapped__  # un-jitted: the budget is read while tracing
    meta = (jnp.asarray(qlens), jnp.asarray(kvlens), jnp.asarray(table))
    fast = xla(*args, *meta, layout=layout, sm_scale=d**-0.5, **scales)
    np.testing.assert_allclose(np.asarray(fast), np.asarray(ref), atol=2e-5, rtol=2e-5)
    if jax.default_backend() == "cpu":  # the 8 decode rows really ran as a loop over groups of `budget_rows`
        loops = find(xla, *args, *meta, primitive="scan", layout=layout, sm_scale=d**-0.5, **scales)
        assert [e.params["length"] for e in loops] == [8 // budget_rows]


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


# ---------------------------------------------------------------------------------------------------------------
# The Pallas kernel over fully ragged batches
# ---------------------------------------------------------------------------------------------------------------


def ragged_case(rng, kinds: str, *, max_q: int, max_ctx: int, ps: int, kh: int, g: int, d: int, spare: int = 3):
    """A ragged batch, one row per letter of `kinds`: `P` a prefill from position 0, `p` a prefill chunk starting
    mid-context, `d` a decode row, `0` an empty row with a cached context, `-` an empty padding row. Rows sit
    in the token axis in random order with random gaps (tokens of no row) and at least `spare` trailing slots;
    pages are a random permutation of the pool; the null page holds large values that must never be seen.
    T and the pool size depend only on the arguments (not on the draw), so every draw reuses one compilation."""
    s_count = len(kinds)
    qlens = np.zeros(s_count, np.int32)
    kvlens = np.zeros(s_count, np.int32)
    for s, kind in enumerate(kinds):
        if kind == "P":
            qlens[s] = kvlens[s] = rng.integers(2, max_q + 1)
        elif kind == "p":
            qlens[s] = rng.integers(2, max_q + 1)
            kvlens[s] = rng.integers(qlens[s] + 1, max(max_ctx, qlens[s] + 1) + 1)
        elif kind == "d":
            qlens[s], kvlens[s] = 1, rng.integers(1, max_ctx + 1)
        elif kind == "0":
            kvlens[s] = rng.integers(1, max_ctx + 1)
    qstart = np.zeros(s_count, np.int32)
    pos = 0
    for s in rng.permutation(s_count):
        pos += int(rng.random() < 0.3)
        qstart[s] = pos
        pos += qlens[s]
    t_count = sum(max_q if k in "pP" else k == "d" for k in kinds) + len(kinds) + spare  # >= pos + spare
    max_kv = max(max_ctx, max_q + 1)
    p = -(-max_kv // ps) + 1  # one more column than any row needs: padded with the null page
    need = [-(-int(kv) // ps) for kv in kvlens]
    num_pages = 1 + len(kinds) * (p - 1) + 2
    free = list(rng.permutation(np.arange(1, num_pages)))
    table = np.zeros((s_count, p), np.int32)
    for s in range(s_count):
        for j in range(need[s]):
            table[s, j] = free.pop()
    k_pages = rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32)
    v_pages = rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32)
    k_pages[:, 0], v_pages[:, 0] = 30.0, -30.0
    q = rng.normal(size=(t_count, kh * g, d)).astype(np.float32)
    return q, k_pages, v_pages, qstart, qlens, kvlens, table


@jax.jit
def quantize_pages(pages: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """[KH, N, ps, D] float -> int8 pages and [KH, N, ps] scales, through the engine's `quantize_kv`."""
    kh, n, ps, d = pages.shape
    x = pages.transpose(1, 2, 0, 3).reshape(n * ps, kh, d)  # [T, KH, D] as the engine writes them
    qx, sc = quantize_kv(x)
    return (qx.reshape(n, ps, kh, d).transpose(2, 0, 1, 3), sc.reshape(n, ps, kh).transpose(2, 0, 1))


def kernel_inputs(rng, kinds, max_q, max_ctx, ps, kh, g, d, window, cap, kv_dtype):
    """Arguments for the kernel, the same in float32 for the reference, and the keyword arguments of both."""
    q, kp, vp, qstart, qlens, kvlens, table = ragged_case(rng, kinds, max_q=max_q, max_ctx=max_ctx, ps=ps, kh=kh,
                                                          g=g, d=d)
    kw = dict(sm_scale=d**-0.5, sliding_window=window, soft_cap=cap)
    q, kp, vp = jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp)
    if kv_dtype == "int8":
        kp, kw["k_scales"] = quantize_pages(kp)
        vp, kw["v_scales"] = quantize_pages(vp)
    elif kv_dtype == "bf16":
        q, kp, vp = (x.astype(jnp.bfloat16) for x in (q, kp, vp))
    args = [q, kp, vp] + [jnp.asarray(x) for x in (qstart, qlens, kvlens, table)]
    ref_args = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args]
    return args, ref_args, kw


T = AttentionTuning
KERNEL_CASES = [
    # (id, kinds, max_q, max_ctx, page_size, kv_heads, q_per_kv, head_dim, window, soft_cap, kv dtype, tuning)
    ("mqa-ps8", "Pdd0p-", 12, 40, 8, 1, 4, 8, None, None, "f32", T(block_q=8, pages_per_block=2)),
    ("gqa2-ps16-window", "pdPd0d", 9, 70, 16, 2, 2, 16, 11, None, "f32", T(block_q=4, pages_per_block=1)),
    ("gqa4-ps32-cap", "dpd-P", 20, 100, 32, 2, 4, 32, None, 3.0, "f32", T(block_q=16, pages_per_block=1)),
    ("mha-int8-split3", "ddpd0", 6, 60, 8, 3, 1, 16, None, None, "int8", T(block_q=2, pages_per_block=4, k_splits=3)),
    ("g3-window-cap-split2", "pd0dp", 16, 50, 16, 3, 3, 8, 6, 2.0, "f32", T(block_q=8, pages_per_block=2, k_splits=2)),
    ("decode-many-pages", "ddddd0d-", 1, 160, 8, 2, 2, 16, None, None, "f32",
     T(block_q=1, pages_per_block=2, k_splits=4)),
    ("long-chunk-int8", "pd", 40, 130, 8, 1, 2, 16, None, None, "int8", T(block_q=16, pages_per_block=4, k_splits=2)),
    ("int8-window-split-decode", "dpdPd0", 10, 90, 8, 2, 2, 16, 13, None, "int8",
     T(block_q=4, pages_per_block=2, k_splits=3, split_max_q=1)),
    ("int8-window-bq32", "dpdP", 12, 90, 16, 2, 2, 32, 20, None, "int8", T(block_q=32, pages_per_block=2)),
    ("bf16-default-tuning", "pdd0P", 10, 60, 16, 2, 4, 16, None, None, "bf16", None),
    ("default-tuning-window", "PdpdP", 14, 80, 8, 2, 2, 16, 9, None, "f32", None),
]
MIXES_PER_CASE = 3  # ragged mixes per compiled shape: row metadata is data, so these cost no compilation


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_matches_reference(case):
    _, kinds, max_q, max_ctx, ps, kh, g, d, window, cap, kv_dtype, tuning = case
    seed = KERNEL_CASES.index(case)
    for mix in range(MIXES_PER_CASE):
        rng = np.random.default_rng(1000 * seed + mix)
        args, ref_args, kw = kernel_inputs(rng, kinds, max_q, max_ctx, ps, kh, g, d, window, cap, kv_dtype)
        expected = np.asarray(ragged_paged_attention_reference(*ref_args, **kw))
        got = ragged_paged_attention_pallas(*args, config=tuning, interpret=True, **kw)
        assert got.shape == args[0].shape and got.dtype == args[0].dtype
        if tuning is not None and mix == 0:  # the kernel runs the tuning asked for
            (call,) = find(ragged_paged_attention_pallas, *args, primitive="pallas_call", config=tuning,
                           interpret=True, **kw)
            t_count, p = args[0].shape[0], args[6].shape[1]
            # grid (token blocks, KV heads, key splits); the page table (operand 5) padded to whole page blocks
            assert tuple(call.params["grid_mapping"].grid) == (-(-t_count // tuning.block_q), kh, tuning.k_splits)
            assert call.invars[5].aval.shape[1] == -(-p // tuning.pages_per_block) * tuning.pages_per_block
        tol = 3e-2 if kv_dtype == "bf16" else 2e-5
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), expected, atol=tol, rtol=tol)
        if kv_dtype != "int8":  # the reference itself against the NumPy loop
            loop = numpy_attention(*(np.asarray(x) for x in ref_args), d**-0.5, window, cap)
            np.testing.assert_allclose(expected, loop, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# int8 KV
# ---------------------------------------------------------------------------------------------------------------


def test_quantize_kv_round_trip():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(37, 3, 16)).astype(np.float32) * rng.uniform(0.01, 10, size=(37, 3, 1)).astype(np.float32)
    x[5, 1] = 0.0  # an all-zero head vector
    qx, scale = quantize_kv(jnp.asarray(x))
    assert qx.dtype == jnp.int8 and qx.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == (37, 3)
    qx, scale = np.asarray(qx), np.asarray(scale)
    assert np.abs(qx).max() <= 127
    np.testing.assert_allclose(scale, np.abs(x).max(axis=-1) / 127, rtol=1e-6)
    err = np.abs(qx * scale[..., None] - x)
    assert np.all(err <= scale[..., None] * 0.5 * (1 + 1e-5) + 1e-12)  # round to nearest: half a step
    assert scale[5, 1] == 0 and np.all(qx[5, 1] == 0)
    np.testing.assert_array_equal(np.abs(qx).max(axis=-1)[scale > 0], 127)  # the full range is used


INT8_ATTENTION_TOL = 0.03  # measured max error ~0.01 for unit-normal q/k/v, head_dim 16


def test_int8_attention_close_to_float():
    rng = np.random.default_rng(11)
    q, kp, vp, qstart, qlens, kvlens, table = ragged_case(rng, "Pdpd0", max_q=10, max_ctx=60, ps=8, kh=2, g=2, d=16)
    kq, ksc = quantize_pages(kp)
    vq, vsc = quantize_pages(vp)
    meta = [jnp.asarray(x) for x in (qstart, qlens, kvlens, table)]
    exact = np.asarray(ragged_paged_attention_reference(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), *meta,
                                                        sm_scale=0.25))
    quant = ragged_paged_attention_reference(jnp.asarray(q), kq, vq, *meta, sm_scale=0.25, k_scales=ksc,
                                             v_scales=vsc)
    assert np.abs(np.asarray(quant) - exact).max() < INT8_ATTENTION_TOL
    # The spec with int8 is the spec over the dequantized pages.
    deq = ragged_paged_attention_reference(jnp.asarray(q), kq * ksc[..., None], vq * vsc[..., None], *meta,
                                           sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(quant), np.asarray(deq), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_xla_int8_matches_reference(window):
    layout = PrefillDecodeLayout(2, 8, 3)
    rng = np.random.default_rng(23 + (window or 0))
    q, kp, vp, qlens, kvlens, table = random_case(rng, layout, 8, 2, 2, 16, 45)
    kq, ksc = quantize_pages(kp)
    vq, vsc = quantize_pages(vp)
    qstart = layout_query_start(layout)
    kw = dict(sm_scale=0.25, sliding_window=window, soft_cap=4.0, k_scales=ksc, v_scales=vsc)
    expected = ragged_paged_attention_reference(q, kq, vq, qstart, qlens, kvlens, table, **kw)
    got = ragged_paged_attention_xla(q, kq, vq, qlens, kvlens, table, layout=layout, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


def test_scales_must_come_in_pairs_with_pool_shape():
    kp = jnp.zeros((2, 4, 8, 16), jnp.int8)
    args = (jnp.zeros((3, 4, 16)), kp, kp, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32),
            jnp.ones((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="both k_scales and v_scales"):
        ragged_paged_attention_reference(*args, sm_scale=1.0, k_scales=jnp.ones((2, 4, 8)))
    with pytest.raises(ValueError, match=r"\(2, 4, 8\)"):
        ragged_paged_attention_pallas(*args, sm_scale=1.0, k_scales=jnp.ones((2, 4)), v_scales=jnp.ones((2, 4)))


# ---------------------------------------------------------------------------------------------------------------
# The impl switch and the tuning
# ---------------------------------------------------------------------------------------------------------------


def test_paged_attention_impl_switch(monkeypatch):
    """Each `impl` runs its implementation (and only it), with the right result."""
    layout = PrefillDecodeLayout(1, 8, 3)
    rng = np.random.default_rng(5)
    q, kp, vp, qlens, kvlens, table = random_case(rng, layout, 8, 2, 2, 8, 30)
    qstart = layout_query_start(layout)
    args = [jnp.asarray(x) for x in (q, kp, vp)] + [qstart] + [jnp.asarray(x) for x in (qlens, kvlens, table)]
    expected = numpy_attention(*(np.asarray(a) for a in args), 0.3)
    cases = [  # (impl, layout, the implementation that must run)
        ("reference", None, "reference"),
        ("reference", layout, "reference"),
        ("xla", layout, "xla"),
        ("xla", None, "reference"),  # the XLA path needs the layout
        # head_dim 8: on a GPU "xla" too (test_gpu_rules covers the GPU choice); on the CPU the native kernel
        ("auto", layout, "native" if NATIVE else "xla"),
        ("auto", None, "native" if NATIVE else "reference"),
        ("pallas", layout, "pallas"),
        ("pallas", None, "pallas"),
    ] + ([("native", layout, "native"), ("native", None, "native")] if NATIVE else [])
    calls = spy_impls(monkeypatch)
    for impl, lay, want in cases:
        calls.clear()
        got = paged_attention(*args, sm_scale=0.3, impl=impl, layout=lay, interpret=True)  # head_dim 8: no GPU
        np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5, rtol=2e-5, err_msg=f"{impl} {lay}")
        assert impls(calls) == [want], (impl, lay)
        if want == "pallas" and lay is not None:  # the layout's longest query picks the kernel's default tuning
            assert calls[0][2]["config"] == default_tuning(max_query_len=8, num_kv_heads=2, page_size=8,
                                                           pages_per_row=table.shape[1])
    with pytest.raises(ValueError, match="'triton'"):
        paged_attention(*args, sm_scale=0.3, impl="triton")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_q=3), "block_q=3"),
        (dict(block_q=0), "block_q=0"),
        (dict(pages_per_block=6), "pages_per_block=6"),
        (dict(k_splits=0), "k_splits=0"),
        (dict(num_warps=3), "num_warps=3"),
        (dict(num_stages=0), "num_stages=0"),
        (dict(k_splits=4, split_max_q=-1), "split_max_q=-1"),
        (dict(k_splits=4, split_max_q=1.0), "split_max_q=1.0"),
        (dict(k_splits=4, split_max_q="1"), "split_max_q='1'"),
    ],
)
def test_invalid_tuning_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AttentionTuning(**kwargs)


@pytest.mark.parametrize("max_q, page_size, pages_per_row", [(1, 8, 64), (1, 16, 3), (7, 16, 40), (64, 32, 100)])
def test_default_tuning_is_valid(max_q, page_size, pages_per_row):
    cfg = default_tuning(max_query_len=max_q, num_kv_heads=2, page_size=page_size, pages_per_row=pages_per_row)
    assert cfg.block_q == (1 if max_q == 1 else min(16, 1 << (max_q - 1).bit_length()))
    assert cfg.pages_per_block * page_size <= 64
    assert cfg.k_splits == 1  # no default splits a row's keys: see the next test


@pytest.mark.parametrize("where", ["interpret", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")])])
def test_a_query_gets_the_same_bits_in_every_kind_of_step(where):
    """With the default tunings a query's output does not depend on the step it is in: a decode token alone, among
    other decode rows, or the same query in a 5-token verification row fold the row's 600 keys (10 key blocks) in the
    same order; on a GPU in a prefill chunk next to another row's tokens too (in interpret mode the kernel's dots
    are XLA:CPU dots, whose rounding of a row can depend on its place in the block). A default that split decode
    steps' keys over programs (flash-decoding, by a count that depended on the step's tokens) gave a decode token
    other bits than the verification row, and greedy speculation on a GPU parted from plain decoding."""
    rng = np.random.default_rng(5)
    kh, g, d, ps, p, kv = 3, 3, 64, 16, 64, 600
    k = jnp.asarray(rng.standard_normal((kh, 2 * p + 1, ps, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((kh, 2 * p + 1, ps, d)), jnp.float32)
    row = np.arange(1, p + 1)  # the row under test; the others use the pool's other pages
    other = np.arange(p + 1, 2 * p + 1)
    q = jnp.asarray(rng.standard_normal((40, kh * g, d)), jnp.float32)  # q[0:5]: the row's last 5 positions

    def attend(qq, rows):  # rows: [(query_len, kv_len, pages)]
        ql = [r[0] for r in rows]
        return np.asarray(ragged_paged_attention_pallas(
            qq, k, v, jnp.asarray(np.cumsum([0] + ql[:-1]), jnp.int32), jnp.asarray(ql, jnp.int32),
            jnp.asarray([r[1] for r in rows], jnp.int32), jnp.asarray(np.stack([r[2] for r in rows]), jnp.int32),
            sm_scale=0.125, interpret=where == "interpret"))

    verification = attend(q[:5], [(5, kv, row)])
    for i in range(5):  # the query at position kv - 5 + i
        pos_kv = kv - 4 + i
        alone = attend(q[i : i + 1], [(1, pos_kv, row)])[0]
        crowd = attend(jnp.concatenate([q[20:23], q[i : i + 1], q[23:27]]),
                       [(1, 300, other), (1, 17, other), (1, 580, other), (1, pos_kv, row)]
                       + [(1, 64 * j + 9, other) for j in range(4)])[3]
        cases = [("among decode rows", crowd), ("verification row", verification[i])]
        if where == "gpu":
            cases.append(("prefill chunk", attend(jnp.concatenate([q[30:37], q[: i + 1]]),
                                                  [(7, 90, other), (i + 1, pos_kv, row)])[7 + i]))
        for name, got in cases:
            assert np.array_equal(got, alone), (i, name, np.abs(got - alone).max())


def test_gpu_shape_limits_are_checked_before_lowering():
    args = (jnp.zeros((4, 2, 8)), jnp.zeros((1, 3, 8, 8)), jnp.zeros((1, 3, 8, 8)), jnp.zeros(1, jnp.int32),
            jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32), jnp.ones((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="head_dim=8"):
        ragged_paged_attention_pallas(*args, sm_scale=1.0, interpret=False)


def test_tuning_is_static_and_hashable():
    assert AttentionTuning(block_q=8) == AttentionTuning(block_q=8)
    assert len({AttentionTuning(), AttentionTuning(), AttentionTuning(k_splits=2)}) == 2
    assert len({AttentionTuning(k_splits=2), AttentionTuning(k_splits=2, split_max_q=1)}) == 2


# ---------------------------------------------------------------------------------------------------------------
# split_max_q: in a mixed step only the short (decode) rows are split over keys
# ---------------------------------------------------------------------------------------------------------------


def mixed_step(dtype=jnp.float32):
    """A mixed step: a prefill chunk of 24 tokens mid-context (at token 3, so its last block also holds decode
    tokens at block_q 8), a row with a cached context and no query, and 6 decode rows whose contexts span 1 to 8
    key blocks of 16 keys (page size 8, 2 pages per block), in a 40-slot token axis with trailing padding.
    Returns (args, reference args, kwargs, prefill token slots, decode token slots)."""
    rng = np.random.default_rng(11)
    kh, g, d, ps, p = 2, 2, 16, 8, 16
    qlens = np.array([24, 0, 1, 1, 1, 1, 1, 1], np.int32)
    kvlens = np.array([70, 30, 9, 40, 77, 128, 100, 16], np.int32)
    qstart = np.array([3, 27, 27, 28, 29, 31, 32, 33], np.int32)  # a gap (token 30) of no row
    num_pages = 1 + len(qlens) * p
    table = np.zeros((len(qlens), p), np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    for s, kv in enumerate(kvlens):
        for j in range(-(-int(kv) // ps)):
            table[s, j] = free.pop()
    k_pages = rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32)
    v_pages = rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32)
    k_pages[:, 0], v_pages[:, 0] = 30.0, -30.0  # the null page: never visible
    q = rng.normal(size=(40, kh * g, d)).astype(np.float32)
    args = [jnp.asarray(x, dtype) for x in (q, k_pages, v_pages)] + [jnp.asarray(x) for x in
                                                                       (qstart, qlens, kvlens, table)]
    ref_args = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args]
    prefill = np.arange(3, 27)
    decode = np.array([27, 28, 29, 31, 32, 33])
    return args, ref_args, dict(sm_scale=d**-0.5), prefill, decode


@pytest.mark.parametrize("block_q", [1, 8])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_split_only_short_rows_matches_reference(block_q, dtype):
    """k_splits=4 with split_max_q=1 on a mixed step: the decode rows split over keys, the chunk attended whole;
    the output matches the spec, zeros in the slots of no row included."""
    args, ref_args, kw, _, _ = mixed_step(jnp.bfloat16 if dtype == "bf16" else jnp.float32)
    tuning = T(block_q=block_q, pages_per_block=2, k_splits=4, split_max_q=1)
    expected = np.asarray(ragged_paged_attention_reference(*ref_args, **kw))
    got = ragged_paged_attention_pallas(*args, config=tuning, interpret=True, **kw)
    assert got.shape == args[0].shape and got.dtype == args[0].dtype
    tol = 3e-2 if dtype == "bf16" else 2e-5
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), expected, atol=tol, rtol=tol)
    (call,) = find(ragged_paged_attention_pallas, *args, primitive="pallas_call", config=tuning, interpret=True,
                   **kw)
    assert tuple(call.params["grid_mapping"].grid) == (-(-40 // block_q), 2, 4)


@pytest.mark.parametrize("where", ["interpret", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")])])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_split_max_q_splits_the_decode_rows_and_leaves_the_chunk_bits(where, dtype):
    """With split_max_q=1 the chunk's tokens get exactly the bits of k_splits=1 (attended whole by split 0 and
    normalised in the kernel as k_splits=1 does: on a GPU Triton's division in the kernel need not round like
    XLA's in the merge), and the decode rows exactly those of every row split (k_splits=4, split_max_q=0): they
    are split."""
    args, _, kw, prefill, decode = mixed_step(jnp.bfloat16 if dtype == "bf16" else jnp.float32)

    def run(**tuning):
        return np.asarray(ragged_paged_attention_pallas(*args, config=T(block_q=8, pages_per_block=2, **tuning),
                                                        interpret=where == "interpret", **kw).astype(jnp.float32))

    whole, all_split = run(), run(k_splits=4)
    got = run(k_splits=4, split_max_q=1)
    assert np.array_equal(got[prefill], whole[prefill]), np.abs(got[prefill] - whole[prefill]).max()
    assert np.array_equal(got[decode], all_split[decode]), np.abs(got[decode] - all_split[decode]).max()
    others = np.setdiff1d(np.arange(40), np.concatenate([prefill, decode]))
    assert not got[others].any()
    # a cap at the chunk's length splits it too; one below it does not
    assert np.array_equal(run(k_splits=4, split_max_q=24), all_split)
    assert np.array_equal(run(k_splits=4, split_max_q=23)[prefill], whole[prefill])
    if where == "interpret" and dtype == "f32":  # the split really changes the chunk's rounding here
        assert not np.array_equal(all_split[prefill], whole[prefill])


def test_split_max_q_parses_from_the_tuning_string():
    from pallas_kernels.registry import attention_registry

    reg = attention_registry()
    assert reg.parse_tuning("pallas", "k_splits=4,split_max_q=1") == T(k_splits=4, split_max_q=1)
    assert reg.parse_tuning("pallas", {"k_splits": 2, "split_max_q": 16}).split_max_q == 16
    with pytest.raises(Exception, match="split_max_q"):
        reg.parse_tuning("pallas", "k_splits=4,split_max_q=-1")


# ---------------------------------------------------------------------------------------------------------------
# Native GPU run
# ---------------------------------------------------------------------------------------------------------------

GPU_CASES = [
    # (kinds, max_q, max_ctx, page_size, kv_heads, q_per_kv, head_dim, window, soft_cap, kv dtype, tuning)
    ("PdpddP0d", 64, 700, 16, 4, 3, 64, None, None, "f32", T(block_q=16, pages_per_block=4)),
    ("dddddddd", 1, 900, 16, 2, 4, 64, None, 30.0, "f32", T(block_q=1, pages_per_block=4, k_splits=4)),
    ("pdpd", 40, 500, 32, 2, 2, 128, 100, None, "int8", T(block_q=16, pages_per_block=2, k_splits=2)),
    ("PdddP", 50, 400, 16, 2, 8, 64, None, None, "bf16", None),
    ("pdddddd", 64, 700, 16, 2, 4, 64, None, None, "bf16", T(block_q=16, pages_per_block=4, k_splits=4, split_max_q=1)),
]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}-{c[9]}" for c in GPU_CASES])
def test_kernel_native_gpu_matches_reference(case):
    kinds, max_q, max_ctx, ps, kh, g, d, window, cap, kv_dtype, tuning = case
    rng = np.random.default_rng(GPU_CASES.index(case))
    args, ref_args, kw = kernel_inputs(rng, kinds, max_q, max_ctx, ps, kh, g, d, window, cap, kv_dtype)
    with jax.default_matmul_precision("highest"):
        expected = np.asarray(ragged_paged_attention_reference(*ref_args, **kw))
    start = time.perf_counter()
    got = ragged_paged_attention_pallas(*args, config=tuning, interpret=False, **kw).block_until_ready()
    print(f"compile+run {time.perf_counter() - start:.2f}s")
    tol = 3e-2 if kv_dtype == "bf16" else 2e-3
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("int8", [False, True])
def test_layer_of_a_stacked_cache_equals_that_layers_slice(monkeypatch, impl, int8):
    """`layer=` reads one layer of the stacked `[L, ...]` cache (the XLA path gathers from the stack directly, also
    inside the CPU's row groups) exactly as passing that layer's slice."""
    monkeypatch.setattr(pa, "CPU_DECODE_GATHER_BYTES", 1)  # row groups of one on the CPU
    layout, ps, kh, g, d, max_ctx = PrefillDecodeLayout(1, 8, 4), 8, 2, 2, 16, 40
    rng = np.random.default_rng(11)
    stack = [random_case(np.random.default_rng(i), layout, ps, kh, g, d, max_ctx) for i in range(3)]
    q, _, _, qlens, kvlens, table = random_case(rng, layout, ps, kh, g, d, max_ctx)
    kp = jnp.stack([jnp.asarray(c[1]) for c in stack])  # [L, KH, N, ps, D]
    vp = jnp.stack([jnp.asarray(c[2]) for c in stack])
    ks = vs = None
    if int8:
        pairs = [(quantize_pages(kp[i]), quantize_pages(vp[i])) for i in range(3)]
        kp, ks = jnp.stack([a[0][0] for a in pairs]), jnp.stack([a[0][1] for a in pairs])
        vp, vs = jnp.stack([a[1][0] for a in pairs]), jnp.stack([a[1][1] for a in pairs])
    args = (jnp.asarray(q),)
    rest = (layout_query_start(layout), jnp.asarray(qlens), jnp.asarray(kvlens), jnp.asarray(table))
    kw = dict(sm_scale=d**-0.5, impl=impl, layout=layout)
    calls = spy_impls(monkeypatch)
    for layer in range(3):
        pick = lambda a, i=layer: None if a is None else a[i]
        want = paged_attention(*args, kp[layer], vp[layer], *rest, k_scales=pick(ks), v_scales=pick(vs), **kw)
        calls.clear()
        got = paged_attention(*args, kp, vp, *rest, k_scales=ks, v_scales=vs, layer=jnp.int32(layer), **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
        (name, call_args, call_kw), = calls
        assert IMPL_OF[name] == impl
        if impl == "xla":  # handed the whole stack and the layer index, not a slice
            assert call_args[1].shape == kp.shape and int(call_kw["layer"]) == layer


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("impl", ["reference", "xla", "pallas", "native"])
def test_non_finite_values_in_slots_no_row_sees_leave_the_output_alone(impl, int8):
    """The cache slots past a row's kv_len (its last page's tail, the null page 0 that pads a short row's page table)
    hold what was written there last, possibly another job's NaN or inf. A row never sees them, so its output is the
    one with those slots clean: an implementation that weights them by 0 instead of dropping them gets 0 * NaN."""
    if impl == "native" and not NATIVE:
        pytest.skip(f"native attention: {native_attention.library_reason()}")
    case = pa.contract_case(stacked=False, int8=int8)  # rows: 3 queries over 11 keys (pages 1, 2); 1 over 5 (3, 0)
    clean = pa.paged_attention(impl=impl, interpret=True, **case)
    assert np.isfinite(np.asarray(clean)).all()
    poisoned = dict(case)
    for name, scale in (("k_pages", "k_scales"), ("v_pages", "v_scales")):
        pool = np.array(case[name])
        bad = np.iinfo(np.int8).max if int8 else np.nan
        pool[:, 2, 3:] = bad  # page 2 past row 0's kv_len 11 (8 + 3)
        pool[:, 3, 5:] = bad  # page 3 past row 1's kv_len 5
        pool[:, 0] = bad  # the null page padding row 1's table
        poisoned[name] = jnp.asarray(pool)
        if int8:  # an int8 cache's poison is in its scales
            s = np.array(case[scale])
            s[:, 2, 3:] = np.inf
            s[:, 3, 5:] = np.nan
            s[:, 0] = np.inf
            poisoned[scale] = jnp.asarray(s)
    got = pa.paged_attention(impl=impl, interpret=True, **poisoned)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))
