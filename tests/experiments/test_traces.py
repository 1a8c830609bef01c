"""Request traces (experiments/lib/serving/traces.py): each layout read from small files and the shipped samples,
speedup, sorting, BurstGPT's failed rows, every kind of bad line named by file:line; `workloads.trace_workload`,
the `trace` scenario and `rescale_arrivals`; experiments/make_trace.py; bench_serving's --dataset=trace flags. No
model is compiled."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from absl import app, flags

from experiments import make_trace
from experiments.lib.serving import traces, workloads
from experiments.lib.serving.traces import TraceError, TraceRow, read_trace
from paged.testing import ByteTokenizer
from tests.experiments.helpers import run_expecting_usage_error

SPECIAL = sorted(ByteTokenizer.special_token_ids)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(ROOT, "experiments", "data", "traces")


def _write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ------------------------------------------------------------------------------------------------ formats
def test_native_csv_with_optional_columns(tmp_path):
    p = _write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens,priority,deadline_s,prefix_id,prefix_len\n"
                                  "0.5,10,4,,,,\n"
                                  "1.0,20,5,2,3.5,sys,8\n"
                                  "\n"  # blank lines are skipped
                                  "2.5,30,6,-1,,sys,\n")
    t = read_trace(p)
    assert (t.format, t.syntax, t.num_skipped, t.was_sorted) == ("native", "csv", 0, False)
    assert t.rows == [TraceRow(0.0, 10, 4), TraceRow(0.5, 20, 5, 2, 3.5, "sys", 8), TraceRow(2.0, 30, 6, -1, None,
                                                                                              "sys", None)]
    assert t.span_s == 2.0 and t.mean_rate == pytest.approx(1.0)
    d = t.describe()
    assert d["rows"] == 3 and d["rows_with_priority"] == 2 and d["prefix_ids"] == 1 and "note" not in d


def test_native_jsonl(tmp_path):
    p = _write(tmp_path, "t.jsonl", '{"arrival_s": 0, "prompt_tokens": 7, "output_tokens": 3}\n\n'
                                    '{"arrival_s": 0.25, "prompt_tokens": 9, "output_tokens": 2, "prefix_id": 4, '
                                    '"prefix_len": 9, "priority": 1, "deadline_s": 2}\n'
                                    '{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 1, "priority": null}\n')
    t = read_trace(p)
    assert (t.format, t.syntax) == ("native", "jsonl")
    assert t.rows == [TraceRow(0.0, 7, 3), TraceRow(0.25, 9, 2, 1, 2.0, 4, 9), TraceRow(1.0, 5, 1)]
    assert t.mean_rate == pytest.approx(2.0)


def test_azure_rows_without_output_are_skipped_and_counted(tmp_path):
    p = _write(tmp_path, "az0.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00,5,5\n"
               "2024-01-01 00:00:01,7,0\n2024-01-01 00:00:02,9,3\n")
    t = read_trace(p)
    assert [(r.prompt_tokens, r.output_tokens) for r in t.rows] == [(5, 5), (9, 3)] and t.num_skipped == 1
    assert [r.arrival_s for r in t.rows] == [0.0, 2.0]


def test_azure_layout_seven_fraction_digits_and_utc_offset(tmp_path):
    p = _write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                   "2023-11-16 18:15:46.6805900,4808,10\n"
                                   "2023-11-16 18:15:46.6805901,100,5\n"  # 100 ns later: the 7th digit counts
                                   "2023-11-16 18:15:50.1234567,3180,8\n"
                                   "2023-11-16 18:16:00,20,1\n")
    t = read_trace(p)
    assert t.format == "azure" and [r.prompt_tokens for r in t.rows] == [4808, 100, 3180, 20]
    assert [r.output_tokens for r in t.rows] == [10, 5, 8, 1]
    np.testing.assert_allclose(t.arrivals, [0.0, 1e-7, 3.4428667, 13.31941], rtol=0, atol=1e-9)
    # the 2024 traces write a UTC offset; a row at +01:00 is an hour earlier in UTC
    p = _write(tmp_path, "az24.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                     "2024-05-10 00:00:00.009930+00:00,10,2\n"
                                     "2024-05-10 01:00:01.009930+01:00,10,2\n")
    np.testing.assert_allclose(read_trace(p).arrivals, [0.0, 1.0], atol=1e-9)


def test_burstgpt_layout_skips_failed_rows(tmp_path):
    p = _write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                  "5,ChatGPT,472,18,490,Conversation log\n"
                                  "45,ChatGPT,1087,0,1087,Conversation log\n"
                                  "110.5,GPT-4,417,505,922,API log\n"
                                  "111,GPT-4,30,0,30,API log\n")
    t = read_trace(p)
    assert t.format == "burstgpt" and t.num_skipped == 2
    assert t.rows == [TraceRow(0.0, 472, 18), TraceRow(105.5, 417, 505)]
    assert "skipped_note" in t.describe()
    only_failures = _write(tmp_path, "f.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                              "5,ChatGPT,472,0,472,Conversation log\n")
    with pytest.raises(TraceError, match=r"no requests \(1 failed BurstGPT rows"):
        read_trace(only_failures)


def test_explicit_format_overrides_detection(tmp_path):
    p = _write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00,5,5\n")
    assert read_trace(p, format="azure").format == "azure"
    with pytest.raises(TraceError, match=r"az\.csv:1: a burstgpt trace's header needs the column\(s\) Timestamp"):
        read_trace(p, format="burstgpt")
    j = _write(tmp_path, "t.jsonl", '{"arrival_s": 0, "prompt_tokens": 7, "output_tokens": 3}\n')
    with pytest.raises(TraceError, match="only native traces may be JSONL"):
        read_trace(j, format="azure")
    with pytest.raises(ValueError, match="unknown trace format"):
        read_trace(p, format="csv")


@pytest.mark.parametrize("name,fmt,rows,skipped", [
    ("bursty_example.csv", "native", 200, 0),
    ("chat_with_prefixes.jsonl", "native", 20, 0),
    ("azure_layout_example.csv", "azure", 50, 0),
    ("burstgpt_layout_example.csv", "burstgpt", 50, 2),
])
def test_shipped_samples(name, fmt, rows, skipped):
    t = read_trace(os.path.join(SAMPLES, name))
    assert (t.format, len(t), t.num_skipped, t.was_sorted) == (fmt, rows, skipped, False)
    assert t.rows[0].arrival_s == 0.0 and np.all(np.diff(t.arrivals) >= 0) and 0 < t.mean_rate < math.inf
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in t.rows)
    if name.endswith(".jsonl"):
        d = t.describe()
        assert d["prefix_ids"] == 3 and 0 < d["rows_with_priority"] < 20 and 0 < d["rows_with_deadline"] < 20


# ------------------------------------------------------------------------------------------------ speedup, sorting
def test_speedup_divides_arrivals(tmp_path):
    p = _write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n1,5,5\n3,5,5\n7,5,5\n")
    np.testing.assert_allclose(read_trace(p).arrivals, [0, 2, 6])
    fast = read_trace(p, speedup=4.0)
    np.testing.assert_allclose(fast.arrivals, [0, 0.5, 1.5])
    assert fast.speedup == 4.0 and fast.mean_rate == pytest.approx(4 * read_trace(p).mean_rate)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="speedup"):
            read_trace(p, speedup=bad)


def test_unsorted_rows_are_sorted_stably(tmp_path):
    p = _write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n2,1,1\n1,2,1\n2,3,1\n1,4,1\n0.5,5,1\n")
    t = read_trace(p)
    assert t.was_sorted and "sorted stably" in t.describe()["note"]
    assert [r.prompt_tokens for r in t.rows] == [5, 2, 4, 1, 3]  # ties keep the file's order
    np.testing.assert_allclose(t.arrivals, [0, 0.5, 0.5, 1.5, 1.5])
    az = _write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:05,1,1\n"
                                    "2024-01-01 00:00:01,2,1\n")
    t = read_trace(az)
    assert t.was_sorted and [r.prompt_tokens for r in t.rows] == [2, 1] and t.arrivals.tolist() == [0.0, 4.0]


# ------------------------------------------------------------------------------------------------ bad lines
NATIVE = "arrival_s,prompt_tokens,output_tokens,priority,deadline_s,prefix_id,prefix_len\n0,5,5,,,,\n"


@pytest.mark.parametrize("line,message", [
    ("1,5\n", r"2 columns, but the header \(line 1\) has 7"),
    ("1,5,5,,,,,\n", "8 columns"),
    ("abc,5,5,,,,\n", "arrival_s must be a number, got 'abc'"),
    ("inf,5,5,,,,\n", "arrival_s must be a finite number"),
    ("1,x,5,,,,\n", "prompt_tokens must be an integer"),
    ("1,5,2.5,,,,\n", "output_tokens must be an integer"),
    ("1,0,5,,,,\n", "prompt_tokens must be >= 1, got 0"),
    ("1,5,-3,,,,\n", "output_tokens must be >= 1, got -3"),
    ("-1,5,5,,,,\n", "arrival_s must be >= 0"),
    (",5,5,,,,\n", "arrival_s is missing"),
    ("1,5,5,high,,,\n", "priority must be an integer"),
    ("1,5,5,,0,,\n", "deadline_s .* must be > 0"),
    ("1,5,5,,,p,6\n", "prefix_len 6 is larger than prompt_tokens 5"),
    ("1,5,5,,,,3\n", "prefix_len is given without a prefix_id"),
])
def test_bad_csv_line_names_file_and_line(tmp_path, line, message):
    p = _write(tmp_path, "bad.csv", NATIVE + "1,5,5,,,,\n" + line)
    with pytest.raises(TraceError, match=rf"bad\.csv:4: {message}"):
        read_trace(p)


@pytest.mark.parametrize("line,message", [
    ('{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 5, "deadline": 3}', "unknown key\\(s\\) 'deadline'"),
    ('{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 5', "invalid JSON"),
    ('[1, 5, 5]', "expected a JSON object"),
    ('{"arrival_s": 1, "prompt_tokens": 5}', "output_tokens is missing"),
    ('{"arrival_s": 1, "prompt_tokens": true, "output_tokens": 5}', "prompt_tokens must be an integer"),
    ('{"arrival_s": "soon", "prompt_tokens": 5, "output_tokens": 5}', "arrival_s must be a number"),
    ('{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 5, "prefix_id": 1.5}', "prefix_id must be a string"),
    ('{"arrival_s": 1, "prompt_tokens": 4, "output_tokens": 5, "prefix_id": "a", "prefix_len": 9}',
     "prefix_len 9 is larger than prompt_tokens 4"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, message):
    good = '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}\n'
    p = _write(tmp_path, "bad.jsonl", good + "\n" + line + "\n")
    with pytest.raises(TraceError, match=rf"bad\.jsonl:3: {message}"):
        read_trace(p)


@pytest.mark.parametrize("header,line,message", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens", "16/11/2023 18:15,5,5", "TIMESTAMP must look like"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens", "2023-13-16 18:15:46.1,5,5", "TIMESTAMP .* is not a valid date"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.1,5,-1", "GeneratedTokens must be >= 0"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.1,0,5", "ContextTokens must be >= 1"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type", "-2,m,5,5,10,x",
     "Timestamp must be >= 0"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type", "3,m,0,5,5,x",
     "Request tokens must be >= 1"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type", "3,m,5,-1,4,x",
     "Response tokens must be >= 0"),
])
def test_bad_public_layout_lines(tmp_path, header, line, message):
    first = "2023-11-16 18:15:46.0,5,5" if header.startswith("TIMESTAMP") else "1,m,5,5,10,x"
    p = _write(tmp_path, "pub.csv", f"{header}\n{first}\n{line}\n")
    with pytest.raises(TraceError, match=rf"pub\.csv:3: {message}"):
        read_trace(p)


def test_bad_headers_and_empty_files(tmp_path):
    with pytest.raises(TraceError, match=r"x\.csv:2: unrecognised header 'time,in,out'"):
        read_trace(_write(tmp_path, "x.csv", "\ntime,in,out\n1,2,3\n"))
    with pytest.raises(TraceError, match=r"y\.csv:1: unknown column\(s\) 'deadline'; .*'deadline' -> 'deadline_s'"):
        read_trace(_write(tmp_path, "y.csv", "arrival_s,prompt_tokens,output_tokens,deadline\n0,1,1,5\n"))
    with pytest.raises(TraceError, match=r"z\.csv:1: column\(s\) prompt_tokens appear more than once"):
        read_trace(_write(tmp_path, "z.csv", "arrival_s,prompt_tokens,output_tokens,prompt_tokens\n0,1,1,1\n"))
    with pytest.raises(TraceError, match="the trace is empty"):
        read_trace(_write(tmp_path, "e.csv", "\n  \n"))
    with pytest.raises(TraceError, match="no requests"):
        read_trace(_write(tmp_path, "h.csv", "arrival_s,prompt_tokens,output_tokens\n"))
    with pytest.raises(TraceError, match="cannot read the trace"):
        read_trace(tmp_path / "missing.csv")


def test_100k_rows_round_trip(tmp_path):
    rows = make_trace.make_rows(100_000, 50.0, input_len=500, output_len=100, range_ratio=0.9, seed=0)
    p = str(tmp_path / "big.csv")
    traces.write_trace(p, rows)
    assert read_trace(p).rows == rows  # (~0.4 s on the 2-core CPU; its speed is no test's business)


# ------------------------------------------------------------------------------------------------ trace_workload
def _trace(rows, path="mem.csv", **kw):
    return traces.Trace(list(rows), path, "native", **kw)


def test_trace_workload_lengths_clipping_priorities_deadlines():
    rows = [TraceRow(0.0, 10, 4, priority=2, deadline_s=1.5), TraceRow(0.5, 300, 300), TraceRow(0.5, 7, 1),
            TraceRow(2.0, 5, 5)]
    wl, arr = workloads.trace_workload(_trace(rows), 3, vocab_size=258, special_ids=SPECIAL, seed=0,
                                       max_seq_len=64)
    assert arr.tolist() == [0.0, 0.5, 0.5]
    assert [(r.prompt_len, r.output_len) for r in wl.requests] == [(10, 4), workloads.clip_pair(300, 300, 64), (7, 1)]
    assert wl.num_clipped == 1 and wl.name == "trace"
    assert [r.priority for r in wl.requests] == [2, 0, 0] and [r.deadline for r in wl.requests] == [1.5, None, None]
    assert all(not set(r.prompt_ids) & set(SPECIAL) for r in wl.requests)
    d = wl.describe()
    assert d["num_requests"] == 3 and d["trace_rows"] == 4 and d["num_prompts_requested"] == 3
    assert d["num_clipped"] == 1 and d["mean_rate"] == pytest.approx(4.0)
    # more prompts than rows: all rows, both numbers recorded
    wl, arr = workloads.trace_workload(_trace(rows), 10, vocab_size=258, seed=0)
    assert len(wl.requests) == 4 and len(arr) == 4
    assert wl.describe()["num_prompts_requested"] == 10 and wl.describe()["trace_rows"] == 4
    assert len(workloads.trace_workload(_trace(rows), None, vocab_size=258)[0].requests) == 4
    again, _ = workloads.trace_workload(_trace(rows), 10, vocab_size=258, seed=0)
    other, _ = workloads.trace_workload(_trace(rows), 10, vocab_size=258, seed=1)
    assert [r.prompt_ids for r in again.requests] == [r.prompt_ids for r in wl.requests]
    assert [r.prompt_ids for r in other.requests] != [r.prompt_ids for r in wl.requests]


def test_trace_workload_shared_prefixes():
    rows = [TraceRow(0.0, 20, 2, prefix_id="a", prefix_len=8), TraceRow(0.1, 30, 2, prefix_id=5, prefix_len=8),
            TraceRow(0.2, 12, 2, prefix_id="a", prefix_len=8), TraceRow(0.3, 40, 2, prefix_id="a", prefix_len=16),
            TraceRow(0.4, 9, 2), TraceRow(0.5, 10, 2, prefix_id=5, prefix_len=4),
            TraceRow(0.6, 10, 2, prefix_id="a")]
    wl, _ = workloads.trace_workload(_trace(rows), None, vocab_size=258, special_ids=SPECIAL, seed=3)
    r = wl.requests
    assert [x.prefix_id for x in r] == [0, 1, 0, 0, None, 1, 0]
    assert [x.prompt_len for x in r] == [20, 30, 12, 40, 9, 10, 10]
    assert r[0].prompt_ids[:8] == r[2].prompt_ids[:8] == r[3].prompt_ids[:8] == wl.prefixes[0][:8]
    assert r[3].prompt_ids[:16] == wl.prefixes[0] and len(wl.prefixes[0]) == 16  # extended by the longer row
    assert r[1].prompt_ids[:4] == r[5].prompt_ids[:4] == wl.prefixes[1][:4]
    assert r[0].prompt_ids[:8] != r[1].prompt_ids[:8]  # different ids, different prefixes
    assert r[0].prompt_ids[8:12] != r[2].prompt_ids[8:12]  # after the prefix, each row's own tokens
    assert r[6].prompt_ids[:8] != wl.prefixes[0][:8]  # no prefix_len: shares nothing
    assert wl.describe()["num_prefixes_used"] == 2


def test_trace_scenario_and_rescale(tmp_path):
    path = os.path.join(SAMPLES, "chat_with_prefixes.jsonl")
    wl, arr = workloads.make_scenario("trace", 12, rate=99.0, vocab_size=300, seed=1, max_seq_len=4096,
                                      priority_levels=5, trace_file=path, trace_speedup=2.0)
    t = read_trace(path, speedup=2.0)
    np.testing.assert_allclose(arr, t.arrivals[:12])  # the rate argument is ignored
    assert [r.priority for r in wl.requests] == [r.priority or 0 for r in t.rows[:12]]  # the trace's, not seeded
    assert wl.params["scenario"] == "trace" and wl.params["rate_argument_ignored"] == 99.0
    assert wl.params["rate"] == pytest.approx(workloads.mean_rate(arr))
    plain = _write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,5,5\n2,5,5\n")
    wl, _ = workloads.make_scenario("trace", 3, rate=1.0, vocab_size=300, priority_levels=3, trace_file=plain)
    assert {r.priority for r in wl.requests} <= {0, 1, 2}  # no priorities in the trace: seeded ones
    with pytest.raises(ValueError, match="needs a trace file"):
        workloads.make_scenario("trace", 3, rate=1.0, vocab_size=300)
    with pytest.raises(ValueError, match="unknown workload .*trace"):
        workloads.make_scenario("nope", 3, rate=1.0, vocab_size=300)
    bad = _write(tmp_path, "bad.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,0,5\n")
    with pytest.raises(TraceError, match=r"bad\.csv:3"):
        workloads.make_scenario("trace", 3, rate=1.0, vocab_size=300, trace_file=bad)

    a = np.array([0.0, 1.0, 1.0, 4.0])  # mean rate 3 / 4
    b = workloads.rescale_arrivals(a, 3.0)
    np.testing.assert_allclose(b, [0, 0.25, 0.25, 1.0])
    assert workloads.mean_rate(b) == pytest.approx(3.0)
    np.testing.assert_allclose(workloads.rescale_arrivals(a + 10, 1.5), [10, 10.5, 10.5, 12.0])
    assert (workloads.rescale_arrivals(a, math.inf) == 0).all()
    with pytest.raises(ValueError, match="zero span"):
        workloads.rescale_arrivals([2.0, 2.0, 2.0], 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        workloads.rescale_arrivals([0.0], 1.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        workloads.rescale_arrivals([1.0, 0.0], 1.0)
    with pytest.raises(ValueError, match="rate must be > 0"):
        workloads.rescale_arrivals(a, 0.0)


# ------------------------------------------------------------------------------------------------ make_trace
def test_make_rows_options_and_round_trip(tmp_path):
    rows = make_trace.make_rows(300, 4.0, burstiness=0.3, input_len=50, output_len=10, range_ratio=0.5, seed=2,
                                num_prefixes=3, prefix_len=16, priority_levels=3, deadline_s=9.0)
    assert rows == make_trace.make_rows(300, 4.0, burstiness=0.3, input_len=50, output_len=10, range_ratio=0.5,
                                        seed=2, num_prefixes=3, prefix_len=16, priority_levels=3, deadline_s=9.0)
    assert {r.prefix_id for r in rows} == {"p0", "p1", "p2"} and {r.prefix_len for r in rows} == {16}
    assert all(16 + 25 <= r.prompt_tokens <= 16 + 75 and 5 <= r.output_tokens <= 15 for r in rows)
    assert {r.priority for r in rows} == {0, 1, 2} and {r.deadline_s for r in rows} == {9.0}
    gaps = np.diff([r.arrival_s for r in rows])
    assert gaps.var() / gaps.mean() ** 2 > 1.5  # burstier than Poisson (CV^2 ~ 1 / 0.3)
    for name in ("r.csv", "r.jsonl"):
        traces.write_trace(tmp_path / name, rows)
        assert read_trace(tmp_path / name).rows == rows
    plain = make_trace.make_rows(5, 1.0, seed=0)
    assert all(r.prefix_id is None and r.priority is None and r.deadline_s is None for r in plain)
    traces.write_trace(tmp_path / "p.csv", plain)
    assert (tmp_path / "p.csv").read_text().splitlines()[0] == "arrival_s,prompt_tokens,output_tokens"
    # the public layouts keep the requests (Azure to 100 ns, BurstGPT to the millisecond)
    traces.write_trace(tmp_path / "az.csv", rows, layout="azure")
    az = read_trace(tmp_path / "az.csv")
    assert az.format == "azure" and [(r.prompt_tokens, r.output_tokens) for r in az.rows] == [
        (r.prompt_tokens, r.output_tokens) for r in rows]
    np.testing.assert_allclose(az.arrivals, [r.arrival_s for r in rows], atol=1e-6)
    traces.write_trace(tmp_path / "b.csv", rows, layout="burstgpt", failed_at=[0, 7])
    b = read_trace(tmp_path / "b.csv")
    assert b.format == "burstgpt" and b.num_skipped == 2 and len(b) == 300
    with pytest.raises(ValueError, match="num_prefixes"):
        make_trace.make_rows(5, 1.0, num_prefixes=2, prefix_len=0)


def test_make_trace_script(tmp_path):
    out = tmp_path / "sub" / "t.csv"
    cmd = [sys.executable, "-m", "experiments.make_trace", "--num_requests=40", "--rate=3", "--burstiness=0.5",
           "--input_len=32", "--output_len=8", "--range_ratio=0.5", "--seed=4", "--num_prefixes=2",
           "--prefix_len=8", "--priority_levels=2", f"--out={out}"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "wrote 40 requests" in res.stderr
    assert read_trace(out).rows == make_trace.make_rows(40, 3.0, burstiness=0.5, input_len=32, output_len=8,
                                                        range_ratio=0.5, seed=4, num_prefixes=2, prefix_len=8,
                                                        priority_levels=2)


# ------------------------------------------------------------------------------------------------ bench_serving
@pytest.fixture
def bench():
    from experiments import bench_serving

    yield bench_serving
    flags.FLAGS.unparse_flags()


def _parse(argv):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["bench_serving", *argv])


def test_bench_serving_trace_flags(bench, tmp_path):
    _parse(["--model=tiny", f"--output_dir={tmp_path}", "--dataset=trace"])
    with pytest.raises(app.UsageError, match="--dataset=trace needs --trace_file"):
        bench.main([])
    bad = _write(tmp_path, "bad.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,5\n")
    _parse(["--model=tiny", f"--output_dir={tmp_path}", "--dataset=trace", f"--trace_file={bad}"])
    with pytest.raises(app.UsageError, match=r"bad\.csv:3: 2 columns"):
        bench.main([])
    good = os.path.join(SAMPLES, "azure_layout_example.csv")
    _parse(["--model=tiny", f"--output_dir={tmp_path}", "--dataset=trace", f"--trace_file={good}",
            "--trace_format=burstgpt"])
    with pytest.raises(app.UsageError, match="a burstgpt trace's header needs"):
        bench.main([])
    with pytest.raises(flags.IllegalFlagValueError, match="trace_speedup"):
        _parse(["--dataset=trace", "--trace_speedup=0"])
    with pytest.raises(flags.IllegalFlagValueError):
        _parse(["--trace_format=parquet"])


@pytest.mark.parametrize("argv, message", [
    (["--dataset=random", "--trace_file=t.csv"], "--trace_file is read only with --dataset=trace"),
    (["--trace_speedup=2"], "--trace_speedup is read only with --dataset=trace"),
    (["--dataset=trace", "--trace_file=t.csv", "--request_rate=4"], "--request_rate: --dataset=trace replays"),
    (["--dataset=trace", "--trace_file=t.csv", "--burstiness=0.5"], "--burstiness: --dataset=trace replays"),
    (["--dataset=sharegpt", "--input_len=64"], "--input_len is not used by --dataset=sharegpt"),
    (["--dataset=random", "--prefix_len=64"], "--prefix_len is not used by --dataset=random"),
])
def test_bench_serving_refuses_flags_its_dataset_does_not_read(bench, tmp_path, argv, message):
    _parse(["--model=tiny", f"--output_dir={tmp_path}", *argv])
    with pytest.raises(app.UsageError, match=message):
        bench.main([])


@pytest.mark.parametrize("bad, message", [
    ("--layout=burstgpt --failed_requests=-1", "--failed_requests must be >= 0"),
    ("--layout=azure --start=garbage", "--start='garbage' is not a date and time"),
])
def test_make_trace_bad_flags_are_usage_errors_before_out_is_opened(tmp_path, bad, message):
    out = tmp_path / "t.csv"
    out.write_text("keep me\n")
    res = run_expecting_usage_error("experiments.make_trace", "--num_requests=5", f"--out={out}", *bad.split())
    assert message in res.stderr, res.stderr[-2000:]
    assert out.read_text() == "keep me\n"
