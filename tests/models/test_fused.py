"""The fused projections' column layout (`models.fused`): grouping for tensor parallelism is a permutation that
`split_columns` undoes, for float and quantized weights, and a model in the grouped layout computes what the plain one
does; which matrices split by rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models import init_random_weights, quant
from models.fused import gate_up_parts, group_columns, grouped_order, qkv_parts, rows_split, split_columns
from models.llama import forward
from paged.testing import tiny_config
from pallas_kernels.quant_format import LayerSlice, dequantize

CFG = tiny_config(64)


def test_grouped_order_interleaves_the_parts_by_group():
    assert grouped_order((4, 2, 2), 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert grouped_order((3, 3), 1).tolist() == list(range(6))
    with pytest.raises(ValueError, match="divide into 2 groups"):
        grouped_order((3, 2), 2)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_split_columns_undoes_the_grouping(groups):
    parts = (8, 4, 4)
    y = jnp.asarray(np.random.default_rng(0).normal(size=(3, 16)), jnp.float32)
    got = split_columns(group_columns(y, parts, groups), parts, groups)
    assert [g.shape for g in got] == [(3, 8), (3, 4), (3, 4)]
    np.testing.assert_array_equal(np.concatenate(got, axis=1), y)


def test_quantized_weights_group_like_their_float_matrix():
    w = jnp.asarray(np.random.default_rng(1).normal(size=(64, 48)), jnp.float32)
    parts = (16, 16, 16)
    for kind in ("q4_1", "int8"):
        qa = quant.quantize(w, kind, 32)
        g = group_columns(qa, parts, 4)
        assert g.shape == qa.shape
        np.testing.assert_array_equal(dequantize(g), group_columns(dequantize(qa), parts, 4))


def test_a_model_in_the_grouped_layout_computes_the_same_logits():
    params = init_random_weights(CFG, seed=3, scale=0.1)
    rng = np.random.default_rng(4)  # biases too (as Qwen2 has on q/k/v): they are regrouped with their matrices
    bias = lambda n: jnp.asarray(rng.normal(0, 0.1, size=(CFG.num_layers, n)), jnp.float32)  # noqa: E731
    params = params.replace(layers=params.layers.replace(bqkv=bias(sum(qkv_parts(CFG))),
                                                         b_gate_up=bias(2 * CFG.intermediate_size)))
    lw = params.layers
    grouped = params.replace(layers=lw.replace(
        wqkv=group_columns(lw.wqkv, qkv_parts(CFG), 2), w_gate_up=group_columns(lw.w_gate_up, gate_up_parts(CFG), 2),
        bqkv=group_columns(lw.bqkv, qkv_parts(CFG), 2), b_gate_up=group_columns(lw.b_gate_up, gate_up_parts(CFG), 2),
        fused_groups=2))
    tokens = jnp.asarray([[5, 9, 2, 33, 7, 1]], jnp.int32)
    want, got = forward(params, CFG, tokens), forward(grouped, CFG, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    wrong = params.replace(layers=grouped.layers.replace(fused_groups=1))  # regrouped but read as plain
    assert np.max(np.abs(forward(wrong, CFG, tokens) - want)) > 1e-3


def test_which_matrices_split_by_rows():
    w = jnp.ones((96, 8), jnp.float32)
    assert rows_split(w, 2) and rows_split(w, 4) and not rows_split(w, 5) and not rows_split(w, 1)
    q = quant.quantize(w, "q4_1", 32)  # 3 groups
    assert rows_split(q, 3) and not rows_split(q, 2)
    assert rows_split(LayerSlice(quant.stack([q, q]), jnp.int32(0)), 3)
    assert rows_split(quant.quantize(jnp.ones((128, 8)), "int8", None), 2)  # per channel, 64-row shards
    assert not rows_split(quant.quantize(w, "int8", None), 2)  # 48-row shards would re-block the activations
