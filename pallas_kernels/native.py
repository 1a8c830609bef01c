"""The native CPU matmul: `x @ dequantize(qa)` as int8 integer dot products in C++ (AVX2 / VNNI / AMX), via `jax.ffi`.

XLA:CPU has no integer-dot kernel for 4-bit weights, so every decode step turned all the model's weights into
float32 before the dots (docs/performance.md). `cpu/quant_matmul.cc` does what llama.cpp does instead: the
activations are quantized to int8 per block (one scale per weight group for the q4 kinds, per 32 inputs for int8),
each block is an integer dot product against the stored 4- or 8-bit weights (AVX2, or `vpdpbusd` where the CPU has
AVX-VNNI or AVX512-VNNI, AMX tiles from 6 rows of x where it has AMX-INT8: `ISAS`, `JPG_NATIVE_ISA`), and float32
scales (and q4_1 mins) are applied once per block.
It reads the project's `QuantizedArray` layout as it is (no second copy of the weights), and spreads output tiles
over XLA:CPU's own intra-op threads (the FFI's thread pool; no second pool competing for the cores).

The result is not bit-identical to the float path: quantizing x to int8 costs about 0.4% relative error per dot
(tested against `dequant_matmul_reference` with that bound; the model-level effect is in docs/performance.md).

The library is built by setuptools with the package (`setup.py`; optional: without a compiler the package installs
without it). `unavailable_reason()` says why it cannot be used here (not built, no AVX2, the FFI call failing its
smoke test), `None` when it can. Registered as the matmul implementation "native"; `"auto"` uses it on the CPU for
the row counts where it wins (`NATIVE_MAX_ROWS`, per instruction set and weight kind) and XLA's float dot above.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_format import QuantizedArray, dequantize, pack_q4

TARGET = "jpg_quant_matmul"
KINDS = {"q4_1": 0, "q4_0": 1, "int8": 2}
# The instruction sets the kernel is compiled for (quant_matmul.cc's `Isa`); "auto" runs the best this CPU has.
# AVX-VNNI and AVX512-VNNI add `vpdpbusd` (four u8 x s8 products summed into int32 in one instruction); the
# AVX512 build also has 32 registers, so it takes 4 rows of x per pass over the weights instead of 2. "avx512amx" is
# that build with AMX: from 6 rows of x on, the integer dots run on tiles (up to 64 rows per pass over the weights,
# 16 per tile product), bit-identical. Asking whether it is supported (`supported_isas`) also asks Linux, once, for
# the process's permission to use AMX state (process-wide; the kernel needs it before its first tile).
ISAS = {"auto": 0, "avx2": 1, "avxvnni": 2, "avx512vnni": 3, "avx512amx": 4}
# "auto" picks the native kernel on the CPU for at most this many rows of x per weight kind (None: any number), by
# the instruction set it runs; above, XLA's float32 dot of the dequantized weight is faster. Measured by timing the
# model's matrices at 1-512 rows (docs/kernels.md, "The native CPU kernel"): with VNNI the kernel is faster than
# XLA at every row count, prefill chunks included; with AVX2 alone up to 128 rows (the model's matrices: 194 vs
# 233 ms at 128 rows, 769 vs 648 at 512).
NATIVE_MAX_ROWS = {
    "avx2": {"q4_1": 128, "q4_0": 128, "int8": 128},
    "avxvnni": {"q4_1": None, "q4_0": None, "int8": None},
    "avx512vnni": {"q4_1": None, "q4_0": None, "int8": None},
    "avx512amx": {"q4_1": None, "q4_0": None, "int8": None},
}


def max_rows(kind: str) -> int | None:
    """The most rows of x `"auto"` sends to the native kernel for weights of `kind` on this CPU: None for any
    number, 0 for never (an unsupported kind, or the kernel cannot run)."""
    which = resolved_isa()
    if which is None or kind not in KINDS:
        return 0
    return NATIVE_MAX_ROWS[which][kind]


def isa() -> str:
    """The instruction set the kernel runs: `JPG_NATIVE_ISA` (one of ISAS) if set, else "auto" (the best this CPU
    has). A name this CPU cannot run is a ValueError naming the ones it can. It is read when a call is traced: set
    it before the first step (a function jitted already keeps the one it was traced with)."""
    name = _env_choice("JPG_NATIVE_ISA", "auto", ISAS)
    if name != "auto" and name not in supported_isas():
        raise ValueError(f"JPG_NATIVE_ISA={name!r}: this CPU (or this build) can run {supported_isas()}")
    return name


def supported_isas() -> list[str]:
    """The instruction sets of the built kernel that this CPU can run, best last ([] when it is not built)."""
    return list(_supported_isas())


@functools.cache
def _supported_isas() -> tuple[str, ...]:  # asked at every trace of a matmul: the CPU does not change
    lib, why = _load()
    if why is not None:
        return ()
    return tuple(name for name, code in ISAS.items() if code and lib.jpg_isa_supported(code))


def resolved_isa() -> str | None:
    """The instruction set calls run here (what "auto" resolves to), or None when the kernel cannot run."""
    supported = _supported_isas()
    if not supported:
        return None
    name = isa()
    return supported[-1] if name == "auto" else name


def _library_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_native_quant_matmul*.so")))
    return found[0] if found else None


PREFETCH_HINTS = ("nta", "t0")


def prefetch_hint() -> str:
    """How the kernel prefetches the weights: `JPG_NATIVE_PREFETCH` if set, else "nta" (non-temporal: a model's
    weights stream through without evicting the KV cache, the activations and the host's data from the caches;
    "t0" keeps them like any other line). Read when a call is traced, like `isa()`."""
    return _env_choice("JPG_NATIVE_PREFETCH", "nta", PREFETCH_HINTS)


def _env_choice(var: str, default: str, choices) -> str:
    """The value of the environment variable `var` (trimmed, lower case; `default` when unset or empty), one of
    `choices`, else a ValueError naming them."""
    name = os.environ.get(var, default).strip().lower() or default
    if name not in choices:
        raise ValueError(f"{var}={name!r}: expected one of {sorted(choices)}")
    return name


def threads() -> int:
    """Threads per call: `JPG_NATIVE_THREADS` if set, else the cores this process may run on (the kernel also uses at
    most XLA's intra-op threads plus the calling one)."""
    env = os.environ.get("JPG_NATIVE_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    path = _library_path()
    if path is None:
        return None, ("the native kernel is not built (reinstall with a C++ compiler: pip install -e . ; "
                      "the build prints why it was skipped)")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"the native kernel {os.path.basename(path)} does not load: {e}"
    if not lib.jpg_cpu_supported():
        return None, "this CPU lacks AVX2/FMA/F16C, which the native kernel needs"
    global _REGISTERED
    if not _REGISTERED:
        try:
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JpgQuantMatmul), platform="cpu")
        except Exception as e:  # noqa: BLE001 (an FFI version mismatch, ...)
            return None, f"registering the native kernel with XLA failed: {type(e).__name__}: {e}"
        _REGISTERED = True
    return lib, None


_REGISTERED = False
ATTENTION_TARGET = "jpg_paged_attention"  # the library's paged attention (pallas_kernels.native_attention)


@functools.cache
def attention_reason() -> str | None:
    """Why the library's paged attention (`pallas_kernels.native_attention`) cannot be registered, or None once it is
    (on its own: a library built before it had the kernel still serves the matmul)."""
    lib, why = _load()
    if why is not None:
        return why
    try:
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.JpgPagedAttention), platform="cpu")
    except Exception as e:  # noqa: BLE001 (a library built without it: AttributeError; an FFI mismatch, ...)
        return (f"the native library has no usable paged attention ({type(e).__name__}: {e}); rebuild it with "
                "pip install -e . --no-deps")
    return None


def unavailable_reason() -> str | None:
    """Why the native kernel cannot run here, or None when it can: JAX's default backend is the CPU (the kernel is an
    XLA:CPU custom call; in a process whose arrays live on a GPU the Pallas kernel serves instead), and the kernel is
    built, loadable, has AVX2 and passes its smoke test against the reference."""
    return library_reason() or build_reason()


def library_reason() -> str | None:
    """Why the native library cannot be used here at all (not the CPU backend, not built, not loadable, no AVX2), or
    None, whether or not the kernels pass their smoke test. Tests skip on this: where the library is there, a kernel
    that fails its smoke test makes its tests fail (it is unavailable to the dispatchers) instead of skipping them."""
    backend = jax.default_backend()
    if backend != "cpu":
        return (f"it is a CPU kernel and JAX's default backend here is {backend!r} (set JAX_PLATFORMS=cpu to run on "
                "the CPU)")
    return _load()[1]


@functools.cache
def build_reason() -> str | None:
    """Why the built kernel cannot run on this CPU, or None (built, loadable, AVX2, smoke test passed)."""
    lib, why = _load()
    if why is not None:
        return why
    # In a thread of its own: the first call may come while the engine's step is being traced, and JAX's trace
    # state is per thread, so the smoke test runs eagerly there.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_smoke_test).result()


def _smoke_test() -> str | None:
    try:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.integers(0, 16, (64, 32)), jnp.uint8)
        qa = QuantizedArray(pack_q4(q, 32), jnp.asarray(rng.uniform(0.01, 0.1, (2, 32)), jnp.float16),
                            jnp.asarray(rng.uniform(-0.5, 0.0, (2, 32)), jnp.float16), "q4_1", 32, (64, 32))
        x = jnp.asarray(rng.normal(size=(2, 64)), jnp.float32)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's own (several processes)
            got = np.asarray(jax.jit(native_matmul)(x, qa))
            want = np.asarray(jnp.dot(x, dequantize(qa), precision=jax.lax.Precision.HIGHEST))  # the spec
        if not np.allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max()):
            return "the native kernel's smoke test disagrees with the reference"
    except Exception as e:  # noqa: BLE001
        return f"the native kernel's smoke test failed: {type(e).__name__}: {e}"
    return None


def available() -> bool:
    return unavailable_reason() is None


def activation_block(qa: QuantizedArray) -> int:
    """Inputs per int8 activation scale: the weight group for the q4 kinds (both nibbles of a byte share it), else
    32 where it divides the group (per-channel int8 too), else the group."""
    g = qa.group_size
    if qa.kind != "int8" or g <= 32:
        return g
    return 32 if g % 32 == 0 else g


def native_matmul(x: jnp.ndarray, qa: QuantizedArray, *, tuning=None, layer: jnp.ndarray | None = None) -> jnp.ndarray:
    """`x` `[N, in]` @ the matrix `qa` stands for -> float32 `[N, out]`, by the native kernel (CPU only).

    With `layer` (an int32 scalar), `qa` is a stack `[L, ...]` of matrices and matrix `layer` is read in place:
    inside a `lax.scan` over layers, passing the stack (not the scan's slice) spares XLA a copy of the layer."""
    del tuning
    if layer is None and qa.batch_shape:
        raise ValueError(f"native matmul: qa is stacked (batch_shape={qa.batch_shape}); pass layer=")
    if layer is not None and len(qa.batch_shape) != 1:
        raise ValueError(f"native matmul: layer= needs a stack of matrices [L, ...], got batch_shape={qa.batch_shape}")
    if qa.kind not in KINDS:
        raise ValueError(f"native matmul: unsupported kind {qa.kind!r}")
    block = activation_block(qa)
    if block % 2 or (qa.kind != "int8" and qa.group_size % 2):
        raise ValueError(f"native matmul: group size {qa.group_size} must be even")
    _, why = _load()
    if why is not None:
        raise RuntimeError(why)
    mins = qa.mins if qa.mins is not None else jnp.zeros((1,), jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], qa.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), qa.values, qa.scales, mins, index, kind=np.int32(KINDS[qa.kind]),
                group_size=np.int64(qa.group_size), block=np.int64(block), threads=np.int64(threads()),
                isa=np.int32(ISAS[isa()]), stream=np.int32(prefetch_hint() == "nta"))
