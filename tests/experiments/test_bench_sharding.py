"""experiments/bench_sharding.py in a subprocess (it creates virtual CPU devices before JAX starts): every tp runs
the same jobs, reports tokens/s, and says whether its outputs equal the first tp's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.compile_settings import script_env


@pytest.mark.slow
def test_bench_sharding_runs_each_tp_and_checks_outputs(tmp_path):
    out = tmp_path / "s.json"
    env = script_env()
    p = subprocess.run([sys.executable, "-m", "experiments.bench_sharding", "--tp=1,2", "--dp=1,2", "--cpu_devices=2",
                        "--jobs=2", "--max_new_tokens=4", f"--json_out={out}"], capture_output=True, text=True,
                       env={**env, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert len(rec["devices"]) == 2 and [(r["dp"], r["tp"]) for r in rec["runs"]] == [(1, 1), (1, 2), (2, 1)]
    for r in rec["runs"]:
        assert r["outputs_equal_first"] and r["new_tokens"] == 8 and r["tokens_per_s"] > 0
