"""The serving benchmark (experiments/bench_serving.py, experiments/lib/serving/): metrics on hand-made records,
seeded workloads and arrivals, the host loop on the fake engine, and one end-to-end run on the tiny model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from absl import app, flags

from experiments.lib.serving import hardware, metrics, plots, runner, workloads
from experiments.lib.serving.metrics import RequestRecord
from paged import DynamicGenerator
from paged.policies.base import Policy
from paged.testing import ByteTokenizer, FakeEngine

SPECIAL = sorted(ByteTokenizer.special_token_ids)


# ------------------------------------------------------------------------------------------------ metrics
def _records():
    return [
        # ttft 0.1, e2el 0.6, tpot 0.25, itls 0.2, 0.3
        RequestRecord(0, prompt_len=10, target_output_len=3, scheduled=0.0, arrival=0.0, enqueued=0.0,
                      token_times=[0.1, 0.3, 0.6], eos_reason="max_new_tokens", cached_tokens=4),
        # one token: ttft = e2el = 0.5, no TPOT, no ITL
        RequestRecord(1, prompt_len=5, target_output_len=1, scheduled=1.0, arrival=1.0, enqueued=1.0,
                      token_times=[1.5], eos_reason="max_new_tokens"),
        # held back by the concurrency limit from 0.2 to 0.5: ttft 0.2, e2el 0.5, tpot 0.1, itls 0.1 x 3
        RequestRecord(2, prompt_len=20, target_output_len=4, scheduled=0.2, arrival=0.5, enqueued=0.5,
                      token_times=[0.7, 0.8, 0.9, 1.0], eos_reason="max_new_tokens", cached_tokens=6),
        # failed (never produced a token): ignored by every metric, counted as failed
        RequestRecord(3, prompt_len=7, target_output_len=2, error="boom"),
    ]


def test_metrics_exact_values():
    m = metrics.compute_metrics(_records(), duration=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(43 / 2)
    ttft = m["ttft_ms"]  # [100, 500, 200]
    assert ttft["mean"] == pytest.approx(800 / 3) and ttft["median"] == pytest.approx(200)
    assert ttft["std"] == pytest.approx(np.std([100, 500, 200]))
    assert ttft["p90"] == pytest.approx(440) and ttft["p99"] == pytest.approx(494)  # linear interpolation
    tpot = m["tpot_ms"]  # [250, 100]: the 1-token request is excluded
    assert tpot["count"] == 2 and tpot["mean"] == pytest.approx(175) and tpot["median"] == pytest.approx(175)
    assert tpot["std"] == pytest.approx(75) and tpot["p90"] == pytest.approx(235)
    assert tpot["p99"] == pytest.approx(248.5)
    itl = m["itl_ms"]  # pooled [200, 300, 100, 100, 100]
    assert itl["count"] == 5 and itl["mean"] == pytest.approx(160) and itl["median"] == pytest.approx(100)
    assert itl["p90"] == pytest.approx(260)
    e2el = m["e2el_ms"]  # [600, 500, 500]
    assert e2el["mean"] == pytest.approx(1600 / 3) and e2el["median"] == pytest.approx(500)
    assert m["send_delay_ms"]["mean"] == pytest.approx(100)  # (0 + 0 + 300) / 3
    assert m["cached_tokens"] == 10 and m["cached_token_fraction"] == pytest.approx(10 / 35)
    assert m["goodput"] is None


def test_goodput_and_one_token_requests():
    recs = _records()
    m = metrics.compute_metrics(recs, 2.0, metrics.parse_slo("ttft:300,tpot:200"))
    # r0 misses TPOT (250 ms), r1 misses TTFT (500 ms), r2 meets both
    assert m["good_requests"] == 1 and m["goodput"] == pytest.approx(0.5)
    # a 1-token request has TPOT 0 for goodput: only TTFT can fail it
    m = metrics.compute_metrics(recs, 2.0, {"tpot": 300.0})
    assert m["good_requests"] == 3 and m["goodput"] == pytest.approx(1.5)
    m = metrics.compute_metrics(recs, 2.0, {"e2el": 550.0})
    assert m["good_requests"] == 2


def test_itl_has_one_gap_per_delivery_and_tpot_one_per_token():
    """A decode burst's (or a streamed chunk's) tokens arrive together: one inter-token gap per delivery, as vLLM
    counts one per chunk (a gap per token had made the median ITL 0 with bursts of 4); TPOT divides by tokens."""
    burst = RequestRecord(0, 3, 7, token_times=[0.1, 0.4, 0.4, 0.4, 0.7, 0.7, 0.7], eos_reason="max_new_tokens")
    assert burst.itls == pytest.approx([0.3, 0.3]) and burst.tpot == pytest.approx(0.1)
    m = metrics.compute_metrics([burst], 1.0)
    assert m["itl_ms"]["count"] == 2 and m["itl_ms"]["median"] == pytest.approx(300)


def test_the_plotted_cdf_counts_the_zeros_it_cannot_draw():
    """The latency CDF panels draw positive values on a log axis; zeros (had) left out of the count made the curve
    reach 0.5 at the median of the positive values alone."""
    x, y = plots.positive_cdf([0.0, 0.0, 0.3, 0.1])
    assert x.tolist() == [0.1, 0.3] and y.tolist() == [0.75, 1.0]
    x, y = plots.positive_cdf([])
    assert x.size == y.size == 0


def test_tpot_excludes_single_token_requests():
    one = RequestRecord(0, 3, 1, token_times=[0.2], eos_reason="max_new_tokens")
    assert one.tpot is None and one.itls == []
    m = metrics.compute_metrics([one], 1.0)
    assert m["tpot_ms"]["count"] == 0 and m["tpot_ms"]["mean"] is None and m["itl_ms"]["count"] == 0
    assert m["ttft_ms"]["mean"] == pytest.approx(200)
    assert "n/a" in metrics.format_table(m)


def test_parse_slo():
    assert metrics.parse_slo("") == {} and metrics.parse_slo(None) == {}
    assert metrics.parse_slo("ttft:2000, TPOT:100,e2el:30000") == {"ttft": 2000.0, "tpot": 100.0, "e2el": 30000.0}
    for bad, msg in [("ttft=2000", "name:milliseconds"), ("foo:1", "name:milliseconds"), ("ttft:abc", "number"),
                     ("ttft:-1", "positive"), ("ttft:1,ttft:2", "twice")]:
        with pytest.raises(ValueError, match=msg):
            metrics.parse_slo(bad)


def test_prefix_stats_and_delta():
    before = {"prefix_queries": 10, "prefix_hits": 2, "pages_used": 5, "steps": 3, "name": "x"}
    after = {"prefix_queries": 20, "prefix_hits": 7, "pages_used": 1, "steps": 9, "name": "x"}
    s = metrics.prefix_cache_stats(before, after, _records())
    assert s["prefix_queries"] == 10 and s["prefix_hits"] == 5 and s["page_hit_rate"] == pytest.approx(0.5)
    assert s["token_hit_rate"] == pytest.approx(10 / 35)
    assert metrics.metrics_delta(before, after) == {"prefix_queries": 10, "prefix_hits": 5, "pages_used": -4,
                                                    "steps": 6}


# ------------------------------------------------------------------------------------------------ workloads
def test_random_workload_deterministic_and_bounded():
    kw = dict(vocab_size=50, special_ids=[0, 49], range_ratio=0.25)
    a = workloads.random_workload(40, 100, 20, seed=3, **kw)
    b = workloads.random_workload(40, 100, 20, seed=3, **kw)
    c = workloads.random_workload(40, 100, 20, seed=4, **kw)
    assert [(r.prompt_ids, r.output_len) for r in a.requests] == [(r.prompt_ids, r.output_len) for r in b.requests]
    assert [r.prompt_ids for r in a.requests] != [r.prompt_ids for r in c.requests]
    ins = [r.prompt_len for r in a.requests]
    outs = [r.output_len for r in a.requests]
    assert 75 <= min(ins) and max(ins) <= 125 and len(set(ins)) > 5
    assert 15 <= min(outs) and max(outs) <= 25
    toks = {t for r in a.requests for t in r.prompt_ids}
    assert not toks & {0, 49} and toks <= set(range(50))
    exact = workloads.random_workload(5, 7, 3, vocab_size=50, seed=0)
    assert {(r.prompt_len, r.output_len) for r in exact.requests} == {(7, 3)}
    d = a.describe()
    assert d["dataset"] == "random" and d["num_requests"] == 40 and d["input_len"]["total"] == sum(ins)


def test_length_bounds_and_fit_checks():
    assert workloads.length_bounds(100, 0.25) == (75, 125)
    assert workloads.length_bounds(10, 0.0) == (10, 10)
    assert workloads.length_bounds(1, 0.9) == (1, 1)
    with pytest.raises(ValueError, match="range_ratio"):
        workloads.length_bounds(10, 1.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        workloads.random_workload(2, 60, 10, vocab_size=50, range_ratio=0.1, max_seq_len=70)
    with pytest.raises(ValueError, match="unknown dataset"):
        workloads.make_workload("nope", 2, vocab_size=50)


def test_prefix_workload_shares_exactly_the_prefixes():
    w = workloads.prefix_workload(20, 3, 16, 5, 4, vocab_size=258, special_ids=SPECIAL, range_ratio=0.4, seed=1)
    assert len(w.prefixes) == 3 and all(len(p) == 16 for p in w.prefixes)
    assert len({tuple(p) for p in w.prefixes}) == 3
    assert {r.prefix_id for r in w.requests} == {0, 1, 2}
    counts = np.bincount([r.prefix_id for r in w.requests])
    assert counts.max() - counts.min() <= 1  # used equally often
    for r in w.requests:
        assert r.prompt_ids[:16] == w.prefixes[r.prefix_id]
        assert 3 <= r.prompt_len - 16 <= 7
    again = workloads.prefix_workload(20, 3, 16, 5, 4, vocab_size=258, special_ids=SPECIAL, range_ratio=0.4, seed=1)
    assert [r.prompt_ids for r in again.requests] == [r.prompt_ids for r in w.requests]
    other = workloads.prefix_workload(20, 3, 16, 5, 4, vocab_size=258, special_ids=SPECIAL, range_ratio=0.4, seed=2)
    assert other.prefixes != w.prefixes
    assert w.describe()["num_prefixes_used"] == 3


def test_sharegpt_workload_from_the_shipped_file():
    pairs = workloads.load_length_pairs()
    assert len(pairs) >= 500
    w = workloads.sharegpt_workload(50, vocab_size=258, special_ids=SPECIAL, seed=0, max_seq_len=256)
    assert len(w.requests) == 50
    assert all(r.prompt_len + r.output_len <= 256 and r.prompt_len >= 1 and r.output_len >= 1 for r in w.requests)
    assert len({r.prompt_len for r in w.requests}) > 10  # real length variance
    same = workloads.sharegpt_workload(50, vocab_size=258, special_ids=SPECIAL, seed=0, max_seq_len=256)
    assert [(r.prompt_len, r.output_len) for r in same.requests] == [(r.prompt_len, r.output_len) for r in w.requests]
    unclipped = workloads.sharegpt_workload(50, vocab_size=258, seed=0)
    assert {(r.prompt_len, r.output_len) for r in unclipped.requests} <= set(pairs)
    assert w.num_clipped == sum(r.prompt_len + r.output_len > 256 for r in unclipped.requests)


def test_clip_pair():
    assert workloads.clip_pair(10, 20, 100) == (10, 20)
    assert workloads.clip_pair(10, 3000, 2048) == (10, 2038)  # a short prompt is not cut
    assert workloads.clip_pair(3000, 10, 2048) == (2038, 10)  # a short output is not cut
    assert workloads.clip_pair(3000, 3000, 2048) == (1024, 1024)


# ------------------------------------------------------------------------------------------------ arrivals
def test_arrivals_gamma_process():
    t = workloads.arrival_times(20001, rate=4.0, burstiness=1.0, seed=0)
    gaps = np.diff(t)
    assert t[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1.0, rel=0.08)  # Poisson: CV^2 = 1
    for shape in (0.25, 4.0):
        g = np.diff(workloads.arrival_times(20001, rate=4.0, burstiness=shape, seed=1))
        assert g.mean() == pytest.approx(0.25, rel=0.05)
        assert g.var() / g.mean() ** 2 == pytest.approx(1 / shape, rel=0.12)
    assert (workloads.arrival_times(7, math.inf) == 0).all()
    np.testing.assert_array_equal(workloads.arrival_times(50, 2.0, seed=5), workloads.arrival_times(50, 2.0, seed=5))
    assert not np.array_equal(workloads.arrival_times(50, 2.0, seed=5), workloads.arrival_times(50, 2.0, seed=6))
    with pytest.raises(ValueError, match="rate"):
        workloads.arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        workloads.arrival_times(3, 1.0, burstiness=0.0)


# ------------------------------------------------------------------------------------------------ runner
def fake_gen(**kw):
    eng = dict(num_pages=64, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=64)
    eng.update(kw)
    return DynamicGenerator(engine=FakeEngine(**eng), tokenizer=ByteTokenizer())


def _random(n=12, **kw):
    args = dict(input_len=10, output_len=6, range_ratio=0.5, vocab_size=258, special_ids=SPECIAL, seed=0)
    args.update(kw)
    return workloads.random_workload(n, args.pop("input_len"), args.pop("output_len"), **args)


def test_closed_loop_respects_max_concurrency_and_output_lengths():
    gen = fake_gen()
    w = _random(12)
    res = runner.run_benchmark(gen, w.requests, max_concurrency=3)
    assert len(res.records) == 12
    for req, rec in zip(w.requests, res.records):
        assert rec.index == req.index and rec.success and rec.eos_reason == "max_new_tokens"
        assert rec.output_tokens == req.output_len == rec.target_output_len
        assert rec.token_times == sorted(rec.token_times) and rec.ttft >= 0
    assert res.trace and max(a + p for _, a, p, _ in res.trace) <= 3  # generator.active + pending
    assert res.max_in_flight == 3 and res.max_generator_jobs == 3
    assert res.step_summary["max_rows_per_step"] <= 3
    assert gen.num_remaining_jobs() == 0
    assert res.metrics_after["jobs_completed"] - res.metrics_before["jobs_completed"] == 12
    assert "run" not in vars(gen.engine)  # the probe restored the engine
    # with no limit the generator's own batch size (4) is the only cap
    res = runner.run_benchmark(fake_gen(), _random(12).requests)
    assert res.max_generator_jobs == 12 and res.step_summary["max_rows_per_step"] == 4


class _NeverAdmits(Policy):
    name = "never_admits"

    def admit(self, waiting, s):
        pass


def test_a_policy_that_never_admits_stalls_the_run_with_an_error_naming_it():
    gen = DynamicGenerator(engine=FakeEngine(num_pages=64, page_size=8, max_batch_size=4, max_chunk_size=16,
                                             max_seq_len=64), tokenizer=ByteTokenizer(), policy=_NeverAdmits())
    with pytest.raises(RuntimeError, match=r"no progress for 20 iterations with 3 requests in flight \(3 waiting, 0 "
                                           r"running\) under policy _NeverAdmits\(name='never_admits'.*"
                                           r"test_bench_serving\._NeverAdmits\): its admit\(\) started no"):
        runner.run_benchmark(gen, _random(3).requests, max_stalls=20)


def test_the_step_summary_counts_rows_tokens_and_bursts():
    probe = runner.EngineProbe(None)
    probe.steps += [runner.StepRecord(((0, 4, False), (10, 1, True)), 1, 0.5, 0.75),  # a prefill chunk, a decode row
                    runner.StepRecord(((11, 1, True), (5, 1, False)), 3, 0.25, 0.5)]  # a 3-step burst; a 1-token chunk
    assert probe.summary(2.0) == {
        "steps": 2, "engine_seconds": 0.75, "engine_call_seconds": 1.25, "mean_rows_per_step": 2.0,
        "max_rows_per_step": 2, "decode_rows": 2, "prefill_tokens": 5, "tokens_processed": 5 + 2 * 3,
        "host_seconds_outside_engine": 0.75}


class FakeClock:
    """Time advances only by sleep() and by each engine step (10 ms)."""

    def __init__(self):
        self.t = 100.0
        self.sleeps = []

    def __call__(self):
        return self.t

    def sleep(self, dt):
        assert dt > 0
        self.sleeps.append(dt)
        self.t += dt


class TimedFakeEngine(FakeEngine):
    def __init__(self, clock, **kw):
        super().__init__(**kw)
        self.clock = clock

    def run(self, rows, **kw):
        self.clock.t += 0.01
        return super().run(rows, **kw)


def test_open_loop_respects_arrival_times_with_a_fake_clock():
    clock = FakeClock()
    gen = DynamicGenerator(engine=TimedFakeEngine(clock, num_pages=64, page_size=8, max_batch_size=4,
                                                  max_chunk_size=16, max_seq_len=64), tokenizer=ByteTokenizer())
    w = _random(6, output_len=3, range_ratio=0.0)
    arrivals = [0.0, 0.0, 0.5, 0.52, 2.0, 2.0]
    res = runner.run_benchmark(gen, w.requests, arrivals=arrivals, clock=clock, sleep=clock.sleep)
    assert len(res.records) == 6
    for rec, a in zip(res.records, arrivals):
        assert rec.scheduled == a and rec.arrival == a  # no concurrency limit: sent on arrival
        assert rec.enqueued >= a  # never before its arrival
        assert rec.token_times[0] > a and rec.output_tokens == 3
    assert clock.sleeps  # the loop slept while idle, until the next arrival
    assert res.records[2].enqueued == pytest.approx(0.5)  # it slept exactly until then
    assert res.records[4].enqueued == pytest.approx(2.0) and 2.0 < res.duration < 2.2


def test_rate_and_concurrency_together():
    clock = FakeClock()
    gen = DynamicGenerator(engine=TimedFakeEngine(clock, num_pages=64, page_size=8, max_batch_size=4,
                                                  max_chunk_size=16, max_seq_len=64), tokenizer=ByteTokenizer())
    w = _random(8, output_len=5, range_ratio=0.0)
    arr = [0.0, 0.001, 0.002, 0.003, 1.0, 1.001, 1.002, 5.0]
    res = runner.run_benchmark(gen, w.requests, arrivals=arr, max_concurrency=1, clock=clock, sleep=clock.sleep)
    assert res.max_in_flight == 1 and len(res.records) == 8 and all(r.output_tokens == 5 for r in res.records)
    prev_end = None
    for rec, a in zip(res.records, arr):
        assert rec.enqueued >= rec.arrival >= rec.scheduled == a
        if prev_end is not None and prev_end > a:  # held back: sent when the previous request finished
            assert rec.arrival == pytest.approx(prev_end)
        prev_end = rec.token_times[-1]
    assert res.records[1].arrival > res.records[1].scheduled
    m = metrics.compute_metrics(res.records, res.duration)
    assert m["send_delay_ms"]["mean"] > 0


def test_open_loop_real_clock_small_rate():
    w = _random(8, output_len=2, range_ratio=0.0)
    res = runner.run_benchmark(fake_gen(), w.requests, request_rate=100.0, seed=1)
    sched = workloads.arrival_times(8, 100.0, 1.0, seed=1)
    assert len(res.records) == 8 and all(r.success and r.output_tokens == 2 for r in res.records)
    for rec, a in zip(res.records, sched):
        assert rec.scheduled == pytest.approx(a) and rec.enqueued >= a
    assert res.duration >= sched[-1]


def test_prefix_workload_hits_the_cache_and_random_does_not():
    def hit_rates(w):
        gen = fake_gen(num_pages=64)
        runner.warm_up(gen, w.requests[:1])
        res = runner.run_benchmark(gen, w.requests, max_concurrency=2)
        return metrics.prefix_cache_stats(res.metrics_before, res.metrics_after, res.records)

    pre = hit_rates(workloads.prefix_workload(8, 2, 24, 4, 4, vocab_size=258, special_ids=SPECIAL, seed=0))
    assert pre["page_hit_rate"] > 0.5 and pre["token_hit_rate"] > 0.5
    rnd = hit_rates(_random(8, input_len=28, output_len=4, range_ratio=0.0))
    assert rnd["prefix_queries"] > 0 and rnd["page_hit_rate"] == 0.0 and rnd["token_hit_rate"] == 0.0


def test_warm_up_resets_the_prompt_cache():
    gen = fake_gen()
    w = workloads.prefix_workload(2, 1, 24, 4, 2, vocab_size=258, seed=0)
    runner.warm_up(gen, w.requests)
    assert gen.pool.num_cached == 0


def test_utilisation_estimate_counts_rows():
    cost = hardware.ModelCost(weight_bytes=1000, matmul_params=10, head_params=5, kv_bytes_per_token=2,
                              attn_flops_per_pair=4)
    rows = [(10, 1, True), (0, 3, True)]  # a decode row at position 10, a 3-token prefill from 0
    assert cost.step_bytes(rows) == 1000 + 2 * (11 + 3)
    assert cost.step_flops(rows) == 2 * 10 * 4 + 2 * 5 * 2 + 4 * (11 + 6)
    steps = [runner.StepRecord(rows=rows, num_steps=1, seconds=0.5, wall=0.6)] * 2
    u = hardware.utilisation(cost, steps, duration=2.0, peaks={"bandwidth_gbps": 1e-6, "matmul_gflops": 1e-6})
    assert u["total_bytes"] == 2 * 1028 and u["achieved_gbps"] == pytest.approx(2 * 1028 / 2.0 / 1e9)
    assert u["achieved_gbps_engine_time"] == pytest.approx(2 * 1028 / 1.0 / 1e9)
    assert u["bandwidth_fraction"] == pytest.approx(u["achieved_gbps"] / 1e-6)
    assert hardware.utilisation(None, steps, 1.0, None) is None
    assert hardware.engine_cost(FakeEngine()) is None


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture
def bench():
    from experiments import bench_serving

    yield bench_serving
    flags.FLAGS.unparse_flags()


def _parse(argv):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["bench_serving", *argv])


def test_bad_slo_is_a_clear_error(bench, tmp_path):
    _parse(["--model=tiny", f"--output_dir={tmp_path}", "--slo=ttft=2000"])
    with pytest.raises(app.UsageError, match="bad SLO entry 'ttft=2000'"):
        bench.main([])
    _parse(["--model=tiny", f"--output_dir={tmp_path}", "--max_concurrency=2,zero"])
    with pytest.raises(app.UsageError, match="max_concurrency"):
        bench.main([])


@pytest.mark.slow  # fast tier: a lighter test covers the same path
def test_main_end_to_end_tiny_sweep(bench, tmp_path, capsys):
    _parse(["--model=tiny", "--dataset=random", "--num_prompts=4", "--input_len=6", "--output_len=4",
            "--range_ratio=0.3", "--max_concurrency=1,2", "--page_size=8", "--max_seq_len=32", "--max_chunk_size=16",
            "--num_warmup=1", "--nocompile_all_buckets", "--noprogress", "--plot", "--slo=ttft:600000",
            f"--output_dir={tmp_path}", "--run_name=t"])
    assert bench.main([]) is None
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2 and "Mean TTFT (ms):" in out
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) == 2
    recs = [json.loads(x) for x in lines]
    assert [r["max_concurrency"] for r in recs] == [1, 2]
    for r in recs:
        for key in ("schema", "flags", "git", "device", "versions", "load_avg_before", "load_avg_after", "workload",
                    "metrics", "prefix_cache", "steps", "generator_metrics", "hardware", "notes", "per_request",
                    "engine", "model"):
            assert key in r, key
        m = r["metrics"]
        assert m["completed"] == 4 and m["failed"] == 0
        assert m["total_output_tokens"] == sum(p["output_tokens"] for p in r["per_request"])
        assert m["total_output_tokens"] == r["workload"]["output_len"]["total"]
        assert m["duration_s"] > 0 and m["output_throughput"] > 0 and m["goodput"] == pytest.approx(
            m["request_throughput"])
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            s = m[name]
            assert 0 <= s["median"] <= s["p90"] <= s["p99"] and s["mean"] > 0
        assert r["max_in_flight"] <= r["max_concurrency"] and r["max_generator_jobs"] <= r["max_concurrency"]
        assert r["flags"]["model"] == "tiny" and r["flags"]["request_rate"] == "inf"
        assert r["request_rate"] == "inf"
        assert len(r["load_avg_before"]) == 3 and r["versions"]["jax"] and r["device"]["cpu_count"] >= 1
        assert "sha" in r["git"] and "dirty" in r["git"]
        assert r["generator_metrics"]["delta"]["jobs_completed"] == 4
        assert r["generator_metrics"]["delta"]["tokens_generated"] == m["total_output_tokens"]
        hw = r["hardware"]
        assert hw["peak"]["bandwidth_gbps"] > 0 and hw["peak"]["matmul_gflops"] > 0
        u = hw["utilisation"]
        assert u["achieved_gbps"] > 0 and u["achieved_gflops"] > 0 and 0 < u["bandwidth_fraction"]
        assert u["weight_bytes_per_step"] > 0 and u["steps"] == r["steps"]["steps"] > 0
        assert "KV" in hw["notes"] and r["engine"]["max_batch_size"] == 2
        assert r["warmup_requests"] == 1 and "compiles_during_run" in r
    for name in ("t_latency_cdf.png", "t_sweep.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


@pytest.mark.parametrize("argv, match", [
    (["--num_prompts=0"], "--num_prompts must be >= 1"),
    (["--input_len=0"], "--input_len must be >= 1"),
    (["--dataset=sharegpt", "--dataset_path=/nonexist.json"], "--dataset=sharegpt: .*nonexist.json"),
    (["--run_name=sub/x"], "--run_name is a file name stem"),
])
def test_bad_workload_and_output_flags_fail_before_measuring_or_loading(bench, tmp_path, monkeypatch, argv, match):
    from experiments.lib import engine_flags

    def too_late(*a, **k):
        raise AssertionError("the bad flag was not caught before the long work")

    monkeypatch.setattr(hardware, "measure_peaks", too_late)
    monkeypatch.setattr(engine_flags, "load_model", too_late)
    _parse(["--model=tiny", f"--output_dir={tmp_path}", *argv])
    with pytest.raises(app.UsageError, match=match):
        bench.main([])
    assert not list(tmp_path.iterdir())  # no record begun


def test_a_simulated_burst_is_one_probed_step():
    """The simulator runs a decode burst as single steps through its class's run: a probe wrapped around the
    engine records the burst once (it had recorded each inner step and then the burst again, doubling the steps and
    engine seconds of every `--decode_steps > 1` simulated run); the probe's seconds equal the virtual clock's."""
    from paged import DynamicGenerator, Job
    from paged.device.config import EngineConfig
    from paged.sim import SimulatedEngine, StepTimeModel

    sim = SimulatedEngine(EngineConfig(max_batch_size=4, max_seq_len=256, num_pages=17, decode_steps=4).resolve(),
                          StepTimeModel.constant(0.01))
    gen = DynamicGenerator(engine=sim, policy="fcfs")
    gen.enqueue(Job([1, 2, 3, 4], 17))
    start = sim.clock()
    with runner.EngineProbe(sim, sim.clock) as probe:
        while gen.num_remaining_jobs():
            gen.iterate()
    assert any(s.num_steps > 1 for s in probe.steps)
    assert sum(s.num_steps for s in probe.steps) == 17  # one prefill step, then 16 decode steps in bursts
    assert sum(s.wall for s in probe.steps) == pytest.approx(sim.clock() - start)
