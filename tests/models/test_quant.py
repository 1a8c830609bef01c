"""QuantizedArray: quantization error bounds, `dequantize` against a NumPy decoding of the raw fields, lossless GGUF
block import, stack/slice/concat, nbytes; `models.linear.matmul`, the entry point that routes quantized weights to
the dequant-matmul implementation `impl` names."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from models import quant
from models.linear import MATMUL_IMPLS, matmul
from paged.testing import tiny_config
from pallas_kernels import dequant_gemv
from pallas_kernels import dequant_matmul as dm
from pallas_kernels.quant_format import QuantizedArray, check, dequantize
from pallas_kernels.registry import MATMUL
from tests.pallas_kernels.helpers import names_of, numpy_dequantize, spy

KINDS = [("q4_1", 32), ("q4_0", 32), ("int8", 32), ("int8", None), ("q4_1", 16), ("int8", 64)]


def _w(k=128, n=48, seed=0, scale=0.05):
    return np.random.default_rng(seed).normal(0.0, scale, size=(k, n)).astype(np.float32)


def _groups(a, g):  # [in, out] -> [in/g, g, out]
    return a.reshape(a.shape[0] // g, g, a.shape[1])


# ------------------------------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("kind,group_size", KINDS)
def test_quantize_error_bounds(kind, group_size):
    w = _w()
    qa = check(quant.quantize(w, kind, group_size))
    g = group_size or w.shape[0]
    assert qa.group_size == g and qa.shape == w.shape and qa.kind == kind
    err = _groups(np.abs(np.asarray(dequantize(qa)) - w), g)  # [in/g, g, out]
    d = np.abs(np.asarray(qa.scales, np.float32))[:, None, :]  # [in/g, 1, out]
    if kind == "q4_1":
        m = np.abs(np.asarray(qa.mins, np.float32))[:, None, :]
        # half a step, plus the fp16 rounding of min and scale (the top of the range may clip by a hair)
        bound, rel = 0.5 * d + 16 * d * 2.0**-11 + m * 2.0**-11, 0.1
    elif kind == "q4_0":
        bound, rel = 1.0 * d * (1 + 2.0**-10), 0.12  # the side opposite the extreme clips at +7: up to a full step
    else:
        bound, rel = 0.5 * d * (1 + 2.0**-9), 0.01
    assert np.all(err <= bound + 1e-9), float(np.max(err - bound))
    assert np.linalg.norm(err) / np.linalg.norm(w) < rel


@pytest.mark.parametrize("kind,group_size", KINDS)
def test_dequantize_matches_numpy_decoding_of_the_raw_fields(kind, group_size):
    """`dequantize` against an element-by-element NumPy decoding of the documented layout (nibble order included),
    for single and stacked arrays."""
    qas = [quant.quantize(_w(seed=i), kind, group_size) for i in range(2)]
    for qa in qas:
        np.testing.assert_allclose(np.asarray(dequantize(qa)), numpy_dequantize(qa), rtol=1e-6, atol=1e-7)
    dense = np.asarray(dequantize(quant.stack(qas)))  # [2, in, out]
    np.testing.assert_allclose(dense, np.stack([numpy_dequantize(qa) for qa in qas]), rtol=1e-6, atol=1e-7)
    assert dequantize(qas[0], dtype=jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "int8"])
def test_quantize_constant_and_zero_groups(kind):
    w = np.zeros((64, 4), np.float32)
    w[:, 1] = 0.5  # a constant column: zero range
    w[:32, 2] = -0.25
    got = np.asarray(dequantize(quant.quantize(w, kind)))
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got[:, 0], 0.0)
    if kind == "q4_1":  # scale 0, min = the constant
        np.testing.assert_array_equal(got, w)
    else:
        np.testing.assert_allclose(got, w, atol=0.5 / 7)


def test_quantize_float32_scales_are_tighter():
    w = _w(seed=3)
    e16 = np.abs(np.asarray(dequantize(quant.quantize(w, "int8", None))) - w).max()
    qa32 = quant.quantize(w, "int8", None, scale_dtype=jnp.float32)
    assert qa32.scales.dtype == jnp.float32 and qa32.scales.shape == (1, w.shape[1])
    assert np.abs(np.asarray(dequantize(qa32)) - w).max() <= e16 * 1.01


@pytest.mark.parametrize(
    "kind,group_size,match",
    [
        ("q3", 32, "unknown quantization kind"),
        ("q4_1", None, "only supported for int8"),
        ("q4_0", 6, "divide in=112"),
        ("int8", 0, "must be positive"),
    ],
)
def test_quantize_rejects(kind, group_size, match):
    with pytest.raises(ValueError, match=match):
        quant.quantize(np.zeros((112, 8), np.float32), kind, group_size)


def test_quantize_rejects_odd_q4_group():
    with pytest.raises(ValueError, match="group_size=7 must be even"):
        quant.quantize(np.zeros((14, 8), np.float32), "q4_0", 7)


def test_check_rejects_inconsistent_leaves():
    qa = quant.quantize(_w(), "q4_1")
    with pytest.raises(ValueError, match="mins must be given"):
        check(qa.replace(mins=None))
    with pytest.raises(ValueError, match="values must be uint8"):
        check(qa.replace(values=qa.values[:-2]))
    with pytest.raises(ValueError, match="scales must be"):
        check(qa.replace(scales=qa.scales[:, :-1]))


# ----------------------------------------------------------------------------------------------- GGUF import
_FROM = {QT.Q4_1: quant.from_gguf_q4_1, QT.Q4_0: quant.from_gguf_q4_0, QT.Q8_0: quant.from_gguf_q8_0}
_BLOCK_BYTES = {QT.Q4_1: 20, QT.Q4_0: 18, QT.Q8_0: 34}


def _random_blocks(qt, out, k, seed=0):
    """Hand-made blocks: every quant byte value, finite fp16 scales/mins of both signs."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    b = rng.integers(0, 256, size=(out, nb, _BLOCK_BYTES[qt]), dtype=np.uint8)
    n_half = 2 if qt == QT.Q4_1 else 1
    halves = rng.normal(0.0, 0.05, size=(out, nb, n_half)).astype("<f2")
    b[:, :, : 2 * n_half] = halves.view(np.uint8).reshape(out, nb, 2 * n_half)
    return b.reshape(out, nb * _BLOCK_BYTES[qt])


@pytest.mark.parametrize("qt", [QT.Q4_1, QT.Q4_0, QT.Q8_0])
@pytest.mark.parametrize("source", ["gguf_quantize", "random_blocks"])
def test_gguf_import_is_exact(qt, source):
    out, k = 40, 96
    if source == "gguf_quantize":
        raw = gguf.quants.quantize(_w(k=out, n=k, seed=1, scale=1.0), qt)  # a GGUF tensor is [out, in]
    else:
        raw = _random_blocks(qt, out, k)
    assert raw.shape == (out, k // 32 * _BLOCK_BYTES[qt]) and raw.dtype == np.uint8
    qa = check(_FROM[qt](raw, (out, k)))
    assert qa.shape == (k, out) and qa.group_size == 32
    want = gguf.quants.dequantize(raw, qt)  # [out, in] float32
    got = np.asarray(dequantize(qa))
    np.testing.assert_array_equal(got, want.T)
    idx = jnp.asarray([5, 0, out - 1, 5])
    np.testing.assert_array_equal(np.asarray(quant.gather_out(qa, idx)), want[np.asarray(idx)])


@pytest.mark.parametrize("qt", [QT.Q4_1, QT.Q8_0])
def test_gguf_import_through_writer_and_reader(tmp_path, qt):
    out, k = 24, 64
    raw = gguf.quants.quantize(_w(k=out, n=k, seed=2, scale=1.0), qt)
    path = str(tmp_path / "t.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("w", raw, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (t,) = gguf.GGUFReader(path).tensors
    shape_out_in = tuple(int(d) for d in reversed(t.shape.tolist()))
    assert shape_out_in == (out, k)
    qa = _FROM[qt](t.data, shape_out_in)
    np.testing.assert_array_equal(np.asarray(dequantize(qa)), gguf.quants.dequantize(t.data, qt).T)


def test_gguf_import_rejects_wrong_sizes():
    raw = _random_blocks(QT.Q4_1, 8, 64)
    with pytest.raises(ValueError, match="expected 320 uint8 block bytes"):
        quant.from_gguf_q4_1(raw[:, :-1], (8, 64))
    with pytest.raises(ValueError, match="not a multiple of the 32-element block"):
        quant.from_gguf_q4_1(raw, (8, 48))


@pytest.mark.slow
@pytest.mark.real_weights
def test_smollm2_gguf_tensors_import_exactly():
    from models.embedded import embedded_gguf_path

    reader = gguf.GGUFReader(embedded_gguf_path())
    by_name = {t.name: t for t in reader.tensors}
    cases = (("blk.0.ffn_down.weight", QT.Q4_1), ("blk.3.attn_q.weight", QT.Q4_1), ("token_embd.weight", QT.Q8_0))
    for name, qt in cases:
        t = by_name[name]
        assert t.tensor_type == qt, (name, t.tensor_type)
        shape_out_in = tuple(int(d) for d in reversed(t.shape.tolist()))
        qa = _FROM[qt](t.data, shape_out_in)
        want = gguf.quants.dequantize(t.data, qt).reshape(shape_out_in)
        np.testing.assert_array_equal(np.asarray(dequantize(qa)), want.T, err_msg=name)
        if qt == QT.Q8_0:  # the tied embedding's rows, looked up without dequantizing the whole table
            ids = jnp.asarray([1, 2, 49151, 100])
            np.testing.assert_array_equal(np.asarray(quant.gather_out(qa, ids)), want[np.asarray(ids)])


# ---------------------------------------------------------------------------------------- stack / concat / size
@pytest.mark.parametrize("kind,group_size", [("q4_1", 32), ("q4_0", 32), ("int8", None)])
def test_stack_slice_round_trip(kind, group_size):
    qas = [quant.quantize(_w(seed=i), kind, group_size) for i in range(3)]
    st = quant.stack(qas)
    assert st.batch_shape == (3,) and st.shape == qas[0].shape
    dense = np.asarray(dequantize(st))  # [3, in, out]
    for i, qa in enumerate(qas):
        sl = jax.tree.map(lambda a, i=i: a[i], st)
        assert (sl.kind, sl.group_size, sl.shape, sl.batch_shape) == (qa.kind, qa.group_size, qa.shape, ())
        for a, b in zip(jax.tree_util.tree_leaves(sl), jax.tree_util.tree_leaves(qa)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(dense[i], np.asarray(dequantize(qa)))

    # lax.scan over the stack hands the body one layer's QuantizedArray
    def body(c, layer_qa):
        assert isinstance(layer_qa, QuantizedArray) and layer_qa.batch_shape == ()
        return c, dequantize(layer_qa)[0]

    _, rows = jax.lax.scan(body, 0, st)
    np.testing.assert_array_equal(np.asarray(rows), dense[:, 0])


@pytest.mark.parametrize("kind,group_size", [("q4_1", 32), ("q4_0", 16), ("int8", 32), ("int8", None)])
def test_concat_out(kind, group_size):
    parts = [quant.quantize(_w(n=n, seed=n), kind, group_size) for n in (48, 16, 16)]
    cat = check(quant.concat_out(parts))
    assert cat.shape == (128, 80)
    want = np.concatenate([np.asarray(dequantize(p)) for p in parts], axis=1)
    np.testing.assert_array_equal(np.asarray(dequantize(cat)), want)
    # concat of stacks == stack of concats (the loader may do either)
    st = quant.concat_out([quant.stack([p, p]) for p in parts])
    np.testing.assert_array_equal(np.asarray(dequantize(st)), np.stack([want, want]))


def test_select_out_permutes_columns():
    qa = quant.quantize(_w(), "q4_1")
    perm = np.random.default_rng(0).permutation(qa.shape[1])
    sel = check(quant.select_out(qa, perm))
    np.testing.assert_array_equal(np.asarray(dequantize(sel)), np.asarray(dequantize(qa))[:, perm])
    with pytest.raises(ValueError, match="within"):
        quant.select_out(qa, [qa.shape[1]])


def test_stack_and_concat_reject_mismatches():
    a = quant.quantize(_w(), "q4_1")
    with pytest.raises(ValueError, match="share kind"):
        quant.concat_out([a, quant.quantize(_w(), "q4_0")])
    with pytest.raises(ValueError, match="in=64"):
        quant.concat_out([a, quant.quantize(_w(k=64), "q4_1")])
    with pytest.raises(ValueError, match="shape"):
        quant.stack([a, quant.quantize(_w(n=16), "q4_1")])
    with pytest.raises(ValueError, match="at least one"):
        quant.stack([])


def test_nbytes():
    k, n = 576, 1536
    w = np.zeros((k, n), np.float32)
    assert quant.nbytes(quant.quantize(w, "q4_1")) == k * n // 2 + 2 * (k // 32) * n * 2  # 0.625 B/weight
    assert quant.nbytes(quant.quantize(w, "q4_0")) == k * n // 2 + (k // 32) * n * 2  # 0.5625
    assert quant.nbytes(quant.quantize(w, "int8")) == k * n + (k // 32) * n * 2  # 1.0625
    assert quant.nbytes(quant.quantize(w, "int8", None)) == k * n + n * 2


# --------------------------------------------------------------------------------------- the matmul entry point
IMPL_FUNCTIONS = ["dequant_matmul_reference", "dequant_matmul_xla", "dequant_matmul_pallas"]


@pytest.mark.parametrize("impl", MATMUL_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_routes_quantized_weights_to_the_impl(monkeypatch, impl, dtype):
    """A `QuantizedArray` goes to the dequant-matmul implementation `impl` names (and only to it); the result is
    `x @ w + bias` in x's dtype."""
    why = dm.native.unavailable_reason() if impl == "native" else None  # a GPU backend, or not built here
    if why is not None:
        pytest.skip(f"native kernel: {why} (tests/pallas_kernels/test_native_matmul.py fails where it could be built "
                    "and was not)")
    native_here = dm.native.available()  # before the spies: its first call runs a smoke test
    calls = spy(monkeypatch, dm, IMPL_FUNCTIONS)
    spy(monkeypatch, dequant_gemv, ["dequant_gemv_pallas"], calls)
    native_calls = spy(monkeypatch, dm.native, ["native_matmul"])
    qa = quant.quantize(_w(), "q4_1")
    x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 128)), dtype)
    bias = jnp.asarray(np.random.default_rng(4).normal(size=48), jnp.float32)
    got = matmul(x, qa, bias, impl=impl)
    assert got.dtype == dtype and got.shape == (3, 48)
    want = np.asarray(x.astype(jnp.float32), np.float64) @ numpy_dequantize(qa) + np.asarray(bias, np.float64)
    auto = dm.gpu_auto_impl(3, qa) if jax.default_backend() == "gpu" else ("native" if native_here else "xla")
    ran = {"auto": auto}.get(impl, impl)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # the bf16 result is rounded to bf16
    tol = max(tol, MATMUL.get(ran).tolerance or 0.0)  # native: int8 activations
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol * np.abs(want).max())
    function = {"native": "native_matmul", "pallas_gemv": "dequant_gemv_pallas"}.get(ran, f"dequant_matmul_{ran}")
    assert names_of(calls + native_calls) == [function]


def test_matmul_of_float_weights_is_a_plain_dot(monkeypatch):
    calls = spy(monkeypatch, dm, IMPL_FUNCTIONS)
    w = _w()
    x = np.random.default_rng(3).normal(size=(3, 128)).astype(np.float32)
    got = matmul(jnp.asarray(x), jnp.asarray(w, jnp.bfloat16), impl="pallas")  # impl only concerns quantized w
    assert got.dtype == jnp.float32
    want = x.astype(np.float64) @ np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert calls == []


@pytest.mark.parametrize("tied", [True, False])
def test_step_read_bytes_counts_the_head_not_a_separate_embedding(tied):
    """A decode step reads every layer, the final norm and the head; a separate (untied) input table is only
    gathered, so it is left out -- but a tied table is the head and is counted."""
    import dataclasses

    from models import init_random_weights

    cfg = tiny_config(64, tie_word_embeddings=tied)
    w = init_random_weights(cfg)
    embed = 64 * 32 * 4
    assert w.step_read_bytes() == w.nbytes() - (0 if tied else embed)
    if not tied:
        assert w.step_read_bytes() == dataclasses.replace(w, embed=w.embed[:1]).nbytes() - 32 * 4
