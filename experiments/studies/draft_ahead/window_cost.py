"""A draft burst's wall time with and without its two-slot window (every row with a catch-up token) at 1 / 4 / 16
rows: `PYTHONPATH=. python experiments/studies/draft_ahead/window_cost.py [k]` (the top-32 draft at
/tmp/draft-topk, int4; median of 20 bursts after 5, each waited for). Output of the run at 9d7a73b in
window_cost.txt."""

import sys
import time

import numpy as np

from models import load_model
from paged.device.batch import RowInput
from paged.device.config import Drafting
from paged.device.engine import Engine

draft = load_model("/tmp/draft-topk", load_tokenizer=False, quant="int4")
k = int(sys.argv[1]) if len(sys.argv) > 1 else 1
for rows in (1, 4, 16):
    eng = Engine(draft, num_pages=16 * 8 + 1, page_size=64, max_batch_size=16, max_seq_len=512, drafting=Drafting(k))
    batch = [RowInput(tokens=[100 + i], start_pos=200, pages=list(range(1 + 8 * i, 9 + 8 * i))) for i in range(rows)]
    ms = {}
    for name, catch_up in (("plain", [-1] * rows), ("window", [5] * rows)):
        ts = []
        for _ in range(25):
            t = time.perf_counter()
            eng.draft(batch, list(range(rows)), rows, catch_up, host=True)
            ts.append(time.perf_counter() - t)
        ms[name] = np.median(ts[5:]) * 1e3
    print(f"S={rows} k={k} plain {ms['plain']:.2f} ms window {ms['window']:.2f} ms", flush=True)
