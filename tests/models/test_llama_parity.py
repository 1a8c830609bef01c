"""Parity of the JAX forward with HF transformers on tiny random models of every supported architecture."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models import ModelConfig, UnsupportedArchitectureError, load_model  # noqa: E402
from models.llama import forward, greedy_generate  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope-bias-headdim": ("LlamaConfig", "LlamaForCausalLM", dict(
        head_dim=24, attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "llama-linear-rope-mqa-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=1, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, head_dim=16)),
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "smollm2-like": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=6, num_key_value_heads=2, hidden_size=96, tie_word_embeddings=True, rope_theta=100000.0)),
}


def make_hf(arch: str, seed: int = 0):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


# Fast tier: plain Llama; the other architecture variants in the slow tier.
FAST_ARCHS = {"llama"}


@pytest.fixture(scope="module", params=[a if a in FAST_ARCHS else pytest.param(a, marks=pytest.mark.slow)
                                        for a in sorted(ARCHS)])
def pair(request, tmp_path_factory):
    model = make_hf(request.param)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    return request.param, model, load_model(d, load_tokenizer=False)


def test_logits_match(pair):
    arch, hf, ours = pair
    rng = np.random.default_rng(1)
    ids = rng.integers(0, BASE["vocab_size"], size=(2, 17))
    ref = hf_logits(hf, ids)
    got = np.asarray(forward(ours.params, ours.config, jnp.asarray(ids, jnp.int32)))
    scale = np.abs(ref).max()
    err = np.abs(got - ref).max()
    assert err < 1e-4 * scale, f"{arch}: max abs err {err:.3g} vs logit scale {scale:.3g}"


def test_greedy_continuation_matches(pair):
    arch, hf, ours = pair
    prompt = [5, 17, 99, 3, 42, 7]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    expected = out[0, len(prompt):].tolist()
    assert greedy_generate(ours.params, ours.config, prompt, 10) == expected


def test_bf16_and_sharded_checkpoints(tmp_path):
    hf = make_hf("llama", seed=3)
    hf.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_model(tmp_path, load_tokenizer=False)
    ids = np.arange(1, 13)[None]
    # the same bf16 weights, upcast at load on both sides
    assert load_model(tmp_path).tokenizer is None  # the directory has no tokenizer files
    hf32 = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ref = hf_logits(hf32, ids)
    got = np.asarray(forward(ours.params, ours.config, jnp.asarray(ids, jnp.int32)))
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()


def test_unknown_architecture_and_rope_raise():
    with pytest.raises(UnsupportedArchitectureError, match="model_type 'gpt_neox'"):
        ModelConfig.from_hf({"model_type": "gpt_neox", "hidden_size": 8})
    cfg = {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        ModelConfig.from_hf(cfg)


def test_missing_files_and_wrong_shapes(tmp_path):
    from models import MissingWeightError, ModelFileNotFoundError, WeightShapeError

    with pytest.raises(ModelFileNotFoundError):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelFileNotFoundError, match="config.json"):
        load_model(tmp_path)
    hf = make_hf("llama")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    with pytest.raises(WeightShapeError, match="gate_proj"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(MissingWeightError, match="layers.2"):
        load_model(tmp_path)
