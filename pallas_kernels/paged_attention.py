"""Ragged paged attention: the pure-jnp reference (the spec), the XLA fast path used on the CPU, and a Pallas
kernel for the GPU (Triton lowering; interpreted on the CPU).

KV cache layout (per layer): head-major pages `[KH, num_pages, page_size, D]`. Head-major keeps each head's pages
contiguous, so a decode gather reads `page_size * D` contiguous floats per page and the score/value contractions are
plain batched matmuls over `[KH, L, D]`; on XLA:CPU this measured faster than token-major `[pages, page_size, KH, D]`
(see docs/architecture.md). Page 0 is reserved as the null page: padding tokens write there and padded page-table
entries point there; its contents are never visible because `kv_lens` masks them.

Ragged batch semantics (shared by every implementation):
- row s owns query tokens `q[query_start[s] : query_start[s] + query_lens[s]]`;
- `kv_lens[s]` counts the row's tokens in the cache *including* this step's new tokens (already written), so query
  i of row s sits at absolute position `kv_lens[s] - query_lens[s] + i` and sees keys `0..position` (causal), or
  only the last `sliding_window` of them;
- the row's keys live in pages `page_table[s, 0..]`, token j at page `page_table[s, j // page_size]`, offset
  `j % page_size`;
- tokens that belong to no row, and rows whose keys are all masked, produce zeros.

Quantized KV: `k_pages`/`v_pages` may be int8 with float32 scales `k_scales`/`v_scales` `[KH, num_pages,
page_size]`, one per token per head (`quantize_kv` makes them); a key is `int8 * scale`. Every implementation
folds the scales into the scores and the softmax weights instead of dequantizing whole pages.

Implementations: `ragged_paged_attention_reference` (the spec), `ragged_paged_attention_xla` (batches in
`PrefillDecodeLayout`, the CPU path), `ragged_paged_attention_pallas` (a Pallas kernel over any ragged batch, for
the GPU; interpreted on the CPU), and `paged_attention`, the dispatcher. They are registered in
`pallas_kernels.registry.ATTENTION` as "reference", "xla" and "pallas"; a new one is registered the same way, or
named by its import path `module:function` wherever an implementation name is accepted.

The contract of an implementation (what `paged_attention`, hence the engine's step, calls):

    fn(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *,
       sm_scale, sliding_window, soft_cap, k_scales, v_scales, layout, tuning) -> out

- q `[T, nH, D]` (the model's dtype: float32 or bfloat16); out: the same shape and dtype, zeros for tokens of no
  row. nH is a multiple of KH (grouped-query attention: query head h reads KV head h // (nH // KH)).
- k_pages, v_pages `[KH, num_pages, page_size, D]`: float32/bfloat16, or int8 with k_scales, v_scales
  `[KH, num_pages, page_size]` float32 (else both None). Page 0 is the null page.
- query_start, query_lens, kv_lens `[S]` int32 and page_table `[S, P]` int32: the ragged batch above. Rows with
  query_lens 0 are padding. In the engine's batches `query_start` is `layout_query_start(layout)` extended by the
  decode tokens' slots, and the decode tokens of a prefill bucket sit in the last window's padding.
- sm_scale float; sliding_window int >= 1 or None; soft_cap float or None (all static).
- layout: the `PrefillDecodeLayout` the batch is padded to, or None (then only the ragged arrays describe it). With
  S == layout.num_rows the batch is exactly the layout (windows of `max_q_len` tokens, then one slot per decode
  row); the engine's prefill buckets may also put decode rows in the padding of the last window, and then S >
  layout.num_rows and only `query_start` says where they are.
- tuning: whatever the implementation's `tuning_type` is (a frozen, hashable dataclass; `AttentionTuning` for the
  built-in kernel), or None for its default. Set it with `EngineConfig.attn_tuning` / `--attn_tuning`.
- Registered with `stacked_cache=True`, it also gets `layer` (int32 scalar) and the stacked cache
  `[L, KH, num_pages, page_size, D]` (scales `[L, KH, num_pages, page_size]`) and must read that layer; otherwise
  the dispatcher passes the layer's slice.
It is called inside `jax.jit` with the arrays traced and everything else static. `check_contract` traces it on a
small case at registration; `pallas_kernels.testing` holds the conformance suite.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import native_attention, registry
from pallas_kernels.registry import ATTENTION, KernelContractError, KernelError, KernelImpl, split_tuning
from pallas_kernels.tuning import AttentionTuning, default_tuning

NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class PrefillDecodeLayout:
    """Static token layout of a batch, used by the XLA path: `num_prefill_rows` windows of `max_q_len` tokens
    (row s owns tokens `[s * max_q_len, (s + 1) * max_q_len)`, of which the first `query_lens[s]` are real),
    followed by `num_decode_rows` single-token rows."""

    num_prefill_rows: int
    max_q_len: int
    num_decode_rows: int

    def __post_init__(self):
        if self.num_prefill_rows < 0 or self.num_decode_rows < 0 or self.max_q_len < 1:
            raise ValueError(f"invalid layout {self}")
        if self.num_prefill_rows == 0 and self.max_q_len != 1:
            raise ValueError(f"a layout without prefill rows must have max_q_len=1, got {self}")

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_rows * self.max_q_len + self.num_decode_rows

    @property
    def num_rows(self) -> int:
        return self.num_prefill_rows + self.num_decode_rows


def _soft_cap(s: jnp.ndarray, soft_cap: float | None) -> jnp.ndarray:
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _visible(q_pos: jnp.ndarray, k_pos: jnp.ndarray, kv_len: jnp.ndarray, sliding_window: int | None) -> jnp.ndarray:
    ok = (k_pos <= q_pos) & (k_pos < kv_len)
    if sliding_window is not None:
        ok &= (q_pos - k_pos) < sliding_window
    return ok


def _check_scales(k_pages, v_pages, k_scales, v_scales) -> None:
    if (k_scales is None) != (v_scales is None):
        raise ValueError("pass both k_scales and v_scales, or neither")
    if k_scales is None:
        return
    want = k_pages.shape[:3]
    if k_scales.shape != want or v_scales.shape != v_pages.shape[:3]:
        raise ValueError(f"scales must be [KH, num_pages, page_size] = {want}, got k_scales {k_scales.shape}, "
                         f"v_scales {v_scales.shape}")


@jax.jit
def quantize_kv(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Symmetric int8 quantization per token per head: `x` `[T, KH, D]` float -> (`[T, KH, D]` int8, scales
    `[T, KH]` float32) with `scale = max|x| / 127` over D and `x ~= q * scale`; an all-zero vector gets scale 0.
    The engine writes both into the cache: `k_pages[:, page, off] = q`, `k_scales[:, page, off] = scale`."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / 127.0  # [T, KH]
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(xf / safe[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(
    q: jnp.ndarray,  # [T, nH, D]
    k_pages: jnp.ndarray,  # [KH, num_pages, page_size, D]
    v_pages: jnp.ndarray,  # [KH, num_pages, page_size, D]
    query_start: jnp.ndarray,  # [S] int32
    query_lens: jnp.ndarray,  # [S] int32
    kv_lens: jnp.ndarray,  # [S] int32
    page_table: jnp.ndarray,  # [S, P] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jnp.ndarray | None = None,  # [KH, num_pages, page_size] float32, with int8 k_pages
    v_scales: jnp.ndarray | None = None,  # [KH, num_pages, page_size] float32, with int8 v_pages
) -> jnp.ndarray:  # [T, nH, D]
    """The spec: every token gathers its own row's whole context. Simple, memory-hungry; for tests."""
    _check_scales(k_pages, v_pages, k_scales, v_scales)
    t_count, nh, d = q.shape
    kh, _, ps, _ = k_pages.shape
    g = nh // kh
    s_count, p = page_table.shape
    t = jnp.arange(t_count)
    member = (t[:, None] >= query_start[None, :]) & (t[:, None] < (query_start + query_lens)[None, :])  # [T, S]
    valid = member.any(axis=1)
    row = jnp.argmax(member, axis=1)  # [T]
    q_pos = kv_lens[row] - query_lens[row] + (t - query_start[row])  # [T]
    pages = page_table[row]  # [T, P]
    k = k_pages[:, pages].reshape(kh, t_count, p * ps, d).astype(jnp.float32)  # [KH, T, L, D]
    v = v_pages[:, pages].reshape(kh, t_count, p * ps, d).astype(jnp.float32)
    if k_scales is not None:
        k = k * k_scales[:, pages].reshape(kh, t_count, p * ps, 1)
        v = v * v_scales[:, pages].reshape(kh, t_count, p * ps, 1)
    qf = q.reshape(t_count, kh, g, d).astype(jnp.float32)
    s = jnp.einsum("tkgd,ktld->tkgl", qf, k) * sm_scale
    s = _soft_cap(s, soft_cap)
    k_pos = jnp.arange(p * ps)
    vis = _visible(q_pos[:, None], k_pos[None, :], kv_lens[row][:, None], sliding_window)  # [T, L]
    vis &= valid[:, None]
    s = jnp.where(vis[:, None, None, :], s, NEG_INF)
    w = jax.nn.softmax(s, axis=-1) * vis[:, None, None, :]
    v = jnp.where(vis[None, :, :, None], v, 0.0)  # an invisible slot's value may be non-finite: 0 * NaN = NaN
    o = jnp.einsum("tkgl,ktld->tkgd", w, v)
    return o.reshape(t_count, nh, d).astype(q.dtype)


def _attend_rows(
    q: jnp.ndarray,  # [R, Q, KH, G, D] float32
    k: jnp.ndarray,  # [R, KH, L, D]
    v: jnp.ndarray,  # [R, KH, L, D]
    q_pos: jnp.ndarray,  # [R, Q]
    kv_len: jnp.ndarray,  # [R]
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: jnp.ndarray | None = None,  # [R, KH, L] float32 (int8 k)
    v_scale: jnp.ndarray | None = None,  # [R, KH, L] float32 (int8 v)
) -> jnp.ndarray:  # [R, Q, KH, G, D]
    s = jnp.einsum("rqkgd,rkld->rkgql", q, k, preferred_element_type=jnp.float32) * sm_scale
    if k_scale is not None:
        s = s * k_scale[:, :, None, None, :]
    s = _soft_cap(s, soft_cap)
    k_pos = jnp.arange(k.shape[2])
    vis = _visible(q_pos[:, :, None], k_pos[None, None, :], kv_len[:, None, None], sliding_window)  # [R, Q, L]
    vis = vis[:, None, None]  # [R, 1, 1, Q, L]
    s = jnp.where(vis, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m) * vis
    denom = jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    w = e / denom
    if v_scale is not None:
        w = jnp.where(vis, w * v_scale[:, :, None, None, :], 0.0)
    # Slots past a row's kv_len (a page's tail, the null page of a short row) hold whatever was written there last,
    # possibly another job's non-finite values: zero them, or their weight 0 would still make 0 * NaN = NaN.
    v = jnp.where((k_pos[None, :] < kv_len[:, None])[:, None, :, None], v.astype(jnp.float32), 0.0)
    # Contract into [R, KH, G, Q, D] and transpose after: asked for `rqkgd` directly, XLA:CPU lays the product out
    # with G minor and runs it as a slow batched matmul (decode, 8 rows x 384 keys: 0.66 ms vs 0.09 ms).
    o = jnp.einsum("rkgql,rkld->rkgqd", w, v, preferred_element_type=jnp.float32)
    return o.transpose(0, 3, 1, 2, 4)


# Decode rows gather their pages into one [rows, KH, L, D] block before two small contractions. On the CPU that
# block must stay in cache: past a few MiB both steps run at memory speed and the whole call gets ~3x slower
# (16 rows x 2048 keys: 46 ms in one piece, 17 ms in groups of 2 rows; docs/performance.md). So on the CPU the
# decode rows go through `lax.map` in groups whose gathered K and V fit this budget.
CPU_DECODE_GATHER_BYTES = 6 << 20


def decode_chunk_rows(num_rows: int, bytes_per_row: int) -> int:
    """Decode rows per group in the XLA path: all of them off the CPU; on the CPU the largest power of two (a
    divisor of the power-of-two row bucket) whose gathered K/V fit `CPU_DECODE_GATHER_BYTES`, at least 1."""
    if jax.default_backend() != "cpu" or num_rows & (num_rows - 1):
        return num_rows
    c = num_rows
    while c > 1 and c * bytes_per_row > CPU_DECODE_GATHER_BYTES:
        c //= 2
    return c


@functools.partial(jax.jit, static_argnames=("layout", "sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_xla(
    q: jnp.ndarray,  # [T, nH, D], T = layout.num_tokens
    k_pages: jnp.ndarray,  # [KH, num_pages, page_size, D]
    v_pages: jnp.ndarray,  # [KH, num_pages, page_size, D]
    query_lens: jnp.ndarray,  # [S] int32
    kv_lens: jnp.ndarray,  # [S] int32
    page_table: jnp.ndarray,  # [S, P] int32
    *,
    layout: PrefillDecodeLayout,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jnp.ndarray | None = None,  # [KH, num_pages, page_size] float32, with int8 k_pages
    v_scales: jnp.ndarray | None = None,  # [KH, num_pages, page_size] float32, with int8 v_pages
    layer: jnp.ndarray | None = None,  # int32 scalar: the pools (and scales) are stacked [L, ...]; use this one
) -> jnp.ndarray:  # [T, nH, D]
    """Fast path for batches in `PrefillDecodeLayout`: prefill windows as one batched block, decode rows as
    another; each row gathers only its own pages once (not once per query token).

    With `layer`, the pages are gathered straight from the stacked cache: slicing the layer out first would copy
    that layer's whole pool on every call once the gathers sit inside the CPU's row-group loop."""
    if layer is None:
        _check_scales(k_pages, v_pages, k_scales, v_scales)
    else:
        _check_scales(k_pages[0], v_pages[0], None if k_scales is None else k_scales[0],
                      None if v_scales is None else v_scales[0])
    t_count, nh, d = q.shape
    kh, _, ps, _ = k_pages.shape[-4:]
    g = nh // kh
    sp, qm, sd = layout.num_prefill_rows, layout.max_q_len, layout.num_decode_rows
    p = page_table.shape[1]
    qf = q.astype(jnp.float32)

    def gather(rows: slice) -> tuple[jnp.ndarray, ...]:
        return gather_pages(page_table[rows])

    def gather_pages(pt: jnp.ndarray) -> tuple[jnp.ndarray, ...]:  # pt [R, P]
        r = pt.shape[0]
        def take(a):  # -> [R, KH, P, ...]; a[layer, :, pt] puts the (separated) advanced index dims first
            return jnp.moveaxis(a[:, pt], 0, 1) if layer is None else jnp.moveaxis(a[layer, :, pt], 2, 1)

        k = take(k_pages).reshape(r, kh, p * ps, d)  # [R, KH, L, D]
        v = take(v_pages).reshape(r, kh, p * ps, d)
        if k_scales is None:
            return k.astype(jnp.float32), v.astype(jnp.float32), None, None
        ks = take(k_scales).reshape(r, kh, p * ps)  # [R, KH, L]
        vs = take(v_scales).reshape(r, kh, p * ps)
        return k.astype(jnp.float32), v.astype(jnp.float32), ks, vs

    outs = []
    if sp:
        k, v, ksc, vsc = gather(slice(0, sp))
        qp = qf[: sp * qm].reshape(sp, qm, kh, g, d)
        q_pos = (kv_lens[:sp] - query_lens[:sp])[:, None] + jnp.arange(qm)[None, :]  # [Sp, Qm]
        o = _attend_rows(qp, k, v, q_pos, kv_lens[:sp], sm_scale, sliding_window, soft_cap, ksc, vsc)
        real = jnp.arange(qm)[None, :] < query_lens[:sp, None]  # [Sp, Qm]
        outs.append(jnp.where(real[:, :, None, None, None], o, 0.0).reshape(sp * qm, nh, d))
    if sd:
        def decode(qd, kv_l, pt):  # [C, KH, G, D], [C], [C, P] -> [C, nH, D]
            k, v, ksc, vsc = gather_pages(pt)
            o = _attend_rows(qd[:, None], k, v, (kv_l - 1)[:, None], kv_l, sm_scale, sliding_window, soft_cap,
                             ksc, vsc)
            return o.reshape(-1, nh, d)

        qd = qf[sp * qm :].reshape(sd, kh, g, d)
        chunk = decode_chunk_rows(sd, p * ps * kh * d * 4 * 2)
        if chunk < sd:  # rows in sequence, a cache-sized group at a time (see decode_chunk_rows)
            n = sd // chunk
            o = jax.lax.map(lambda a: decode(*a), (qd.reshape(n, chunk, kh, g, d), kv_lens[sp:].reshape(n, chunk),
                                                   page_table[sp:].reshape(n, chunk, p))).reshape(sd, nh, d)
        else:
            o = decode(qd, kv_lens[sp:], page_table[sp:])
        real = query_lens[sp:] > 0
        outs.append(jnp.where(real[:, None, None], o, 0.0))
    return jnp.concatenate(outs, axis=0).astype(q.dtype) if len(outs) > 1 else outs[0].astype(q.dtype)


def layout_query_start(layout: PrefillDecodeLayout) -> jnp.ndarray:
    """query_start `[S]` implied by a layout (for calling the reference on layout batches)."""
    pre = jnp.arange(layout.num_prefill_rows, dtype=jnp.int32) * layout.max_q_len
    dec = layout.num_prefill_rows * layout.max_q_len + jnp.arange(layout.num_decode_rows, dtype=jnp.int32)
    return jnp.concatenate([pre, dec])


# ---------------------------------------------------------------------------------------------------------------
# Pallas kernel
# ---------------------------------------------------------------------------------------------------------------
#
# Grid (token block b, KV head h, key split c). A program owns `block_q` consecutive slots of the flat token axis
# for one KV head, all `G` query heads of that KV head stacked into the rows of one matrix (`M = block_q * G`
# rows), so every key block loaded is used by the whole group. The block may hold tokens of several rows (decode
# rows sit next to each other); the wrapper lists, per block, the distinct rows present, and the kernel runs the
# online softmax over each listed row's visible pages in turn, masking the tokens of other rows. A token's
# softmax state is touched only by its own row's keys, so visiting rows one after another is exact.
#
# No scalar prefetch and no scratch buffers (GPU Pallas accepts neither): the page table and the row metadata
# are ordinary operands, read as scalars inside the kernel, and pages are gathered from this head's whole pool
# `[num_pages, page_size, D]` with an indexed load. The accumulators are loop carries.
#
# With `k_splits > 1`, split c attends only the c-th part of each row's visible key blocks and writes its
# un-normalised output with the running max and sum; the wrapper merges the splits. With `split_max_q > 0` too, a
# row of more than `split_max_q` query tokens is not split: split 0 attends all its key blocks and normalises its
# tokens' output in the kernel, exactly as with `k_splits == 1`, the other splits attend none, and the wrapper takes
# those tokens' output from split 0 as it is (their bits are those of `k_splits == 1`).


def _ragged_kernel(
    block_rows_ref,  # [block_q] int32: the distinct rows with tokens in this block, first `nrows` valid
    block_nrows_ref,  # [1] int32
    query_start_ref,  # [S] int32
    query_lens_ref,  # [S] int32
    kv_lens_ref,  # [S] int32
    page_table_ref,  # [S, P'] int32, P' a multiple of pages_per_block
    q_ref,  # [block_q, G', D]
    k_pages_ref,  # [num_pages, page_size, D]
    k_scales_ref,  # [num_pages, page_size] float32, or None
    v_pages_ref,  # [num_pages, page_size, D]
    v_scales_ref,  # [num_pages, page_size] float32, or None
    o_ref,  # [block_q, G', D]: the output (k_splits == 1) or this split's un-normalised float32 partial
    *stat_refs,  # k_splits > 1: m_ref, l_ref [block_q, G'] float32 (running max and sum of this split)
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_block: int,
    k_splits: int,
    split_max_q: int,
    compute_dtype: jnp.dtype,
):
    b = pl.program_id(0)
    split = pl.program_id(2)
    block_q, gp, d = q_ref.shape
    num_pages, page_size, _ = k_pages_ref.shape
    m_rows = block_q * gp
    block_k = pages_per_block * page_size
    blk_start = b * block_q

    q = q_ref[...].reshape(m_rows, d).astype(compute_dtype)  # [M, D]
    tok = blk_start + lax.broadcasted_iota(jnp.int32, (m_rows, 1), 0) // gp  # [M, 1] token of each q row
    key_iota = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, Bk]

    def row_body(n, carry):
        r = block_rows_ref[n]
        qs = query_start_ref[r]
        ql = query_lens_ref[r]
        kv = kv_lens_ref[r]
        # The row's tokens in this block and the keys any of them can see.
        t_lo = jnp.maximum(blk_start, qs)
        t_hi = jnp.minimum(blk_start + block_q, qs + ql)  # exclusive; > t_lo since the row is listed
        first_pos = kv - ql + (t_lo - qs)
        last_pos = kv - ql + (t_hi - 1 - qs)
        key_hi = jnp.minimum(kv, last_pos + 1)
        key_lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        blk_lo = key_lo // block_k
        blk_hi = jnp.maximum((key_hi + block_k - 1) // block_k, blk_lo)
        whole = None  # split_max_q: this row is attended whole by split 0 (a traced bool)
        if k_splits > 1:
            per = (blk_hi - blk_lo + k_splits - 1) // k_splits
            part_lo = jnp.minimum(blk_lo + split * per, blk_hi)
            part_hi = jnp.minimum(part_lo + per, blk_hi)
            if split_max_q:  # a long row: all its blocks in split 0, none in the others
                whole = ql > split_max_q
                blk_lo = jnp.where(whole, jnp.where(split == 0, blk_lo, blk_hi), part_lo)
                blk_hi = jnp.where(whole, blk_hi, part_hi)
            else:
                blk_lo, blk_hi = part_lo, part_hi
        in_row = (tok >= qs) & (tok < qs + ql)  # [M, 1]
        q_pos = kv - ql + (tok - qs)  # [M, 1]

        def page_body(j, carry):
            acc, m_i, l_i = carry  # [M, D] un-normalised output, [M] running max, [M] running sum
            pages = page_table_ref[r, pl.ds(j * pages_per_block, pages_per_block)]  # [ppb]
            pages = jnp.clip(pages, 0, num_pages - 1)
            k = k_pages_ref[pages].reshape(block_k, d).astype(compute_dtype)  # [Bk, D]
            v = v_pages_ref[pages].reshape(block_k, d).astype(compute_dtype)  # [Bk, D]
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [M, Bk]
            s = s * sm_scale
            if k_scales_ref is not None:
                s = s * k_scales_ref[pages].reshape(1, block_k)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            k_pos = j * block_k + key_iota  # [1, Bk]
            vis = in_row & (k_pos <= q_pos) & (k_pos < kv)  # [M, Bk]
            if sliding_window is not None:
                vis &= (q_pos - k_pos) < sliding_window
            s = jnp.where(vis, s, NEG_INF)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))  # [M]
            corr = jnp.exp(m_i - m_new)
            p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)  # [M, Bk]
            l_i = corr * l_i + jnp.sum(p, axis=1)
            if v_scales_ref is not None:
                p = jnp.where(vis, p * v_scales_ref[pages].reshape(1, block_k), 0.0)
            # a slot past kv_len may hold a non-finite value (a page's stale tail): 0 * NaN would be NaN
            v = jnp.where((k_pos < kv).reshape(block_k, 1), v, jnp.zeros((), v.dtype))
            pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [M, D]
            return corr[:, None] * acc + pv, m_new, l_i

        carry = lax.fori_loop(blk_lo, blk_hi, page_body, carry)
        if whole is not None:  # a whole row's tokens: normalised here as with k_splits == 1 (later rows leave them)
            acc, m_i, l_i = carry
            done = in_row & whole  # [M, 1]
            acc = jnp.where(done, _normalised(acc, l_i), acc)
            carry = acc, m_i, l_i
        return carry

    init = (
        jnp.zeros((m_rows, d), jnp.float32),
        jnp.full((m_rows,), NEG_INF, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
    )
    acc, m_i, l_i = lax.fori_loop(0, block_nrows_ref[0], row_body, init)
    if k_splits == 1:
        o_ref[...] = _normalised(acc, l_i).reshape(block_q, gp, d).astype(o_ref.dtype)
    else:
        m_ref, l_ref = stat_refs
        o_ref[...] = acc.reshape(block_q, gp, d)
        m_ref[...] = m_i.reshape(block_q, gp)
        l_ref[...] = l_i.reshape(block_q, gp)


def _normalised(acc: jnp.ndarray, l_i: jnp.ndarray) -> jnp.ndarray:
    """The output of an online softmax's state: `acc / l` ([M, D] / [M]), 0 where no key was visible. One expression
    for `k_splits == 1` and the whole rows of `split_max_q`, so both round the same (a GPU divides in the kernel
    with Triton's division, which need not round like XLA's in the wrapper)."""
    return jnp.where(l_i[:, None] > 0, acc / jnp.where(l_i > 0, l_i, 1.0)[:, None], 0.0)


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _token_rows(query_start: jnp.ndarray, query_lens: jnp.ndarray, num_tokens: int) -> jnp.ndarray:
    """[num_tokens] int32: the row owning each token slot, -1 for a slot of no row."""
    t = jnp.arange(num_tokens)
    member = (t[:, None] >= query_start[None, :]) & (t[:, None] < (query_start + query_lens)[None, :])  # [T', S]
    return jnp.where(member.any(axis=1), jnp.argmax(member, axis=1), -1).astype(jnp.int32)


def _block_rows(
    query_start: jnp.ndarray,  # [S] int32
    query_lens: jnp.ndarray,  # [S] int32
    num_blocks: int,
    block_q: int,
) -> tuple[jnp.ndarray, jnp.ndarray]:  # [NB, block_q] rows (-1 padded), [NB, 1] counts
    """For each block of `block_q` token slots, the distinct rows owning tokens in it, in token order."""
    r = _token_rows(query_start, query_lens, num_blocks * block_q).reshape(num_blocks, block_q)
    prev = jnp.concatenate([jnp.full((num_blocks, 1), -1, jnp.int32), r[:, :-1]], axis=1)
    first = (r >= 0) & (r != prev)  # a row's tokens are contiguous, so each row starts once per block
    i = jnp.arange(block_q)[None, :]
    order = jnp.argsort(jnp.where(first, i, block_q + i), axis=1)
    rows = jnp.where(jnp.take_along_axis(first, order, axis=1), jnp.take_along_axis(r, order, axis=1), -1)
    return rows.astype(jnp.int32), first.sum(axis=1, keepdims=True).astype(jnp.int32)


def _should_interpret(interpret: bool | None) -> bool:
    return not registry.on_gpu() if interpret is None else interpret


def gpu_unsupported_reason(head_dim: int, page_size: int, pages_per_block: int | None = None) -> str | None:
    """Why the kernel cannot run natively on a GPU for this shape (Triton's tensor-core dots need power-of-two
    sizes >= 16), or None when it can. `pages_per_block`: the tuning's (None: any the default tuning could pick,
    so only head_dim and page_size are checked)."""
    problems = []
    if head_dim & (head_dim - 1) or head_dim < 16:
        problems.append(f"head_dim={head_dim} (needs a power of two >= 16)")
    if page_size & (page_size - 1):
        problems.append(f"page_size={page_size} (needs a power of two)")
    if pages_per_block is not None and pages_per_block * page_size < 16:
        problems.append(f"pages_per_block * page_size = {pages_per_block} * {page_size} (needs >= 16)")
    return "; ".join(problems) or None


def auto_impl(head_dim: int, page_size: int) -> str:
    """What "auto" runs for this shape: the kernel on a GPU where it supports the shape; on the CPU the native
    kernel where it is built and runs (`pallas_kernels.native_attention`); otherwise "xla"."""
    if registry.on_gpu():
        return "pallas" if gpu_unsupported_reason(head_dim, page_size) is None else "xla"
    return "native" if native_attention.unavailable_reason(head_dim) is None else "xla"


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "config", "interpret")
)
def ragged_paged_attention_pallas(
    q: jnp.ndarray,  # [T, nH, D]
    k_pages: jnp.ndarray,  # [KH, num_pages, page_size, D]
    v_pages: jnp.ndarray,  # [KH, num_pages, page_size, D]
    query_start: jnp.ndarray,  # [S] int32
    query_lens: jnp.ndarray,  # [S] int32
    kv_lens: jnp.ndarray,  # [S] int32
    page_table: jnp.ndarray,  # [S, P] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jnp.ndarray | None = None,  # [KH, num_pages, page_size] float32, with int8 k_pages
    v_scales: jnp.ndarray | None = None,  # [KH, num_pages, page_size] float32, with int8 v_pages
    config: AttentionTuning | None = None,
    interpret: bool | None = None,
) -> jnp.ndarray:  # [T, nH, D]
    """The Pallas kernel over a fully ragged batch (semantics in the module docstring). `interpret=None`
    interprets wherever the backend is not a GPU (the kernel lowers through Triton)."""
    t_count, nh, d = q.shape
    kh, num_pages, ps, d_k = k_pages.shape
    s_count, p = page_table.shape
    if k_pages.shape != v_pages.shape or d_k != d:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be [KH, num_pages, "
                         f"page_size, D={d}]")
    if nh % kh:
        raise ValueError(f"query heads ({nh}) must be a multiple of KV heads ({kh})")
    if not query_start.shape == query_lens.shape == kv_lens.shape == (s_count,):
        raise ValueError(f"query_start {query_start.shape}, query_lens {query_lens.shape}, kv_lens "
                         f"{kv_lens.shape} must all be [S={s_count}] like page_table {page_table.shape}")
    _check_scales(k_pages, v_pages, k_scales, v_scales)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if config is None:
        config = default_tuning(max_query_len=1 if t_count <= s_count else t_count, num_kv_heads=kh, page_size=ps,
                                pages_per_row=p)
    interpret = _should_interpret(interpret)
    g = nh // kh
    bq, ppb, ks = config.block_q, config.pages_per_block, config.k_splits
    # Triton wants power-of-two block sizes and dot dims >= 16: pad the group so that M = block_q * G' >= 16
    # (done in interpret mode too, so the CPU tests run the shapes the GPU runs).
    gp = max(_next_power_of_two(g), _next_power_of_two(-(-16 // bq)))
    if not interpret:
        reason = gpu_unsupported_reason(d, ps, ppb)
        if reason:
            raise ValueError(f"the GPU kernel cannot run this shape: {reason}; use impl='xla' (or 'auto', which "
                             "falls back to it) for such models")

    nb = -(-t_count // bq)
    t_pad = nb * bq
    qg = q.reshape(t_count, kh, g, d)
    qg = jnp.pad(qg, ((0, t_pad - t_count), (0, 0), (0, gp - g), (0, 0)))  # [T', KH, G', D]
    p_pad = -(-p // ppb) * ppb
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, p_pad - p)))  # padded with the null page
    block_rows, block_nrows = _block_rows(query_start.astype(jnp.int32), query_lens.astype(jnp.int32), nb, bq)

    if jnp.issubdtype(k_pages.dtype, jnp.floating):
        compute_dtype = jnp.promote_types(q.dtype, k_pages.dtype)
    else:
        compute_dtype = q.dtype if jnp.issubdtype(q.dtype, jnp.floating) else jnp.float32

    kernel = functools.partial(
        _ragged_kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        pages_per_block=ppb, k_splits=ks, split_max_q=config.split_max_q if ks > 1 else 0,
        compute_dtype=compute_dtype,
    )
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, c: (0,) * len(shape))
    pool_spec = pl.BlockSpec((None, num_pages, ps, d), lambda b, h, c: (h, 0, 0, 0))
    scale_spec = None if k_scales is None else pl.BlockSpec((None, num_pages, ps), lambda b, h, c: (h, 0, 0))
    in_specs = [
        pl.BlockSpec((None, bq), lambda b, h, c: (b, 0)),  # block_rows
        pl.BlockSpec((None, 1), lambda b, h, c: (b, 0)),  # block_nrows
        full((s_count,)),  # query_start
        full((s_count,)),  # query_lens
        full((s_count,)),  # kv_lens
        full((s_count, p_pad)),  # page_table
        pl.BlockSpec((bq, None, gp, d), lambda b, h, c: (b, h, 0, 0)),  # q
        pool_spec,  # k_pages
        scale_spec,  # k_scales
        pool_spec,  # v_pages
        scale_spec,  # v_scales
    ]
    if ks == 1:
        out_shape = jax.ShapeDtypeStruct((t_pad, kh, gp, d), q.dtype)
        out_specs = pl.BlockSpec((bq, None, gp, d), lambda b, h, c: (b, h, 0, 0))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((ks, t_pad, kh, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((ks, t_pad, kh, gp), jnp.float32),
            jax.ShapeDtypeStruct((ks, t_pad, kh, gp), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((None, bq, None, gp, d), lambda b, h, c: (c, b, h, 0, 0)),
            pl.BlockSpec((None, bq, None, gp), lambda b, h, c: (c, b, h, 0)),
            pl.BlockSpec((None, bq, None, gp), lambda b, h, c: (c, b, h, 0)),
        )
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    out = pl.pallas_call(
        kernel,
        grid=(nb, kh, ks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params,
        name=f"ragged_paged_attention_bq{bq}_ppb{ppb}_ks{ks}" + (f"_sq{config.split_max_q}"
                                                                    if ks > 1 and config.split_max_q else ""),
    )(
        block_rows, block_nrows, query_start.astype(jnp.int32), query_lens.astype(jnp.int32),
        kv_lens.astype(jnp.int32), table, qg, k_pages, k_scales, v_pages, v_scales,
    )
    if ks > 1:
        acc, m_i, l_i = out  # [K, T', KH, G', D], [K, T', KH, G'] x2
        m_all = jnp.max(m_i, axis=0)
        w = jnp.exp(m_i - m_all[None])  # [K, T', KH, G']
        l_all = jnp.sum(w * l_i, axis=0)
        o = jnp.sum(w[..., None] * acc, axis=0)
        out = jnp.where(l_all[..., None] > 0, o / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)
        if config.split_max_q:  # the tokens of rows attended whole: split 0 wrote their output, normalised
            tok_row = _token_rows(query_start.astype(jnp.int32), query_lens.astype(jnp.int32), t_pad)
            whole = (tok_row >= 0) & (query_lens.astype(jnp.int32)[jnp.maximum(tok_row, 0)] > config.split_max_q)
            out = jnp.where(whole[:, None, None, None], acc[0], out)
    return out[:t_count, :, :g].reshape(t_count, nh, d).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------------------
# The implementations, registered by name (`pallas_kernels.registry.ATTENTION`), and the dispatcher
# ---------------------------------------------------------------------------------------------------------------
#
# Every implementation is called by `paged_attention` the same way (the contract in the module docstring):
#     fn(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *, sm_scale, sliding_window, soft_cap,
#        k_scales, v_scales, layout, tuning[, layer])
# The built-ins are thin adapters over the functions above.


def _reference_impl(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *, sm_scale,
                    sliding_window=None, soft_cap=None, k_scales=None, v_scales=None, layout=None, tuning=None):
    del layout, tuning  # the spec needs neither
    return ragged_paged_attention_reference(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table,
                                            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                            k_scales=k_scales, v_scales=v_scales)


def _xla_impl(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *, sm_scale, sliding_window=None,
              soft_cap=None, k_scales=None, v_scales=None, layout=None, tuning=None, layer=None):
    """The layout fast path; for a batch that is not exactly its layout (none given, or decode rows in a window's
    padding), the reference."""
    del tuning
    if layout is None or page_table.shape[0] != layout.num_rows:
        if layer is not None:
            k_pages, v_pages = k_pages[layer], v_pages[layer]
            k_scales = None if k_scales is None else k_scales[layer]
            v_scales = None if v_scales is None else v_scales[layer]
        return _reference_impl(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap, k_scales=k_scales,
                               v_scales=v_scales)
    return ragged_paged_attention_xla(q, k_pages, v_pages, query_lens, kv_lens, page_table, layout=layout,
                                      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                      k_scales=k_scales, v_scales=v_scales, layer=layer)


def _pallas_impl(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *, sm_scale, sliding_window=None,
                 soft_cap=None, k_scales=None, v_scales=None, layout=None, tuning=None, interpret=None):
    """The Pallas kernel; without a `tuning`, the default for the shape (knowing the longest query from `layout`)."""
    if tuning is None and layout is not None:
        tuning = default_tuning(max_query_len=layout.max_q_len, num_kv_heads=k_pages.shape[0],
                                page_size=k_pages.shape[2], pages_per_row=page_table.shape[1])
    return ragged_paged_attention_pallas(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table,
                                         sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                         k_scales=k_scales, v_scales=v_scales, config=tuning, interpret=interpret)


_pallas_impl.tuning_type = AttentionTuning


def _native_impl(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *, sm_scale, sliding_window=None,
                 soft_cap=None, k_scales=None, v_scales=None, layout=None, tuning=None, layer=None):
    """The native CPU kernel (`pallas_kernels.native_attention`), reading the stacked cache in place. Where
    `native_attention.MAX_QUERY_LEN` is set and the step's prefill windows are longer, this dispatcher sends the
    windows through XLA's contraction and has the kernel write the decode rows over their output."""
    common = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scales=k_scales,
                  v_scales=v_scales, layer=layer)
    cap = native_attention.MAX_QUERY_LEN
    if cap is None or layout is None or not layout.num_prefill_rows or layout.max_q_len <= cap:
        return native_attention.native_paged_attention(q, k_pages, v_pages, query_start, query_lens, kv_lens,
                                                       page_table, layout=layout, tuning=tuning, **common)
    # the prefill windows [0, sp * qm) through XLA (the engine's prefill buckets have rows past the layout's, decode
    # rows sitting in the windows' padding: the windows are still the first num_prefill_rows rows, at row * max_q_len)
    sp, qm = layout.num_prefill_rows, layout.max_q_len
    o = ragged_paged_attention_xla(q[: sp * qm], k_pages, v_pages, query_lens[:sp], kv_lens[:sp], page_table[:sp],
                                   layout=PrefillDecodeLayout(sp, qm, 0),
                                   **{**common, "layer": None if layer is None else jnp.asarray(layer, jnp.int32)})
    # The windows' output is zero past each chunk, where decode rows may sit, and the other decode rows' slots follow
    # the windows: the kernel writes the decode rows' tokens over it (the windows' rows handed over without queries).
    base = jnp.concatenate([o.astype(jnp.float32), jnp.zeros((q.shape[0] - sp * qm, *q.shape[1:]), jnp.float32)])
    if page_table.shape[0] == sp:  # no decode rows
        return base.astype(q.dtype)
    return native_attention.native_paged_attention(q, k_pages, v_pages, query_start, query_lens.at[:sp].set(0),
                                                   kv_lens, page_table, base=base, **common)

# The built-in names (every registered name, plugins included, is `ATTENTION.names()`).
IMPLS = ("auto", "reference", "xla", "pallas", "native")


def paged_attention(
    q: jnp.ndarray,  # [T, nH, D]
    k_pages: jnp.ndarray,  # [KH, num_pages, page_size, D]
    v_pages: jnp.ndarray,  # [KH, num_pages, page_size, D]
    query_start: jnp.ndarray,  # [S] int32
    query_lens: jnp.ndarray,  # [S] int32
    kv_lens: jnp.ndarray,  # [S] int32
    page_table: jnp.ndarray,  # [S, P] int32
    *,
    sm_scale: float,
    impl: str | KernelImpl = "auto",
    layout: PrefillDecodeLayout | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jnp.ndarray | None = None,  # [KH, num_pages, page_size] float32, with int8 pages
    v_scales: jnp.ndarray | None = None,
    config: Any = None,
    interpret: bool | None = None,
    layer: jnp.ndarray | None = None,
) -> jnp.ndarray:  # [T, nH, D]
    """Ragged paged attention through the implementation `impl` names (`ATTENTION.get`): a registered name
    ("reference" the spec, "xla" the layout fast path, "pallas" the kernel, or one registered by a user), a
    `module:function` import path, or "auto" (the kernel on a GPU where it supports the shape, see
    `gpu_unsupported_reason`; otherwise "xla"). `layout`, when given, must
    describe the batch (the XLA path ignores `query_start`). `config` is the implementation's tuning (passed as
    `tuning=`; `AttentionTuning` for the kernel; None: its default). `interpret` only affects the built-in kernel.
    With `layer` (an int32 scalar) the pools and scales are the stacked cache `[L, KH, num_pages, page_size, (D)]`:
    implementations registered with `stacked_cache=True` read that layer themselves, the others get its slice."""
    impl, tuned = split_tuning(impl)  # a `Tuned` (impl, tuning) from the engine config
    config = tuned if config is None else config
    if impl == "auto":
        impl = auto_impl(q.shape[-1], k_pages.shape[-2])
    try:
        entry = ATTENTION.get(impl)
    except KernelError as e:
        raise ValueError(f"impl: {e}") from None
    if layer is not None and not entry.stacked_cache:
        pick = lambda a: None if a is None else a[layer]  # noqa: E731
        k_pages, v_pages, k_scales, v_scales = pick(k_pages), pick(v_pages), pick(k_scales), pick(v_scales)
        layer = None
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scales=k_scales,
                  v_scales=v_scales, layout=layout, tuning=config)
    if layer is not None:
        kwargs["layer"] = layer
    if entry.fn is _pallas_impl:
        kwargs["interpret"] = interpret
    if entry.builtin:
        return entry.fn(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, **kwargs)
    return registry.checked_call(entry, (q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table), kwargs,
                                 q.shape, q.dtype, f"q {q.shape} {q.dtype}, cache {k_pages.shape} {k_pages.dtype}")


def contract_case(stacked: bool = False, int8: bool = False, window: int | None = None,
                  cache: str | None = None) -> dict[str, Any]:
    """A small batch in the contract's terms (one prefill row of 3 tokens, one decode row; 2 query heads per KV head,
    head_dim 16, page_size 8; `stacked`: a 2-layer stacked cache with `layer=1`), as the keyword arguments of
    `paged_attention` (without `impl`). `cache`: the cache dtype ("float32", "bfloat16", "float16", "int8"; `int8`
    is the same as "int8"), with a float32 query as the engine passes one. Used by the registration check;
    `pallas_kernels.testing` has the full case space."""
    cache = cache or ("int8" if int8 else "float32")
    int8 = cache == "int8"
    import numpy as np

    rng = np.random.default_rng(0)
    kh, g, d, ps, n_pages = 1, 2, 16, 8, 4
    layout = PrefillDecodeLayout(1, 4, 1)
    lead = (2,) if stacked else ()
    pool = lambda: rng.normal(size=(*lead, kh, n_pages, ps, d)).astype(np.float32)  # noqa: E731
    k, v = pool(), pool()
    ks = vs = None
    if int8:
        ks = np.abs(rng.normal(size=(*lead, kh, n_pages, ps))).astype(np.float32) * 0.02
        vs = np.abs(rng.normal(size=(*lead, kh, n_pages, ps))).astype(np.float32) * 0.02
        k, v = np.clip(np.round(k * 40), -127, 127).astype(np.int8), np.clip(np.round(v * 40), -127, 127).astype(
            np.int8)
    if cache in ("bfloat16", "float16"):
        k, v = jnp.asarray(k, cache), jnp.asarray(v, cache)
    case = dict(
        q=jnp.asarray(rng.normal(size=(layout.num_tokens, kh * g, d)).astype(np.float32)),
        k_pages=jnp.asarray(k), v_pages=jnp.asarray(v),
        query_start=layout_query_start(layout), query_lens=jnp.asarray([3, 1], jnp.int32),
        kv_lens=jnp.asarray([11, 5], jnp.int32), page_table=jnp.asarray([[1, 2], [3, 0]], jnp.int32),
        sm_scale=d**-0.5, layout=layout, sliding_window=window,
        k_scales=None if ks is None else jnp.asarray(ks), v_scales=None if vs is None else jnp.asarray(vs),
    )
    if stacked:
        case["layer"] = jnp.int32(1)
    return case


def check_contract(impl: KernelImpl) -> None:
    """`KernelContractError` unless `impl` traces on `contract_case()` (every cache dtype `EngineConfig` takes: a
    kernel that refused float16 had passed here and failed every step; the stacked cache when it takes one) to an
    output of the query's shape and dtype. Traces only (`jax.eval_shape`)."""
    for cache in ("float32", "bfloat16", "float16", "int8"):
        case = contract_case(stacked=impl.stacked_cache, cache=cache)
        q = case["q"]
        try:
            static = dict(layout=case["layout"], sm_scale=case["sm_scale"])
            out = jax.eval_shape(lambda c, static=static: paged_attention(impl=impl, **c, **static),
                                 {k: v for k, v in case.items() if k not in static})
        except KernelContractError as e:  # (the dispatcher's: what it raised, or a wrong output, named already)
            raise KernelContractError(f"{e}: on the contract's small case at registration ({cache} cache). See "
                                      "docs/kernels.md for the arguments, shapes and dtypes") from e
        except Exception as e:  # noqa: BLE001 (whatever the user's function raised while tracing)
            raise KernelContractError(
                f"paged_attention: {impl.name!r} failed on the contract's small case ({cache}"
                f" cache{', stacked with layer=' if impl.stacked_cache else ''}): {type(e).__name__}: {e}. "
                "See docs/kernels.md for the arguments, shapes and dtypes") from e
        if not hasattr(out, "shape") or tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
            got = f"{getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}"
            raise KernelContractError(
                f"paged_attention: {impl.name!r} must return the query's shape and dtype {tuple(q.shape)} "
                f"{q.dtype}; it returned {got}. See docs/kernels.md")


ATTENTION.set_contract(check_contract)
for _name, _fn, _stacked in (("reference", _reference_impl, False), ("xla", _xla_impl, True),
                             ("pallas", _pallas_impl, False), ("native", _native_impl, True)):
    ATTENTION.register(_name, _fn, stacked_cache=_stacked, check=False, builtin=True)


__all__ = [
    "ATTENTION",
    "IMPLS",
    "AttentionTuning",
    "check_contract",
    "contract_case",
    "PrefillDecodeLayout",
    "auto_impl",
    "gpu_unsupported_reason",
    "layout_query_start",
    "paged_attention",
    "quantize_kv",
    "ragged_paged_attention_pallas",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
]
