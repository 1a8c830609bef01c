"""`bench_serving --backend=openai` (experiments/lib/serving/http_client.py) against this project's server: the same
workloads and metrics as in-process, measured over HTTP from the streamed chunks. The server runs the fake engine
(nothing compiles); the client's vocabulary comes from `--model=tiny`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import bench_serving
from experiments.lib.serving import http_client
from experiments.lib.serving.workloads import Request
from paged import DynamicGenerator
from paged.testing import ByteTokenizer, FakeEngine
from tests.experiments.helpers import run_main
from tests.server.helpers import LiveServer, wait_idle


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(num_pages=160, page_size=8, max_batch_size=4, max_chunk_size=32, max_seq_len=256,
                        record=False)
    s = LiveServer(DynamicGenerator(tokenizer=ByteTokenizer(), engine=engine, decode_steps=3), model_name="fake")
    yield s
    s.stop()


def test_bench_serving_over_http_closed_and_open_loop(server, tmp_path):
    run_main(bench_serving, "--backend=openai", f"--base_url={server.base}", "--model=tiny", "--dataset=prefix",
             "--num_prompts=12", "--num_prefixes=2", "--prefix_len=16", "--input_len=8", "--output_len=7",
             "--max_concurrency=3,inf", "--request_rate=200", f"--output_dir={tmp_path}", "--run_name=http",
             "--noprogress", "--nomeasure_hardware", "--num_warmup=2")
    records = [json.loads(line) for line in (tmp_path / "http.jsonl").read_text().splitlines()]
    assert [r["max_concurrency"] for r in records] == [3, None]
    for rec in records:
        m = rec["metrics"]
        assert (m["completed"], m["failed"], m["total_output_tokens"]) == (12, 0, 84), rec["per_request"]
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert m[f"{name}_ms"]["count"] > 0 and m[f"{name}_ms"]["median"] >= 0
        # one gap per delivery after the first (a chunk's tokens arrive together, as vLLM counts): the first token,
        # then the other 6 in bursts of at most 3 (fewer gaps than tokens)
        assert 0 < m["itl_ms"]["count"] < 12 * 6, m["itl_ms"]
        assert rec["backend"]["name"] == "openai" and rec["backend"]["served_model"] == "fake"
        assert all(r["output_tokens"] == 7 and r["error"] is None for r in rec["per_request"])
        assert rec["prefix_cache"]["prefix_hits"] > 0  # the shared prefixes, counted by the server's /metrics
        assert rec["server_metrics"]["delta"]["tokens_generated"] == 84
        assert rec["server_metrics"]["delta"]["time_engine_s"] > 0  # the host loop's phases, from /metrics
    assert records[0]["max_in_flight"] == 3
    wait_idle(server)


def test_bench_serving_over_http_with_trace_arrivals_and_goodput(server, tmp_path):
    """A trace's arrival times (sped up: the five requests arrive within a few tenths of a second) and goodput under
    an SLO every request meets on the fake engine."""
    trace = Path(__file__).resolve().parents[2] / "experiments/data/traces/chat_with_prefixes.jsonl"
    run_main(bench_serving, "--backend=openai", f"--base_url={server.base}", "--model=tiny", "--dataset=trace",
             f"--trace_file={trace}", "--trace_speedup=10", "--num_prompts=5", "--slo=ttft:600000,e2el:600000",
             "--max_concurrency=inf", f"--output_dir={tmp_path}", "--run_name=trace", "--noprogress",
             "--nomeasure_hardware", "--num_warmup=0")
    (rec,) = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    m = rec["metrics"]
    assert (m["completed"], m["failed"]) == (5, 0), rec["per_request"]
    assert m["goodput"] is not None and m["goodput"] > 0
    wl = rec["workload"]
    assert (wl["dataset"], wl["trace_speedup"], wl["num_requests"]) == ("trace", 10, 5)
    wait_idle(server)


def test_token_times_follow_the_usage_counts(server):
    """Without continuous usage stats a chunk counts one token, and the final usage gives the rest the last chunk's
    time; with them, a chunk of k tokens gives k times. The totals are exact either way."""
    reqs = [Request(index=i, prompt_ids=[65 + i, 66, 67], output_len=9) for i in range(3)]
    for continuous in (True, False):
        res = http_client.run_http_benchmark(server.base, "fake", reqs, max_concurrency=2,
                                             continuous_usage=continuous)
        assert [r.output_tokens for r in res.records] == [9, 9, 9] and not any(r.error for r in res.records)
        assert all(r.eos_reason == "length" for r in res.records)
    bad = http_client.run_http_benchmark(server.base, "no-such-model", reqs[:1])
    assert bad.records[0].error.startswith("HTTP 404")
