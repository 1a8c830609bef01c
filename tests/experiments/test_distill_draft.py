"""experiments/distill_draft.py: its data helpers (answer masks, the reduced head's tokens) and the script end to end
on a tiny random Llama, whose draft must load and keep greedy output identical. Subprocesses: the script's absl
flags would clash with the other scripts'."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.experiments.helpers import run_expecting_usage_error
from tests.experiments.test_generate import model_dir  # noqa: F401 (the fixture)


def env() -> dict[str, str]:
    """The scripts' environment, read when a test runs: tests/conftest.py sets how tiny-model tests compile
    (`JAX_DISABLE_MOST_OPTIMIZATIONS`) before each test, after this module is imported (a copy made at import
    compiled every script with the full optimisations)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


HELPERS = r"""
import json
from experiments.lib.common import CHAT
import numpy as np
from experiments.distill_draft import (MORE_TASKS, MORE_TOPICS, TASKS, TOPICS, copy_prompts, head_token_ids,
                                       make_examples, open_prompts, soft_cross_entropy, teacher_columns)
tokens, labels, mask = make_examples([([1, 2, 3], [4, 5]), ([6], [7, 8, 9, 10, 11])], 4)
# the teacher's top-3 at each answer token: token t's row is (t, t + 20, -1) with probabilities (0.5, 0.25, 0)
dist = lambda a: (np.array([[t, t + 20, -1] for t in a]), np.array([[0.5, 0.25, 0.0]] * len(a)))
with_soft = [([1, 2, 3], [4, 5], dist([4, 5])), ([6], [7, 8, 9, 10, 11], dist([7, 8, 9, 10, 11])),
             ([], [4, 5, 6], dist([4, 5, 6]))]  # no prompt: the first label is the second answer token
_, _, mask2, s_ids, s_p = make_examples(with_soft, 4, soft_k=2)
try:
    make_examples([([1], [2])], 4, soft_k=2)
    no_dist = None
except ValueError as e:
    no_dist = str(e)
remap = np.full(40, -1); remap[[4, 5, 24]] = [0, 1, 2]  # a head of tokens 4, 5 and 24
cols, w = teacher_columns(np.array([[4, 24, -1], [5, 25, -1], [7, 27, -1]]), np.array([[0.5, 0.25, 0.0]] * 3),
                          remap)
logq = np.log(np.array([[0.1, 0.2, 0.7]] * 3))
print(json.dumps({
    "soft_ids": s_ids.tolist(), "soft_p": s_p.tolist(), "mask2": mask2.tolist(), "no_dist": no_dist,
    "cols": cols.tolist(), "w": w.tolist(), "sce": np.asarray(soft_cross_entropy(logq, cols, w)).tolist(),
    "tokens": tokens.tolist(), "labels": labels.tolist(), "mask": mask.tolist(),
    "head": head_token_ids([[5, 5, 9, 2], [9, 5, 7]], 3, [42]),
    "head_all": head_token_ids([[5, 5]], 8, [1]),
    "open": open_prompts(5, 0), "open_again": open_prompts(5, 0),
    "base_first": set(open_prompts(480, 0)) == {t.format(x) for t in TASKS for x in TOPICS},
    "prefix": open_prompts(500, 0)[:480] == open_prompts(480, 0),
    "wide": len(set(open_prompts(3000, 0))), "wide_size": len({t.format(x) for t in TASKS + MORE_TASKS
                                                               for x in TOPICS + MORE_TOPICS}),
    "benchmark_prompts": sorted(set(open_prompts(3000, 0)) & set(CHAT)),
    "copy": copy_prompts(["one two three four", "", "five six"], 3, 0, max_words=2),
}))
"""


def test_helpers():
    p = subprocess.run([sys.executable, "-c", HELPERS], capture_output=True, text=True, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # the teacher's distribution at each label: that answer token's row, zero where the label is not an answer
    assert r["mask2"][:2] == r["mask"] and r["mask2"][2] == [1, 1, 0, 0] and r["soft_ids"][2][:2] == [[5, 25], [6, 26]]
    assert r["soft_ids"][0] == [[0, 0], [0, 0], [4, 24], [5, 25]] and r["soft_ids"][1] == [[7, 27], [8, 28], [9, 29],
                                                                                           [10, 30]]
    assert r["soft_p"][0] == [[0, 0], [0, 0], [0.5, 0.25], [0.5, 0.25]] and r["soft_p"][1] == [[0.5, 0.25]] * 4
    assert "top-2" in r["no_dist"]
    # head columns, renormalised over the tokens the head has (token 25 is not in it; none of row 3's is)
    assert r["cols"] == [[0, 2, 0], [1, 0, 0], [0, 0, 0]]
    np.testing.assert_allclose(r["w"], [[2 / 3, 1 / 3, 0], [1, 0, 0], [0, 0, 0]], rtol=1e-6)
    log = __import__("math").log
    want = [-(2 / 3 * log(0.1) + 1 / 3 * log(0.7)), -log(0.2), 0.0]
    assert r["sce"] == pytest.approx(want, abs=1e-5)
    # prompt [1 2 3] + answer [4 5]: the labels at positions 2 and 3 are answer tokens (4, 5)
    assert r["tokens"][0] == [1, 2, 3, 4] and r["labels"][0] == [2, 3, 4, 5] and r["mask"][0] == [0, 0, 1, 1]
    # prompt [6] + answer [7 .. 11] cut to 4 tokens: every label is an answer token
    assert r["tokens"][1] == [6, 7, 8, 9] and r["labels"][1] == [7, 8, 9, 10] and r["mask"][1] == [1, 1, 1, 1]
    assert r["head"] == [5, 9, 42]  # the forced token, then by frequency (5 x3, 9 x2), sorted by id
    assert r["head_all"] == [1, 5]
    assert r["open"] == r["open_again"] and len(set(r["open"])) == 5
    # the first 480 open requests are TASKS x TOPICS as before the wide pool; then every wide request once
    assert r["base_first"] and r["prefix"] and r["wide"] == r["wide_size"] > 2000
    assert r["benchmark_prompts"] == []
    # each request names its source text (the empty one skipped), cut to two words
    assert [src for _, src in r["copy"]] == [0, 2, 0]
    assert all(("one two" in c and "three" not in c) if src == 0 else "five six" in c for c, src in r["copy"])


ANSWERS = r"""
import json, sys, time
from experiments.distill_draft import generate_answers
from models import load_model
target = load_model(sys.argv[1])
prompts = [f"request number {i}: " + "word " * (i % 5) for i in range(21)]
far = time.perf_counter() + 600
print(json.dumps({
    "alone": [generate_answers(target, [prompts[i]], 6, 0.0, 0, far, "one")[0] for i in (0, 1, 2, 16, 20)],
    "batched": generate_answers(target, prompts, 6, 0.0, 0, far, "continuous", batch=2),
    "late": generate_answers(target, prompts, 6, 0.0, 0, time.perf_counter() - 1, "past the deadline"),
    "soft": [(q, a, d[0].tolist(), d[1].tolist())
             for q, a, d in generate_answers(target, prompts[:3], 6, 0.0, 0, far, "with top-4", batch=2, top_k=4)],
}))
"""


@pytest.mark.slow
def test_answers_come_back_in_prompt_order_with_continuous_batching(model_dir):  # noqa: F811
    """generate_answers keeps up to `batch` jobs running over chunks of 8 x batch prompts: each answer is its own
    prompt's (the same as generated alone), in order, across chunk boundaries (21 prompts, chunks of 16)."""
    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", ANSWERS, str(model_dir)], capture_output=True, text=True, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(r["batched"]) == 21 and [r["batched"][i] for i in (0, 1, 2, 16, 20)] == r["alone"]
    assert all(len(a) >= 1 for _, a in r["batched"]) and len({tuple(q) for q, _ in r["batched"]}) == 21
    assert r["late"] == []
    # with the target's top-4 at each answer token: the same answers, and greedy text is each row's first token
    assert [(q, a) for q, a, _, _ in r["soft"]] == [tuple(x) for x in r["batched"][:3]]
    for _, a, ids, probs in r["soft"]:
        assert len(ids) == len(probs) == len(a) and all(len(row) == 4 for row in ids + probs)
        assert [row[0] for row in ids] == a
        assert all(row == sorted(row, reverse=True) and 0 < sum(row) <= 1 + 1e-5 for row in probs)


@pytest.mark.parametrize("loss", ["topk", "ce"])
@pytest.mark.slow
def test_script_end_to_end(model_dir, tmp_path, loss):  # noqa: F811
    pytest.importorskip("torch")
    out = tmp_path / "draft"
    p = subprocess.run([sys.executable, "-m", "experiments.distill_draft", f"--target={model_dir}", f"--out={out}",
                        "--num_prompts=6", "--gen_tokens=8", "--steps=4", "--batch_size=2", "--seq_len=48",
                        "--layers=1", "--head_vocab=24", "--max_minutes=8", "--eval_workloads=copy",
                        "--eval_prompts=2", "--eval_tokens=6", f"--loss={loss}", "--topk=8"],
                       capture_output=True, text=True, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    log = json.loads((out / "distill_log.json").read_text())
    assert log["flags"]["loss"] == loss and log["flags"]["topk"] == 8
    assert log["steps_run"] == 4 and len(log["loss_top1"]) == 4
    assert log["train_examples"] + log["heldout_examples"] == 6 and log["heldout_examples"] >= 1
    assert 0 < log["head_coverage"] <= 1 and 0 <= log["heldout_top1"] <= 1
    assert list(log["workload_top1"]) == ["copy"] and 0 <= log["workload_top1"]["copy"] <= 1
    check = r"""
import json, sys
import numpy as np
from models import load_model
from paged import DynamicGenerator, SamplingSettings
target = load_model(sys.argv[1]); draft = load_model(sys.argv[2], load_tokenizer=False, quant="int8")
kw = dict(max_batch_size=2, max_seq_len=64, page_size=8, max_chunk_size=16)
prompts = ["hello there", "the cat sat on"]
a = DynamicGenerator(target, **kw).generate(prompts, 10, gen_settings=SamplingSettings.greedy())
g = DynamicGenerator(target, **kw, draft_model=draft, num_draft_tokens=2)
b = g.generate(prompts, 10, gen_settings=SamplingSettings.greedy())
ids = np.asarray(draft.params.head_ids).tolist()
print(json.dumps({"same": a == b, "drafted": g.metrics()["drafted_tokens"], "ids": ids,
                  "layers": draft.config.num_layers, "eos": target.tokenizer.eos_token_id}))
"""
    p = subprocess.run([sys.executable, "-c", check, str(model_dir), str(out)], capture_output=True, text=True,
                       env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["same"] and r["drafted"] > 0 and r["layers"] == 1
    assert 0 < len(r["ids"]) <= 24 and r["eos"] in r["ids"] and r["ids"] == sorted(set(r["ids"]))


@pytest.fixture(scope="module")
def layers2_target(tmp_path_factory):
    """A random 2-layer Llama without a tokenizer (experiments.lib.common's "tiny"), saved as an HF folder."""
    from experiments.lib.common import load_experiment_model
    from models.draft import save_hf_llama

    d = tmp_path_factory.mktemp("tiny_target")
    m = load_experiment_model("tiny")
    save_hf_llama(m.params, m.config, str(d))
    return d


@pytest.mark.parametrize("bad, message", [
    ("--eval_workloads=copy,bogus", "--eval_workloads: unknown ['bogus']; each one of copy, chat"),
    ("--gen_batch=0", "--gen_batch must be >= 1, got 0"),
    ("--layers=3", "--layers=3: the target has 2 layers"),  # checked once the target has loaded, before it generates
])
def test_a_bad_flag_is_a_usage_error_before_any_work(layers2_target, tmp_path, bad, message):
    """A bad value stops the script with absl's usage message naming the flag, not a traceback minutes into the
    generation (the target here has no tokenizer: a check that let a bad value through stops there instead)."""
    p = run_expecting_usage_error("experiments.distill_draft", f"--target={layers2_target}",
                                  f"--out={tmp_path / 'draft'}", bad)
    assert message in p.stderr, p.stderr[-2000:]
