"""`ModelConfig`: the static, hashable description of a Llama-family model.

Built from a Hugging Face `config.json` dict (`ModelConfig.from_hf`) or from GGUF metadata (`ModelConfig.from_gguf`).
It is hashable so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from models.errors import ModelFileNotFoundError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling. `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama with attention_bias)
    o_bias: bool = False  # output projection carries a bias (Llama with attention_bias)
    mlp_bias: bool = False
    sliding_window: int | None = None  # attend only to the last `sliding_window` positions (Mistral)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}. "
                "See docs/architecture.md ('Adding an architecture')."
            )
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope scaling type {self.rope_scaling.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) for GQA"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * f + 2 * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + lm_head

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face `config.json` dict (transformers 4 `rope_scaling` or 5 `rope_parameters`)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}. "
                "See docs/architecture.md ('Adding an architecture')."
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported (only 'silu')")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or {}
        merged = {**rope_params, **rope_scaling}
        rope_theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )
        sliding = None
        if model_type == "mistral":
            sliding = cfg.get("sliding_window")
        elif model_type == "qwen2" and cfg.get("use_sliding_window"):
            layer_types = cfg.get("layer_types") or []
            if layer_types and len(set(layer_types)) > 1:
                raise UnsupportedArchitectureError(
                    "Qwen2 with sliding window on only some layers (mixed layer_types) is not supported"
                )
            sliding = cfg.get("sliding_window")
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=(model_type == "qwen2") or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelFileNotFoundError(
                f"{cfg_path} not found: an HF model directory needs config.json next to its *.safetensors"
            )
        with open(cfg_path) as f:
            return cls.from_hf(json.load(f))

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], *, tie_word_embeddings: bool) -> ModelConfig:
        """From GGUF key/value metadata (decoded to Python values). GGUF has no tie flag: the caller passes
        whether the file lacks a separate `output.weight`."""
        arch = metadata.get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise UnsupportedArchitectureError(
                f"GGUF architecture {arch!r} is not supported; supported: llama (incl. Mistral, SmolLM2), qwen2"
            )

        def key(name: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{name}", default)

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        kv_heads = int(key("attention.head_count_kv", heads))
        head_dim = int(key("attention.key_length", 0) or key("rope.dimension_count", 0) or hidden // heads)
        rope_type = {"none": "default", None: "default"}.get(key("rope.scaling.type"), key("rope.scaling.type"))
        scaling = RopeScaling(rope_type=rope_type, factor=float(key("rope.scaling.factor", 1.0) or 1.0))
        vocab = key("vocab_size")
        if vocab is None:
            tokens = metadata.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else None
        if vocab is None:
            raise UnsupportedArchitectureError("GGUF metadata has neither a vocab_size nor tokenizer.ggml.tokens")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            model_type="qwen2" if arch == "qwen2" else "llama",
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=tie_word_embeddings,
            qkv_bias=arch == "qwen2",
            sliding_window=None,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )
