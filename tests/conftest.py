"""Suite-wide hygiene: the whole suite runs in one process, which accumulates compiled executables (each holds
mapped code pages) and memory-mapped GGUF files from the reader tests. Past a few hundred modules' worth, XLA:CPU's
compiler crashed (SIGSEGV) in the full run, never in any subset. Dropping JAX's caches and collecting garbage after
every test module keeps the process's mappings bounded.

Compiled programs persist on disk (JAX's compilation cache in `.pytest_cache/jax-compilation-cache`, shared by the
xdist workers), so a module that needs a program another module or worker compiled loads it instead of compiling it
again, and a second run of the suite skips compilation. The same settings go into the environment
(`JAX_COMPILATION_CACHE_DIR` and the two thresholds), so the scripts that tests run in processes of their own (the
experiments' end-to-end tests, the mesh checks) share the cache too: on six such test files, 249 s -> 211 s from an
empty cache. `PAGED_TEST_COMPILATION_CACHE=0` turns this off (every program compiled afresh); any other value is the
directory to use."""

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
    settings = {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0.1,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)  # inherited by the subprocesses that tests start


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_after_each_module():
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def release_compiled_programs_after_each_test():
    """For modules whose tests each build generators with draft models (`pytestmark = pytest.mark.usefixtures(...)`):
    their compiled programs (a sampler each, ~700 memory maps) would otherwise pile up until the module ends and pass
    the process's map limit (the clean-clone suite crashed at 64,884 of 65,530 in test_speculative_generator)."""
    yield
    jax.clear_caches()
    gc.collect()


# The heaviest test files, longest first (wall seconds of their tests in a clean-clone run on the 2-core host,
# 2026-11-29: ~430, 350 (one subprocess), 210, 140, 130, 90, 70, 65, 60, 60). The suite hands whole files to its
# two workers (`--dist loadfile`) in collection order (`--no-loadscope-reorder`: xdist would otherwise sort the
# files by their number of tests), so a heavy file reached near the end leaves the other worker idle; started first,
# the rest of the files fill in around them.
HEAVY_FIRST = ("tests/paged/test_speculative_generator.py", "tests/paged/test_sharding.py",
               "tests/paged/test_fused_step.py", "tests/paged/test_speculative.py", "tests/paged/test_warmup.py",
               "tests/paged/test_step.py", "tests/experiments/test_distill_draft.py",
               "tests/experiments/test_generate.py", "tests/models/test_quantized_models.py",
               "tests/paged/test_draft_ahead.py")


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
