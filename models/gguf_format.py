"""A small, fast reader of the GGUF container: header, key/value metadata, tensor infos, memory-mapped tensor data.

`gguf.GGUFReader` makes a numpy memmap view for every part of every key/value field, about a million views for a
tokenizer's token and merge lists, which takes seconds. This reader parses the same layout with `struct` and
`np.frombuffer` straight into plain Python values, and maps the file once for the tensor data.

Layout (all integers in the file's byte order, little-endian unless the writer chose big-endian):
    "GGUF" magic, uint32 version (2 or 3), uint64 tensor_count, uint64 kv_count,
    kv_count x (string key, uint32 GGUFValueType, value), where a string is uint64 length + UTF-8 bytes and an array
        is uint32 element type + uint64 count + elements,
    tensor_count x (string name, uint32 n_dims, n_dims x uint64 ne (ne0, the contiguous dim, first), uint32
        GGMLQuantizationType, uint64 offset relative to the data section),
    padding to the next multiple of `general.alignment` (default 32), then the data section.

Values come back as the project's GGUF reader has always given them: str (invalid UTF-8 kept with surrogateescape),
int, float, bool, and flat lists for arrays (nested arrays flattened; empty arrays as []).
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from models.errors import CorruptFileError, ModelFileNotFoundError, ModelLoadError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# The fixed-size part of the header: magic, version, tensor_count, kv_count.
_HEADER_BYTES = 4 + 4 + 8 + 8
# Names the gguf package's reader gives the header values; a key/value pair with one of these names is a duplicate.
_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")
# Nested arrays are parsed recursively; no real file nests more than twice, this only keeps corrupt files from
# exhausting the Python stack.
_MAX_ARRAY_DEPTH = 256

# struct / numpy codes of the fixed-size value types (without the byte-order prefix).
_SCALAR_CODES = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
# Tensor types whose data is a typed array of elements; every other type is uint8 block rows [..., bytes_per_row]
# (BF16 included, as gguf's reader gives it and gguf.quants.dequantize expects it).
_TYPED_TENSORS = {
    GGMLQuantizationType.F32: "f4",
    GGMLQuantizationType.F16: "f2",
    GGMLQuantizationType.F64: "f8",
    GGMLQuantizationType.I8: "i1",
    GGMLQuantizationType.I16: "i2",
    GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: ne0 (the contiguous dim) first, i.e. reversed numpy order
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute offset of the tensor's bytes in the file
    # Read-only view of the mapped file: typed [ne_{n-1}, ..., ne0] for F32/F16/F64/I8-I64, uint8 block rows
    # [ne_{n-1}, ..., ne1, ne0 / block_size * type_size] for every other type. None when opened without tensor data.
    data: np.ndarray | None


@dataclasses.dataclass(eq=False)
class GGUFFile:
    path: str
    version: int
    big_endian: bool
    alignment: int
    data_offset: int  # start of the data section
    metadata: dict[str, Any]  # key/value pairs in file order, as plain Python values
    value_types: dict[str, GGUFValueType]  # key -> type of its value (ARRAY for arrays)
    tensors: list[GGUFTensor]


class _Corrupt(Exception):
    """The bytes do not form a GGUF file; the message says where and why."""


class _Unsupported(Exception):
    """A GGUF file of version 1, which predates 64-bit counts and lengths."""


def read_gguf_file(path: str | os.PathLike, *, map_tensors: bool = True) -> GGUFFile:
    """Parse a GGUF file. With `map_tensors`, each tensor's `data` is a view of one read-only memory map of the file;
    without, `data` is None. Tensor infos are parsed and bounds-checked either way; tensor bytes are never read here.

    Raises ModelFileNotFoundError for a missing file, CorruptFileError for anything that is not a readable GGUF file
    (bad magic, unknown value or tensor type, duplicate keys, truncation, tensor data past the end) and ModelLoadError
    for a version 1 file; every message starts with the path."""
    spath = os.fspath(path)
    if not os.path.isfile(spath):
        raise ModelFileNotFoundError(f"GGUF file {spath} not found")
    try:
        size = os.path.getsize(spath)
        if size < _HEADER_BYTES:
            raise _Corrupt(f"the file has {size} bytes, fewer than a GGUF header's {_HEADER_BYTES}")
        mm = np.memmap(spath, dtype=np.uint8, mode="r")  # maps lazily: only the pages read below are loaded
        return _parse(spath, mm, memoryview(mm), map_tensors)
    except _Corrupt as e:
        raise CorruptFileError(f"{spath} is not a GGUF file (or is truncated/corrupt): {e}") from None
    except _Unsupported as e:
        raise ModelLoadError(f"{spath} {e}") from None
    except (struct.error, ValueError, OverflowError, IndexError) as e:
        # The parser checks every bound it reads; this is only a net, so no corrupt file ever escapes unnamed.
        raise CorruptFileError(f"{spath} is not a GGUF file (or is truncated/corrupt): {e}") from e
    except OSError as e:  # exists but cannot be read or mapped (permissions, a special file)
        raise ModelLoadError(f"GGUF file {spath} could not be read ({e})") from e


def _parse(path: str, mm: np.ndarray, mv: memoryview, map_tensors: bool) -> GGUFFile:
    if bytes(mv[:4]) != MAGIC:
        raise _Corrupt(f"bad magic {bytes(mv[:4])!r}, expected {MAGIC!r}")
    (version,) = struct.unpack_from("<I", mv, 4)
    # Read as little-endian, a big-endian file's small version number has zero low 16 bits (gguf's reader checks the
    # same). Big-endian files are parsed; read_gguf refuses their tensors (quantized blocks cannot be byte-swapped).
    big_endian = version & 0xFFFF == 0
    if big_endian:
        (version,) = struct.unpack_from(">I", mv, 4)
    if version not in SUPPORTED_VERSIONS:
        if version == 1:
            raise _Unsupported(
                "is a GGUF version 1 file; version 1 files are not supported (only versions 2 and 3), re-export the "
                "model with a current llama.cpp (convert_hf_to_gguf.py)"
            )
        raise _Corrupt(f"unsupported GGUF version {version} (this reader handles versions 2 and 3)")
    p = _Parser(mv, big_endian)
    tensor_count, kv_count = struct.unpack_from(p.e + "QQ", mv, 8)
    off = _HEADER_BYTES

    metadata: dict[str, Any] = {}
    value_types: dict[str, GGUFValueType] = {}
    # Each pair takes at least 8 (key length) + 4 (type) + 1 bytes; fail at once on a corrupt count.
    p.need(off, kv_count * 13, f"{kv_count} key/value pairs")
    for _ in range(kv_count):
        key_off = off
        key, off = p.string(off, "key", strict=True)
        p.need(off, 4, f"the value type of {key!r}")
        (vtype,) = p.u32.unpack_from(mv, off)
        value, off = p.value(off + 4, vtype, key)
        if key in metadata or key in _HEADER_FIELDS:
            raise _Corrupt(f"duplicate key {key!r} at byte {key_off}")
        metadata[key] = value
        value_types[key] = GGUFValueType(vtype)

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        if value_types["general.alignment"] != GGUFValueType.UINT32:
            raise _Corrupt(f"general.alignment has type {value_types['general.alignment'].name}, expected UINT32")
        alignment = metadata["general.alignment"]
        if alignment == 0 or alignment & (alignment - 1):
            raise _Corrupt(f"general.alignment {alignment} is not a power of two")

    infos = []
    # Each tensor info takes at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset) bytes.
    p.need(off, tensor_count * 24, f"{tensor_count} tensor infos")
    for _ in range(tensor_count):
        name, off = p.string(off, "tensor name", strict=True)
        p.need(off, 4, f"tensor {name!r}")
        (n_dims,) = p.u32.unpack_from(mv, off)
        off += 4
        p.need(off, 8 * n_dims + 12, f"tensor {name!r}")
        dims = struct.unpack_from(f"{p.e}{n_dims}Q", mv, off)
        off += 8 * n_dims
        raw_type, rel_offset = struct.unpack_from(p.e + "IQ", mv, off)
        off += 12
        infos.append((name, dims, raw_type, rel_offset))
    data_start = -(-off // alignment) * alignment

    tensors: list[GGUFTensor] = []
    names: set[str] = set()
    for name, dims, raw_type, rel_offset in infos:
        if name in names:
            raise _Corrupt(f"duplicate tensor name {name!r}")
        names.add(name)
        try:
            ttype = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise _Corrupt(f"tensor {name!r} has unknown GGML type {raw_type}") from None
        n_elements = math.prod(dims)
        n_bytes = n_elements * type_size // block_size
        start = data_start + rel_offset
        if n_bytes and start + n_bytes > p.size:
            raise _Corrupt(
                f"tensor {name!r} ({n_bytes} bytes at byte {start}) runs past the end of the file ({p.size} bytes)"
            )
        np_shape = tuple(reversed(dims))
        code = _TYPED_TENSORS.get(ttype)
        if code is None:  # blocks: the last numpy dim becomes bytes per row
            if not dims or dims[0] % block_size:
                raise _Corrupt(
                    f"tensor {name!r} of type {ttype.name} has shape {list(dims)}, whose ne0 is not a multiple of the "
                    f"block size {block_size}"
                )
            np_shape = (*np_shape[:-1], dims[0] // block_size * type_size)
        data = None
        if map_tensors:
            data = mm[start : start + n_bytes] if n_bytes else mm[:0]  # an empty tensor's offset is never used
            data = (data if code is None else data.view(p.e + code)).reshape(np_shape)
        tensors.append(GGUFTensor(name, ttype, tuple(dims), n_elements, n_bytes, start, data))

    return GGUFFile(path, version, big_endian, alignment, data_start, metadata, value_types, tensors)


class _Parser:
    """Bounds-checked reads of GGUF values from a byte buffer in one byte order."""

    def __init__(self, mv: memoryview, big_endian: bool) -> None:
        self.mv = mv
        self.size = len(mv)
        self.e = e = ">" if big_endian else "<"
        self.u32 = struct.Struct(e + "I")
        self.u64 = struct.Struct(e + "Q")
        self.scalars = {int(t): struct.Struct(e + c) for t, c in _SCALAR_CODES.items()}
        self.dtypes = {int(t): np.dtype(e + c) for t, c in _SCALAR_CODES.items()}

    def need(self, off: int, n: int, what: str) -> None:
        if off + n > self.size:
            raise _Corrupt(f"{what} at byte {off} runs past the end of the file ({self.size} bytes)")

    def string(self, off: int, what: str, strict: bool = False) -> tuple[str, int]:
        self.need(off, 8, what)
        (n,) = self.u64.unpack_from(self.mv, off)
        off += 8
        self.need(off, n, what)
        raw = self.mv[off : off + n]
        try:
            # surrogateescape keeps invalid UTF-8 (possible in token lists) lossless: s.encode("utf-8",
            # "surrogateescape") gives the stored bytes back. Keys and tensor names must be valid UTF-8.
            return str(raw, "utf-8", "strict" if strict else "surrogateescape"), off + n
        except UnicodeDecodeError as e:
            raise _Corrupt(f"{what} at byte {off} is not valid UTF-8: {e}") from None

    def value(self, off: int, vtype: int, key: str) -> tuple[Any, int]:
        st = self.scalars.get(vtype)
        if st is not None:
            self.need(off, st.size, f"the value of {key!r}")
            return st.unpack_from(self.mv, off)[0], off + st.size
        if vtype == GGUFValueType.STRING:
            return self.string(off, f"the value of {key!r}")
        if vtype == GGUFValueType.ARRAY:
            chunks: list[Any] = []
            off = self._array(off, key, chunks, 0)
            return _join(chunks), off
        raise _Corrupt(f"the value of {key!r} at byte {off} has unknown type {vtype}")

    def _array(self, off: int, key: str, chunks: list[Any], depth: int) -> int:
        """Parse an array at `off` (element type, count, elements), appending its leaves to `chunks` as numpy arrays
        (numeric/bool) or lists of str; return the offset after it."""
        if depth > _MAX_ARRAY_DEPTH:
            raise _Corrupt(f"the value of {key!r} nests arrays more than {_MAX_ARRAY_DEPTH} deep")
        self.need(off, 12, f"the array header of {key!r}")
        (itype,) = self.u32.unpack_from(self.mv, off)
        (n,) = self.u64.unpack_from(self.mv, off + 4)
        off += 12
        if n == 0:  # an empty array's element type is never looked at (gguf's reader accepts any)
            return off
        dt = self.dtypes.get(itype)
        if dt is not None:
            nbytes = n * dt.itemsize
            self.need(off, nbytes, f"the {n} elements of {key!r}")
            chunks.append(np.frombuffer(self.mv, dtype=dt, count=n, offset=off))
            return off + nbytes
        if itype == GGUFValueType.STRING:
            self.need(off, 8 * n, f"the {n} strings of {key!r}")  # each string has at least its length
            mv, size, u64 = self.mv, self.size, self.u64.unpack_from
            out = []
            append = out.append
            for _ in range(n):
                if off + 8 > size:
                    raise _Corrupt(f"a string of {key!r} at byte {off} runs past the end of the file ({size} bytes)")
                end = off + 8 + u64(mv, off)[0]
                if end > size:
                    raise _Corrupt(f"a string of {key!r} at byte {off} runs past the end of the file ({size} bytes)")
                append(str(mv[off + 8 : end], "utf-8", "surrogateescape"))
                off = end
            chunks.append(out)
            return off
        if itype == GGUFValueType.ARRAY:
            self.need(off, 12 * n, f"the {n} nested arrays of {key!r}")
            for _ in range(n):
                off = self._array(off, key, chunks, depth + 1)
            return off
        raise _Corrupt(f"the array {key!r} at byte {off - 12} has unknown element type {itype}")


def _join(chunks: list[Any]) -> list[Any]:
    """The leaves of a (possibly nested) array as one flat Python list."""
    if not chunks:
        return []
    if len(chunks) == 1:
        c = chunks[0]
        return c if isinstance(c, list) else c.tolist()
    if all(isinstance(c, np.ndarray) for c in chunks):
        # As gguf's ReaderField-based conversion did: numeric leaves of a nested array are concatenated (with numpy
        # type promotion if the sub-arrays differ in type), then converted to Python numbers.
        return np.concatenate(chunks).tolist()
    return [x for c in chunks for x in (c if isinstance(c, list) else c.tolist())]
