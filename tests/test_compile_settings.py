"""How the test processes compile (`tests/conftest.py`, `tests/compile_settings.py`): tiny-model tests without XLA's
expensive optimisations, tests marked `optimised` (and `real_weights`) with them, like users' programs; the scripts
that tests start inherit the choice through the environment."""

from __future__ import annotations

import os

import jax
import pytest

from tests.compile_settings import QUICK_COMPILE


def test_a_tiny_model_test_compiles_unoptimised():
    assert bool(jax.config.read("jax_disable_most_optimizations")) == QUICK_COMPILE
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == ("1" if QUICK_COMPILE else "0")


@pytest.mark.optimised
def test_an_optimised_test_compiles_like_users_programs():
    assert not jax.config.read("jax_disable_most_optimizations")
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "0"
