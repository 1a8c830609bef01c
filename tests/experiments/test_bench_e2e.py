"""experiments/bench_e2e.py: the bytes a step must read (hand-computed for a tiny config), the roofline arithmetic,
the step timing's split over bursts (a hand-checkable fake generator), and one tiny run end to end.

The script runs in a process of its own: its flags (--batch_sizes, --context, --plot, ...) share names with other
scripts' flags of other defaults and types, which absl keeps in one registry per process."""

from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import pytest

from experiments.lib.roofline import (
    decode_step_bytes,
    kv_tokens_read,
    prefill_chunks,
    prefill_work,
    roofline_tokens_per_s,
)
from experiments.lib.serving.hardware import model_cost
from experiments.lib.step_timing import TIMERS, prefill, time_decode
from models import ModelConfig, init_random_weights, random_weights
from paged.device.state import EngineState
from tests.compile_settings import ROOT, script_env
from tests.experiments.helpers import run_expecting_usage_error

H, F, NQ, NKV, D, L, V = 64, 128, 4, 2, 16, 2, 256
CFG = ModelConfig(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=F, num_layers=L, num_heads=NQ,
                  num_kv_heads=NKV, head_dim=D)  # untied embeddings: a step reads the LM head, not the table


def test_decode_bytes_are_the_weights_once_and_every_rows_kv_in_whole_pages():
    # per layer two norms, q/k/v, o, gate+up, down; the final norm; the LM head (the input table is not read)
    params = L * (2 * H + H * (NQ + 2 * NKV) * D + NQ * D * H + H * 2 * F + F * H) + H + H * V
    cost = model_cost(CFG, init_random_weights(CFG))
    assert cost.weight_bytes == 4 * params == 361_728
    assert cost.kv_bytes_per_token == L * 2 * NKV * D * 4 == 512
    # rows holding 10 and 70 tokens read 11 and 71 slots: one page of 16, five pages
    assert kv_tokens_read(10, 16) == 16 and kv_tokens_read(70, 16) == 80 and kv_tokens_read(15, 16) == 16
    assert decode_step_bytes(cost, [10, 70], 16) == 361_728 + (16 + 80) * 512
    # two steps from 15 cached tokens: 16 slots, then 17 -> a second page; the mean per step
    assert decode_step_bytes(cost, [15], 16, steps=2) == 361_728 + (16 + 32) / 2 * 512


def test_an_int8_cache_counts_its_scales_and_quantized_weights_their_real_bytes():
    state = EngineState.create(CFG, 4, 16, jnp.int8)  # float32 scale per token and head beside the int8 values
    assert model_cost(CFG, init_random_weights(CFG), state).kv_bytes_per_token == L * 2 * NKV * (D + 4)
    # q4_0: half a byte per weight and a float16 scale per 32 input rows and column; norms bfloat16
    mats = L * [(H, (NQ + 2 * NKV) * D), (NQ * D, H), (H, 2 * F), (F, H)] + [(H, V)]  # + the LM head
    q4 = sum(k * n // 2 + 2 * (k // 32) * n for k, n in mats)
    norms = 2 * (L * 2 * H + H)
    assert model_cost(CFG, random_weights(CFG, "q4_0")).weight_bytes == q4 + norms


def test_roofline_and_prefill_arithmetic():
    assert roofline_tokens_per_s(10e9, 5e8, 4) == pytest.approx(80.0)  # 20 steps/s x 4 rows
    assert prefill_chunks(600, 256) == [(0, 256), (256, 256), (512, 88)]
    cost = model_cost(CFG, init_random_weights(CFG))
    work = prefill_work(cost, 40, 16, 16)  # chunks end at 16, 32, 40 tokens: 16, 32, 48 slots
    assert work["chunks"] == 3 and work["bytes"] == 3 * cost.weight_bytes + (16 + 32 + 48) * 512
    assert work["flops"] == sum(cost.step_flops([(s, n, True)]) for s, n in ((0, 16), (16, 16), (32, 8)))


class BurstGenerator:
    """A generator whose every iterate() is a burst of `k` decode steps over its jobs, each timer growing by a known
    amount per call."""

    class Job:
        def __init__(self, pos):
            self.kv_position, self.new_tokens = pos, 0

    def __init__(self, positions, k, end_after=None):
        self.active, self.pending, self.k, self.steps, self.tokens = [self.Job(p) for p in positions], [], k, 0, 0
        self.timers = dict.fromkeys(TIMERS.values(), 0.0)
        self.end_after = end_after

    def enqueue(self, jobs):
        self.pending += jobs

    def iterate(self):
        self.active += self.pending
        self.pending = []
        for j in self.active:
            j.kv_position += self.k
            j.new_tokens += self.k
        self.steps += self.k
        self.tokens += self.k * len(self.active)
        for i, key in enumerate(TIMERS.values()):
            self.timers[key] += 1e-3 * (i + 1)
        if self.end_after is not None and self.steps >= self.end_after:
            self.active.pop()

    def metrics(self):
        return {"tokens_generated": self.tokens, **self.timers}


def test_a_timed_window_counts_bursts_as_steps_and_splits_each_step():
    gen = BurstGenerator([5, 9], k=4)
    prefill(gen, [BurstGenerator.Job(0)])  # one call: every job has a token
    assert gen.steps == 4 and [j.kv_position for j in gen.active] == [9, 13, 4]
    w = time_decode(gen, 6)  # two bursts of 4: the last goes past 6
    assert (w.rows, w.steps, w.calls, w.tokens, w.kv_positions) == (3, 8, 2, 24, (9, 13, 4))
    split = w.split_ms()
    assert split["schedule_ms"] == pytest.approx(2 * 1 / 8) and split["results_ms"] == pytest.approx(2 * 5 / 8)
    assert split["launch_ms"] == split["dispatch_ms"] and split["device_ms"] == split["device_wait_ms"]
    assert split["host_ms"] + split["launch_ms"] + split["device_ms"] == pytest.approx(w.ms_per_step)
    with pytest.raises(RuntimeError, match="ended or waited"):
        time_decode(BurstGenerator([1, 2], k=1, end_after=1), 2)


def test_a_tiny_run_writes_every_field_and_a_plot(tmp_path):
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    p = subprocess.run([sys.executable, "-m", "experiments.bench_e2e", "--model=tiny", "--batch_sizes=2,1",
                        "--context=16", "--tokens=4", "--decode_steps=1", "--warmup_steps=1", "--prefill_tokens=40",
                        "--max_chunk_size=16", "--page_size=16", "--copy_mb=8", "--copy_repeats=1",
                        f"--json_out={out}", f"--plot={png}"], capture_output=True, text=True, cwd=ROOT,
                       env=script_env(JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["model"] == "tiny" and rec["device"]["name"] and rec["copy"]["bandwidth_gbps"] > 0
    assert rec["setup"]["batch_sizes"] == [1, 2] and rec["setup"]["page_size"] == 16
    assert rec["weights"]["bytes_per_step"] == 361_728 and rec["weights"]["kv_bytes_per_token"] == 512
    pre = rec["prefill"]
    assert pre["prompt_tokens"] == 40 and pre["chunk"] == 16 and pre["tokens_per_s"] > 0 and pre["copy_fraction"] > 0
    assert [d["batch"] for d in rec["decode"]] == [1, 2]
    for d in rec["decode"]:
        assert d["steps"] >= 4 and d["tokens"] == d["batch"] * d["steps"] and d["context_min"] >= 16
        # bytes: the weights and each row's pages (a row holds 16 + at least its warm-up token: two pages)
        assert d["bytes_per_step"] == d["weight_bytes_per_step"] + d["kv_bytes_per_step"]
        assert d["kv_bytes_per_step"] >= d["batch"] * 32 * 512
        assert d["roofline_tokens_per_s"] == pytest.approx(
            d["batch"] * rec["copy"]["bandwidth_gbps"] * 1e9 / d["bytes_per_step"])
        # the fraction is positive; on a CPU it is not bounded by 1 (a tiny model's weights stay in the caches)
        assert d["roofline_fraction"] > 0
        assert d["roofline_fraction"] == pytest.approx(d["tokens_per_s"] / d["roofline_tokens_per_s"])
        assert d["host_ms"] + d["launch_ms"] + d["device_ms"] == pytest.approx(d["ms_per_step"])
        assert d["host_ms"] > 0 and d["device_ms"] >= 0
    assert "roofline fraction" in p.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_flags_are_usage_errors(tmp_path):
    p = run_expecting_usage_error("experiments.bench_e2e", "--model=tiny", "--batch_sizes=1,x")
    assert "--batch_sizes=1,x: give integers >= 1" in p.stderr
    # (had failed after the whole measurement, with a ZeroDivisionError; --copy_mb=-1 with a JAX shape error)
    p = run_expecting_usage_error("experiments.bench_e2e", "--model=tiny", "--copy_repeats=0")
    assert "--copy_repeats must be >= 1, got 0" in p.stderr
