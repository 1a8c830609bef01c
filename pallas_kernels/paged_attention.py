"""Ragged paged attention: the pure-jnp reference (the spec) and the XLA fast path used on the CPU.

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
- tokens that belong to no row produce zeros.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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
) -> jnp.ndarray:  # [T, nH, D]
    """The spec: every token gathers its own row's whole context. Simple, memory-hungry; for tests."""
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
    qf = q.reshape(t_count, kh, g, d).astype(jnp.float32)
    s = jnp.einsum("tkgd,ktld->tkgl", qf, k) * sm_scale
    s = _soft_cap(s, soft_cap)
    k_pos = jnp.arange(p * ps)
    vis = _visible(q_pos[:, None], k_pos[None, :], kv_lens[row][:, None], sliding_window)  # [T, L]
    vis &= valid[:, None]
    s = jnp.where(vis[:, None, None, :], s, NEG_INF)
    w = jax.nn.softmax(s, axis=-1) * vis[:, None, None, :]
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
) -> jnp.ndarray:  # [R, Q, KH, G, D]
    s = jnp.einsum("rqkgd,rkld->rkgql", q, k, preferred_element_type=jnp.float32) * sm_scale
    s = _soft_cap(s, soft_cap)
    k_pos = jnp.arange(k.shape[2])
    vis = _visible(q_pos[:, :, None], k_pos[None, None, :], kv_len[:, None, None], sliding_window)  # [R, Q, L]
    vis = vis[:, None, None]  # [R, 1, 1, Q, L]
    s = jnp.where(vis, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m) * vis
    denom = jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("rkgql,rkld->rqkgd", e / denom, v.astype(jnp.float32), preferred_element_type=jnp.float32)
    return o


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
) -> jnp.ndarray:  # [T, nH, D]
    """Fast path for batches in `PrefillDecodeLayout`: prefill windows as one batched block, decode rows as
    another; each row gathers only its own pages once (not once per query token)."""
    t_count, nh, d = q.shape
    kh, _, ps, _ = k_pages.shape
    g = nh // kh
    sp, qm, sd = layout.num_prefill_rows, layout.max_q_len, layout.num_decode_rows
    p = page_table.shape[1]
    qf = q.astype(jnp.float32)

    def gather(rows: slice) -> tuple[jnp.ndarray, jnp.ndarray]:
        pt = page_table[rows]  # [R, P]
        r = pt.shape[0]
        k = jnp.moveaxis(k_pages[:, pt], 0, 1).reshape(r, kh, p * ps, d)  # [R, KH, L, D]
        v = jnp.moveaxis(v_pages[:, pt], 0, 1).reshape(r, kh, p * ps, d)
        return k.astype(jnp.float32), v.astype(jnp.float32)

    outs = []
    if sp:
        k, v = gather(slice(0, sp))
        qp = qf[: sp * qm].reshape(sp, qm, kh, g, d)
        q_pos = (kv_lens[:sp] - query_lens[:sp])[:, None] + jnp.arange(qm)[None, :]  # [Sp, Qm]
        o = _attend_rows(qp, k, v, q_pos, kv_lens[:sp], sm_scale, sliding_window, soft_cap)
        real = jnp.arange(qm)[None, :] < query_lens[:sp, None]  # [Sp, Qm]
        outs.append((o * real[:, :, None, None, None]).reshape(sp * qm, nh, d))
    if sd:
        k, v = gather(slice(sp, sp + sd))
        qd = qf[sp * qm :].reshape(sd, 1, kh, g, d)
        q_pos = (kv_lens[sp:] - 1)[:, None]  # [Sd, 1]
        o = _attend_rows(qd, k, v, q_pos, kv_lens[sp:], sm_scale, sliding_window, soft_cap)
        real = query_lens[sp:] > 0
        outs.append((o * real[:, None, None, None, None]).reshape(sd, nh, d))
    return jnp.concatenate(outs, axis=0).astype(q.dtype) if len(outs) > 1 else outs[0].astype(q.dtype)


def layout_query_start(layout: PrefillDecodeLayout) -> jnp.ndarray:
    """query_start `[S]` implied by a layout (for calling the reference on layout batches)."""
    pre = jnp.arange(layout.num_prefill_rows, dtype=jnp.int32) * layout.max_q_len
    dec = layout.num_prefill_rows * layout.max_q_len + jnp.arange(layout.num_decode_rows, dtype=jnp.int32)
    return jnp.concatenate([pre, dec])
