"""The column layout of the fused projections (`wqkv` = [q | k | v], `w_gate_up` = [gate | up]), plain or grouped.

Plain (`groups == 1`, how the loaders build them): the parts side by side. Grouped by `g` (tensor parallelism over
`g` devices, `paged.device.sharding`): every part cut into `g` equal slices and the slices interleaved by group,
`[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`, so that an even split of the columns over `g` devices hands device `s` exactly
its own query heads, KV heads (or intermediate features) of every part, and the matmul's output splits into the parts
without any exchange between devices. `LayerWeights.fused_groups` says which layout a model's weights are in; the
layer splits its fused outputs with `split_columns` accordingly.

Which weights a tensor-parallel mesh splits, and how (`tp_split`): the fused projections by columns ("col"), the
attention output and MLP down projections by rows ("row", their partial products summed over the devices). A
quantized matrix splits by rows only along whole quantization groups (`rows_split`); otherwise it stays whole.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_kernels.native import activation_block
from pallas_kernels.quant_format import Q4_KINDS, LayerSlice, QuantizedArray

# LayerWeights field -> how tensor parallelism splits it: "col" (output features) or "row" (input features)
TP_SPLIT = {"wqkv": "col", "w_gate_up": "col", "wo": "row", "w_down": "row"}


def qkv_parts(cfg: Any) -> tuple[int, int, int]:
    """Column counts of q, k and v in `wqkv`."""
    d = cfg.head_dim
    return cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d


def gate_up_parts(cfg: Any) -> tuple[int, int]:
    """Column counts of gate and up in `w_gate_up`."""
    return cfg.intermediate_size, cfg.intermediate_size


def grouped_order(parts: tuple[int, ...], groups: int) -> np.ndarray:
    """Column indices such that `grouped[..., i] == plain[..., order[i]]`. Every part must divide by `groups`."""
    if any(p % groups for p in parts):
        raise ValueError(f"every part of {parts} must divide into {groups} groups")
    starts = np.cumsum((0, *parts[:-1]))
    return np.concatenate([np.arange(s + g * (p // groups), s + (g + 1) * (p // groups))
                           for g in range(groups) for s, p in zip(starts, parts, strict=True)]).astype(np.int32)


def group_columns(a: Any, parts: tuple[int, ...], groups: int) -> Any:
    """A fused weight `[..., in, out]` (float or `QuantizedArray`; or its bias `[..., out]`; or None), grouped."""
    if a is None or groups == 1:
        return a
    order = grouped_order(parts, groups)
    if isinstance(a, QuantizedArray):
        from models.quant import select_out

        return select_out(a, order)
    return jnp.take(a, jnp.asarray(order), axis=-1)


def split_columns(y: jnp.ndarray, parts: tuple[int, ...], groups: int) -> list[jnp.ndarray]:
    """The parts `[N, p]` (each in its plain column order) of a fused matmul output `y` `[N, sum(parts)]` laid out
    with `groups` groups."""
    n = y.shape[0]
    if groups == 1:
        bounds = np.cumsum((0, *parts))
        return [y[:, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    g = y.reshape(n, groups, sum(parts) // groups)
    bounds = np.cumsum((0, *(p // groups for p in parts)))
    return [g[:, :, a:b].reshape(n, p) for a, b, p in zip(bounds[:-1], bounds[1:], parts, strict=True)]


def rows_split(w: Any, tp: int) -> bool:
    """Whether matrix `w` (`[..., in, out]`, float or quantized) can be split by rows over `tp` devices: a float one
    whenever `tp` divides `in`; a quantized one only along whole groups (its scales split with its values), or
    per-channel int8 whose shards are whole activation blocks (the scales, one row, stay whole)."""
    qa = w.stacked if isinstance(w, LayerSlice) else w
    rows = qa.shape[0] if isinstance(qa, QuantizedArray) else w.shape[-2]
    if tp == 1 or rows % tp:
        return False
    if not isinstance(qa, QuantizedArray):
        return True
    if qa.num_groups == 1:  # per-channel int8: its one row of scales stays whole; each shard keeps whole
        # activation blocks (the native kernel gives every 32 inputs one int8 scale), so it computes what one
        # device computes for those rows
        return qa.kind not in Q4_KINDS and (rows // tp) % activation_block(qa) == 0
    return qa.num_groups % tp == 0
