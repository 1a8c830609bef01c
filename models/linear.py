"""The single entry point for weight matmuls, so quantized weight formats plug in at one place."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.dequant_matmul import IMPLS, dequant_matmul
from pallas_kernels.quant_format import LayerSlice, QuantizedArray

MATMUL_IMPLS = IMPLS  # "auto", "xla", "pallas", "reference": the dequant-matmul implementations


def matmul(
    x: jnp.ndarray,  # [N, in]
    w: jnp.ndarray | QuantizedArray | LayerSlice,  # [in, out]
    bias: jnp.ndarray | None = None,  # [out]
    *,
    impl: str = "auto",
) -> jnp.ndarray:  # [N, out], x's dtype
    """`x @ w (+ bias)` with float32 accumulation. x: `[N, in]`; w: `[in, out]` float, or a `QuantizedArray`
    standing for one (then `impl` picks the dequant-matmul: "auto", "xla", "pallas", "reference")."""
    if isinstance(w, (QuantizedArray, LayerSlice)):
        y = dequant_matmul(x, w, impl=impl)
    else:
        y = jnp.dot(x, w.astype(x.dtype) if w.dtype != x.dtype else w, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
