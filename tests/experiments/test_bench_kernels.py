"""experiments/bench_kernels.py's choices: the implementations timed by default per backend, and the dense
baseline per backend (the timing itself runs in tests/pallas_kernels/test_kernel_registry.py, slow tier)."""

from __future__ import annotations

from experiments import bench_kernels


def test_default_implementations_per_backend():
    assert bench_kernels.default_impls("gpu", None) == ["pallas", "xla"]
    assert bench_kernels.default_impls("cpu", None) == ["native", "xla", "reference"]  # what "auto" runs on the CPU
    assert bench_kernels.default_impls("cpu", "not built") == ["xla", "reference"]


def test_the_dense_baseline_is_the_backends_fastest_dense_dot():
    assert bench_kernels.dense_baseline_dtype("cpu") == "float32"
    assert bench_kernels.dense_baseline_dtype("gpu") == "bfloat16"
