"""Capacity search and rank agreement (experiments/lib/serving/capacity.py), and compare_policies' capacity on the
simulator against a capacity known in closed form. No model, no JAX compile."""

from __future__ import annotations

import json
import math

import pytest

from experiments.lib.serving import capacity
from experiments.lib.serving.metrics import RequestRecord
from paged.sim import StepTimeModel
from tests.experiments.helpers import parse_flags


def test_capacity_from_points_is_the_highest_rate_below_the_first_failure():
    c = capacity.capacity_from_points([(0.5, True), (1.0, True), (2.0, False), (4.0, True)])
    assert (c.rate, c.above, c.bounded, c.describe()) == (1.0, 2.0, True, "1/s")
    c = capacity.capacity_from_points([(1.0, True), (2.0, True)])
    assert (c.rate, c.above, c.bounded, c.describe()) == (2.0, None, False, ">= 2/s")
    c = capacity.capacity_from_points([(1.0, False), (2.0, False)])
    assert (c.rate, c.above, c.describe()) == (None, 1.0, "< 1/s")


@pytest.mark.parametrize("true_cap, start", [(7.3, 1.0), (7.3, 100.0), (0.01, 1.0), (8.0, 8.0)])
def test_search_capacity_brackets_then_bisects(true_cap, start):
    calls = []
    c = capacity.search_capacity(lambda r: calls.append(r) or r <= true_cap, start, rel_tol=0.01, max_points=40)
    assert c.rate <= true_cap < c.above and c.above / c.rate - 1 <= 0.01
    assert [r for r, _ in c.tried] == calls and len(calls) < 40


def test_search_capacity_stops_at_max_points_and_checks_arguments():
    c = capacity.search_capacity(lambda r: True, 1.0, max_points=4)  # never fails: capacity >= the last rate
    assert (c.rate, c.above, len(c.tried)) == (8.0, None, 4)
    with pytest.raises(ValueError, match="start"):
        capacity.search_capacity(lambda r: True, 0.0)
    with pytest.raises(ValueError, match="factor"):
        capacity.search_capacity(lambda r: True, 1.0, factor=1.0)


def test_ranking_groups_ties_and_puts_unbounded_first():
    caps = {"a": capacity.Capacity(2.0, 4.0, []), "b": capacity.Capacity(4.0, None, []),
            "c": capacity.Capacity(2.0, 4.0, []), "d": capacity.Capacity(None, 0.5, [])}
    assert capacity.ranking(caps) == [["b"], ["a", "c"], ["d"]]
    assert capacity.format_ranking(caps) == "b (>= 4/s) > a (2/s) = c (2/s) > d (< 0.5/s)"


def test_kendall_tau_on_hand_made_cases():
    assert capacity.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert capacity.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # one swapped pair of six: (5 - 1) / 6
    assert capacity.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # tau-b with a tie in b: pairs (1,2) tied in b; concordant 5, discordant 0 -> 5 / sqrt(6 * 5)
    assert capacity.kendall_tau([1, 2, 3, 4], [1, 1, 3, 4]) == pytest.approx(5 / math.sqrt(30))
    assert capacity.kendall_tau([1, 1, 1], [1, 2, 3]) is None and capacity.kendall_tau([1], [2]) is None
    with pytest.raises(ValueError):
        capacity.kendall_tau([1, 2], [1])


def test_slo_attainment_counts_failures_as_misses():
    ok = RequestRecord(0, 8, 2, arrival=0.0, token_times=[0.01, 0.02], eos_reason="max_new_tokens")
    slow = RequestRecord(1, 8, 2, arrival=0.0, token_times=[0.2, 0.21], eos_reason="max_new_tokens")
    failed = RequestRecord(2, 8, 2, arrival=0.0, error="boom")
    assert capacity.slo_attainment([ok, slow, failed], {"ttft": 50.0}) == pytest.approx(1 / 3)


def test_compare_policies_finds_a_capacity_known_in_closed_form(cp, tmp_path, capsys):
    """One row (max_batch_size 1), every step 10 ms, prompts of 8 tokens prefilled in one step that samples the
    first token, 10 output tokens: a request holds the engine for 10 steps = 0.1 s, so 10 requests/s is the
    service rate. Arrivals are evenly spaced (gamma shape 1e12). Above 10/s request k waits k * (0.1 - 1/rate): its
    TTFT is 0.01 + k * (0.1 - 1/rate). With a 50 ms TTFT SLO and 90% of 100 requests to meet it, requests
    k = 0..89 must: 89 * (0.1 - 1/rate) <= 0.04, i.e. rate <= 1 / (0.1 - 0.04 / 89) = 10.045/s."""
    stm = tmp_path / "constant.json"
    StepTimeModel.constant(0.01).save(stm)
    out = tmp_path / "rec.json"
    parse_flags(cp, [f"--step_time_model={stm}", "--workload=gamma", "--burstiness=1e12", "--input_len=8",
            "--output_len=10",
            "--range_ratio=0", "--max_batch_size=1", "--num_requests=100", "--page_size=8", "--max_seq_len=64",
            "--rates=auto", "--rate=4", "--slo_ttft_ms=50", "--slo_tpot_ms=1000", "--capacity_tolerance=0.002",
            "--capacity_max_points=20", "--policies=fcfs,exllamav2", f"--json_out={out}", "--nosave_requests",
            "--nosave_steps", "--noprogress"])
    cp.main([])
    text = capsys.readouterr().out
    expected = 1 / (0.1 - 0.04 / 89)
    rec = json.loads(out.read_text())
    for policy in ("fcfs", "exllamav2"):
        c = rec["capacity"][policy]
        assert c["bounded"] and c["rate"] <= expected < c["failing_rate"] <= c["rate"] * 1.002 + 1e-9
        assert f"capacity  {policy}" in text
    assert "SLO: TTFT <= 50 ms, TPOT <= 1000 ms; a rate is sustained when >= 90%" in text
    assert "ranking by capacity: fcfs (" in text and rec["ranking"] == [["fcfs", "exllamav2"]]
    below = [p for p in rec["points"] if p["rate"] <= 10]
    assert below and all(p["metrics"]["ttft_ms"]["p99"] == pytest.approx(10.0) for p in below)
