"""The truncated-layer self-draft: the target's first n layers and its head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ModelConfig, init_random_weights
from models.draft import truncated_model
from models.errors import InvalidLoadOptionError
from models.llama import forward
from models.loader import Model

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0)
MODEL = Model(config=CFG, params=init_random_weights(CFG, seed=1, scale=0.2), tokenizer=None, source="tiny")
TOKENS = jnp.asarray([[3, 14, 15, 9, 26, 5, 35]], jnp.int32)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_truncated_model_is_the_target_with_later_layers_removed(n):
    """Zeroing the output projections of layers >= n makes them the identity (residual only): the full model's
    logits then equal the truncated model's."""
    draft = truncated_model(MODEL, n)
    assert draft.config.num_layers == n and draft.tokenizer is MODEL.tokenizer
    assert jax.tree_util.tree_leaves(draft.params.layers)[0].shape[0] == n
    keep = (jnp.arange(CFG.num_layers) < n)[:, None, None]
    layers = MODEL.params.layers.replace(wo=MODEL.params.layers.wo * keep, w_down=MODEL.params.layers.w_down * keep)
    identity_tail = MODEL.params.replace(layers=layers)
    np.testing.assert_allclose(np.asarray(forward(draft.params, draft.config, TOKENS)),
                               np.asarray(forward(identity_tail, CFG, TOKENS)), rtol=1e-5, atol=1e-5)
    if n < CFG.num_layers:  # and it is not the full model
        assert not np.allclose(np.asarray(forward(draft.params, draft.config, TOKENS)),
                               np.asarray(forward(MODEL.params, CFG, TOKENS)), atol=1e-3)


@pytest.mark.parametrize("n", [0, 5, 1.0, True])
def test_truncated_model_rejects_bad_layer_counts(n):
    with pytest.raises(InvalidLoadOptionError):
        truncated_model(MODEL, n)
