"""The model's greedy outputs on the speculative benchmark's prompts (16 copy and 16 chat, 96 tokens), pickled for
sweep.py (the outputs experiments.ngram_bound replays)."""

import pickle

import numpy as np

from experiments.lib.common import chat_prompt, workload
from models import load_model
from paged import DynamicGenerator, Job, SamplingSettings

model = load_model("smollm2-135m", quant="keep")
tok = model.tokenizer
gen = DynamicGenerator(model, max_batch_size=1, max_seq_len=1024)
out = {}
for wl in ("copy", "chat"):
    out[wl] = []
    for text in workload(wl, 16, 0):
        ids = [int(t) for t in np.asarray(tok.encode(chat_prompt(tok, text), encode_special_tokens=True)).ravel()]
        job = Job(ids, 96, gen_settings=SamplingSettings.greedy(), stop_conditions=[tok.eos_token_id])
        gen.enqueue(job)
        while gen.num_remaining_jobs():
            list(gen.iterate())
        out[wl].append((ids, [int(t) for t in np.asarray(job.sequence[len(ids):]).ravel()]))
with open("/tmp/s26/workloads.pkl", "wb") as fh:
    pickle.dump(out, fh)
print({k: sum(len(o) for _, o in v) for k, v in out.items()})
