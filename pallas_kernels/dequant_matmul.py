"""Dequantizing matmul `x @ dequantize(qa)`: the pure-jnp reference, the XLA fast path for the CPU, a Pallas kernel.

`qa` is a `pallas_kernels.quant_format.QuantizedArray` standing for a float matrix `[in, out]` (groups of
`group_size` along `in`; kinds "q4_1", "q4_0", "int8"; layout and nibble order in `quant_format.py`; `models/quant.py`
makes them). Every implementation returns float32 `[N, out]` accumulated in float32.

- `dequant_matmul_reference`: dequantize to float32, one dot at HIGHEST precision. The spec.
- XLA path (`impl="xla"`, the CPU default): dequantize into a float32 matrix and run one dot. On XLA:CPU this
  beats every formulation that avoids materializing the weight (grouped partial dots, a fused multiply-reduce, an
  `[out, in]` layout: measured 2-10x slower), and float32 beats bf16 here (bf16 x is upcast). int4 is expanded
  nibble-plane-major (all low nibbles, then all high ones) against correspondingly permuted x columns, because the
  in-group concatenate that `dequantize` uses compiles ~6x slower inside `lax.scan`. Per-channel int8 dots the
  converted int8 values and scales the `[N, out]` result. Very large matrices (the LM head) loop over output-column
  chunks so the float32 temporary stays a few MB.
- Pallas kernel (`impl="pallas"`, the GPU default): grid over (N blocks, out blocks, in splits); each program loops
  over its share of `in` in steps of `block_in` rows, and per quantization group dots the x slice with the group's
  raw quants (converted to x's dtype: exact, since |q| <= 127) and applies the group's scale (and min, via the
  group's x row sums) to the `[block_n, block_out]` partial product in float32. Applying the scale after the dot
  costs `block_n * block_out` multiplies per group instead of `group_size * block_out`, and leaves the weight
  operand exact in bf16. int4 groups are two contiguous half-groups (low and high nibbles), so the kernel does two
  dots of `group_size/2` rows per group and never reshapes or interleaves. No scalar prefetch and no scratch
  buffers (Triton rejects both); the accumulator is a loop carry. `split_in > 1` gives each program a slice of `in`
  and sums the float32 partials outside -- parallelism for decode, where N is 1 and `out / block_out` is small.
- Pallas GEMV (`impl="pallas_gemv"`, `dequant_gemv.py`): for few rows; the weight tile dequantized in registers and
  multiplied into x with elementwise float32 multiply-adds, no tensor-core dot and no padding of N to 16. On a GPU
  "auto" runs it up to `tuned_tables.gemv_max_rows` rows (per device and weight kind) and this kernel above
  (`gpu_auto_impl`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import dequant_gemv, native, registry
from pallas_kernels.quant_call import quant_pallas_call
from pallas_kernels.quant_format import LayerSlice, QuantizedArray, dequantize, random_quantized
from pallas_kernels.registry import MATMUL, KernelContractError, KernelError, KernelImpl, split_tuning
from pallas_kernels.tuned_tables import gemv_max_rows, lookup_matmul


@dataclasses.dataclass(frozen=True)
class MatmulTuning:
    """Block sizes of the Pallas kernel (the XLA path ignores them).

    block_n: rows of x per program (x is zero-padded up to a multiple); on GPU at least 16 (tensor-core dot).
    block_out: output columns per program; must divide `out`.
    block_in: input rows per loop step; a multiple of the group size (or a divisor of `in` for per-channel int8).
    split_in: programs sharing one output tile, each over `in / split_in` rows; partials summed in float32.
    num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
    """

    block_n: int = 16
    block_out: int = 128
    block_in: int = 64
    split_in: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MatmulTuning.{f.name} must be a positive int; got {v!r}")
        if self.num_warps & (self.num_warps - 1) or self.num_warps > 32:
            raise ValueError(f"MatmulTuning.num_warps must be a power of two in [1, 32]; got {self.num_warps!r}")


def default_tuning(n: int, qa: QuantizedArray) -> MatmulTuning:
    """The tuning used when the caller passes none: a measured entry of `pallas_kernels.tuned_tables` for this
    device and shape if there is one, else one that fits the shape: power-of-two blocks that divide `in`/`out`,
    `split_in` for small outputs.

    The reduction over `in` (`block_in` steps, `split_in` partial sums) is chosen from the matrix alone, never from
    the row count `n` (which sets only `block_n`), so a row of x gets the same bits however many rows share the call:
    a decode token next to a long prefill chunk as in a decode step. (`split_in` used to shrink as the row blocks
    grew: SmolLM2's down projection summed in 4 parts up to 192 rows, in 2 up to 448 and in 1 above.) A measured
    table entry is one per matrix (`tuned_tables.matmul_key`): its tiles and reduction apply to every row count, its
    `block_n` up to that many rows."""
    k, out = qa.shape
    block_n = 16 if n <= 16 else (32 if n <= 32 else 64)
    measured = lookup_matmul(jax.devices()[0].device_kind, kind=qa.kind, group_size=qa.group_size, k=k, out=out)
    if measured is not None:
        t = MatmulTuning(**measured)
        return t if n <= t.block_n else dataclasses.replace(t, block_n=max(block_n, t.block_n))

    def largest_pow2_divisor(size: int, cap: int, floor: int = 1) -> int:
        b = cap
        while b > floor and size % b:
            b //= 2
        return b

    block_out = largest_pow2_divisor(out, 128)
    if qa.per_channel:
        block_in = largest_pow2_divisor(k, 128)
    else:
        g = qa.group_size
        block_in = g * largest_pow2_divisor(k // g, max(1, 128 // g))
    steps = k // block_in
    tiles = out // block_out  # of one row block: the split must not depend on n (see above)
    split = 1
    while tiles * split < 64 and steps % (split * 2) == 0 and steps // (split * 2) >= 2:
        split *= 2
    return MatmulTuning(block_n=block_n, block_out=block_out, block_in=block_in, split_in=split)


# ------------------------------------------------------------------------------------------------- reference
def dequant_matmul_reference(x: jnp.ndarray, qa: QuantizedArray) -> jnp.ndarray:
    """The spec: `x` `[N, in]` @ dequantize(qa) `[in, out]` -> float32 `[N, out]`."""
    w = dequantize(qa)  # [in, out] float32
    return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


# -------------------------------------------------------------------------------------------------- XLA path
# Above this many bytes of dequantized float32 weight (e.g. a 576 x 49152 LM head: 113 MB), the XLA path loops over
# output-column chunks of about XLA_CHUNK_BYTES, so the dequantized tile stays in cache instead of being written to
# and read back from fresh memory (measured ~10x faster at N=1 for the LM head). Smaller matrices run in one piece.
XLA_CHUNK_ABOVE = 16 << 20
XLA_CHUNK_BYTES = 4 << 20


def _plane_major_x(x: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """x `[N, in]` with columns reordered (half, group, j): all low-nibble elements first, then all high ones."""
    n, k = x.shape
    return x.reshape(n, k // group_size, 2, group_size // 2).transpose(0, 2, 1, 3).reshape(n, k)


def _dequantize_q4_plane_major(qa: QuantizedArray) -> jnp.ndarray:
    """float32 `[in, out]` with rows in (half, group, j) order, to pair with `_plane_major_x`.

    Same values as `dequantize`, but the nibble planes are expanded along a new leading axis instead of being
    concatenated inside each group: inside a `lax.scan` over layers XLA:CPU compiles the concatenate ~6x slower.
    """
    k, out = qa.shape
    g = qa.group_size
    p = qa.values.reshape(1, k // g, g // 2, out)
    q = ((p >> jnp.array([0, 4], jnp.uint8).reshape(2, 1, 1, 1)) & 15).astype(jnp.float32)  # [2, in/G, G/2, out]
    s = qa.scales.astype(jnp.float32)[None, :, None, :]
    w = q * s + qa.mins.astype(jnp.float32)[None, :, None, :] if qa.kind == "q4_1" else (q - 8.0) * s
    return w.reshape(k, out)


def _xla_dot(x: jnp.ndarray, qa: QuantizedArray) -> jnp.ndarray:  # x: [N, in] float32 -> [N, out] float32
    if qa.kind == "int8":
        if qa.per_channel:
            return jnp.dot(x, qa.values.astype(jnp.float32)) * qa.scales.astype(jnp.float32)  # [N, out] * [1, out]
        return jnp.dot(x, dequantize(qa))
    return jnp.dot(_plane_major_x(x, qa.group_size), _dequantize_q4_plane_major(qa))


def dequant_matmul_xla(x: jnp.ndarray, qa: QuantizedArray) -> jnp.ndarray:
    """Dequantize to float32 and run one dot (bf16 x is upcast: measured faster on XLA:CPU, and more accurate)."""
    x = x.astype(jnp.float32)
    k, out = qa.shape
    if k * out * 4 <= XLA_CHUNK_ABOVE:
        return _xla_dot(x, qa)
    cols = max(128, XLA_CHUNK_BYTES // (4 * k) // 128 * 128)
    n_full = out // cols

    def columns(start: int | jnp.ndarray, size: int) -> QuantizedArray:
        sub = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=a.ndim - 1), qa)
        return sub.replace(shape=(k, size))

    def step(i, y):  # y: [N, out]
        return jax.lax.dynamic_update_slice_in_dim(y, _xla_dot(x, columns(i * cols, cols)), i * cols, axis=1)

    y = jax.lax.fori_loop(0, n_full, step, jnp.zeros((x.shape[0], out), jnp.float32))
    if out > n_full * cols:
        y = y.at[:, n_full * cols :].set(_xla_dot(x, columns(n_full * cols, out - n_full * cols)))
    return y


# ------------------------------------------------------------------------------------------------ Pallas path
def _dequant_matmul_kernel(
    x_ref,  # [block_n, in / split_in] (x's dtype)
    v_ref,  # q4: uint8 [in / split_in / 2, block_out]; int8: int8 [in / split_in, block_out]
    s_ref,  # [groups / split_in, block_out] (per-channel: [1, block_out])
    *rest,  # m_ref [groups / split_in, block_out] for q4_1; then o_ref [block_n, block_out] float32
    kind: str,
    group_size: int,
    block_in: int,
    num_steps: int,
    per_channel: bool,
):
    m_ref = rest[0] if kind == "q4_1" else None
    o_ref = rest[-1]
    cdt = x_ref.dtype
    g = group_size
    f32 = jnp.float32

    def dot(a, b):
        return jnp.dot(a, b.astype(cdt), preferred_element_type=f32)

    def step(c, acc):  # acc: [block_n, block_out] float32
        row0 = pl.multiple_of(c * block_in, block_in)
        if per_channel:
            return acc + dot(x_ref[:, pl.ds(row0, block_in)], v_ref[pl.ds(row0, block_in), :])
        for j in range(block_in // g):  # static: the groups of this step
            row = row0 + j * g
            grp = c * (block_in // g) + j
            s = s_ref[pl.ds(grp, 1), :].astype(f32)  # [1, block_out]
            if kind == "int8":
                acc += dot(x_ref[:, pl.ds(row, g)], v_ref[pl.ds(row, g), :]) * s
                continue
            p = v_ref[pl.ds(pl.multiple_of(row // 2, g // 2), g // 2), :]  # [g/2, block_out] uint8
            x_lo = x_ref[:, pl.ds(row, g // 2)]  # [block_n, g/2]: group elements 0 .. g/2-1 (low nibbles)
            x_hi = x_ref[:, pl.ds(row + g // 2, g // 2)]  # [block_n, g/2]: elements g/2 .. g-1 (high nibbles)
            part = dot(x_lo, p & 15) + dot(x_hi, p >> 4)  # [block_n, block_out]
            xsum = jnp.sum(x_lo.astype(f32), axis=1, keepdims=True) + jnp.sum(x_hi.astype(f32), axis=1, keepdims=True)
            if kind == "q4_1":
                acc += part * s + xsum * m_ref[pl.ds(grp, 1), :].astype(f32)
            else:  # q4_0: (q - 8) * s
                acc += (part - 8.0 * xsum) * s
        return acc

    acc = jax.lax.fori_loop(0, num_steps, step, jnp.zeros(o_ref.shape, f32))
    if per_channel:
        acc = acc * s_ref[...].astype(f32)
    o_ref[...] = acc


def _check_tuning(n: int, qa: QuantizedArray, t: MatmulTuning, native_gpu: bool) -> None:
    k, out = qa.shape
    if out % t.block_out:
        raise ValueError(f"out={out} is not a multiple of block_out={t.block_out}; pick a block_out that divides it")
    if k % t.split_in or (k // t.split_in) % t.block_in:
        raise ValueError(
            f"in={k} must split into split_in={t.split_in} parts that are multiples of block_in={t.block_in}"
        )
    if not qa.per_channel and t.block_in % qa.group_size:
        raise ValueError(f"block_in={t.block_in} must be a multiple of group_size={qa.group_size}")
    if native_gpu:
        dims = {"block_n": t.block_n, "block_out": t.block_out}
        dims["dot depth"] = t.block_in if qa.per_channel else (qa.group_size // (2 if qa.kind != "int8" else 1))
        bad = {name: v for name, v in dims.items() if v < 16 or v & (v - 1)}
        if bad:
            raise ValueError(f"the GPU kernel needs powers of two >= 16 for its dot shapes; got {bad}")


def gpu_unsupported_reason(qa: QuantizedArray, tuning: MatmulTuning | None = None, n: int = 1) -> str | None:
    """Why the kernel cannot run natively on a GPU for this matrix (and tuning; None: the default tuning for `n`
    rows), or None when it can."""
    try:
        _check_tuning(n, qa, tuning if tuning is not None else default_tuning(n, qa), native_gpu=True)
    except ValueError as e:
        return str(e)
    return None


def dequant_matmul_pallas(
    x: jnp.ndarray, qa: QuantizedArray, config: MatmulTuning | None = None, *, interpret: bool | None = None
) -> jnp.ndarray:
    """The Pallas kernel; `interpret=None` interprets where Pallas cannot lower (the CPU)."""
    n, k = x.shape
    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "tpu")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.float32)
    t = config if config is not None else default_tuning(n, qa)
    _check_tuning(n, qa, t, native_gpu=not interpret and jax.default_backend() == "gpu")
    n_pad = -(-n // t.block_n) * t.block_n
    if n_pad != n:
        x = jnp.pad(x, ((0, n_pad - n), (0, 0)))
    kernel = functools.partial(
        _dequant_matmul_kernel,
        kind=qa.kind,
        group_size=qa.group_size,
        block_in=t.block_in,
        num_steps=k // t.split_in // t.block_in,
        per_channel=qa.per_channel,
    )
    x_spec = pl.BlockSpec((t.block_n, k // t.split_in), lambda i, j, s: (i, s))
    y = quant_pallas_call(kernel, x, x_spec, qa, n_pad=n_pad, rows=t.block_n, block_out=t.block_out,
                          split_in=t.split_in, interpret=interpret, num_warps=t.num_warps, num_stages=t.num_stages,
                          name=f"dequant_matmul_{qa.kind}")
    return y[:n]


# ------------------------------------------------------------------------------------------------ entry point
# The implementations, registered by name (`pallas_kernels.registry.MATMUL`). The contract (see the module
# docstring): fn(x [N, in] float, qa: QuantizedArray (one matrix, not stacked), *, tuning) -> float32 [N, out].


def _reference_impl(x, qa, *, tuning=None):
    del tuning
    return dequant_matmul_reference(x, qa)


def _xla_impl(x, qa, *, tuning=None):
    del tuning
    return dequant_matmul_xla(x, qa)


def _pallas_impl(x, qa, *, tuning=None, interpret=None):
    return dequant_matmul_pallas(x, qa, tuning, interpret=interpret)


def _pallas_gemv_impl(x, qa, *, tuning=None, interpret=None):
    return dequant_gemv.dequant_gemv_pallas(x, qa, tuning, interpret=interpret)


_pallas_gemv_impl.tuning_type = dequant_gemv.GemvTuning


def _native_check() -> None:
    why = native.unavailable_reason()
    if why is not None:
        raise KernelError(f"matmul_impl 'native' cannot run here: {why}; use 'xla' (or 'auto', which falls back)")


def _native_impl(x, qa, *, tuning=None, layer=None):
    _native_check()
    return native.native_matmul(x, qa, tuning=tuning, layer=layer)


_native_impl.tolerance = 0.02  # int8 activations (one scale per block): ~0.5-1% of the largest output


def native_fits(n: int, qa: QuantizedArray) -> bool:
    """`auto`'s rule on the CPU: the native kernel for the row counts where it is faster on this CPU's instruction
    set (`native.max_rows`), when it is built and runs here; XLA otherwise."""
    if not native.available() or native.activation_block(qa) % 2:
        return False
    limit = native.max_rows(qa.kind)
    return limit is None or n <= limit


_pallas_impl.tuning_type = MatmulTuning

# The built-in names (every registered name, plugins included, is `MATMUL.names()`).
IMPLS = ("auto", "reference", "xla", "pallas", "pallas_gemv", "native")


def gpu_auto_impl(n: int, qa: QuantizedArray, config: Any = None) -> str:
    """`auto`'s rule on a GPU for `n` rows of x: the GEMV up to `tuned_tables.gemv_max_rows` rows for this device
    and weight kind (where it fits the matrix, `dequant_gemv.gpu_unsupported_reason`), the tensor-core kernel above
    (where it fits, `gpu_unsupported_reason`), XLA otherwise. A `GemvTuning` in `config` serves only the GEMV (the
    tensor-core kernel then runs its default)."""
    gemv_config = config if isinstance(config, (dequant_gemv.GemvTuning, MatmulTuning)) else None
    if (n <= gemv_max_rows(jax.devices()[0].device_kind, qa.kind)
            and dequant_gemv.gpu_unsupported_reason(qa, gemv_config, n) is None):
        return "pallas_gemv"
    if gpu_unsupported_reason(qa, _matmul_config(config), n) is None:
        return "pallas"
    return "xla"


def _matmul_config(config: Any) -> Any:
    """`config` for the tensor-core kernel: a GEMV tuning is not its own (None: its default)."""
    return None if isinstance(config, dequant_gemv.GemvTuning) else config


def dequant_matmul(
    x: jnp.ndarray,
    qa: QuantizedArray,
    *,
    impl: str | KernelImpl = "auto",
    config: Any = None,
    interpret: bool | None = None,
) -> jnp.ndarray:
    """`x` `[N, in]` @ the matrix `qa` stands for `[in, out]` -> float32 `[N, out]`.

    impl: a registered name ("reference", "xla", "pallas", "pallas_gemv", "native", or one a user registered), a
    `module:function` path, or "auto": on a GPU `gpu_auto_impl` (the GEMV for few rows, the tensor-core kernel
    above, each where it fits the matrix; XLA otherwise); on the CPU the native kernel where `native_fits`, else
    XLA. `config` is the implementation's tuning (`MatmulTuning` for the tensor-core kernel, `GemvTuning` for the
    GEMV); `interpret` only affects the built-in Pallas kernels.
    """
    impl, tuned = split_tuning(impl)  # a `Tuned` (impl, tuning) from the engine config
    config = tuned if config is None else config
    if impl == "auto" and isinstance(qa, (QuantizedArray, LayerSlice)):
        if registry.on_gpu():
            impl = gpu_auto_impl(x.shape[0], qa if isinstance(qa, QuantizedArray) else qa.stacked, config)
            config = _matmul_config(config) if impl == "pallas" else config
        else:
            impl = "native" if native_fits(x.shape[0], qa if isinstance(qa, QuantizedArray) else qa.stacked) else "xla"
    try:
        entry = MATMUL.get(impl)
    except KernelError as e:
        raise ValueError(f"impl: {e}") from None
    if isinstance(qa, LayerSlice):  # one layer of a stack: the native kernel reads it in place, the rest slice it
        if entry.fn is _native_impl and x.ndim == 2 and x.shape[1] == qa.shape[0]:
            return _native_impl(x, qa.stacked, tuning=config, layer=qa.layer)
        qa = qa.get()
    if not isinstance(qa, QuantizedArray):
        raise TypeError(f"dequant_matmul needs a QuantizedArray; got {type(qa).__name__}")
    if qa.batch_shape:
        raise ValueError(f"qa is stacked (batch_shape={qa.batch_shape}); slice one matrix out first")
    if x.ndim != 2 or x.shape[1] != qa.shape[0]:
        raise ValueError(f"x must be [N, in={qa.shape[0]}]; got shape {tuple(x.shape)}")
    if entry.fn is _pallas_impl:
        return _pallas_impl(x, qa, tuning=config, interpret=interpret)
    if entry.fn is _pallas_gemv_impl:
        return _pallas_gemv_impl(x, qa, tuning=config, interpret=interpret)
    if entry.builtin:
        return entry.fn(x, qa, tuning=config)
    return registry.checked_call(entry, (x, qa), dict(tuning=config), (x.shape[0], qa.shape[1]), jnp.dtype(jnp.float32),
                                 f"x {tuple(x.shape)} {x.dtype}, a {qa.kind} matrix {tuple(qa.shape)}")


def contract_cases() -> list[tuple[jnp.ndarray, QuantizedArray]]:
    """Small (x, qa) pairs in the contract's terms, one per weight kind (q4_1, q4_0 and int8 in groups of 32, int8
    per output channel): x [3, 64] float32, qa standing for [64, 32]. Used by the registration check;
    `pallas_kernels.testing` has the full case space."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 64)).astype(np.float32))
    return [(x, random_quantized(rng, kind, group, 64, 32)) for kind, group in (("q4_1", 32), ("q4_0", 32),
                                                                               ("int8", 32), ("int8", 64))]


def check_contract(impl: KernelImpl) -> None:
    """`KernelContractError` unless `impl` traces on `contract_cases()` to float32 `[N, out]`. Traces only."""
    for x, qa in contract_cases():
        try:
            out = jax.eval_shape(lambda x, qa: dequant_matmul(x, qa, impl=impl), x, qa)
        except KernelContractError as e:  # (the dispatcher's: what it raised, or a wrong output, named already)
            raise KernelContractError(f"{e}: on the contract's small case at registration ({qa.kind}, group "
                                      f"{qa.group_size}). See docs/kernels.md") from e
        except Exception as e:  # noqa: BLE001 (whatever the user's function raised while tracing)
            raise KernelContractError(
                f"dequant_matmul: {impl.name!r} failed on the contract's small case ({qa.kind}, group "
                f"{qa.group_size}): {type(e).__name__}: {e}. See docs/kernels.md") from e
        want = (x.shape[0], qa.shape[1])
        if not hasattr(out, "shape") or tuple(out.shape) != want or out.dtype != jnp.float32:
            got = f"{getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}"
            raise KernelContractError(f"dequant_matmul: {impl.name!r} must return float32 {want}; it returned {got}. "
                                      "See docs/kernels.md")


MATMUL.set_contract(check_contract)
for _name, _fn in (("reference", _reference_impl), ("xla", _xla_impl), ("pallas", _pallas_impl),
                   ("pallas_gemv", _pallas_gemv_impl), ("native", _native_impl)):
    MATMUL.register(_name, _fn, check=False, builtin=True)
