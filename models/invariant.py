"""Float arithmetic whose bits do not depend on the batch around a row: what the model's own XLA ops use where the
compiler would otherwise round a row differently by the shape of the program it sits in.

With the native CPU kernels (int8 activations) a rounding's difference in a hidden state grows through the layers to
whole quantization steps and flips greedy near-ties, so a job's output would depend on what else ran in its step:
a verification row against a decode step, a batch of 16 against a job alone, one chunking of a prompt against
another. XLA:CPU compiles the same jnp code differently by shape in two ways that matter here:

- a row's reduction (`jnp.mean(x * x, -1)` of RMSNorm) is summed in an order that depends on how many rows the
  array has (SmolLM2's 576 from 8 rows up): `row_sum` adds in one fixed pairwise order, as elementwise adds,
  whatever the shape;
- LLVM may fuse `a * b + c` into one multiply-add (one rounding fewer) in one loop and not in another (a decode
  step writes a token's rotated key inside an in-place update of the cache, a verification step in a loop of its
  own): `rounded` leaves no multiply for an add to absorb.

`tests/paged/test_speculative_generator.py` (verification rows against decode steps) and `tests/paged/test_generator.py`
(a job alone against the same job in a batch, prompts chunked differently) check the bits; docs/speculative.md
("Limits") tells the story."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def opaque_zero(x: jnp.ndarray) -> jnp.ndarray:
    """int32, x's shape: 0 where x is finite (1 where it is inf or NaN), a value the compiler cannot fold to 0."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return ((bits & 0x7F800000) == 0x7F800000).astype(jnp.int32)


@jax.custom_jvp
def rounded(p: jnp.ndarray, zero: jnp.ndarray) -> jnp.ndarray:
    """float32 `p` itself (its bits ORed with `zero`, `opaque_zero` of a finite operand): a product passed through
    this is rounded to float32 before any add that follows, in every program. Differentiable as the identity in `p`
    (a bitcast alone has no derivative: training through the forward, `experiments/distill_draft.py`, needs one)."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(p.astype(jnp.float32), jnp.int32) | zero, jnp.float32)


@rounded.defjvp
def _rounded_jvp(primals, tangents):
    p, zero = primals
    return rounded(p, zero), tangents[0].astype(jnp.float32)


def row_sum(v: jnp.ndarray) -> jnp.ndarray:
    """Sum over the last axis in a fixed pairwise order (halves added elementwise; an odd length padded with one
    zero, which adds exactly): the same bits for a row whatever the other axes hold."""
    n = v.shape[-1]
    while n > 1:
        if n % 2:
            v = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (1,), v.dtype)], axis=-1)
            n += 1
        v = v[..., : n // 2] + v[..., n // 2 :]
        n //= 2
    return v[..., 0]
