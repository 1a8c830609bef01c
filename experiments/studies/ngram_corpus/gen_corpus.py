"""The model's greedy answers to build_ngram_corpus's default prompt set (2000 open + 2000 copy requests, 128 tokens),
pickled for sweep.py: the answers that experiments.build_ngram_corpus puts in its table."""

import pickle
import sys
import time

from experiments.lib.answers import copy_prompts, generate_answers, open_prompts
from models import load_model

n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
model = load_model("smollm2-135m", quant="keep")
tok = model.tokenizer
t0 = time.perf_counter()
pairs = generate_answers(model, open_prompts(n, 0), 128, 0.0, 0, time.perf_counter() + 1e9, "open", 32)
texts = [tok.decode(a, decode_special_tokens=False) for _, a in pairs]
copies = copy_prompts(texts, n, 0)
pairs += generate_answers(model, [c for c, _ in copies], 128, 0.0, 1, time.perf_counter() + 1e9, "copy", 32)
print("answers", len(pairs), "tokens", sum(len(a) for _, a in pairs), "s", time.perf_counter() - t0)
with open("/tmp/s26/corpus.pkl", "wb") as fh:
    pickle.dump(pairs, fh)
