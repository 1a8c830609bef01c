"""experiments/profile_speculative.py end to end on a tiny random Llama (subprocess: its absl flags would clash with
the other scripts')."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.experiments.helpers import run_expecting_usage_error
from tests.experiments.test_generate import model_dir  # noqa: F401 (the fixture)


@pytest.mark.parametrize("drafter", ["none", "ngram", "self"])
@pytest.mark.slow
def test_script_end_to_end(model_dir, tmp_path, drafter):  # noqa: F811
    pytest.importorskip("torch")
    out = tmp_path / "records" / "prof.json"  # a folder that does not exist yet: the script makes it
    runs = 2 if drafter == "none" else 1  # a second call appends (checked once: each call is a process's compile)
    ops = ["--ops"] if drafter == "ngram" else []  # the per-operation breakdown (a traced third pass), once
    for run in range(runs):
        sampled = ["--temperature=1.5"] if run == 1 else []  # none's second run: a seeded sampled job
        p = subprocess.run([sys.executable, "-m", "experiments.profile_speculative", f"--model={model_dir}",
                            "--quant=none", f"--drafter={drafter}", "--self_draft_layers=1", "--max_new_tokens=12",
                            "--num_draft_tokens=2", f"--json_out={out}", *ops, *sampled],
                           capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert p.returncode == 0, p.stderr[-3000:]
    recs = json.loads(out.read_text())
    assert len(recs) == runs
    r = recs[-1]
    assert r["flags"]["self_draft_layers"] == 1  # (what defines the self-draft)
    assert r["flags"]["temperature"] == (1.5 if runs == 2 else 0.0)
    assert len(r["output_tokens"]) == r["tokens"]
    if runs == 2:  # the sampled job wrote other tokens than the greedy one
        assert recs[0]["flags"]["temperature"] == 0.0 and recs[0]["output_tokens"] != r["output_tokens"]
    assert 0 < r["tokens"] <= 12 and 0 < r["iterates"] <= r["tokens"] + 1
    parts = r["parts"]
    total = sum(v["total_s"] for v in parts.values())
    assert 0 < total < r["wall_s"] and r["host_s"] > 0  # the parts fit in the wall time
    names = {k.split(" (")[0] for k in parts}
    assert "step_forward" in names
    if drafter == "none":
        assert "verify_sample" not in names and "draft_burst_jit" not in names and "step_sample" in names
    else:
        assert "verify_sample" in names
    if drafter == "self":  # the draft's burst and its mirror (a 1-layer forward) are timed apart
        assert "draft_burst_jit" in names and any(k.startswith("step_forward (1 layers") for k in parts)
        bursts = {k for k in parts if k.startswith("draft_burst_jit")}  # told apart: with a window or not
        assert bursts and bursts <= {"draft_burst_jit (window)", "draft_burst_jit (no catch-up)"}
    for v in parts.values():
        assert v["calls"] > 0 and v["median_ms"] > 0
    if not ops:
        assert "ops" not in r
        return
    # every part traced, each call matched with an execution of its own program, its operations timed
    assert set(r["ops"]) == set(parts)
    for key, b in r["ops"].items():
        assert b["calls"] == parts[key]["calls"], key
        assert b["ops"] and all(o["ms_per_call"] > 0 for o in b["ops"])
        assert sum(o["ms_per_call"] for o in b["ops"]) < 20 * parts[key]["median_ms"] + 50
    assert "by operation" in p.stdout


@pytest.mark.parametrize("bad, message", [
    (("--drafter=none", "--adaptive"), "--adaptive needs a drafter"),  # (had run plain and recorded adaptive)
    (("--drafter=ngram", "--draft_dir=/tmp/x"), "--draft_dir is --drafter=distilled's checkpoint"),
    (("--drafter=distilled",), "--drafter=distilled needs --draft_dir"),
    (("--drafter=ngram", "--num_draft_tokens=0"), "--num_draft_tokens must be in [1, 64], got 0"),
    (("--drafter=self", "--self_draft_layers=0"), "--self_draft_layers must be >= 1"),
    (("--temperature=-1",), "--temperature must be >= 0"),
])
def test_a_bad_flag_is_a_usage_error_before_the_model_loads(tmp_path, bad, message):
    """absl's usage message naming the flag, not a traceback (the model does not exist: a check that let the bad
    value through fails at the model with another message)."""
    p = run_expecting_usage_error("experiments.profile_speculative", f"--model={tmp_path / 'no-model'}", *bad)
    assert message in p.stderr, p.stderr[-2000:]


def test_a_model_or_layer_count_it_cannot_use_is_a_usage_error(model_dir, tmp_path):  # noqa: F811
    p = run_expecting_usage_error("experiments.profile_speculative", f"--model={tmp_path / 'no-model'}")
    assert f"--model {tmp_path / 'no-model'}:" in p.stderr, p.stderr[-2000:]
    p = run_expecting_usage_error("experiments.profile_speculative", f"--model={model_dir}", "--drafter=self",
                                  "--self_draft_layers=5")
    assert "--self_draft_layers=5: the model has 2 layers" in p.stderr, p.stderr[-2000:]
