"""The quantized-weight format the kernels consume: the `QuantizedArray` pytree and `dequantize`.

This is the contract between the layers: `models/quant.py` produces `QuantizedArray`s (round-to-nearest quantization
at load time, lossless GGUF block import, stack/concat/select), the kernels in `pallas_kernels/` consume them. It lives
on the kernels' side so that `pallas_kernels` depends on jax and numpy only (see docs/architecture.md, "Layers").

A `QuantizedArray` stands for a logical float matrix `[in, out]`, the orientation `models.linear.matmul` uses
(`x @ w`). Quantization groups run along `in`: every `group_size` consecutive input rows of one output column share a
scale (and, for "q4_1", a min). That is the GGUF/llama.cpp grouping, so GGUF blocks import without requantizing.

Kinds (value of one element `q` of group `g`, column `o`):
    "q4_1"  q in 0..15   value = q * scales[g, o] + mins[g, o]     (asymmetric, like GGUF Q4_1)
    "q4_0"  q in 0..15   value = (q - 8) * scales[g, o]            (symmetric, like GGUF Q4_0)
    "int8"  q in -127..127  value = q * scales[g, o]               (like GGUF Q8_0; group_size == in is per-channel)

Physical layout (leaves; any leading axes are stacking axes, e.g. layers):
    values  q4: uint8 `[..., in/2, out]`, two elements per byte; int8: int8 `[..., in, out]`
    scales  `[..., in/group_size, out]` (float16 by default, as in GGUF; float32 allowed)
    mins    `[..., in/group_size, out]` for "q4_1", else None

Why `[in, out]` with `out` minor, and not GGUF's `[out, in]` rows:
- XLA:CPU. The fastest CPU formulation is "dequantize to a float matrix, then one dot" (grouped partial dots are ~9x
  slower). Dequantizing into `[in, out]` hands the dot the same operand an fp32 weight would be; measured, an
  `[out, in]` layout contracted on its minor axis (or a fused multiply-reduce) was 2-4x slower than the `[in, out]`
  one at every shape tried.
- The output axis stays free: fusing q/k/v or gate/up (`concat_out`) is a plain concatenation of every leaf, and a
  kernel tiles `out` with no constraint from the packing.
- A GPU kernel tile `[block_in, block_out]` is a contiguous slab of rows; its scales are the `block_in/group_size`
  rows of `scales` above it, loaded as `[rows, block_out]` rows that broadcast over the tile.
Nibble order inside a group follows GGUF: packed row `g*group_size/2 + j` holds element `j` of group `g` in its low
nibble and element `j + group_size/2` in its high nibble. So a GGUF block's 16 quant bytes are one column of 16 packed
rows, and unpacking a group is two contiguous half-groups (`p & 15`, `p >> 4`) -- no interleaving shuffle.

Static metadata (`kind`, `group_size`, `shape`) is kept out of the leaves, so `jax.tree.map(lambda a: a[i], qa)`
slices layer `i` of a stacked array, and `lax.scan` over stacked weights hands the body per-layer arrays.
`shape` is the logical `(in, out)` of ONE matrix; stacking axes are `qa.batch_shape`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("q4_1", "q4_0", "int8")
Q4_KINDS = ("q4_1", "q4_0")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "scales", "mins"],
    meta_fields=["kind", "group_size", "shape"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A quantized stand-in for a float matrix `[in, out]` (see the module docstring for the layout)."""

    values: jnp.ndarray  # q4: uint8 [..., in/2, out]; int8: int8 [..., in, out]
    scales: jnp.ndarray  # [..., in/G, out]
    mins: jnp.ndarray | None  # [..., in/G, out] for "q4_1"; None otherwise
    kind: str  # static
    group_size: int  # static
    shape: tuple[int, int]  # static: logical (in, out) of one matrix

    def replace(self, **changes) -> QuantizedArray:
        """A copy with the given fields replaced (leaves or metadata)."""
        return dataclasses.replace(self, **changes)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading stacking axes (e.g. `(num_layers,)`); `()` for a single matrix."""
        return tuple(self.values.shape[:-2])

    @property
    def num_groups(self) -> int:
        return self.shape[0] // self.group_size

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.shape[0]

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype `dequantize` produces."""
        return jnp.dtype(jnp.float32)

    def __repr__(self) -> str:
        return (
            f"QuantizedArray(kind={self.kind!r}, shape={self.shape}, group_size={self.group_size}, "
            f"batch_shape={self.batch_shape}, scales={jnp.dtype(self.scales.dtype).name})"
        )


@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Matrix `layer` (an int32 scalar, possibly traced) of a stacked `QuantizedArray` `[L, ...]`, not yet sliced:
    a kernel that can read one matrix of a stack in place takes `stacked` and `layer` (`dequant_matmul` does that
    for the native CPU kernel); everything else calls `get()`."""

    stacked: QuantizedArray
    layer: jnp.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.stacked.shape

    @property
    def kind(self) -> str:
        return self.stacked.kind

    def get(self) -> QuantizedArray:
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, 0, keepdims=False), self.stacked)


def check(qa: QuantizedArray) -> QuantizedArray:
    """Raise ValueError unless the leaves agree with the static metadata; return `qa`."""
    if qa.kind not in KINDS:
        raise ValueError(f"unknown quantization kind {qa.kind!r}; expected one of {KINDS}")
    k, n = qa.shape
    g = qa.group_size
    if g < 1 or k % g:
        raise ValueError(f"group_size={g} must be positive and divide in={k}")
    rows = k // 2 if qa.kind in Q4_KINDS else k
    want = jnp.uint8 if qa.kind in Q4_KINDS else jnp.int8
    if tuple(qa.values.shape[-2:]) != (rows, n) or qa.values.dtype != want:
        raise ValueError(
            f"{qa.kind} values must be {jnp.dtype(want).name} [..., {rows}, {n}] for shape={qa.shape}; "
            f"got {qa.values.dtype} {tuple(qa.values.shape)}"
        )
    lead = tuple(qa.values.shape[:-2])
    if tuple(qa.scales.shape) != (*lead, k // g, n):
        raise ValueError(f"scales must be [{', '.join(map(str, (*lead, k // g, n)))}]; got {tuple(qa.scales.shape)}")
    if (qa.mins is None) != (qa.kind != "q4_1"):
        raise ValueError(f"mins must be given for q4_1 and only for q4_1 (kind={qa.kind!r})")
    if qa.mins is not None and tuple(qa.mins.shape) != tuple(qa.scales.shape):
        raise ValueError(f"mins shape {tuple(qa.mins.shape)} != scales shape {tuple(qa.scales.shape)}")
    return qa


def pack_q4(q: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """int quants `[in, out]` in 0..15 -> uint8 `[in/2, out]` (low nibble: first half of each group)."""
    k, n = q.shape
    qg = q.astype(jnp.uint8).reshape(k // group_size, 2, group_size // 2, n)
    return (qg[:, 0] | (qg[:, 1] << 4)).reshape(k // 2, n)


def unpack_q4(values: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """uint8 `[..., in/2, out]` -> uint8 quants `[..., in/G, G, out]` in 0..15 (the inverse of `pack_q4`)."""
    *lead, half, n = values.shape
    p = values.reshape(*lead, 2 * half // group_size, group_size // 2, n)
    return jnp.concatenate([p & 15, p >> 4], axis=-2)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(qa: QuantizedArray, dtype=jnp.float32) -> jnp.ndarray:
    """The float matrix `[..., in, out]` that `qa` stands for (computed in float32, then cast to `dtype`).

    For GGUF-imported arrays this equals `gguf.quants.dequantize(...)` transposed, bit for bit: the same float32
    products (and sums) in the same order.
    """
    *lead, _, n = qa.values.shape
    k, g = qa.shape[0], qa.group_size
    s = qa.scales.astype(jnp.float32)[..., :, None, :]  # [..., in/G, 1, out]
    if qa.kind in Q4_KINDS:
        q = unpack_q4(qa.values, g).astype(jnp.float32)  # [..., in/G, G, out]
        if qa.kind == "q4_1":
            w = q * s + qa.mins.astype(jnp.float32)[..., :, None, :]
        else:
            w = (q - 8.0) * s
    else:
        w = qa.values.reshape(*lead, k // g, g, n).astype(jnp.float32) * s
    return w.reshape(*lead, k, n).astype(dtype)


def random_quantized(rng: np.random.Generator, kind: str, group_size: int | None, k: int, out: int) -> QuantizedArray:
    """A `QuantizedArray` `[k, out]` of random quants and scales (float16, as GGUF), every bit pattern of the format
    in use (no quantizer involved)."""
    g = k if group_size is None else group_size
    scales = jnp.asarray(rng.uniform(0.002, 0.02, size=(k // g, out)).astype(np.float16))
    if kind in Q4_KINDS:
        q = jnp.asarray(rng.integers(0, 16, size=(k, out)), jnp.int32)
        mins = jnp.asarray(rng.uniform(-0.1, 0.0, size=(k // g, out)).astype(np.float16)) if kind == "q4_1" else None
        return QuantizedArray(values=pack_q4(q, g), scales=scales, mins=mins, kind=kind, group_size=g, shape=(k, out))
    if kind != "int8":
        raise ValueError(f"unknown kind {kind!r}")
    q = jnp.asarray(rng.integers(-127, 128, size=(k, out)), jnp.int8)
    return QuantizedArray(values=q, scales=scales, mins=None, kind=kind, group_size=g, shape=(k, out))
