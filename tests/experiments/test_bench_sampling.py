"""experiments/bench_sampling.py: the per-setting timings, and greedy_final's two formulations timed alone."""

from __future__ import annotations

import json

from experiments import bench_sampling
from pallas_kernels import native_greedy
from tests.experiments.helpers import run_main


def test_settings_and_greedy_final_formulations_are_timed(tmp_path, capsys):
    out = tmp_path / "r.json"
    run_main(bench_sampling, "--rows=2", "--vocab=64", "--history=8", "--only=plain greedy,top_k=50", "--iters=2",
             "--compile_rows=", "--greedy_final_rows=1,3", f"--json_out={out}")
    rec = json.loads(out.read_text())
    assert set(rec["ms"]) == {"plain greedy", "top_k=50"}
    assert all(t["median"] > 0 for t in rec["ms"].values())
    assert set(rec["greedy_final_ms"]) == {"1", "3"}
    want = {"xla", "native"} if native_greedy.unavailable_reason() is None else {"xla"}
    assert all(set(t) == want and min(t.values()) > 0 for t in rec["greedy_final_ms"].values())
    assert "greedy_final S=3 V=64" in capsys.readouterr().out
