"""experiments/ngram_bound.py: the replay of the n-gram drafter over known outputs (hand-computed steps), and the
script end to end on a tiny random Llama (subprocess: its absl flags would clash with the other scripts')."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paged.ngram import Replay, replay
from tests.experiments.test_generate import model_dir  # noqa: F401 (the fixture)


def test_replay_counts_the_steps_of_greedy_verification():
    # prefill emits 1; then the suffix (1,) matches the prompt's start: drafts 2 3 4 5, all accepted, plus 7; then
    # nothing matches (... 5 7): a plain step emits 8
    r = replay([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7, 8], k=4, max_ngram=4, max_new_tokens=100)
    assert r == Replay(tokens=7, steps=3, verifications=1, drafted=4, accepted=4)
    assert r.speedup(1.0) == pytest.approx(7 / 3)
    assert r.speedup(2.0) == pytest.approx(7 / 4)  # the verification step costs two plain ones
    # a rejection: drafts 2 3 9 1, the output goes 2 5: one accepted, the step emits 2 and 5
    assert replay([1, 2, 3, 9], [1, 2, 5], k=4, max_ngram=4, max_new_tokens=100) == Replay(3, 2, 1, 4, 1)
    # drafts never run past max_new_tokens: 4 tokens asked, the step after prefill may draft 4 - 1 - 1 = 2
    assert replay([1, 2, 3, 4], [1, 2, 3, 4], k=4, max_ngram=4, max_new_tokens=4) == Replay(4, 2, 1, 2, 2)
    # k = 1 caps the drafts; after 1 2 3 the suffix (2, 3) proposes 7, not (3,)'s more recent 8
    r = replay([1, 2, 3, 7, 3, 8], [1, 2, 3, 7, 3], k=1, max_ngram=2, max_new_tokens=100)
    assert r == Replay(tokens=5, steps=3, verifications=2, drafted=2, accepted=2)
    # the last draft checked against the output's end: drafts 4 7, the output ends after 4
    assert replay([5, 1, 2, 3, 4, 7], [5, 1, 2, 3, 4], k=2, max_ngram=2, max_new_tokens=100) == Replay(5, 3, 2, 4, 3)
    assert replay([1, 2], [], k=4, max_ngram=4, max_new_tokens=10) == Replay()
    # an output longer than max_new_tokens (not the generator's): past the limit nothing is drafted
    assert replay([1, 2, 3], [1, 2, 3, 1, 2, 3], k=4, max_ngram=4, max_new_tokens=2) == Replay(6, 6, 0, 0, 0)
    assert Replay(4, 2, 1, 2, 2).add(Replay(3, 2, 1, 4, 1)) == Replay(7, 4, 2, 6, 3)


def test_script_end_to_end(model_dir, tmp_path):  # noqa: F811
    pytest.importorskip("torch")
    out = tmp_path / "bound.json"
    p = subprocess.run([sys.executable, "-m", "experiments.ngram_bound", f"--model={model_dir}", "--quant=none",
                        "--workloads=copy", "--num_prompts=2", "--max_new_tokens=8", "--num_draft_tokens=2,4",
                        "--verify_costs=1,2", f"--json_out={out}"], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert [r["num_draft_tokens"] for r in rec["runs"]] == [2, 4]
    for r in rec["runs"]:
        assert 0 < r["steps"] <= r["tokens"] <= 16 and r["verifications"] < r["steps"]
        assert r["tokens_per_step"] == pytest.approx(r["tokens"] / r["steps"])
        assert r["predicted_speedup"]["1.0"] == pytest.approx(r["tokens_per_step"])
        assert r["predicted_speedup"]["2.0"] <= r["predicted_speedup"]["1.0"]
        assert len(r["per_prompt_tokens_per_step"]) == 2
