"""`models.invariant`: the values are the plain formulas' (up to the summation order) and so are the gradients
(training goes through the forward: `experiments/distill_draft.py`). Batch invariance itself is checked end to end,
bit for bit, in tests/paged/host/test_generator.py and tests/paged/speculation/test_speculative_generator.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.invariant import opaque_zero, rounded, row_sum
from models.llama import rms_norm
from models.rope import apply_rope


@pytest.mark.parametrize("n", [1, 2, 7, 18, 576])
def test_row_sum_is_a_sum_and_the_same_for_a_row_in_any_batch(n):
    x = np.random.default_rng(n).standard_normal((16, n)).astype(np.float32)
    got = np.asarray(jax.jit(row_sum)(x))
    np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)
    one = np.stack([np.asarray(jax.jit(row_sum)(x[i : i + 1]))[0] for i in range(16)])
    assert np.array_equal(got, one)


def test_rounded_leaves_finite_values_alone():
    x = jnp.asarray([0.0, -0.0, 1e-40, 3.5, -2e30, 1.0], jnp.float32)
    assert np.array_equal(np.asarray(rounded(x, opaque_zero(x))), np.asarray(x))
    assert np.array_equal(np.asarray(opaque_zero(jnp.asarray([1.0, jnp.inf, jnp.nan]))), [0, 1, 1])


def _plain_rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    return w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps))


def _plain_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin[:, None, :]


def test_values_and_gradients_are_the_plain_formulas():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
    g = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)  # a cotangent: grad of <f(x), g>
    np.testing.assert_allclose(rms_norm(x, w, 1e-5), _plain_rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    got = jax.grad(lambda a: (rms_norm(a, w, 1e-5) * g).sum())(x)
    want = jax.grad(lambda a: (_plain_rms_norm(a, w, 1e-5) * g).sum())(x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    q = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
    ang = jnp.asarray(rng.uniform(0, 6, (3, 8)), jnp.float32)
    cos, sin = jnp.cos(jnp.concatenate([ang, ang], -1)), jnp.sin(jnp.concatenate([ang, ang], -1))
    gq = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
    np.testing.assert_allclose(apply_rope(q, cos, sin), _plain_rope(q, cos, sin), rtol=1e-6, atol=1e-6)
    got = jax.grad(lambda a: (apply_rope(a, cos, sin) * gq).sum())(q)
    want = jax.grad(lambda a: (_plain_rope(a, cos, sin) * gq).sum())(q)
    assert np.abs(np.asarray(want)).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
