"""Group-quantized weight matrices: `QuantizedArray`, round-to-nearest quantizers, and lossless GGUF block import.

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

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

KINDS = ("q4_1", "q4_0", "int8")
_Q4_KINDS = ("q4_1", "q4_0")
GGUF_BLOCK = 32  # elements per GGUF Q4_0/Q4_1/Q8_0 block


@struct.dataclass
class QuantizedArray:
    """A quantized stand-in for a float matrix `[in, out]` (see the module docstring for the layout)."""

    values: jnp.ndarray  # q4: uint8 [..., in/2, out]; int8: int8 [..., in, out]
    scales: jnp.ndarray  # [..., in/G, out]
    mins: jnp.ndarray | None  # [..., in/G, out] for "q4_1"; None otherwise
    kind: str = struct.field(pytree_node=False)
    group_size: int = struct.field(pytree_node=False)
    shape: tuple[int, int] = struct.field(pytree_node=False)  # logical (in, out) of one matrix

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
    def dtype(self):
        """The dtype `dequantize` produces."""
        return jnp.dtype(jnp.float32)

    def __repr__(self) -> str:
        return (
            f"QuantizedArray(kind={self.kind!r}, shape={self.shape}, group_size={self.group_size}, "
            f"batch_shape={self.batch_shape}, scales={jnp.dtype(self.scales.dtype).name})"
        )


def check(qa: QuantizedArray) -> QuantizedArray:
    """Raise ValueError unless the leaves agree with the static metadata; return `qa`."""
    if qa.kind not in KINDS:
        raise ValueError(f"unknown quantization kind {qa.kind!r}; expected one of {KINDS}")
    k, n = qa.shape
    g = qa.group_size
    if g < 1 or k % g:
        raise ValueError(f"group_size={g} must be positive and divide in={k}")
    rows = k // 2 if qa.kind in _Q4_KINDS else k
    want = jnp.uint8 if qa.kind in _Q4_KINDS else jnp.int8
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


# ---------------------------------------------------------------------------------------------------- quantize
def quantize(w: jnp.ndarray, kind: str, group_size: int | None = 32, *, scale_dtype=jnp.float16) -> QuantizedArray:
    """Round-to-nearest quantization of a float matrix `w` `[in, out]` (groups of `group_size` along `in`).

    group_size=None means one group per column (per-channel); only "int8" allows it. q4 kinds need an even group
    size. Scales (and mins) are rounded to `scale_dtype` first and the quants computed against the rounded values,
    so the stored scale is the one the quants were fitted to.
    """
    w = jnp.asarray(w, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a matrix [in, out]; got shape {tuple(w.shape)}")
    if kind not in KINDS:
        raise ValueError(f"unknown quantization kind {kind!r}; expected one of {KINDS}")
    k, n = w.shape
    if group_size is None:
        if kind != "int8":
            raise ValueError(f"per-channel (group_size=None) is only supported for int8, not {kind!r}")
        group_size = k
    if group_size < 1 or k % group_size:
        raise ValueError(f"group_size={group_size} must be positive and divide in={k}")
    if kind in _Q4_KINDS and group_size % 2:
        raise ValueError(f"{kind} packs two elements per byte within a group; group_size={group_size} must be even")
    return _quantize(w, kind, group_size, jnp.dtype(scale_dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize(w: jnp.ndarray, kind: str, group_size: int, scale_dtype) -> QuantizedArray:
    k, n = w.shape
    wg = w.reshape(k // group_size, group_size, n)  # [in/G, G, out]

    def rounded(a):
        return a.astype(scale_dtype).astype(jnp.float32)

    def inv(d):
        return jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))

    mins = None
    if kind == "q4_1":
        lo, hi = wg.min(axis=1), wg.max(axis=1)  # [in/G, out]
        m = rounded(lo)
        d = rounded((hi - m) / 15.0)
        q = jnp.clip(jnp.round((wg - m[:, None]) * inv(d)[:, None]), 0, 15)
        mins = m.astype(scale_dtype)
    elif kind == "q4_0":
        # Like llama.cpp: the signed extreme maps to -8, so the full range -8..7 is used on the far side.
        idx = jnp.argmax(jnp.abs(wg), axis=1)[:, None]
        ext = jnp.take_along_axis(wg, idx, axis=1)[:, 0]
        d = rounded(ext / -8.0)
        q = jnp.clip(jnp.round(wg * inv(d)[:, None]) + 8, 0, 15)
    else:
        d = rounded(jnp.abs(wg).max(axis=1) / 127.0)
        q = jnp.clip(jnp.round(wg * inv(d)[:, None]), -127, 127)
    q = q.astype(jnp.int32).reshape(k, n)
    values = _pack_q4(q, group_size) if kind in _Q4_KINDS else q.astype(jnp.int8)
    return QuantizedArray(
        values=values, scales=d.astype(scale_dtype), mins=mins, kind=kind, group_size=group_size, shape=(k, n)
    )


def _pack_q4(q: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """int quants `[in, out]` in 0..15 -> uint8 `[in/2, out]` (low nibble: first half of each group)."""
    k, n = q.shape
    qg = q.astype(jnp.uint8).reshape(k // group_size, 2, group_size // 2, n)
    return (qg[:, 0] | (qg[:, 1] << 4)).reshape(k // 2, n)


def _unpack_q4(values: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """uint8 `[..., in/2, out]` -> uint8 quants `[..., in/G, G, out]` in 0..15."""
    *lead, half, n = values.shape
    p = values.reshape(*lead, 2 * half // group_size, group_size // 2, n)
    return jnp.concatenate([p & 15, p >> 4], axis=-2)


# -------------------------------------------------------------------------------------------------- dequantize
@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(qa: QuantizedArray, dtype=jnp.float32) -> jnp.ndarray:
    """The float matrix `[..., in, out]` that `qa` stands for (computed in float32, then cast to `dtype`).

    For GGUF-imported arrays this equals `gguf.quants.dequantize(...)` transposed, bit for bit: the same float32
    products (and sums) in the same order.
    """
    *lead, _, n = qa.values.shape
    k, g = qa.shape[0], qa.group_size
    s = qa.scales.astype(jnp.float32)[..., :, None, :]  # [..., in/G, 1, out]
    if qa.kind in _Q4_KINDS:
        q = _unpack_q4(qa.values, g).astype(jnp.float32)  # [..., in/G, G, out]
        if qa.kind == "q4_1":
            w = q * s + qa.mins.astype(jnp.float32)[..., :, None, :]
        else:
            w = (q - 8.0) * s
    else:
        w = qa.values.reshape(*lead, k // g, g, n).astype(jnp.float32) * s
    return w.reshape(*lead, k, n).astype(dtype)


def gather_out(qa: QuantizedArray, idx: jnp.ndarray) -> jnp.ndarray:
    """Dequantized output columns `idx` `[T]` as rows `[T, in]` float32, i.e. `dequantize(qa)[:, idx].T`.

    This is the embedding lookup of a tied embedding stored as the LM head `[H, V]`, without dequantizing `[H, V]`.
    Only for a single (unstacked) matrix.
    """
    if qa.batch_shape:
        raise ValueError(f"gather_out needs a single matrix; this one is stacked with batch_shape={qa.batch_shape}")
    cols = jax.tree.map(lambda a: jnp.take(a, idx, axis=-1), qa)  # every leaf [rows, T]
    return dequantize(cols.replace(shape=(qa.shape[0], int(idx.shape[0])))).T


def select_out(qa: QuantizedArray, idx) -> QuantizedArray:
    """The QuantizedArray of output columns `idx` (e.g. a row permutation of a GGUF q/k projection), still quantized.

    `idx` is a static index array (numpy or list); every leaf is gathered along its last axis.
    """
    idx = np.asarray(idx)
    if idx.ndim != 1 or (idx.size and (idx.min() < 0 or idx.max() >= qa.shape[1])):
        raise ValueError(f"select_out needs a 1-d index array within [0, {qa.shape[1]}); got shape {idx.shape}")
    sel = jax.tree.map(lambda a: jnp.take(a, jnp.asarray(idx), axis=-1), qa)
    return sel.replace(shape=(qa.shape[0], int(idx.size)))


def nbytes(qa: QuantizedArray) -> int:
    """Resident bytes of all leaves (values, scales, mins)."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(qa))


# ------------------------------------------------------------------------------------------- stack and concat
def _same_format(qas: Sequence[QuantizedArray], what: str) -> None:
    if not qas:
        raise ValueError(f"{what} needs at least one QuantizedArray")
    a = qas[0]
    for i, b in enumerate(qas[1:], 1):
        if (b.kind, b.group_size, b.scales.dtype) != (a.kind, a.group_size, a.scales.dtype):
            raise ValueError(
                f"{what}: array {i} is {b.kind}/group {b.group_size}/{b.scales.dtype}, array 0 is "
                f"{a.kind}/group {a.group_size}/{a.scales.dtype}; all must share kind, group size and scale dtype"
            )
        if b.batch_shape != a.batch_shape:
            raise ValueError(f"{what}: array {i} has batch_shape {b.batch_shape}, array 0 has {a.batch_shape}")


def stack(qas: Sequence[QuantizedArray]) -> QuantizedArray:
    """Stack same-shaped arrays along a new leading axis (e.g. layers, for `lax.scan`)."""
    _same_format(qas, "stack")
    for i, b in enumerate(qas):
        if b.shape != qas[0].shape:
            raise ValueError(f"stack: array {i} has shape {b.shape}, array 0 has {qas[0].shape}")
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *qas)


def concat_out(qas: Sequence[QuantizedArray]) -> QuantizedArray:
    """Concatenate along the output dimension (fused q/k/v or gate/up): `[in, o1] ++ [in, o2] -> [in, o1 + o2]`."""
    _same_format(qas, "concat_out")
    k = qas[0].shape[0]
    for i, b in enumerate(qas):
        if b.shape[0] != k:
            raise ValueError(f"concat_out: array {i} has in={b.shape[0]}, array 0 has in={k}")
    first = qas[0]
    values = jnp.concatenate([q.values for q in qas], axis=-1)
    scales = jnp.concatenate([q.scales for q in qas], axis=-1)
    mins = None if first.mins is None else jnp.concatenate([q.mins for q in qas], axis=-1)
    return QuantizedArray(
        values=values,
        scales=scales,
        mins=mins,
        kind=first.kind,
        group_size=first.group_size,
        shape=(k, sum(q.shape[1] for q in qas)),
    )


# ---------------------------------------------------------------------------------------------- GGUF import
def _gguf_blocks(raw: np.ndarray, shape_out_in: tuple[int, int], block_bytes: int, name: str) -> np.ndarray:
    """GGUF block bytes (`[out, n_blocks * block_bytes]`, or any shape with that many bytes) -> `[out, nb, bytes]`."""
    out, k = (int(d) for d in shape_out_in)
    if k % GGUF_BLOCK:
        raise ValueError(f"{name}: in={k} is not a multiple of the {GGUF_BLOCK}-element block")
    nb = k // GGUF_BLOCK
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.size != out * nb * block_bytes:
        raise ValueError(
            f"{name}: expected {out * nb * block_bytes} uint8 block bytes for shape [out={out}, in={k}] "
            f"({nb} blocks of {block_bytes} bytes per row); got {raw.dtype} array of shape {raw.shape}"
        )
    return raw.reshape(out, nb, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the 2 bytes on the last axis: `[..., 2]` uint8 -> `[...]` float16."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float16)


def _from_gguf_blocks(b: np.ndarray, values: np.ndarray, kind: str, mins: np.ndarray | None = None) -> QuantizedArray:
    """QuantizedArray `[in, out]` from GGUF blocks `b` `[out, nb, bytes]` (fp16 scale in bytes 0:2) and their
    `values` `[out, ...]` (and fp16 `mins` `[out, nb]`), each transposed to the `[..., out]` layout."""
    out, nb = b.shape[:2]
    t = lambda a: jnp.asarray(np.ascontiguousarray(a.T))
    return QuantizedArray(values=t(values), scales=t(_f16(b[:, :, 0:2])), mins=None if mins is None else t(mins),
                          kind=kind, group_size=GGUF_BLOCK, shape=(nb * GGUF_BLOCK, out))


def from_gguf_q4_1(raw_blocks: np.ndarray, shape_out_in: tuple[int, int]) -> QuantizedArray:
    """Q4_1 blocks (fp16 d, fp16 m, 16 quant bytes) of a `[out, in]` GGUF tensor -> QuantizedArray `[in, out]`."""
    b = _gguf_blocks(raw_blocks, shape_out_in, 20, "Q4_1")
    out, nb = b.shape[:2]
    return _from_gguf_blocks(b, b[:, :, 4:].reshape(out, nb * 16), "q4_1", _f16(b[:, :, 2:4]))  # values [in/2, out]


def from_gguf_q4_0(raw_blocks: np.ndarray, shape_out_in: tuple[int, int]) -> QuantizedArray:
    """Q4_0 blocks (fp16 d, 16 quant bytes) of a `[out, in]` GGUF tensor -> QuantizedArray `[in, out]`."""
    b = _gguf_blocks(raw_blocks, shape_out_in, 18, "Q4_0")
    out, nb = b.shape[:2]
    return _from_gguf_blocks(b, b[:, :, 2:].reshape(out, nb * 16), "q4_0")  # values [in/2, out]


def from_gguf_q8_0(raw_blocks: np.ndarray, shape_out_in: tuple[int, int]) -> QuantizedArray:
    """Q8_0 blocks (fp16 d, 32 int8) of a `[out, in]` GGUF tensor -> QuantizedArray "int8" `[in, out]`, group 32."""
    b = _gguf_blocks(raw_blocks, shape_out_in, 34, "Q8_0")
    out, nb = b.shape[:2]
    q = np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(out, nb * GGUF_BLOCK)
    return _from_gguf_blocks(b, q, "int8")  # values [in, out]


FROM_GGUF = {"Q4_1": from_gguf_q4_1, "Q4_0": from_gguf_q4_0, "Q8_0": from_gguf_q8_0}
