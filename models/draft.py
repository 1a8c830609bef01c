"""Draft models for speculative decoding: cut from the target, given a reduced LM head, saved as a checkpoint.

`truncated_model(model, n)`: the target's first `n` decoder layers, then its own final norm and LM head (a
"self-draft", the zero-training baseline): same vocabulary and tokenizer, weights shared with the target (the
layer stack is sliced, not copied per token).

`reduced_head(model, token_ids)`: the model with an LM head over `token_ids` only (`Weights.head_ids`): the other
tokens get a -inf logit, so the draft never proposes them, and each draft token costs a head of `len(token_ids)`
columns instead of the vocabulary's (for SmolLM2-135M the 576 x 49152 head is about twice the arithmetic of all the
layers of a 4-layer draft). Lossless in speculative decoding: the draft's q is 0 outside the head.

`matched_vocab(model, vocab_size)`: the model with logits over another model's vocabulary size (a draft whose
vocabulary is padded differently from its target's past the same tokenizer; `paged.speculation.draft` applies it).

`save_hf_llama(params, cfg, out)`: float Llama `Weights` as an HF checkpoint (`model.safetensors` + `config.json`)
that `models.load_model(out)` reads; a reduced head is saved as `lm_head.weight` `[N, H]` + `lm_head.token_ids`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from models import quant as quant_lib
from models.errors import InvalidLoadOptionError, WeightShapeError
from models.loader import Model
from models.weights import HEAD_IDS_TENSOR, check_head_ids
from pallas_kernels.quant_format import QuantizedArray, dequantize


def truncated_model(model: Model, num_layers: int) -> Model:
    """`model` cut to its first `num_layers` layers (1 <= num_layers <= model.config.num_layers), keeping the
    embedding, final norm and LM head."""
    total = model.config.num_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise InvalidLoadOptionError(f"truncated_model: num_layers must be an int in [1, {total}], got {num_layers!r}")
    layers = jax.tree_util.tree_map(lambda a: a[:num_layers], model.params.layers)
    params = model.params.replace(layers=layers)
    cfg = dataclasses.replace(model.config, num_layers=num_layers)
    return Model(config=cfg, params=params, tokenizer=model.tokenizer, source=f"{model.source}[:{num_layers} layers]",
                 dtype=model.dtype)


def reduced_head(model: Model, token_ids) -> Model:
    """`model` with its LM head cut to the columns of `token_ids` (distinct ids in [0, vocab_size); any order):
    every other token's logit becomes -inf. A quantized head is re-quantized in its own format after the cut."""
    try:
        ids = check_head_ids(np.asarray(token_ids), model.config)
    except WeightShapeError as e:
        raise InvalidLoadOptionError(f"reduced_head: {e}") from None
    p = model.params
    if p.head_ids is not None:
        raise InvalidLoadOptionError("reduced_head: the model's LM head is already reduced")
    head = p.embed if p.lm_head is None else p.lm_head  # [H, V] when quantized or untied; [V, H] when tied float
    if isinstance(head, QuantizedArray):
        cut = quant_lib.quantize(dequantize(head)[:, ids], head.kind, head.group_size)
    elif p.lm_head is None:
        cut = jnp.asarray(head)[ids].T
    else:
        cut = jnp.asarray(head)[:, ids]
    params = p.replace(lm_head=cut, head_ids=jnp.asarray(ids, jnp.int32))
    cfg = dataclasses.replace(model.config, tie_word_embeddings=False)
    return Model(config=cfg, params=params, tokenizer=model.tokenizer,
                 source=f"{model.source}[head of {len(ids)} tokens]", dtype=model.dtype)


def _fit_vocab_axis(a, n: int, axis: int):
    """`a` with its vocabulary axis (`axis`; a `QuantizedArray`'s columns) cut to its first `n` ids or padded with
    zeros to `n` (a quantized array with zero quants, scales and mins: it dequantizes to exact zeros)."""
    def fit(x, ax):
        if x is None:
            return None
        v = x.shape[ax]
        if n <= v:
            return jax.lax.slice_in_dim(x, 0, n, axis=ax)
        pad = [(0, 0)] * x.ndim
        pad[ax] = (0, n - v)
        return jnp.pad(x, pad)

    if isinstance(a, QuantizedArray):
        if n <= a.shape[1]:
            return quant_lib.select_out(a, np.arange(n))
        return a.replace(values=fit(a.values, -1), scales=fit(a.scales, -1), mins=fit(a.mins, -1),
                         shape=(a.shape[0], n))
    return fit(jnp.asarray(a), axis)


def _take_columns(a, cols: np.ndarray):
    """The columns `cols` of a `[H, N]` head (float or `QuantizedArray`, still quantized)."""
    if isinstance(a, QuantizedArray):
        return quant_lib.select_out(a, cols)
    return jnp.take(jnp.asarray(a), cols, axis=-1)


def matched_vocab(model: Model, vocab_size: int) -> Model:
    """`model` (a draft) with logits over the `vocab_size` ids of another model (its target) whose vocabulary is
    padded differently past the same tokenizer, as Qwen2.5-7B's 152064 ids and Qwen2.5-0.5B's 151936 for 151665
    tokens. An id below both sizes keeps its logit; an id past the model's own vocabulary gets a -inf logit (never
    proposed: its q is 0, so speculative decoding stays lossless) and a zero embedding (the target may feed it); an
    id past `vocab_size` is dropped (it has no text: the tokenizer ends below both). Exact: the kept columns and rows
    are the model's own (a quantized table is cut or zero-padded without requantizing). `model` itself when the
    sizes already match."""
    v = model.config.vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise InvalidLoadOptionError(f"matched_vocab: vocab_size must be an int >= 1, got {vocab_size!r}")
    vocab_size = int(vocab_size)
    if vocab_size == v:
        return model
    p = model.params
    tied = p.lm_head is None
    quantized_embed = isinstance(p.embed, QuantizedArray)  # (stored [H, V], as a head)
    if p.head_ids is not None:  # a reduced head: keep its columns whose ids the target has
        ids = np.asarray(p.head_ids)
        keep = np.flatnonzero(ids < vocab_size)
        if keep.size == 0:
            raise InvalidLoadOptionError(f"matched_vocab: none of the reduced head's token ids is below {vocab_size}")
        head, head_ids = _take_columns(p.lm_head, keep), jnp.asarray(ids[keep], jnp.int32)
    elif vocab_size < v:  # the ids past `vocab_size` dropped: the head's first columns (tied: the cut table)
        head = None if tied else _fit_vocab_axis(p.lm_head, vocab_size, -1)
        head_ids = None
    else:  # a head over the model's own ids; the target's ids past them get -inf
        head = (p.embed if quantized_embed else jnp.asarray(p.embed).T) if tied else p.lm_head
        head_ids = jnp.arange(v, dtype=jnp.int32)
    embed = _fit_vocab_axis(p.embed, vocab_size, -1 if quantized_embed else 0)
    params = p.replace(embed=embed, lm_head=head, head_ids=head_ids)
    cfg = dataclasses.replace(model.config, vocab_size=vocab_size, tie_word_embeddings=head is None)
    return dataclasses.replace(model, config=cfg, params=params,
                               source=f"{model.source}[vocabulary {v} -> {vocab_size}]")


def hf_llama_config(cfg) -> dict:
    """The HF `config.json` of a Llama of config `cfg` (no rope scaling)."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "float32",
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else None}


def save_hf_llama(params, cfg, out: str) -> None:
    """Float Llama `params` (`Weights`: tied, untied, or with a reduced head) of config `cfg` as HF-named
    `out/model.safetensors` + `out/config.json`. Quantized weights, biases, rope scaling and tensor-parallel
    layouts are refused (`InvalidLoadOptionError`): this writes what the distillation script trains."""
    from safetensors.numpy import save_file

    lw = params.layers
    if any(isinstance(a, QuantizedArray) for a in jax.tree_util.tree_leaves(
            params, is_leaf=lambda x: isinstance(x, QuantizedArray))):
        raise InvalidLoadOptionError("save_hf_llama writes float weights: load the model with quant=None")
    if lw.fused_groups != 1:  # regrouped for tensor parallelism (models.fused): the columns are not [q | k | v]
        raise InvalidLoadOptionError("save the model's own weights, not an engine's tensor-parallel copy")
    rs = cfg.rope_scaling
    if lw.bqkv is not None or lw.bo is not None or lw.b_gate_up is not None or (
            rs is not None and rs.rope_type != "default"):
        raise InvalidLoadOptionError("save_hf_llama writes bias-free Llama weights without rope scaling")
    if cfg.sliding_window is not None or cfg.model_type != "llama":
        raise InvalidLoadOptionError(f"save_hf_llama writes Llama checkpoints (full attention), not "
                                     f"{cfg.model_type!r} with sliding_window={cfg.sliding_window}")
    d = cfg.head_dim
    nq, nkv, f = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": np.asarray(params.embed, np.float32),
                                "model.norm.weight": np.asarray(params.final_norm, np.float32)}
    if params.lm_head is not None:
        t["lm_head.weight"] = np.asarray(params.lm_head, np.float32).T  # [N or V, H]
    if params.head_ids is not None:
        t[HEAD_IDS_TENSOR] = np.asarray(params.head_ids, np.int32)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = np.asarray(lw.wqkv[i], np.float32).T  # [out, in]
        t[p + "self_attn.q_proj.weight"] = qkv[:nq]
        t[p + "self_attn.k_proj.weight"] = qkv[nq : nq + nkv]
        t[p + "self_attn.v_proj.weight"] = qkv[nq + nkv :]
        t[p + "self_attn.o_proj.weight"] = np.asarray(lw.wo[i], np.float32).T
        gu = np.asarray(lw.w_gate_up[i], np.float32).T
        t[p + "mlp.gate_proj.weight"] = gu[:f]
        t[p + "mlp.up_proj.weight"] = gu[f:]
        t[p + "mlp.down_proj.weight"] = np.asarray(lw.w_down[i], np.float32).T
        t[p + "input_layernorm.weight"] = np.asarray(lw.attn_norm[i], np.float32)
        t[p + "post_attention_layernorm.weight"] = np.asarray(lw.mlp_norm[i], np.float32)
    os.makedirs(out, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, os.path.join(out, "model.safetensors"))
    conf = hf_llama_config(dataclasses.replace(cfg, tie_word_embeddings=params.lm_head is None))
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(conf, fh, indent=2)
