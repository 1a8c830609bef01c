"""What prompt lookup (n-gram drafting) can gain on a workload at most: replay the n-gram drafter over the model's own
greedy outputs, with no engine in the loop.

Speculative decoding's speed-up is (tokens per step) / (a step's cost relative to a plain decode step). This script
measures the first factor exactly and prices the second with a model: it generates each prompt's greedy output with
the plain generator (the same seeded prompts as `experiments.bench_speculative`), then replays the generator's
drafting over it step by step: the prefill step emits the first token; every later step proposes up to
min(k, max_new_tokens - new_tokens - 1) tokens from `paged.ngram.NgramIndex` over prompt + output so far (a step
with no match is a plain decode step), accepts the longest prefix that the output continues with, and emits it plus
one token. Greedy verification accepts exactly that prefix, so these are the steps a fixed n-gram drafter takes on
that output (with the native CPU kernel, greedy outputs under speculation can differ at near-ties: see
docs/speculative.md, "Limits").

Reported per workload and k: steps, verification steps, tokens per step (the speed-up if verification cost nothing
and prefill as much as a decode step), tokens per verification, and the predicted speed-up when a verification step
costs c plain steps, for each c of `--verify_costs` (`experiments.bench_speculative` and docs/speculative.md measure
c: 1.7 on the 2-core CPU at k = 4, 1.09 on an H200).

    python -m experiments.ngram_bound --json_out experiments/results/ngram_bound_cpu.json
"""

from __future__ import annotations

import dataclasses

from absl import app, flags

from experiments.common import chat_prompt, workload, write_record
from paged.ngram import Replay, replay

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "the embedded name, an HF dir or a .gguf")
flags.DEFINE_string("quant", "keep", "weights: keep (GGUF blocks as stored), none (dequantized), int8, int4")
flags.DEFINE_list("workloads", ["copy", "chat"], "seeded workloads of experiments.bench_speculative")
flags.DEFINE_integer("num_prompts", 16, "prompts per workload")
flags.DEFINE_integer("max_new_tokens", 96, "tokens per job")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_list("num_draft_tokens", ["4", "8", "16"], "k values to replay")
flags.DEFINE_integer("max_ngram", 4, "longest suffix matched")
flags.DEFINE_list("verify_costs", ["1.0", "1.25", "1.5"], "a verification step's cost in plain steps, for the "
                  "predicted speed-up")
flags.DEFINE_string("json_out", None, "write the record here")


def main(argv):
    del argv
    import numpy as np

    from experiments.serving.env import device_info, git_info, versions
    from models import load_model
    from paged import DynamicGenerator, Job, SamplingSettings

    model = load_model(FLAGS.model, quant=None if FLAGS.quant == "none" else FLAGS.quant)
    tok = model.tokenizer
    gen = DynamicGenerator(model, max_batch_size=1, max_seq_len=min(1024, model.config.max_position_embeddings))
    ks = [int(k) for k in FLAGS.num_draft_tokens]
    costs = [float(c) for c in FLAGS.verify_costs]
    record = {"flags": {k: getattr(FLAGS, k) for k in ("model", "quant", "workloads", "num_prompts", "max_new_tokens",
                                                        "seed", "num_draft_tokens", "max_ngram", "verify_costs")},
              "git": git_info(), "device": device_info(), "versions": versions(), "runs": []}
    stop = [tok.eos_token_id] if getattr(tok, "eos_token_id", None) is not None else None
    for wl in FLAGS.workloads:
        outputs = []
        for text in workload(wl, FLAGS.num_prompts, FLAGS.seed):
            ids = [int(t) for t in np.asarray(tok.encode(chat_prompt(tok, text), encode_special_tokens=True)).ravel()]
            job = Job(ids, FLAGS.max_new_tokens, gen_settings=SamplingSettings.greedy(), stop_conditions=stop)
            gen.enqueue(job)
            while gen.num_remaining_jobs():
                list(gen.iterate())
            outputs.append((ids, [int(t) for t in np.asarray(job.sequence[len(ids):]).ravel()]))
        for k in ks:
            per = [replay(p, o, k, FLAGS.max_ngram, FLAGS.max_new_tokens) for p, o in outputs]
            total = Replay()
            for r in per:
                total = total.add(r)
            run = {"workload": wl, "num_draft_tokens": k, **dataclasses.asdict(total),
                   "tokens_per_step": total.tokens / total.steps,
                   "tokens_per_verification": 1 + total.accepted / total.verifications if total.verifications else None,
                   "acceptance_rate": total.accepted / total.drafted if total.drafted else None,
                   "predicted_speedup": {str(c): total.speedup(c) for c in costs},
                   "per_prompt_tokens_per_step": [r.tokens / r.steps if r.steps else None for r in per]}
            record["runs"].append(run)
            pred = "  ".join(f"c={c:g}: {total.speedup(c):.2f}x" for c in costs)
            tpv = run["tokens_per_verification"]
            print(f"{wl:>5} k={k:<3} tokens {total.tokens} steps {total.steps} verifications {total.verifications}  "
                  f"tokens/step {run['tokens_per_step']:.2f}  tokens/verification "
                  f"{'-' if tpv is None else f'{tpv:.2f}'}  predicted {pred}", flush=True)
    write_record(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
