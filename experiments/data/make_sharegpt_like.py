"""Generate `sharegpt_like_lengths.json`: synthetic (input tokens, output tokens) pairs shaped like ShareGPT chat
requests, for `experiments/bench_serving.py --dataset sharegpt`. No ShareGPT text is used or shipped.

    python experiments/data/make_sharegpt_like.py            # rewrites the file (deterministic: seed 0)

Distribution (independent log-normals, then vLLM-style filtering of the pairs):
- input  ~ LogNormal(mu=ln 110, sigma=1.2): median 110 tokens, long right tail (pasted code / documents);
- output ~ LogNormal(mu=ln 170, sigma=0.90): median 170 tokens, fewer very short answers than prompts;
- pairs with input < 4 or output < 4, input > 1024 or input + output > 2048 are redrawn (the filter vLLM's
  `benchmark_serving` applies when it samples ShareGPT).

The parameters were chosen so the filtered means land near what is publicly reported for ShareGPT-based serving
benchmarks: the vLLM paper (Kwon et al., SOSP 2023) gives mean ShareGPT prompt / output lengths of ~161 / ~338
tokens, and vLLM's filtered first-turn sampling with Llama-family tokenizers gives means of roughly 200-230 input and
~200 output tokens per request. These are approximate shapes, not a fit to the real data: use the file to exercise
the scheduler with realistic length variance, not to quote ShareGPT numbers.

Result (seed 0, 1000 pairs; also stored under "stats" in the file): input mean 177, median 102, p90 444, p99 910;
output mean 240, median 166, p90 534, p99 1213 tokens.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

SEED = 0
NUM_PAIRS = 1000
INPUT_MEDIAN, INPUT_SIGMA = 110.0, 1.2
OUTPUT_MEDIAN, OUTPUT_SIGMA = 170.0, 0.90
MIN_LEN, MAX_INPUT, MAX_TOTAL = 4, 1024, 2048
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharegpt_like_lengths.json")


def make_pairs(n: int = NUM_PAIRS, seed: int = SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    pairs: list[list[int]] = []
    while len(pairs) < n:
        i = int(round(rng.lognormal(math.log(INPUT_MEDIAN), INPUT_SIGMA)))
        o = int(round(rng.lognormal(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA)))
        if i < MIN_LEN or o < MIN_LEN or i > MAX_INPUT or i + o > MAX_TOTAL:
            continue
        pairs.append([i, o])
    return pairs


def stats(xs: list[int]) -> dict:
    a = np.asarray(xs)
    return {"mean": round(float(a.mean()), 1), "median": round(float(np.median(a)), 1),
            "p90": round(float(np.percentile(a, 90)), 1), "p99": round(float(np.percentile(a, 99)), 1),
            "min": int(a.min()), "max": int(a.max())}


def main() -> None:
    pairs = make_pairs()
    doc = {
        "description": "Synthetic ShareGPT-like (input_tokens, output_tokens) pairs; see make_sharegpt_like.py. "
                       "No real ShareGPT data.",
        "generator": "experiments/data/make_sharegpt_like.py",
        "seed": SEED,
        "distribution": {
            "input": {"kind": "lognormal", "median": INPUT_MEDIAN, "sigma": INPUT_SIGMA},
            "output": {"kind": "lognormal", "median": OUTPUT_MEDIAN, "sigma": OUTPUT_SIGMA},
            "filter": {"min_len": MIN_LEN, "max_input": MAX_INPUT, "max_total": MAX_TOTAL},
        },
        "stats": {"input": stats([p[0] for p in pairs]), "output": stats([p[1] for p in pairs])},
        "pairs": pairs,
    }
    with open(PATH, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(pairs)} pairs to {PATH}")
    print(json.dumps(doc["stats"]))


if __name__ == "__main__":
    main()
