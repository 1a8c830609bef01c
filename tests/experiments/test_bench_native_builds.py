"""experiments/bench_native_builds.py: builds are timed side by side in one process and their bits compared."""

from __future__ import annotations

import json

import pytest
from absl import app

from experiments import bench_native_builds as bnb
from tests.experiments.helpers import run_main


@pytest.fixture
def small(monkeypatch):
    from pallas_kernels import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    for name, value in (("HIDDEN", 64), ("QKV", 96), ("INTER", 128), ("VOCAB", 320)):
        monkeypatch.setattr(bnb, name, value)


def run(*argv: str) -> None:
    run_main(bnb, *argv)


def test_two_registrations_of_one_build_time_alike_and_share_bits(small, tmp_path, capsys):
    out = tmp_path / "r.json"
    run("--builds=package,package", "--row_counts=1,3", "--scan_layers=2", "--rounds=3", "--nocold",
        f"--json_out={out}")
    rec = json.loads(out.read_text())
    assert [(r["build"], r["rows"]) for r in rec["results"]] == [("package", 1), ("package", 1), ("package", 3),
                                                                  ("package", 3)]
    assert all(r["same_bits"] for r in rec["results"])
    assert all(r["layers_ms_median"] > 0 and r["head_ms_p25"] > 0 and r["head_gb_s"] > 0 for r in rec["results"])
    assert rec["flags"]["builds"] == ["package", "package"] and rec["isa"]
    assert "same bits as package: True" in capsys.readouterr().out


def test_a_build_with_other_bits_is_reported(small, tmp_path, monkeypatch):
    real = bnb.programs

    def programs(target, w, layers):  # the second build's head answers one ulp-free step off
        lay, head = real(target, w, layers)
        return (lay, head) if target.endswith("0") else (lay, lambda x: head(x) + 1.0)

    monkeypatch.setattr(bnb, "programs", programs)
    out = tmp_path / "r.json"
    run("--builds=package,package", "--row_counts=2", "--scan_layers=1", "--rounds=1", "--nocold", f"--json_out={out}")
    assert [r["same_bits"] for r in json.loads(out.read_text())["results"]] == [True, False]


def test_a_missing_library_is_a_usage_error(small, tmp_path):
    with pytest.raises(app.UsageError, match="no shared library"):
        run(f"--builds=package,{tmp_path / 'nothing.so'}", "--rounds=1", "--nocold")
