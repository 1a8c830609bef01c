"""experiments/lib/peaks.py: the peaks utilisation is measured against (the highest of the run's measurements and
the recorded table, raised to a point's achieved rate), so no utilisation is above 100%."""

from __future__ import annotations

import pytest

from experiments.lib import peaks
from experiments.lib.peaks import Peak


def test_the_highest_candidate_is_the_peak_and_says_where_it_came_from():
    before, after = Peak(3.0, "measured before the points"), Peak(10.0, "measured after the points")
    assert peaks.pick_peak([before, after, None]) == after  # a busy start measured low: the later one counts
    assert peaks.pick_peak([before, after, Peak(12.0, "recorded")]).source == "recorded"
    with pytest.raises(ValueError):
        peaks.pick_peak([None])


def test_a_point_above_every_peak_raises_the_peak_so_utilisation_stays_at_most_1():
    got = peaks.choose_peaks(
        [{"bandwidth_gbps": Peak(3.0, "before"), "matmul_gflops": Peak(100.0, "before")},
         {"bandwidth_gbps": Peak(10.0, "after"), "matmul_gflops": Peak(90.0, "after")}],
        {"bandwidth_gbps": Peak(8.0, "recorded")},
        {"bandwidth_gbps": {"attention decode xla": 12.0, "matmul 1x8x8 xla": 5.0},
         "matmul_gflops": {"attention decode xla": 50.0}})
    bw, dot = got["bandwidth_gbps"], got["matmul_gflops"]
    assert bw.value == 12.0 and "attention decode xla" in bw.source and "10" in bw.source  # raised, and from what
    assert dot == Peak(100.0, "before")  # no point above it
    assert peaks.utilisation(12.0, bw) == 1.0 and peaks.utilisation(5.0, bw) == pytest.approx(5 / 12)
    with pytest.raises(ValueError, match="raise_to_achieved"):
        peaks.utilisation(13.0, bw)


def test_recorded_peaks_by_device_and_dtype():
    table = {"NVIDIA H100 80GB HBM3": {"bandwidth_gbps": {"value": 2945.0, "date": "2026-11-24", "source": "f.json"},
                                       "matmul_gflops": {"value": 8e5, "dtype": "bfloat16"}}}
    rec = peaks.recorded_peaks(table, "NVIDIA H100 80GB HBM3", "bfloat16")
    assert rec["bandwidth_gbps"].value == 2945.0 and "2026-11-24" in rec["bandwidth_gbps"].source
    assert rec["matmul_gflops"].value == 8e5
    assert "matmul_gflops" not in peaks.recorded_peaks(table, "NVIDIA H100 80GB HBM3", "float32")  # another peak
    assert peaks.recorded_peaks(table, "NVIDIA H200", "bfloat16") == {}
    assert peaks.device_key({"backend": "gpu", "device_kind": "NVIDIA H200"}) == "NVIDIA H200"
    assert peaks.device_key({"backend": "cpu", "cpu_model": "AMD EPYC", "cpus_usable": 2}) == "cpu: AMD EPYC, 2 CPUs"
    assert peaks.recorded_peaks(peaks.load_table(), "NVIDIA H100 80GB HBM3", "bfloat16")  # the repository's table


def test_the_table_keeps_the_higher_measurement():
    table = {"d": {"bandwidth_gbps": {"value": 20.0}}}
    new, changed = peaks.updated_table(table, "d", {"bandwidth_gbps": Peak(15.0, "m"), "matmul_gflops": Peak(9.0, "m")},
                                       date="2026-12-07", source="x.json", matmul_dtype="float32")
    assert changed == ["matmul_gflops"] and new["d"]["bandwidth_gbps"]["value"] == 20.0
    assert new["d"]["matmul_gflops"] == {"value": 9.0, "date": "2026-12-07", "source": "x.json", "method": "m",
                                         "dtype": "float32"}
    assert table["d"] == {"bandwidth_gbps": {"value": 20.0}}  # not changed in place
