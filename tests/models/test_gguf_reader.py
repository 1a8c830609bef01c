"""Tests for models/gguf_reader.py on tiny writer-made GGUF files, plus one slow test on the embedded SmolLM2 file.

The block dequantizers below are written from the GGML block layouts with `struct`, independently of gguf.quants, so
a layout mistake shared by gguf's quantize and dequantize would still show up.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from hypothesis import given, settings
from hypothesis import strategies as st

from models.errors import ModelError, ModelFileNotFoundError, UnsupportedTensorTypeError, WeightShapeError
from models.gguf_format import read_gguf_file
from models.gguf_reader import (
    SUPPORTED_TENSOR_TYPES,
    GGUFContents,
    hf_tensor_name,
    read_gguf,
    read_gguf_metadata,
    unpermute_qk,
)


# ------------------------------------------------------------------------------------------- reference dequantizers
def _blocks(raw: np.ndarray, block_bytes: int) -> list[bytes]:
    data = raw.tobytes()
    assert len(data) % block_bytes == 0
    return [data[i : i + block_bytes] for i in range(0, len(data), block_bytes)]


def _nibbles(qs: bytes) -> list[int]:
    # 16 bytes hold 32 elements: low nibbles are elements 0-15, high nibbles elements 16-31.
    return [b & 0x0F for b in qs] + [b >> 4 for b in qs]


def ref_q8_0(raw: np.ndarray) -> np.ndarray:
    out = []
    for blk in _blocks(raw, 34):  # fp16 d, 32 x int8
        (d,) = struct.unpack("<e", blk[:2])
        out += [d * q for q in struct.unpack("<32b", blk[2:])]
    return np.array(out, dtype=np.float32)


def ref_q4_0(raw: np.ndarray) -> np.ndarray:
    out = []
    for blk in _blocks(raw, 18):  # fp16 d, 16 bytes of nibbles; value = (nibble - 8) * d
        (d,) = struct.unpack("<e", blk[:2])
        out += [(q - 8) * d for q in _nibbles(blk[2:])]
    return np.array(out, dtype=np.float32)


def ref_q4_1(raw: np.ndarray) -> np.ndarray:
    out = []
    for blk in _blocks(raw, 20):  # fp16 d, fp16 m, 16 bytes of nibbles; value = nibble * d + m
        d, m = struct.unpack("<ee", blk[:4])
        out += [q * d + m for q in _nibbles(blk[4:])]
    return np.array(out, dtype=np.float32)


def ref_bf16(raw: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an IEEE float32.
    halves = struct.unpack(f"<{raw.nbytes // 2}H", raw.tobytes())
    return np.array(struct.unpack(f"<{len(halves)}f", struct.pack(f"<{len(halves)}I", *(h << 16 for h in halves))))


def ref_f16(raw: np.ndarray) -> np.ndarray:
    return np.array(struct.unpack(f"<{raw.size}e", raw.tobytes()), dtype=np.float32)


def ref_f32(raw: np.ndarray) -> np.ndarray:
    return np.array(struct.unpack(f"<{raw.size}f", raw.tobytes()), dtype=np.float32)


# Per-block error bound of each type for a block `x` (32 floats), beyond which dequantized values are wrong.
def _q8_bound(x: np.ndarray) -> float:
    return 0.5 * np.abs(x).max() / 127 * 1.2  # half a step; 1.2 covers the fp16 rounding of the scale


def _q4_0_bound(x: np.ndarray) -> float:
    return np.abs(x).max() / 8 * 1.05  # one full step: the end opposite the signed max clips at 7 * d


def _q4_1_bound(x: np.ndarray) -> float:
    return 0.5 * (x.max() - x.min()) / 15 * 1.2 + abs(x.min()) * 2**-10  # half a step + fp16 rounding of d and m


# type -> (reference dequantizer, per-block bound or None for an elementwise relative tolerance, rtol)
CASES: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], float] | None, float]] = {
    "F32": (ref_f32, None, 0.0),
    "F16": (ref_f16, None, 2**-11),
    "BF16": (ref_bf16, None, 2**-8),
    "Q8_0": (ref_q8_0, _q8_bound, 0.0),
    "Q4_0": (ref_q4_0, _q4_0_bound, 0.0),
    "Q4_1": (ref_q4_1, _q4_1_bound, 0.0),
}


# ---------------------------------------------------------------------------------------------------------- writers
def write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, QT | None]],
    kv: Callable[[gguf.GGUFWriter], None] | None = None,
    arch: str = "llama",
    **writer_kwargs: Any,
) -> Path:
    """Write a GGUF file; each tensor is (array, raw_dtype): raw_dtype None for F32/F16 arrays, else uint8 blocks."""
    w = gguf.GGUFWriter(str(path), arch, **writer_kwargs)
    if kv is not None:
        kv(w)
    for name, (arr, raw_dtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k permutation (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantized(x: np.ndarray, type_name: str) -> tuple[np.ndarray, QT | None]:
    qtype = QT[type_name]
    if qtype in (QT.F32, QT.F16):
        return gguf.quants.quantize(x, qtype), None  # typed arrays: the writer infers the type
    return gguf.quants.quantize(x, qtype), qtype  # uint8 blocks [rows, row_bytes]


# ------------------------------------------------------------------------------------------------- tensor types
@pytest.mark.parametrize("type_name", SUPPORTED_TENSOR_TYPES)
def test_each_supported_type_matches_reference_and_original(tmp_path: Path, type_name: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)  # [out=4, in=64]: two 32-element blocks per row
    x[1] *= 100.0  # a block scale far from 1
    x[2, :32] = 0.0  # an all-zero block (scale 0)
    x[3, 32:] = 0.25  # a constant block (Q4_1: d = 0, value carried by m)
    raw, raw_dtype = _quantized(x, type_name)
    path = write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (raw, raw_dtype)})

    got = read_gguf(path)
    name = "model.layers.0.mlp.up_proj.weight"
    w = got.tensors[name]
    assert got.tensor_types == {name: type_name}
    assert w.shape == (4, 64) and w.dtype == np.float32

    ref_dequant, block_bound, rtol = CASES[type_name]
    np.testing.assert_array_equal(w, ref_dequant(raw).reshape(4, 64))
    if block_bound is None:
        np.testing.assert_allclose(w, x, rtol=rtol, atol=0)
    else:
        for xb, wb in zip(x.reshape(-1, 32), w.reshape(-1, 32), strict=True):
            assert np.abs(wb - xb).max() <= block_bound(xb) + 1e-7, (xb, wb)


def test_dtype_argument_and_arrays_are_owned(tmp_path: Path) -> None:
    x = np.linspace(-1, 1, 2 * 32, dtype=np.float32).reshape(2, 32)  # [2, 32]
    path = write_gguf(tmp_path / "t.gguf", {"output_norm.weight": (x[0], None), "output.weight": _quantized(x, "Q8_0")})
    got = read_gguf(path, dtype=np.float16)
    assert all(a.dtype == np.float16 for a in got.tensors.values())
    norm = read_gguf(path).tensors["model.norm.weight"]
    norm[0] = 5.0  # writable, not a read-only view of the mapped file
    np.testing.assert_array_equal(read_gguf(path).tensors["model.norm.weight"], x[0])


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_unsupported_type_raises(tmp_path: Path, type_name: str) -> None:
    x = np.ones((2, 32), dtype=np.float32)
    path = write_gguf(tmp_path / "t.gguf", {"blk.0.attn_v.weight": _quantized(x, type_name)})
    with pytest.raises(UnsupportedTensorTypeError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert "blk.0.attn_v.weight" in msg and type_name in msg and "Q4_1" in msg and "llama-quantize" in msg
    assert read_gguf_metadata(path)["general.architecture"] == "llama"  # metadata alone still reads


def test_unsupported_k_quant_raw_bytes(tmp_path: Path) -> None:
    # gguf cannot quantize to Q6_K; declare raw bytes of the right size (210 bytes per 256 elements).
    raw = np.zeros((1, 210), dtype=np.uint8)
    path = write_gguf(tmp_path / "t.gguf", {"token_embd.weight": (raw, QT.Q6_K)})
    with pytest.raises(UnsupportedTensorTypeError, match="Q6_K"):
        read_gguf(path)


# ------------------------------------------------------------------------------------------------ q/k permutation
@settings(max_examples=50, deadline=None)
@given(
    n_head=st.integers(1, 8),
    half_dim=st.integers(1, 8),
    in_features=st.integers(1, 6),
    bias=st.booleans(),
)
def test_unpermute_inverts_converter_permute(n_head: int, half_dim: int, in_features: int, bias: bool) -> None:
    rows = n_head * 2 * half_dim
    shape = (rows,) if bias else (rows, in_features)
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(unpermute_qk(converter_permute(w, n_head), n_head), w)
    np.testing.assert_array_equal(converter_permute(unpermute_qk(w, n_head), n_head), w)


def test_unpermute_gives_rotate_half_order() -> None:
    # In the GGUF layout RoPE pairs are adjacent rows (2i, 2i+1); HF's rotate-half pairs row i with row i + head_dim/2.
    n_head, head_dim = 3, 8
    pair = np.tile(np.repeat(np.arange(head_dim // 2), 2), n_head)  # [n_head*head_dim] pair index of each GGUF row
    member = np.tile([0, 1], n_head * head_dim // 2)  # [n_head*head_dim] 0 = first of the pair, 1 = second
    labels = np.stack([pair, member], axis=1)  # [rows, 2]
    hf = unpermute_qk(labels, n_head).reshape(n_head, 2, head_dim // 2, 2)  # [head, half, i, (pair, member)]
    for h in range(n_head):
        for half in range(2):
            np.testing.assert_array_equal(hf[h, half, :, 0], np.arange(head_dim // 2))
            np.testing.assert_array_equal(hf[h, half, :, 1], half)


def test_unpermute_rejects_odd_rows() -> None:
    with pytest.raises(WeightShapeError):
        unpermute_qk(np.zeros((6, 4)), 4)


# --------------------------------------------------------------------------------------------------------- metadata
def test_metadata_round_trip(tmp_path: Path) -> None:
    def kv(w: gguf.GGUFWriter) -> None:
        w.add_string("general.name", "tiny ünïcode ☃")
        w.add_uint32("llama.block_count", 3)
        w.add_int32("test.neg", -7)
        w.add_uint64("test.big", 2**40)
        w.add_float32("llama.rope.freq_base", 10000.0)
        w.add_float64("test.f64", 0.1)
        w.add_bool("tokenizer.ggml.add_bos_token", True)
        w.add_bool("test.false", False)
        w.add_array("tokenizer.ggml.tokens", ["<s>", "Ġhello", "☃", ""])
        w.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1])
        w.add_array("tokenizer.ggml.merges", ["Ġ h", "e l"])
        w.add_array("test.floats", [0.5, 1.5])
        w.add_array("test.bools", [True, False])
        w.add_key_value("test.raw", b"ok\xff", gguf.GGUFValueType.STRING)  # not valid UTF-8

    path = write_gguf(tmp_path / "t.gguf", {"output_norm.weight": (np.ones(4, np.float32), None)}, kv)
    md = read_gguf_metadata(path)
    expected = {
        "general.architecture": "llama",
        "general.name": "tiny ünïcode ☃",
        "llama.block_count": 3,
        "test.neg": -7,
        "test.big": 2**40,
        "llama.rope.freq_base": 10000.0,
        "test.f64": 0.1,
        "tokenizer.ggml.add_bos_token": True,
        "test.false": False,
        "tokenizer.ggml.tokens": ["<s>", "Ġhello", "☃", ""],
        "tokenizer.ggml.token_type": [3, 1, 1, 1],
        "tokenizer.ggml.merges": ["Ġ h", "e l"],
        "test.floats": [0.5, 1.5],
        "test.bools": [True, False],
    }
    for key, value in expected.items():
        assert md[key] == value and type(md[key]) is type(value), (key, md[key])
    assert all(type(t) is int for t in md["tokenizer.ggml.token_type"])
    assert all(type(b) is bool for b in md["test.bools"])
    assert md["test.raw"].encode("utf-8", "surrogateescape") == b"ok\xff"  # invalid bytes survive losslessly
    assert not any(k.startswith("GGUF.") for k in md)  # reader-made header pseudo-fields are left out
    assert read_gguf(path).metadata == md


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.gguf"
    for fn in (read_gguf, read_gguf_metadata):
        with pytest.raises(ModelFileNotFoundError, match="nope.gguf"):
            fn(path)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00"])
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelError, match="not a GGUF file"):
        read_gguf(path)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9])
def test_truncated_file(tmp_path: Path, keep: float) -> None:
    def kv(w: gguf.GGUFWriter) -> None:
        w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(50)])

    path = write_gguf(tmp_path / "t.gguf", {"output.weight": (np.ones((8, 32), np.float32), None)}, kv)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelError):
        read_gguf(path)


def test_big_endian_file_metadata_reads_tensors_refused(tmp_path: Path) -> None:
    def kv(w: gguf.GGUFWriter) -> None:
        w.add_uint32("llama.block_count", 3)

    tensors = {"output_norm.weight": (np.arange(4, dtype=np.float32), None)}
    path = write_gguf(tmp_path / "be.gguf", tensors, kv, endianess=gguf.GGUFEndian.BIG)
    assert read_gguf_metadata(path)["llama.block_count"] == 3
    with pytest.raises(ModelError, match="big-endian"):
        read_gguf(path)


# ----------------------------------------------------------------------------------------------------- name mapping
def _one_layer_file(
    path: Path, arch: str, q_hf: np.ndarray, k_hf: np.ndarray, qb_hf: np.ndarray, permute: bool
) -> Path:
    hidden, inter, vocab, n_head, n_kv = 16, 24, 10, 2, 1
    rng = np.random.default_rng(1)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    perm = converter_permute if permute else (lambda w, n: w)

    def kv(w: gguf.GGUFWriter) -> None:
        w.add_uint32(f"{arch}.attention.head_count", n_head)
        w.add_uint32(f"{arch}.attention.head_count_kv", n_kv)
        w.add_uint32(f"{arch}.embedding_length", hidden)

    tensors = {
        "token_embd.weight": (f32(vocab, hidden), None),
        "output_norm.weight": (f32(hidden), None),
        "output.weight": (f32(vocab, hidden), None),
        "rope_freqs.weight": (f32(2), None),
        "blk.0.attn_norm.weight": (f32(hidden), None),
        "blk.0.ffn_norm.weight": (f32(hidden), None),
        "blk.0.attn_q.weight": (perm(q_hf, n_head), None),
        "blk.0.attn_q.bias": (perm(qb_hf, n_head), None),
        "blk.0.attn_k.weight": (perm(k_hf, n_kv), None),
        "blk.0.attn_v.weight": (f32(8, hidden), None),
        "blk.0.attn_output.weight": (f32(hidden, hidden), None),
        "blk.0.ffn_gate.weight": (f32(inter, hidden), None),
        "blk.0.ffn_up.weight": (f32(inter, hidden).astype(np.float16), None),
        "blk.0.ffn_down.weight": (f32(hidden, inter), None),
    }
    return write_gguf(path, tensors, kv, arch=arch)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_name_mapping_shapes_and_qk_unpermute(tmp_path: Path, arch: str) -> None:
    # 2 q heads, 1 kv head, head_dim 8 (with head_dim 4 the permutation would be its own inverse).
    hidden = 16
    q_hf = np.arange(16 * hidden, dtype=np.float32).reshape(16, hidden)  # [n_head*head_dim, hidden], HF order
    k_hf = -np.arange(8 * hidden, dtype=np.float32).reshape(8, hidden)  # [n_kv*head_dim, hidden]
    qb_hf = np.arange(16, dtype=np.float32)  # [n_head*head_dim]
    # llama.cpp permutes q/k only for general.architecture == "llama".
    path = _one_layer_file(tmp_path / "t.gguf", arch, q_hf, k_hf, qb_hf, permute=arch == "llama")
    got = read_gguf(path)
    assert isinstance(got, GGUFContents)

    shapes = {name: w.shape for name, w in got.tensors.items()}
    assert shapes == {
        "model.embed_tokens.weight": (10, 16),
        "model.norm.weight": (16,),
        "lm_head.weight": (10, 16),
        "rope_freqs.weight": (2,),  # unknown to HF: kept under its GGUF name
        "model.layers.0.input_layernorm.weight": (16,),
        "model.layers.0.post_attention_layernorm.weight": (16,),
        "model.layers.0.self_attn.q_proj.weight": (16, 16),
        "model.layers.0.self_attn.q_proj.bias": (16,),
        "model.layers.0.self_attn.k_proj.weight": (8, 16),
        "model.layers.0.self_attn.v_proj.weight": (8, 16),
        "model.layers.0.self_attn.o_proj.weight": (16, 16),
        "model.layers.0.mlp.gate_proj.weight": (24, 16),
        "model.layers.0.mlp.up_proj.weight": (24, 16),
        "model.layers.0.mlp.down_proj.weight": (16, 24),
    }
    assert got.tensor_types["model.layers.0.mlp.up_proj.weight"] == "F16"
    assert got.tensor_types["rope_freqs.weight"] == "F32"
    np.testing.assert_array_equal(got.tensors["model.layers.0.self_attn.q_proj.weight"], q_hf)
    np.testing.assert_array_equal(got.tensors["model.layers.0.self_attn.k_proj.weight"], k_hf)
    np.testing.assert_array_equal(got.tensors["model.layers.0.self_attn.q_proj.bias"], qb_hf)


def test_hf_tensor_name() -> None:
    assert hf_tensor_name("blk.12.attn_output.bias") == "model.layers.12.self_attn.o_proj.bias"
    assert hf_tensor_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.attn_q_norm.weight") == "blk.0.attn_q_norm.weight"
    assert hf_tensor_name("rope_freqs.weight") == "rope_freqs.weight"


# ------------------------------------------------------------------------------------------------------ real model
@pytest.mark.real_weights
def test_embedded_smollm2() -> None:
    from models.embedded import embedded_gguf_path

    got = read_gguf(embedded_gguf_path())
    t = got.tensors
    assert len(t) == 272 and all(name.startswith("model.") for name in t)  # every tensor has an HF name
    assert "lm_head.weight" not in t  # tied embeddings: the file has no output.weight
    assert t["model.embed_tokens.weight"].shape == (49152, 576)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (1536, 576)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert t["model.layers.29.self_attn.q_proj.weight"].shape == (576, 576)
    assert got.tensor_types["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert got.tensor_types["model.embed_tokens.weight"] == "Q8_0"
    assert got.tensor_types["model.norm.weight"] == "F32"
    assert all(np.isfinite(w).all() for w in t.values())

    md = got.metadata
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and all(type(s) is str for s in tokens)
    assert tokens[1] == "<|im_start|>"
    assert isinstance(md["tokenizer.chat_template"], str) and "im_start" in md["tokenizer.chat_template"]
    assert md["llama.attention.head_count"] == 9 and md["llama.attention.head_count_kv"] == 3


# ================================================================================== container parser (gguf_format)
# The reference is the implementation this reader replaced: gguf.GGUFReader (a memmap view per field part) plus the
# conversion of its ReaderFields to Python values, kept here verbatim so the new parser can be compared against it.
_OLD_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


def _old_decode(raw: np.ndarray) -> str:
    return raw.tobytes().decode("utf-8", errors="surrogateescape")


def _old_field_value(field: Any) -> Any:
    if not field.types:
        return None
    if field.types[0] == VT.ARRAY:
        if not field.data:
            return []
        if field.types[-1] == VT.STRING:
            return [_old_decode(field.parts[i]) for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    if field.types[0] == VT.STRING:
        return _old_decode(field.parts[field.data[0]])
    return field.parts[field.data[0]].tolist()[0]


def _old_view(path: Path) -> dict[str, Any]:
    """What the GGUFReader-based reader gave, or ModelError where it raised one."""
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, OverflowError, KeyError) as e:
        raise ModelError(f"{path} is not a GGUF file (or is truncated/corrupt): {e}") from e
    return {
        "metadata": {k: _old_field_value(f) for k, f in reader.fields.items() if k not in _OLD_HEADER_FIELDS},
        "big_endian": reader.byte_order == "S",
        "data_offset": reader.data_offset,
        "tensors": [
            (t.name, t.tensor_type, tuple(t.shape.tolist()), t.n_elements, t.n_bytes, t.data_offset, t.data)
            for t in reader.tensors
        ],
    }


def _new_view(path: Path) -> dict[str, Any]:
    f = read_gguf_file(path)
    assert _same_value(list(read_gguf_file(path, map_tensors=False).metadata.items()), list(f.metadata.items()))
    return {
        "metadata": f.metadata,
        "big_endian": f.big_endian,
        "data_offset": f.data_offset,
        "tensors": [
            (t.name, t.tensor_type, t.shape, t.n_elements, t.n_bytes, t.data_offset, t.data) for t in f.tensors
        ],
    }


def _same_value(a: Any, b: Any) -> bool:
    """Equal with equal Python types all the way down; floats by repr (so NaN == NaN and 0.0 != -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return repr(a) == repr(b)


def assert_same_as_old(path: Path) -> None:
    try:
        old = _old_view(path)
    except ModelError:
        with pytest.raises(ModelError):  # the messages are checked where it matters (test_parser_handmade_files)
            read_gguf_file(path)
        return
    new = _new_view(path)
    assert list(new["metadata"]) == list(old["metadata"])  # same keys in the same (file) order
    for key, value in old["metadata"].items():
        assert _same_value(new["metadata"][key], value), (key, new["metadata"][key], value)
    assert new["big_endian"] == old["big_endian"] and new["data_offset"] == old["data_offset"]
    assert len(new["tensors"]) == len(old["tensors"])
    for n, o in zip(new["tensors"], old["tensors"], strict=True):
        assert n[:6] == o[:6]
        assert type(n[2][0]) is int if n[2] else True
        assert n[6].dtype == o[6].dtype and n[6].shape == o[6].shape and n[6].tobytes() == o[6].tobytes(), n[0]
        assert not n[6].flags.writeable  # a read-only view of the mapped file


# ------------------------------------------------------------------------------------------ writer-made round trips
_INT_RANGES = {
    VT.UINT8: (0, 2**8 - 1),
    VT.INT8: (-(2**7), 2**7 - 1),
    VT.UINT16: (0, 2**16 - 1),
    VT.INT16: (-(2**15), 2**15 - 1),
    VT.UINT32: (0, 2**32 - 1),
    VT.INT32: (-(2**31), 2**31 - 1),
    VT.UINT64: (0, 2**64 - 1),
    VT.INT64: (-(2**63), 2**63 - 1),
}


def _scalars(vtype: VT) -> st.SearchStrategy[Any]:
    if vtype in _INT_RANGES:
        return st.integers(*_INT_RANGES[vtype])
    if vtype == VT.FLOAT32:
        return st.floats(width=32)
    if vtype == VT.FLOAT64:
        return st.floats()
    if vtype == VT.BOOL:
        return st.booleans()
    assert vtype == VT.STRING
    return st.text(max_size=12) | st.binary(max_size=12)  # bytes are written as-is: invalid UTF-8 included


_SCALAR_TYPES = [t for t in VT if t != VT.ARRAY]
# Inner arrays of a nested array; the writer infers their element type (int -> INT32, float -> FLOAT32, bytes ->
# UINT8 array). Numeric kinds may be mixed across inner arrays, strings only with strings (the old conversion decoded
# numbers as strings or strings as numbers there, which nothing relies on).
_NUMERIC_INNER = st.one_of(
    st.lists(st.integers(*_INT_RANGES[VT.INT32]), min_size=1, max_size=4),
    st.lists(st.floats(width=32), min_size=1, max_size=4),
    st.lists(st.booleans(), min_size=1, max_size=4),
    st.binary(min_size=1, max_size=4),
)
_STRING_INNER = st.lists(st.text(max_size=5) | st.binary(max_size=5), min_size=1, max_size=4)
_VALUES = st.one_of(
    st.sampled_from(_SCALAR_TYPES).flatmap(lambda t: _scalars(t).map(lambda v: (t, v, None))),
    st.sampled_from(_SCALAR_TYPES).flatmap(
        lambda t: st.lists(_scalars(t), min_size=1, max_size=20).map(lambda v: (VT.ARRAY, v, t))
    ),
    st.lists(_NUMERIC_INNER, min_size=1, max_size=3).map(lambda v: (VT.ARRAY, v, VT.ARRAY)),
    st.lists(_STRING_INNER, min_size=1, max_size=3).map(lambda v: (VT.ARRAY, v, VT.ARRAY)),
)
_KEYS = st.text(min_size=1, max_size=10).filter(lambda k: not k.startswith(("general.", "GGUF.")))
_TENSOR_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "I32"]


def _tensor(type_name: str, dims: list[int], seed: int) -> tuple[np.ndarray, QT | None]:
    rng = np.random.default_rng(seed)
    if type_name == "I32":
        return rng.integers(-1000, 1000, dims).astype(np.int32), None
    if type_name in ("F32", "F16"):
        return rng.standard_normal(dims).astype(np.float32 if type_name == "F32" else np.float16), None
    dims = [*dims[:-1], 32 * dims[-1]]  # whole blocks per row
    return _quantized(rng.standard_normal(dims).astype(np.float32), type_name)


@settings(max_examples=40, deadline=None)
@given(
    kvs=st.lists(st.tuples(_KEYS, _VALUES), max_size=8, unique_by=lambda kv: kv[0]),
    tensors=st.lists(
        st.tuples(st.sampled_from(_TENSOR_TYPES), st.lists(st.integers(1, 5), min_size=1, max_size=3)), max_size=4
    ),
    alignment=st.sampled_from([None, 8, 64, 256]),
    big_endian=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_parser_matches_gguf_reader_on_writer_files(
    tmp_path_factory: pytest.TempPathFactory,
    kvs: list[tuple[str, tuple[VT, Any, VT | None]]],
    tensors: list[tuple[str, list[int]]],
    alignment: int | None,
    big_endian: bool,
    seed: int,
) -> None:
    def kv(w: gguf.GGUFWriter) -> None:
        if alignment is not None:
            w.add_custom_alignment(alignment)
        for key, (vtype, value, sub_type) in kvs:
            w.add_key_value(key, value, vtype, sub_type=sub_type)

    arrays = {f"t{i}": _tensor(name, dims, seed + i) for i, (name, dims) in enumerate(tensors)}
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    path = write_gguf(tmp_path_factory.mktemp("rt") / "t.gguf", arrays, kv, endianess=endian)
    assert_same_as_old(path)
    f = read_gguf_file(path)
    assert f.big_endian == big_endian and f.alignment == (alignment or 32) and f.data_offset % f.alignment == 0
    assert [t.tensor_type.name for t in f.tensors] == [name for name, _ in tensors]
    # What was written comes back: strings as str (bytes losslessly via surrogateescape), numbers as Python numbers.
    for key, (vtype, value, sub_type) in kvs:
        got = f.metadata[key]
        if vtype == VT.ARRAY and sub_type == VT.ARRAY:
            value = [x for inner in value for x in inner]
        if vtype == VT.STRING or sub_type in (VT.STRING, VT.ARRAY):
            as_bytes = lambda s: s if isinstance(s, bytes) else s.encode("utf-8")  # noqa: E731
            if vtype == VT.STRING:
                assert got.encode("utf-8", "surrogateescape") == as_bytes(value)
            elif all(isinstance(x, (str, bytes)) for x in value):
                assert [s.encode("utf-8", "surrogateescape") for s in got] == [as_bytes(s) for s in value]
        elif vtype in _INT_RANGES or vtype == VT.BOOL or sub_type in _INT_RANGES or sub_type == VT.BOOL:
            assert got == value


def _s(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _arr(itype: int, n: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IQ", itype, n) + payload


def _ti(name: str, dims: tuple[int, ...], ttype: int, offset: int = 0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", ttype, offset)


def _raw_gguf(kvs: list[bytes], infos: list[bytes] = (), data: bytes = b"", version: int = 3, align: int = 32) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % align) + data


_NEST_300 = _arr(VT.ARRAY, 1) * 300 + _arr(VT.INT32, 0)
# id -> (file bytes, expected metadata beyond general.* or an error regex, whether gguf's reader agreed)
_HANDMADE: dict[str, tuple[bytes, dict[str, Any] | str, bool]] = {
    "empty numeric array": (_raw_gguf([_kv("a", VT.ARRAY, _arr(VT.INT32, 0))]), {"a": []}, True),
    "empty string array": (_raw_gguf([_kv("a", VT.ARRAY, _arr(VT.STRING, 0))]), {"a": []}, True),
    "empty array, unknown element type": (_raw_gguf([_kv("a", VT.ARRAY, _arr(99, 0))]), {"a": []}, True),
    "nested, first inner empty": (
        _raw_gguf(
            [_kv("a", VT.ARRAY, _arr(VT.ARRAY, 2, _arr(VT.INT32, 0) + _arr(VT.INT32, 2, struct.pack("<ii", 5, -6))))]
        ),
        {"a": [5, -6]},
        True,
    ),
    "nested, all inner empty": (
        _raw_gguf([_kv("a", VT.ARRAY, _arr(VT.ARRAY, 2, _arr(VT.INT32, 0) + _arr(VT.STRING, 0)))]),
        {"a": []},
        True,
    ),
    "nested, mixed numeric types promote": (
        _raw_gguf(
            [
                _kv(
                    "a",
                    VT.ARRAY,
                    _arr(VT.ARRAY, 2, _arr(VT.INT8, 1, b"\xff") + _arr(VT.FLOAT32, 1, struct.pack("<f", 0.5))),
                )
            ]
        ),
        {"a": [-1.0, 0.5]},
        True,
    ),
    "nested strings": (
        _raw_gguf(
            [
                _kv(
                    "a",
                    VT.ARRAY,
                    _arr(VT.ARRAY, 2, _arr(VT.STRING, 1, _s("x")) + _arr(VT.STRING, 2, _s(b"\xff") + _s("z"))),
                )
            ]
        ),
        {"a": ["x", "\udcff", "z"]},
        True,
    ),
    "bool stored as 2": (_raw_gguf([_kv("b", VT.BOOL, b"\x02")]), {"b": True}, True),
    "version 2": (_raw_gguf([_kv("v", VT.UINT16, b"\x07\x00")], version=2), {"v": 7}, True),
    "empty f32 tensor at a far offset": (
        _raw_gguf([], [_ti("e", (0, 4), QT.F32, 2**40)]),
        {},
        True,
    ),
    "version 1": (_raw_gguf([], version=1), "version 1 files are not supported", True),
    "version 4": (_raw_gguf([], version=4), "not a GGUF file.*version 4", True),
    "bad magic": (b"GGUG" + _raw_gguf([])[4:], "not a GGUF file.*magic", True),
    "unknown value type": (_raw_gguf([_kv("a", 13, b"\0" * 8)]), "not a GGUF file.*unknown type 13", True),
    "unknown array element type": (_raw_gguf([_kv("a", VT.ARRAY, _arr(13, 1, b"\0" * 8))]), "not a GGUF file", True),
    "duplicate key": (_raw_gguf([_kv("a", VT.UINT8, b"\1")] * 2), "not a GGUF file.*duplicate key", True),
    "header pseudo-field as key": (_raw_gguf([_kv("GGUF.version", VT.UINT8, b"\1")]), "not a GGUF file", True),
    "invalid UTF-8 key": (_raw_gguf([_kv(b"k\xff", VT.UINT8, b"\1")]), "not a GGUF file.*UTF-8", True),
    "alignment not UINT32": (
        _raw_gguf([_kv("general.alignment", VT.UINT64, struct.pack("<Q", 32))]),
        "not a GGUF file.*alignment",
        True,
    ),
    "alignment not a power of two": (
        _raw_gguf([_kv("general.alignment", VT.UINT32, struct.pack("<I", 48))]),
        "not a GGUF file.*alignment",
        True,
    ),
    "alignment zero": (_raw_gguf([_kv("general.alignment", VT.UINT32, b"\0" * 4)]), "not a GGUF file", True),
    "huge kv count": (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**63), "not a GGUF file", True),
    "huge numeric array": (_raw_gguf([_kv("a", VT.ARRAY, _arr(VT.INT32, 2**62, b"\0" * 8))]), "not a GGUF file", True),
    "huge string array": (_raw_gguf([_kv("a", VT.ARRAY, _arr(VT.STRING, 2**62, _s("x")))]), "not a GGUF file", True),
    # gguf's reader took a string running past the end as the rest of the file; a truncated string is an error now.
    "huge string": (_raw_gguf([_kv("a", VT.STRING, struct.pack("<Q", 2**63) + b"x")]), "not a GGUF file", False),
    "arrays nested 300 deep": (_raw_gguf([_kv("a", VT.ARRAY, _NEST_300)]), "not a GGUF file.*nests", False),
    "unknown tensor type": (_raw_gguf([], [_ti("t", (4,), 99)], b"\0" * 32), "not a GGUF file.*GGML type", True),
    "quantized row not whole blocks": (
        _raw_gguf([], [_ti("t", (16,), QT.Q8_0)], b"\0" * 64),
        "not a GGUF file.*block size",
        True,
    ),
    "duplicate tensor name": (
        _raw_gguf([], [_ti("t", (4,), QT.F32), _ti("t", (4,), QT.F32, 16)], b"\0" * 32),
        "not a GGUF file.*duplicate tensor",
        True,
    ),
    "huge n_dims": (_raw_gguf([], [_s("t") + struct.pack("<I", 2**32 - 1)]), "not a GGUF file", True),
    "tensor past the end": (
        _raw_gguf([], [_ti("t", (4,), QT.F32, 32)], b"\0" * 32),
        "not a GGUF file.*past the end",
        True,
    ),
    "huge tensor": (_raw_gguf([], [_ti("t", (2**40, 2**40), QT.F32)], b"\0" * 32), "not a GGUF file", True),
}


@pytest.mark.parametrize("case", list(_HANDMADE))
def test_parser_handmade_files(tmp_path: Path, case: str) -> None:
    data, expected, old_agrees = _HANDMADE[case]
    path = tmp_path / "h.gguf"
    path.write_bytes(data)
    if isinstance(expected, str):
        for fn in (read_gguf_file, read_gguf_metadata, read_gguf):
            with pytest.raises(ModelError, match=expected):
                fn(path)
    else:
        md = read_gguf_metadata(path)
        assert md.keys() == expected.keys()
        for key, value in expected.items():
            assert _same_value(md[key], value), (key, md[key], value)
    if old_agrees:
        assert_same_as_old(path)


def _small_file(path: Path) -> Path:
    def kv(w: gguf.GGUFWriter) -> None:
        w.add_string("general.name", "tiny ☃")
        w.add_uint32("llama.block_count", 1)
        w.add_float64("test.f64", 0.1)
        w.add_bool("test.bool", True)
        w.add_array("tokenizer.ggml.tokens", ["<s>", "Ġhi", "☃", b"\xff\xfe", ""])
        w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
        w.add_key_value("test.nested", [[1, 2], [3]], VT.ARRAY, sub_type=VT.ARRAY)

    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    tensors = {
        "output_norm.weight": (x[0], None),
        "output.weight": _quantized(x, "Q4_1"),
        "blk.0.x": (x.astype(np.float16), None),
    }
    return write_gguf(path, tensors, kv)


def test_truncated_at_many_offsets_always_model_error(tmp_path: Path) -> None:
    full = _small_file(tmp_path / "full.gguf")
    data = full.read_bytes()
    needed = max(t.data_offset + t.n_bytes for t in read_gguf_file(full).tensors)
    assert needed <= len(data)
    cut = tmp_path / "cut.gguf"
    for n in sorted({*range(0, needed, 37), *range(0, 64), needed - 1}):
        cut.write_bytes(data[:n])
        for fn in (read_gguf_file, read_gguf_metadata, read_gguf):
            with pytest.raises(ModelError, match="is not a GGUF file \\(or is truncated/corrupt\\)"):
                fn(cut)
    cut.write_bytes(data[:needed])  # trailing padding after the last tensor is optional
    assert read_gguf_metadata(cut) == read_gguf_metadata(full)


@settings(max_examples=150, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4))
def test_corrupted_header_bytes_raise_only_model_error(tmp_path_factory: pytest.TempPathFactory, flips: list) -> None:
    folder = tmp_path_factory.mktemp("fuzz")
    full = _small_file(folder / "full.gguf")
    data = bytearray(full.read_bytes())
    header_end = read_gguf_file(full).data_offset
    for pos, xor in flips:
        data[pos % header_end] ^= xor
    full.write_bytes(bytes(data))
    for fn in (read_gguf_file, read_gguf_metadata):
        try:
            fn(full)
        except ModelError:
            pass


def test_metadata_only_maps_no_tensors(tmp_path: Path) -> None:
    path = _small_file(tmp_path / "t.gguf")
    lazy, full = read_gguf_file(path, map_tensors=False), read_gguf_file(path)
    assert all(t.data is None for t in lazy.tensors)
    assert [(t.name, t.shape, t.data_offset) for t in lazy.tensors] == [
        (t.name, t.shape, t.data_offset) for t in full.tensors
    ]
    by_name = {t.name: t for t in full.tensors}
    assert by_name["output.weight"].data.dtype == np.uint8 and by_name["output.weight"].data.shape == (2, 20)
    assert by_name["blk.0.x"].data.dtype == np.float16 and by_name["blk.0.x"].data.shape == (2, 32)
    assert full.value_types["test.nested"] == VT.ARRAY and full.metadata["test.nested"] == [1, 2, 3]
    assert full.metadata["tokenizer.ggml.tokens"][3].encode("utf-8", "surrogateescape") == b"\xff\xfe"


@pytest.mark.real_weights
def test_embedded_smollm2_parses_like_gguf_reader() -> None:
    from models.embedded import embedded_gguf_path

    path = Path(embedded_gguf_path())
    assert_same_as_old(path)
    md = read_gguf_metadata(path)
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and len(md["tokenizer.ggml.merges"]) > 48000
    assert all(type(t) is int for t in md["tokenizer.ggml.token_type"])
