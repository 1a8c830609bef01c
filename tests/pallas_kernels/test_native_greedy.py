"""The native greedy normalisation (`pallas_kernels.native_greedy`) against XLA's formulation
(`paged.device.sampling.greedy_final_xla`): the same tokens, bit for bit where it matters (ties, NaN, infinities), the
log-probabilities within a few ulp; and the switch that picks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.device import sampling
from pallas_kernels import native_greedy

# Skipped only where the library cannot be called at all: a built kernel that fails its smoke test fails these tests
pytestmark = pytest.mark.skipif(native_greedy.library_reason() is not None,
                                reason=f"no native greedy normalisation here: {native_greedy.library_reason()}")


def both(x: np.ndarray):
    xa = jnp.asarray(x)
    got = [np.asarray(a) for a in jax.jit(native_greedy.native_greedy_final)(xa)]
    want = [np.asarray(a) for a in jax.jit(sampling.greedy_final_xla)(xa)]
    return got, want


@pytest.mark.parametrize("s,v", [(1, 49152), (5, 49152), (9, 4099), (3, 8), (2, 7), (1, 1)])
def test_native_matches_xla_on_random_logits(s: int, v: int) -> None:
    x = (np.random.default_rng(s * 1000 + v).standard_normal((s, v)) * 4).astype(np.float32)
    (final, token, logprob), (w_final, w_token, w_logprob) = both(x)
    assert final.dtype == np.float32 and token.dtype == np.int32 and logprob.dtype == np.float32
    np.testing.assert_array_equal(token, w_token)
    np.testing.assert_array_equal(token, np.argmax(x, axis=-1))
    np.testing.assert_allclose(final, w_final, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(logprob, w_logprob, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.exp(final.astype(np.float64)).sum(-1), 1.0, rtol=1e-5)


def test_edge_rows_give_xla_answers() -> None:
    """Ties to the lowest index (inside the vectors, across lanes, in the tail), the first NaN of a row that has one
    (and a row of NaN out), a row of -inf, +inf maxima, the first and last positions, a row of equal values, a wide
    range that underflows exp."""
    v = 4099  # a tail past the last whole vector of 8
    x = np.array(jax.random.normal(jax.random.key(3), (12, v)), np.float32)
    x[1, [5, 7, 4000]] = 100.0
    x[2, :] = -np.inf
    x[3, [10, 3000]] = np.nan
    x[3, 20] = 1e30
    x[4, v - 1] = 50.0  # in the tail
    x[5, 0] = 50.0
    x[6, :] = 1.0
    x[7, [8, 9]] = np.inf
    x[8, [13, 4098]] = 60.0  # a tie between a vector lane and the tail
    x[9, [4097, 4098]] = 70.0  # a tie inside the tail
    x[10, ::2] -= 1000.0  # exp underflows for half the row
    x[11, [4096]] = np.nan  # a NaN in the tail only
    x[0, [3, 11, 19]] = 80.0  # a tie within one lane (3, 11 and 19 are lane 3's)
    (final, token, logprob), (w_final, w_token, w_logprob) = both(x)
    np.testing.assert_array_equal(token, w_token)
    np.testing.assert_array_equal(token, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(token[[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11]],
                                  [3, 5, 0, 10, v - 1, 0, 0, 8, 13, 4097, 4096])
    np.testing.assert_array_equal(np.isnan(final), np.isnan(w_final))  # whole rows of NaN where XLA has them
    assert np.isnan(final[[2, 3, 7, 11]]).all()
    np.testing.assert_allclose(final, w_final, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(logprob, w_logprob, rtol=1e-6, atol=1e-5)


def test_signed_zeros_tie_to_the_first() -> None:
    x = np.full((2, 24), -1.0, np.float32)
    x[0, [5, 13]] = [-0.0, 0.0]  # equal as floats: the first is the max's first occurrence
    x[1, [2, 21]] = [0.0, -0.0]  # across lanes
    (_, token, _), (_, w_token, _) = both(x)
    assert token.tolist() == w_token.tolist() == [5, 2]


def test_one_float_apart_the_larger_logit_wins() -> None:
    """Two logits one float apart normalise to the same log-probability; the token is still the larger's."""
    x = (np.random.default_rng(7).standard_normal((1, 50000)) * 0.01).astype(np.float32)
    x[0, 100] = np.float32(1.0)
    x[0, 200] = np.nextafter(np.float32(1.0), np.float32(2.0))
    (_, token, _), _ = both(x)
    assert token.tolist() == [200]


def test_other_float_dtypes_are_normalised_in_float32() -> None:
    x = (np.random.default_rng(1).standard_normal((2, 1000)) * 3).astype(np.float32)
    got = jax.jit(native_greedy.native_greedy_final)(jnp.asarray(x, jnp.bfloat16))
    want = jax.jit(sampling.greedy_final_xla)(jnp.asarray(x, jnp.bfloat16))
    assert got[0].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-5)


def test_auto_runs_native_on_the_cpu_and_the_switch_turns_it_off(monkeypatch) -> None:
    calls = []
    real = native_greedy.native_greedy_final

    def counting(x):
        calls.append(x.shape)
        return real(x)

    monkeypatch.setattr(native_greedy, "native_greedy_final", counting)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 64)), jnp.float32)
    jax.jit(sampling.greedy_final)(x)
    assert calls == [(2, 64)]
    monkeypatch.setenv("JPG_NATIVE_GREEDY", "0")
    assert "JPG_NATIVE_GREEDY=0" in native_greedy.unavailable_reason()
    jax.jit(lambda a: sampling.greedy_final(a))(x + 1)  # a new trace (the switch is read at trace time)
    assert calls == [(2, 64)]
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: sampling.greedy_final(a, "xla"))(x)[1]),
                                  np.argmax(np.asarray(x), -1))
    with pytest.raises(RuntimeError, match="JPG_NATIVE_GREEDY=0"):
        native_greedy.native_greedy_final(x)
    with pytest.raises(ValueError, match="impl"):
        sampling.greedy_final(x, "fast")


def test_bad_shapes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"\[S, V\]"):
        native_greedy.native_greedy_final(jnp.zeros((2, 3, 4), jnp.float32))
    with pytest.raises(ValueError, match="vocabulary"):
        native_greedy.native_greedy_final(jnp.zeros((2, 0), jnp.float32))
