"""What prompt lookup (n-gram drafting) can gain on a workload at most: replay the n-gram drafter over the model's own
greedy outputs, with no engine in the loop.

Speculative decoding's speed-up is (tokens per step) / (a step's cost relative to a plain decode step). This script
measures the first factor exactly and prices the second with a model: it generates each prompt's greedy output with
the plain generator (the same seeded prompts as `experiments.bench_speculative`), then replays the generator's
drafting over it step by step: the prefill step emits the first token; every later step proposes up to
min(k, max_new_tokens - new_tokens - 1) tokens from `paged.speculation.ngram.NgramIndex` over prompt + output so far (a
step with no match is a plain decode step), accepts the longest prefix that the output continues with, and emits it plus
one token. Greedy verification accepts exactly that prefix, so these are the steps a fixed n-gram drafter takes on
that output (greedy outputs under speculation are plain decoding's, bit for bit on the native CPU kernels since
2026-11-28; with float matmuls up to near-ties: docs/speculative.md, "Limits").

Reported per workload, k and policy: steps, verification steps, tokens per step (the speed-up if verification cost
nothing and prefill as much as a decode step), tokens per verification, and the predicted speed-up when a
verification step costs c plain steps, for each c of `--verify_costs` (`experiments.bench_speculative` and
docs/speculative.md measure c: 1.53 on the 2-core CPU at k = 4, 1.09 on an H200, its "Current figures").

How many of its drafts a step verifies (`--policies`, `paged.speculation.ngram.replay`): "all" (the generator's fixed
drafter),
"grow" (per job, 1 at first, doubled after a full acceptance, accepted + 1 after a rejection), "gate" (all or none,
as the generator's `adaptive_draft=True` decides: `paged.speculation.draft_gate.DraftGate` with `--gate_rho`) and
"oracle"
(exactly the drafts that will be accepted: no policy with this drafter does better); `--min_match` leaves matches
shorter than that unverified. Each run is also priced with a cost per verification width W (a row of W - 1 drafts):
`--price` times a plain and a verification step at batch 1 in the generator for every width of `--widths` and every
k + 1 (`experiments.lib.common.price_steps`); without it, c(W) = A + B (W - 1) from `--cost_model`. Two predictions:
`predicted_speedup_fixed_width`, every verification at width k + 1 (the generator as built: one verification width),
and `predicted_speedup_widths`, each at the narrowest of `--widths` below k + 1, or k + 1, that holds its drafts (an
engine with a verification bucket per width, which the generator does not have). `--ngram_corpus` replays the
drafter with a corpus table (`paged.speculation.ngram_corpus`), as a generator given `ngram_corpus=` drafts.

    python -m experiments.ngram_bound --json_out experiments/results/ngram_bound_cpu.json
    python -m experiments.ngram_bound --workloads copy --num_draft_tokens 4,8,16 --policies all,grow,oracle \
        --price --json_out experiments/results/ngram_policies_cpu.json
"""

from __future__ import annotations

import dataclasses

from absl import app, flags

from experiments.lib.common import chat_prompt, check_out_flag, price_steps, workload, write_record
from paged.speculation.ngram import REPLAY_POLICIES, Replay, replay


def width_costs(widths, prices: dict | None, model: tuple[float, float]) -> dict[int, float]:
    """A verification of width W in plain steps, for each W of `widths`: measured (`prices`, `price_steps`'s answer
    keyed by k = W - 1) where given, else A + B (W - 1) with (A, B) = `model`."""
    if prices:
        missing = [w for w in widths if not (prices[w - 1]["verify_ms"] and prices[w - 1]["plain_ms"])]
        if missing:
            raise app.UsageError(f"--price: no verification or no plain step was timed at widths {missing} (the "
                                 "pricing prompts drafted nothing there); use more --max_new_tokens")
        return {w: prices[w - 1]["verify_ms"] / prices[w - 1]["plain_ms"] for w in widths}
    return {w: model[0] + model[1] * (w - 1) for w in widths}


def smallest_width(costs: dict[int, float], m: int) -> float:
    """The cost of the narrowest width in `costs` that holds m drafts."""
    return costs[min(w for w in costs if w >= m + 1)]

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
flags.DEFINE_list("policies", ["all"], "how many proposed drafts a step verifies: all, grow, gate, oracle "
                  "(paged.speculation.ngram.replay)")
flags.DEFINE_integer("min_match", 1, "a suffix match shorter than this is not verified")
flags.DEFINE_float("gate_rho", None, "--policies gate: the DraftGate's step-cost constant rho (None: the backend's, "
                   "as adaptive_draft=True)")
flags.DEFINE_list("widths", ["2", "3", "5", "9", "17"], "verification widths (drafts + 1) of the variable-width "
                  "prediction")
flags.DEFINE_bool("price", False, "time plain and verification steps in the generator for every width (and k + 1)")
flags.DEFINE_list("cost_model", ["1.12", "0.12"], "A, B: without --price, a verification of width W costs "
                  "A + B (W - 1) plain steps")
flags.DEFINE_string("ngram_corpus", None, "a saved paged.speculation.ngram_corpus.NgramCorpus "
                    "(experiments/build_ngram_corpus.py) that drafts where prompt lookup's match is shorter than 2 "
                    "tokens, as the generator's ngram_corpus=")
flags.DEFINE_string("json_out", None, "write the record here")
check_out_flag("json_out")


def number_list(name: str, kind: type, lo: float, strict: bool = False) -> list:
    """The comma-separated `--name` as `kind` values, each >= lo (> lo with `strict`); app.UsageError naming the
    flag for an empty list or a bad item."""
    values = getattr(FLAGS, name)
    bound = f"{'>' if strict else '>='} {lo:g}"
    try:
        out = [kind(v) for v in values]
    except ValueError:
        out = []
    if not out or any(not (v > lo if strict else v >= lo) for v in out):  # (not: a NaN is no number here)
        raise app.UsageError(f"--{name}={','.join(values)}: give {kind.__name__} values {bound}, comma-separated")
    return out


def check_flags() -> tuple[list[int], list[float], list[int], tuple[float, float]]:
    """(k values, verification costs, widths, cost model (A, B)) from the flags; app.UsageError naming the flag for a
    bad value: before the model loads."""
    import math
    import os

    from experiments.lib.common import WORKLOADS, check_chat_model_flags

    check_chat_model_flags("the workloads are chat prompts")
    bad = [w for w in FLAGS.workloads if w not in WORKLOADS]
    if bad or not FLAGS.workloads:
        raise app.UsageError(f"--workloads: unknown {bad}; give some of {', '.join(WORKLOADS)}")
    bad = [p for p in FLAGS.policies if p not in REPLAY_POLICIES]
    if bad or not FLAGS.policies:
        raise app.UsageError(f"--policies: unknown {bad}; give some of {', '.join(REPLAY_POLICIES)}")
    for name, lo in (("num_prompts", 1), ("max_new_tokens", 1), ("max_ngram", 1), ("min_match", 1)):
        if getattr(FLAGS, name) < lo:
            raise app.UsageError(f"--{name} must be >= {lo}, got {getattr(FLAGS, name)}")
    if FLAGS.gate_rho is not None and not (math.isfinite(FLAGS.gate_rho) and FLAGS.gate_rho >= 0):
        raise app.UsageError(f"--gate_rho must be a finite number >= 0, got {FLAGS.gate_rho}")
    if FLAGS.ngram_corpus and not os.path.isfile(FLAGS.ngram_corpus):
        raise app.UsageError(f"--ngram_corpus {FLAGS.ngram_corpus}: no such file (experiments.build_ngram_corpus "
                             "--out)")
    ks = number_list("num_draft_tokens", int, 1)
    costs = number_list("verify_costs", float, 0, strict=True)
    widths = sorted(set(number_list("widths", int, 2)))
    model = number_list("cost_model", float, 0)
    if not all(math.isfinite(c) for c in costs):
        raise app.UsageError(f"--verify_costs={','.join(FLAGS.verify_costs)}: give finite numbers > 0")
    if len(model) != 2 or not all(math.isfinite(c) for c in model):
        raise app.UsageError(f"--cost_model={','.join(FLAGS.cost_model)}: give two finite numbers A,B >= 0")
    return ks, costs, widths, (model[0], model[1])


def main(argv):
    del argv
    ks, costs, widths, cost_model = check_flags()
    import numpy as np

    from experiments.lib.common import model_flag
    from experiments.lib.serving.env import device_info, git_info, versions
    from models import load_model
    from paged import DynamicGenerator, Job, SamplingSettings

    with model_flag("model", FLAGS.model):
        model = load_model(FLAGS.model, quant=None if FLAGS.quant == "none" else FLAGS.quant)
    tok = model.tokenizer
    if tok is None:
        raise app.UsageError(f"--model {FLAGS.model} has no tokenizer: the workloads are chat prompts")
    gen = DynamicGenerator(model, max_batch_size=1, max_seq_len=min(1024, model.config.max_position_embeddings))
    all_widths = sorted({w for w in widths if w <= max(ks) + 1} | {k + 1 for k in ks})
    record = {"flags": {k: getattr(FLAGS, k) for k in ("model", "quant", "workloads", "num_prompts", "max_new_tokens",
                                                        "seed", "num_draft_tokens", "max_ngram", "verify_costs",
                                                        "policies", "min_match", "gate_rho", "widths", "price",
                                                        "cost_model", "ngram_corpus")},
              "git": git_info(), "device": device_info(), "versions": versions(), "runs": []}
    corpus = None
    if FLAGS.ngram_corpus:
        from paged.errors import InvalidConfigError
        from paged.speculation.ngram_corpus import load_corpus

        try:
            corpus = load_corpus(FLAGS.ngram_corpus, model.config.vocab_size)
        except InvalidConfigError as e:
            raise app.UsageError(f"--ngram_corpus {FLAGS.ngram_corpus}: {e}") from None
        record["ngram_corpus"] = repr(corpus)
    prices = None
    if FLAGS.price:
        from experiments.lib.serving.env import load_average

        record["load_before_pricing"] = load_average("ngram_bound")
        prices = price_steps(model, [w - 1 for w in all_widths], workload("copy", 4, FLAGS.seed), FLAGS.max_new_tokens)
        record["step_prices"] = {str(w): prices[w - 1] for w in all_widths}
    cost_of = width_costs(all_widths, prices, cost_model)
    record["width_costs"] = {str(w): c for w, c in cost_of.items()}
    print("verification cost by width (plain steps):", {w: round(c, 3) for w, c in cost_of.items()}, flush=True)
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
            # an engine with a bucket for each of --widths up to k + 1, and k + 1 itself
            variable = {w: c for w, c in cost_of.items() if w in widths and w < k + 1} | {k + 1: cost_of[k + 1]}
            for policy in FLAGS.policies:
                gate = None
                if policy == "gate":  # one gate for the workload's prompts, as one generator runs them
                    from paged.speculation.draft_gate import DraftGate

                    gate = DraftGate(k, FLAGS.gate_rho)
                per = [replay(p, o, k, FLAGS.max_ngram, FLAGS.max_new_tokens, policy, FLAGS.min_match, gate,
                              corpus)
                       for p, o in outputs]
                total = Replay()
                for r in per:
                    total = total.add(r)
                fixed = total.speedup(cost_of[k + 1])
                flexible = total.speedup_by(lambda m, v=variable: smallest_width(v, m))
                run = {"workload": wl, "num_draft_tokens": k, "policy": policy, **dataclasses.asdict(total),
                       "verified": {str(m): n for m, n in sorted(total.verified.items())},
                       "tokens_per_step": total.tokens / total.steps,
                       "tokens_per_verification": (1 + total.accepted / total.verifications if total.verifications
                                                   else None),
                       "acceptance_rate": total.accepted / total.drafted if total.drafted else None,
                       "predicted_speedup": {str(c): total.speedup(c) for c in costs},
                       "predicted_speedup_fixed_width": fixed, "predicted_speedup_widths": flexible,
                       "per_prompt_tokens_per_step": [r.tokens / r.steps if r.steps else None for r in per]}
                record["runs"].append(run)
                pred = "  ".join(f"c={c:g}: {total.speedup(c):.2f}x" for c in costs)
                tpv = run["tokens_per_verification"]
                print(f"{wl:>5} k={k:<3} {policy:>6}  tokens {total.tokens} steps {total.steps} verifications "
                      f"{total.verifications}  tokens/step {run['tokens_per_step']:.2f}  tokens/verification "
                      f"{'-' if tpv is None else f'{tpv:.2f}'}  predicted {pred}  width {k + 1}: {fixed:.2f}x  "
                      f"widths {sorted(variable)}: {flexible:.2f}x", flush=True)
    write_record(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
