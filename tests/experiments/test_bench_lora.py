"""experiments/bench_lora.py measures every configuration, on the tiny model."""

from __future__ import annotations

from experiments import bench_lora
from experiments.lib.common import load_experiment_model


def test_every_configuration_is_measured_against_the_engine_without_lora():
    results, _ = bench_lora.measure(load_experiment_model("tiny"), rows=4, rank=4, counts=[1, 3], context=20, iters=2)
    assert [r["config"] for r in results] == ["none, no stack", "none", "1 adapter", "3 adapters"]
    assert [r["adapters"] for r in results] == [0, 0, 1, 3]
    assert results[0]["overhead_per_token_ms"] == 0.0
    assert all(r["step_ms_median"] > 0 and r["per_token_ms"] == r["step_ms_median"] / 4 for r in results)


def test_random_adapters_fit_the_model():
    model = load_experiment_model("tiny")
    a = bench_lora.random_adapter(model.config, 4, 0)
    assert len(a.weights) == 7 * model.config.num_layers and a.rank == 4
    assert a.digest != bench_lora.random_adapter(model.config, 4, 1).digest
