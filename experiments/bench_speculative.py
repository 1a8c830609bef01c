"""Speculative decoding benchmark: tokens/s and acceptance for no draft, n-gram, a truncated-layer self-draft and a
distilled draft (`experiments/distill_draft.py`), at several batch sizes, on two seeded workloads:

- `copy`: rewrite or quote a given text or code (the output repeats the prompt: n-gram territory);
- `chat`: open questions (the draft model's territory).

Drafter names: `none`, `ngram`, `corpus` (prompt lookup with the corpus table of `--ngram_corpus`,
`DynamicGenerator(ngram_corpus=)`), `self`, `distilled` (with `--draft_dir`), each but `none` also with the suffix
`_adaptive` (`DynamicGenerator(adaptive_draft=True)`: a step verifies only where its drafts are expected to pay, see
`paged/speculation/draft_gate.py`); a draft model (`self`, `distilled`) also with the suffix `_late` (after `_adaptive`
where both): its proposal bursts wait for each verification's results on the host instead of going ahead
(`paged.speculation.draft.DraftModel.pipeline = False`; docs/speculative.md, "How a step works"). Each configuration
warms up (compiles) first; then, per workload and batch size b, the same
`--num_prompts` seeded prompts run with at most b jobs in the generator at once (a finished job's slot takes the
next prompt), so every batch size sees the same text and a single-stream figure is not one prompt's luck. The JSON
record carries the flags, git state, device and versions (`experiments.lib.serving.env`).

`--rounds R` runs each (workload, batch size) R times, every configuration once per round, one after another, the
configurations' order rotated by one each round: a machine whose speed drifts over minutes (a 2-core CPU moves
10-15% between runs) then slows both sides of a ratio alike, where one round per configuration in a row puts the
drift between them. Each run's `speedup_vs_none` is against the `none` run of its own round; `summary` holds, per
configuration, workload and batch size, the median tokens/s and the median, lowest and highest of those paired
ratios.

`--cpu_dispatch=sync` runs every program in the calling thread instead of JAX's worker threads (process-wide, so one
mode for every configuration of the run; `paged/device/cpu_runtime.py`); the record's `device` says which mode ran.

    python -m experiments.bench_speculative --draft_dir=/tmp/smollm2-draft-4l --json_out=/tmp/bench_spec.json
    python -m experiments.bench_speculative --draft_dir=/tmp/draft-wide --drafters=none,distilled --batch_sizes=1 \
        --num_draft_tokens=1 --rounds=4
"""

from __future__ import annotations

import hashlib
import time

from absl import app, flags

from experiments.lib import engine_flags
from experiments.lib.common import chat_prompt, check_out_flag, workload, write_record
from paged.speculation.rows import ACCEPTANCE_RULES, MAX_DRAFT_TOKENS

flags.DEFINE_string("model", "smollm2-135m", "target model")
flags.DEFINE_string("draft_dir", None, "distilled draft (experiments.distill_draft --out); skipped when unset")
flags.DEFINE_string("ngram_corpus", None, "the corpus drafter's table (experiments.build_ngram_corpus --out); the "
                    "corpus drafters are skipped when unset")
flags.DEFINE_integer("self_draft_layers", 4, "layers of the truncated self-draft")
flags.DEFINE_enum("draft_quant", "int8", ["int8", "int4", "none"], "the distilled draft's weights (a float "
                  "checkpoint): int8 / int4 quantized at load (the native CPU kernel runs them), or none (float32)")
flags.DEFINE_list("drafters", ["none", "ngram", "self", "distilled"], "configurations to run (each may take the "
                  "suffix _adaptive: adaptive_draft=True; a draft model then _late: no burst dispatched ahead)")
flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "jobs in the generator at once")
flags.DEFINE_integer("num_prompts", 0, "prompts per workload and batch size (0: the largest batch size)")
flags.DEFINE_float("draft_token_cost", None, "_adaptive drafters: the step-cost model's rho (None: the backend's)")
flags.DEFINE_list("workloads", ["copy", "chat"], "seeded workloads")
flags.DEFINE_integer("num_draft_tokens", 4, "drafts per step")
flags.DEFINE_integer("max_ngram", 4, "n-gram drafter: longest suffix matched")
flags.DEFINE_integer("max_new_tokens", 128, "tokens per job")
flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampled (drafts accepted by --draft_acceptance's rule)")
flags.DEFINE_enum("draft_acceptance", "rejection", list(ACCEPTANCE_RULES), "how sampled jobs accept "
                  "drafts: lossless rejection sampling, sample-then-match with coupled draws, or with greedy drafts as "
                  "ExLlamaV2 (DynamicGenerator(draft_acceptance=))")
flags.DEFINE_integer("seed", 0, "workload and sampling seed")
flags.DEFINE_integer("rounds", 1, "runs of every configuration per workload and batch size, interleaved (see above)",
                     lower_bound=1)
flags.DEFINE_string("json_out", None, "write the record here")
check_out_flag("json_out")
if "quant" not in flags.FLAGS:  # (experiments.lib.engine_flags defines the same flag where both are imported)
    flags.DEFINE_string("quant", "keep", "weights: 'keep' a GGUF's quantized blocks (the native CPU kernel decodes "
                        "them), 'none' dequantizes to float32, 'int8' / 'int4' requantize")
engine_flags.define_cpu_dispatch()
# EngineConfig's, for every configuration of the run (the kernels and their tunings: e.g. a GPU's attention with a
# key split, --attn_tuning=k_splits=8, against the default)
for _name in ("fuse_sampler", "attn_impl", "matmul_impl", "attn_tuning", "matmul_tuning"):
    engine_flags.define_config_flag(_name)
flags.DEFINE_bool("warmup", True, "compile every bucket before timing (--nowarmup: a quick smoke run, timings then "
                  "include compilation and mean nothing)")
FLAGS = flags.FLAGS


BASES = ("none", "ngram", "corpus", "self", "distilled")  # the drafters, before their suffixes


def check_flags() -> list[int]:
    """The batch sizes of `--batch_sizes`; app.UsageError naming the flag for a bad value: before any model loads."""
    import math
    import os

    from experiments.lib.common import WORKLOADS, check_chat_model_flags

    check_chat_model_flags("this benchmark runs chat prompts")
    unknown = [d for d in FLAGS.drafters if drafter_name(d)[0] not in BASES
               or drafter_name(d)[2] and drafter_name(d)[0] not in ("self", "distilled")
               or drafter_name(d)[1] and drafter_name(d)[0] == "none"]
    if unknown or not FLAGS.drafters:
        raise app.UsageError(f"--drafters: unknown {unknown}; use none, ngram, corpus, self, distilled (each but "
                             "none may end in _adaptive; self and distilled then in _late)")
    try:
        batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    except ValueError:
        batch_sizes = []
    if not batch_sizes or min(batch_sizes) < 1:
        raise app.UsageError(f"--batch_sizes={','.join(FLAGS.batch_sizes)}: give integers >= 1, e.g. 1,4,16")
    bad = [w for w in FLAGS.workloads if w not in WORKLOADS]
    if bad or not FLAGS.workloads:
        raise app.UsageError(f"--workloads: unknown {bad}; give some of {', '.join(WORKLOADS)}")
    if not FLAGS.temperature >= 0:
        raise app.UsageError(f"--temperature must be >= 0 (0: greedy), got {FLAGS.temperature}")
    for name, lo in (("num_draft_tokens", 1), ("max_new_tokens", 1), ("max_ngram", 1), ("self_draft_layers", 1),
                     ("num_prompts", 0)):
        if getattr(FLAGS, name) < lo:
            raise app.UsageError(f"--{name} must be >= {lo}, got {getattr(FLAGS, name)}")
    if FLAGS.num_draft_tokens > MAX_DRAFT_TOKENS:
        raise app.UsageError(f"--num_draft_tokens must be <= {MAX_DRAFT_TOKENS}, got {FLAGS.num_draft_tokens}")
    cost = FLAGS.draft_token_cost
    if cost is not None and not (math.isfinite(cost) and cost >= 0):
        raise app.UsageError(f"--draft_token_cost must be a finite number >= 0, got {cost}")
    if FLAGS.draft_dir and not os.path.isdir(FLAGS.draft_dir):
        raise app.UsageError(f"--draft_dir {FLAGS.draft_dir}: no such folder (experiments.distill_draft --out)")
    return batch_sizes


def main(argv):
    del argv
    batch_sizes = check_flags()
    from experiments.lib.common import model_flag
    from experiments.lib.serving.env import device_info, git_info, load_average, versions
    from models import load_model
    from models.draft import truncated_model
    from paged import DynamicGenerator, SamplingSettings
    from paged.device.config import EngineConfig

    engine_flags.apply_cpu_dispatch()  # before anything starts JAX (the record's device says which mode ran)
    from paged.errors import InvalidConfigError
    from paged.speculation.draft import check_draft_model
    from paged.speculation.ngram_corpus import NgramCorpus, load_corpus

    corpus = None
    if FLAGS.ngram_corpus:  # read before the model loads: a bad path fails at once
        try:
            corpus = NgramCorpus.load(FLAGS.ngram_corpus)
        except InvalidConfigError as e:
            raise app.UsageError(f"--ngram_corpus {FLAGS.ngram_corpus}: {e}") from None
    distilled = None
    if FLAGS.draft_dir:  # (before the target: a bad draft fails at once)
        with model_flag("draft_dir", FLAGS.draft_dir):
            distilled = load_model(FLAGS.draft_dir, load_tokenizer=False,
                                   quant=None if FLAGS.draft_quant == "none" else FLAGS.draft_quant)
    with model_flag("model", FLAGS.model):
        target = load_model(FLAGS.model, quant=None if FLAGS.quant == "none" else FLAGS.quant)
    tok = target.tokenizer
    if tok is None:
        raise app.UsageError(f"--model {FLAGS.model} has no tokenizer: this benchmark runs chat prompts")
    drafts = {"none": None, "ngram": None}
    if corpus is not None:
        try:
            drafts["corpus"] = load_corpus(corpus, target.config.vocab_size)
        except InvalidConfigError as e:
            raise app.UsageError(f"--ngram_corpus {FLAGS.ngram_corpus}: {e}") from None
    if any(drafter_name(d)[0] == "self" for d in FLAGS.drafters):
        if FLAGS.self_draft_layers > target.config.num_layers:
            raise app.UsageError(f"--self_draft_layers={FLAGS.self_draft_layers}: the target has "
                                 f"{target.config.num_layers} layers")
        drafts["self"] = truncated_model(target, FLAGS.self_draft_layers)
    if distilled is not None:
        try:  # (the same check the generator makes: a vocabulary padded differently needs both tokenizers)
            check_draft_model(target, distilled)
        except InvalidConfigError as e:
            raise app.UsageError(f"--draft_dir {FLAGS.draft_dir}: {e}") from None
        drafts["distilled"] = distilled
    settings = (SamplingSettings.greedy() if FLAGS.temperature <= 0
                else SamplingSettings(temperature=FLAGS.temperature))
    max_seq_len = min(1024, target.config.max_position_embeddings)
    longest = max(len(tok.encode(chat_prompt(tok, p), encode_special_tokens=True))
                  for wl in FLAGS.workloads for p in workload(wl, FLAGS.num_prompts or max(batch_sizes), FLAGS.seed))
    if longest + FLAGS.max_new_tokens > max_seq_len:  # (before any configuration compiles)
        raise app.UsageError(f"--max_new_tokens={FLAGS.max_new_tokens}: the longest prompt ({longest} tokens) and "
                             f"the new tokens exceed the generator's max_seq_len of {max_seq_len}; give at most "
                             f"{max(max_seq_len - longest, 0)}")
    record = {"flags": {k: getattr(FLAGS, k) for k in ("model", "quant", "warmup", "draft_dir", "ngram_corpus",
                                                        "draft_quant", "self_draft_layers",
                                                        "drafters",
                                                        "batch_sizes", "workloads", "num_draft_tokens", "max_ngram",
                                                        "max_new_tokens", "temperature", "seed", "num_prompts",
                                                        "draft_token_cost", "draft_acceptance", "rounds",
                                                        "cpu_dispatch", "fuse_sampler", "attn_impl",
                                                        "matmul_impl", "attn_tuning", "matmul_tuning")},
              "git": git_info(), "device": device_info(), "versions": versions(),
              "load_before": load_average("bench_speculative"), "runs": []}
    num_prompts = FLAGS.num_prompts or max(batch_sizes)
    gens = {}  # drafter -> (generator, compile seconds): every configuration built and warmed up first
    for drafter in FLAGS.drafters:
        base, adaptive, late = drafter_name(drafter)
        if base not in drafts:
            print(f"skipping {drafter} (no {'--ngram_corpus' if base == 'corpus' else '--draft_dir'})")
            continue
        kw = {}
        if base in ("ngram", "corpus"):
            kw = dict(use_ngram_draft=True, max_ngram=FLAGS.max_ngram, num_draft_tokens=FLAGS.num_draft_tokens,
                      ngram_corpus=drafts[base])
        elif drafts[base] is not None:
            kw = dict(draft_model=drafts[base], num_draft_tokens=FLAGS.num_draft_tokens)
        if kw and adaptive:
            kw.update(adaptive_draft=True, draft_token_cost=FLAGS.draft_token_cost)
        if kw:
            kw.update(draft_acceptance=FLAGS.draft_acceptance)
        # one config: a tuning is checked against its own kernel, so the kernels and tunings go in together
        try:
            config = EngineConfig(fuse_sampler=FLAGS.fuse_sampler, attn_impl=FLAGS.attn_impl,
                                  matmul_impl=FLAGS.matmul_impl, attn_tuning=FLAGS.attn_tuning,
                                  matmul_tuning=FLAGS.matmul_tuning)
            gen = DynamicGenerator(target, max_batch_size=max(batch_sizes), config=config, max_seq_len=max_seq_len,
                                   **kw)
        except InvalidConfigError as e:  # (a tuning the kernel does not take, say)
            raise app.UsageError(f"--drafters {drafter}: {e}") from None
        if late:
            gen.speculation.speculator.draft.pipeline = False
        t0 = time.perf_counter()
        if FLAGS.warmup:
            gen.warmup()
        gens[drafter] = (gen, time.perf_counter() - t0)
    order = list(gens)
    if not FLAGS.warmup:
        print("--nowarmup: each configuration's first runs include compiling its programs (tok/s and ratios too)")
    for rnd in range(FLAGS.rounds):
        for wl in FLAGS.workloads:
            for bs in batch_sizes:
                for drafter in order[rnd % len(order):] + order[: rnd % len(order)]:
                    run = run_config(gens[drafter][0], drafter, wl, bs, num_prompts, settings, tok)
                    run.update(round=rnd, compile_s=gens[drafter][1])
                    record["runs"].append(run)
                    rate, mal = run["acceptance_rate"], run["mean_accepted_length"]
                    print(f"{drafter:>18} {wl:>5} bs={bs:<3} {run['tokens_per_s']:8.1f} tok/s  acceptance "
                          f"{'-' if rate is None else f'{100 * rate:.1f}%'}  mean accepted length "
                          f"{'-' if mal is None else f'{mal:.2f}'}" + (f"  (round {rnd + 1})" if FLAGS.rounds > 1
                                                                      else ""), flush=True)
    record["summary"] = summarize(record["runs"])
    for c in record["summary"]:
        if c["drafter"] != "none" and c["identical_to_none"] is not None:
            print(f"{c['drafter']:>18} {c['workload']:>5} bs={c['batch_size']:<3} outputs identical to none: "
                  f"{c['identical_to_none']}/{c['jobs']}" + (" (fewest of any round)" if FLAGS.rounds > 1 else ""))
    if FLAGS.rounds > 1:
        for c in record["summary"]:
            ratio = c["speedup_vs_none"]
            print(f"{c['drafter']:>18} {c['workload']:>5} bs={c['batch_size']:<3} median {c['tokens_per_s']:8.1f} "
                  f"tok/s" + ("" if ratio is None else f"  x none: median {ratio['median']:.2f} "
                                                         f"({ratio['min']:.2f}-{ratio['max']:.2f})"))
    record["load_after"] = load_average()
    write_record(FLAGS.json_out, record)


def drafter_name(name: str) -> tuple[str, bool, bool]:
    """(drafter, adaptive, late) of a `--drafters` entry: the suffixes `_late` and `_adaptive` taken off."""
    late = name.endswith("_late")
    name = name.removesuffix("_late")
    return name.removesuffix("_adaptive"), name.endswith("_adaptive"), late


GAUGES = ("pages_total", "pages_used", "pages_cached", "pages_free", "jobs_pending", "jobs_active")  # not counts


def run_config(gen, drafter: str, wl: str, bs: int, num_prompts: int, settings, tok) -> dict:
    """One run: the workload's `num_prompts` seeded prompts through `gen`, at most `bs` jobs at once."""
    from paged import Job

    prompts = [chat_prompt(tok, p) for p in workload(wl, num_prompts, FLAGS.seed)]
    jobs = [Job(tok.encode(p, encode_special_tokens=True), FLAGS.max_new_tokens, gen_settings=settings,
                seed=FLAGS.seed + i, stop_conditions=[tok.eos_token_id] if hasattr(tok, "eos_token_id") else None)
            for i, p in enumerate(prompts)]
    before = gen.metrics()
    t0 = time.perf_counter()
    finals = []
    waiting = list(jobs)
    while waiting or gen.num_remaining_jobs():
        while waiting and gen.num_remaining_jobs() < bs:  # at most bs jobs at once
            gen.enqueue(waiting.pop(0))
        finals += [r for r in gen.iterate() if r["eos"]]
    dt = time.perf_counter() - t0
    new = sum(r["new_tokens"] for r in finals)
    outputs = [hashlib.sha1(str(j.sequence[len(j.input_ids):]).encode()).hexdigest()[:12] for j in jobs]
    acc = sum(r.get("accepted_draft_tokens", 0) for r in finals)
    rej = sum(r.get("rejected_draft_tokens", 0) for r in finals)
    after = gen.metrics()
    rows = after["verification_rows"] - before["verification_rows"]
    hist = [a - b for a, b in zip(after["accepted_at_position"], before["accepted_at_position"])]
    return {"drafter": drafter, "workload": wl, "batch_size": bs, "new_tokens": new, "seconds": dt,
            "tokens_per_s": new / dt, "accepted_draft_tokens": acc, "rejected_draft_tokens": rej,
            "acceptance_rate": acc / (acc + rej) if acc + rej else None,
            "mean_accepted_length": 1 + acc / rows if rows else None, "verification_rows": rows,
            "accepted_at_position": hist, "steps": after["steps"] - before["steps"],
            "gated_steps": after["gated_steps"] - before["gated_steps"], "jobs": len(finals),
            "draft_bursts_ahead_used": after["draft_bursts_ahead_used"] - before["draft_bursts_ahead_used"],
            "corpus_drafted_tokens": after["corpus_drafted_tokens"] - before["corpus_drafted_tokens"],
            "corpus_accepted_draft_tokens": (after["corpus_accepted_draft_tokens"]
                                             - before["corpus_accepted_draft_tokens"]),
            "draft_acceptance": gen.speculation.speculator.acceptance if gen.speculation else None,
            "fuse_sampler": gen.config.fuse_sampler, "engine": gen.config.to_dict(), "output_hashes": outputs,
            # this run's counts and host-loop seconds (the generator's totals less those before it; the rates are
            # the fields above), and the gauges (pages, jobs) as the run left them
            "metrics": {k: (v - before[k] if k not in GAUGES else v) for k, v in after.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith("_rate")
                        and k != "mean_accepted_length"}}


def summarize(runs: list[dict]) -> list[dict]:
    """Sets each run's `speedup_vs_none` (against the `none` run of the same workload, batch size and round) and
    `identical_to_none` (how many of its jobs emitted exactly that run's tokens: all of them for greedy decoding and
    for seeded sampling with `--draft_acceptance=match`; None without a `none` run) and returns, per (drafter,
    workload, batch size) in first-seen order, the median tokens/s, the median, lowest and highest of those ratios
    over the rounds (None where no `none` run pairs with it) and the fewest identical outputs of any round."""
    import statistics

    base = {(r["workload"], r["batch_size"], r.get("round", 0)): r for r in runs if r["drafter"] == "none"}
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        b = base.get((r["workload"], r["batch_size"], r.get("round", 0)))
        r["speedup_vs_none"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        r["identical_to_none"] = (sum(x == y for x, y in zip(r["output_hashes"], b["output_hashes"])) if b
                                  else None)
        groups.setdefault((r["drafter"], r["workload"], r["batch_size"]), []).append(r)
    out = []
    for (drafter, wl, bs), rs in groups.items():
        ratios = [r["speedup_vs_none"] for r in rs if r["speedup_vs_none"] is not None]
        out.append({"drafter": drafter, "workload": wl, "batch_size": bs, "rounds": len(rs),
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                    "speedup_vs_none": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
                    if ratios else None,
                    "identical_to_none": None if rs[0]["identical_to_none"] is None
                    else min(r["identical_to_none"] for r in rs), "jobs": rs[0]["jobs"]})
    return out


if __name__ == "__main__":
    app.run(main)
