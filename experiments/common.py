"""Helpers shared by the experiment scripts."""

from __future__ import annotations


def load_experiment_model(name: str, *, dtype: str = "float32", quant: str | None = None):
    """`"tiny"` (a random 2-layer Llama for quick runs) or anything `models.load_model` accepts, loaded with `dtype`
    and `quant` (both ignored for "tiny")."""
    from models import ModelConfig, init_random_weights, load_model
    from models.loader import Model

    if name == "tiny":
        cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16)
        return Model(config=cfg, params=init_random_weights(cfg), tokenizer=None, source="tiny")
    return load_model(name, dtype=dtype, quant=quant)
