"""`ModelConfig`: the static, hashable description of a Llama-family model.

Built from a Hugging Face `config.json` dict (`ModelConfig.from_hf`) or from GGUF metadata (`ModelConfig.from_gguf`).
It is hashable so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from models.errors import (
    CorruptFileError,
    ModelConfigError,
    ModelFileNotFoundError,
    ModelLoadError,
    UnsupportedArchitectureError,
    raise_with_source,
)

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
    # per-frequency divisors of the inverse frequencies [head_dim // 2], applied after the type's scaling: a GGUF's
    # `rope_freqs.weight` (how llama.cpp's converter stores Llama 3.1 / 3.2's llama3 scaling); None: none
    freq_factors: tuple[float, ...] | None = None


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
                raise ModelConfigError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) for GQA"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"ModelConfig.head_dim must be even (rotary embeddings turn dimensions in pairs), "
                                   f"got {self.head_dim}")

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
    def from_hf(cls, cfg: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """From a Hugging Face `config.json` dict (transformers 4 `rope_scaling` or 5 `rope_parameters`).

        Every key is type- and range-checked: a missing, mistyped or inconsistent value raises ModelConfigError (an
        unknown architecture UnsupportedArchitectureError) whose message starts with `source` (the file's path)."""
        try:
            if not isinstance(cfg, dict):
                raise ModelConfigError(f"the file must hold a JSON object, got a {type(cfg).__name__}")
            return cls._from_hf(_Fields(cfg))
        except ModelLoadError as e:
            raise_with_source(e, source)

    @classmethod
    def _from_hf(cls, cfg: _Fields) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}. "
                "See docs/architecture.md ('Adding an architecture')."
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported (only 'silu')")
        hidden = cfg.integer("hidden_size")
        heads = cfg.integer("num_attention_heads")
        kv_heads = cfg.integer("num_key_value_heads", heads)
        head_dim = cfg.integer("head_dim", None, minimum=0) or None  # 0 (seen in the wild) means "derive it"
        _check_heads(hidden, heads, kv_heads, head_dim, ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                         "head_dim"))
        quantized = cfg.get("quantization_config")
        if quantized:  # FP8, GPTQ, AWQ, bitsandbytes, ...: tensors this loader cannot read as weights
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
            raise UnsupportedArchitectureError(
                f"the checkpoint is quantized (quantization_config, quant_method {method!r}), which is not "
                "supported: use a float (F32/F16/BF16) checkpoint, or a GGUF file (Q8_0/Q4_0/Q4_1 kept with "
                "quant='keep'), or quantize at load with quant='int8' / 'int4'")
        rope_params = cfg.mapping("rope_parameters")
        rope_scaling = cfg.mapping("rope_scaling")
        merged = _Fields({**rope_params, **rope_scaling}, what="rope_scaling/rope_parameters ")
        rope_theta = merged.number("rope_theta", cfg.number("rope_theta", 10000.0))
        # the legacy rope_scaling wins over rope_parameters where both name a type, as in transformers
        rope_type = (rope_scaling.get("rope_type", rope_scaling.get("type"))
                     or rope_params.get("rope_type", rope_params.get("type")) or "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=merged.number("factor", 1.0),
            low_freq_factor=merged.number("low_freq_factor", 1.0),
            high_freq_factor=merged.number("high_freq_factor", 4.0),
            original_max_position_embeddings=merged.integer("original_max_position_embeddings", 8192),
        )
        sliding = None
        if model_type == "mistral":
            sliding = cfg.integer("sliding_window", None)
        elif model_type == "qwen2" and cfg.flag("use_sliding_window", False):
            sliding = _qwen2_window(cfg, cfg.integer("sliding_window", None), cfg.integer("num_hidden_layers"))
        attention_bias = cfg.flag("attention_bias", False)
        return cls(
            model_type=model_type,
            vocab_size=cfg.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=cfg.integer("intermediate_size"),
            num_layers=cfg.integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim or hidden // heads,
            rms_norm_eps=cfg.number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.integer("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
            qkv_bias=(model_type == "qwen2") or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=cfg.flag("mlp_bias", False),
            sliding_window=sliding,
            bos_token_id=cfg.token_id("bos_token_id"),
            eos_token_ids=cfg.ids("eos_token_id"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> ModelConfig:
        """From `path/config.json`; a missing, unreadable or invalid file raises a ModelLoadError naming it."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            found = "is not a file" if os.path.exists(cfg_path) else "not found"
            raise ModelFileNotFoundError(
                f"{cfg_path} {found}: an HF model directory needs config.json next to its *.safetensors"
            )
        return cls.from_hf(read_json_file(cfg_path), source=cfg_path)

    @classmethod
    def from_gguf(
        cls, metadata: dict[str, Any], *, tie_word_embeddings: bool, source: str = "GGUF metadata",
        biases: tuple[bool, bool, bool] = (False, False, False), rope_freqs: Any = None,
    ) -> ModelConfig:
        """From GGUF key/value metadata (decoded to Python values). GGUF has no tie flag: the caller passes
        whether the file lacks a separate `output.weight`; nor bias flags: `biases` says which of the llama
        architecture's optional biases the file holds (q/k/v, o, the MLP's), and `rope_freqs` is its
        `rope_freqs.weight` tensor (Llama 3.1 / 3.2's llama3 scaling as llama.cpp stores it) or None. Errors are
        ModelLoadErrors whose message starts with `source` (the file's path)."""
        try:
            return cls._from_gguf(_Fields(metadata, missing="the GGUF metadata lacks it"), tie_word_embeddings,
                                  biases, rope_freqs)
        except ModelLoadError as e:
            raise_with_source(e, source)

    @classmethod
    def _from_gguf(cls, metadata: _Fields, tie_word_embeddings: bool, biases: tuple[bool, bool, bool],
                   rope_freqs: Any) -> ModelConfig:
        arch = metadata.get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise UnsupportedArchitectureError(
                f"GGUF architecture {arch!r} is not supported; supported: llama (incl. Mistral, SmolLM2), qwen2"
            )
        k = f"{arch}."
        hidden = metadata.integer(k + "embedding_length")
        heads = metadata.integer(k + "attention.head_count")
        kv_heads = metadata.integer(k + "attention.head_count_kv", heads)
        head_dim = (metadata.integer(k + "attention.key_length", None, minimum=0)
                    or metadata.integer(k + "rope.dimension_count", None, minimum=0) or None)
        _check_heads(hidden, heads, kv_heads, head_dim, (k + "embedding_length", k + "attention.head_count",
                                                         k + "attention.head_count_kv", k + "attention.key_length"))
        rope_type = metadata.get(k + "rope.scaling.type", "none")
        rope_type = "default" if rope_type == "none" else rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        factors = None
        if rope_freqs is not None:
            factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
            dim = head_dim or hidden // heads
            if factors.shape != (dim // 2,) or not (np.isfinite(factors).all() and (factors > 0).all()):
                raise ModelConfigError(f"rope_freqs.weight must hold {dim // 2} positive finite numbers (one per "
                                       f"rotary frequency), got shape {factors.shape}")
            factors = tuple(float(x) for x in factors)
        scaling = RopeScaling(rope_type=rope_type, factor=metadata.number(k + "rope.scaling.factor", 1.0, minimum=0.0)
                              or 1.0, freq_factors=factors)
        vocab = metadata.integer(k + "vocab_size", None)
        if vocab is None:
            tokens = metadata.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ModelConfigError(f"the GGUF metadata has neither {k}vocab_size nor tokenizer.ggml.tokens")
            if not isinstance(tokens, list) or not tokens:
                raise ModelConfigError(f"tokenizer.ggml.tokens must be a non-empty array, got {_short(tokens)}")
            vocab = len(tokens)
        eos = metadata.token_id("tokenizer.ggml.eos_token_id")
        return cls(
            model_type="qwen2" if arch == "qwen2" else "llama",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=metadata.integer(k + "feed_forward_length"),
            num_layers=metadata.integer(k + "block_count"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim or hidden // heads,
            rms_norm_eps=metadata.number(k + "attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=metadata.number(k + "rope.freq_base", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=metadata.integer(k + "context_length", 2048),
            tie_word_embeddings=tie_word_embeddings,
            qkv_bias=arch == "qwen2" or biases[0],
            o_bias=biases[1],
            mlp_bias=biases[2],
            sliding_window=None,
            bos_token_id=metadata.token_id("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,),
        )


# ---------------------------------------------------------------------------------------------------------- helpers
_REQUIRED: Any = object()
LAYER_TYPES = ("full_attention", "sliding_attention")


def _qwen2_window(cfg: _Fields, window: int | None, num_layers: int) -> int | None:
    """The sliding window of a Qwen2 config with use_sliding_window, as transformers reads it: `layer_types`, or
    where absent the layers from `max_window_layers` (default 28) on slide. Every layer sliding: the window; none:
    None (full attention); a mix is an UnsupportedArchitectureError (one window for every layer here)."""
    if window is None:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = cfg.integer("max_window_layers", 28, minimum=0)
        layer_types = [LAYER_TYPES[i >= first] for i in range(num_layers)]
    if not isinstance(layer_types, list) or not all(t in LAYER_TYPES for t in layer_types):
        raise ModelConfigError(f"'layer_types' must be a list of {' / '.join(map(repr, LAYER_TYPES))}, got "
                               f"{_short(layer_types)}")
    kinds = set(layer_types)
    if len(kinds) > 1:
        raise UnsupportedArchitectureError(
            "Qwen2 with a sliding window on only some layers (layer_types, or max_window_layers below "
            "num_hidden_layers) is not supported: every layer slides or none does")
    return window if kinds == {"sliding_attention"} else None


def _short(value: Any) -> str:
    """repr of a config value, cut short: a corrupt file can hold a huge one."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """Typed reads of a config.json dict or GGUF metadata. A null value counts as absent; every failure is a
    ModelConfigError naming the key, the value found and what is expected."""

    def __init__(self, data: Mapping[str, Any], *, what: str = "", missing: str = "set it") -> None:
        self.data = data
        self.what = what  # prefix of key names in messages, e.g. "rope_scaling/rope_parameters "
        self.missing = missing  # what to do about a missing required key

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def _value(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None and default is _REQUIRED:
            raise ModelConfigError(f"required key {self.what}{key!r} is missing; {self.missing}")
        return value

    def integer(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> Any:
        """An int >= minimum (an integral float such as 64.0 is accepted); `default` when absent."""
        value = self._value(key, default)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ModelConfigError(f"{self.what}{key!r} must be {kind}, got {_short(value)}")
        return value

    def number(self, key: str, default: Any = _REQUIRED, *, minimum: float | None = None) -> Any:
        """A finite number > 0 (or >= minimum when given); `default` when absent."""
        value = self._value(key, default)
        if value is None:
            return default
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        ok = ok and (value > 0 if minimum is None else value >= minimum)
        if not ok:
            kind = "a positive number" if minimum is None else f"a number >= {minimum}"
            raise ModelConfigError(f"{self.what}{key!r} must be {kind}, got {_short(value)}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._value(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ModelConfigError(f"{self.what}{key!r} must be true or false, got {_short(value)}")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self._value(key, None)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ModelConfigError(f"{self.what}{key!r} must be an object (or null), got {_short(value)}")
        return value

    def ids(self, key: str) -> tuple[int, ...]:
        """Token ids: an int or a list of ints, as a tuple; () when absent. Negative ids are dropped: some files
        write -1 for "none"."""
        value = self._value(key, None)
        if value is None:
            return ()
        items = value if isinstance(value, list) else [value]
        sub = _Fields({str(i): v for i, v in enumerate(items)})
        try:
            ids = [sub.integer(str(i), minimum=-(2**63)) for i in range(len(items))]
        except ModelConfigError:
            raise ModelConfigError(
                f"{self.what}{key!r} must be a token id (an integer) or a list of them, got {_short(value)}"
            ) from None
        return tuple(i for i in ids if i >= 0)

    def token_id(self, key: str) -> int | None:
        """One token id; None when absent or negative."""
        value = self._value(key, None)
        if isinstance(value, list):
            raise ModelConfigError(f"{self.what}{key!r} must be a token id (an integer), got {_short(value)}")
        ids = self.ids(key)
        return ids[0] if ids else None


def _check_heads(hidden: int, heads: int, kv_heads: int, head_dim: int | None, keys: tuple[str, str, str, str]):
    """Attention sizes that fit together, in the source's key names."""
    hidden_key, heads_key, kv_key, head_dim_key = keys
    if heads % kv_heads:
        raise ModelConfigError(
            f"{heads_key} ({heads}) must be a multiple of {kv_key} ({kv_heads}): each key/value head serves a whole "
            "group of query heads"
        )
    if head_dim is None and hidden % heads:
        raise ModelConfigError(
            f"{hidden_key} ({hidden}) is not divisible by {heads_key} ({heads}) and {head_dim_key} is not set; "
            f"set {head_dim_key} or fix the sizes"
        )
    d = head_dim or hidden // heads
    if d % 2:
        where = head_dim_key if head_dim else f"{hidden_key} / {heads_key} = {hidden} / {heads}"
        raise ModelConfigError(f"the head size ({where}) is {d}, odd: rotary embeddings turn a head's dimensions in "
                               "pairs, so it must be even")


def read_json_file(path: str) -> Any:
    """The parsed JSON of a checkpoint file (config.json, model.safetensors.index.json); unreadable bytes or invalid
    JSON raise CorruptFileError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptFileError(f"{path} is not valid JSON ({e}); the file is truncated or corrupt, re-download it") \
            from e
    except OSError as e:
        raise ModelLoadError(f"{path} could not be read ({e})") from e
