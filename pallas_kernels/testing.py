"""The kernel conformance suite as a library: the case space, input builders, tolerances and checks that any
implementation of a kernel family must pass (the project's own kernel tests use them too).

    from pallas_kernels import testing
    for case in testing.attention_cases("quick"):
        testing.check_attention("my_module:my_attention", case)   # AssertionError saying where it differs

or through pytest, for any registered implementation or import path:

    python -m pytest --pyargs pallas_kernels.conformance --kernel=my_module:my_attention [--kernel-level=full]

Attention cases (`AttentionCase`) span page sizes 8-64, 1-3 KV heads, GQA ratios 1-4 (MHA, GQA, MQA), head dims
8-64, prefill-only, decode-only and mixed batches (given with their `PrefillDecodeLayout`, as the engine's XLA path
sees them, or fully ragged with gaps between rows and no layout, as the Pallas kernel sees them), empty rows, rows
ending exactly on a page boundary, a sliding window, a soft cap, float32 / bfloat16 / int8 caches and the stacked
`[L, ...]` cache with `layer=`. Every case checks against `ragged_paged_attention_reference` (itself checked against
a NumPy loop in the project's tests) at the case's dtype tolerance, and that tokens of no row come out zero. The
null page (page 0) holds large values that a correct kernel never reads into a visible score.

Matmul cases (`MatmulCase`) span the weight kinds (q4_1, q4_0, int8 grouped, int8 per channel), group sizes 32 and
64, row counts 1 (decode) to 40, and float32 / bfloat16 activations, against a float64 NumPy decoding of the format.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import (
    PrefillDecodeLayout,
    layout_query_start,
    paged_attention,
    quantize_kv,
    ragged_paged_attention_reference,
)
from pallas_kernels.quant_format import QuantizedArray, random_quantized

# --------------------------------------------------------------------------------------------------- attention


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One point of the attention case space.

    rows: one letter per row: `P` a prefill from position 0, `p` a prefill chunk starting mid-context, `d` a decode
        row, `0` an empty row with a cached context, `-` an empty padding row. With `layout=True` the prefill rows
        (P, p, and 0/- among them) come first in windows of `max_q` tokens and the decode rows (d, 0, -) follow, one
        slot each, as `PrefillDecodeLayout(num_prefill, max_q, num_decode)`; otherwise rows sit in random order with
        random gaps (tokens of no row) and no layout is passed.
    max_q: the longest prefill chunk; max_ctx: the longest context; page_size; kv_heads; q_per_kv (query heads per
    KV head); head_dim; window: sliding window or None; soft_cap or None; cache: "float32", "bfloat16" (q too) or
    "int8" (per-token scales); stacked: the cache has 3 layers and `layer=1` is attended; page_aligned: every
    non-empty row's context ends on a page boundary; mixes: independent draws of the row lengths (same shapes, so
    one compilation).
    """

    name: str
    rows: str
    max_q: int
    max_ctx: int
    page_size: int
    kv_heads: int
    q_per_kv: int
    head_dim: int
    layout: bool = False
    window: int | None = None
    soft_cap: float | None = None
    cache: str = "float32"
    stacked: bool = False
    page_aligned: bool = False
    mixes: int = 2

    @property
    def prefill_layout(self) -> PrefillDecodeLayout | None:
        if not self.layout:
            return None
        npre = sum(k in "Pp" for k in self.rows)
        ndec = len(self.rows) - npre
        return PrefillDecodeLayout(npre, self.max_q if npre else 1, ndec)


_QUICK = [
    AttentionCase("decode-mqa-ps8", "ddd0d-", 1, 40, 8, 1, 4, 8, layout=True),
    AttentionCase("mixed-gqa2-ps16-window", "Pp-dd0d", 9, 70, 16, 2, 2, 16, layout=True, window=11),
    AttentionCase("ragged-gqa4-ps32-cap", "dpd-P", 20, 100, 32, 2, 4, 32, soft_cap=3.0),
    AttentionCase("ragged-mha-int8", "ddpd0", 6, 60, 8, 3, 1, 16, cache="int8"),
    AttentionCase("mixed-bf16-page-aligned", "Ppdd", 16, 64, 16, 2, 2, 16, layout=True, cache="bfloat16",
                  page_aligned=True),
    AttentionCase("stacked-layer-int8", "Pdd", 8, 40, 8, 2, 2, 16, layout=True, cache="int8", stacked=True),
]
_FULL_EXTRA = [
    AttentionCase("prefill-only-ps64-hd64", "PpP", 24, 150, 64, 1, 2, 64, layout=True),
    AttentionCase("decode-many-pages", "ddddd0d-", 1, 160, 8, 2, 2, 16, layout=True),
    AttentionCase("ragged-window-cap", "pd0dp", 16, 50, 16, 3, 3, 8, window=6, soft_cap=2.0),
    AttentionCase("ragged-long-chunk-int8", "pd", 40, 130, 8, 1, 2, 16, cache="int8"),
    AttentionCase("ragged-int8-window", "dpdP", 12, 90, 16, 2, 2, 32, window=20, cache="int8"),
    AttentionCase("ragged-bf16", "pdd0P", 10, 60, 16, 2, 4, 16, cache="bfloat16"),
    AttentionCase("mixed-page-aligned-window", "pPddd", 16, 96, 16, 2, 2, 16, layout=True, window=16,
                  page_aligned=True),
    AttentionCase("stacked-ragged", "dPd-", 8, 48, 8, 1, 4, 16, stacked=True),
    AttentionCase("empty-rows-only-one-real", "--d0-", 1, 30, 8, 1, 2, 8),
]


def attention_cases(level: str = "quick") -> list[AttentionCase]:
    """The attention case space: "quick" (6 cases: every feature once) or "full" (15)."""
    if level not in ("quick", "full"):
        raise ValueError(f"level must be 'quick' or 'full', got {level!r}")
    return list(_QUICK) + (list(_FULL_EXTRA) if level == "full" else [])


@jax.jit
def quantize_pages(pages: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """[KH, N, ps, D] float -> int8 pages and [KH, N, ps] scales, through the engine's `quantize_kv`."""
    kh, n, ps, d = pages.shape
    x = pages.transpose(1, 2, 0, 3).reshape(n * ps, kh, d)  # [T, KH, D] as the engine writes them
    qx, sc = quantize_kv(x)
    return qx.reshape(n, ps, kh, d).transpose(2, 0, 1, 3), sc.reshape(n, ps, kh).transpose(2, 0, 1)


def ragged_rows(rng: np.random.Generator, case: AttentionCase) -> tuple[np.ndarray, ...]:
    """(query_start, query_lens, kv_lens, num_tokens) of one draw of `case`'s rows."""
    kinds = case.rows
    s_count, ps = len(kinds), case.page_size
    qlens = np.zeros(s_count, np.int32)
    kvlens = np.zeros(s_count, np.int32)
    for s, kind in enumerate(kinds):
        if kind == "P":
            qlens[s] = kvlens[s] = rng.integers(2, case.max_q + 1)
        elif kind == "p":
            qlens[s] = rng.integers(2, case.max_q + 1)
            kvlens[s] = rng.integers(qlens[s] + 1, max(case.max_ctx, qlens[s] + 1) + 1)
        elif kind == "d":
            qlens[s], kvlens[s] = 1, rng.integers(1, case.max_ctx + 1)
        elif kind == "0":
            kvlens[s] = rng.integers(1, case.max_ctx + 1)
        if case.page_aligned and kvlens[s] and kind != "P":  # end the context on a page boundary
            kvlens[s] = -(-kvlens[s] // ps) * ps
    lay = case.prefill_layout
    if lay is not None:
        order = [s for s, k in enumerate(kinds) if k in "Pp"] + [s for s, k in enumerate(kinds) if k not in "Pp"]
        qstart = np.asarray(layout_query_start(lay))
        return (qstart, qlens[order], kvlens[order], lay.num_tokens)
    qstart = np.zeros(s_count, np.int32)
    pos = 0
    for s in rng.permutation(s_count):
        pos += int(rng.random() < 0.3)
        qstart[s] = pos
        pos += qlens[s]
    t_count = sum(case.max_q if k in "pP" else k == "d" for k in kinds) + len(kinds) + 3  # >= pos + 3
    return qstart, qlens, kvlens, t_count


def build_attention_inputs(case: AttentionCase, mix: int = 0) -> dict[str, Any]:
    """The keyword arguments of `paged_attention` (without `impl`) for draw `mix` of `case`: q, k_pages, v_pages,
    query_start, query_lens, kv_lens, page_table, sm_scale, layout, sliding_window, soft_cap, k_scales, v_scales and,
    for stacked cases, layer. Shapes depend only on the case, never on the draw."""
    rng = np.random.default_rng([zlib.crc32(case.name.encode()), mix])
    qstart, qlens, kvlens, t_count = ragged_rows(rng, case)
    kh, g, d, ps = case.kv_heads, case.q_per_kv, case.head_dim, case.page_size
    s_count = len(qlens)
    max_kv = max(case.max_ctx, case.max_q + 1)
    max_kv = -(-max_kv // ps) * ps if case.page_aligned else max_kv
    p = -(-max_kv // ps) + 1  # one more column than any row needs: padded with the null page
    num_pages = 1 + s_count * (p - 1) + 2
    free = list(rng.permutation(np.arange(1, num_pages)))
    table = np.zeros((s_count, p), np.int32)
    for s in range(s_count):
        for j in range(-(-int(kvlens[s]) // ps)):
            table[s, j] = free.pop()
    layers = 3 if case.stacked else 1
    k_pages = rng.normal(size=(layers, kh, num_pages, ps, d)).astype(np.float32)
    v_pages = rng.normal(size=(layers, kh, num_pages, ps, d)).astype(np.float32)
    k_pages[:, :, 0], v_pages[:, :, 0] = 30.0, -30.0  # the null page: must never be visible
    q = rng.normal(size=(t_count, kh * g, d)).astype(np.float32)
    kp, vp = jnp.asarray(k_pages), jnp.asarray(v_pages)
    ks = vs = None
    qj = jnp.asarray(q)
    if case.cache == "int8":
        pairs = [(quantize_pages(kp[i]), quantize_pages(vp[i])) for i in range(layers)]
        kp, ks = jnp.stack([a[0][0] for a in pairs]), jnp.stack([a[0][1] for a in pairs])
        vp, vs = jnp.stack([a[1][0] for a in pairs]), jnp.stack([a[1][1] for a in pairs])
    elif case.cache == "bfloat16":
        qj, kp, vp = qj.astype(jnp.bfloat16), kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16)
    elif case.cache != "float32":
        raise ValueError(f"cache must be float32, bfloat16 or int8, got {case.cache!r}")
    if not case.stacked:
        kp, vp = kp[0], vp[0]
        ks, vs = (None if ks is None else ks[0]), (None if vs is None else vs[0])
    out = dict(q=qj, k_pages=kp, v_pages=vp, query_start=jnp.asarray(qstart, jnp.int32),
               query_lens=jnp.asarray(qlens), kv_lens=jnp.asarray(kvlens), page_table=jnp.asarray(table),
               sm_scale=d**-0.5, layout=case.prefill_layout, sliding_window=case.window, soft_cap=case.soft_cap,
               k_scales=ks, v_scales=vs)
    if case.stacked:
        out["layer"] = jnp.int32(1)
    return out


def attention_tolerance(case: AttentionCase) -> float:
    """Absolute and relative tolerance against the reference: float32 2e-5 (the reference runs at highest matmul
    precision, an implementation may use the default: on a GPU that is TF32, hence 2e-3 there); bfloat16 3e-2;
    int8 caches as float32 (the scales are the same numbers in both)."""
    if case.cache == "bfloat16":
        return 3e-2
    return 2e-3 if jax.default_backend() == "gpu" else 2e-5


@functools.partial(jax.jit, static_argnames=("impl", "layout", "sm_scale", "sliding_window", "soft_cap", "tuning",
                                             "interpret"))
def _run(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, k_scales, v_scales, layer, *, impl,
         layout, sm_scale, sliding_window, soft_cap, tuning, interpret):
    return paged_attention(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, sm_scale=sm_scale,
                           impl=impl, layout=layout, sliding_window=sliding_window, soft_cap=soft_cap,
                           k_scales=k_scales, v_scales=v_scales, config=tuning, interpret=interpret, layer=layer)


def run_attention(impl: Any, inputs: dict[str, Any], *, tuning: Any = None, interpret: bool | None = None):
    """`paged_attention(impl=impl, **inputs)` under `jax.jit`, as the engine calls it (arrays traced)."""
    i = inputs
    return _run(i["q"], i["k_pages"], i["v_pages"], i["query_start"], i["query_lens"], i["kv_lens"],
                i["page_table"], i["k_scales"], i["v_scales"], i.get("layer"), impl=impl, layout=i["layout"],
                sm_scale=i["sm_scale"], sliding_window=i["sliding_window"], soft_cap=i["soft_cap"], tuning=tuning,
                interpret=interpret)


def reference_attention(inputs: dict[str, Any]) -> np.ndarray:
    """float32 NumPy output of the reference for `inputs` (the layer's slice for stacked inputs)."""
    i = dict(inputs)
    layer = i.pop("layer", None)
    if layer is not None:
        for k in ("k_pages", "v_pages", "k_scales", "v_scales"):
            i[k] = None if i[k] is None else i[k][int(layer)]
    f32 = lambda a: a.astype(jnp.float32) if a is not None and a.dtype == jnp.bfloat16 else a  # noqa: E731
    with jax.default_matmul_precision("highest"):
        out = ragged_paged_attention_reference(
            f32(i["q"]), f32(i["k_pages"]), f32(i["v_pages"]), i["query_start"], i["query_lens"], i["kv_lens"],
            i["page_table"], sm_scale=i["sm_scale"], sliding_window=i["sliding_window"], soft_cap=i["soft_cap"],
            k_scales=i["k_scales"], v_scales=i["v_scales"])
    return np.asarray(out, np.float32)


def native_gpu_skip_reason(impl: Any, case: AttentionCase, interpret: bool | None = None) -> str | None:
    """Why the built-in kernel, running natively on a GPU, does not take `case` (its shape rules,
    `gpu_unsupported_reason`), or None. Conformance runs skip such cases; "auto" sends such models to "xla"."""
    from pallas_kernels import registry
    from pallas_kernels.paged_attention import ATTENTION, gpu_unsupported_reason

    if interpret or not registry.on_gpu() or ATTENTION.get(impl) is not ATTENTION.get("pallas"):
        return None
    reason = gpu_unsupported_reason(case.head_dim, case.page_size)
    return None if reason is None else f"the GPU kernel does not take {case.name}: {reason}"


def check_attention(impl: Any, case: AttentionCase, *, tuning: Any = None, interpret: bool | None = None) -> None:
    """AssertionError unless implementation `impl` (a registered name, a `module:function` path or a `KernelImpl`)
    matches the reference on every draw of `case`: the output's shape and dtype, zeros for tokens of no row, and
    every value within `attention_tolerance(case)`. The message names the case, draw, and where the first wrong
    value is: token, query head (and its KV head), the batch row owning the token, its position in the row's
    sequence, the row's kv_len, and the page holding that position (`token_place`)."""
    tol = attention_tolerance(case)
    for mix in range(case.mixes):
        inputs = build_attention_inputs(case, mix)
        got = run_attention(impl, inputs, tuning=tuning, interpret=interpret)
        q = inputs["q"]
        assert got.shape == q.shape and got.dtype == q.dtype, (
            f"{case.name} (draw {mix}): output {got.shape} {got.dtype}, expected the query's {q.shape} {q.dtype}")
        got = np.asarray(got.astype(jnp.float32))
        want = reference_attention(inputs)
        qs, ql = np.asarray(inputs["query_start"]), np.asarray(inputs["query_lens"])
        owned = np.zeros(q.shape[0], bool)
        for s0, n in zip(qs, ql):
            owned[s0 : s0 + n] = True
        stray = np.abs(got[~owned]).max(initial=0.0)
        if stray != 0.0:
            t = int(np.flatnonzero(~owned & (np.abs(got).reshape(len(got), -1).max(axis=1) != 0))[0])
            raise AssertionError(f"{case.name} (draw {mix}): tokens of no row must be zero, found |x| up to "
                                 f"{stray:.3g}; first at token {t}")
        err = np.abs(got - want)
        bad = ~(err <= tol + tol * np.abs(want))  # (so that NaN, which compares false, is bad too)
        if bad.any():
            t, h, _ = (int(i) for i in np.argwhere(bad)[0])
            where = describe_place(token_place(inputs, t))
            raise AssertionError(
                f"{case.name} (draw {mix}): {int(bad.sum())} of {bad.size} values differ from the reference by more "
                f"than {tol}{_non_finite(got)} (max error {np.nanmax(err, initial=0.0):.3g}); first at token {t}, "
                f"head {h} (KV head {h // case.q_per_kv}), {where}: got {got[t, h, :4]}, want {want[t, h, :4]}")


def _non_finite(got: np.ndarray) -> str:
    n = int((~np.isfinite(got)).sum())
    return f", {n} of them NaN or infinite" if n else ""


def token_place(inputs: dict[str, Any], t: int) -> dict[str, int] | None:
    """Where token `t` of a batch (`build_attention_inputs`' arrays) sits: `row` (the batch row owning it),
    `position` (its position in the row's sequence), the row's `kv_len`, `page_index` (the column of the row's page
    table holding that position), `page` (the page id there; -1 past the table's end) and `offset` (within the
    page). None for a token of no row."""
    qs, ql, kv = (np.asarray(inputs[k]) for k in ("query_start", "query_lens", "kv_lens"))
    table = np.asarray(inputs["page_table"])
    ps = inputs["k_pages"].shape[-2]
    for s in range(len(qs)):
        if qs[s] <= t < qs[s] + ql[s]:
            pos = int(kv[s] - ql[s] + t - qs[s])
            idx = pos // ps
            page = int(table[s, idx]) if idx < table.shape[1] else -1
            return dict(row=s, position=pos, kv_len=int(kv[s]), page_index=idx, page=page, offset=pos % ps)
    return None


def describe_place(place: dict[str, int] | None) -> str:
    """`token_place`'s answer in words."""
    if place is None:
        return "a token of no row"
    return (f"row {place['row']}, position {place['position']} (kv_len {place['kv_len']}; page table column "
            f"{place['page_index']}: page {place['page']}, offset {place['offset']})")


# ------------------------------------------------------------------------------------------------------ matmul


@dataclasses.dataclass(frozen=True)
class MatmulCase:
    """One point of the dequant-matmul case space: `x` `[n, k]` (float32 or bfloat16) @ a `kind` matrix `[k, out]`
    in groups of `group_size` (None: per output channel, int8 only)."""

    name: str
    kind: str
    group_size: int | None
    n: int
    k: int
    out: int
    x_dtype: str = "float32"


_MM_QUICK = [
    MatmulCase("q4_1-decode", "q4_1", 32, 1, 128, 64),
    MatmulCase("q4_0-batch", "q4_0", 32, 7, 128, 64),
    MatmulCase("int8-g32-batch", "int8", 32, 16, 128, 64),
    MatmulCase("int8-per-channel", "int8", None, 3, 128, 64),
]
_MM_FULL_EXTRA = [
    MatmulCase("q4_1-g64-prefill", "q4_1", 64, 40, 256, 128),
    MatmulCase("q4_0-bf16", "q4_0", 32, 5, 128, 64, "bfloat16"),
    MatmulCase("int8-wide", "int8", 64, 2, 256, 192),
    MatmulCase("q4_1-odd-rows", "q4_1", 32, 33, 64, 32),
]


def matmul_cases(level: str = "quick") -> list[MatmulCase]:
    """The dequant-matmul case space: "quick" (4 cases: every weight kind once) or "full" (8)."""
    if level not in ("quick", "full"):
        raise ValueError(f"level must be 'quick' or 'full', got {level!r}")
    return list(_MM_QUICK) + (list(_MM_FULL_EXTRA) if level == "full" else [])


def numpy_dequantize(qa: QuantizedArray) -> np.ndarray:
    """float64 `[in, out]` from the raw leaves of one (unstacked) `qa`, element by element from the documented
    format: element `i` of column `o` is in group `g = i // G`; for q4 kinds its quant is the low nibble of packed
    row `g * G/2 + i % G` when `i % G < G/2`, else the high nibble of packed row `g * G/2 + i % G - G/2`."""
    k, out = qa.shape
    g = qa.group_size
    i = np.arange(k)
    group = i // g  # [in]
    scales = np.asarray(qa.scales, np.float64)[group]  # [in, out]
    values = np.asarray(qa.values)
    if qa.kind == "int8":
        return values.astype(np.float64) * scales
    r = i % g
    low = r < g // 2
    packed = values[group * (g // 2) + np.where(low, r, r - g // 2)].astype(np.int64)  # [in, out]
    q = np.where(low[:, None], packed & 15, packed >> 4).astype(np.float64)
    if qa.kind == "q4_1":
        return q * scales + np.asarray(qa.mins, np.float64)[group]
    assert qa.kind == "q4_0", qa.kind
    return (q - 8.0) * scales


def numpy_matmul(x: np.ndarray, qa: QuantizedArray) -> np.ndarray:
    """`x` `[N, in]` @ the matrix `qa` stands for, in float64 NumPy: an oracle independent of `dequantize`."""
    return np.asarray(x, np.float64) @ numpy_dequantize(qa)


def build_matmul_inputs(case: MatmulCase) -> tuple[jnp.ndarray, QuantizedArray]:
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    x = jnp.asarray(rng.normal(size=(case.n, case.k)).astype(np.float32), jnp.dtype(case.x_dtype))
    return x, random_quantized(rng, case.kind, case.group_size, case.k, case.out)


def matmul_tolerance(case: MatmulCase, impl: Any = None) -> float:
    """Relative tolerance (of the output's largest magnitude) against the float64 oracle: float32 activations 2e-5
    (2e-3 on a GPU, where dots may use TF32); bfloat16 activations 1e-2 (x itself is rounded); at least the
    implementation's own `tolerance` when it is approximate by design (it quantizes activations)."""
    from pallas_kernels.registry import MATMUL, KernelImpl

    if case.x_dtype == "bfloat16":
        base = 1e-2
    else:
        base = 2e-3 if jax.default_backend() == "gpu" else 2e-5
    entry = impl if isinstance(impl, KernelImpl) else (MATMUL.get(impl) if isinstance(impl, str) else None)
    return max(base, entry.tolerance or 0.0) if entry is not None else base


def check_matmul(impl: Any, case: MatmulCase, *, tuning: Any = None, interpret: bool | None = None) -> None:
    """AssertionError unless `impl` gives float32 `[n, out]` within `matmul_tolerance(case)` of the oracle."""
    from pallas_kernels.dequant_matmul import dequant_matmul

    x, qa = build_matmul_inputs(case)
    run = jax.jit(lambda x, qa: dequant_matmul(x, qa, impl=impl, config=tuning, interpret=interpret))
    got = run(x, qa)
    assert got.shape == (case.n, case.out) and got.dtype == jnp.float32, (
        f"{case.name}: output {got.shape} {got.dtype}, expected float32 {(case.n, case.out)}")
    want = numpy_matmul(np.asarray(x.astype(jnp.float32)), qa)
    tol = matmul_tolerance(case, impl) * max(np.abs(want).max(), 1e-6)
    err = np.abs(np.asarray(got, np.float64) - want)
    bad = ~(err <= tol)  # (so that NaN, which compares false, is bad too)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise AssertionError(f"{case.name}: {int(bad.sum())} of {err.size} values differ from the oracle by more than "
                             f"{tol:.3g}{_non_finite(np.asarray(got))} (max {np.nanmax(err, initial=0.0):.3g}); first "
                             f"at row {r} of x, output column {c}: got {got[r, c]}, want {want[r, c]}")


__all__ = [
    "AttentionCase",
    "MatmulCase",
    "attention_cases",
    "attention_tolerance",
    "build_attention_inputs",
    "build_matmul_inputs",
    "check_attention",
    "check_matmul",
    "describe_place",
    "matmul_cases",
    "matmul_tolerance",
    "numpy_dequantize",
    "numpy_matmul",
    "quantize_pages",
    "reference_attention",
    "run_attention",
    "token_place",
]
