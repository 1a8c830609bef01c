"""Draft models for speculative decoding that need no separate checkpoint.

`truncated_model(model, n)`: the target's first `n` decoder layers, then its own final norm and LM head (a
"self-draft", the zero-training baseline): same vocabulary and tokenizer, weights shared with the target (the
layer stack is sliced, not copied per token).
"""

from __future__ import annotations

import dataclasses

import jax

from models.errors import InvalidLoadOptionError
from models.loader import Model


def truncated_model(model: Model, num_layers: int) -> Model:
    """`model` cut to its first `num_layers` layers (1 <= num_layers <= model.config.num_layers), keeping the
    embedding, final norm and LM head."""
    total = model.config.num_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise InvalidLoadOptionError(f"truncated_model: num_layers must be an int in [1, {total}], got {num_layers!r}")
    layers = jax.tree_util.tree_map(lambda a: a[:num_layers], model.params.layers)
    params = model.params.replace(layers=layers)
    cfg = dataclasses.replace(model.config, num_layers=num_layers)
    return Model(config=cfg, params=params, tokenizer=model.tokenizer, source=f"{model.source}[:{num_layers} layers]",
                 dtype=model.dtype)
