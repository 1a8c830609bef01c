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
