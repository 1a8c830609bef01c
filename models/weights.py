"""Weight pytrees for Llama-family models, and their construction from an HF-named state dict.

Layers are stacked on a leading axis so the forward runs them under one `lax.scan` (compile time independent of
depth). Projections are stored `[in, out]` for `x @ w`, with q/k/v fused into one matrix and gate/up into another:
fewer, larger matmuls are faster on every backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import struct

from models import quant as quant_lib
from models.config import ModelConfig
from models.errors import InvalidLoadOptionError, MissingWeightError, WeightShapeError
from pallas_kernels.quant_format import QuantizedArray, dequantize


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
    # static: the column layout of wqkv / w_gate_up (and their biases): 1 plain, g grouped for tensor parallelism
    # over g devices (`models.fused`)
    fused_groups: int = struct.field(pytree_node=False, default=1)


@struct.dataclass
class Weights:
    embed: jnp.ndarray  # [V, H]
    layers: LayerWeights
    final_norm: jnp.ndarray  # [H]
    lm_head: jnp.ndarray | None = None  # [H, V]; None when tied to `embed`; [H, N] with `head_ids`
    # A reduced LM head (drafts: `experiments/distill_draft.py --head_vocab`): int32 [N], the token id of each of
    # lm_head's N columns; every other token's logit is -inf (never proposed). None: lm_head covers the vocabulary.
    head_ids: jnp.ndarray | None = None

    def nbytes(self) -> int:
        return quant_lib.nbytes(self)

    def step_read_bytes(self) -> int:
        """Weight bytes one decode step reads: every layer, the final norm and the LM head (the embedding table
        when tied), but of a separate embedding table only the gathered rows, counted as nothing. Times steps per
        second, this is the memory bandwidth the weights take (as gpt-fast reports it)."""
        total = self.nbytes()
        if self.lm_head is not None:  # untied: the input table is gathered, not read whole
            total -= quant_lib.nbytes(self.embed)
        return total


QUANT_MODES = (None, "keep", "int8", "int4")
_KINDS = {"int8": "int8", "int4": "q4_1"}  # round-to-nearest formats for float checkpoints


def weights_from_state_dict(
    cfg: ModelConfig, get: Callable[[str], np.ndarray | QuantizedArray | None], dtype=jnp.float32,
    quant: str | None = None,
) -> Weights:
    """Build `Weights` from HF tensor names. `get(name)` returns the tensor (a float array `[out, in]`, or a
    `QuantizedArray` standing for `[in, out]`) or None if absent. Shapes are checked against `cfg`.

    quant: None (float weights of `dtype`; quantized tensors are dequantized), "keep" (quantized tensors stay
    quantized, float ones stay float), "int8" / "int4" (every projection, the embedding and the LM head are
    quantized round-to-nearest at load, group 32; int4 uses the asymmetric Q4_1 format; the embedding stays int8).
    """
    if quant not in QUANT_MODES:
        choices = ", ".join(map(repr, QUANT_MODES))
        raise InvalidLoadOptionError(f"quant={quant!r} is not supported; use one of {choices}")
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    if quant in _KINDS:  # (a bare ValueError from the quantizer had named no option and no file)
        for name, size in (("hidden_size", h), ("intermediate_size", f), ("num_heads * head_dim", nq)):
            if size % 32:
                raise InvalidLoadOptionError(f"quant={quant!r} quantizes each projection in groups of 32 along its "
                                             f"input, and this model's {name} is {size}, not a multiple of 32; load "
                                             "it with quant=None")

    def need(name: str, shape: tuple[int, ...], explain: Callable[[tuple[int, ...]], str] | None = None):
        """The tensor `name` of `shape`; `explain(got)`: the message of a shape mismatch, where the config is not
        what sets the shape."""
        t = get(name)
        if t is None:
            raise MissingWeightError(f"tensor {name!r} is missing from the checkpoint (expected shape {shape})",
                                     tensor=name)
        got = tuple(reversed(t.shape)) if isinstance(t, QuantizedArray) else tuple(np.shape(t))
        if got != shape:
            raise WeightShapeError(
                explain(got) if explain is not None else (f"tensor {name!r} has shape {got}, but the config implies "
                                                          f"{shape}; check that config.json belongs to these weights"),
                tensor=name,
            )
        return t if isinstance(t, QuantizedArray) else np.asarray(t).astype(np.float32)

    def as_float(t) -> np.ndarray:  # -> [in, out]
        return np.asarray(dequantize(t)) if isinstance(t, QuantizedArray) else t.T

    host_dtype = np.dtype(jnp.dtype(dtype))  # (bfloat16: ml_dtypes' numpy type)

    def linear(parts: list, kind: str | None = None, host: bool = False):
        """Fuse `[out_i, in]` tensors along `out` into one `[in, sum out_i]` matrix, float or quantized; `host`: a
        float one stays a numpy array of `dtype` (`stack` places the whole stack at once)."""
        qas = [t for t in parts if isinstance(t, QuantizedArray)]
        if quant == "keep" and len(qas) == len(parts) and len({(q.kind, q.group_size) for q in qas}) == 1:
            return qas[0] if len(qas) == 1 else quant_lib.concat_out(qas)
        w = np.concatenate([as_float(t) for t in parts], axis=1)
        want = kind or _KINDS.get(quant)
        if want is not None:
            return quant_lib.quantize(jnp.asarray(w), want, 32)
        return w.astype(host_dtype) if host else jnp.asarray(w, dtype)

    def stack(mats: Iterator):
        """The layers' matrices (made one at a time by `mats`) stacked `[L, ...]`. Float ones are written into one
        host array of `dtype` as they come and placed once: no list of per-layer copies besides the stack (a
        checkpoint had needed 4-5x its size in memory at load)."""
        first = next(mats)
        if isinstance(first, QuantizedArray):
            rest = [first, *mats]
            if all(isinstance(m, QuantizedArray) for m in rest) and len(
                    {(m.kind, m.group_size, m.shape) for m in rest}) == 1:
                return quant_lib.stack(rest)
            # mixed formats across layers: fall back to float
            return jnp.stack([np.asarray(dequantize(m)) if isinstance(m, QuantizedArray) else m for m in rest]).astype(
                dtype)
        out = np.empty((cfg.num_layers, *np.shape(first)), host_dtype)
        out[0] = first
        for i, m in enumerate(mats, 1):
            out[i] = np.asarray(dequantize(m)) if isinstance(m, QuantizedArray) else m
        return jnp.asarray(out)

    def p(i: int, rest: str) -> str:
        return f"model.layers.{i}.{rest}"

    L = range(cfg.num_layers)

    def fstack(fn) -> jnp.ndarray:
        return jnp.asarray(np.stack([fn(i) for i in L]), dtype)

    layers = LayerWeights(
        attn_norm=fstack(lambda i: need(p(i, "input_layernorm.weight"), (h,))),
        wqkv=stack(linear([need(p(i, "self_attn.q_proj.weight"), (nq, h)),
                           need(p(i, "self_attn.k_proj.weight"), (nkv, h)),
                           need(p(i, "self_attn.v_proj.weight"), (nkv, h))], host=True) for i in L),
        wo=stack(linear([need(p(i, "self_attn.o_proj.weight"), (h, nq))], host=True) for i in L),
        mlp_norm=fstack(lambda i: need(p(i, "post_attention_layernorm.weight"), (h,))),
        w_gate_up=stack(linear([need(p(i, "mlp.gate_proj.weight"), (f, h)),
                                need(p(i, "mlp.up_proj.weight"), (f, h))], host=True) for i in L),
        w_down=stack(linear([need(p(i, "mlp.down_proj.weight"), (h, f))], host=True) for i in L),
        bqkv=fstack(lambda i: np.concatenate(
            [need(p(i, f"self_attn.{n}_proj.bias"), (s,)) for n, s in (("q", nq), ("k", nkv), ("v", nkv))]))
        if cfg.qkv_bias else None,
        bo=fstack(lambda i: need(p(i, "self_attn.o_proj.bias"), (h,))) if cfg.o_bias else None,
        b_gate_up=fstack(lambda i: np.concatenate(
            [need(p(i, "mlp.gate_proj.bias"), (f,)), need(p(i, "mlp.up_proj.bias"), (f,))]))
        if cfg.mlp_bias else None,
        b_down=fstack(lambda i: need(p(i, "mlp.down_proj.bias"), (h,))) if cfg.mlp_bias else None,
    )
    embed_t = need("model.embed_tokens.weight", (cfg.vocab_size, h))
    head_ids = get(HEAD_IDS_TENSOR)
    if head_ids is not None:
        head_ids = check_head_ids(np.asarray(head_ids), cfg)
        if cfg.tie_word_embeddings:
            raise WeightShapeError(f"{HEAD_IDS_TENSOR!r} (a reduced LM head) needs an untied lm_head.weight; "
                                   "set tie_word_embeddings to false in config.json", tensor=HEAD_IDS_TENSOR)
    head_rows = cfg.vocab_size if head_ids is None else len(head_ids)
    explain = None if head_ids is None else (
        lambda got: f"{HEAD_IDS_TENSOR!r} names {head_rows} tokens but lm_head.weight has {got[0]} rows of "
                    f"{got[1:]} (hidden {h}): a reduced head needs one token id per row")
    head_t = None if cfg.tie_word_embeddings else need("lm_head.weight", (head_rows, h), explain)
    if quant is None or (quant == "keep" and not isinstance(embed_t, QuantizedArray)):
        embed = jnp.asarray(as_float(embed_t).T, dtype)  # [V, H]
    else:  # quantized embeddings are stored as the LM head [H, V]
        embed = linear([embed_t], kind=None if quant == "keep" else "int8")
    lm_head = None
    if head_t is not None:
        lm_head = linear([head_t], kind=None if quant in (None, "keep") else "int8") if quant else jnp.asarray(
            as_float(head_t), dtype)
    return Weights(
        embed=embed,
        layers=layers,
        final_norm=jnp.asarray(need("model.norm.weight", (h,)), dtype),
        lm_head=lm_head,
        head_ids=None if head_ids is None else jnp.asarray(head_ids, jnp.int32),
    )


HEAD_IDS_TENSOR = "lm_head.token_ids"  # a reduced head's token ids in a safetensors checkpoint (int32 [N])


def check_head_ids(ids: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The token ids of a reduced LM head, checked: 1-D integers, distinct, each in [0, vocab_size)."""
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise WeightShapeError(f"{HEAD_IDS_TENSOR!r} must be a non-empty 1-D integer tensor, got dtype {ids.dtype} "
                               f"shape {ids.shape}", tensor=HEAD_IDS_TENSOR)
    if ids.min() < 0 or ids.max() >= cfg.vocab_size or len(np.unique(ids)) != ids.size:
        raise WeightShapeError(f"{HEAD_IDS_TENSOR!r} must hold distinct token ids in [0, {cfg.vocab_size})",
                               tensor=HEAD_IDS_TENSOR)
    return ids.astype(np.int32)


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
