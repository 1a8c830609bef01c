"""experiments/studies/feature_draft_study.py: the acceptance counting and the greedy replay (hand-computed), the
batched
chain evaluation against a step-by-step autoregressive run of the draft, and the script end to end on a tiny random
Llama. Subprocesses: the script's absl flags (shared with distill_draft) would clash with the other scripts'."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.experiments.test_generate import model_dir  # noqa: F401 (the fixture)


def env() -> dict[str, str]:
    """The scripts' environment, read when a test runs: tests/conftest.py sets how tiny-model tests compile
    (`JAX_DISABLE_MOST_OPTIMIZATIONS`) before each test, after this module is imported (a copy made at import
    compiled every script with the full optimisations)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def run_snippet(code: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


COUNTING = r"""
import json
import numpy as np
from experiments.studies.feature_draft_study import accepted_lengths, replay_steps
tokens = np.array([[10, 11, 12, 13, 14, 15, 16]])          # x[0..6]
answer = np.array([[0, 0, 1, 1, 1, 1, 1]], bool)            # the answer is x[2..6]
drafts = np.full((1, 6, 3), -1)                             # start t proposes x[t + 2], x[t + 3], x[t + 4]
drafts[0, 1] = [13, 14, 99]   # start 1 (input x[2]): two right, then wrong
drafts[0, 2] = [14, 15, 16]   # start 2: all three right
drafts[0, 3] = [15, 99, 16]   # start 3: one right (the third is right but after a miss)
drafts[0, 4] = [16, 17, 18]   # start 4: one right, then past the answer's end
drafts[0, 0] = [12, 13, 14]   # start 0 (x[2] is the first answer token): x[2] right
full = accepted_lengths(drafts, tokens, answer, 3)
two = accepted_lengths(drafts, tokens, answer, 2)
print(json.dumps({"full": full.tolist(), "two": two.tolist(),
                  "replay": replay_steps(full[0], answer[0]), "replay_two": replay_steps(two[0], answer[0]),
                  "none": replay_steps(np.zeros(6, int), answer[0]),
                  "short": replay_steps(full[0], answer[0] & False)}))
"""


ALIGNMENT = r"""
import json
import numpy as np
from experiments.studies.feature_draft_study import teacher_inputs, training_targets
toks = np.array([[10, 11, 12, 13]])
fts = np.arange(4)[None, :, None] * np.ones((1, 4, 2)) + 100   # f[t] = 100 + t
labs = np.array([[11, 12, 13, 0]])                               # labels[t] = x[t + 1] (make_examples)
msk = np.array([[0.0, 1.0, 1.0, 0.0]])
feat, nxt, pos, b, t = teacher_inputs(toks, fts)
f_next, lab, m = training_targets(fts, labs, msk)
print(json.dumps({"feat": np.asarray(feat)[:, 0].tolist(), "nxt": np.asarray(nxt).tolist(),
                  "pos": np.asarray(pos).tolist(), "bt": [b, t], "f_next": np.asarray(f_next)[:, 0].tolist(),
                  "lab": np.asarray(lab).tolist(), "m": np.asarray(m).tolist()}))
"""


def test_training_alignment():
    r = run_snippet(ALIGNMENT)
    # input t = (f[t], x[t + 1]) at position t + 1, trained towards f[t + 1] and x[t + 2]
    assert r["feat"] == [100, 101, 102] and r["nxt"] == [11, 12, 13] and r["pos"] == [1, 2, 3] and r["bt"] == [1, 3]
    assert r["f_next"] == [101, 102, 103] and r["lab"] == [12, 13, 0] and r["m"] == [1.0, 1.0, 0.0]


def test_counting():
    r = run_snippet(COUNTING)
    assert r["full"] == [[3, 2, 3, 1, 1, 0]]
    assert r["two"] == [[2, 2, 2, 1, 1, 0]]
    # prefill emits x[2]; step 1 starts at t = 1: accepts 2 (x[3], x[4]) + 1 = x[5]; step 2 at t = 4: 1 accepted,
    # capped at the answer's end (x[6]): 4 tokens in 2 steps
    assert r["replay"] == [4, 2]
    assert r["replay_two"] == [4, 2]
    assert r["none"] == [4, 4]  # no draft accepted: one token per step
    assert r["short"] == [0, 0]


CHAINS = r"""
import json
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from experiments.studies.feature_draft_study import draft_chains, draft_layer, head_logits
from models import ModelConfig, init_random_weights
from models.llama import dense_causal_attention
cfg = ModelConfig(model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
params = init_random_weights(cfg, seed=3, scale=0.3)
dcfg = dataclasses.replace(cfg, num_layers=1)
rng = np.random.default_rng(0)
h = cfg.hidden_size
tr = {"fc": jnp.asarray(rng.normal(0, 0.3, (2 * h, h)), jnp.float32), "fc_b": jnp.asarray(rng.normal(0, 0.1, h),
      jnp.float32), "layers": jax.tree_util.tree_map(lambda a: a[-1:], params.layers)}
frozen = params.replace(layers=None)
ids = jnp.asarray(rng.permutation(cfg.vocab_size)[:20], jnp.int32)
head_rows = jnp.asarray(rng.normal(0, 1.0, (h, 20)), jnp.float32)
toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
fts = jnp.asarray(rng.normal(0, 1.0, (2, 9, h)), jnp.float32)
chain = 4
got, got_h = map(np.asarray, draft_chains(tr, frozen, dcfg, head_rows, ids, toks, fts, chain, return_hidden=True))
ref, ref_h = np.zeros_like(got), np.zeros_like(got_h)
for b in range(2):
    for t in range(8):
        feats = [fts[b, s] for s in range(t + 1)]
        nxt = [int(toks[b, s + 1]) for s in range(t + 1)]
        pos = [s + 1 for s in range(t + 1)]
        for j in range(chain):
            out, _ = draft_layer(tr, frozen, dcfg, jnp.stack(feats), jnp.asarray(nxt, jnp.int32),
                                 jnp.asarray(pos, jnp.int32), dense_causal_attention(dcfg, 1, len(feats)))
            d = int(ids[jnp.argmax(head_logits(out[-1:], frozen, dcfg, head_rows), -1)[0]])
            ref[b, t, j], ref_h[b, t, j] = d, out[-1]
            feats.append(out[-1]); nxt.append(d); pos.append(pos[-1] + 1)
print(json.dumps({"got": got.tolist(), "ref": ref.tolist(), "ids": np.asarray(ids).tolist(),
                  "h_err": float(np.abs(got_h - ref_h).max()), "h_size": float(np.abs(ref_h).max())}))
"""


@pytest.mark.slow
def test_chains_match_a_step_by_step_run():
    r = run_snippet(CHAINS)
    assert r["got"] == r["ref"]
    assert r["h_err"] < 1e-4 * r["h_size"]  # the outputs themselves, at every depth (a token may hide an error)
    drafted = {d for row in r["got"] for start in row for d in start}
    assert drafted <= set(r["ids"]) and len(drafted) > 3  # head columns mapped to token ids; not one constant


@pytest.mark.slow
def test_script_end_to_end(model_dir, tmp_path):  # noqa: F811
    pytest.importorskip("torch")
    out = tmp_path / "study.json"
    p = subprocess.run([sys.executable, "-m", "experiments.studies.feature_draft_study", f"--target={model_dir}",
                        "--target_quant=none", "--num_prompts=6", "--gen_tokens=8", "--steps=3", "--batch_size=2",
                        "--seq_len=64", "--head_vocab=24", "--eval_workloads=copy,chat", "--eval_prompts=2",
                        "--eval_tokens=8", "--chain=2", "--price_ks=1,2", "--extra_text_tokens=200",
                        f"--json_out={out}"],
                       capture_output=True, text=True, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["steps_run"] == 3 and len(r["loss_top1"]) == 3 and r["train_examples"] == 6
    assert r["extra_text_tokens"] == 192  # three windows of 64 tokens of the packages' descriptions
    assert r["extra_text_sources"] and all(isinstance(n, str) for n in r["extra_text_sources"])
    assert r["flags"]["extra_text_tokens"] == 200
    assert 0 < r["head_tokens"] <= 24
    for name in ("copy", "chat"):
        ev = r["evaluation"][name]
        assert len(ev["acceptance_by_depth"]) == 2 and all(0 <= a <= 1 for a in ev["acceptance_by_depth"])
        first, second = ev["starts_reaching_depth"]  # each answer token but the last starts a decoding step
        assert first == ev["answer_tokens"] - ev["prompts"] and 0 <= second <= first
        assert set(ev["by_k"]) == {"1", "2"} and all(v["tokens_per_step"] >= 1 for v in ev["by_k"].values())
    for k in ("1", "2"):
        price = r["step_prices"][k]
        assert price["plain_ms"] > 0 and price["verify_ms"] > 0 and r["chain_ms"][k] > 0
        pred = r["predicted_speedup"][k]
        cost = (price["verify_ms"] + r["chain_ms"][k]) / price["plain_ms"]
        assert pred["step_cost_in_plain_steps"] == pytest.approx(cost)
        assert pred["chat"] == pytest.approx(r["evaluation"]["chat"]["by_k"][k]["tokens_per_step"] / cost)
