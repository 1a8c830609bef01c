"""The native CPU paged attention: `cpu/paged_attention.cc` through `jax.ffi`, registered as attention "native".

XLA:CPU's path (`ragged_paged_attention_xla`) gathers each row's pages into a contiguous block per layer before two
small contractions; at decode and verification sizes the gather (a transposing copy of K and V, per layer and
step) and the fusions' fixed costs are most of attention's time, and attention is most of a batched decode step
(docs/notes/performance-journal.md, "Against the peers, with the native paged attention"). The kernel
reads the pages in place from the engine's stacked cache instead, one task per (row, KV head, block of 16 query
tokens), with an online softmax over the pages
(float32, bfloat16, float16 or int8-with-scales caches; sliding window and soft cap as the contract says).

Every row runs here, prefill windows of any length too: on the AMD EPYC host the kernel prefills a 256-token prompt
in 78 ms against 97-123 ms with XLA's contraction for the windows (1024 tokens: 404-408 against 510-586 ms), and a
query gets the same bits in any block, so a prompt's keys and a job's output do not depend on how its prompt was
chunked (`models.invariant`). `MAX_QUERY_LEN` (None) set to n sends windows of more than n tokens to XLA's
contraction instead (the split of 2026-11-27, 32, kept for comparison). `"auto"` picks this on
the CPU where the kernel is built and runs (`pallas_kernels.native.unavailable_reason()`, `native.attention_reason()`)
and the head dimension is a multiple of 8; `attn_impl="xla"` turns it off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native

# None: every row here. An int: prefill windows of more query tokens than this (per row) run through XLA's
# contraction (`ragged_paged_attention_xla`): the dispatcher (`paged_attention._native_impl`) reads it at trace time
MAX_QUERY_LEN: int | None = None


def library_reason() -> str | None:
    """Why the library's attention cannot be called here at all, whatever the smoke test says (what tests skip on:
    `native.library_reason`)."""
    return native.library_reason() or native.attention_reason()


def unavailable_reason(head_dim: int | None = None) -> str | None:
    """Why the native attention cannot run here (or for this head dimension), None when it can."""
    why = native.unavailable_reason() or native.attention_reason()
    if why is not None:
        return why
    if head_dim is not None and head_dim % 8:
        return f"head_dim {head_dim} is not a multiple of 8"
    return None


def _call(q, k_pages, v_pages, k_scales, v_scales, layer, query_start, query_lens, kv_lens, page_table, *, sm_scale,
          sliding_window, soft_cap, base=None):
    """The kernel; `base` (float32, q's shape): the output starts as it (aliased) instead of zeros, and the rows'
    tokens are written over it."""
    scaled = k_scales is not None
    dummy = jnp.zeros((1,), jnp.float32)
    call = jax.ffi.ffi_call(native.ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential", input_output_aliases={10: 0} if base is not None else None)
    out = call(q.astype(jnp.float32), k_pages, v_pages, k_scales if scaled else dummy,
               v_scales if scaled else dummy, jnp.asarray(layer, jnp.int32).reshape(()),
               query_start.astype(jnp.int32), query_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
               page_table.astype(jnp.int32), dummy if base is None else base, sm_scale=np.float32(sm_scale),
               window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
               threads=np.int64(native.threads()), scaled=np.int32(scaled), has_base=np.int32(base is not None))
    return out.astype(q.dtype)


def native_paged_attention(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *, sm_scale,
                           sliding_window=None, soft_cap=None, k_scales=None, v_scales=None, layout=None, tuning=None,
                           layer=None, base=None):
    """`paged_attention`'s contract (stacked cache with `layer`, or one layer's pools without it), every row here.
    `base` (float32, q's shape): the output starts as it and the rows' tokens are written over it (the dispatcher,
    `pallas_kernels.paged_attention`, runs windows longer than `MAX_QUERY_LEN` through XLA and hands their output
    here with those rows' queries taken away)."""
    del tuning, layout

    why = unavailable_reason(q.shape[-1])
    if why is not None:
        raise RuntimeError(f"attn_impl 'native' cannot run here: {why}; use 'xla' (or 'auto', which falls back)")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("pass both k_scales and v_scales, or neither")
    if layer is None:  # one layer's pools: a stack of one
        k_pages, v_pages = k_pages[None], v_pages[None]
        k_scales = None if k_scales is None else k_scales[None]
        v_scales = None if v_scales is None else v_scales[None]
        layer = 0
    return _call(q, k_pages, v_pages, k_scales, v_scales, layer, query_start, query_lens, kv_lens, page_table,
                 sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, base=base)
