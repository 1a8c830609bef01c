"""The `pallas_call` both Pallas dequant-matmuls make (`dequant_matmul.dequant_matmul_pallas`, the tensor-core kernel,
and `dequant_gemv.dequant_gemv_pallas`, the GEMV): grid (row blocks, output blocks, input splits); each program gets
its x block (the caller's spec: x as it is, or transposed), its share of `in` of the quantized matrix's values,
scales (per-channel: the one row) and Q4_1 mins, and writes its split's float32 partial; the partials are summed
outside."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.quant_format import QuantizedArray


def quant_pallas_call(kernel: Callable, x_operand: jnp.ndarray, x_spec: pl.BlockSpec, qa: QuantizedArray, *,
                      n_pad: int, rows: int, block_out: int, split_in: int, interpret: bool, num_warps: int,
                      num_stages: int, name: str) -> jnp.ndarray:
    """float32 `[n_pad, out]`: `kernel(x_ref, v_ref, s_ref, [m_ref,] o_ref)` over the grid (`n_pad / rows`,
    `out / block_out`, `split_in`), `x_spec` indexed by (row block, output block, split)."""
    k, out = qa.shape
    k_split = k // split_in
    rows_split = k_split // 2 if qa.kind != "int8" else k_split
    groups_split = 1 if qa.per_channel else k_split // qa.group_size
    scale_map = (lambda i, j, s: (0, j)) if qa.per_channel else (lambda i, j, s: (s, j))
    in_specs = [
        x_spec,
        pl.BlockSpec((rows_split, block_out), lambda i, j, s: (s, j)),
        pl.BlockSpec((groups_split, block_out), scale_map),
    ]
    operands = [x_operand, qa.values, qa.scales]
    if qa.kind == "q4_1":
        in_specs.append(pl.BlockSpec((groups_split, block_out), scale_map))
        operands.append(qa.mins)
    compiler_params = None
    if not interpret:  # name the Triton backend: left unnamed, jax may pick Mosaic GPU, which these kernels do not fit
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    partials = pl.pallas_call(
        kernel,
        grid=(n_pad // rows, out // block_out, split_in),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, rows, block_out), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((split_in, n_pad, out), jnp.float32),
        interpret=interpret,
        compiler_params=compiler_params,
        name=name,
    )(*operands)  # [split_in, n_pad, out]
    return partials[0] if split_in == 1 else jnp.sum(partials, axis=0)
