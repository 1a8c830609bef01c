"""experiments/bench_int_formulations.py: every formulation it times computes the dequantized product."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import bench_int_formulations as bif


@pytest.mark.parametrize("name", ["f32", "xla_q4_1", "xla_int8", "xla_intdot_channel", "xla_intdot_group",
                                  "native_q4_1", "native_int8"])
def test_each_formulation_is_timed_only_after_it_matches(name):
    from pallas_kernels import native

    if name.startswith("native") and not native.available():
        pytest.skip(native.unavailable_reason())
    bif.SHAPES["tiny"] = (64, 40)
    try:
        r = bif.time_one(name, "tiny", rows=3, layers=2, repeats=1, rng=np.random.default_rng(0))
    finally:
        del bif.SHAPES["tiny"]
    assert r["max_rel_err"] < 0.05 and r["min_ms"] > 0 and r["layers"] == 2
    q4, i8 = 64 * 40 // 2 + 2 * 2 * 40 * 2, 64 * 40 + 2 * 40 * 2  # values + f16 scales (+ q4_1 mins), per layer
    want = {"f32": 64 * 40 * 4, "xla_q4_1": q4, "native_q4_1": q4, "xla_int8": i8, "native_int8": i8,
            "xla_intdot_group": i8, "xla_intdot_channel": 64 * 40 + 40 * 2}[name]
    assert r["weight_bytes"] == 2 * want


def test_a_wrong_formulation_is_caught(monkeypatch):
    monkeypatch.setattr(bif, "intdot_group", lambda x, q, s, group=32: bif.intdot_channel(x, q, s[:1]))
    bif.SHAPES["tiny"] = (64, 40)
    try:
        with pytest.raises(AssertionError, match="relative error"):
            bif.time_one("xla_intdot_group", "tiny", rows=3, layers=2, repeats=1, rng=np.random.default_rng(0))
    finally:
        del bif.SHAPES["tiny"]


def test_a_timing_is_the_mean_of_its_calls(monkeypatch):
    import itertools

    monkeypatch.setattr(bif.time, "perf_counter", itertools.count().__next__)  # each reading 1 s after the last
    bif.SHAPES["tiny"] = (64, 40)
    try:
        r = bif.time_one("f32", "tiny", rows=3, layers=2, repeats=2, rng=np.random.default_rng(0), calls=4)
    finally:
        del bif.SHAPES["tiny"]
    assert r["min_ms"] == r["median_ms"] == 1e3 / 4  # one second over the 4 calls of a timing
