"""Two ways the distilled draft could propose better, measured offline before building either: how often the
target's greedy token is among the draft's top 1 / 2 / 3 / 4 (what a tree of that many candidates at one position
would accept), and how often the draft's argmax is the target's token when its reduced head is widened with the
target's own head rows (for every token, or only for the prompt's tokens: the rare words a copy quotes).

The draft runs teacher-forced over each prompt + the target's greedy answer (96 tokens, the benchmark's 16 copy
and 16 chat prompts), float32 weights. `PYTHONPATH=. python experiments/studies/draft_confidence/draft_alternatives.py`
(the top-32 draft at /tmp/draft-topk); record in draft_alternatives.json."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.distill_draft import generate_answers
from experiments.lib.common import workload
from models import load_model
from models.llama import hidden_states, rms_norm

speaker = load_model("smollm2-135m", quant="keep")  # the target as the benchmark runs it
target = load_model("smollm2-135m")  # float: its head rows (tied to the input embedding)
draft = load_model("/tmp/draft-topk", load_tokenizer=False)
P, cfg = draft.params, draft.config
ids = np.asarray(P.head_ids)
w_draft = np.asarray(P.lm_head)
w_draft = w_draft if w_draft.shape[0] == len(ids) else w_draft.T  # [N, H]
w_target = np.asarray(target.params.lm_head if target.params.lm_head is not None else target.params.embed)
w_target = w_target if w_target.shape[0] == target.config.vocab_size else w_target.T  # [V, H]
final_hidden = jax.jit(lambda toks: rms_norm(hidden_states(P, cfg, toks), P.final_norm, cfg.rms_norm_eps))

record = {"draft": "/tmp/draft-topk (top-32 distilled, 4 layers, 8192-token head), float32", "workloads": {}}
for name in ("copy", "chat"):
    answers = generate_answers(speaker, workload(name, 16, 0), 96, 0.0, 0, float("inf"), name)
    top = np.zeros(4)
    argmax = {"reduced_head": 0, "reduced_plus_prompt_rows": 0, "reduced_plus_all_target_rows": 0}
    n = 0
    for item in answers:
        prompt, answer = item[0], item[1]
        toks = jnp.asarray(np.asarray(prompt + answer, np.int32)[None])
        h = np.asarray(final_hidden(toks)).reshape(-1, cfg.hidden_size)
        reduced = np.full((h.shape[0], w_target.shape[0]), -np.inf, np.float32)
        reduced[:, ids] = h @ w_draft.T
        widened = h @ w_target.T
        widened[:, ids] = reduced[:, ids]
        prompt_rows = reduced.copy()
        extra = np.setdiff1d(np.unique(prompt), ids)
        prompt_rows[:, extra] = widened[:, extra]
        order = np.argsort(-reduced, axis=-1)[:, :4]
        for j, want in enumerate(answer):
            pos = len(prompt) + j - 1  # the hidden state that predicts answer[j]
            rank = np.flatnonzero(order[pos] == want)
            if rank.size:
                top[rank[0]:] += 1
            argmax["reduced_head"] += int(reduced[pos].argmax() == want)
            argmax["reduced_plus_prompt_rows"] += int(prompt_rows[pos].argmax() == want)
            argmax["reduced_plus_all_target_rows"] += int(widened[pos].argmax() == want)
            n += 1
    record["workloads"][name] = {"tokens": n, "top_k_coverage": {str(k + 1): round(top[k] / n, 4) for k in range(4)},
                                 "argmax_agreement": {k: round(v / n, 4) for k, v in argmax.items()}}
    print(name, json.dumps(record["workloads"][name]))
with open("experiments/results/draft_confidence/draft_alternatives.json", "w") as fh:
    json.dump(record, fh, indent=2)
