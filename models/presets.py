"""Presets: real architectures with random weights, for timing the engine at the sizes users run, with no download.

A preset is the published architecture of a real model (its `config.json`, as Meta, Qwen and Hugging Face publish
it) with random weights generated directly on the default JAX device with `jax.random`: its parameter count and its
resident bytes are the real model's, its outputs are noise. Use it through every `--model` (`models.load_model`):

    preset:llama3-8b                 float weights in `dtype`; `quant="int8"` / `"int4"` as for a float checkpoint
    preset:llama3-8b@q4_0            the suffix names the weight format outright (WEIGHT_FORMATS): it overrides
                                     `dtype`, and `quant` must be None / "keep" (or the suffix's own int8 / int4)

Weight formats (`WEIGHT_FORMATS`), as this framework stores them (`pallas_kernels/quant_format.py`); every
quantized format groups 32 input rows per float16 scale, like GGUF's blocks:

    bf16, float16, float32   every tensor in that dtype
    int8  = q8_0             every projection, the embedding and the LM head int8 (what `quant="int8"` makes of a
                             float checkpoint; the same bytes as a GGUF Q8_0 file)
    int4                     projections Q4_1 (4-bit quants, float16 scale and min); embedding and LM head int8 (what
                             `quant="int4"` makes of a float checkpoint)
    q4_0, q4_1               every projection, the embedding and the LM head in that GGUF block format (a "pure"
                             GGUF file, `llama-quantize --pure`)

In the quantized formats the norms (and Qwen2's q/k/v biases) stay float, in the `dtype` given (bfloat16 for a
suffix), which is also the activations' dtype. A quantized embedding is stored as the LM head `[H, V]`.

Random values: every matrix normal(0, 0.02) (Hugging Face's `initializer_range` for all four models), the
quantized ones uniform quants with scales that give the same standard deviation (and, for Q4_1, mins that centre
them), norms 1. Activations stay finite through all layers. Stacked layer tensors are generated one layer at a
time inside one jitted `lax.map`, so the largest transient is one layer's random bits, and nothing is copied
from the host: an 8B model in bf16 needs its 16 GB on the device and little more.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from models.config import ModelConfig, RopeScaling
from models.errors import InvalidLoadOptionError, ModelFileNotFoundError
from models.weights import LayerWeights, Weights
from pallas_kernels.quant_format import Q4_KINDS, QuantizedArray

PREFIX = "preset:"
GROUP_SIZE = 32  # input rows per scale in every quantized format (GGUF's block)
STD = 0.02  # standard deviation of every random matrix (HF initializer_range)


@dataclasses.dataclass(frozen=True)
class Preset:
    """A real model's architecture, its published parameter count, and where both come from."""

    name: str
    config: ModelConfig
    params: int  # the published total (embeddings and LM head included)
    source: str


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("llama3-8b", ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001,)),
        8_030_261_248, "meta-llama/Meta-Llama-3-8B config.json; 8.03B on its model card"),
    Preset("llama3.2-1b", ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,)),
        1_235_814_400, "meta-llama/Llama-3.2-1B config.json; 1.23B on its model card"),
    Preset("qwen2.5-7b", ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=131072, tie_word_embeddings=False, qkv_bias=True, bos_token_id=151643,
        eos_token_ids=(151643,)),
        7_615_616_512, "Qwen/Qwen2.5-7B config.json; 7.61B (6.53B non-embedding) on its model card"),
    Preset("smollm2-135m", ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=0, eos_token_ids=(0,)),
        134_515_008, "HuggingFaceTB/SmolLM2-135M config.json (the embedded GGUF's shape); 135M on its model card"),
)}


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How each kind of tensor is stored: a float dtype name, or a quantization kind ("int8", "q4_0", "q4_1")."""

    projections: str
    embed: str
    lm_head: str


FLOAT_FORMATS = {"bf16": "bfloat16", "float16": "float16", "float32": "float32"}  # format -> its dtype
FORMATS: dict[str, WeightFormat | None] = {  # None: every tensor in the format's float dtype
    **{name: None for name in FLOAT_FORMATS},
    "int8": WeightFormat("int8", "int8", "int8"),
    "q8_0": WeightFormat("int8", "int8", "int8"),
    "int4": WeightFormat("q4_1", "int8", "int8"),
    "q4_0": WeightFormat("q4_0", "q4_0", "q4_0"),
    "q4_1": WeightFormat("q4_1", "q4_1", "q4_1"),
}
WEIGHT_FORMATS = tuple(FORMATS)


def preset_config(name: str) -> ModelConfig:
    """The `ModelConfig` of preset `name` (a key of `PRESETS`); ModelFileNotFoundError listing them otherwise."""
    return _preset(name).config


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ModelFileNotFoundError(f"unknown preset {name!r} (preset:NAME or preset:NAME@FORMAT); the presets "
                                     f"are: {', '.join(PRESETS)}")
    return PRESETS[name]


def parse_source(source: str) -> tuple[str, str | None]:
    """`"preset:NAME"` or `"preset:NAME@FORMAT"` -> (NAME, FORMAT or None), both checked."""
    name, at, fmt = source[len(PREFIX):].partition("@")
    _preset(name)
    if at:  # "preset:NAME@" names no format: an error, as any unknown format is
        check_format(fmt)
    return name, fmt or None


def is_preset_source(source: object) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def check_format(weights: str) -> str:
    if weights not in FORMATS:
        raise InvalidLoadOptionError(f"weight format {weights!r} is not known; use one of {', '.join(FORMATS)}")
    return weights


def float_dtype(weights: str, dtype: str) -> str:
    """The dtype of format `weights`' float tensors: a float format's own, else `dtype` (checked)."""
    if check_format(weights) in FLOAT_FORMATS:
        return FLOAT_FORMATS[weights]
    if dtype not in FLOAT_FORMATS.values():
        raise InvalidLoadOptionError(f"dtype={dtype!r} is not supported; use one of "
                                     f"{', '.join(FLOAT_FORMATS.values())}")
    return dtype


def float_format(dtype: str) -> str:
    """The float weight format of `dtype` ("bfloat16" -> "bf16")."""
    return {v: k for k, v in FLOAT_FORMATS.items()}[dtype]


# --------------------------------------------------------------------------------------------- counting
def _matrices(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """Every weight matrix as (role, count, in, out); role is a `WeightFormat` field: "projections" (per layer,
    `count` = layers), "embed", "lm_head"."""
    h, f, d, n = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    out = [("projections", n, h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d),
           ("projections", n, cfg.num_heads * d, h), ("projections", n, h, 2 * f), ("projections", n, f, h),
           ("embed", 1, h, cfg.vocab_size)]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head", 1, h, cfg.vocab_size))
    return out


def _vectors(cfg: ModelConfig) -> int:
    """Elements of the tensors that are never quantized: the norms and the biases."""
    h, f, d, n = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    per_layer = 2 * h  # attention and MLP norms
    per_layer += (cfg.num_heads + 2 * cfg.num_kv_heads) * d if cfg.qkv_bias else 0
    per_layer += h if cfg.o_bias else 0
    per_layer += 2 * f + h if cfg.mlp_bias else 0
    return n * per_layer + h  # + the final norm


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of `cfg`: the embedding, an untied LM head, every layer's q/k/v/o and MLP matrices, biases and
    norms, and the final norm (a tied LM head counts once)."""
    return sum(count * k * n for _, count, k, n in _matrices(cfg)) + _vectors(cfg)


def _quantized_bytes(kind: str, k: int, n: int) -> int:
    """Resident bytes of one QuantizedArray `[k, n]` in groups of GROUP_SIZE: values, float16 scales (and mins)."""
    values = k * n // 2 if kind in Q4_KINDS else k * n
    groups = k // GROUP_SIZE * n
    return values + 2 * groups * (2 if kind == "q4_1" else 1)


def weight_bytes(cfg: ModelConfig, weights: str = "bf16", *, dtype: str = "bfloat16") -> int:
    """Resident bytes of `cfg`'s weights in format `weights` (WEIGHT_FORMATS), as this framework stores them: a
    quantized matrix is its values (one byte per element for int8, half a byte for Q4), a float16 scale per 32
    input rows and output column, and for Q4_1 a float16 min as well. The norms and biases stay float, in `dtype`
    (the float formats name their own dtype)."""
    fmt, vec = FORMATS[check_format(weights)], jnp.dtype(float_dtype(weights, dtype)).itemsize
    if fmt is None:
        return parameter_count(cfg) * vec
    mats = sum(count * _quantized_bytes(getattr(fmt, role), k, n) for role, count, k, n in _matrices(cfg))
    return mats + _vectors(cfg) * vec


# ------------------------------------------------------------------------------------------- random weights
def random_weights(cfg: ModelConfig, weights: str = "bf16", *, seed: int = 0, dtype: str = "bfloat16") -> Weights:
    """Random `Weights` of `cfg` in format `weights`, generated on the default device (see the module docstring);
    the float tensors of a quantized format in `dtype`. Their bytes are `weight_bytes(cfg, weights, dtype=dtype)`."""
    fmt, fdtype = FORMATS[check_format(weights)], jnp.dtype(float_dtype(weights, dtype))
    for role, _, k, _ in _matrices(cfg):
        if fmt is not None and k % GROUP_SIZE:
            raise InvalidLoadOptionError(f"{weights}: the {role} has {k} input rows, not a multiple of the "
                                         f"{GROUP_SIZE}-row quantization group")
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    h, f, d, n = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    nqkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d

    def matrix(kind: str | None, k: int, out: int, layers: int | None = n):
        """A `[layers, k, out]` stack (layers=None: one `[k, out]` matrix), float or quantized `kind`."""
        key = next(keys)
        if kind is None:
            return _normal(key, (k, out), fdtype, layers)
        values, scales, mins = _quantized(key, kind, k, out, layers)
        return QuantizedArray(values=values, scales=scales, mins=mins, kind=kind, group_size=GROUP_SIZE,
                              shape=(k, out))

    proj = None if fmt is None else fmt.projections
    def bias(width: int, present: bool):
        return _normal(next(keys), (width,), fdtype, n) if present else None

    ones = functools.partial(jnp.ones, dtype=fdtype)
    layers = LayerWeights(
        attn_norm=ones((n, h)),
        wqkv=matrix(proj, h, nqkv),
        wo=matrix(proj, cfg.num_heads * d, h),
        mlp_norm=ones((n, h)),
        w_gate_up=matrix(proj, h, 2 * f),
        w_down=matrix(proj, f, h),
        bqkv=bias(nqkv, cfg.qkv_bias),
        bo=bias(h, cfg.o_bias),
        b_gate_up=bias(2 * f, cfg.mlp_bias),
        b_down=bias(h, cfg.mlp_bias),
    )
    if fmt is None:
        embed = _normal(next(keys), (cfg.vocab_size, h), fdtype, None)  # [V, H]
    else:
        embed = matrix(fmt.embed, h, cfg.vocab_size, None)  # quantized embeddings are stored as the LM head [H, V]
    head = None if cfg.tie_word_embeddings else matrix(None if fmt is None else fmt.lm_head, h, cfg.vocab_size, None)
    return Weights(embed=embed, layers=layers, final_norm=ones((h,)), lm_head=head)


def _per_layer(fn, key: jax.Array, layers: int | None):
    """`fn(key)`, or its results for `layers` keys stacked on a new leading axis (one layer at a time)."""
    if layers is None:
        return fn(key)
    return jax.lax.map(fn, jax.random.split(key, layers))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "layers"))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype, layers: int | None) -> jnp.ndarray:
    return _per_layer(lambda k: (STD * jax.random.normal(k, shape, jnp.float32)).astype(dtype), key, layers)


# standard deviation of the quants drawn below: int8 -127..127 with 0 twice as likely; q4_1 0..15; q4_0 1..15 with 8
# twice as likely
_QUANT_STD = {"int8": (sum(q * q for q in range(-127, 128)) / 256) ** 0.5, "q4_1": ((16**2 - 1) / 12) ** 0.5,
              "q4_0": (sum((q - 8) ** 2 for q in range(1, 16)) / 16) ** 0.5}


@functools.partial(jax.jit, static_argnames=("kind", "k", "out", "layers"))
def _quantized(key: jax.Array, kind: str, k: int, out: int, layers: int | None):
    """Random (values, scales, mins) of a `[k, out]` QuantizedArray (stacked over `layers`): uniform quants of mean
    0 (Q4_1: mean 7.5, centred by its mins), float16 scales that give the dequantized values standard deviation STD
    (within +-25% per group)."""
    def one(key):
        kv, ks = jax.random.split(key)
        if kind in Q4_KINDS:
            b = jax.random.bits(kv, (k // 2, out), jnp.uint8)  # two uniform nibbles per byte
            if kind == "q4_0":  # q - 8 must have mean 0, or the offset adds up over the rows into huge activations
                lo, hi = b & 15, b >> 4
                b = jnp.where(lo == 0, 8, lo) | (jnp.where(hi == 0, 8, hi) << 4)
            values = b.astype(jnp.uint8)
        else:
            values = jax.lax.bitcast_convert_type(jax.random.bits(kv, (k, out), jnp.uint8), jnp.int8)
            values = jnp.where(values == -128, 0, values).astype(jnp.int8)  # -127..127, mean 0
        jitter = jax.random.uniform(ks, (k // GROUP_SIZE, out), jnp.float32, 0.75, 1.25)
        scales = (STD / _QUANT_STD[kind] * jitter).astype(jnp.float16)
        mins = (-7.5 * scales.astype(jnp.float32)).astype(jnp.float16) if kind == "q4_1" else None
        return values, scales, mins

    return _per_layer(one, key, layers)
