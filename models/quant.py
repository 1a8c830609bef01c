"""Model-side quantization: round-to-nearest quantizers for float weights at load time, lossless GGUF block import,
and the structural operations weight loading needs (stack layers, fuse outputs, select columns, embedding lookup).

The format itself -- the `QuantizedArray` pytree, its layout and nibble order, `check` and `dequantize` -- is the
kernels' input, so it lives in `pallas_kernels/quant_format.py`; import it from there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_format import KINDS, Q4_KINDS, QuantizedArray, dequantize, pack_q4

GGUF_BLOCK = 32  # elements per GGUF Q4_0/Q4_1/Q8_0 block

__all__ = [  # the model-side API; the format (QuantizedArray, check, dequantize) is pallas_kernels.quant_format's
    "FROM_GGUF",
    "GGUF_BLOCK",
    "concat_out",
    "from_gguf_q4_0",
    "from_gguf_q4_1",
    "from_gguf_q8_0",
    "gather_out",
    "nbytes",
    "quantize",
    "select_out",
    "stack",
]


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
    if kind in Q4_KINDS and group_size % 2:
        raise ValueError(f"{kind} packs two elements per byte within a group; group_size={group_size} must be even")
    return _quantize(w, kind, group_size, jnp.dtype(scale_dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize(w: jnp.ndarray, kind: str, group_size: int, scale_dtype) -> QuantizedArray:
    k, n = w.shape
    wg = w.reshape(k // group_size, group_size, n)  # [in/G, G, out]

    def rounded(a):  # a's value in scale_dtype, kept in float32. Not `astype(scale_dtype).astype(float32)`: XLA:GPU
        # may drop that round trip inside a fusion (excess precision), fitting the quants to unrounded scales
        # (found on the first GPU run: int8 errors past half a step).
        info = jnp.finfo(scale_dtype)
        return jax.lax.reduce_precision(a, exponent_bits=info.nexp, mantissa_bits=info.nmant)

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
    values = pack_q4(q, group_size) if kind in Q4_KINDS else q.astype(jnp.int8)
    return QuantizedArray(
        values=values, scales=d.astype(scale_dtype), mins=mins, kind=kind, group_size=group_size, shape=(k, n)
    )


# ---------------------------------------------------------------------------------------------- column access
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


def nbytes(qa) -> int:
    """Resident bytes of all leaves of a `QuantizedArray` (values, scales, mins), or of any pytree of arrays."""
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
