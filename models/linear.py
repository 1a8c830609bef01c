"""The single entry point for weight matmuls, so quantized weight formats plug in at one place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.fused import rows_split
from pallas_kernels.dequant_matmul import IMPLS, dequant_matmul
from pallas_kernels.quant_format import LayerSlice, QuantizedArray

MATMUL_IMPLS = IMPLS  # "auto", "xla", "pallas", "reference": the dequant-matmul implementations


def matmul(
    x: jnp.ndarray,  # [N, in]
    w: jnp.ndarray | QuantizedArray | LayerSlice,  # [in, out]
    bias: jnp.ndarray | None = None,  # [out]
    *,
    impl: str = "auto",
    split: str | None = None,
) -> jnp.ndarray:  # [N, out], x's dtype
    """`x @ w (+ bias)` with float32 accumulation. x: `[N, in]`; w: `[in, out]` float, or a `QuantizedArray`
    standing for one (then `impl` picks the dequant-matmul: "auto", "xla", "pallas", "reference").

    split: how a tensor-parallel mesh splits `w` ("col", "row"; `models.fused.TP_SPLIT`). A quantized layer matmul
    under a mesh runs per device on its shard of `w` and of the tokens (`per_device`), since a kernel's custom call
    cannot be partitioned by XLA; float matmuls are left to XLA's partitioner."""
    if isinstance(w, (QuantizedArray, LayerSlice)):
        tp, dp = _mesh_sizes()
        how = split if split is not None and tp > 1 and (split == "col" or rows_split(w, tp)) else None
        if how is not None or (split is not None and dp > 1 and x.shape[0] % dp == 0):
            y = per_device(x, w, how, impl)
        else:
            y = dequant_matmul(x, w, impl=impl)
    else:
        y = jnp.dot(x, w.astype(x.dtype) if w.dtype != x.dtype else w, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _mesh_sizes() -> tuple[int, int]:
    """(tp, dp) of the mesh in context; (1, 1) without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1, 1
    return tuple(mesh.shape[a] if a in mesh.axis_names else 1 for a in ("tp", "dp"))


def per_device(x: jnp.ndarray, w: QuantizedArray | LayerSlice, split: str | None, impl: str) -> jnp.ndarray:
    """The quantized matmul `x @ w` -> float32 `[N, out]` run by each device of the mesh on its share (a
    `shard_map`): split "col", each device of `tp` computes its output columns (the result stays split by column);
    "row", each multiplies its slice of `x`'s features by its rows and the partial products are summed over `tp`;
    None, `w` is whole on every device. The tokens are split over `dp` too when the mesh has it and they divide
    evenly. The shards are whole quantization groups (`models.fused.rows_split`), so each is a `QuantizedArray` of
    its own, with its own shape."""
    mesh = jax.sharding.get_abstract_mesh()
    tp, dp = _mesh_sizes()
    tokens = "dp" if dp > 1 and x.shape[0] % dp == 0 else None
    stacked, layer = (w.stacked, w.layer) if isinstance(w, LayerSlice) else (w, None)
    k, n = stacked.shape
    lead = (None,) * len(stacked.batch_shape)
    if split is None:
        leaf = scale_spec = P()
        x_spec = out_spec = P(tokens, None)
        local = stacked
    elif split == "col":
        leaf, x_spec, out_spec = P(*lead, None, "tp"), P(tokens, None), P(tokens, "tp")
        local = stacked.replace(shape=(k, n // tp))
        scale_spec = leaf
    else:
        leaf, x_spec, out_spec = P(*lead, "tp", None), P(tokens, "tp"), P(tokens, None)
        per_channel = stacked.num_groups == 1
        local = stacked.replace(shape=(k // tp, n), group_size=k // tp if per_channel else stacked.group_size)
        scale_spec = P() if per_channel else leaf
    specs = stacked.replace(values=leaf, scales=scale_spec, mins=None if stacked.mins is None else scale_spec)

    def run(x, qa, *layer):
        qa = local.replace(values=qa.values, scales=qa.scales, mins=qa.mins)
        y = dequant_matmul(x, LayerSlice(qa, layer[0]) if layer else qa, impl=impl)
        return jax.lax.psum(y, "tp") if split == "row" else y

    args = (x, stacked) if layer is None else (x, stacked, layer)
    in_specs = (x_spec, specs) if layer is None else (x_spec, specs, P())
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*args)
