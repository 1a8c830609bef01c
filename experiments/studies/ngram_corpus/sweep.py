"""The corpus table's settings, swept offline (docs/notes/speculative-journal.md, "A corpus table for the n-gram
drafter (2026-11-29, AMD EPYC host)").

Reads the corpus that gen_corpus.py writes (the model's greedy answers to build_ngram_corpus's default prompt set)
and the benchmark outputs that gen_workloads.py writes (16 copy and 16 chat prompts, 96 tokens), then replays the
n-gram drafter with the adaptive gate (`paged.speculation.ngram.replay`, policy "gate") for each setting: min_count (the
table's pruning), CORPUS_BELOW (prompt-lookup matches shorter than this give way to the table) and min_confidence
(the chain's cut). Prints tokens per step and the speed-up predicted at this host's verification prices.

    PYTHONPATH=. python experiments/studies/ngram_corpus/gen_corpus.py 2000
    PYTHONPATH=. python experiments/studies/ngram_corpus/gen_workloads.py
    PYTHONPATH=. python experiments/studies/ngram_corpus/sweep.py
"""

import pickle

import paged.speculation.ngram_corpus as nc
from paged.speculation.draft_gate import DraftGate
from paged.speculation.ngram import Replay, replay

PRICE = {2: 1.343, 4: 1.529}  # a verification of k + 1 tokens in plain steps (ngram_bound --price on this host)
pairs = pickle.load(open("/tmp/s26/corpus.pkl", "rb"))
outputs = pickle.load(open("/tmp/s26/workloads.pkl", "rb"))
sequences = [list(p[-6:]) + list(a) for p, a in pairs]
for k in (2, 4):
    for wl in ("copy", "chat"):
        gate, total = DraftGate(k, 0.12), Replay()
        for p, o in outputs[wl]:
            total = total.add(replay(p, o, k, 4, 96, "gate", 1, gate))
        print(f"k={k} {wl} prompt lookup alone: tokens/step {total.tokens / total.steps:.2f} "
              f"predicted {total.speedup(PRICE[k]):.2f}x")
for min_count in (1, 2, 3):
    table = nc.NgramCorpus.build(sequences, 49152, min_count=min_count)
    for below in (1, 2):
        nc.CORPUS_BELOW = below
        for conf in (0.0, 0.3, 0.6):
            table.min_confidence = conf
            for k in (2, 4):
                for wl in ("copy", "chat"):
                    gate, total = DraftGate(k, 0.12), Replay()
                    for p, o in outputs[wl]:
                        total = total.add(replay(p, o, k, 4, 96, "gate", 1, gate, table))
                    print(f"min_count={min_count} below={below} min_confidence={conf} k={k} {wl}: tokens/step "
                          f"{total.tokens / total.steps:.2f} predicted {total.speedup(PRICE[k]):.2f}x")
