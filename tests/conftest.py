"""Suite-wide hygiene: the whole suite runs in one process, which accumulates compiled executables (each holds
mapped code pages) and memory-mapped GGUF files from the reader tests. Past a few hundred modules' worth, XLA:CPU's
compiler crashed (SIGSEGV) in the full run, never in any subset. Dropping JAX's caches and collecting garbage after
every test module keeps the process's mappings bounded.

Compiled programs persist on disk (JAX's compilation cache in `.pytest_cache/jax-compilation-cache`, shared by the
xdist workers), so a module that needs a program another module or worker compiled loads it instead of compiling it
again, and a second run of the suite skips compilation. `PAGED_TEST_COMPILATION_CACHE=0` turns this off (every
program compiled afresh); any other value is the directory to use."""

from __future__ import annotations

import gc
import os

import jax
import pytest


def pytest_configure(config):
    where = os.environ.get("PAGED_TEST_COMPILATION_CACHE", "")
    if where == "0":
        return
    path = where or str(config.rootpath / ".pytest_cache" / "jax-compilation-cache")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_after_each_module():
    yield
    jax.clear_caches()
    gc.collect()
