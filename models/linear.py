"""The single entry point for weight matmuls, so quantized weight formats plug in at one place."""

from __future__ import annotations

import jax.numpy as jnp


def matmul(x: jnp.ndarray, w, bias: jnp.ndarray | None = None) -> jnp.ndarray:
    """`x @ w (+ bias)` with float32 accumulation. x: `[N, in]`; w: `[in, out]`."""
    y = jnp.dot(x, w.astype(x.dtype) if w.dtype != x.dtype else w, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
