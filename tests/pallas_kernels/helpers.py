"""Test helpers for the kernels: which implementation ran (spies), what a traced program contains (jaxpr walks),
and an independent NumPy decoding of the quantized-weight format."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from models import quant


# ------------------------------------------------------------------------------------------------------- spies
def spy(monkeypatch: pytest.MonkeyPatch, module: ModuleType, names: list[str],
        calls: list[tuple[str, tuple, dict]] | None = None) -> list[tuple[str, tuple, dict]]:
    """Wrap the functions `names` of `module` (looked up by the module's own code at call time) so that each call
    is recorded as `(name, args, kwargs)` and then forwarded (into `calls`, when given: one record of several
    modules' calls). Calls happen while tracing, so a jitted caller records only when it (re)traces: use fresh
    static arguments, or `jax.clear_caches()` first."""
    calls = [] if calls is None else calls

    def recording(name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            calls.append((name, args, kwargs))
            return original(*args, **kwargs)

        return wrapper

    for name in names:
        monkeypatch.setattr(module, name, recording(name, getattr(module, name)))
    return calls


def names_of(calls: list[tuple[str, tuple, dict]]) -> list[str]:
    return [c[0] for c in calls]


# ------------------------------------------------------------------------------------------------------ jaxprs
def _sub_jaxprs(value: Any) -> Iterator[Jaxpr]:
    for v in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(v, ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, Jaxpr):
            yield v


def equations(jaxpr: Jaxpr | ClosedJaxpr) -> Iterator[JaxprEqn]:
    """Every equation of `jaxpr`, nested ones (jit, scan, while, cond, pallas_call bodies) included."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from equations(sub)


def find(fn: Callable, *args, primitive: str, **kwargs) -> list[JaxprEqn]:
    """The equations of primitive `primitive` in the program `fn(*args, **kwargs)` traces to."""
    jaxpr = jax.make_jaxpr(functools.partial(fn, **kwargs))(*args)
    return [e for e in equations(jaxpr) if e.primitive.name == primitive]



# --------------------------------------------------------------------------------------- the format in NumPy
# The independent NumPy decoding of the quantized format lives in the conformance suite (the oracle of its matmul
# cases); the kernel tests use the same one.
from pallas_kernels.testing import numpy_dequantize, numpy_matmul  # noqa: E402, F401

# The dequant-matmul kernels' test cases (test_dequant_matmul.py, test_dequant_gemv.py): weight kinds with their group
# size (None: per channel), a small matrix (interpret mode costs grid points x operand bytes), x, and the comparison.
KINDS = [("q4_1", 32), ("q4_0", 32), ("int8", 32), ("int8", None)]
K, OUT = 128, 64


@functools.cache
def quantized(kind, group_size, k=K, out=OUT, seed=0):
    w = np.random.default_rng(seed).normal(0.0, 0.05, size=(k, out)).astype(np.float32)
    return quant.quantize(w, kind, group_size)


def activations(n, k=K, seed=1, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, k)).astype(np.float32), dtype)


def assert_close(got, want, rtol=2e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())
