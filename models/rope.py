"""Rotary position embeddings (HF "rotate half" layout) with default, linear and llama3 frequency scaling, and a
GGUF's per-frequency divisors (`RopeScaling.freq_factors`)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.invariant import opaque_zero, rounded


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
    if rs.freq_factors is not None:
        inv = inv / np.asarray(rs.freq_factors, dtype=np.float64)
    return inv


def rope_cos_sin(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin tables `[N, head_dim]` for int positions `[N]`."""
    inv = jnp.asarray(inv_frequencies(cfg), jnp.float32)  # [D/2]
    freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]  # [N, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [N, D]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x: `[N, heads, D]`; cos/sin: `[N, D]`. `x * cos + rotate_half(x) * sin` in float32, each product rounded
    before the sum (as HF's torch ops compute it) in every program: `models.invariant.rounded`. (Left to LLVM, a decode
    step's rotated keys were fused into a multiply-add and a verification row's were not, and greedy speculation on
    the native CPU kernels parted from plain decoding at near-ties: 9 of 16 SmolLM2 copy prompts.)"""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    c, s = cos.astype(jnp.float32)[:, None, :], sin.astype(jnp.float32)[:, None, :]
    zero = opaque_zero(c)
    return (rounded(xf * c, zero) + rounded(rotated * s, zero)).astype(x.dtype)
