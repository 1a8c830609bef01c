"""What a checkpoint means, as transformers and llama.cpp read it: Qwen2's per-layer sliding window, the legacy
`rope_scaling` against `rope_parameters`, a llama GGUF's optional biases and its llama3 `rope_freqs.weight`, which
file a source names, and the checkpoints that must be refused rather than loaded wrong (quantized ones, tensors of
layers the config lacks, a tensor in two files). Each once loaded silently with other weights or other attention."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models import ModelConfig, load_model
from models.errors import (
    CorruptFileError,
    InvalidLoadOptionError,
    ModelConfigError,
    ModelFileNotFoundError,
    UnsupportedArchitectureError,
)
from models.llama import forward
from tests.models.test_load_errors import CONFIG, hf_state_dict, write_gguf, write_hf

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5)
IDS = np.random.default_rng(1).integers(0, 128, size=(1, 24))


def hf_pair(tmp_path: Path, cfg_cls: str, model_cls: str, **extra):
    """A tiny random transformers model saved to `tmp_path`, and its logits on IDS."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = model(torch.tensor(IDS)).logits.float().numpy()
    return model, ref


def our_logits(model) -> np.ndarray:
    return np.asarray(forward(model.params, model.config, jnp.asarray(IDS, jnp.int32)))


def close(got: np.ndarray, ref: np.ndarray) -> bool:
    return float(np.abs(got - ref).max()) < 1e-4 * float(np.abs(ref).max())


# ------------------------------------------------------------------------------------------------ config semantics
def qwen2(**extra) -> dict:
    return {**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, **extra}


def test_qwen2_slides_only_on_the_layers_transformers_slides():
    """use_sliding_window alone: the layers from max_window_layers (default 28) on slide, so a 2-layer model has
    full attention; every layer from 0: the window; a mix, from max_window_layers or layer_types: refused."""
    assert ModelConfig.from_hf(qwen2()).sliding_window is None
    assert ModelConfig.from_hf(qwen2(max_window_layers=0)).sliding_window == 4
    assert ModelConfig.from_hf(qwen2(layer_types=["sliding_attention"] * 2)).sliding_window == 4
    assert ModelConfig.from_hf(qwen2(layer_types=["full_attention"] * 2)).sliding_window is None
    assert ModelConfig.from_hf(qwen2(use_sliding_window=False, max_window_layers=0)).sliding_window is None
    for mixed in (qwen2(max_window_layers=1), qwen2(layer_types=["full_attention", "sliding_attention"])):
        with pytest.raises(UnsupportedArchitectureError, match="only some layers"):
            ModelConfig.from_hf(mixed)
    with pytest.raises(ModelConfigError, match="layer_types"):
        ModelConfig.from_hf(qwen2(layer_types=["sliding"] * 2))


def test_legacy_rope_scaling_wins_over_rope_parameters():
    cfg = {**BASE, "model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
           "rope_scaling": {"type": "linear", "factor": 4.0}}
    scaling = ModelConfig.from_hf(cfg).rope_scaling
    assert (scaling.rope_type, scaling.factor) == ("linear", 4.0)
    cfg = {**BASE, "model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    assert ModelConfig.from_hf(cfg).rope_scaling.rope_type == "linear"


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq"])
def test_a_quantized_hf_checkpoint_is_refused_by_name(tmp_path: Path, method: str):
    write_hf(tmp_path, config={**CONFIG, "quantization_config": {"quant_method": method}})
    with pytest.raises(UnsupportedArchitectureError, match=f"quantized .*'{method}'.*float"):
        load_model(tmp_path, load_tokenizer=False)


# ---------------------------------------------------------------------------------------- what the weights hold
def test_tensors_of_layers_the_config_lacks_are_refused(tmp_path: Path):
    write_hf(tmp_path, config={**CONFIG, "num_hidden_layers": 1})  # the weights hold two layers
    with pytest.raises(ModelConfigError, match="layer 1 .*config has 1 layers"):
        load_model(tmp_path, load_tokenizer=False)


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path: Path):
    write_hf(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    save_file({"model.layers.0.self_attn.q_proj.weight": np.zeros_like(sd["model.layers.0.self_attn.q_proj.weight"])},
              str(tmp_path / "model_zero.safetensors"))
    with pytest.raises(CorruptFileError, match="q_proj.weight' is in both .*remove the stray file"):
        load_model(tmp_path, load_tokenizer=False)


# ---------------------------------------------------------------------------------------------- which file a source is
def test_an_existing_path_wins_over_the_embedded_name(tmp_path: Path, monkeypatch):
    """A directory named like the embedded model (`huggingface-cli download ... --local-dir SmolLM2-135M`) is that
    directory, not the embedded GGUF."""
    write_hf(tmp_path / "SmolLM2-135M")
    monkeypatch.chdir(tmp_path)
    assert load_model("SmolLM2-135M", load_tokenizer=False).config.num_layers == CONFIG["num_hidden_layers"]


def test_a_gguf_file_is_found_by_its_magic_bytes(tmp_path: Path):
    gguf_file = write_gguf(tmp_path / "m.gguf")
    for name in ("M.GGUF", "model-q8"):
        shutil.copy(gguf_file, tmp_path / name)
        assert load_model(tmp_path / name).config.num_layers == 1
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelFileNotFoundError, match="is a file but not a GGUF file"):
        load_model(tmp_path / "notes.txt")


def test_an_empty_preset_suffix_is_an_error():
    with pytest.raises(InvalidLoadOptionError, match="weight format ''"):
        load_model("preset:smollm2-135m@")


def test_the_models_stop_ids_include_the_configs_eos_list(tmp_path: Path):
    write_hf(tmp_path, tokenizer=True, config={**CONFIG, "eos_token_id": [3, 2]})
    model = load_model(tmp_path)
    assert model.tokenizer.eos_token_id is not None
    assert model.stop_token_ids == sorted({model.tokenizer.eos_token_id, 3, 2})


# ------------------------------------------------------------------------------- against transformers (slow tier)
@pytest.mark.slow
def test_qwen2_with_an_unused_sliding_window_matches_transformers(tmp_path: Path):
    _, ref = hf_pair(tmp_path, "Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=4)
    assert close(our_logits(load_model(tmp_path, load_tokenizer=False)), ref)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the reader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf_dir: Path, out: Path, rope_freqs: np.ndarray | None = None) -> Path:
    """An HF Llama directory as llama.cpp's convert_hf_to_gguf.py writes it: F32 tensors under GGUF names, q/k rows
    permuted, biases as `blk.N.*.bias`, llama3 scaling as a `rope_freqs.weight` tensor and no scaling key."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))))
    w.add_vocab_size(cfg["vocab_size"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    stems = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in sd.items():
        t = t.astype(np.float32)
        if name in top:
            w.add_tensor(top[name], t)
            continue
        parts = name.split(".")
        stem = ".".join(parts[3:5]) if parts[3] in ("self_attn", "mlp") else parts[3]
        if stem in ("self_attn.q_proj", "self_attn.k_proj"):
            t = permute(t, nh if stem == "self_attn.q_proj" else nkv)
        w.add_tensor(f"blk.{parts[2]}.{stems[stem]}.{parts[-1]}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.slow
def test_a_llama_gguf_with_biases_keeps_them(tmp_path: Path):
    """llama.cpp reads a llama GGUF's attention and MLP biases where the file has them; they had been dropped."""
    import torch

    hf, _ = hf_pair(tmp_path / "hf", "LlamaConfig", "LlamaForCausalLM", attention_bias=True, mlp_bias=True)
    with torch.no_grad():  # (transformers initialises biases to zero)
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5)
        hf.save_pretrained(tmp_path / "hf")
        ref = hf(torch.tensor(IDS)).logits.float().numpy()
    model = load_model(write_llama_gguf(tmp_path / "hf", tmp_path / "b.gguf"), load_tokenizer=False)
    assert (model.config.qkv_bias, model.config.o_bias, model.config.mlp_bias) == (True, True, True)
    assert close(our_logits(model), ref)


@pytest.mark.slow
def test_a_llama3_gguf_applies_its_rope_freqs(tmp_path: Path):
    """Llama 3.1 / 3.2 GGUFs carry llama3 scaling as `rope_freqs.weight` (per-frequency divisors) and no scaling
    key; ignoring it had made the low frequencies 8x too high."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    _, ref = hf_pair(tmp_path / "hf", "LlamaConfig", "LlamaForCausalLM", rope_scaling=rope)
    d = BASE["hidden_size"] // BASE["num_attention_heads"]
    factors = []
    for inv in 1.0 / (10000.0 ** (np.arange(0, d, 2) / d)):  # convert_hf_to_gguf.py's rope factors
        wavelen = 2 * math.pi / inv
        if wavelen < 16 / 4.0:
            factors.append(1.0)
        elif wavelen > 16 / 1.0:
            factors.append(8.0)
        else:
            smooth = (16 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    model = load_model(write_llama_gguf(tmp_path / "hf", tmp_path / "l3.gguf", np.asarray(factors)),
                       load_tokenizer=False)
    assert model.config.rope_scaling.freq_factors is not None
    assert close(our_logits(model), ref)
    with pytest.raises(ModelConfigError, match="rope_freqs.weight must hold"):
        load_model(write_llama_gguf(tmp_path / "hf", tmp_path / "bad.gguf", np.ones(3)), load_tokenizer=False)



def test_a_gguf_is_never_held_dequantized_whole(tmp_path: Path):
    """Its tensors are converted as the loader reads them (`models.gguf_reader.LazyTensors`) and the layers are
    stacked into one array as they come: the host memory numpy holds at once stays under the model's float32 size
    (here 0.63x; the whole file had been dequantized to float32 first, 1.3x here: SmolLM2's bfloat16 load peaked
    1.5 GB above the process's start, 0.65 GB now)."""
    import tracemalloc

    cfg = {**CONFIG, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 16, "vocab_size": 256}
    sd = hf_state_dict(cfg)
    path = write_llama_gguf(write_hf(tmp_path / "hf", sd=sd, config=cfg), tmp_path / "m.gguf")
    whole = sum(t.size for t in sd.values()) * 4
    tracemalloc.start()
    try:
        model = load_model(path, dtype="bfloat16", load_tokenizer=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert model.params.nbytes() == whole // 2
    assert peak < 0.9 * whole, (peak, whole)
