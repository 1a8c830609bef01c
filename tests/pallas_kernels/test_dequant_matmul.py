"""dequant_matmul: the reference, the XLA path and the Pallas kernel (interpret mode on the CPU) against an independent
NumPy decoding of the quantized format (float64); which implementation the `impl` switch ran; that the kernel runs
the tuning it is given."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant
from pallas_kernels import dequant_matmul as dm
from pallas_kernels.dequant_matmul import (
    MatmulTuning,
    _check_tuning,
    default_tuning,
    dequant_matmul,
)
from pallas_kernels.quant_format import QuantizedArray
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

# impl -> the function of `pallas_kernels.dequant_matmul` that runs it
IMPL_FUNCTIONS = {
    "reference": "dequant_matmul_reference",
    "xla": "dequant_matmul_xla",
    "pallas": "dequant_matmul_pallas",
}

_qa, _x, _close = quantized, activations, assert_close


@pytest.fixture
def ran(monkeypatch) -> Callable[[], list[str]]:
    """`ran()`: the implementations ("reference", "xla", "pallas") `dequant_matmul` has called so far, in order."""
    calls = spy(monkeypatch, dm, list(IMPL_FUNCTIONS.values()))
    impl_of = {function: impl for impl, function in IMPL_FUNCTIONS.items()}
    return lambda: [impl_of[name] for name in names_of(calls)]


@pytest.mark.parametrize("kind,group_size", KINDS)
@pytest.mark.parametrize("n", [1, 3])
def test_reference_matches_numpy(kind, group_size, n, ran):
    qa, x = _qa(kind, group_size), _x(n)
    _close(dequant_matmul(x, qa, impl="reference"), numpy_matmul(x, qa))
    assert ran() == ["reference"]


@pytest.mark.parametrize("kind,group_size", KINDS)
@pytest.mark.parametrize("n", [1, 3, 16])
def test_xla_matches_numpy(kind, group_size, n, ran):
    qa, x = _qa(kind, group_size), _x(n)
    _close(jax.jit(functools.partial(dequant_matmul, impl="xla"))(x, qa), numpy_matmul(x, qa))
    assert ran() == ["xla"]


@pytest.mark.parametrize("kind,group_size", KINDS)
def test_xla_chunked_over_out(monkeypatch, kind, group_size):
    """Large matrices loop over output-column chunks: 2 full chunks of 128 columns and a 64-column tail here."""
    monkeypatch.setattr(dm, "XLA_CHUNK_ABOVE", 0)
    monkeypatch.setattr(dm, "XLA_CHUNK_BYTES", 4 * K * 128)
    dots = spy(monkeypatch, dm, ["_xla_dot"])
    qa, x = _qa(kind, group_size, out=320), _x(3)
    _close(dequant_matmul(x, qa, impl="xla"), numpy_matmul(x, qa))
    # the loop body (traced once) dots one 128-column chunk, then the tail its 64 columns
    assert [args[1].shape for _, args, _ in dots] == [(K, 128), (K, 64)]
    assert [e.params["length"] for e in find(dm.dequant_matmul_xla, x, qa, primitive="scan")] == [2]  # full chunks


# (kind, group, N, tuning): every kind at N in {1, 3, 16}, cycling through tuning points (None = default_tuning).
_TUNINGS = [
    None,
    MatmulTuning(block_n=8, block_out=32, block_in=64, split_in=2),
    MatmulTuning(block_n=16, block_out=64, block_in=32, split_in=1),
    MatmulTuning(block_n=4, block_out=16, block_in=128, split_in=1),
]
_PALLAS_CASES = [
    (kind, g, n, _TUNINGS[(i + j) % len(_TUNINGS)])
    for i, (kind, g) in enumerate(KINDS)
    for j, n in enumerate([1, 3, 16])
]


def _kernel_plan(n: int, k: int, out: int, t: MatmulTuning) -> tuple[tuple[int, ...], int, int]:
    """What tuning `t` makes the kernel run: its grid (x row blocks, output column blocks, input splits), the padded
    row count of x, and the loop steps (of `block_in` rows) each program takes."""
    n_pad = -(-n // t.block_n) * t.block_n
    return (n_pad // t.block_n, out // t.block_out, t.split_in), n_pad, k // t.split_in // t.block_in


def _traced_plan(*args, **kwargs) -> tuple[tuple[int, ...], int, int]:
    """`_kernel_plan` as read off the program `dequant_matmul(*args, **kwargs)` traces to."""
    (call,) = find(dequant_matmul, *args, primitive="pallas_call", **kwargs)
    (loop,) = [e for e in equations(call.params["jaxpr"]) if e.primitive.name == "scan"]
    return tuple(call.params["grid_mapping"].grid), call.invars[0].aval.shape[0], loop.params["length"]


@pytest.mark.parametrize("kind,group_size,n,tuning", _PALLAS_CASES)
def test_pallas_matches_numpy(kind, group_size, n, tuning, ran):
    qa, x = _qa(kind, group_size), _x(n)
    got = dequant_matmul(x, qa, impl="pallas", config=tuning, interpret=True)
    _close(got, numpy_matmul(x, qa))
    assert ran() == ["pallas"]
    # the kernel ran with the tuning asked for (or the default one), not some other blocking
    want = _kernel_plan(n, K, OUT, tuning or default_tuning(n, qa))
    assert _traced_plan(x, qa, impl="pallas", config=tuning, interpret=True) == want


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("kind", ["q4_1", "int8"])
def test_bf16_activations(impl, kind, ran):
    """bf16 x: XLA upcasts it, the kernel dots it with the quants converted to bf16 (exact); both accumulate in
    float32, so the result is the float64 product of the bf16-rounded x up to float32 rounding."""
    qa, x = _qa(kind, 32), _x(5, dtype=jnp.bfloat16)
    got = dequant_matmul(x, qa, impl=impl)
    _close(got, numpy_matmul(np.asarray(x.astype(jnp.float32)), qa), rtol=1e-4)
    assert ran() == [impl]


def test_odd_sizes(ran):
    """N=5, out=48 (no power-of-two tile above 16), in=96 (3 groups): default tuning copes; the grid is 1 x 3."""
    qa, x = _qa("q4_1", 32, k=96, out=48), _x(5, k=96)
    assert default_tuning(5, qa) == MatmulTuning(block_n=16, block_out=16, block_in=32, split_in=1)
    want = numpy_matmul(x, qa)
    _close(dequant_matmul(x, qa, impl="pallas"), want)
    _close(dequant_matmul(x, qa, impl="xla"), want)
    assert ran() == ["pallas", "xla"]
    assert _traced_plan(x, qa, impl="pallas") == ((1, 3, 1), 16, 3)


@pytest.mark.parametrize(
    "tuning,match",
    [
        (MatmulTuning(block_out=48), "out=64 is not a multiple of block_out=48"),
        (MatmulTuning(block_out=64, block_in=48), "split_in=1 parts that are multiples of block_in=48"),
        (MatmulTuning(block_out=64, block_in=64, split_in=4), "split_in=4 parts that are multiples of block_in=64"),
        (MatmulTuning(block_out=64, block_in=16), "block_in=16 must be a multiple of group_size=32"),
    ],
)
def test_unsupported_tunings_raise(tuning, match):
    with pytest.raises(ValueError, match=match):
        dequant_matmul(_x(2), _qa("q4_1", 32), impl="pallas", config=tuning)


@pytest.mark.parametrize("field", ["block_n", "block_out", "block_in", "split_in"])
@pytest.mark.parametrize("bad", [0, -16, 2.0, True])
def test_tuning_validates_itself(field, bad):
    with pytest.raises(ValueError, match=f"MatmulTuning.{field} must be a positive int; got {bad!r}"):
        MatmulTuning(**{field: bad})


def test_gpu_shape_rules_checked_before_lowering():
    qa = _qa("q4_1", 32)
    with pytest.raises(ValueError, match=r"powers of two >= 16.*'block_n': 8"):
        _check_tuning(1, qa, MatmulTuning(block_n=8, block_out=64, block_in=64), native_gpu=True)


@pytest.mark.parametrize(
    "k,out,group_size",
    [(576, 1536, 32), (1536, 576, 32), (576, 960, 32), (576, 3072, 32), (576, 49152, 32), (576, 1536, None)],
)
@pytest.mark.parametrize("n", [1, 16, 300])
def test_default_tuning_fits_smollm2_shapes(k, out, group_size, n):
    qa = QuantizedArray(
        values=jax.ShapeDtypeStruct((k, out), jnp.int8),
        scales=jax.ShapeDtypeStruct((1, out), jnp.float16),
        mins=None,
        kind="int8",
        group_size=group_size or k,
        shape=(k, out),
    )
    t = default_tuning(n, qa)
    _check_tuning(n, qa, t, native_gpu=True)


@pytest.mark.parametrize("where", ["interpret", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="native Pallas lowering needs a GPU")])])
def test_a_row_gets_the_same_bits_beside_any_number_of_rows(where):
    """With the default tuning the reduction over `in` depends on the matrix alone, so a row's output bits do not
    depend on how many rows share the call (a decode token next to a long prefill chunk, or in a decode step). The
    down projection of SmolLM2 (1536 x 576) used to sum in 4 parts up to 192 rows, in 2 up to 448 and in 1 above,
    and 300 rows gave row 0 other bits than one row did. 20 rows: a verification step of 4 rows at k = 4."""
    qa, x = _qa("q4_1", 32, k=1536, out=576), _x(500, k=1536)
    assert len({(default_tuning(n, qa).block_in, default_tuning(n, qa).split_in) for n in (1, 17, 65, 300, 4096)}) == 1
    alone = np.asarray(dequant_matmul(x[:1], qa, impl="pallas", interpret=where == "interpret"))
    for n in (5, 20, 80, 300, 500):
        got = np.asarray(dequant_matmul(x[:n], qa, impl="pallas", interpret=where == "interpret"))
        assert np.array_equal(got[0], alone[0]), (n, np.abs(got[0] - alone[0]).max())


def test_entry_point_errors():
    qa, x = _qa("int8", 32), _x(2)
    with pytest.raises(ValueError, match="unknown implementation 'triton'"):
        dequant_matmul(x, qa, impl="triton")
    with pytest.raises(ValueError, match=r"x must be \[N, in=128\]; got shape \(2, 64\)"):
        dequant_matmul(x[:, :64], qa)
    with pytest.raises(ValueError, match="stacked"):
        dequant_matmul(x, quant.stack([qa, qa]))
    with pytest.raises(TypeError, match="QuantizedArray"):
        dequant_matmul(x, jnp.zeros((128, 64)))


def test_auto_picks_by_backend_and_row_count(monkeypatch, ran):
    """auto: Pallas on the GPU; on the CPU the native kernel up to its row limit (NATIVE_MAX_ROWS[isa][kind]; the
    AVX2 limits here, since with VNNI there is none) where it is built, XLA for larger row counts and wherever the
    native kernel is not available."""
    available = dm.native.available()  # its first call runs a smoke test (through the reference): not counted
    skip = len(ran())
    if available:
        monkeypatch.setattr(dm.native, "resolved_isa", lambda: "avx2")
    native_calls = spy(monkeypatch, dm.native, ["native_matmul"])
    qa = _qa("q4_0", 32)
    small = dm.native.NATIVE_MAX_ROWS["avx2"]["q4_0"]
    large = small + 1
    for n in (small, large):
        _close(dequant_matmul(_x(n), qa), numpy_matmul(_x(n), qa), rtol=2e-2)
    if jax.default_backend() == "gpu":  # more rows than the GEMV takes (test_dequant_gemv.py)
        assert ran()[skip:] == ["pallas", "pallas"] and not native_calls
    elif available:
        assert ran()[skip:] == ["xla"] and [args[0].shape[0] for _, args, _ in native_calls] == [small]
    else:
        assert ran()[skip:] == ["xla", "xla"] and not native_calls


def test_auto_falls_back_to_xla_without_the_native_kernel(monkeypatch, ran):
    """No compiler at install (or a CPU without AVX2): auto runs XLA, and asking for "native" says why."""
    monkeypatch.setattr(dm.native, "unavailable_reason", lambda: "not built (no C++ compiler at install)")
    monkeypatch.setattr(dm.native, "available", lambda: False)
    qa, x = _qa("q4_1", 32), _x(1)
    _close(dequant_matmul(x, qa), numpy_matmul(x, qa))
    assert ran() == ([] if jax.default_backend() == "gpu" else ["xla"])  # one row on a GPU: the GEMV
    with pytest.raises(dm.KernelError, match="not built .*use 'xla'"):
        dequant_matmul(x, qa, impl="native")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="native Pallas lowering needs a GPU")
@pytest.mark.parametrize("kind,group_size", KINDS)
@pytest.mark.parametrize("n", [1, 16, 64])
@pytest.mark.parametrize("k,out", [(576, 1536), (1536, 576)])
def test_native_gpu_kernel(kind, group_size, n, k, out):
    qa, x = _qa(kind, group_size, k=k, out=out), _x(n, k=k)
    _close(dequant_matmul(x, qa, impl="pallas", interpret=False), numpy_matmul(x, qa), rtol=1e-3)
