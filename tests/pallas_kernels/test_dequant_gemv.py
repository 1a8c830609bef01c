"""The GEMV dequant-matmul (`impl="pallas_gemv"`, interpret mode on the CPU) against the independent NumPy decoding
of the format; its tuning and shape rules; that a row's bits do not depend on the rows beside it; and "auto" on a
GPU (`registry.on_gpu` patched): the GEMV up to the row limit of `tuned_tables`, the tensor-core kernel above.
Lowering for CUDA is in test_gpu_rules.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dequant_gemv as dg
from pallas_kernels import dequant_matmul as dm
from pallas_kernels import registry, tuned_tables
from pallas_kernels.dequant_gemv import GemvTuning, check_tuning, default_tuning, dequant_gemv_pallas
from pallas_kernels.dequant_matmul import MatmulTuning, dequant_matmul
from pallas_kernels.registry import MATMUL
from tests.pallas_kernels.helpers import (
    KINDS,
    OUT,
    K,
    activations,
    assert_close,
    equations,
    find,
    names_of,
    numpy_matmul,
    quantized,
    spy,
)

_qa, _x, _close = quantized, activations, assert_close


def _plan(*args, **kwargs) -> tuple[tuple[int, ...], int]:
    """(grid, loop steps per program) of the program `dequant_matmul(*args, **kwargs)` traces to."""
    (call,) = find(dequant_matmul, *args, primitive="pallas_call", **kwargs)
    (loop,) = [e for e in equations(call.params["jaxpr"]) if e.primitive.name == "scan"]
    return tuple(call.params["grid_mapping"].grid), loop.params["length"]


# No split, and split-K (with acc_rows below the half-group, several row blocks, the other int_to_float).
SPLIT = GemvTuning(block_n=2, block_out=32, block_in=32, split_in=2, acc_rows=8, int_to_float="cast")
NO_SPLIT = GemvTuning(block_n=8, block_out=64, block_in=64, split_in=1)


@pytest.mark.parametrize("kind,group_size", KINDS)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("tuning", [NO_SPLIT, SPLIT], ids=["no_split", "split_in2"])
def test_gemv_matches_numpy(kind, group_size, n, tuning, monkeypatch):
    calls = spy(monkeypatch, dg, ["dequant_gemv_pallas"])
    qa, x = _qa(kind, group_size), _x(n)
    got = dequant_matmul(x, qa, impl="pallas_gemv", config=tuning, interpret=True)
    _close(got, numpy_matmul(x, qa))
    assert names_of(calls) == ["dequant_gemv_pallas"]
    # the kernel ran the tuning: grid (row blocks, output tiles, splits) and block_in steps per program
    rows = min(n, tuning.block_n)
    want = ((-(-n // rows), OUT // tuning.block_out, tuning.split_in), K // tuning.split_in // tuning.block_in)
    assert _plan(x, qa, impl="pallas_gemv", config=tuning, interpret=True) == want


@pytest.mark.parametrize("kind,group_size", KINDS)
def test_default_tuning_and_bf16(kind, group_size):
    """The default tuning, with bf16 activations (upcast in the kernel; float32 accumulation)."""
    qa, x = _qa(kind, group_size), _x(2, dtype=jnp.bfloat16)
    got = dequant_matmul(x, qa, impl="pallas_gemv", interpret=True)
    _close(got, numpy_matmul(np.asarray(x.astype(jnp.float32)), qa), rtol=1e-4)


def test_a_row_gets_the_same_bits_beside_any_number_of_rows():
    """The default reduction depends on the matrix alone and each row has its own accumulator, so row 0 comes out
    the same alone, beside 2 rows, and beside 8 (another row block)."""
    qa, x = _qa("q4_1", 32, k=256), _x(9, k=256)
    assert len({_reduction(default_tuning(n, qa)) for n in (1, 3, 8, 9, 100)}) == 1
    alone = np.asarray(dequant_matmul(x[:1], qa, impl="pallas_gemv", interpret=True))
    for n in (3, 9):
        got = np.asarray(dequant_matmul(x[:n], qa, impl="pallas_gemv", interpret=True))
        assert np.array_equal(got[0], alone[0]), (n, np.abs(got[0] - alone[0]).max())


def _reduction(t: GemvTuning) -> tuple:
    """The fields that set a row's order of float32 operations."""
    return t.block_in, t.split_in, t.acc_rows, t.num_warps, t.int_to_float


def test_default_tuning_splits_the_input_where_the_output_is_narrow():
    """4096 x 14336 (the 8B up projection): 112 tiles of 128 columns, split 4 ways; 14336 x 4096 (its down
    projection): 32 tiles, split 8 ways. Both fit the GPU rules."""
    for (k, out), split in [((4096, 14336), 4), ((14336, 4096), 8)]:
        qa = _shape_only("q4_1", 32, k, out)
        t = default_tuning(1, qa)
        assert (t.block_out, t.block_in, t.split_in, t.acc_rows) == (128, 128, split, 16)
        check_tuning(qa, t, native_gpu=True)
    per_channel = _shape_only("int8", 576, 576, 1536)
    check_tuning(per_channel, default_tuning(1, per_channel), native_gpu=True)


def _shape_only(kind, group_size, k, out):
    from pallas_kernels.quant_format import QuantizedArray

    rows = k // 2 if kind != "int8" else k
    dtype = jnp.uint8 if kind != "int8" else jnp.int8
    scales = jax.ShapeDtypeStruct((k // group_size, out), jnp.float16)
    return QuantizedArray(values=jax.ShapeDtypeStruct((rows, out), dtype), scales=scales,
                          mins=scales if kind == "q4_1" else None, kind=kind, group_size=group_size, shape=(k, out))


@pytest.mark.parametrize(
    "tuning,match",
    [
        (GemvTuning(block_out=48), "out=64 is not a multiple of block_out=48"),
        (GemvTuning(block_out=64, block_in=96), "split_in=1 parts that are multiples of block_in=96"),
        (GemvTuning(block_out=64, block_in=64, split_in=4), "split_in=4 parts that are multiples of block_in=64"),
        (GemvTuning(block_out=64, block_in=16), "block_in=16 must be a multiple of group_size=32"),
        (GemvTuning(block_out=64, block_in=32, acc_rows=32), r"acc_rows=32 must divide the half-group \(16"),
        (GemvTuning(block_out=64, block_in=32, acc_rows=3), r"acc_rows=3 must divide the half-group"),
    ],
)
def test_unsupported_tunings_raise(tuning, match):
    with pytest.raises(ValueError, match=match):
        dequant_matmul(_x(2), _qa("q4_1", 32), impl="pallas_gemv", config=tuning, interpret=True)


def test_odd_shapes_are_rejected_before_lowering_on_a_gpu():
    """Shapes that run interpreted but not on a GPU (Triton's tensors are powers of two): named before lowering."""
    odd = _qa("q4_1", 32, k=96, out=48)  # no power-of-two tile >= 16 divides 48 ... except 16
    check_tuning(odd, GemvTuning(block_out=16, block_in=96), native_gpu=True)
    with pytest.raises(ValueError, match=r"power-of-two block_out >= 16 .*'block_out': 8"):
        check_tuning(odd, GemvTuning(block_out=8, block_in=96), native_gpu=True)
    with pytest.raises(ValueError, match=r"power-of-two acc_rows; got \{'acc_rows': 12\}"):
        check_tuning(_qa("int8", None, k=96), GemvTuning(block_out=16, block_in=96, acc_rows=12), native_gpu=True)
    # interpreted, a 48-wide tile and a 12-row accumulator are fine
    _close(dequant_matmul(_x(2, k=96), _qa("int8", None, k=96), impl="pallas_gemv", interpret=True,
                          config=GemvTuning(block_out=16, block_in=96, acc_rows=12)),
           numpy_matmul(_x(2, k=96), _qa("int8", None, k=96)))
    assert dg.gpu_unsupported_reason(_qa("q4_1", 32, out=40)) is not None  # 40 columns: tile of 8 at most
    assert dg.gpu_unsupported_reason(_qa("q4_1", 32)) is None


@pytest.mark.parametrize("field", ["block_n", "block_out", "block_in", "split_in", "acc_rows"])
@pytest.mark.parametrize("bad", [0, -16, 2.0, True])
def test_tuning_validates_itself(field, bad):
    with pytest.raises(ValueError, match=f"GemvTuning.{field} must be a positive int; got {bad!r}"):
        GemvTuning(**{field: bad})


def test_tuning_from_flags_and_from_the_tensor_core_kernels():
    """`--matmul_tuning` text parses into a GemvTuning; a MatmulTuning (bench_kernels --sweep's grid) runs as its
    tiles and split."""
    assert MATMUL.get("pallas_gemv").tuning_type is GemvTuning
    t = MATMUL.parse_tuning("pallas_gemv", "block_out=32,split_in=2,int_to_float=cast,acc_rows=8")
    assert t == GemvTuning(block_out=32, split_in=2, int_to_float="cast", acc_rows=8)
    with pytest.raises(registry.KernelError, match="int_to_float must be one of"):
        MATMUL.parse_tuning("pallas_gemv", "int_to_float=round")
    qa, x = _qa("q4_0", 32), _x(3)
    mt = MatmulTuning(block_n=16, block_out=32, block_in=64, split_in=2)
    assert dg.as_gemv_tuning(mt, 3, qa) == GemvTuning(block_n=16, block_out=32, block_in=64, split_in=2, acc_rows=16)
    _close(dequant_matmul(x, qa, impl="pallas_gemv", config=mt, interpret=True), numpy_matmul(x, qa))
    assert _plan(x, qa, impl="pallas_gemv", config=mt, interpret=True) == ((1, 2, 2), 1)


def test_measured_table_entry_is_the_default(monkeypatch):
    qa = _qa("q4_1", 32)
    key = tuned_tables.matmul_key(kind="q4_1", group_size=32, k=K, out=OUT)
    monkeypatch.setitem(tuned_tables.GEMV, jax.devices()[0].device_kind, {key: dict(block_out=16, split_in=2,
                                                                                    block_in=32, acc_rows=4)})
    assert default_tuning(3, qa) == GemvTuning(block_n=3, block_out=16, block_in=32, split_in=2, acc_rows=4)
    tuned_tables.check_entries()
    with pytest.raises(ValueError, match="not a row count"):
        tuned_tables.check_entries(gemv_max_rows={"gpu": {"q4_1": -1}})


# ---------------------------------------------------------------------------------------- "auto" on a GPU
@pytest.fixture
def gpu_calls(monkeypatch):
    """Take the GPU branch of "auto" (the kernels still run interpreted); returns the kernels' calls, in order."""
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
    calls = spy(monkeypatch, dm, ["dequant_matmul_pallas", "dequant_matmul_xla"])
    return spy(monkeypatch, dg, ["dequant_gemv_pallas"], calls)


def _auto(n, qa, **kwargs):
    x = _x(n, k=qa.shape[0])
    got = dequant_matmul(x, qa, interpret=True, **kwargs)
    _close(got, numpy_matmul(x, qa))


@pytest.mark.parametrize("kind", ["q4_1", "int8"])
def test_auto_on_a_gpu_runs_the_gemv_up_to_the_row_limit(gpu_calls, monkeypatch, kind):
    """The default limit (DEFAULT_GEMV_MAX_ROWS rows; 0 as shipped, until a GPU measurement: the tensor-core kernel
    for every row count): the GEMV at the limit, the tensor-core kernel one row above. A measured entry of
    GEMV_MAX_ROWS for this device moves the switch (here to 2 rows, for this kind only)."""
    qa = _qa(kind, 32)
    assert dm.gpu_auto_impl(1, qa) == "pallas"  # as shipped: no device has a measured limit
    limit = 8
    monkeypatch.setattr(tuned_tables, "DEFAULT_GEMV_MAX_ROWS", limit)
    assert tuned_tables.gemv_max_rows(jax.devices()[0].device_kind, kind) == limit  # no entry for the CPU
    for n in (1, limit, limit + 1):
        _auto(n, qa)
    assert names_of(gpu_calls) == ["dequant_gemv_pallas", "dequant_gemv_pallas", "dequant_matmul_pallas"]
    assert [args[0].shape[0] for _, args, _ in gpu_calls] == [1, limit, limit + 1]

    gpu_calls.clear()
    monkeypatch.setitem(tuned_tables.GEMV_MAX_ROWS, jax.devices()[0].device_kind, {kind: 2})
    for n in (2, 3):
        _auto(n, qa)
    _auto(3, _qa("q4_0", 32))  # another kind: still the default limit
    assert names_of(gpu_calls) == ["dequant_gemv_pallas", "dequant_matmul_pallas", "dequant_gemv_pallas"]
    assert dm.gpu_auto_impl(2, qa) == "pallas_gemv" and dm.gpu_auto_impl(3, qa) == "pallas"


def test_auto_on_a_gpu_falls_back_per_matrix(gpu_calls, monkeypatch):
    """Where the GEMV's GPU rules reject the matrix, the tensor-core kernel if it fits, else XLA."""
    monkeypatch.setattr(tuned_tables, "DEFAULT_GEMV_MAX_ROWS", 8)
    _auto(1, _qa("q4_1", 32, out=40))  # neither fits 40 columns
    assert names_of(gpu_calls) == ["dequant_matmul_xla"]
    assert dm.gpu_auto_impl(1, _qa("q4_1", 16)) == "pallas_gemv"  # groups of 16: the GEMV fits, the dots do not
    assert dm.gpu_auto_impl(9, _qa("q4_1", 16)) == "xla"


def test_auto_hands_each_kernel_its_own_tuning(gpu_calls, monkeypatch):
    """A GemvTuning given with "auto" runs the GEMV (and is not the tensor-core kernel's: above the limit that one
    runs its default); a MatmulTuning serves both."""
    monkeypatch.setattr(tuned_tables, "DEFAULT_GEMV_MAX_ROWS", 8)
    qa = _qa("q4_1", 32)
    gt = GemvTuning(block_n=8, block_out=16, block_in=64, split_in=2)
    big = tuned_tables.DEFAULT_GEMV_MAX_ROWS + 1
    assert _plan(_x(1), qa, config=gt, interpret=True) == ((1, 4, 2), 1)
    _auto(big, qa, config=gt)
    assert names_of(gpu_calls)[-1] == "dequant_matmul_pallas" and gpu_calls[-1][1][2] is None


# every kind at 1 and 8 rows (the unrolled maximum of the default), and the conversion by cast, on SmolLM2's down
# projection (its default tuning splits the input in 2)
GPU_CASES = [(kind, g, n, "magic") for kind, g in KINDS for n in (1, 8)] + [("q4_1", 32, 3, "cast"),
                                                                          ("int8", 32, 3, "cast")]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="native Pallas lowering needs a GPU")
@pytest.mark.parametrize("kind,group_size,n,int_to_float", GPU_CASES)
def test_native_gpu_gemv(kind, group_size, n, int_to_float):
    """Compiled for the GPU (Triton), against the float64 oracle; and row 0 with the same bits alone."""
    qa, x = _qa(kind, group_size, k=1536, out=576), _x(n, k=1536)
    t = dataclasses.replace(default_tuning(n, qa), int_to_float=int_to_float)
    got = np.asarray(dequant_gemv_pallas(x, qa, t, interpret=False))
    _close(got, numpy_matmul(x, qa), rtol=1e-3)
    alone = np.asarray(dequant_gemv_pallas(x[:1], qa, t, interpret=False))
    assert np.array_equal(got[0], alone[0])
