"""compare_policies / validate_sim / the scenario workloads, on the simulator (no model, no JAX compile)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from absl import app, flags

from experiments.lib.serving import workloads
from paged.sim import StepTimeModel


@pytest.fixture
def cp():
    from experiments import compare_policies

    yield compare_policies
    flags.FLAGS.unparse_flags()


def _parse(argv):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["compare_policies", *argv])


@pytest.mark.parametrize("name", workloads.SCENARIOS)
def test_scenarios_are_seeded_and_shaped(name):
    a, ta = workloads.make_scenario(name, 32, rate=4.0, vocab_size=300, seed=1, max_seq_len=4096, priority_levels=3)
    b, tb = workloads.make_scenario(name, 32, rate=4.0, vocab_size=300, seed=1, max_seq_len=4096, priority_levels=3)
    assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in b.requests] and np.array_equal(ta, tb)
    assert len(ta) == 32 and np.all(np.diff(ta) >= 0) and {r.priority for r in a.requests} <= {0, 1, 2}
    if name == "bursty":
        assert len(set(ta.tolist())) == 2  # two bursts of 16
    if name == "shared_prompt":
        assert len({tuple(r.prompt_ids[:256]) for r in a.requests}) == 1


def test_compare_policies_on_the_simulator_writes_table_and_record(cp, tmp_path, capsys):
    stm = tmp_path / "stm.json"
    StepTimeModel(0.02, {"prefill_tokens": 2e-4, "decode_rows": 1e-3}, device="test", model="test").save(stm)
    out = tmp_path / "rec.json"
    _parse([f"--step_time_model={stm}", "--num_requests=24", "--rate=20", "--input_len=40", "--output_len=16",
            "--range_ratio=0.5", "--page_size=8", "--max_seq_len=128", "--max_batch_size=4", "--page_budget=24",
            "--policies=exllamav2,vllm,experiments.policies.edf:EarliestDeadlineFirst", "--deadline=5",
            f"--json_out={out}", "--plot", "--noprogress"])
    cp.main([])
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "EarliestDeadlineFirst" in table and "TTFT p50/step" not in table
    rec = json.loads(out.read_text())
    assert rec["schema"] == "compare_policies/1" and rec["backend"]["kind"] == "sim"
    assert [p["allocation"] for p in rec["policies"]] == ["reserve", "on_demand", "on_demand"]
    for p in rec["policies"]:
        assert p["metrics"]["completed"] == 24 and len(p["per_request"]) == 24
        assert len(p["steps"]["decode_rows"]) == p["step_summary"]["steps"] and p["steps"]["engine_seconds"][0] > 0
        assert p["preemptions"] == sum(r["preemptions"] for r in p["per_request"])
    assert rec["policies"][1]["preemptions"] > 0  # 24 pages of 8 tokens for 4 rows of up to 80 tokens
    assert (tmp_path / "rec_cdf.png").exists() and (tmp_path / "rec_bars.png").exists()


def test_compare_policies_flag_errors(cp, tmp_path):
    _parse(["--policies=fcfs,lifo"])
    with pytest.raises(app.UsageError, match="--policies=lifo is not one of"):
        cp.main([])
    _parse(["--policies=nomodule_xyz:Thing"])
    with pytest.raises(app.UsageError, match="cannot import module"):
        cp.main([])
    _parse([f"--step_time_model={tmp_path / 'missing.json'}"])
    with pytest.raises(app.UsageError, match="--step_time_model"):
        cp.main([])


def test_validate_sim_errors():
    from experiments import validate_sim

    assert validate_sim.rel_error(1.1, 1.0) == pytest.approx(0.1) and validate_sim.rel_error(1.0, None) is None
