"""Llama-family forward as pure functions over a `Weights` pytree.

The transformer body works on a flat list of tokens `[N, H]` and delegates attention to an `attend` callback, so
the same layer code serves the dense forward here (`forward`, used for parity tests and as the oracle) and the paged
engine step (`paged.device.step`), which writes K/V into cache pages and attends through a page table.

    attend(layer: int32 scalar, q [N, nH, D], k [N, nKV, D], v [N, nKV, D], state) -> (out [N, nH, D], state)

Layers run under `lax.scan` over the stacked weights, so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.fused import TP_SPLIT, gate_up_parts, grouped_order, qkv_parts, split_columns
from models.invariant import opaque_zero, rounded, row_sum
from models.linear import matmul
from models.lora import LoraStack, lora_delta
from models.quant import gather_out
from models.rope import apply_rope, rope_cos_sin
from models.weights import LayerWeights, Weights
from pallas_kernels.quant_format import LayerSlice, QuantizedArray

AttendFn = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray, Any], tuple[jnp.ndarray, Any]]


def rms_norm(x: jnp.ndarray, w: jnp.ndarray, eps: float) -> jnp.ndarray:
    """x * rsqrt(mean(x^2) + eps) * w over the last axis, in float32, with the same bits for a row whatever the
    batch: the squares rounded and summed in one fixed order (`models.invariant`; XLA:CPU's row reduction sums one row
    in another order than sixteen)."""
    xf = x.astype(jnp.float32)
    mean = row_sum(rounded(xf * xf, opaque_zero(xf))) / xf.shape[-1]
    xf = xf * jax.lax.rsqrt(mean + eps)[..., None]
    return (w.astype(jnp.float32) * xf.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def embed_tokens(params: Weights, token_ids: jnp.ndarray, dtype=None) -> jnp.ndarray:
    """token_ids `[N]` -> hidden `[N, H]`. A quantized embedding is stored as the LM head `[H, V]`."""
    if isinstance(params.embed, QuantizedArray):
        return gather_out(params.embed, token_ids).astype(dtype or params.final_norm.dtype)
    return jnp.take(params.embed, token_ids, axis=0)


def _layer(
    cfg: ModelConfig, lw: LayerWeights, h: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray,
    layer: jnp.ndarray, attend: AttendFn, state: Any, mm: str = "auto", lora: tuple | None = None,
) -> tuple[jnp.ndarray, Any]:
    n = h.shape[0]
    d, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    groups = lw.fused_groups  # > 1: the fused projections' columns are grouped for tensor parallelism
    fused = {"qkv": qkv_parts(cfg), "gate_up": gate_up_parts(cfg)}

    def mat(x, w, bias, group, split):  # the weight matmul, plus the tokens' LoRA adapters (`models.lora`)
        y = matmul(x, w, bias, impl=mm, split=split)
        if lora is None:
            return y
        delta = lora_delta(x, lora[0], layer, group, lora[1])  # plain column order
        if groups > 1 and group in fused:
            delta = jnp.take(delta, jnp.asarray(grouped_order(fused[group], groups)), axis=-1)
        return (y.astype(jnp.float32) + delta).astype(y.dtype)

    x = rms_norm(h, lw.attn_norm, cfg.rms_norm_eps)
    qkv = mat(x, lw.wqkv, lw.bqkv, "qkv", TP_SPLIT["wqkv"])  # [N, (nH + 2 nKV) D]
    q, k, v = split_columns(qkv, fused["qkv"], groups)
    q, k, v = q.reshape(n, nh, d), k.reshape(n, nkv, d), v.reshape(n, nkv, d)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    attn, state = attend(layer, q, k, v, state)  # [N, nH, D]
    h = h + mat(attn.reshape(n, nh * d).astype(h.dtype), lw.wo, lw.bo, "o", TP_SPLIT["wo"])
    x = rms_norm(h, lw.mlp_norm, cfg.rms_norm_eps)
    gu = mat(x, lw.w_gate_up, lw.b_gate_up, "gate_up", TP_SPLIT["w_gate_up"])  # [N, 2F]
    gate, up = split_columns(gu, fused["gate_up"], groups)
    act = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    h = h + mat(act.astype(h.dtype), lw.w_down, lw.b_down, "down", TP_SPLIT["w_down"])
    return h, state


def run_layers(
    params: Weights, cfg: ModelConfig, h: jnp.ndarray, positions: jnp.ndarray, attend: AttendFn, state: Any,
    matmul_impl: str = "auto", lora: tuple[LoraStack, jnp.ndarray] | None = None,
) -> tuple[jnp.ndarray, Any]:
    """All decoder layers over hidden `[N, H]` at `positions` `[N]`; `state` is threaded through `attend`.
    `matmul_impl` picks the dequant-matmul for quantized weights. `lora`: (the adapter stack, each token's slot
    index `[N]`, 0 for none) adds every token's own adapter to the weight matmuls (`models.lora`)."""
    cos, sin = rope_cos_sin(cfg, positions)

    def body(carry, layer):
        h, state = carry
        return _layer(cfg, layer_view(params.layers, layer), h, cos, sin, layer, attend, state, matmul_impl,
                      lora), None

    (h, state), _ = jax.lax.scan(body, (h, state), jnp.arange(cfg.num_layers, dtype=jnp.int32))
    return h, state


def layer_view(layers: LayerWeights, layer: jnp.ndarray) -> LayerWeights:
    """Layer `layer` of the stacked weights: float arrays indexed (a dynamic slice XLA fuses into its consumer),
    quantized ones as `LayerSlice`s, which `matmul` either slices the same way or hands whole, with the index, to a
    kernel that reads the layer in place (the native CPU kernel: XLA would copy a slice passed to a custom call)."""
    def view(a):
        if a is None:
            return None
        if isinstance(a, QuantizedArray):
            return LayerSlice(a, layer)
        return jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)

    return layers.replace(**{f.name: view(getattr(layers, f.name)) for f in dataclasses.fields(layers)
                             if f.metadata.get("pytree_node", True)})


def compute_logits(params: Weights, cfg: ModelConfig, h: jnp.ndarray, matmul_impl: str = "auto") -> jnp.ndarray:
    """Final norm and LM head: hidden `[N, H]` -> float32 logits `[N, V]`."""
    x = rms_norm(h, params.final_norm, cfg.rms_norm_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    if isinstance(head, QuantizedArray):  # stored [H, V] either way
        logits = matmul(x.astype(jnp.float32), head, impl=matmul_impl).astype(jnp.float32)
    elif params.lm_head is None:
        logits = jnp.dot(x, params.embed.T.astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        logits = jnp.dot(x, params.lm_head.astype(x.dtype), preferred_element_type=jnp.float32)
    if params.head_ids is None:
        return logits
    # a reduced head: its N columns are the logits of head_ids; no other token can be sampled
    full = jnp.full(logits.shape[:-1] + (cfg.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., params.head_ids].set(logits)


def dense_causal_attention(cfg: ModelConfig, batch: int, seqlen: int) -> AttendFn:
    """Attention for `batch` sequences of `seqlen` tokens laid out row-major in `[N = batch * seqlen]`."""
    g = cfg.q_per_kv
    scale = cfg.head_dim**-0.5
    t = jnp.arange(seqlen)
    mask = t[:, None] >= t[None, :]  # [T, S]
    if cfg.sliding_window is not None:
        mask &= (t[:, None] - t[None, :]) < cfg.sliding_window

    def attend(layer, q, k, v, state):
        qb = q.reshape(batch, seqlen, cfg.num_kv_heads, g, cfg.head_dim).astype(jnp.float32)
        kb = k.reshape(batch, seqlen, cfg.num_kv_heads, cfg.head_dim).astype(jnp.float32)
        vb = v.reshape(batch, seqlen, cfg.num_kv_heads, cfg.head_dim).astype(jnp.float32)
        s = jnp.einsum("btkgd,bskd->bkgts", qb, kb) * scale
        s = jnp.where(mask, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bkgts,bskd->btkgd", p, vb)
        return o.reshape(batch * seqlen, cfg.num_heads, cfg.head_dim).astype(q.dtype), state

    return attend


@functools.partial(jax.jit, static_argnames=("cfg", "matmul_impl"))
def hidden_states(params: Weights, cfg: ModelConfig, tokens: jnp.ndarray, matmul_impl: str = "auto") -> jnp.ndarray:
    """Dense causal forward up to the last layer: tokens `[B, T]` -> hidden states `[B * T, H]` (before the final
    norm; row-major by sequence)."""
    b, t = tokens.shape
    flat = tokens.reshape(-1)
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)
    h = embed_tokens(params, flat)
    h, _ = run_layers(params, cfg, h, positions, dense_causal_attention(cfg, b, t), None, matmul_impl)
    return h


@functools.partial(jax.jit, static_argnames=("cfg", "matmul_impl"))
def forward(params: Weights, cfg: ModelConfig, tokens: jnp.ndarray, matmul_impl: str = "auto") -> jnp.ndarray:
    """Dense causal forward: tokens `[B, T]` -> float32 logits `[B, T, V]` (positions 0..T-1)."""
    b, t = tokens.shape
    h = hidden_states(params, cfg, tokens, matmul_impl)
    return compute_logits(params, cfg, h, matmul_impl).reshape(b, t, -1)


def greedy_generate(params: Weights, cfg: ModelConfig, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy decoding by re-running the dense forward (O(n^2); tests and oracles only)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = forward(params, cfg, jnp.asarray([ids], jnp.int32))
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt) :]
