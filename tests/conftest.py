"""Suite-wide hygiene: the whole suite runs in one process, which accumulates compiled executables (each holds
mapped code pages) and memory-mapped GGUF files from the reader tests. Past a few hundred modules' worth, XLA:CPU's
compiler crashed (SIGSEGV) in the full run, never in any subset. Dropping JAX's caches and collecting garbage after
every test module keeps the process's mappings bounded."""

from __future__ import annotations

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_after_each_module():
    yield
    jax.clear_caches()
    gc.collect()
