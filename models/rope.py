"""Rotary position embeddings (HF "rotate half" layout) with default, linear and llama3 frequency scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies `[head_dim // 2]` (float64 numpy, computed once at trace time)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_wavelen = old_len / rs.low_freq_factor
        high_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin tables `[N, head_dim]` for int positions `[N]`."""
    inv = jnp.asarray(inv_frequencies(cfg), jnp.float32)  # [D/2]
    freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]  # [N, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [N, D]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x: `[N, heads, D]`; cos/sin: `[N, D]` float32. `x * cos + rotate_half(x) * sin` in float32 with each product
    rounded before the sum, as HF's torch ops compute it, in every program (see `_rounded_product`)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    c, s = cos.astype(jnp.float32)[:, None, :], sin.astype(jnp.float32)[:, None, :]
    return (_rounded_product(xf, c, c) + _rounded_product(rotated, s, c)).astype(x.dtype)


def _rounded_product(a: jnp.ndarray, b: jnp.ndarray, cos: jnp.ndarray) -> jnp.ndarray:
    """a * b (float32), rounded to float32 whatever the compiler fuses it with.

    Left to itself, LLVM may contract `a * b + c * d` into a fused multiply-add (one rounding fewer), and whether it
    does depends on the loop XLA emits around it: on the CPU a decode step writes a token's rotated key in an in-place
    update of the cache and a verification step computes its rows' keys in a loop of their own, so the same token at
    the same position got keys a rounding apart. The native kernel's int8 activations turn such a difference into
    whole quantization steps, and greedy decoding with speculation then parted from plain greedy decoding at
    near-ties (9 of 16 SmolLM2 copy prompts). ORing the product's bits with bit 30 of a cosine (always 0: |cos| <= 1
    keeps the exponent below 128), which the compiler cannot prove zero, leaves the value alone and leaves no
    multiply for an add to absorb."""
    zero = lax.bitcast_convert_type(cos, jnp.int32) & jnp.int32(0x40000000)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(a * b, jnp.int32) | zero, jnp.float32)
