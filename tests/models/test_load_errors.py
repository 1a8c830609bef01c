"""Loaders fail clearly: every corrupt, truncated or inconsistent checkpoint file raises a `ModelLoadError` whose
message names the file, never the underlying library's raw error.

The checkpoints are real files written here: a tiny HF directory (config.json + safetensors written with numpy, one
file or two shards with an index, plus tokenizer files copied from tests/models/data) and a tiny GGUF with a byte-level
BPE vocabulary, written with the `gguf` package. The fuzz tests truncate them at a seeded sample of offsets (every
region: header, metadata, tensor infos, data) and flip random bytes; each outcome must be a successful load or a
ModelLoadError naming the damaged file.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from safetensors.numpy import save_file

from models import (
    CorruptFileError,
    InvalidLoadOptionError,
    InvalidPromptError,
    InvalidPromptTypeError,
    MissingWeightError,
    ModelConfig,
    ModelConfigError,
    ModelError,
    ModelFileNotFoundError,
    ModelLoadError,
    TokenizerError,
    TokenizerLoadError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
    WeightShapeError,
    load_model,
)
from models.gguf_format import read_gguf_file
from models.gguf_reader import read_gguf, read_gguf_metadata
from models.tokenizer import Tokenizer, load_tokenizer_from_dir

DATA = Path(__file__).parent / "data"
BPE_DIR = DATA / "tiny_bpe"
SP_MODEL = DATA / "tiny_sp.model"

CONFIG: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


# ---------------------------------------------------------------------------------------------------------- writers
def hf_state_dict(cfg: dict[str, Any] = CONFIG, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors under HF names, `[out, in]`, for a Llama config dict."""
    rng = np.random.default_rng(seed)
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    r = lambda *s: rng.normal(0, 0.1, s).astype(np.float32)  # noqa: E731
    sd = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": 1 + r(h), "lm_head.weight": r(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
            p + "self_attn.q_proj.weight": r(nq, h), p + "self_attn.k_proj.weight": r(nkv, h),
            p + "self_attn.v_proj.weight": r(nkv, h), p + "self_attn.o_proj.weight": r(h, nq),
            p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h), p + "mlp.down_proj.weight": r(h, f),
        }
    return sd


def write_hf(d: Path, *, sd: dict[str, np.ndarray] | None = None, sharded: bool = False, tokenizer: bool = False,
             config: dict[str, Any] = CONFIG) -> Path:
    """A tiny HF checkpoint directory: config.json plus model.safetensors, or two shards and their index."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    sd = hf_state_dict() if sd is None else sd
    if sharded:
        names = sorted(sd)
        parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                 "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
        for file, keys in parts.items():
            save_file({k: sd[k] for k in keys}, str(d / file))
        weight_map = {k: file for file, keys in parts.items() for k in keys}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(sd, str(d / "model.safetensors"))
    if tokenizer:
        for f in BPE_DIR.iterdir():
            shutil.copy(f, d / f.name)
    return d


def _bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """tokens, token types and merges of the tiny byte-level tokenizer.json, as llama.cpp's converter writes them."""
    spec = json.loads((BPE_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(spec["model"]["vocab"])
    added = {t["id"]: t for t in spec["added_tokens"]}
    vocab |= {t["content"]: i for i, t in added.items()}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [(3 if added[i]["special"] else 4) if i in added else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges


GGUF_HIDDEN, GGUF_INTER, GGUF_HEADS, GGUF_KV = 32, 32, 4, 2


def write_gguf(path: Path, *, kv: Callable[[gguf.GGUFWriter], None] | None = None, tokenizer: bool = True,
               arch_keys: bool = True, tensors: dict[str, tuple[np.ndarray, QT | None]] | None = None) -> Path:
    """A tiny one-layer Llama GGUF (F32, F16 and Q8_0 tensors) with the tiny BPE vocabulary; `kv(writer)` adds or
    overrides metadata, `tensors` replaces tensors by GGUF name."""
    tokens, types, merges = _bpe_vocab()
    v, h, f = len(tokens), GGUF_HIDDEN, GGUF_INTER
    nkv = GGUF_KV * h // GGUF_HEADS
    rng = np.random.default_rng(0)
    r = lambda *s: rng.normal(0, 0.1, s).astype(np.float32)  # noqa: E731
    all_tensors: dict[str, tuple[np.ndarray, QT | None]] = {
        "token_embd.weight": (r(v, h).astype(np.float16), None),
        "output_norm.weight": (1 + r(h), None),
        "blk.0.attn_norm.weight": (1 + r(h), None),
        "blk.0.ffn_norm.weight": (1 + r(h), None),
        "blk.0.attn_q.weight": (r(h, h), None),
        "blk.0.attn_k.weight": (r(nkv, h), None),
        "blk.0.attn_v.weight": (r(nkv, h), None),
        "blk.0.attn_output.weight": (r(h, h), None),
        "blk.0.ffn_gate.weight": (gguf.quants.quantize(r(f, h), QT.Q8_0), QT.Q8_0),
        "blk.0.ffn_up.weight": (r(f, h), None),
        "blk.0.ffn_down.weight": (r(h, f), None),
    }
    all_tensors |= tensors or {}
    w = gguf.GGUFWriter(str(path), "llama")
    if arch_keys:
        w.add_block_count(1)
        w.add_embedding_length(h)
        w.add_feed_forward_length(f)
        w.add_head_count(GGUF_HEADS)
        w.add_head_count_kv(GGUF_KV)
        w.add_context_length(64)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if kv is not None:
        kv(w)
    for name, (arr, raw_dtype) in all_tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def expect_load_error(fn: Callable[[], Any], cls: type[ModelLoadError] = ModelLoadError, *names: str) -> str:
    """Run `fn`; it must raise `cls` (a ModelLoadError) whose message contains every one of `names`."""
    with pytest.raises(ModelLoadError) as info:
        fn()
    assert isinstance(info.value, cls), f"{type(info.value).__name__} is not a {cls.__name__}: {info.value}"
    msg = str(info.value)
    for name in names:
        assert name in msg, f"{name!r} not in {msg!r}"
    return msg


def outcome(fn: Callable[[], Any], *names: str) -> str:
    """"ok" if `fn` loads; the error class name if it raised a ModelLoadError naming one of `names`; anything else
    (another exception type, or a message naming none of them) fails the test."""
    try:
        fn()
    except ModelLoadError as e:
        assert any(n in str(e) for n in names), f"{type(e).__name__} names none of {names}: {e}"
        return type(e).__name__
    return "ok"


def truncation_offsets(size: int, header: int, n: int = 24, seed: int = 0) -> list[int]:
    """Every offset inside the first `header` bytes plus a seeded sample of `n` across the rest of the file."""
    rng = random.Random(seed)
    return sorted({*range(min(header, size)), *rng.sample(range(header, size), min(n, size - header))})


def flipped(data: bytes, rng: random.Random, limit: int | None = None) -> bytes:
    """`data` with 1 to 3 random bytes XOR-ed with a random non-zero value (within the first `limit` bytes)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        out[rng.randrange(limit or len(out))] ^= rng.randint(1, 255)
    return bytes(out)


# ------------------------------------------------------------------------------------------------------ hierarchy
def test_every_load_error_is_a_model_load_error_with_its_old_bases() -> None:
    for cls in (ModelFileNotFoundError, CorruptFileError, ModelConfigError, UnsupportedArchitectureError,
                WeightShapeError, MissingWeightError, UnsupportedTensorTypeError, InvalidLoadOptionError,
                TokenizerLoadError):
        assert issubclass(cls, ModelLoadError) and issubclass(cls, ModelError) and issubclass(cls, ValueError)
    assert issubclass(ModelFileNotFoundError, FileNotFoundError)
    assert issubclass(MissingWeightError, KeyError)
    assert issubclass(TokenizerLoadError, TokenizerError)
    assert issubclass(InvalidPromptError, TokenizerError) and not issubclass(InvalidPromptError, ModelLoadError)
    assert issubclass(InvalidPromptTypeError, TypeError) and issubclass(InvalidPromptTypeError, InvalidPromptError)
    assert str(MissingWeightError("tensor 'x' is missing")) == "tensor 'x' is missing"  # not KeyError's quoting


def test_bad_dtype_and_quant_are_named_errors(tmp_path: Path) -> None:
    d = write_hf(tmp_path / "m")
    msg = expect_load_error(lambda: load_model(d, dtype="float64", load_tokenizer=False), InvalidLoadOptionError,
                            "float64", "'float32'", "'bfloat16'")
    assert "dtype" in msg
    expect_load_error(lambda: load_model(d, dtype=["float32"], load_tokenizer=False), InvalidLoadOptionError)
    expect_load_error(lambda: load_model(d, quant="int3", load_tokenizer=False), InvalidLoadOptionError,
                      "int3", "'int8'", "'keep'")
    for quant in ("int8", "int4"):  # groups of 32 and a hidden size of 16: had been a bare ValueError
        expect_load_error(lambda q=quant: load_model(d, quant=q, load_tokenizer=False), InvalidLoadOptionError,
                          str(d), "hidden_size is 16, not a multiple of 32", "quant=None")


# ------------------------------------------------------------------------------------------------------ config.json
def test_tiny_checkpoints_load(tmp_path: Path) -> None:
    one = load_model(write_hf(tmp_path / "one", tokenizer=True))
    two = load_model(write_hf(tmp_path / "two", sharded=True), load_tokenizer=False)
    assert one.config == two.config and one.tokenizer is not None and two.tokenizer is None
    np.testing.assert_array_equal(np.asarray(one.params.layers.wqkv), np.asarray(two.params.layers.wqkv))
    m = load_model(write_gguf(tmp_path / "t.gguf"))
    assert m.config.vocab_size == 601 and m.tokenizer is not None and m.tokenizer.encode("hello")


@pytest.mark.parametrize("content", [b"", b"{", b'{"model_type": "llama", "hidden_size": 16,', b"\xff\xfe{}",
                                     b"[" * 100_000, b"nul"])
def test_config_json_not_json(tmp_path: Path, content: bytes) -> None:
    d = write_hf(tmp_path / "m")
    (d / "config.json").write_bytes(content)
    msg = expect_load_error(lambda: load_model(d, load_tokenizer=False), CorruptFileError, str(d / "config.json"))
    assert "not valid JSON" in msg


@pytest.mark.parametrize("content", ["[1, 2]", '"llama"', "null", "3"])
def test_config_json_not_an_object(tmp_path: Path, content: str) -> None:
    d = write_hf(tmp_path / "m")
    (d / "config.json").write_text(content)
    expect_load_error(lambda: load_model(d, load_tokenizer=False), ModelConfigError, str(d / "config.json"),
                      "JSON object")


_BAD_CONFIGS: dict[str, tuple[dict[str, Any], type[ModelLoadError], str]] = {
    "no hidden_size": ({"hidden_size": None}, ModelConfigError, "'hidden_size' is missing"),
    "no num_hidden_layers": ({"num_hidden_layers": None}, ModelConfigError, "'num_hidden_layers' is missing"),
    "no vocab_size": ({"vocab_size": None}, ModelConfigError, "'vocab_size' is missing"),
    "no num_attention_heads": ({"num_attention_heads": None}, ModelConfigError, "'num_attention_heads' is missing"),
    "hidden_size a string": ({"hidden_size": "big"}, ModelConfigError,
                             "'hidden_size' must be a positive integer, got 'big'"),
    "hidden_size a numeric string": ({"hidden_size": "16"}, ModelConfigError, "'hidden_size' must be a positive"),
    "hidden_size zero": ({"hidden_size": 0}, ModelConfigError, "'hidden_size' must be a positive integer, got 0"),
    "vocab_size negative": ({"vocab_size": -32}, ModelConfigError, "'vocab_size' must be a positive integer, got -32"),
    "layers fractional": ({"num_hidden_layers": 2.5}, ModelConfigError, "'num_hidden_layers' must be a positive"),
    "layers a bool": ({"num_hidden_layers": True}, ModelConfigError, "'num_hidden_layers' must be a positive"),
    "intermediate_size a list": ({"intermediate_size": [24]}, ModelConfigError, "'intermediate_size' must be"),
    "heads not a multiple of kv heads": ({"num_key_value_heads": 3}, ModelConfigError,
                                         r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    "kv heads zero": ({"num_key_value_heads": 0}, ModelConfigError, "'num_key_value_heads' must be a positive"),
    "hidden not divisible by heads": ({"hidden_size": 18}, ModelConfigError,
                                      r"hidden_size \(18\) is not divisible by num_attention_heads \(4\).*head_dim"),
    "head_dim a string": ({"head_dim": "4"}, ModelConfigError, "'head_dim' must be"),
    # odd head sizes: rotary embeddings pair the dimensions (they had loaded, then failed every step)
    "odd head size": ({"hidden_size": 20}, ModelConfigError,
                      r"head size \(hidden_size / num_attention_heads = 20 / 4\) is 5, odd"),
    "odd head_dim": ({"head_dim": 5}, ModelConfigError, r"head size \(head_dim\) is 5, odd"),
    "rms_norm_eps a string": ({"rms_norm_eps": "1e-5"}, ModelConfigError, "'rms_norm_eps' must be a positive number"),
    "rms_norm_eps negative": ({"rms_norm_eps": -1.0}, ModelConfigError, "'rms_norm_eps' must be a positive number"),
    "rope_theta zero": ({"rope_theta": 0}, ModelConfigError, "'rope_theta' must be a positive number"),
    "rope_scaling a string": ({"rope_scaling": "linear"}, ModelConfigError, "'rope_scaling' must be an object"),
    "rope factor a string": ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, ModelConfigError,
                             "'factor' must be a positive number"),
    "tie flag a string": ({"tie_word_embeddings": "yes"}, ModelConfigError,
                          "'tie_word_embeddings' must be true or false"),
    "eos a string": ({"eos_token_id": "</s>"}, ModelConfigError, "'eos_token_id' must be a token id"),
    "eos list with a string": ({"eos_token_id": [2, "x"]}, ModelConfigError, "'eos_token_id' must be a token id"),
    "bos a list": ({"bos_token_id": [1]}, ModelConfigError, "'bos_token_id' must be a token id"),
    "sliding window a string": ({"model_type": "mistral", "sliding_window": "4k"}, ModelConfigError,
                                "'sliding_window' must be a positive integer"),
    "unknown model_type": ({"model_type": "gpt_neox"}, UnsupportedArchitectureError, "model_type 'gpt_neox'"),
    "no model_type": ({"model_type": None}, UnsupportedArchitectureError, "model_type None"),
    "gelu": ({"hidden_act": "gelu"}, UnsupportedArchitectureError, "hidden_act 'gelu'"),
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedArchitectureError, "yarn"),
}


@pytest.mark.parametrize("case", list(_BAD_CONFIGS))
def test_config_json_bad_values(tmp_path: Path, case: str) -> None:
    patch, cls, pattern = _BAD_CONFIGS[case]
    cfg = {k: v for k, v in {**CONFIG, **patch}.items() if v is not None}
    d = write_hf(tmp_path / "m", config=cfg)
    msg = expect_load_error(lambda: load_model(d, load_tokenizer=False), cls, str(d / "config.json"))
    assert re.search(pattern, msg), msg
    with pytest.raises(cls, match=pattern):  # the dict API says the same, naming "config.json"
        ModelConfig.from_hf(cfg)


def test_config_json_integral_floats_and_nulls_are_accepted(tmp_path: Path) -> None:
    cfg = {**CONFIG, "hidden_size": 16.0, "head_dim": None, "rope_scaling": None, "sliding_window": None,
           "bos_token_id": -1, "eos_token_id": [2, -1, 3]}
    got = load_model(write_hf(tmp_path / "m", config=cfg), load_tokenizer=False).config
    assert got.hidden_size == 16 and got.bos_token_id is None and got.eos_token_ids == (2, 3)


# ------------------------------------------------------------------------------------------------ safetensors files
@pytest.mark.parametrize("content", [b"", b"\x00" * 7, b"garbage, not a safetensors file at all",
                                     b"\xff" * 8 + b"{}", b"\x04\x00\x00\x00\x00\x00\x00\x00{}"])
def test_garbage_safetensors(tmp_path: Path, content: bytes) -> None:
    d = write_hf(tmp_path / "m")
    (d / "model.safetensors").write_bytes(content)
    msg = expect_load_error(lambda: load_model(d, load_tokenizer=False), CorruptFileError,
                            str(d / "model.safetensors"))
    assert "not a safetensors file" in msg


def test_wrong_shape_names_the_file_and_tensor(tmp_path: Path) -> None:
    sd = hf_state_dict()
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"][:20]
    d = write_hf(tmp_path / "m", sd=sd)
    msg = expect_load_error(lambda: load_model(d, load_tokenizer=False), WeightShapeError, str(d / "model.safetensors"),
                            "model.layers.1.mlp.up_proj.weight", "(20, 16)", "config.json")
    assert msg.count(str(d)) == 1


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_, np.int64])
def test_non_float_tensor(tmp_path: Path, dtype: type) -> None:
    sd = hf_state_dict()
    sd["model.norm.weight"] = np.ones(16, dtype)
    d = write_hf(tmp_path / "m", sd=sd)
    expect_load_error(lambda: load_model(d, load_tokenizer=False), WeightShapeError, str(d / "model.safetensors"),
                      "model.norm.weight", "floating point")


def test_missing_tensor_names_the_directory_and_files(tmp_path: Path) -> None:
    sd = hf_state_dict()
    del sd["model.layers.0.self_attn.k_proj.weight"]
    d = write_hf(tmp_path / "m", sd=sd)
    with pytest.raises(KeyError):  # still a KeyError for old callers
        load_model(d, load_tokenizer=False)
    expect_load_error(lambda: load_model(d, load_tokenizer=False), MissingWeightError, str(d), "model.safetensors",
                      "model.layers.0.self_attn.k_proj.weight", "config.json")


def test_no_safetensors_files(tmp_path: Path) -> None:
    d = write_hf(tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError):
        load_model(d, load_tokenizer=False)
    expect_load_error(lambda: load_model(d, load_tokenizer=False), ModelFileNotFoundError, str(d), ".safetensors")


def test_missing_config_json(tmp_path: Path) -> None:
    d = write_hf(tmp_path / "m")
    (d / "config.json").unlink()
    expect_load_error(lambda: load_model(d, load_tokenizer=False), ModelFileNotFoundError, str(d / "config.json"))


# ------------------------------------------------------------------------------------------------ sharded checkpoints
INDEX = "model.safetensors.index.json"


@pytest.mark.parametrize("content", ["{", "", "\xff"])
def test_index_not_json(tmp_path: Path, content: str) -> None:
    d = write_hf(tmp_path / "m", sharded=True)
    (d / INDEX).write_text(content, encoding="latin-1")
    expect_load_error(lambda: load_model(d, load_tokenizer=False), CorruptFileError, str(d / INDEX), "JSON")


@pytest.mark.parametrize("content", [{"metadata": {}}, [], {"weight_map": []}, {"weight_map": {}},
                                     {"weight_map": {"model.norm.weight": 3}}])
def test_index_without_a_weight_map(tmp_path: Path, content: Any) -> None:
    d = write_hf(tmp_path / "m", sharded=True)
    (d / INDEX).write_text(json.dumps(content))
    expect_load_error(lambda: load_model(d, load_tokenizer=False), CorruptFileError, str(d / INDEX), "weight_map")


def test_index_names_a_missing_shard(tmp_path: Path) -> None:
    d = write_hf(tmp_path / "m", sharded=True)
    (d / "model-00002-of-00002.safetensors").unlink()
    expect_load_error(lambda: load_model(d, load_tokenizer=False), ModelFileNotFoundError, str(d / INDEX),
                      "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "sub/../../x.safetensors", ""])
def test_index_naming_a_shard_outside_the_directory_is_corrupt(tmp_path: Path, shard: str) -> None:
    """(An absolute or climbing path had been followed; an empty name reported as a blank missing shard.)"""
    d = write_hf(tmp_path / "m", sharded=True)
    index = json.loads((d / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (d / INDEX).write_text(json.dumps(index))
    expect_load_error(lambda: load_model(d, load_tokenizer=False), CorruptFileError, str(d / INDEX),
                      f"names shard {shard!r}, which is no file name inside")


def test_a_directory_where_a_file_belongs_is_named_as_such(tmp_path: Path) -> None:
    """config.json, the index or a tokenizer file that is a directory is an error saying so (had been "not found",
    or skipped: the model loaded without its index or tokenizer); so is a directory named like a GGUF file."""
    d = write_hf(tmp_path / "m", tokenizer=True)
    (d / INDEX).mkdir()
    expect_load_error(lambda: load_model(d), CorruptFileError, str(d / INDEX), "is not a file")
    (d / INDEX).rmdir()
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").mkdir()
    expect_load_error(lambda: load_model(d), TokenizerLoadError, str(d / "tokenizer.json"), "is not a file")
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    expect_load_error(lambda: load_model(d), ModelFileNotFoundError, str(d / "config.json"), "is not a file")
    (tmp_path / "x.gguf").mkdir()
    expect_load_error(lambda: load_model(str(tmp_path / "x.gguf")), ModelFileNotFoundError, "x.gguf is a directory")


@pytest.mark.parametrize("wrong", ["other shard", "no shard"])
def test_index_names_the_wrong_shard(tmp_path: Path, wrong: str) -> None:
    d = write_hf(tmp_path / "m", sharded=True)
    index = json.loads((d / INDEX).read_text())
    name = "model.norm.weight" if wrong == "other shard" else "model.layers.9.mlp.up_proj.weight"
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    other = first if index["weight_map"].get(name) == second else second
    index["weight_map"][name] = other
    (d / INDEX).write_text(json.dumps(index))
    expect_load_error(lambda: load_model(d, load_tokenizer=False), CorruptFileError, str(d / INDEX), name, other)


def test_truncated_shard_names_the_shard(tmp_path: Path) -> None:
    d = write_hf(tmp_path / "m", sharded=True)
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])
    expect_load_error(lambda: load_model(d, load_tokenizer=False), CorruptFileError, str(shard), "truncated")


# ------------------------------------------------------------------------------------------------------ HF fuzzing
@pytest.mark.parametrize("file", ["config.json", "model.safetensors"])
def test_hf_files_truncated_anywhere(tmp_path: Path, file: str) -> None:
    d = write_hf(tmp_path / "m")
    path = d / file
    data = path.read_bytes()
    header = 16 if file == "config.json" else int.from_bytes(data[:8], "little") + 8  # safetensors: JSON header
    seen = set()
    for n in truncation_offsets(len(data), min(header, 64), n=30):
        path.write_bytes(data[:n])
        seen.add(outcome(lambda: load_model(d, load_tokenizer=False), str(path)))
    assert "ok" not in seen  # no prefix of either file is a complete one


@pytest.mark.parametrize("file", ["config.json", "model.safetensors"])
def test_hf_files_with_flipped_bytes(tmp_path: Path, file: str) -> None:
    d = write_hf(tmp_path / "m")
    path = d / file
    data = path.read_bytes()
    # safetensors: mostly the JSON header (flips in the tensor bytes only change values, which must load fine)
    limit = None if file == "config.json" else int.from_bytes(data[:8], "little") + 8
    rng = random.Random(1)
    seen = set()
    for i in range(40):
        path.write_bytes(flipped(data, rng, None if i % 4 == 0 else limit))
        # a flip in config.json can surface as a shape error in the shard, whose message blames config.json
        seen.add(outcome(lambda: load_model(d, load_tokenizer=False), file))
    assert len(seen) > 1


# ------------------------------------------------------------------------------------------------------------ GGUF
def test_gguf_corrupted_magic_and_version(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(b"GGUX" + data[4:])
    expect_load_error(lambda: load_model(path), CorruptFileError, str(path), "magic")
    for version, cls in ((1, ModelLoadError), (4, CorruptFileError), (0xFFFF, CorruptFileError)):
        path.write_bytes(data[:4] + version.to_bytes(4, "little") + data[8:])
        expect_load_error(lambda: load_model(path), cls, str(path), "version")


@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
                                 "llama.attention.head_count"])
def test_gguf_missing_architecture_key(tmp_path: Path, key: str) -> None:
    path = write_gguf(tmp_path / "t.gguf", arch_keys=False, kv=lambda w: [
        w.add_uint32(k, v) for k, v in {"llama.embedding_length": GGUF_HIDDEN, "llama.block_count": 1,
                                        "llama.feed_forward_length": GGUF_INTER,
                                        "llama.attention.head_count": GGUF_HEADS}.items() if k != key])
    expect_load_error(lambda: load_model(path), ModelConfigError, str(path), key, "missing")


def test_gguf_missing_architecture(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes().replace(b"general.architecture", b"general.architecturX")
    path.write_bytes(data)
    expect_load_error(lambda: load_model(path), UnsupportedArchitectureError, str(path), "architecture None")


_BAD_METADATA: dict[str, tuple[Callable[[gguf.GGUFWriter], Any], type[ModelLoadError], str]] = {
    "embedding_length a string": (lambda w: w.add_string("llama.embedding_length", "big"), ModelConfigError,
                                  "'llama.embedding_length' must be a positive integer, got 'big'"),
    "block_count zero": (lambda w: w.add_uint32("llama.block_count", 0), ModelConfigError,
                         "'llama.block_count' must be a positive integer, got 0"),
    "head_count a float": (lambda w: w.add_float32("llama.attention.head_count", 2.5), ModelConfigError,
                           "head_count"),
    # the q/k un-permute at read time meets the inconsistency before the config check does; either says so
    "head_count not a multiple of kv": (lambda w: w.add_uint32("llama.attention.head_count_kv", 3), ModelLoadError,
                                        "must be a multiple of|un-permute"),
    "rms eps a string": (lambda w: w.add_string("llama.attention.layer_norm_rms_epsilon", "tiny"), ModelConfigError,
                         "layer_norm_rms_epsilon"),
    "architecture unsupported": (lambda w: w.add_string("general.architecture", "gemma"),
                                 UnsupportedArchitectureError, "'gemma'"),
    "tokens not strings": (lambda w: w.add_array("tokenizer.ggml.tokens", list(range(601))), TokenizerLoadError,
                           "tokenizer.ggml.tokens must be an array of strings"),
    "token types not integers": (lambda w: w.add_array("tokenizer.ggml.token_type", ["x"] * 601),
                                 TokenizerLoadError, "token_type must be an array of integers"),
    "merges out of vocabulary": (lambda w: w.add_array("tokenizer.ggml.merges", ["Ġ zzz"]), TokenizerLoadError,
                                 "does not form a valid 'gpt2' tokenizer"),
    "merges not strings": (lambda w: w.add_array("tokenizer.ggml.merges", [1, 2]), TokenizerLoadError,
                           "merges must be an array of strings"),
    "bos id a string": (lambda w: w.add_string("tokenizer.ggml.bos_token_id", "<s>"), ModelConfigError,
                        "bos_token_id' must be a token id"),
    "padding id a string": (lambda w: w.add_string("tokenizer.ggml.padding_token_id", "<pad>"), TokenizerLoadError,
                            "padding_token_id must be a token id"),
    "unsupported tokenizer model": (lambda w: w.add_string("tokenizer.ggml.model", "bert"), TokenizerLoadError,
                                    "'bert' is not supported"),
    "chat template does not parse": (lambda w: w.add_string("tokenizer.chat_template", "{% for m in messages %}"),
                                     TokenizerLoadError, "tokenizer.chat_template: the chat template does not parse"),
    "chat template not a string": (lambda w: w.add_uint32("tokenizer.chat_template", 7), TokenizerLoadError,
                                   "chat_template must be a string"),
}


def _override(fill: Callable[[gguf.GGUFWriter], Any]) -> Callable[[gguf.GGUFWriter], None]:
    """A metadata writer that replaces keys `write_gguf` already added (GGUFWriter refuses duplicates)."""

    def kv(w: gguf.GGUFWriter) -> None:
        before = dict(w.kv_data[0])
        w.kv_data[0].clear()
        fill(w)
        new = dict(w.kv_data[0])
        w.kv_data[0].clear()
        w.kv_data[0].update({**before, **new})

    return kv


@pytest.mark.parametrize("case", list(_BAD_METADATA))
def test_gguf_bad_metadata(tmp_path: Path, case: str) -> None:
    fill, cls, pattern = _BAD_METADATA[case]
    path = write_gguf(tmp_path / "t.gguf", kv=_override(fill))
    msg = expect_load_error(lambda: load_model(path), cls, str(path))
    assert re.search(pattern, msg), msg


def test_gguf_wrong_tensor_shape(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", tensors={"blk.0.ffn_up.weight": (np.ones((GGUF_INTER, 16), np.float32),
                                                                           None)})
    expect_load_error(lambda: load_model(path, load_tokenizer=False), WeightShapeError, str(path),
                      "model.layers.0.mlp.up_proj.weight")


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf")
    data = path.read_bytes().replace(b"blk.0.ffn_up.weight", b"blk.0.ffn_uq.weight")
    path.write_bytes(data)
    expect_load_error(lambda: load_model(path, load_tokenizer=False), MissingWeightError, str(path),
                      "model.layers.0.mlp.up_proj.weight")


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", tensors={"blk.0.ffn_up.weight": (np.zeros((GGUF_INTER, 210), np.uint8),
                                                                           QT.Q6_K)})
    expect_load_error(lambda: load_model(path, load_tokenizer=False), UnsupportedTensorTypeError, str(path), "Q6_K")


def test_gguf_tensor_data_offset_past_the_end(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf")
    info = read_gguf_file(path, map_tensors=False)
    last = max(info.tensors, key=lambda t: t.data_offset)
    data = bytearray(path.read_bytes())
    # the tensor info's relative offset (uint64) is the last field before the next info, or before the data padding
    name = last.name.encode()
    at = data.index(name) + len(name) + 4 + 8 * len(last.shape) + 4
    rel = last.data_offset - info.data_offset
    assert int.from_bytes(data[at:at + 8], "little") == rel
    data[at:at + 8] = (rel + 4096).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    expect_load_error(lambda: load_model(path), CorruptFileError, str(path), last.name, "past the end")


def test_gguf_bad_head_count_for_the_qk_unpermute(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", kv=_override(lambda w: w.add_uint32("llama.attention.head_count", 3)))
    # load_model checks the config before it reads a tensor; the reader alone names the tensor it cannot un-permute
    expect_load_error(lambda: load_model(path), ModelConfigError, str(path), "llama.attention.head_count (3)")
    expect_load_error(lambda: read_gguf(path).tensors["model.layers.0.self_attn.q_proj.weight"], WeightShapeError,
                      str(path), "blk.0.attn_q.weight", "un-permute")


def _gguf_regions(path: Path) -> tuple[int, int, int, int]:
    """End of the metadata, of the tensor infos, start of the data section, and end of the last tensor's data."""
    f = read_gguf_file(path, map_tensors=False)
    data = path.read_bytes()
    first = f.tensors[0].name.encode()
    infos_start = data.index(len(first).to_bytes(8, "little") + first)
    return infos_start, f.data_offset - 1, f.data_offset, max(t.data_offset + t.n_bytes for t in f.tensors)


def test_gguf_truncated_in_every_region(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf")
    data = path.read_bytes()
    meta_end, infos_end, data_start, needed = _gguf_regions(path)
    rng = random.Random(2)
    offsets = set(truncation_offsets(needed, 32, n=20, seed=3))
    offsets |= {*rng.sample(range(32, meta_end), 8), *rng.sample(range(meta_end, infos_end), 8), data_start,
                needed - 1}
    seen = {}
    for n in sorted(offsets):
        path.write_bytes(data[:n])
        seen[n] = outcome(lambda: load_model(path), str(path))
        for read in (read_gguf_file, read_gguf_metadata) if n < infos_end else ():  # the reader's own API too
            assert outcome(lambda read=read: read(path), str(path)) == "CorruptFileError"
    assert set(seen.values()) == {"CorruptFileError"}, seen


def test_gguf_with_flipped_bytes(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf")
    data = path.read_bytes()
    meta_end, infos_end, data_start, _ = _gguf_regions(path)
    rng = random.Random(4)
    seen: dict[str, int] = {}
    for i in range(48):
        # a third each: the fixed header and metadata, the tensor infos, anywhere
        limit = (meta_end, data_start, None)[i % 3]
        corrupt = bytearray(flipped(data, rng, limit))
        if i % 3 == 1:  # keep the flips inside the tensor infos
            corrupt = bytearray(data[:meta_end]) + corrupt[meta_end:infos_end] + bytearray(data[infos_end:])
        path.write_bytes(bytes(corrupt))
        kind = outcome(lambda: load_model(path), str(path))
        seen[kind] = seen.get(kind, 0) + 1
    assert len(seen) > 2, seen


# ------------------------------------------------------------------------------------------------------- tokenizers
def test_missing_tokenizer_is_none(tmp_path: Path) -> None:
    # Documented: a directory without tokenizer.json / tokenizer.model loads with tokenizer=None.
    d = write_hf(tmp_path / "m")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert load_model(d).tokenizer is None


@pytest.mark.parametrize("content", [b"{not json", b"", b'{"a": 1}', b"[]", b"\xff\xfe\x00", b'{"model": {}}'])
def test_corrupt_tokenizer_json(tmp_path: Path, content: bytes) -> None:
    d = write_hf(tmp_path / "m", tokenizer=True)
    (d / "tokenizer.json").write_bytes(content)
    expect_load_error(lambda: load_model(d), TokenizerLoadError, str(d / "tokenizer.json"), "not a valid")


def test_corrupt_tokenizer_model(tmp_path: Path) -> None:
    d = write_hf(tmp_path / "m")
    for content in (b"", b"\x00garbage", SP_MODEL.read_bytes()[:100], b"\x0a\xff\xff\xff\xff\x0f"):
        (d / "tokenizer.model").write_bytes(content)
        expect_load_error(lambda: load_model(d), TokenizerLoadError, str(d / "tokenizer.model"), "sentencepiece")


_BAD_TOKENIZER_CONFIGS: dict[str, tuple[str, str | bytes, str]] = {
    "not json": ("tokenizer_config.json", "{", "Could not read"),
    "not utf-8": ("tokenizer_config.json", b'{"a": "\xff"}', "Could not read"),
    "not an object": ("tokenizer_config.json", "[]", "JSON object"),
    "bos a number": ("tokenizer_config.json", json.dumps({"bos_token": 5}), "bos_token must be a string"),
    "eos content not a string": ("tokenizer_config.json", json.dumps({"eos_token": {"content": 1}}),
                                 "eos_token must be a string"),
    "eos not in vocabulary": ("tokenizer_config.json", json.dumps({"eos_token": "<nope>"}), "not in the vocabulary"),
    "add_bos a string": ("tokenizer_config.json", json.dumps({"add_bos_token": "yes"}), "add_bos_token must be true"),
    "template a number": ("tokenizer_config.json", json.dumps({"chat_template": 3}), "chat_template must be a string"),
    "template list without templates": ("tokenizer_config.json", json.dumps({"chat_template": [{"name": "x"}]}),
                                        "chat_template must be a string"),
    "template does not parse": ("tokenizer_config.json", json.dumps({"chat_template": "{% if %}"}),
                                "the chat template does not parse"),
    "jinja file does not parse": ("chat_template.jinja", "{{ messages", "the chat template does not parse"),
    "jinja file not utf-8": ("chat_template.jinja", b"\xff{{ x }}", "Could not read"),
    "json template file": ("chat_template.json", json.dumps({"chat_template": "{% endfor %}"}),
                           "the chat template does not parse"),
    "special tokens map": ("special_tokens_map.json", "{", "Could not read"),
}


@pytest.mark.parametrize("case", list(_BAD_TOKENIZER_CONFIGS))
@pytest.mark.parametrize("kind", ["tokenizer.json", "tokenizer.model"])
def test_bad_tokenizer_config_files(tmp_path: Path, case: str, kind: str) -> None:
    file, content, pattern = _BAD_TOKENIZER_CONFIGS[case]
    d = write_hf(tmp_path / "m")
    if kind == "tokenizer.json":
        shutil.copy(BPE_DIR / "tokenizer.json", d / "tokenizer.json")
    else:
        shutil.copy(SP_MODEL, d / "tokenizer.model")
    if file != "tokenizer_config.json":
        shutil.copy(BPE_DIR / "tokenizer_config.json", d / "tokenizer_config.json")
        if kind == "tokenizer.model":  # its tokens are not the sentencepiece model's
            (d / "tokenizer_config.json").write_text("{}")
    path = d / file
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    # a token missing from the vocabulary is blamed on the vocabulary file and tokenizer_config.json together
    names = [str(d / kind), file] if case == "eos not in vocabulary" else [str(path)]
    expect_load_error(lambda: load_model(d), TokenizerLoadError, *names, pattern)
    with pytest.raises(TokenizerLoadError):
        load_tokenizer_from_dir(d)


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer.model"])
def test_tokenizer_files_truncated_and_flipped(tmp_path: Path, file: str) -> None:
    d = write_hf(tmp_path / "m")
    path = d / file
    data = (BPE_DIR / "tokenizer.json" if file == "tokenizer.json" else SP_MODEL).read_bytes()
    rng = random.Random(5)
    seen = set()
    for n in truncation_offsets(len(data), 8, n=12, seed=6):
        path.write_bytes(data[:n])
        seen.add(outcome(lambda: load_tokenizer_from_dir(d), str(path)))
    for _ in range(24):
        path.write_bytes(flipped(data, rng))
        seen.add(outcome(lambda: load_tokenizer_from_dir(d), str(path)))
    assert "TokenizerLoadError" in seen


# ------------------------------------------------------------------------------------------------ encode() inputs
@pytest.fixture(scope="module")
def tokenizers_of_every_kind(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    from tests.models.test_tokenizer import _sp_gguf_metadata  # the sentencepiece vocabulary as GGUF "llama"

    folder = tmp_path_factory.mktemp("toks")
    bpe_gguf = write_gguf(folder / "bpe.gguf", arch_keys=False)
    return {
        "tokenizer.json": load_tokenizer_from_dir(BPE_DIR),
        "sentencepiece": Tokenizer.from_sentencepiece(SP_MODEL),
        "gguf gpt2": Tokenizer.from_gguf_metadata(read_gguf_metadata(bpe_gguf)),
        "gguf llama": Tokenizer.from_gguf_metadata(_sp_gguf_metadata(folder)),
    }


@pytest.mark.parametrize("kind", ["tokenizer.json", "sentencepiece", "gguf gpt2", "gguf llama"])
@pytest.mark.parametrize("text, index, code", [("abc\ud800def", 3, "U+D800"), ("\udcff", 0, "U+DCFF"),
                                                ("é😀\udc80 x", 2, "U+DC80"), ("ok \udfff", 3, "U+DFFF")])
def test_encode_lone_surrogate(tokenizers_of_every_kind: dict[str, Tokenizer], kind: str, text: str, index: int,
                               code: str) -> None:
    tok = tokenizers_of_every_kind[kind]
    for special in (False, True):
        with pytest.raises(InvalidPromptError) as info:
            tok.encode(text, encode_special_tokens=special)
        assert isinstance(info.value, TokenizerError) and isinstance(info.value, ValueError)
        assert not isinstance(info.value, TypeError)
        msg = str(info.value)
        assert f"character index {index}" in msg and code in msg and "remove it or pass valid Unicode" in msg
    assert tok.decode(tok.encode("abc def")) == "abc def"  # still usable


@pytest.mark.parametrize("kind", ["tokenizer.json", "sentencepiece", "gguf gpt2", "gguf llama"])
@pytest.mark.parametrize("value", [b"abc", None, 5, ["a", "b"]])
def test_encode_non_str(tokenizers_of_every_kind: dict[str, Tokenizer], kind: str, value: Any) -> None:
    with pytest.raises(InvalidPromptTypeError, match=f"takes a str, got {type(value).__name__}") as info:
        tokenizers_of_every_kind[kind].encode(value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, TokenizerError)
