"""The native CPU greedy normalisation: `cpu/greedy_final.cc` through `jax.ffi`.

A batch whose rows are all greedy with nothing adjusting their logits samples through
`paged.device.sampling.greedy_final`:
final = log_softmax(logits), token = the first maximal logit (the first NaN of a row that has one, as
`jnp.argmax`), logprob = final[token]. XLA:CPU runs its formulation as separate passes over [S, V]: 0.12 ms for one
row of SmolLM2's 49152 logits and 0.25 ms for the five positions of a verification row, more than the LM head's
extra rows cost (docs/kernels.md, "The native greedy normalisation"). The kernel does it in three vectorised passes
per row (rows spread over XLA:CPU's threads): the same tokens, and the log-probabilities within a few ulp of
XLA's (the kernel's exp is Cephes' polynomial, its sum in another order). Under a mesh XLA replicates the call: every
device normalises every row (correct, not split).

`unavailable_reason()` says why it cannot run here (the library's reasons, a library built without it, or
`JPG_NATIVE_GREEDY=0`, which keeps XLA's formulation), None when it can; `paged.device.sampling.greedy_final` uses it on
the CPU where it can.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native

TARGET = "jpg_greedy_final"


@functools.cache
def _registered() -> str | None:
    """Register the kernel with XLA once; why it could not be, or None."""
    lib, why = native._load()
    if why is not None:
        return why
    try:
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JpgGreedyFinal), platform="cpu")
    except Exception as e:  # noqa: BLE001 (a library built before the kernel: AttributeError; an FFI mismatch, ...)
        return (f"the native library has no usable greedy normalisation ({type(e).__name__}: {e}); rebuild it with "
                "pip install -e . --no-deps")
    return None


def unavailable_reason() -> str | None:
    """Why the native greedy normalisation cannot run here, or None when it can."""
    if os.environ.get("JPG_NATIVE_GREEDY", "1") == "0":
        return "JPG_NATIVE_GREEDY=0 keeps XLA's formulation"
    return native.unavailable_reason() or _registered()


def library_reason() -> str | None:
    """Why the library's greedy normalisation cannot be called here at all, whatever the matmul's smoke test says
    (what tests skip on: `native.library_reason`)."""
    if os.environ.get("JPG_NATIVE_GREEDY", "1") == "0":
        return "JPG_NATIVE_GREEDY=0 keeps XLA's formulation"
    return native.library_reason() or _registered()


def native_greedy_final(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(final f32 [S, V], token i32 [S], logprob f32 [S]) of logits [S, V] (any float dtype; computed in float32)."""
    why = unavailable_reason()
    if why is not None:
        raise RuntimeError(f"the native greedy normalisation cannot run here: {why}")
    if logits.ndim != 2:
        raise ValueError(f"logits must be [S, V], got shape {logits.shape}")
    s, v = logits.shape
    if not 0 < v < 1 << 31:
        raise ValueError(f"the vocabulary must have 1 to 2^31 - 1 entries, got {v}")
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((s, v), jnp.float32), jax.ShapeDtypeStruct((s,), jnp.int32),
                                     jax.ShapeDtypeStruct((s,), jnp.float32)), vmap_method="sequential")
    final, token, logprob = call(logits.astype(jnp.float32), threads=np.int64(native.threads()))
    return final, token, logprob
