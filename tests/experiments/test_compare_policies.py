"""compare_policies / validate_sim / the scenario workloads, on the simulator (no model, no JAX compile)."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from absl import app

from experiments.lib.serving import workloads
from paged.sim import StepTimeMismatchWarning, StepTimeModel
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


def test_a_fit_from_another_setup_is_warned_once_per_comparison(cp, tmp_path, capsys):
    """The fit's setup is compared with the flags once: one "warning:" line for two policies, not one more from
    Python's warnings machinery per engine built; the record names the difference."""
    stm = tmp_path / "stm.json"
    StepTimeModel(0.02, {"decode_rows": 1e-3}, device="test", model="test",
                  setup={"name": "fit_x", "model": "smollm2-135m", "page_size": 8}).save(stm)
    out = tmp_path / "rec.json"
    parse_flags(cp, [f"--step_time_model={stm}", "--model=other-model", "--num_requests=4", "--rate=20",
                     "--input_len=16", "--output_len=4", "--page_size=8", "--max_seq_len=64", "--max_batch_size=2",
                     "--policies=fcfs,sjf", f"--json_out={out}", "--noprogress"])
    with warnings.catch_warnings(record=True) as escaped:  # what Python would print besides the line
        warnings.simplefilter("always")
        cp.main([])
    assert not [w for w in escaped if issubclass(w.category, StepTimeMismatchWarning)], escaped
    err = capsys.readouterr().err
    assert err.count("was measured on a different setup") == 1, err
    assert "warning: step-time fit 'fit_x' was measured on a different setup than these flags: model: fit " \
           "'smollm2-135m', here 'other-model'" in err and "StepTimeMismatchWarning" not in err
    mismatches = json.loads(out.read_text())["backend"]["setup_mismatches"]
    assert mismatches == ["model: fit 'smollm2-135m', here 'other-model'"]


def test_the_record_holds_queue_time_and_recomputed_tokens_of_one_preemption(cp, tmp_path):
    """Two requests of 8 prompt + 16 output tokens at t=0, every step 1 s, 2 rows, 5 pages of 8 tokens (each request
    ends on 3 pages: 6 > 5), one prefill row per step, the `vllm` policy (pages on demand, preempt the newest).
    By hand: request 0 is prefilled in the first step (t=0..1): queue time 0, tokens at 1, 2, ..., 16. Request 1
    waits for the second step (t=1..2): queue time 1, first token at 2. At t=10 both have 8 + 9 = 17 tokens and need
    a third page with only 5 in the pool: request 1 (the newest) is preempted, once. Its first two pages (16 tokens,
    complete and hashed) stay in the prefix cache, so when request 0 ends at 16 and request 1 is re-admitted, no
    token is recomputed: its 16 computed tokens come from the cache, and its 17th had not run yet (it was to be the
    next decode row's, and runs as one now); its tokens resume at 17 and end at 23. (The count had been 1: the
    pending token, which runs whether or not the job was preempted.)"""
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
    assert point["tokens_recomputed"] == 0 and point["summary"]["recomputed"] == 0
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


def _run(policy, step_s, ttft_ms, preemptions=0, steps=100, simulated=False):
    """A PolicyRun as validate_sim reads it: `steps` engine steps of `step_s` seconds (real: scheduling + engine +
    results; simulated: the predicted seconds), TTFT p50, preemptions."""
    import types

    timers = {"time_engine_simulated_s": step_s * steps} if simulated else {
        "time_schedule_s": 0.1 * step_s * steps, "time_engine_s": 0.8 * step_s * steps,
        "time_results_s": 0.1 * step_s * steps}
    result = types.SimpleNamespace(metrics_before={}, metrics_after={"steps": steps, **timers})
    return types.SimpleNamespace(policy=policy, rate=12.0, preemptions=preemptions, result=result,
                                 metrics={"ttft_ms": {"median": ttft_ms}, "slo_attainment": 1.0},
                                 row={"ttft_p50_ms": ttft_ms})


def test_validate_sim_compares_the_median_of_repeated_real_runs_and_reports_their_spread(cp):
    """Three real runs per policy: the simulator is compared with their median (not the first run), the spread is
    (max - min) / median, and the ranking is of the medians: here b's first real run alone would rank it first."""
    from experiments import validate_sim

    parse_flags(validate_sim, ["--real_repeats=3"])
    real = [[_run("a", 0.020, 1000), _run("a", 0.022, 1200), _run("a", 0.021, 1100, preemptions=2)],
            [_run("b", 0.030, 900), _run("b", 0.024, 1500), _run("b", 0.027, 1400)],
            [_run("c", 0.010, 100), _run("c", 0.010, 100), _run("c", 0.010, 120)]]
    sim = [_run("a", 0.0231, 1100, simulated=True), _run("b", 0.027, 1600, simulated=True),
           _run("c", 0.009, 110, simulated=True)]
    rows = validate_sim.validate(real, sim)
    a, b, c = rows
    assert a["real_step_ms"] == pytest.approx(21.0) and a["step_error"] == pytest.approx(0.1) and a["step_ok"]
    assert a["real_ttft_p50_ms"] == 1100 and a["ttft_error"] == pytest.approx(0.0) and a["real_preemptions"] == 0
    assert a["real_ttft_spread"] == pytest.approx(200 / 1100) and a["real_step_ms_runs"] == pytest.approx([20, 22, 21])
    assert b["real_ttft_p50_ms"] == 1400 and b["ttft_error"] == pytest.approx(200 / 1400) and b["ttft_ok"]
    assert c["real_ttft_spread"] == pytest.approx(0.2) and c["step_error"] == pytest.approx(-0.1)
    rank = validate_sim.rank_agreement(real, sim)
    assert rank["real_order"] == ["c", "a", "b"] and rank["sim_order"] == ["c", "a", "b"] and rank["tau"] == 1.0
    # the real runs of a (1000-1200) and b (900-1500) overlap: only c's order against both is reproducible
    assert [(p["faster"], p["slower"], p["sim_agrees"]) for p in rank["pairs"]] == [("c", "a", True), ("c", "b", True)]
    table = validate_sim.format_rows(rows, [{"rate": 12.0, **rank}])
    assert "±9%" in table and "the median of 3 runs" in table  # a: (1200 - 1000) / 1100 / 2
    assert "reproducibly (> 15% apart): 2 of 3; the simulator orders 2 of them the same way" in table
    sim[2] = _run("c", 0.009, 1300, simulated=True)  # the simulator puts c after a, which the real runs never do
    assert [p["sim_agrees"] for p in validate_sim.separated_pairs(real, sim)] == [False, True]
    # runs that do not overlap but whose medians are 5% apart: no order the simulator is asked to resolve
    close = [[_run("d", 0.01, v) for v in (100, 101, 102)], [_run("e", 0.01, v) for v in (105, 106, 107)]]
    pair_sim = [_run("d", 0.01, 110, simulated=True), _run("e", 0.01, 100, simulated=True)]
    assert validate_sim.separated_pairs(close, pair_sim) == []
    assert validate_sim.separated_pairs(close, pair_sim, min_gap=0.01) == [
        {"faster": "d", "slower": "e", "sim_agrees": False}]
    assert validate_sim.spread([5.0]) is None and validate_sim.median([3, 1, 2, 10]) == 2.5


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
    assert all(r["priority"] in range(3) and r["deadline"] is None for r in point["per_request"])
    parse_flags(cp, [*base, "--rates=3"])  # twice the trace's rate: every gap halved
    cp.main([])
    arrivals = [r["arrival"] for r in json.loads(out.read_text())["points"][0]["per_request"]]
    assert arrivals == pytest.approx([0.0, 0.25, 0.75, 1.0])
    parse_flags(cp, [*base[:2], "--workload=trace", "--noprogress"])
    with pytest.raises(app.UsageError, match="--workload=trace: .*trace_file"):
        cp.main([])
    # a trace's priorities and deadlines reach the record's requests (the priority classes can be analysed)
    path.write_text("arrival_s,prompt_tokens,output_tokens,priority,deadline_s\n0,20,4,2,1.5\n0.5,30,6,0,\n")
    parse_flags(cp, base)
    cp.main([])
    rows = json.loads(out.read_text())["points"][0]["per_request"]
    assert [(r["priority"], r["deadline"]) for r in rows] == [(2, 1.5), (0, None)]
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,20,4\n0.5,-3,6\n")
    parse_flags(cp, base)
    with pytest.raises(app.UsageError, match=r"t.csv:3"):
        cp.main([])
    # every request at once (make_trace --rate=inf writes such traces): replayed as one burst; only --rates, which
    # asks to rescale a rate it has not, is an error
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,20,4\n0,30,6\n")
    parse_flags(cp, base)
    cp.main([])
    point = json.loads(out.read_text())["points"][0]
    assert point["rate"] == "inf" and [r["arrival"] for r in point["per_request"]] == [0.0, 0.0]  # (JSON has no inf)
    parse_flags(cp, [*base, "--rates=2"])
    with pytest.raises(app.UsageError, match="no rate for --rates to rescale"):
        cp.main([])


def test_an_infinite_rate_in_a_plotted_sweep_is_left_off_the_load_axis(cp, tmp_path):
    """--rates=2,inf --plot had written the record, then died in the load-curve plot (a log axis from 2 to inf)."""
    out = tmp_path / "inf.json"
    parse_flags(cp, ["--num_requests=12", "--rates=2,inf", "--policies=vllm,sjf", f"--json_out={out}", "--plot",
                     "--noprogress"])
    cp.main([])
    assert (tmp_path / "inf_load.png").stat().st_size > 0
    assert [p["rate"] for p in json.loads(out.read_text())["points"]][:2] == [2.0, "inf"]  # (JSON has no inf)


def test_validate_sim_names_a_missing_extra_fit_before_loading_the_model(cp, tmp_path):
    from experiments import validate_sim

    parse_flags(validate_sim, ["--rates=1,2", f"--also_fits={tmp_path / 'nope.json'}"])
    with pytest.raises(app.UsageError, match="--also_fits=.*nope.json"):
        validate_sim.main([])


@pytest.mark.parametrize("argv, match", [
    (["--seed=-1"], "--seed must be >= 0"),
    (["--burstiness=0"], "--burstiness is not used by --workload=poisson"),
    (["--trace_file=t.csv"], "--trace_file is not used by --workload=poisson"),
    (["--workload=sharegpt", "--input_len=64"], "--input_len is not used by --workload=sharegpt"),
    (["--workload=trace", "--trace_file=t.csv", "--range_ratio=0.5"], "--range_ratio is not used by --workload=trace"),
    (["--policies=fcfs,sjf,fcfs"], "--policies names fcfs more than once"),
    (["--engine=real", "--model=tiny", "--input_len=0"], "--input_len must be >= 1"),
    (["--engine=real", "--model=tiny", "--workload=trace", "--trace_file=/nonexist.csv"],
     "--workload=trace: /nonexist.csv"),
    # a budget no request fits (it had failed mid-run, after the real engine compiled, naming num_pages)
    (["--engine=real", "--model=tiny", "--page_budget=2"], r"--page_budget=2: request \d+ needs 3 pages"),
    (["--page_budget=0"], "--page_budget must be >= 1"),
    # shared engine flags this script does not read (they had been ignored)
    (["--policy=sjf"], "--policy is not used here"),
    (["--temperature=1.5"], "--temperature is not used here"),
])
def test_compare_policies_checks_every_workload_flag_before_building_an_engine(cp, monkeypatch, argv, match):
    def too_late(*a, **k):
        raise AssertionError("the bad flag was not caught before the engine was built")

    monkeypatch.setattr(cp, "RealBackend", too_late)
    monkeypatch.setattr(cp, "SimBackend", too_late)
    parse_flags(cp, argv)
    with pytest.raises(app.UsageError, match=match):
        cp.main([])



def test_an_auto_search_plots_every_policys_cdf_near_the_chosen_rate(cp):
    """With --rates=auto each policy's search runs its own rates: the CDF plot takes each policy's run at the chosen
    rate or nearest it (on a log scale); it had drawn only the policies whose search ran that exact rate."""
    from types import SimpleNamespace as NS

    def sweep(policy, *rates):
        return NS(policy=policy, runs=[NS(policy=policy, rate=r) for r in rates])

    sweeps = [sweep("priority", 8, 4, 5.66, 4.4), sweep("sjf", 8, 4, 5.66, 6.73), sweep("vllm", 8, 4, math.inf)]
    assert [(r.policy, r.rate) for r in cp.runs_near(sweeps, 4.4)] == [("priority", 4.4), ("sjf", 4),
                                                                          ("vllm", 4)]
    assert [r.rate for r in cp.runs_near(sweeps, 8)] == [8, 8, 8]
