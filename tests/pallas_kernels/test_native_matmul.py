"""The native CPU matmul (`pallas_kernels/cpu/quant_matmul.cc` through `pallas_kernels.native`): against a NumPy
emulation of its integer arithmetic (tight: catches a wrong lane, nibble or scale), against the float reference
(the int8-activation error stays small), over sampled shapes (odd sizes, tails past the 32-column tiles, group
boundaries, every kind and scale dtype, 1-41 rows), on every instruction set this CPU runs (AVX2, AVX-VNNI,
AVX512-VNNI, AMX: `JPG_NATIVE_ISA`); AMX's output bit for bit the VNNI build's; extreme values that overflow a wrong
int16 accumulation; `auto`'s choice on the CPU; and a clear error and the XLA fallback when the kernel is missing."""

from __future__ import annotations

import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quant import quantize
from pallas_kernels import native
from pallas_kernels.dequant_matmul import dequant_matmul, dequant_matmul_reference
from pallas_kernels.quant_format import dequantize, unpack_q4
from pallas_kernels.registry import KernelError

BUILDABLE = shutil.which("g++") is not None and platform.machine() in ("x86_64", "AMD64")


def test_the_kernel_is_built_wherever_it_can_be():
    # The build is optional (setup.py); on a machine with a compiler, a silently skipped build is a failure.
    if not BUILDABLE:
        pytest.skip("no C++ compiler or not x86-64: the XLA path is the fallback")
    assert native.build_reason() is None


def test_a_gpu_backend_makes_the_cpu_kernel_unavailable(monkeypatch):
    """In a process whose default backend is a GPU the kernel (an XLA:CPU custom call) is unavailable with a reason,
    `native` is a clear KernelError, and `auto` never picks it."""
    monkeypatch.setattr(native.jax, "default_backend", lambda: "gpu")
    assert native.unavailable_reason().startswith("it is a CPU kernel and JAX's default backend here is 'gpu'")
    assert not native.available()
    x, qa = make("q4_1", 32, 64, 64, 1, jnp.float16)
    with pytest.raises(KernelError, match="matmul_impl 'native' cannot run here: it is a CPU kernel"):
        dequant_matmul(x, qa, impl="native")


# Skipped only where the library cannot be called at all (`library_reason`): where it is built, a kernel that fails
# its smoke test (and so is unavailable to the dispatcher) fails these tests instead of skipping them
needs_native = pytest.mark.skipif(native.library_reason() is not None,
                                  reason=f"native kernel: {native.library_reason()}")
ISAS = native.supported_isas() or ["avx2"]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Each instruction set this CPU can run, forced through JPG_NATIVE_ISA. It is read when a call is traced, so
    the caches of traced functions are cleared around it (a `jax.jit(native_matmul)` traced under another one would
    be reused as it is)."""
    monkeypatch.setenv("JPG_NATIVE_ISA", request.param)
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def emulate(x: np.ndarray, qa) -> np.ndarray:
    """What the kernel computes, in NumPy float64: x quantized to int8 per block, integer dots per block, then the
    block and group scales (and the q4 kinds' min term on the group sums of the quantized x)."""
    k, o = qa.shape
    g, b = qa.group_size, native.activation_block(qa)
    if qa.kind == "int8":
        q = np.asarray(qa.values, np.int64)  # [k, o]
    else:
        q = np.asarray(unpack_q4(qa.values, g), np.int64).reshape(k, o)
    scales = np.asarray(qa.scales, np.float32).astype(np.float64)  # [k/g, o]
    y = np.zeros((x.shape[0], o))
    for r in range(x.shape[0]):
        xr = x[r].astype(np.float32)
        blocks = xr.reshape(k // b, b)
        amax = np.abs(blocks).max(axis=1)
        d = (amax / np.float32(127)).astype(np.float32)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        xq = np.clip(np.rint(blocks * inv[:, None]), -127, 127).astype(np.int64).reshape(k)
        for grp in range(k // g):
            gacc = np.zeros(o)
            for blk in range(grp * g // b, (grp + 1) * g // b):
                gacc += float(d[blk]) * (xq[blk * b : (blk + 1) * b] @ q[blk * b : (blk + 1) * b])
            y[r] += scales[grp] * gacc
            xs = sum(float(d[blk]) * float(xq[blk * b : (blk + 1) * b].sum())
                     for blk in range(grp * g // b, (grp + 1) * g // b))  # the quantized x's sum
            if qa.kind == "q4_1":
                y[r] += np.asarray(qa.mins, np.float32)[grp].astype(np.float64) * xs
            elif qa.kind == "q4_0":
                y[r] += -8.0 * scales[grp] * xs
    return y


# kind, group (None: per channel), in, out, rows, scale dtype
CASES = [
    ("q4_1", 32, 64, 32, 1, jnp.float16),
    ("q4_1", 32, 576, 96, 1, jnp.float16),
    ("q4_1", 32, 96, 70, 5, jnp.float16),  # 2 tiles + a 6-column scalar tail, one 4-row pass + 1
    ("q4_1", 64, 128, 64, 3, jnp.float32),
    ("q4_1", 32, 64, 7, 2, jnp.float16),  # only the scalar columns
    ("q4_0", 32, 192, 64, 4, jnp.float16),
    ("q4_0", 128, 256, 33, 9, jnp.float32),
    ("int8", 32, 96, 64, 1, jnp.float16),
    ("int8", 64, 128, 40, 6, jnp.float16),
    ("int8", None, 576, 64, 2, jnp.float32),  # per channel: activation blocks of 32 inside the one group
    ("int8", None, 90, 32, 3, jnp.float32),  # per channel, 90 inputs: one activation block of 90
    ("int8", 32, 64, 96, 21, jnp.float16),  # 5 passes of 4 rows + 1
    ("q4_1", 32, 64, 613, 5, jnp.float16),  # 2 spans of 8 tiles + a span of 3 + a 5-column scalar tail
    ("int8", 32, 96, 300, 2, jnp.float16),  # a span of 8 tiles, a span of 1, a 12-column tail
    ("q4_1", 32, 1536, 96, 41, jnp.float16),  # prepared-weight passes over 48 groups, a 1-row tail pass
    ("q4_0", 64, 192, 320, 7, jnp.float32),  # 16 steps per group: the int16 sums of AVX2 flushed twice
    ("int8", None, 1536, 64, 11, jnp.float16),  # per channel, 48 activation blocks; 2- and 4-row passes + tails
    ("q4_1", 12, 48, 64, 3, jnp.float16),  # G/2 = 6 packed rows: 3 steps per group
    ("q4_1", 6, 24, 40, 5, jnp.float16),  # G/2 = 3 (odd): the last step of a group is half empty
    ("int8", 6, 24, 64, 6, jnp.float32),  # activation blocks of 6: steps of 4 inputs, the second half empty
    ("int8", 24, 96, 64, 3, jnp.float16),  # blocks of 24: x quantized 8 at a time (no 32-wide pack), step words copied
    ("q4_1", 48, 96, 64, 2, jnp.float16),  # groups of 48: one 32-wide pack and an 8-wide rest; step words assembled
    ("q4_0", 16, 64, 64, 5, jnp.float16),  # groups of 16: 8-wide quantizing only
    ("q4_1", 32, 1536, 576, 64, jnp.float16),  # x quantized by every thread; prepared spans cut short to fit L2
    # AMX (from 6 rows): up to 64 rows in one pass, each block unpacked once for products of <= 16 rows; above 64,
    # the prepared buffer and passes of <= 64 rows
    ("q4_0", 32, 192, 128, 16, jnp.float32),
    ("q4_1", 12, 48, 64, 17, jnp.float16),  # 3 steps per group: a short tile depth; two 9-row products overlapping
    ("int8", 6, 24, 96, 8, jnp.float32),  # 2 steps per block, the second half empty
    ("q4_1", 64, 256, 200, 33, jnp.float32),  # 16 steps (the tile's full depth), 3 tiles + an 8-column tail
    ("q4_1", 32, 1536, 200, 70, jnp.float16),  # AMX above 64 rows: prepared spans of 2 tiles, passes of 64 + 6 rows
    ("int8", 32, 96, 64, 65, jnp.float32),  # passes of 64 + 1 row: a 1-row tile product
    ("q4_0", 32, 64, 600, 50, jnp.float16),  # 4 products of 13 rows (the last overlapping 2), 9 tiles + a 24-col tail
    ("q4_1", 128, 256, 128, 8, jnp.float16),  # 32 steps per group: deeper than a tile, stays on the VNNI passes
]


def make(kind, group, k, o, n, scale_dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(scale=0.05, size=(k, o)), jnp.float32)
    qa = quantize(w, kind, group, scale_dtype=scale_dtype)
    x = jnp.asarray(rng.normal(size=(n, k)) * rng.uniform(0.1, 3.0, size=(n, 1)), jnp.float32)
    return x, qa


@needs_native
@pytest.mark.parametrize("kind, group, k, o, n, scale_dtype", CASES)
def test_native_equals_its_integer_arithmetic_and_stays_close_to_the_float_reference(kind, group, k, o, n,
                                                                                      scale_dtype, isa):
    x, qa = make(kind, group, k, o, n, scale_dtype)
    got = np.asarray(jax.jit(native.native_matmul)(x, qa))
    assert got.shape == (n, o) and got.dtype == np.float32
    want = emulate(np.asarray(x), qa)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    ref = np.asarray(dequant_matmul_reference(x, qa))
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 0.01, rel  # int8 activations: ~0.5% typical


@needs_native
def test_sampled_shapes_match_the_emulation(isa):
    rng = np.random.default_rng(7)
    for i in range(12):
        kind = ["q4_1", "q4_0", "int8"][i % 3]
        group = int(rng.choice([32, 64]))
        k = group * int(rng.integers(1, 6))
        o = int(rng.integers(1, 700))  # up to 2 spans of 8 tiles and a partial one
        n = int(rng.integers(1, 24))  # the 1-3 row passes and the prepared-weight passes with their tails
        x, qa = make(kind, group, k, o, n, jnp.float16, seed=i)
        got = np.asarray(native.native_matmul(x, qa))
        want = emulate(np.asarray(x), qa)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(np.abs(want).max(), 1e-6),
                                   err_msg=f"{isa}: {kind} g={group} k={k} o={o} n={n}")


@needs_native
@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "int8"])
@pytest.mark.parametrize("n", [3, 20])
def test_extreme_values_stay_exact(kind, isa, n):
    """The largest products everywhere: every activation quantizes to +-127 and every weight is at its extreme
    (nibble 15; int8 -128 and 127, which a GGUF file may hold). A group of 128 inputs is 32 steps, so AVX2's int16
    sums of 4-bit products must be widened every 8 steps (16 would overflow), its int8 path must keep each pair of
    |w| x products within int16 (-128 * -127 twice fits; w + 128 against x would not), and VNNI's int8 path must
    take its +128 offset back out exactly; with 20 rows, on AMX tiles too (int8's 32-input blocks)."""
    from pallas_kernels.quant_format import QuantizedArray, pack_q4

    k, o, g = 256, 64, 128
    rng = np.random.default_rng(3)
    sign = np.where(rng.random((n, k)) < 0.5, -1.0, 1.0)
    x = jnp.asarray(sign * 2.5, jnp.float32)
    x = x.at[0].set(2.5)  # one row all positive: the int16 sums at their largest
    scales = jnp.asarray(rng.uniform(0.5, 1.0, (k // g, o)), jnp.float32)
    if kind == "int8":
        w = np.where(rng.random((k, o)) < 0.5, -128, 127)
        w[:, 0] = -128  # a column of -128 against the all-positive row
        qa = QuantizedArray(jnp.asarray(w, jnp.int8), scales, None, "int8", g, (k, o))
    else:
        q = jnp.full((k, o), 15, jnp.int32)
        mins = jnp.asarray(rng.uniform(-1, 0, (k // g, o)), jnp.float32) if kind == "q4_1" else None
        qa = QuantizedArray(pack_q4(q, g), scales, mins, kind, g, (k, o))
    got = np.asarray(jax.jit(native.native_matmul)(x, qa))
    want = emulate(np.asarray(x), qa)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=isa)


def test_the_instruction_set_switch(monkeypatch):
    """JPG_NATIVE_ISA picks what the kernel runs; a misspelt or unsupported name is a ValueError that names the
    choices; "auto" resolves to the best this CPU has (the last of supported_isas)."""
    monkeypatch.setenv("JPG_NATIVE_ISA", "sse2")
    with pytest.raises(ValueError, match=r"JPG_NATIVE_ISA='sse2': expected one of \['auto', 'avx2', "):
        native.isa()
    if native.supported_isas():
        monkeypatch.setenv("JPG_NATIVE_ISA", "AVX2")
        assert native.isa() == "avx2"
    monkeypatch.delenv("JPG_NATIVE_ISA")
    assert native.isa() == "auto"
    if native.supported_isas():
        assert native.resolved_isa() == native.supported_isas()[-1]
        missing = [i for i in ("avxvnni", "avx512vnni", "avx512amx") if i not in native.supported_isas()]
        if missing:
            monkeypatch.setenv("JPG_NATIVE_ISA", missing[0])
            with pytest.raises(ValueError, match="this CPU .or this build. can run"):
                native.isa()


def test_the_prefetch_switch(monkeypatch):
    """JPG_NATIVE_PREFETCH picks the weights' prefetch hint: "nta" unless set, "t0" on request, anything else a
    ValueError naming the choices."""
    monkeypatch.delenv("JPG_NATIVE_PREFETCH", raising=False)
    assert native.prefetch_hint() == "nta"
    monkeypatch.setenv("JPG_NATIVE_PREFETCH", " T0 ")
    assert native.prefetch_hint() == "t0"
    monkeypatch.setenv("JPG_NATIVE_PREFETCH", "t2")
    with pytest.raises(ValueError, match=r"JPG_NATIVE_PREFETCH='t2': expected one of \['nta', 't0'\]"):
        native.prefetch_hint()


@needs_native
@pytest.mark.parametrize("kind,rows", [("q4_1", 1), ("q4_1", 5), ("int8", 5), ("q4_0", 12)])
def test_the_prefetch_hint_reaches_the_kernel_and_changes_no_bit(monkeypatch, kind, rows):
    """The hint travels to the kernel as its `stream` attribute (1: NTA, 0: T0), read when a call is traced; a
    prefetch hint moves no arithmetic, so both give the same bits (direct passes and prepared weights alike)."""
    x, qa = make(kind, 32, 576, 600, rows, jnp.float16, seed=rows)
    out = {}
    for hint, attr in (("nta", "stream = 1 : i32"), ("t0", "stream = 0 : i32")):
        monkeypatch.setenv("JPG_NATIVE_PREFETCH", hint)
        jax.clear_caches()
        assert attr in jax.jit(native.native_matmul).lower(x, qa).as_text()
        out[hint] = np.asarray(jax.jit(native.native_matmul)(x, qa))
    jax.clear_caches()
    np.testing.assert_array_equal(out["nta"], out["t0"])


@needs_native
@pytest.mark.skipif("avx512amx" not in ISAS, reason="this CPU (or this build) has no usable AMX")
@pytest.mark.parametrize("kind,group,rows", [("q4_1", 32, 6), ("q4_1", 32, 16), ("q4_0", 32, 23), ("int8", 32, 40),
                                             ("int8", None, 9), ("q4_1", 64, 33), ("q4_1", 32, 130),
                                             ("int8", None, 80), ("q4_0", 32, 64), ("q4_1", 12, 50), ("int8", 6, 65)])
def test_amx_tiles_compute_the_bits_of_the_vnni_build(monkeypatch, kind, group, rows):
    """From JPG_AMX_MIN_ROWS rows the AMX build runs its integer dots on tiles; the sums are exact and the float
    scaling runs in the VNNI passes' order, so its output equals the AVX512-VNNI build's bit for bit (which is what
    lets the model-level quality figures of that build stand for it)."""
    x, qa = make(kind, group, 1536 if group is None else 576, 600, rows, jnp.float16, seed=rows)  # 9 tiles + 24
    out = {}
    for which in ("avx512vnni", "avx512amx"):
        monkeypatch.setenv("JPG_NATIVE_ISA", which)
        jax.clear_caches()
        out[which] = np.asarray(jax.jit(native.native_matmul)(x, qa))
    jax.clear_caches()
    np.testing.assert_array_equal(out["avx512amx"], out["avx512vnni"])


@needs_native
def test_zero_rows_and_zero_inputs(isa):
    x, qa = make("q4_1", 32, 64, 64, 2, jnp.float16)
    np.testing.assert_allclose(np.asarray(native.native_matmul(jnp.zeros_like(x), qa)), 0.0)
    assert native.native_matmul(x[:0], qa).shape == (0, 64)


@needs_native
@pytest.mark.parametrize("kind", ["q4_1", "int8"])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(isa, kind):
    """Each row's activations are quantized on their own and its sums never meet another row's, on the direct
    passes (few rows) and over the prepared weights (more): a row's output is bitwise the same alone and among 11 or
    70 others (what speculative greedy identity leans on: a verification row next to another row, or alone)."""
    x, qa = make(kind, 32, 192, 192, 71, jnp.float16, seed=3)
    full = np.asarray(native.native_matmul(x, qa))
    for n in (1, 5, 12):
        np.testing.assert_array_equal(np.asarray(native.native_matmul(x[:n], qa)), full[:n])
    for r in (0, 4, 11, 70):
        np.testing.assert_array_equal(np.asarray(native.native_matmul(x[r : r + 1], qa)), full[r : r + 1])


@needs_native
def test_inside_a_scan_over_stacked_layers(isa):
    xs, qas = zip(*[make("q4_1", 32, 64, 64, 1, jnp.float16, seed=s) for s in range(3)])
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *qas)

    def body(h, qa):
        return h, native.native_matmul(h, qa)

    _, ys = jax.jit(lambda h, w: jax.lax.scan(body, h, w))(xs[0], stacked)
    for i, qa in enumerate(qas):
        np.testing.assert_allclose(np.asarray(ys[i]), emulate(np.asarray(xs[0]), qa), rtol=1e-4, atol=1e-4)


@needs_native
def test_auto_follows_the_row_limits_of_the_instruction_set(monkeypatch):
    """auto sends x to the native kernel up to the row limit of the instruction set it runs and of the weight kind
    (AVX2: 128 rows; with VNNI any number, prefill chunks included), XLA above."""
    calls = []
    real = native.native_matmul
    monkeypatch.setattr(native, "native_matmul", lambda x, qa, **kw: calls.append(x.shape[0]) or real(x, qa, **kw))
    monkeypatch.setattr(native, "resolved_isa", lambda: "avx2")
    assert (native.max_rows("q4_1"), native.max_rows("q4_0"), native.max_rows("int8")) == (128, 128, 128)
    assert native.max_rows("nf4") == 0
    for kind in ("q4_1", "int8"):
        calls.clear()
        limit = native.max_rows(kind)
        x, qa = make(kind, 32, 64, 64, limit + 1, jnp.float16)
        dequant_matmul(x[:1], qa, impl="auto")
        dequant_matmul(x[:limit], qa, impl="auto")
        dequant_matmul(x, qa, impl="auto")  # one row more: XLA
        assert calls == [1, limit], kind
    for vnni in ("avxvnni", "avx512vnni", "avx512amx"):
        monkeypatch.setattr(native, "resolved_isa", lambda v=vnni: v)
        assert native.max_rows("q4_1") is None and native.max_rows("int8") is None
        calls.clear()
        x, qa = make("int8", 32, 64, 64, 300, jnp.float16)
        dequant_matmul(x, qa, impl="auto")
        assert calls == [300], vnni
    monkeypatch.setattr(native, "resolved_isa", lambda: None)  # the kernel cannot run: never
    assert native.max_rows("q4_1") == 0
    x, qa = make("q4_1", 32, 64, 64, 3, jnp.float16)
    out = dequant_matmul(x[:3], qa, impl="native")
    np.testing.assert_allclose(np.asarray(out), emulate(np.asarray(x[:3]), qa), rtol=1e-4, atol=1e-4)


def test_a_missing_kernel_is_a_clear_error_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(native, "unavailable_reason", lambda: "the native kernel is not built (test)")
    monkeypatch.setattr(native, "available", lambda: False)
    x, qa = make("q4_1", 32, 64, 64, 1, jnp.float16)
    with pytest.raises(KernelError, match=r"matmul_impl 'native' cannot run here: the native kernel is not built"):
        dequant_matmul(x, qa, impl="native")
    want = np.asarray(x) @ np.asarray(dequantize(qa))
    np.testing.assert_allclose(np.asarray(dequant_matmul(x, qa, impl="auto")), want, rtol=1e-5, atol=1e-5)
