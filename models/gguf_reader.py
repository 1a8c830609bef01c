"""Read a GGUF file into plain Python metadata and HF-named, HF-oriented float arrays.

`read_gguf` dequantizes every tensor (F32, F16, BF16, Q8_0, Q4_0, Q4_1) to `dtype`, renames llama.cpp tensor names to
Hugging Face names, and undoes the row permutation that llama.cpp's converter applies to Llama q/k projections, so the
result can be loaded exactly like a safetensors checkpoint. `read_gguf_metadata` reads only the key/value fields.
The container itself is parsed by `models.gguf_format` (memory-mapped; tensor bytes are read only when converted).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from models.errors import (
    CorruptFileError,
    ModelConfigError,
    ModelLoadError,
    UnsupportedTensorTypeError,
    WeightShapeError,
    raise_with_source,
)
from models.gguf_format import GGUFFile, GGUFTensor, read_gguf_file

SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# llama.cpp name -> HF name for tensors outside the layer stack.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp per-layer tensor stem -> HF suffix under `model.layers.{i}.`.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclasses.dataclass
class GGUFContents:
    metadata: dict[str, Any]  # every KV field as plain Python values (str, int, float, bool, list)
    # HF name -> dequantized array in HF orientation ([out, in] for Linear weights), converted when read
    # (`LazyTensors`): a model's loader reads each tensor once, so the whole file is never dequantized at once
    tensors: Mapping[str, Any]
    tensor_types: dict[str, str]  # HF name -> GGML type name of the source tensor, e.g. "Q4_1"


class LazyTensors(Mapping):
    """A GGUF's tensors by HF name, each converted (dequantized, q/k rows un-permuted) when it is read and not
    kept: `load_model` reads each once, so a file is never held dequantized whole (a Q4 file dequantized to float32
    is 8x its size). Reading the same name again converts it again."""

    def __init__(self, convert: Callable[[str], Any], names: list[str]):
        self._convert, self._names = convert, dict.fromkeys(names)  # (ordered, and a set's lookups)

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return self._convert(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def hf_tensor_name(gguf_name: str) -> str:
    """HF name of a llama.cpp tensor name; names without a known HF counterpart come back unchanged."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        layer, stem, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[stem]}.{kind}"
    return gguf_name


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs) back to HF's rotate-half row order.

    `w` is a weight `[n_head * head_dim, in_features]` or a bias `[n_head * head_dim]`. The converter maps the HF rows
    of each head, viewed as (2, head_dim/2), to (head_dim/2, 2); this swaps the two axes back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise WeightShapeError(
            f"cannot un-permute a q/k tensor with {rows} rows into {n_head} heads of even size; "
            "check the GGUF's attention.head_count / head_count_kv"
        )
    # [n_head, head_dim/2, 2, *rest] -> [n_head, 2, head_dim/2, *rest] -> [rows, *rest]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Key/value metadata of a GGUF file as plain Python values, without touching tensor data."""
    return _open(path, map_tensors=False).metadata


KEEPABLE_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def read_gguf(path: str | os.PathLike, *, dtype: Any = np.float32, keep_quantized: bool = False) -> GGUFContents:
    """Metadata plus every tensor, HF-named and HF-oriented, dequantized to `dtype`; with `keep_quantized`, 2-D
    Q4_0/Q4_1/Q8_0 tensors come back as `pallas_kernels.quant_format.QuantizedArray`
    (logical `[in, out]`, blocks imported without
    requantization) instead."""
    reader = _open(path)
    spath = reader.path
    metadata = reader.metadata
    # Check every type before dequantizing anything, so an unreadable file fails at once.
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedTensorTypeError(
                f"GGUF tensor {t.name!r} in {spath} has type {t.tensor_type.name}, which this project "
                f"cannot read; supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}. Re-export the GGUF with one of "
                "them, e.g. `llama-quantize model-f16.gguf model-q4_1.gguf Q4_1` (or convert_hf_to_gguf.py "
                "--outtype f16/bf16/q8_0)."
            )
    if reader.big_endian and reader.tensors:
        # Typed views could be byte-swapped, but not the fp16 scales packed inside quantized blocks.
        raise ModelLoadError(f"{spath} is a big-endian GGUF; re-export it in little-endian byte order")

    arch = metadata.get("general.architecture")
    n_head = metadata.get(f"{arch}.attention.head_count")
    n_head_kv = metadata.get(f"{arch}.attention.head_count_kv", n_head)
    by_name: dict[str, tuple[GGUFTensor, int | None]] = {}
    tensor_types: dict[str, str] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        heads = None
        # Only the Llama converter permutes q/k (for ggml's interleaved RoPE); Qwen2 etc. keep HF order.
        if arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = _head_count(n_head, f"{arch}.attention.head_count", spath)
        elif arch == "llama" and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = _head_count(n_head_kv, f"{arch}.attention.head_count_kv", spath)
        by_name[name] = (t, heads)
        tensor_types[name] = t.tensor_type.name

    def convert(name: str) -> Any:
        t, heads = by_name[name]
        try:
            return _convert(t, dtype, keep_quantized, heads)
        except ModelLoadError as e:
            raise_with_source(e, f"{spath}: tensor {t.name!r}")
        except (ValueError, TypeError) as e:  # numpy / gguf.quants on bytes that do not form the stated tensor
            raise CorruptFileError(
                f"{spath}: tensor {t.name!r} ({t.tensor_type.name}, shape {list(t.shape)}) could not be read ({e}); "
                "the file is corrupt, re-convert it"
            ) from e

    return GGUFContents(metadata=metadata, tensors=LazyTensors(convert, list(by_name)), tensor_types=tensor_types)


# ---------------------------------------------------------------------------------------------------------- helpers
def _open(path: str | os.PathLike, *, map_tensors: bool = True) -> GGUFFile:
    # Memory-mapped: tensor data is read only when dequantized. Missing file -> ModelFileNotFoundError; bad magic,
    # unknown value type or truncation -> CorruptFileError ("is not a GGUF file ..."); both are ModelLoadErrors.
    return read_gguf_file(path, map_tensors=map_tensors)


def _head_count(value: Any, key: str, path: str) -> int:
    if value is None:
        raise ModelConfigError(f"{path}: required key {key!r} is missing from the GGUF metadata; it is needed to "
                               "un-permute the q/k projections")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"{path}: GGUF metadata {key} must be a positive integer, got {value!r}")
    return value


def _convert(t: GGUFTensor, dtype: Any, keep_quantized: bool, heads: int | None) -> Any:
    """One tensor in HF orientation: dequantized to `dtype`, or kept quantized (see `read_gguf`); q/k rows
    un-permuted for `heads` heads when given."""
    if keep_quantized and t.tensor_type.name in KEEPABLE_TYPES and len(t.shape) == 2:
        from models import quant

        out_in = tuple(int(x) for x in reversed(t.shape))
        importer = {"Q4_0": quant.from_gguf_q4_0, "Q4_1": quant.from_gguf_q4_1, "Q8_0": quant.from_gguf_q8_0}
        w = importer[t.tensor_type.name](np.asarray(t.data), out_in)
        if heads is not None:  # the row permutation of [out, in] is a column selection of [in, out]
            w = quant.select_out(w, unpermute_qk(np.arange(out_in[0]), heads))
        return w
    w = _dequantize(t, dtype)
    return unpermute_qk(w, heads) if heads is not None else w


def _dequantize(t: GGUFTensor, dtype: Any) -> np.ndarray:
    """A tensor as a fresh `dtype` array of shape reversed(t.shape), i.e. row-major [ne1, ne0] = [out, in]."""
    shape = tuple(reversed(t.shape))  # GGUF lists ne0 (the contiguous dim) first
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        # Typed memmap views; np.array copies so the result does not pin the mapped file and is writable.
        w = np.array(t.data, dtype=dtype)
    else:
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # uint8 block rows [..., bytes] -> float32 [..., ne0]
    return w.reshape(shape).astype(dtype, copy=False)
