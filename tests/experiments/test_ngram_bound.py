"""experiments/ngram_bound.py: the replay of the n-gram drafter over known outputs (hand-computed steps), and the
script end to end on a tiny random Llama (subprocess: its absl flags would clash with the other scripts')."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paged.speculation.ngram import Replay, replay
from tests.experiments.helpers import run_expecting_usage_error
from tests.experiments.test_generate import model_dir  # noqa: F401 (the fixture)


def test_replay_counts_the_steps_of_greedy_verification():
    # prefill emits 1; then the suffix (1,) matches the prompt's start: drafts 2 3 4 5, all accepted, plus 7; then
    # nothing matches (... 5 7): a plain step emits 8
    r = replay([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7, 8], k=4, max_ngram=4, max_new_tokens=100)
    assert r == Replay(tokens=7, steps=3, verifications=1, drafted=4, accepted=4, verified={4: 1})
    assert r.speedup(1.0) == pytest.approx(7 / 3)
    assert r.speedup(2.0) == pytest.approx(7 / 4)  # the verification step costs two plain ones
    # a rejection: drafts 2 3 9 1, the output goes 2 5: one accepted, the step emits 2 and 5
    assert replay([1, 2, 3, 9], [1, 2, 5], k=4, max_ngram=4, max_new_tokens=100) == Replay(3, 2, 1, 4, 1, {4: 1})
    # drafts never run past max_new_tokens: 4 tokens asked, the step after prefill may draft 4 - 1 - 1 = 2
    assert replay([1, 2, 3, 4], [1, 2, 3, 4], k=4, max_ngram=4, max_new_tokens=4) == Replay(4, 2, 1, 2, 2, {2: 1})
    # k = 1 caps the drafts; after 1 2 3 the suffix (2, 3) proposes 7, not (3,)'s more recent 8
    r = replay([1, 2, 3, 7, 3, 8], [1, 2, 3, 7, 3], k=1, max_ngram=2, max_new_tokens=100)
    assert r == Replay(tokens=5, steps=3, verifications=2, drafted=2, accepted=2, verified={1: 2})
    # the last draft checked against the output's end: drafts 4 7, the output ends after 4
    r = replay([5, 1, 2, 3, 4, 7], [5, 1, 2, 3, 4], k=2, max_ngram=2, max_new_tokens=100)
    assert r == Replay(5, 3, 2, 4, 3, {2: 2})
    assert replay([1, 2], [], k=4, max_ngram=4, max_new_tokens=10) == Replay()
    # an output longer than max_new_tokens (not the generator's): past the limit nothing is drafted
    assert replay([1, 2, 3], [1, 2, 3, 1, 2, 3], k=4, max_ngram=4, max_new_tokens=2) == Replay(6, 6, 0, 0, 0)
    assert Replay(4, 2, 1, 2, 2, {2: 1}).add(Replay(3, 2, 1, 4, 1, {4: 1, 2: 2})) == Replay(7, 4, 2, 6, 3, {2: 3, 4: 1})



def test_replay_policies_choose_how_many_drafts_a_step_verifies():
    prompt = [9, 1, 2, 3, 4, 5, 6, 7, 8]
    out = [9, 1, 2, 3, 4, 5, 6, 7, 0]  # copies the prompt, then leaves it
    # all: after 9 the suffix (9,) proposes 1 2 3 4: all accepted, plus 5; then (4, 5) proposes 6 7 8 9: 6 7
    # accepted, 0 emitted
    assert replay(prompt, out, k=4, max_ngram=2, max_new_tokens=100) == Replay(9, 3, 2, 8, 6, {4: 2})
    # grow: 1 draft (accepted: 1 2), then 2 (3 4 5), then 4 (6 7 8 9: two accepted, then 0); g = 1, 2, 4
    r = replay(prompt, out, k=4, max_ngram=2, max_new_tokens=100, policy="grow")
    assert r == Replay(9, 4, 3, 1 + 2 + 4, 1 + 2 + 2, {1: 1, 2: 1, 4: 1})
    # after that rejection g = accepted + 1 = 3: the output goes on 3 4 5 6; nothing matches (0,): a plain step
    # emits 3; (3,) proposes 4 5 6 7 (its most recent occurrence, in the output), 3 of them verified and accepted
    r = replay(prompt, out + [3, 4, 5, 6], k=4, max_ngram=2, max_new_tokens=100, policy="grow")
    assert r == Replay(13, 6, 4, 1 + 2 + 4 + 3, 1 + 2 + 2 + 3, {1: 1, 2: 1, 4: 1, 3: 1})
    # oracle: verifies exactly what is accepted, a step with nothing to accept is plain
    r = replay(prompt, out, k=4, max_ngram=2, max_new_tokens=100, policy="oracle")
    assert r == Replay(9, 3, 2, 6, 6, {4: 1, 2: 1})
    r = replay([1, 2, 3, 9], [1, 2, 5], k=4, max_ngram=4, max_new_tokens=100, policy="oracle")
    assert r == Replay(3, 2, 1, 1, 1, {1: 1})
    # min_match: the one-token match (1,) is not verified (a plain step emits 2); (1, 2) is: 3 9 1 2, rejected
    r = replay([1, 2, 3, 9], [1, 2, 5], k=4, max_ngram=4, max_new_tokens=100, min_match=2)
    assert r == Replay(3, 3, 1, 4, 0, {4: 1})
    with pytest.raises(ValueError, match="policy"):
        replay(prompt, out, k=4, max_ngram=2, max_new_tokens=100, policy="some")
    # gate: the generator's DraftGate decides; free verification (rho 0) verifies every proposal, as "all"
    from paged.speculation.draft_gate import DraftGate

    free = DraftGate(4, token_cost=0.0)
    assert replay(prompt, out, k=4, max_ngram=2, max_new_tokens=100, policy="gate", gate=free) == Replay(
        9, 3, 2, 8, 6, {4: 2})
    assert free.stats()["acceptance_by_class"] == {1: 4 / 4, 2: 2 / 3}  # learned: (9,) 4 of 4, (4, 5) 2 then a miss
    # costly verification (rho 10: ~36 tokens' worth at batch 1) verifies only when the gate explores, after more
    # than explore_every (here 1) gated steps in a row: (9,)'s 1 2 3 4 gated (a plain step emits 1); (9, 1)'s
    # 2 3 4 5 explored, all accepted, plus 6; (6,)'s 7 8 9 1 gated (7 emitted); 8 9 1 2 explored, rejected, 0
    dear = DraftGate(4, token_cost=10.0, explore_every=1)
    r = replay(prompt, out, k=4, max_ngram=2, max_new_tokens=100, policy="gate", gate=dear)
    assert r == Replay(9, 5, 2, 8, 4, {4: 2})
    assert (dear.gated_steps, dear.explored_steps) == (2, 2)
    with pytest.raises(ValueError, match="gate"):
        replay(prompt, out, k=4, max_ngram=2, max_new_tokens=100, policy="gate")
    with pytest.raises(ValueError, match="gate"):
        replay(prompt, out, k=4, max_ngram=2, max_new_tokens=100, gate=free)
    # costs per verified count: plain steps cost 1
    r = Replay(tokens=9, steps=4, verifications=3, drafted=6, accepted=5, verified={1: 1, 2: 1, 3: 1})
    assert r.speedup_by(lambda m: 1.0 + 0.5 * m) == pytest.approx(9 / (1 + 1.5 + 2.0 + 2.5))
    assert r.speedup(2.0) == pytest.approx(9 / (1 + 3 * 2.0))

def run_script(model_dir, out, *args):  # noqa: F811
    p = subprocess.run([sys.executable, "-m", "experiments.ngram_bound", f"--model={model_dir}", "--quant=none",
                        "--workloads=copy", "--num_prompts=2", "--max_new_tokens=8", *args, f"--json_out={out}"],
                       capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def check_predictions(r, width_costs, widths):
    """The record's two width-priced predictions, recomputed from its counts."""
    plain = r["steps"] - r["verifications"]
    fixed = r["tokens"] / (plain + r["verifications"] * width_costs[str(r["num_draft_tokens"] + 1)])
    assert r["predicted_speedup_fixed_width"] == pytest.approx(fixed)
    assert sum(r["verified"].values()) == r["verifications"]
    assert sum(int(m) * n for m, n in r["verified"].items()) == r["drafted"]
    flexible = plain + sum(n * width_costs[str(min(w for w in widths if w > int(m)))] for m, n in r["verified"].items())
    assert r["predicted_speedup_widths"] == pytest.approx(r["tokens"] / flexible)


def test_script_end_to_end(model_dir, tmp_path):  # noqa: F811
    pytest.importorskip("torch")
    # a corpus table of the model's own greedy outputs on the script's prompts: its drafts are taken and accepted
    import numpy as np

    from experiments.lib.common import chat_prompt, workload
    from models import load_model
    from paged import DynamicGenerator, Job, SamplingSettings
    from paged.speculation.ngram_corpus import NgramCorpus

    model = load_model(str(model_dir))
    gen = DynamicGenerator(model, max_batch_size=1, max_seq_len=min(1024, model.config.max_position_embeddings))
    tok = model.tokenizer
    seqs = []
    for p in workload("copy", 2, 0):
        job = Job(tok.encode(chat_prompt(tok, p), encode_special_tokens=True), 8,
                  gen_settings=SamplingSettings.greedy(), stop_conditions=[tok.eos_token_id])
        gen.enqueue(job)
        while gen.num_remaining_jobs():
            list(gen.iterate())
        seqs.append(np.asarray(job.sequence).ravel().tolist()[-14:])
    NgramCorpus.build(seqs, model.config.vocab_size, min_count=1).save(tmp_path / "corpus.npz")
    rec = run_script(model_dir, tmp_path / "bound.json", "--num_draft_tokens=2,4", "--verify_costs=1,2",
                     "--policies=all,grow,oracle", "--widths=2,3", "--cost_model=1.5,0.25",
                     f"--ngram_corpus={tmp_path / 'corpus.npz'}")
    assert rec["flags"]["ngram_corpus"] == str(tmp_path / "corpus.npz") and "NgramCorpus(" in rec["ngram_corpus"]
    assert all(r["corpus_accepted"] > 0 for r in rec["runs"] if r["policy"] == "all")
    assert [(r["num_draft_tokens"], r["policy"]) for r in rec["runs"]] == [
        (k, p) for k in (2, 4) for p in ("all", "grow", "oracle")]
    # without --price: c(W) = A + B (W - 1), for the widths asked, k + 1, and k = 4's width added to the variable set
    assert rec["width_costs"] == {str(w): pytest.approx(1.5 + 0.25 * (w - 1)) for w in (2, 3, 5)}
    for r in rec["runs"]:
        assert 0 < r["steps"] <= r["tokens"] <= 16 and r["verifications"] < r["steps"]
        assert r["tokens_per_step"] == pytest.approx(r["tokens"] / r["steps"])
        assert r["predicted_speedup"]["1.0"] == pytest.approx(r["tokens_per_step"])
        assert r["predicted_speedup"]["2.0"] <= r["predicted_speedup"]["1.0"]
        assert len(r["per_prompt_tokens_per_step"]) == 2
        check_predictions(r, rec["width_costs"], (2, 3, 5))
    for k in (2, 4):
        by = {r["policy"]: r for r in rec["runs"] if r["num_draft_tokens"] == k}
        # the oracle takes the same steps as verifying every draft, verifying only what is accepted
        assert by["oracle"]["steps"] == by["all"]["steps"] and by["oracle"]["accepted"] == by["all"]["accepted"]
        assert by["oracle"]["drafted"] == by["oracle"]["accepted"] <= by["all"]["drafted"]


@pytest.mark.slow
def test_script_prices_widths_in_the_generator(model_dir, tmp_path):  # noqa: F811
    pytest.importorskip("torch")
    rec = run_script(model_dir, tmp_path / "priced.json", "--num_draft_tokens=2", "--widths=2,3,9", "--price")
    assert set(rec["step_prices"]) == {"2", "3"}
    for w, price in rec["step_prices"].items():
        assert price["plain_ms"] > 0 and price["verify_ms"] > 0
        assert rec["width_costs"][w] == pytest.approx(price["verify_ms"] / price["plain_ms"])
    (r,) = rec["runs"]  # (width 9 lies beyond k + 1 = 3: not priced)
    check_predictions(r, rec["width_costs"], (2, 3))


@pytest.mark.parametrize("bad, message", [
    ("--workloads=copy,bogus", "--workloads: unknown ['bogus']; give some of copy, chat"),  # (had run as chat)
    ("--num_draft_tokens=4,abc", "--num_draft_tokens=4,abc: give int values >= 1"),
    ("--max_new_tokens=0", "--max_new_tokens must be >= 1, got 0"),
])
def test_a_bad_flag_is_a_usage_error_before_the_model_loads(tmp_path, bad, message):
    """absl's usage message naming the flag, not a traceback after the model loaded (the model does not exist: a
    check that let a bad value through fails there with another message)."""
    p = run_expecting_usage_error("experiments.ngram_bound", f"--model={tmp_path / 'no-model'}", bad)
    assert message in p.stderr, p.stderr[-2000:]
