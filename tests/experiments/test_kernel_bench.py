"""experiments/lib/kernel_bench.py, bench_kernels' choices: the implementations timed by default per backend, the
dense baseline per backend, and utilisation never above 100% (the timing itself runs in
tests/pallas_kernels/test_kernel_registry.py, slow tier)."""

from __future__ import annotations

import pytest

from experiments.lib import kernel_bench


def test_default_implementations_per_backend():
    assert kernel_bench.default_impls("gpu", None) == ["pallas", "xla"]
    assert kernel_bench.default_impls("cpu", None) == ["native", "xla", "reference"]  # what "auto" runs on the CPU
    assert kernel_bench.default_impls("cpu", "not built") == ["xla", "reference"]


def test_the_dense_baseline_is_the_backends_fastest_dense_dot():
    assert kernel_bench.dense_baseline_dtype("cpu") == "float32"
    assert kernel_bench.dense_baseline_dtype("gpu") == "bfloat16"


def test_utilisation_is_never_above_100_percent():
    from experiments.lib.peaks import Peak, choose_peaks

    rows = [{"op": "matmul", "shape": "1x8x8 q4_1", "impl": "xla", "gbps": 40.0, "gflops": 1.0},
            {"op": "attention", "shape": "decode1x64", "impl": "native", "gbps": 10.0, "gflops": 3.0},
            {"op": "matmul", "shape": "1x8x8 q4_1", "impl": "wrong", "correct": False}]  # not timed
    measured = [{"bandwidth_gbps": Peak(25.0, "measured before"), "matmul_gflops": Peak(2.0, "measured before")}]
    used = choose_peaks(measured, {}, kernel_bench.achieved_rates(rows))
    kernel_bench.apply_utilisation(rows, used)
    assert rows[0]["bandwidth_frac"] == 1.0 and rows[1]["bandwidth_frac"] == 0.25  # raised to the matmul's 40 GB/s
    assert "matmul 1x8x8 q4_1 xla" in used["bandwidth_gbps"].source
    assert rows[1]["flops_frac"] == 1.0 and rows[0]["flops_frac"] == pytest.approx(1 / 3)
    assert "bandwidth_frac" not in rows[2]


def test_the_attention_sweep_splits_only_decode_rows():
    """--sweep's attention grid: a decode shape splits every row's keys; a mixed shape (a chunk and decode rows)
    splits only the decode rows (split_max_q=1, the chunk attended whole), so a GPU run times split decode rows
    against unsplit ones; a prefill shape splits nothing. --sweep_fix narrows the grid to the named fields."""
    from pallas_kernels.paged_attention import PrefillDecodeLayout
    from pallas_kernels.tuning import AttentionTuning

    def grid(layout, fix=None):
        return kernel_bench.sweep_grid("attention", "shape", {"layout": layout}, fix)

    mixed = grid(PrefillDecodeLayout(1, 512, 64))
    assert AttentionTuning(block_q=16, pages_per_block=4, k_splits=4, split_max_q=1) in mixed
    assert AttentionTuning(block_q=16, pages_per_block=4) in mixed
    assert {t.split_max_q for t in mixed if t.k_splits > 1} == {1}
    assert {t.split_max_q for t in mixed if t.k_splits == 1} == {0}
    assert {t.k_splits for t in mixed} == {1, 2, 4, 8}
    decode = grid(PrefillDecodeLayout(0, 1, 64))
    assert {t.k_splits for t in decode} == {1, 2, 4, 8} and {t.split_max_q for t in decode} == {0}
    assert {t.k_splits for t in grid(PrefillDecodeLayout(1, 2048, 0))} == {1}
    fixed = grid(PrefillDecodeLayout(1, 512, 64), {"block_q": 16, "pages_per_block": 4})
    assert fixed == [AttentionTuning(block_q=16, pages_per_block=4)] + [
        AttentionTuning(block_q=16, pages_per_block=4, k_splits=ks, split_max_q=1) for ks in (2, 4, 8)]


@pytest.mark.parametrize("bad, message", [
    ("--ops=bogus", "--ops takes a comma-separated list of attention, matmul"),
    ("--attn_impls=bogus", "--attn_impls: paged_attention: unknown implementation 'bogus'"),
    ("--iters=0", "--iters must be >= 1"),
])
def test_bench_kernels_bad_flags_are_usage_errors_before_the_peaks(bad, message):
    from tests.experiments.helpers import run_expecting_usage_error

    p = run_expecting_usage_error("experiments.bench_kernels", bad)
    assert message in p.stderr, p.stderr[-2000:]
    assert "GB/s" not in p.stdout  # no peaks measured
