"""Distil a small draft model for speculative decoding from the target (default: the embedded SmolLM2-135M).

The draft keeps the target's tokenizer and input embedding (frozen) and has `--layers` decoder layers initialised
from the target's (the first ones, or spread evenly over the depth with `--init=spread`). Its LM head is either the
target's tied one (frozen: `--head_vocab=0`) or a **reduced head** over the `--head_vocab` tokens the target emits
most often in the training text (a trainable `[N, H]` matrix initialised from those tokens' embeddings, saved with
their ids as `lm_head.token_ids`): the 576 x 49152 head is most of a small draft's cost per token, and a token the
target never says is a draft that is never accepted. Other tokens get a -inf logit in the draft (never proposed; the
rejection sampler's q is 0 there, so sampling stays lossless).

Training text: the target's own **greedy** answers (`--gen_temperature`, default 0) to a seeded set of chat prompts
in the chat template the benchmark and `generate.py` use: open requests (`TASKS` x `TOPICS` first, then the wide
pool with `MORE_TASKS` and `MORE_TOPICS`: 2860 distinct requests), then copy-style requests (repeat, correct, quote;
`COPY_INSTRUCTIONS`) over the target's earlier answers, generated with continuous batching (`--gen_batch` jobs).
Neither the benchmark's texts nor its chat prompts (`experiments.lib.common`) are in it. Each example is one prompt +
answer, so a copy request keeps the text it copies in context. Loss (`--loss`): "ce", cross-entropy on the answer
tokens (with greedy text they are the target's argmax: what greedy acceptance checks; no teacher forward, so a step
is cheap); "topk" (the default), cross-entropy against the target's distribution over its `--topk` most likely
tokens at each answer token, which the generator returns with the text (`return_top_tokens`: no teacher forward
either; the tokens outside the reduced head dropped and the rest renormalised), a richer signal per token than its
argmax alone; or "kl", the KL divergence from the target's full next-token distribution at every position (full head
only; a target forward per step). optax AdamW with warm-up and cosine decay; the weights are the project's flax
`Weights` pytree.

Writes `--out/model.safetensors` (HF tensor names) and `--out/config.json`, which `models.load_model(out)` reads;
the draft has no tokenizer files: pass the target's (`DynamicGenerator(target, draft_model=load_model(out,
load_tokenizer=False, quant="int8"))`). Stops at `--max_minutes` (default 30) whatever `--steps` says, with tqdm
bars; `distill_log.json` records the flags, the loss and agreement history and a held-out agreement.

Full run (~30 min on the 2-core CPU):
    python -m experiments.distill_draft --out=/tmp/smollm2-draft
Smoke run (~1 min):
    python -m experiments.distill_draft --out=/tmp/draft-smoke --num_prompts=4 --gen_tokens=24 --steps=3 \
        --batch_size=2 --seq_len=96 --max_minutes=6 --eval_prompts=2
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from experiments.lib.answers import (  # noqa: F401 (the prompt set and generation, here since before answers.py)
    COPY_INSTRUCTIONS,
    MORE_TASKS,
    MORE_TOPICS,
    TASKS,
    TOPICS,
    answer_prompt_set,
    copy_prompts,
    generate_answers,
    open_prompts,
)
from experiments.lib.common import check_out_flag

flags.DEFINE_string("target", "smollm2-135m", "target model (anything models.load_model accepts)")
flags.DEFINE_string("out", None, "output directory (model.safetensors + config.json)")
check_out_flag("out", folder=True)  # checked when the flags are parsed: not after 30 minutes of training
flags.DEFINE_string("target_quant", "keep", "the target's weights when it generates the training text and the "
                    "evaluation answers: keep (as stored: the Q4_1 model bench_speculative runs), none (float32), int8")
flags.DEFINE_integer("layers", 4, "decoder layers of the draft")
flags.DEFINE_enum("init", "first", ["first", "spread"], "initialise from the target's first layers, or spread evenly")
flags.DEFINE_integer("head_vocab", 8192, "tokens of the draft's reduced LM head (the target's most frequent in the "
                     "training text); 0: the target's full tied head")
flags.DEFINE_enum("loss", "topk", ["ce", "topk", "kl"], "ce: cross-entropy on the target's answer tokens; topk: "
                  "cross-entropy against the target's distribution over its --topk most likely tokens at each "
                  "answer token, recorded while it generates (those in the draft's head, renormalised); kl: KL to "
                  "the target's full distribution at every position (a teacher forward per step; needs "
                  "--head_vocab=0)")
flags.DEFINE_integer("topk", 32, "--loss=topk: tokens of the target's distribution kept per answer token (at most "
                     "paged.device.step.TOP_K_WIDTH, 64)")
flags.DEFINE_integer("num_prompts", 4000, "prompts in the seeded prompt set (half open requests, half copy "
                     "requests); generation stops at --gen_minutes")
flags.DEFINE_integer("gen_tokens", 128, "tokens the target generates per prompt (at most)")
flags.DEFINE_float("gen_temperature", 0.0, "sampling temperature of the training answers (0: greedy)")
flags.DEFINE_float("gen_minutes", 9.0, "at most this much of the budget generates text")
flags.DEFINE_integer("gen_batch", 32, "jobs the target generates at once (continuous batching)")
flags.DEFINE_integer("steps", 1100, "training steps (capped by --max_minutes; the learning-rate schedule decays over "
                     "them: ~1 step/s on the 2-core CPU leaves ~18 of the 30 minutes for 1100)")
flags.DEFINE_integer("batch_size", 8, "examples per step")
flags.DEFINE_integer("seq_len", 256, "tokens per example (prompt + answer, truncated; shorter ones padded)")
flags.DEFINE_float("lr", 1e-3, "peak learning rate")
flags.DEFINE_float("kl_temperature", 1.0, "--loss=kl: temperature of both distributions")
flags.DEFINE_float("holdout", 0.05, "share of the open answers held out to measure agreement, each with the copy "
                  "requests over it (no held-out text is trained on)")
flags.DEFINE_list("eval_workloads", ["copy", "chat"], "after training, the draft's agreement with the target on "
                  "these benchmark workloads (experiments.lib.common.workload; their prompts are not trained on)")
flags.DEFINE_integer("eval_prompts", 16, "prompts per evaluation workload")
flags.DEFINE_integer("eval_tokens", 96, "target answer tokens per evaluation prompt")
flags.DEFINE_integer("seed", 0, "seed of the prompt set, the generation and the batches")
flags.DEFINE_float("max_minutes", 30.0, "wall-clock budget for generation + training")
FLAGS = flags.FLAGS

def head_token_ids(answers: list[list[int]], n: int, always: list[int]) -> list[int]:
    """The `n` tokens the target emits most often in `answers` (ties: lower id first), `always` included."""
    import collections

    counts = collections.Counter(t for a in answers for t in a)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    keep = list(dict.fromkeys([t for t in always if t is not None] + ranked))[:n]
    return sorted(keep)


def make_examples(pairs: list[tuple], seq_len: int, soft_k: int = 0):
    """Pad/truncate each prompt + answer to `seq_len`: tokens i32 [N, T], labels i32 [N, T] (the next token),
    mask f32 [N, T] (1 where the label is an answer token).

    `soft_k` > 0 (items with the target's distributions, `generate_answers(top_k=)`) also returns the teacher at
    each label: soft_ids i32 [N, T, soft_k] and soft_probs f32 [N, T, soft_k] (its first `soft_k` tokens; zero
    probability off the answer)."""
    import numpy as np

    n = len(pairs)
    tokens = np.zeros((n, seq_len), np.int32)
    labels = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    if soft_k:
        soft_ids = np.zeros((n, seq_len, soft_k), np.int32)
        soft_probs = np.zeros((n, seq_len, soft_k), np.float32)
    for i, item in enumerate(pairs):
        p, a = item[0], item[1]
        seq = (list(p) + list(a))[: seq_len + 1]
        tokens[i, : min(len(seq), seq_len)] = seq[:seq_len]
        labels[i, : len(seq) - 1] = seq[1:]
        start = max(0, len(p) - 1)
        mask[i, start : len(seq) - 1] = 1.0
        if soft_k:
            if len(item) < 3 or item[2][0].shape[1] < soft_k:
                raise ValueError(f"make_examples(soft_k={soft_k}) needs each answer's top-{soft_k} distributions "
                                 "(generate_answers(top_k=))")
            n_ans = max(0, len(seq) - 1 - start)
            first = start - (len(p) - 1)  # answer tokens whose label position fell before 0 (an empty prompt)
            soft_ids[i, start : start + n_ans] = item[2][0][first : first + n_ans, :soft_k]
            soft_probs[i, start : start + n_ans] = item[2][1][first : first + n_ans, :soft_k]
    if soft_k:
        return tokens, labels, mask, soft_ids, soft_probs
    return tokens, labels, mask


def teacher_columns(soft_ids, soft_probs, remap=None):
    """The teacher's top tokens (`make_examples(soft_k=)`: ids, -1 for none, and probabilities `[..., K]`) as
    columns of the draft's head (`remap[token]`: its column, -1 if the head lacks it; None: the full head) and
    weights renormalised over the tokens the head has (all zero where it has none of them)."""
    import numpy as np

    cols = remap[np.maximum(soft_ids, 0)] if remap is not None else soft_ids
    valid = (soft_ids >= 0) & (cols >= 0)
    w = np.where(valid, soft_probs, 0.0)
    tot = w.sum(-1, keepdims=True)
    return (np.where(valid, cols, 0).astype(np.int32),
            np.where(tot > 0, w / np.maximum(tot, 1e-12), 0.0).astype(np.float32))


def soft_cross_entropy(logq, cols, weights):
    """-sum_k weights[..., k] * logq[..., cols[..., k]]: the cross-entropy of the draft's log-probabilities `logq`
    `[..., N]` against the teacher's top tokens (`teacher_columns`), per position `[...]`."""
    import jax.numpy as jnp

    return -jnp.sum(weights * jnp.take_along_axis(logq, cols, axis=-1), axis=-1)


def draft_params(target, layers: int, init: str):
    import jax
    import numpy as np

    total = target.config.num_layers
    idx = list(range(layers)) if init == "first" else np.linspace(0, total - 1, layers).round().astype(int).tolist()
    sliced = jax.tree_util.tree_map(lambda a: a[np.asarray(idx)], target.params.layers)
    return target.params.replace(layers=sliced), idx


FLAG_NAMES = ("target", "target_quant", "layers", "init", "head_vocab", "loss", "topk", "num_prompts", "gen_tokens",
              "gen_temperature", "gen_minutes", "steps", "batch_size", "seq_len", "lr", "kl_temperature", "holdout",
              "eval_workloads", "eval_prompts", "eval_tokens", "seed", "max_minutes")


def check_flags() -> None:
    """app.UsageError naming the flag for a bad value: before the target loads or generates anything (the upper
    bound of --layers, the target's depth, is checked once the target has loaded, before it generates)."""
    from experiments.lib.common import WORKLOADS, check_quant_flag
    from paged.device.step import TOP_K_WIDTH

    if not FLAGS.out:
        raise app.UsageError("--out is required")
    for name, lo in (("layers", 1), ("num_prompts", 1), ("gen_tokens", 1), ("gen_batch", 1), ("steps", 1),
                     ("batch_size", 1), ("seq_len", 2), ("head_vocab", 0), ("eval_prompts", 1), ("eval_tokens", 1)):
        if getattr(FLAGS, name) < lo:
            raise app.UsageError(f"--{name} must be >= {lo}, got {getattr(FLAGS, name)}")
    for name in ("gen_minutes", "max_minutes", "lr", "kl_temperature"):
        if not getattr(FLAGS, name) > 0:
            raise app.UsageError(f"--{name} must be > 0, got {getattr(FLAGS, name)}")
    if not FLAGS.gen_temperature >= 0:
        raise app.UsageError(f"--gen_temperature must be >= 0 (0: greedy), got {FLAGS.gen_temperature}")
    if not 0 <= FLAGS.holdout < 1:
        raise app.UsageError(f"--holdout must be in [0, 1), got {FLAGS.holdout}")
    check_quant_flag("target_quant")
    bad = [w for w in FLAGS.eval_workloads if w not in WORKLOADS]
    if bad:
        raise app.UsageError(f"--eval_workloads: unknown {bad}; each one of {', '.join(WORKLOADS)}")
    if FLAGS.loss == "kl" and FLAGS.head_vocab:
        raise app.UsageError("--loss=kl compares full distributions: use it with --head_vocab=0")
    if FLAGS.loss == "topk" and not 1 <= FLAGS.topk <= TOP_K_WIDTH:  # wider top tokens come from the host: slow
        raise app.UsageError(f"--topk={FLAGS.topk}: give 1 to {TOP_K_WIDTH} (the generator's top tokens on the "
                             "device)")
    reserve = 30 + 60 * len(FLAGS.eval_workloads)  # saving, and the evaluation on the workloads
    if FLAGS.max_minutes * 60 < reserve + 120:
        raise app.UsageError(f"--max_minutes={FLAGS.max_minutes} leaves no time to generate and train: give at "
                             f"least {(reserve + 120) / 60:.1f} (or fewer --eval_workloads)")


def main(argv):
    del argv
    check_flags()
    if FLAGS.loss == "ce" and FLAGS.gen_temperature > 0:
        print("note: --loss=ce on sampled text learns the target's samples, not its argmax")
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm import tqdm

    from experiments.lib.common import model_flag, workload
    from models import load_model
    from models.draft import reduced_head, save_hf_llama
    from models.llama import forward, hidden_states, rms_norm

    t_start = time.perf_counter()
    deadline = t_start + FLAGS.max_minutes * 60
    reserve = 30 + 60 * len(FLAGS.eval_workloads)  # saving, and the evaluation on the workloads
    with model_flag("target", FLAGS.target):
        target = load_model(FLAGS.target)  # float: the draft's initial layers (and the KL teacher)
    if FLAGS.layers > target.config.num_layers:
        raise app.UsageError(f"--layers={FLAGS.layers}: the target has {target.config.num_layers} layers")
    if target.tokenizer is None:
        raise app.UsageError(f"--target {FLAGS.target} has no tokenizer: the training text is its own answers")
    rs = target.config.rope_scaling
    if rs is not None and rs.rope_type != "default":
        raise app.UsageError("this script writes a Llama draft without rope scaling")
    # the text and the evaluation come from the target as the benchmark runs it (by default its stored weights)
    speaker = target if FLAGS.target_quant == "none" else load_model(FLAGS.target, quant=FLAGS.target_quant)
    tok = target.tokenizer
    # 1. training text: the target's answers to open requests, then to copy requests over those answers
    gen_deadline = min(deadline - reserve - 60, t_start + FLAGS.gen_minutes * 60)
    soft_k = FLAGS.topk if FLAGS.loss == "topk" else 0
    # an example's group: the open answer it is, or copies (no leak across splits)
    pairs, groups = answer_prompt_set(speaker, FLAGS.num_prompts, FLAGS.gen_tokens, FLAGS.gen_temperature, FLAGS.seed,
                                      t_start + (gen_deadline - t_start) / 2, gen_deadline, FLAGS.gen_batch,
                                      top_k=soft_k)
    n_groups = max(groups) + 1 if groups else 0  # the open answers (a copy's group is its source's)
    gen_s = time.perf_counter() - t_start
    rng = np.random.default_rng(FLAGS.seed)
    n_held = min(n_groups - 1, max(1, int(round(FLAGS.holdout * n_groups)))) if n_groups > 1 else 0
    held_groups = set(rng.permutation(n_groups)[:n_held].tolist())
    hold = [p for p, g in zip(pairs, groups) if g in held_groups]
    train = [p for p, g in zip(pairs, groups) if g not in held_groups]
    if not train:
        raise app.UsageError("no training text was generated in the time given: raise --max_minutes / --gen_minutes")
    tokens, labels, mask, *soft = make_examples(train, FLAGS.seq_len, soft_k)
    if not mask.any():
        raise app.UsageError(f"--seq_len={FLAGS.seq_len} holds no answer token of any example (the prompts are "
                             "longer): raise it")
    # 2. the draft: target layers; frozen input embedding; the tied head, or a reduced trainable one
    params, idx = draft_params(target, FLAGS.layers, FLAGS.init)
    dcfg = dataclasses.replace(target.config, num_layers=FLAGS.layers)
    trainable = {"layers": params.layers, "final_norm": params.final_norm}
    ids = None

    def to_head(labs, msk):
        """Labels as columns of the reduced head; an answer token outside it cannot be drafted: no loss there (and
        a miss in the agreement, whose denominator is the mask before this)."""
        return np.maximum(remap[labs], 0), msk * (remap[labs] >= 0)

    if FLAGS.head_vocab:
        stops = [tok.eos_token_id, *(target.config.eos_token_ids or ())]
        ids = np.asarray(head_token_ids([item[1] for item in train], FLAGS.head_vocab, stops), np.int32)
        trainable["head"] = reduced_head(target, ids).params.lm_head.T  # the target's head at those tokens [N, H]
        remap = np.full(target.config.vocab_size, -1, np.int32)
        remap[ids] = np.arange(len(ids), dtype=np.int32)
        head_labels, head_mask = to_head(labels, mask)
        covered = float(head_mask.sum() / max(1.0, mask.sum()))
        labels, mask = head_labels, head_mask
    if soft:
        soft = teacher_columns(*soft, remap if ids is not None else None)
    total_steps = FLAGS.steps
    sched = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, max(1, min(100, total_steps // 20)), total_steps,
                                               FLAGS.lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    opt_state = opt.init(trainable)
    tau = FLAGS.kl_temperature

    def draft_logits(tr, toks):
        p = params.replace(layers=tr["layers"], final_norm=tr["final_norm"])  # (the input embedding: frozen)
        if "head" not in tr:
            return forward(p, dcfg, toks)
        h = rms_norm(hidden_states(p, dcfg, toks), tr["final_norm"], dcfg.rms_norm_eps)
        return jnp.dot(h, tr["head"].T).reshape(toks.shape + (-1,))  # [B, T, N]

    @jax.jit
    def teacher(toks):
        return jax.nn.log_softmax(forward(target.params, target.config, toks) / tau, axis=-1)

    def loss_fn(tr, toks, labs, msk, teacher_logp, top=None):
        logits = draft_logits(tr, toks)
        if teacher_logp is None:  # cross-entropy on the answer tokens, or against the teacher's top tokens
            logq = jax.nn.log_softmax(logits, axis=-1)
            nll = (-jnp.take_along_axis(logq, labs[..., None], axis=-1)[..., 0] if top is None
                   else soft_cross_entropy(logq, *top))
            agree = (jnp.argmax(logits, -1) == labs) * msk
            return jnp.sum(nll * msk) / jnp.maximum(1.0, msk.sum()), jnp.sum(agree) / jnp.maximum(1.0, msk.sum())
        logq = jax.nn.log_softmax(logits / tau, axis=-1)
        kl = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - logq), axis=-1)  # [B, T]
        agree = (jnp.argmax(logq, -1) == jnp.argmax(teacher_logp, -1)) * msk
        return jnp.sum(kl * msk) / jnp.maximum(1.0, msk.sum()), jnp.sum(agree) / jnp.maximum(1.0, msk.sum())

    @jax.jit
    def train_step(tr, opt_state, toks, labs, msk, teacher_logp, top):
        (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(tr, toks, labs, msk, teacher_logp, top)
        updates, opt_state = opt.update(grads, opt_state, tr)
        return optax.apply_updates(tr, updates), opt_state, loss, agree

    eval_step = jax.jit(lambda tr, toks, labs, msk: loss_fn(tr, toks, labs, msk, None)[1])
    history = []
    bar = tqdm(range(total_steps), desc="distilling", unit="step")
    for step in bar:
        if time.perf_counter() > deadline - reserve:
            bar.write(f"time budget of {FLAGS.max_minutes} min reached at step {step}")
            break
        pick = rng.integers(0, len(tokens), size=FLAGS.batch_size)
        toks = jnp.asarray(tokens[pick])
        tl = teacher(toks) if FLAGS.loss == "kl" else None
        top = (jnp.asarray(soft[0][pick]), jnp.asarray(soft[1][pick])) if soft else None
        trainable, opt_state, loss, agree = train_step(trainable, opt_state, toks, jnp.asarray(labels[pick]),
                                                       jnp.asarray(mask[pick]), tl, top)
        history.append((float(loss), float(agree)))
        bar.set_postfix(loss=f"{history[-1][0]:.3f}", top1=f"{history[-1][1]:.2f}")

    def agreement(examples) -> float | None:
        """The draft's top-1 agreement with the target's greedy answer tokens of (prompt, answer) pairs."""
        if not examples:
            return None
        e_tok, e_lab, e_msk = make_examples(examples, FLAGS.seq_len)
        total = float(e_msk.sum())
        if ids is not None:
            e_lab, e_msk = to_head(e_lab, e_msk)
        hits = sum(float(eval_step(trainable, jnp.asarray(e_tok[i : i + 4]), jnp.asarray(e_lab[i : i + 4]),
                                   jnp.asarray(e_msk[i : i + 4]))) * float(e_msk[i : i + 4].sum())
                   for i in range(0, len(e_tok), 4))
        return hits / max(1.0, total)

    held_out = agreement(hold)  # prompts of the training distribution, not trained on
    workload_top1 = {}
    for name in FLAGS.eval_workloads:  # the benchmark's prompts (experiments.lib.common.workload): other wording/texts
        ev = generate_answers(speaker, workload(name, FLAGS.eval_prompts, 0), FLAGS.eval_tokens, 0.0, FLAGS.seed,
                              float("inf"), f"target answers ({name} workload)")
        workload_top1[name] = agreement(ev)
    final = params.replace(layers=trainable["layers"], final_norm=trainable["final_norm"])
    if ids is not None:
        final = final.replace(lm_head=trainable["head"].T, head_ids=jnp.asarray(ids))
    save_hf_llama(final, dcfg, FLAGS.out)
    log = {"flags": {k: getattr(FLAGS, k) for k in FLAG_NAMES}, "init_layers": idx,
           "train_examples": len(train), "heldout_examples": len(hold), "train_answer_tokens": int(mask.sum()),
           "head_coverage": covered if ids is not None else 1.0,
           "head_tokens": len(ids) if ids is not None else target.config.vocab_size, "generation_s": gen_s,
           "steps_run": len(history),
           "loss_top1": history, "heldout_top1": held_out, "workload_top1": workload_top1,
           "seconds": time.perf_counter() - t_start}
    with open(os.path.join(FLAGS.out, "distill_log.json"), "w") as fh:
        json.dump(log, fh)
    print(f"wrote {FLAGS.out}: {FLAGS.layers} layers (from target layers {idx}), head of "
          f"{len(ids) if ids is not None else target.config.vocab_size} tokens, {len(history)} steps, "
          f"last loss {history[-1][0] if history else float('nan'):.3f}, agreement held-out {held_out}, "
          f"on the workloads {workload_top1}")


if __name__ == "__main__":
    app.run(main)
