"""Which of the target's greedy output tokens the distilled draft can propose at all: its reduced LM head covers the
8192 tokens the target used most in the training text (`distill_draft --head_vocab`), and a token outside it gets a
-inf logit in the draft. `PYTHONPATH=. python experiments/studies/draft_confidence/head_coverage.py` (the top-32
draft at /tmp/draft-topk); output of the run at 8eb0fdc in head_coverage.txt."""

import numpy as np
from safetensors.numpy import load_file

from experiments.lib.common import chat_prompt, workload
from models import load_model
from paged import DynamicGenerator, Job, SamplingSettings

head = set(load_file("/tmp/draft-topk/model.safetensors")["lm_head.token_ids"].tolist())
target = load_model("smollm2-135m", quant="keep")
tok = target.tokenizer
gen = DynamicGenerator(target, max_batch_size=16, max_seq_len=1024)
for wl in ("copy", "chat"):
    prompts = workload(wl, 16, 0)
    jobs = [Job(tok.encode(chat_prompt(tok, p), encode_special_tokens=True), 96,
                gen_settings=SamplingSettings.greedy(), stop_conditions=[tok.eos_token_id]) for p in prompts]
    for job in jobs:
        gen.enqueue(job)
    while gen.num_remaining_jobs():
        gen.iterate()
    outs = [job.sequence[len(job.input_ids):] for job in jobs]
    tokens = [t for out in outs for t in out]
    print(wl, len(tokens), f"tokens, in the draft's head: {np.mean([t in head for t in tokens]):.3f}")
    if wl == "copy":
        for p, out in zip(prompts, outs):
            missing = [tok.decode([t]) for t in out if t not in head]
            print(f"  {p[:40]!r}: {len(out)} tokens, {len(missing)} outside the head {missing[:8]}")
