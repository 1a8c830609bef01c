"""How well a draft model's confidence in its proposal predicts its acceptance (k = 1, batch 1, greedy).

Run from the repository root: `PYTHONPATH=. python experiments/studies/draft_confidence/draft_confidence.py`
(the top-32 draft at /tmp/draft-topk: `python -m experiments.distill_draft --out=/tmp/draft-topk`). It wraps
`DraftModel.propose` (reads each burst's distributions back: the run is slower than the generator's, the tokens
the same) and `DraftModel.accepted`, prints acceptance by the draft's probability of its own proposal on the 16
copy and 16 chat prompts of `bench_speculative`, and writes each verification's (probability of the proposal,
log-probability of the runner-up, the proposal, the draft's argmax, accepted drafts) to draft_confidence.json."""

import json

import numpy as np

from experiments.lib.common import chat_prompt, workload
from models import load_model
from paged import DynamicGenerator, Job, SamplingSettings
from paged.speculation.draft import DraftModel

OUT = "experiments/results/draft_confidence/draft_confidence.json"
BINS = ((0, .2), (.2, .4), (.4, .6), (.6, .8), (.8, .95), (.95, 1.01))

target = load_model("smollm2-135m", quant="keep")
draft = load_model("/tmp/draft-topk", load_tokenizer=False, quant="int4")
tok = target.tokenizer
log = []  # one entry per verified row
pending = []  # per burst: its rows' confidences, until the step's acceptance comes in
orig_propose, orig_accepted = DraftModel.propose, DraftModel.accepted


def propose(self, target_, specs, want, host=True):
    out = orig_propose(self, target_, specs, want, host)
    if out[1] is not None:
        qn = np.asarray(out[1])[: len(specs), 0]  # [S, V] log-probs at the first draft position
        dev = np.asarray(out[3])
        pending.append([(float(np.exp(qn[j].max())), float(np.sort(qn[j])[-2]), int(dev[j, 0]),
                         int(np.argmax(qn[j]))) for j in range(len(specs))])
    return out


def accepted(self, spec, item, num_drafts):
    if num_drafts and pending:
        row = pending[0].pop(0)
        if not pending[0]:
            pending.pop(0)
        log.append((*row, int(item.num_accepted)))
    return orig_accepted(self, spec, item, num_drafts)


DraftModel.propose, DraftModel.accepted = propose, accepted
gen = DynamicGenerator(target, draft_model=draft, num_draft_tokens=1, max_batch_size=1, max_seq_len=1024)
for wl in ("copy", "chat"):
    start = len(log)
    for p in workload(wl, 16, 0):
        ids = tok.encode(chat_prompt(tok, p), encode_special_tokens=True)
        gen.enqueue(Job(ids, 96, gen_settings=SamplingSettings.greedy(), stop_conditions=[tok.eos_token_id]))
        while gen.num_remaining_jobs():
            gen.iterate()
    a = np.array([r[-1] for r in log[start:]])
    c = np.array([r[0] for r in log[start:]])
    print(wl, len(a), "acceptance", a.mean())
    for lo, hi in BINS:
        m = (c >= lo) & (c < hi)
        print(f"  confidence [{lo}, {hi}): n={m.sum():4d} share={m.mean():.2f} "
              f"acceptance={a[m].mean() if m.any() else float('nan'):.2f}")
with open(OUT, "w") as f:
    json.dump(log, f)
