"""The truncated-layer self-draft: the target's first n layers and its head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.draft import reduced_head, save_hf_llama, truncated_model
from models.errors import InvalidLoadOptionError
from models.llama import forward
from models.loader import Model
from paged.testing import tiny_config, tiny_model

CFG = tiny_config(64, num_layers=4)
MODEL = tiny_model(CFG, seed=1, scale=0.2)
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


# ------------------------------------------------------------------------------------------ reduced LM head
def test_reduced_head_logits_are_the_models_at_its_tokens_and_minus_inf_elsewhere():
    ids = np.random.default_rng(0).permutation(CFG.vocab_size)[:20]  # any order
    draft = reduced_head(MODEL, ids)
    assert draft.config.tie_word_embeddings is False and draft.params.lm_head.shape == (CFG.hidden_size, 20)
    full = np.asarray(forward(MODEL.params, CFG, TOKENS))
    got = np.asarray(forward(draft.params, draft.config, TOKENS))
    assert got.shape == full.shape
    np.testing.assert_allclose(got[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(CFG.vocab_size), ids)
    assert np.all(np.isneginf(got[..., rest]))


def test_reduced_head_of_a_quantized_model_is_requantized_in_its_format():
    from models import quant as quant_lib

    q = MODEL.params.replace(lm_head=quant_lib.quantize(MODEL.params.lm_head, "int8", 32))
    qm = Model(config=CFG, params=q, tokenizer=None, source="tiny-int8")
    ids = np.arange(0, CFG.vocab_size, 3)
    draft = reduced_head(qm, ids)
    assert draft.params.lm_head.kind == "int8" and draft.params.lm_head.shape == (CFG.hidden_size, len(ids))
    np.testing.assert_allclose(np.asarray(forward(draft.params, draft.config, TOKENS))[..., ids],
                               np.asarray(forward(qm.params, CFG, TOKENS))[..., ids], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("ids", [[], [1, 1, 2], [0, CFG.vocab_size], [-1, 3], [[1, 2]]])
def test_reduced_head_rejects_bad_token_ids(ids):
    with pytest.raises(InvalidLoadOptionError, match="token ids|integer tensor"):
        reduced_head(MODEL, ids)


# tied embeddings, as the distilled drafts have; int8-loadable (every input width a multiple of 32)
TIED_CFG = dataclasses.replace(CFG, intermediate_size=64, tie_word_embeddings=True)
TIED = tiny_model(TIED_CFG, seed=2, source="t", scale=0.2)


@pytest.mark.parametrize("src", ["tied", "untied", "reduced", "reduced_untied"])
def test_a_saved_draft_loads_back_with_the_same_logits(tmp_path, src):
    """save_hf_llama -> models.load_model: tied, untied, or with a reduced head (lm_head.weight [N, H] +
    lm_head.token_ids); loaded float and int8 (the head stays reduced)."""
    from models import load_model

    base = MODEL if src.endswith("untied") else TIED
    reduce = src.startswith("reduced")
    src = reduced_head(base, [5, 1, 40, 63, 7]) if reduce else base
    save_hf_llama(src.params, src.config, str(tmp_path))
    got = load_model(str(tmp_path), load_tokenizer=False)
    assert got.config.num_layers == CFG.num_layers
    assert got.config.tie_word_embeddings is (src.params.lm_head is None)
    np.testing.assert_allclose(np.asarray(forward(got.params, got.config, TOKENS)),
                               np.asarray(forward(src.params, src.config, TOKENS)), rtol=1e-5, atol=1e-5)
    if base is MODEL:
        return  # (its 48-wide MLP does not quantize in groups of 32)
    q = load_model(str(tmp_path), load_tokenizer=False, quant="int8")
    assert (q.params.head_ids is not None) is reduce
    if reduce:
        assert list(np.asarray(q.params.head_ids)) == [5, 1, 40, 63, 7]


def test_a_checkpoint_with_bad_head_ids_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    from models import load_model
    from models.errors import WeightShapeError

    red = reduced_head(TIED, [5, 1, 40])
    save_hf_llama(red.params, red.config, str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    t = load_file(path)
    for bad in (np.asarray([5, 5, 40], np.int32), np.asarray([5, 1, 64], np.int32)):
        save_file({**t, "lm_head.token_ids": bad}, path)
        with pytest.raises(WeightShapeError, match="distinct token ids"):
            load_model(str(tmp_path), load_tokenizer=False)
    save_file({**t, "lm_head.token_ids": np.asarray([5, 1], np.int32)}, path)  # 2 ids for a head of 3 rows
    with pytest.raises(WeightShapeError, match="names 2 tokens but lm_head.weight has 3 rows"):
        load_model(str(tmp_path), load_tokenizer=False)


# ------------------------------------------------------------------------------------- matched vocabulary
def _matched_variants():
    from models import quant as quant_lib

    q4_tied = TIED.params.replace(embed=quant_lib.quantize(jnp.asarray(TIED.params.embed).T, "q4_1", 32))
    q8_head = MODEL.params.replace(lm_head=quant_lib.quantize(MODEL.params.lm_head, "int8", 32))
    return {"untied": MODEL, "tied": TIED,
            "q4_tied": Model(config=TIED_CFG, params=q4_tied, tokenizer=None, source="q4-tied"),
            "int8_head": Model(config=CFG, params=q8_head, tokenizer=None, source="int8-head"),
            "reduced": reduced_head(MODEL, [5, 1, 40, 63, 7, 60])}


@pytest.mark.parametrize("variant", ["untied", "tied", "q4_tied", "int8_head", "reduced"])
@pytest.mark.parametrize("vocab", [CFG.vocab_size - 8, CFG.vocab_size + 8])
def test_matched_vocab_keeps_every_shared_logit_and_says_minus_inf_past_its_own(variant, vocab):
    """A draft matched to a target's vocabulary size (`models.draft.matched_vocab`): the shared ids' logits are the
    model's own, exactly; ids past its own vocabulary are -inf; a token past it, fed as the target may, embeds as
    zeros (finite logits, not the NaN of an out-of-range gather)."""
    from models.draft import matched_vocab

    src = _matched_variants()[variant]
    got = matched_vocab(src, vocab)
    assert got.config.vocab_size == vocab and "vocabulary 64 -> " in got.source
    before = np.asarray(forward(src.params, src.config, TOKENS))
    after = np.asarray(forward(got.params, got.config, TOKENS))
    assert after.shape == (*before.shape[:-1], vocab)
    shared = min(vocab, CFG.vocab_size)
    if variant in ("q4_tied", "int8_head"):  # (the quantized matmul blocks a narrower head differently)
        np.testing.assert_allclose(after[..., :shared], before[..., :shared], rtol=1e-5, atol=1e-4)
    else:
        np.testing.assert_array_equal(after[..., :shared], before[..., :shared])
    assert np.all(np.isneginf(after[..., CFG.vocab_size:]))
    if vocab > CFG.vocab_size:
        past = np.asarray(forward(got.params, got.config, jnp.asarray([[3, CFG.vocab_size + 2, 9]], jnp.int32)))
        heard = past[..., :shared]
        assert not np.isnan(past).any() and (np.isfinite(heard) | (variant == "reduced")).all()
    assert matched_vocab(src, CFG.vocab_size) is src


def test_matched_vocab_rejects_bad_sizes_and_a_head_with_no_shared_id():
    from models.draft import matched_vocab

    for bad in (0, 10.0, True):
        with pytest.raises(InvalidLoadOptionError, match="vocab_size must be an int"):
            matched_vocab(MODEL, bad)
    with pytest.raises(InvalidLoadOptionError, match="none of the reduced head's token ids is below 30"):
        matched_vocab(reduced_head(MODEL, [40, 50]), 30)
