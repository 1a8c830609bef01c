"""Wall time of each iterate() at batch 1 on the copy prompts, by kind (prefill, plain, verification): none, prompt
lookup (fixed, k = 4) or prompt lookup with the corpus table at /tmp/s26/smollm2-corpus.npz."""

import sys
import time

import numpy as np

from experiments.lib.common import chat_prompt, workload
from models import load_model
from paged import DynamicGenerator, Job, SamplingSettings
from paged.speculation.ngram_corpus import NgramCorpus

m = load_model("smollm2-135m", quant="keep")
tok = m.tokenizer
mode = sys.argv[1]
kw = {} if mode == "none" else dict(use_ngram_draft=True, num_draft_tokens=4)
if mode == "corpus":
    kw["ngram_corpus"] = NgramCorpus.load("/tmp/s26/smollm2-corpus.npz")
gen = DynamicGenerator(m, max_batch_size=16, max_seq_len=1024, **kw)
gen.warmup()
for rnd in range(2):
    times = {"verify": [], "plain": [], "prefill": []}
    for text in workload("copy", 16, 0):
        job = Job(tok.encode(chat_prompt(tok, text), encode_special_tokens=True), 96,
                  gen_settings=SamplingSettings.greedy(), stop_conditions=[tok.eos_token_id])
        gen.enqueue(job)
        first = True
        while gen.num_remaining_jobs():
            v0 = gen.metrics()["verification_rows"]
            t = time.perf_counter()
            list(gen.iterate())
            dt = time.perf_counter() - t
            kind = "prefill" if first else ("verify" if gen.metrics()["verification_rows"] > v0 else "plain")
            first = False
            times[kind].append(dt * 1000)
    print(mode, rnd, {k: (len(v), round(float(np.median(v)), 2), round(float(np.mean(v)), 2))
                      for k, v in times.items() if v})
