"""The dequantizing matmul for few rows of x (decode): a Pallas GEMV with no tensor-core dot.

`x` `[N, in]` @ the matrix a `QuantizedArray` stands for (`[in, out]`; layouts in `quant_format.py`) -> float32
`[N, out]`, as `dequant_matmul.dequant_matmul_pallas` computes it, for N of 1 to a few. Registered as the matmul
implementation "pallas_gemv"; on a GPU "auto" runs it up to a row count per device and weight kind
(`tuned_tables.gemv_max_rows`) and the tensor-core kernel above.

Why a second kernel. The tensor-core kernel pads x to 16 rows and, per quantization group, runs two dots of 16
inputs and a scale: at one row it is latency-bound (an H100 ran the 4096 x 14336 q4_1 GEMV at 8% of its copy rate,
0.38x a dense bf16 dot that reads four times the bytes). Here the weight tile is dequantized in registers and
multiplied into x with elementwise multiply-adds, which the GPU's float32 units do at full rate, and nothing is
padded: each row costs one multiply-add per weight element, on top of the tile's dequantization, which the rows
share.

The body, per program (grid: row blocks x output tiles x input splits):

- The output tile is `block_out` columns; the program walks its share of `in` (`in / split_in` rows) in loop steps
  of `block_in` rows. A step takes each quantization group in turn, and each group in chunks of `acc_rows` weight
  rows: it loads the chunk's raw quants `[acc_rows, block_out]` (for int4 one chunk of packed bytes holds two:
  the low nibbles are inputs `j` of the group, the high nibbles inputs `j + group/2`), makes them float32 exactly
  (`int_to_float`), applies the group's scale (and q4_1's min, or q4_0's offset of 8) broadcast over the chunk, and
  for every row `r` of x adds `x[r, chunk inputs] (a column [acc_rows, 1]) * w` into that row's accumulator
  `[acc_rows, block_out]`: multiply-adds only, no reduction inside the loop.
- After the loop each row's accumulator is summed over its `acc_rows` axis (one reduction per row per program),
  times the per-channel scale for per-channel int8, and stored.
- `split_in > 1`: the programs of one output tile each take a slice of `in`; their float32 partials `[split_in, N,
  out]` are summed outside the kernel. For decode shapes where `out / block_out` alone gives too few programs.
- x is passed transposed (`[in, N]`, a bitcast for one row), so a row's inputs load as the column that broadcasts
  over the tile. Rows are unrolled in the body (`block_n` per program at most); each row has its own accumulator
  and the same operations whatever the other rows, so a row's bits do not depend on how many rows share the call,
  as long as the rest of the tuning stays the same (`split_in` and `acc_rows` set the order of the sums; on a GPU
  the tile and `num_warps` also set the layout, and so the order, of the final reduction): the default tuning
  takes everything but `block_n` from the matrix alone. Against the tensor-core kernel a row's last bits differ.

`int_to_float`: "magic" (the default) puts a quant into the low mantissa bits of the float 2**23 (an OR; int8's
signed quants are added to the bits of 1.5 * 2**23) and subtracts that float: integer ops and one float add, exact.
"cast" converts (`astype`). The CUDA programming guide's throughput table gives integer-to-float conversions about
16 per SM and clock against 128 float32 multiply-adds on compute capability 8.x and 9.0, and at one row there are
as many conversions as multiply-adds. Not yet measured on a GPU: time both (`--matmul_tuning int_to_float=cast`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import registry
from pallas_kernels.quant_call import quant_pallas_call
from pallas_kernels.quant_format import QuantizedArray
from pallas_kernels.tuned_tables import lookup_gemv

INT_TO_FLOAT = ("magic", "cast")


@dataclasses.dataclass(frozen=True)
class GemvTuning:
    """Block sizes of the GEMV kernel (`impl="pallas_gemv"`).

    block_n: most rows of x per program, each unrolled in the body with its own accumulator; more rows take
        `ceil(N / block_n)` row blocks (x zero-padded to a multiple), each reading the weights again.
    block_out: output columns per program; divides `out`. On a GPU a power of two >= 16.
    block_in: input rows per loop step; a multiple of the group size (or a divisor of `in` for per-channel int8).
    split_in: programs sharing one output tile, each over `in / split_in` rows; float32 partials summed outside.
    acc_rows: depth of each row's float32 accumulator `[acc_rows, block_out]`, and the weight rows taken per chunk;
        divides the half-group (int4), the group (int8) or `block_in` (per-channel int8). On a GPU a power of two.
    int_to_float: how quants become float32: "magic" (mantissa bits, integer ops) or "cast" (a conversion).
    num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
    """

    block_n: int = 8
    block_out: int = 128
    block_in: int = 128
    split_in: int = 1
    acc_rows: int = 16
    int_to_float: str = "magic"
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name == "int_to_float":
                continue
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GemvTuning.{f.name} must be a positive int; got {v!r}")
        if self.num_warps & (self.num_warps - 1) or self.num_warps > 32:
            raise ValueError(f"GemvTuning.num_warps must be a power of two in [1, 32]; got {self.num_warps!r}")
        if self.int_to_float not in INT_TO_FLOAT:
            raise ValueError(f"GemvTuning.int_to_float must be one of {INT_TO_FLOAT}; got {self.int_to_float!r}")


def _largest_pow2_divisor(size: int, cap: int) -> int:
    b = cap
    while b > 1 and size % b:
        b //= 2
    return b


def _chunk_source(qa: QuantizedArray, block_in: int) -> int:
    """The run of weight rows that share one scale (and so one chunk's dequantization): the half-group of int4,
    the group of int8, `block_in` for per-channel int8. `acc_rows` must divide it."""
    if qa.per_channel:
        return block_in
    return qa.group_size // 2 if qa.kind != "int8" else qa.group_size


# Programs to aim for: a few per SM of a large GPU (132 on an H100), so that loads from several programs overlap.
TARGET_PROGRAMS = 256


def default_tuning(n: int, qa: QuantizedArray) -> GemvTuning:
    """The tuning used when the caller passes none: a measured entry of `tuned_tables.GEMV` for this device and
    matrix if there is one, else the heuristic below (unmeasured on a GPU): power-of-two tiles that divide `in` and
    `out`, and `split_in` doubled while the output tiles alone make fewer than `TARGET_PROGRAMS` programs. Only
    `block_n` depends on the row count `n`, so a row gets the same bits however many rows share the call."""
    k, out = qa.shape
    block_n = max(1, min(n, 8))
    measured = lookup_gemv(jax.devices()[0].device_kind, kind=qa.kind, group_size=qa.group_size, k=k, out=out)
    if measured is not None:
        return GemvTuning(**{"block_n": block_n, **measured})
    block_out = _largest_pow2_divisor(out, 128)
    if qa.per_channel:
        block_in = _largest_pow2_divisor(k, 128)
    else:
        g = qa.group_size
        block_in = g * _largest_pow2_divisor(k // g, max(1, 128 // g))
    steps = k // block_in
    tiles = out // block_out
    split = 1
    while tiles * split < TARGET_PROGRAMS and steps % (split * 2) == 0 and steps // (split * 2) >= 2:
        split *= 2
    acc_rows = _largest_pow2_divisor(_chunk_source(qa, block_in), 16)
    return GemvTuning(block_n=block_n, block_out=block_out, block_in=block_in, split_in=split, acc_rows=acc_rows)


def as_gemv_tuning(config, n: int, qa: QuantizedArray) -> GemvTuning:
    """The `GemvTuning` to run: `config` itself; the default for None; for a `MatmulTuning` (the tensor-core kernel's,
    e.g. from `bench_kernels --sweep`, whose grid makes those) its tiles, split and launch parameters, with the
    default `acc_rows` and `int_to_float`."""
    if config is None:
        return default_tuning(n, qa)
    if isinstance(config, GemvTuning):
        return config
    fields = {f.name for f in dataclasses.fields(GemvTuning)}
    if not dataclasses.is_dataclass(config) or not {"block_out", "block_in", "split_in"} <= {
            f.name for f in dataclasses.fields(config)}:
        raise TypeError(f"pallas_gemv takes a GemvTuning (or a MatmulTuning); got {config!r}")
    given = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name in fields}
    acc_rows = _largest_pow2_divisor(_chunk_source(qa, given["block_in"]), 16)
    return GemvTuning(**{"acc_rows": acc_rows, **given})


def check_tuning(qa: QuantizedArray, t: GemvTuning, native_gpu: bool) -> None:
    """ValueError, saying what to change, unless the kernel can run `qa` with `t` (natively on a GPU if
    `native_gpu`: Triton's tensors need power-of-two sizes)."""
    k, out = qa.shape
    if out % t.block_out:
        raise ValueError(f"out={out} is not a multiple of block_out={t.block_out}; pick a block_out that divides it")
    if k % t.split_in or (k // t.split_in) % t.block_in:
        raise ValueError(
            f"in={k} must split into split_in={t.split_in} parts that are multiples of block_in={t.block_in}"
        )
    if not qa.per_channel and t.block_in % qa.group_size:
        raise ValueError(f"block_in={t.block_in} must be a multiple of group_size={qa.group_size}")
    source = _chunk_source(qa, t.block_in)
    if source % t.acc_rows:
        what = "block_in" if qa.per_channel else ("the half-group" if qa.kind != "int8" else "the group")
        raise ValueError(f"acc_rows={t.acc_rows} must divide {what} ({source} weight rows share a scale)")
    if native_gpu:
        bad = {}
        if t.block_out < 16 or t.block_out & (t.block_out - 1):
            bad["block_out"] = t.block_out
        if t.acc_rows & (t.acc_rows - 1):
            bad["acc_rows"] = t.acc_rows
        if bad:
            raise ValueError(f"the GPU GEMV needs a power-of-two block_out >= 16 and a power-of-two acc_rows; "
                             f"got {bad}")


def gpu_unsupported_reason(qa: QuantizedArray, tuning=None, n: int = 1) -> str | None:
    """Why the GEMV cannot run natively on a GPU for this matrix (and tuning; None: the default for `n` rows), or
    None when it can."""
    try:
        check_tuning(qa, as_gemv_tuning(tuning, n, qa), native_gpu=True)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


# 2**23 as float32 bits: OR'd with an integer 0 .. 2**23-1 it reads as 2**23 + that integer, exactly.
_MAGIC = 0x4B000000
_MAGIC_F = 8388608.0
# 1.5 * 2**23: added to a signed integer in -2**22 .. 2**22-1 it reads as 1.5 * 2**23 + that integer.
_MAGIC_SIGNED = 0x4B400000
_MAGIC_SIGNED_F = 12582912.0


def _to_float(q: jnp.ndarray, *, offset: float, mode: str, prepared: bool = False) -> jnp.ndarray:
    """float32 of `q - offset`, exactly. `q`: an integer tile; `prepared`: q is already int32 OR'd with `_MAGIC`."""
    f32 = jnp.float32
    if mode == "cast":
        w = q.astype(f32)
        return w - offset if offset else w
    if prepared:
        return jax.lax.bitcast_convert_type(q, f32) - (_MAGIC_F + offset)
    if jnp.issubdtype(q.dtype, jnp.signedinteger):
        bits = q.astype(jnp.int32) + _MAGIC_SIGNED
        return jax.lax.bitcast_convert_type(bits, f32) - (_MAGIC_SIGNED_F + offset)
    bits = q.astype(jnp.int32) | _MAGIC
    return jax.lax.bitcast_convert_type(bits, f32) - (_MAGIC_F + offset)


def _nibbles(p: jnp.ndarray, mode: str, offset: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """float32 (low nibble - offset, high nibble - offset) of a packed uint8 tile."""
    if mode == "cast":
        return _to_float(p & 15, offset=offset, mode=mode), _to_float(p >> 4, offset=offset, mode=mode)
    p32 = p.astype(jnp.int32)  # 0 .. 255: the high nibble needs no mask after the shift
    lo = _to_float((p32 & 15) | _MAGIC, offset=offset, mode=mode, prepared=True)
    hi = _to_float((p32 >> 4) | _MAGIC, offset=offset, mode=mode, prepared=True)
    return lo, hi


def _gemv_kernel(
    xt_ref,  # [in / split_in, rows] x transposed (x's dtype)
    v_ref,  # q4: uint8 [in / split_in / 2, block_out]; int8: int8 [in / split_in, block_out]
    s_ref,  # [groups / split_in, block_out] (per-channel: [1, block_out])
    *rest,  # m_ref [groups / split_in, block_out] for q4_1; then o_ref [rows, block_out] float32
    kind: str,
    group_size: int,
    block_in: int,
    num_steps: int,
    per_channel: bool,
    rows: int,
    acc_rows: int,
    int_to_float: str,
):
    m_ref = rest[0] if kind == "q4_1" else None
    o_ref = rest[-1]
    f32 = jnp.float32
    c = acc_rows
    g = group_size
    offset = 8.0 if kind == "q4_0" else 0.0  # q4_0 stands for (q - 8) * scale

    def fma(accs, start, w):  # w [c, block_out]: every row r, acc_r += x[r, start : start + c] (a column) * w
        return tuple(acc + xt_ref[pl.ds(start, c), pl.ds(r, 1)].astype(f32) * w for r, acc in enumerate(accs))

    def step(i, accs):  # accs: per row [c, block_out] float32
        row0 = pl.multiple_of(i * block_in, block_in)  # first input row of the step
        if per_channel:  # the scale comes after the reduction
            for h in range(block_in // c):
                accs = fma(accs, row0 + h * c, _to_float(v_ref[pl.ds(row0 + h * c, c), :], offset=0.0,
                                                         mode=int_to_float))
            return accs
        prow0 = pl.multiple_of(i * (block_in // 2), block_in // 2)  # first packed row (int4)
        for j in range(block_in // g):  # static: the groups of this step
            grp = i * (block_in // g) + j
            s = s_ref[pl.ds(grp, 1), :].astype(f32)  # [1, block_out]: broadcast over the chunk
            if kind == "int8":
                for h in range(g // c):
                    start = row0 + j * g + h * c
                    accs = fma(accs, start, _to_float(v_ref[pl.ds(start, c), :], offset=0.0, mode=int_to_float) * s)
                continue
            m = m_ref[pl.ds(grp, 1), :].astype(f32) if kind == "q4_1" else None
            for h in range(g // 2 // c):
                p = v_ref[pl.ds(prow0 + j * (g // 2) + h * c, c), :]  # [c, block_out] uint8
                lo, hi = _nibbles(p, int_to_float, offset)
                w_lo, w_hi = (lo * s + m, hi * s + m) if m is not None else (lo * s, hi * s)
                start = row0 + j * g + h * c  # inputs of the low nibbles; the high ones are g/2 further
                accs = fma(accs, start, w_lo)
                accs = fma(accs, start + g // 2, w_hi)
        return accs

    zeros = tuple(jnp.zeros((c, o_ref.shape[-1]), f32) for _ in range(rows))
    accs = jax.lax.fori_loop(0, num_steps, step, zeros)
    for r, acc in enumerate(accs):
        y = jnp.sum(acc, axis=0, keepdims=True)  # [1, block_out]
        if per_channel:
            y = y * s_ref[...].astype(f32)
        o_ref[pl.ds(r, 1), :] = y


def dequant_gemv_pallas(x: jnp.ndarray, qa: QuantizedArray, config=None, *,
                        interpret: bool | None = None) -> jnp.ndarray:
    """`x` `[N, in]` @ the matrix `qa` stands for -> float32 `[N, out]`, by the GEMV kernel. `config`: a
    `GemvTuning` (or a `MatmulTuning`, see `as_gemv_tuning`; None: `default_tuning`); `interpret=None` interprets
    where Pallas cannot lower (the CPU)."""
    n, k = x.shape
    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "tpu")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.float32)
    t = as_gemv_tuning(config, n, qa)
    check_tuning(qa, t, native_gpu=not interpret and registry.on_gpu())
    rows = min(n, t.block_n)
    n_pad = -(-n // rows) * rows
    if n_pad != n:
        x = jnp.pad(x, ((0, n_pad - n), (0, 0)))
    xt = x.T  # [in, n_pad]
    k_split = k // t.split_in
    kernel = functools.partial(
        _gemv_kernel,
        kind=qa.kind,
        group_size=qa.group_size,
        block_in=t.block_in,
        num_steps=k_split // t.block_in,
        per_channel=qa.per_channel,
        rows=rows,
        acc_rows=t.acc_rows,
        int_to_float=t.int_to_float,
    )
    x_spec = pl.BlockSpec((k_split, rows), lambda i, j, s: (s, i))
    y = quant_pallas_call(kernel, xt, x_spec, qa, n_pad=n_pad, rows=rows, block_out=t.block_out,
                          split_in=t.split_in, interpret=interpret, num_warps=t.num_warps, num_stages=t.num_stages,
                          name=f"dequant_gemv_{qa.kind}")
    return y[:n]
