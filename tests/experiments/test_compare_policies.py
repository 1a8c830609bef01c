"""compare_policies / validate_sim / the scenario workloads, on the simulator (no model, no JAX compile)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from absl import app

from experiments.lib.serving import workloads
from paged.sim import StepTimeModel
from tests.experiments.helpers import parse_flags


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
    parse_flags(cp, [f"--step_time_model={stm}", "--num_requests=24", "--rate=20", "--input_len=40", "--output_len=16",
            "--range_ratio=0.5", "--page_size=8", "--max_seq_len=128", "--max_batch_size=4", "--page_budget=24",
            "--policies=exllamav2,vllm,experiments.policies.edf:EarliestDeadlineFirst", "--deadline=5",
            f"--json_out={out}", "--plot", "--noprogress"])
    cp.main([])
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "EarliestDeadlineFirst" in table and "TTFT p50/step" not in table
    rec = json.loads(out.read_text())
    assert rec["schema"] == "compare_policies/2" and rec["backend"]["kind"] == "sim"
    assert [p["allocation"] for p in rec["points"]] == ["reserve", "on_demand", "on_demand"]
    assert [p["rate"] for p in rec["points"]] == [20.0] * 3 and set(rec["capacity"]) == {p["policy"] for p in
                                                                                       rec["points"]}
    for p in rec["points"]:
        assert p["metrics"]["completed"] == 24 and len(p["per_request"]) == 24
        assert len(p["steps"]["decode_rows"]) == p["step_summary"]["steps"] and p["steps"]["engine_seconds"][0] > 0
        assert p["preemptions"] == sum(r["preemptions"] for r in p["per_request"])
        assert p["metrics"]["queue_ms"]["count"] == 24 and p["tokens_recomputed"] >= 0
    assert rec["points"][1]["preemptions"] > 0  # 24 pages of 8 tokens for 4 rows of up to 80 tokens
    assert (tmp_path / "rec_cdf.png").exists() and (tmp_path / "rec_bars.png").exists()


def test_the_record_holds_queue_time_and_recomputed_tokens_of_one_preemption(cp, tmp_path):
    """Two requests of 8 prompt + 16 output tokens at t=0, every step 1 s, 2 rows, 5 pages of 8 tokens (each request
    ends on 3 pages: 6 > 5), one prefill row per step, the `vllm` policy (pages on demand, preempt the newest).
    By hand: request 0 is prefilled in the first step (t=0..1): queue time 0, tokens at 1, 2, ..., 16. Request 1
    waits for the second step (t=1..2): queue time 1, first token at 2. At t=10 both have 8 + 9 = 17 tokens and need
    a third page with only 5 in the pool: request 1 (the newest) is preempted, once. Its first two pages (16 tokens,
    complete and hashed) stay in the prefix cache, so when request 0 ends at 16 and request 1 is re-admitted, 17 - 16
    = 1 token is recomputed; its tokens resume at 17 and end at 23."""
    stm = tmp_path / "one_second.json"
    StepTimeModel.constant(1.0).save(stm)
    out = tmp_path / "rec.json"
    parse_flags(cp, [f"--step_time_model={stm}", "--num_requests=2", "--rate=inf", "--input_len=8", "--output_len=16",
            "--range_ratio=0", "--page_size=8", "--max_seq_len=64", "--max_batch_size=2", "--max_chunk_size=8",
            "--page_budget=5", "--policies=vllm", f"--json_out={out}", "--noprogress"])
    cp.main([])
    point = json.loads(out.read_text())["points"][0]
    reqs = point["per_request"]
    assert [r["queue_time"] for r in reqs] == [0.0, 1.0]
    assert point["metrics"]["queue_ms"]["median"] == 500.0 and point["summary"]["queue_p50_ms"] == 500.0
    assert [r["preemptions"] for r in reqs] == [0, 1] and point["preemptions"] == 1
    assert point["tokens_recomputed"] == 1 and point["summary"]["recomputed"] == 1
    assert [r["e2el"] for r in reqs] == [16.0, 23.0] and [r["ttft"] for r in reqs] == [1.0, 2.0]


def test_compare_policies_flag_errors(cp, tmp_path):
    parse_flags(cp, ["--policies=fcfs,lifo"])
    with pytest.raises(app.UsageError, match="--policies=lifo is not one of"):
        cp.main([])
    parse_flags(cp, ["--policies=nomodule_xyz:Thing"])
    with pytest.raises(app.UsageError, match="cannot import module"):
        cp.main([])
    parse_flags(cp, [f"--step_time_model={tmp_path / 'missing.json'}"])
    with pytest.raises(app.UsageError, match="--step_time_model"):
        cp.main([])
    parse_flags(cp, ["--step_time_model=no_such_fit"])
    with pytest.raises(app.UsageError, match="no step-time fit named 'no_such_fit'"):
        cp.main([])
    for bad, match in [("--rates=1,x", "--rates must be 'auto' or"), ("--rates=1,1", "distinct"),
                       ("--slo_attainment=0", "--slo_attainment"), ("--slo_ttft_ms=-1", "--slo_ttft_ms")]:
        parse_flags(cp, [bad])
        with pytest.raises(app.UsageError, match=match):
            cp.main([])


def test_validate_sim_errors():
    from experiments import validate_sim

    assert validate_sim.rel_error(1.1, 1.0) == pytest.approx(0.1) and validate_sim.rel_error(1.0, None) is None


def test_compare_policies_replays_a_trace_at_its_own_rate_and_rescaled(cp, tmp_path, capsys):
    from experiments.lib.serving import traces

    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,20,4\n0.5,30,6\n1.5,10,8\n2,12,3\n")
    stm = tmp_path / "stm.json"
    StepTimeModel.constant(0.05).save(stm)
    out = tmp_path / "rec.json"
    base = [f"--step_time_model={stm}", "--workload=trace", f"--trace_file={path}", "--num_requests=10",
            "--page_size=8", "--max_seq_len=64", "--policies=fcfs", f"--json_out={out}", "--noprogress"]
    parse_flags(cp, base)
    cp.main([])
    rec = json.loads(out.read_text())
    point = rec["points"][0]
    assert point["rate"] == pytest.approx(traces.read_trace(str(path)).mean_rate) == pytest.approx(1.5)
    assert [r["arrival"] for r in point["per_request"]] == [0.0, 0.5, 1.5, 2.0]  # its own arrivals, 4 rows of 10
    assert [r["output_tokens"] for r in point["per_request"]] == [4, 6, 8, 3]
    parse_flags(cp, [*base, "--rates=3"])  # twice the trace's rate: every gap halved
    cp.main([])
    arrivals = [r["arrival"] for r in json.loads(out.read_text())["points"][0]["per_request"]]
    assert arrivals == pytest.approx([0.0, 0.25, 0.75, 1.0])
    parse_flags(cp, [*base[:2], "--workload=trace", "--noprogress"])
    with pytest.raises(app.UsageError, match="--workload=trace: .*trace_file"):
        cp.main([])
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,20,4\n0.5,-3,6\n")
    parse_flags(cp, base)
    with pytest.raises(app.UsageError, match=r"t.csv:3"):
        cp.main([])
