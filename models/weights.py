"""Weight pytrees for Llama-family models, and their construction from an HF-named state dict.

Layers are stacked on a leading axis so the forward runs them under one `lax.scan` (compile time independent of
depth). Projections are stored `[in, out]` for `x @ w`, with q/k/v fused into one matrix and gate/up into another:
fewer, larger matmuls are faster on every backend.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import struct

from models.config import ModelConfig
from models.errors import MissingWeightError, WeightShapeError


@struct.dataclass
class LayerWeights:
    attn_norm: jnp.ndarray  # [L, H]
    wqkv: jnp.ndarray  # [L, H, (nH + 2 nKV) D]
    wo: jnp.ndarray  # [L, nH D, H]
    mlp_norm: jnp.ndarray  # [L, H]
    w_gate_up: jnp.ndarray  # [L, H, 2F]
    w_down: jnp.ndarray  # [L, F, H]
    bqkv: jnp.ndarray | None = None  # [L, (nH + 2 nKV) D]
    bo: jnp.ndarray | None = None  # [L, H]
    b_gate_up: jnp.ndarray | None = None  # [L, 2F]
    b_down: jnp.ndarray | None = None  # [L, H]


@struct.dataclass
class Weights:
    embed: jnp.ndarray  # [V, H]
    layers: LayerWeights
    final_norm: jnp.ndarray  # [H]
    lm_head: jnp.ndarray | None = None  # [H, V]; None when tied to `embed`

    def nbytes(self) -> int:
        import jax

        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


def weights_from_state_dict(
    cfg: ModelConfig, get: Callable[[str], np.ndarray | None], dtype=jnp.float32
) -> Weights:
    """Build `Weights` from HF tensor names. `get(name)` returns the tensor (any float dtype) or None if absent.

    Shapes are checked against `cfg`; a mismatch raises WeightShapeError naming the tensor.
    """
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d

    def need(name: str, shape: tuple[int, ...]) -> np.ndarray:
        t = get(name)
        if t is None:
            raise MissingWeightError(f"tensor {name!r} is missing from the checkpoint (expected shape {shape})")
        t = np.asarray(t)
        if tuple(t.shape) != shape:
            raise WeightShapeError(
                f"tensor {name!r} has shape {tuple(t.shape)}, but the config implies {shape}; "
                "check that config.json belongs to these weights"
            )
        return t.astype(np.float32)

    def stack(fn: Callable[[int], np.ndarray]) -> jnp.ndarray:
        return jnp.asarray(np.stack([fn(i) for i in range(cfg.num_layers)]), dtype)

    def p(i: int, rest: str) -> str:
        return f"model.layers.{i}.{rest}"

    def qkv(i: int) -> np.ndarray:
        q = need(p(i, "self_attn.q_proj.weight"), (nq, h))
        k = need(p(i, "self_attn.k_proj.weight"), (nkv, h))
        v = need(p(i, "self_attn.v_proj.weight"), (nkv, h))
        return np.concatenate([q, k, v], axis=0).T

    def gate_up(i: int) -> np.ndarray:
        g = need(p(i, "mlp.gate_proj.weight"), (f, h))
        u = need(p(i, "mlp.up_proj.weight"), (f, h))
        return np.concatenate([g, u], axis=0).T

    layers = LayerWeights(
        attn_norm=stack(lambda i: need(p(i, "input_layernorm.weight"), (h,))),
        wqkv=stack(qkv),
        wo=stack(lambda i: need(p(i, "self_attn.o_proj.weight"), (h, nq)).T),
        mlp_norm=stack(lambda i: need(p(i, "post_attention_layernorm.weight"), (h,))),
        w_gate_up=stack(gate_up),
        w_down=stack(lambda i: need(p(i, "mlp.down_proj.weight"), (h, f)).T),
        bqkv=stack(
            lambda i: np.concatenate(
                [need(p(i, f"self_attn.{n}_proj.bias"), (s,)) for n, s in (("q", nq), ("k", nkv), ("v", nkv))]
            )
        )
        if cfg.qkv_bias
        else None,
        bo=stack(lambda i: need(p(i, "self_attn.o_proj.bias"), (h,))) if cfg.o_bias else None,
        b_gate_up=stack(
            lambda i: np.concatenate([need(p(i, "mlp.gate_proj.bias"), (f,)), need(p(i, "mlp.up_proj.bias"), (f,))])
        )
        if cfg.mlp_bias
        else None,
        b_down=stack(lambda i: need(p(i, "mlp.down_proj.bias"), (h,))) if cfg.mlp_bias else None,
    )
    embed = need("model.embed_tokens.weight", (cfg.vocab_size, h))
    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = jnp.asarray(need("lm_head.weight", (cfg.vocab_size, h)).T, dtype)
    return Weights(
        embed=jnp.asarray(embed, dtype),
        layers=layers,
        final_norm=jnp.asarray(need("model.norm.weight", (h,)), dtype),
        lm_head=lm_head,
    )


def init_random_weights(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, scale: float = 0.02) -> Weights:
    """Random weights for tests and benchmarks (normal(0, scale); norms near 1)."""
    rng = np.random.default_rng(seed)
    h, f, d, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    nqkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d

    def r(*shape: int) -> jnp.ndarray:
        return jnp.asarray(rng.normal(0.0, scale, size=shape).astype(np.float32), dtype)

    def norm(*shape: int) -> jnp.ndarray:
        return jnp.asarray((1.0 + rng.normal(0.0, 0.1, size=shape)).astype(np.float32), dtype)

    layers = LayerWeights(
        attn_norm=norm(L, h),
        wqkv=r(L, h, nqkv),
        wo=r(L, cfg.num_heads * d, h),
        mlp_norm=norm(L, h),
        w_gate_up=r(L, h, 2 * f),
        w_down=r(L, f, h),
        bqkv=r(L, nqkv) if cfg.qkv_bias else None,
        bo=r(L, h) if cfg.o_bias else None,
        b_gate_up=r(L, 2 * f) if cfg.mlp_bias else None,
        b_down=r(L, h) if cfg.mlp_bias else None,
    )
    return Weights(
        embed=r(cfg.vocab_size, h) * 50,  # embeddings of unit-ish scale, as trained models have
        layers=layers,
        final_norm=norm(h),
        lm_head=None if cfg.tie_word_embeddings else r(h, cfg.vocab_size),
    )
