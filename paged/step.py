"""The device step: one jitted pure function `step(params, state, batch) -> (state, results)`.

embed -> layers (write this step's K/V into their pages, attend through the page table) -> logits for each row's
last real token -> on-device sampling. `state` is donated, so the cache is updated in place. Shapes come from the
static `BatchShape`; each distinct shape compiles once (`paged.buckets` enumerates them for warm-up).

`decode_steps` runs several decode steps in one call (`lax.scan`), feeding each sampled token back in: fewer
dispatches per token, at the price of the host seeing stop conditions only every n tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.llama import compute_logits, embed_tokens, run_layers
from models.weights import Weights
from paged.sampling import sample
from paged.state import NULL_PAGE, Batch, BatchShape, EngineState, Results, token_offsets, token_rows
from pallas_kernels.paged_attention import IMPLS, layout_query_start, paged_attention, quantize_kv

ATTN_IMPLS = IMPLS  # "auto" (Pallas on GPU, XLA on CPU), "xla", "pallas", "reference"


def _forward(
    params: Weights, state: EngineState, batch: Batch, cfg: ModelConfig, shape: BatchShape, attn_impl: str,
    matmul_impl: str = "auto",
) -> tuple[EngineState, jnp.ndarray]:
    """Run the model over the batch's tokens, writing K/V; returns the new state and hidden `[T, H]`."""
    layout = shape.layout
    ps = state.page_size
    rows = jnp.asarray(token_rows(layout))  # [T]
    offs = jnp.asarray(token_offsets(layout))  # [T]
    real = offs < batch.query_lens[rows]  # [T]
    pos = batch.positions
    write_page = jnp.where(real, batch.page_table[rows, pos // ps], NULL_PAGE)  # [T]
    write_off = jnp.where(real, pos % ps, 0)
    sm_scale = cfg.head_dim**-0.5
    qstart = layout_query_start(layout)

    def attend(layer, q, k, v, kv):
        kc, vc, ks, vs = kv
        # k, v: [T, KH, D]; the index (layer, :, [T], [T]) addresses [T, KH, (D)] slots
        if ks is not None:  # int8 cache: per-token-per-head scales written beside the values
            k, k_sc = quantize_kv(k)
            v, v_sc = quantize_kv(v)
            ks = ks.at[layer, :, write_page, write_off].set(k_sc)
            vs = vs.at[layer, :, write_page, write_off].set(v_sc)
        kc = kc.at[layer, :, write_page, write_off].set(k.astype(kc.dtype))
        vc = vc.at[layer, :, write_page, write_off].set(v.astype(vc.dtype))
        o = paged_attention(  # the whole stacked cache and the layer: no copy of the layer's pool
            q, kc, vc, qstart, batch.query_lens, batch.kv_lens, batch.page_table, sm_scale=sm_scale, impl=attn_impl,
            layout=layout, sliding_window=cfg.sliding_window, k_scales=ks, v_scales=vs, layer=layer,
        )
        return o, (kc, vc, ks, vs)

    h = embed_tokens(params, batch.token_ids)
    h, (k, v, ks, vs) = run_layers(params, cfg, h, pos, attend, (state.k, state.v, state.k_scale, state.v_scale),
                                   matmul_impl)
    return EngineState(k=k, v=v, k_scale=ks, v_scale=vs), h


def _sample_rows(
    params: Weights, cfg: ModelConfig, shape: BatchShape, batch: Batch, h: jnp.ndarray, return_top_k: int,
    return_logits: bool, matmul_impl: str = "auto",
) -> Results:
    layout = shape.layout
    last = layout_query_start(layout) + jnp.maximum(batch.query_lens - 1, 0)  # [S]
    logits = compute_logits(params, cfg, h[last], matmul_impl)  # [S, V]
    out = sample(
        logits, batch.sampling, positions=batch.kv_lens, history=batch.history,
        bias_ids=batch.bias_ids, bias_values=batch.bias_values, return_top_k=return_top_k,
    )
    return Results(
        token=out.token, logprob=out.logprob, top_ids=out.top_ids, top_logprobs=out.top_logprobs,
        logits=logits if return_logits else None,
    )


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "shape", "return_top_k", "return_logits", "attn_impl", "matmul_impl"),
    donate_argnames=("state",),
)
def step(
    params: Weights,
    state: EngineState,
    batch: Batch,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    return_top_k: int = 0,
    return_logits: bool = False,
    attn_impl: str = "auto",
    matmul_impl: str = "auto",
) -> tuple[EngineState, Results]:
    """One engine step over a ragged batch of prefill chunks and decode rows."""
    state, h = _forward(params, state, batch, cfg, shape, attn_impl, matmul_impl)
    return state, _sample_rows(params, cfg, shape, batch, h, return_top_k, return_logits, matmul_impl)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "shape", "num_steps", "return_top_k", "return_logits", "attn_impl", "matmul_impl"),
    donate_argnames=("state",),
)
def decode_steps(
    params: Weights,
    state: EngineState,
    batch: Batch,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    num_steps: int,
    return_top_k: int = 0,
    return_logits: bool = False,
    attn_impl: str = "auto",
    matmul_impl: str = "auto",
) -> tuple[EngineState, Results]:
    """`num_steps` decode steps in one call; `batch` must be decode-only (no prefill rows) and its page tables must
    already cover positions up to `kv_lens + num_steps - 1`. Results are stacked `[num_steps, S, ...]`."""
    if shape.layout.num_prefill_rows:
        raise ValueError("decode_steps needs a decode-only batch shape (num_prefill_rows == 0)")
    active = batch.query_lens > 0  # [S]

    def body(carry, _):
        state, b = carry
        state, h = _forward(params, state, b, cfg, shape, attn_impl, matmul_impl)
        res = _sample_rows(params, cfg, shape, b, h, return_top_k, return_logits, matmul_impl)
        tok = jnp.where(active, res.token, 0)
        history = b.history
        if history.shape[1]:
            history = jnp.concatenate([history[:, 1:], jnp.where(active, tok, -1)[:, None]], axis=1)
        nb = b.replace(
            token_ids=tok, positions=b.positions + active, kv_lens=b.kv_lens + active, history=history,
        )
        return (state, nb), res

    (state, _), res = jax.lax.scan(body, (state, batch), None, length=num_steps)
    return state, res


def count_compiles() -> dict[str, int]:
    """Number of compiled variants held by each jitted entry point (for the bucket report)."""
    return {"step": step._cache_size(), "decode_steps": decode_steps._cache_size()}


__all__ = ["ATTN_IMPLS", "count_compiles", "decode_steps", "step"]
