"""What a feature-fed draft (EAGLE-style, Li et al. 2024) would be accepted on the speculative benchmark's workloads,
and what it would gain on this machine: measured offline, without building it into the engine.

The distilled draft of `experiments/distill_draft.py` sees only tokens and agrees with the target on 25-33% of the
benchmark's tokens (docs/speculative.md). A feature-fed draft also sees the target's last hidden state: one decoder
layer over `fc([embed(x[t+1]); f[t]])`, f[t] the target's hidden state after token t (before the final norm),
predicts f[t+1]; the target's final norm and LM head (frozen, cut to the `--head_vocab` tokens its answers use) turn
that into a draft of x[t+2]; the next drafts feed the layer's own output back as the feature. A verification step
computes the target's hidden state at every position of its row, so the engine would have f up to the last accepted
token after each step.

What the script does:
1. Training text: the target's greedy answers to `distill_draft`'s seeded prompt set (its flags: `--num_prompts`,
   `--gen_tokens`, `--gen_minutes`, `--seq_len`, `--head_vocab`, `--seed`, `--target`, `--target_quant`), and the
   target's hidden states over it (a dense forward of the target as benchmarked).
2. Trains the draft (optax AdamW, `--steps` / `--batch_size` / `--lr`): smooth L1 between the predicted and the
   target's feature (scaled to unit RMS) plus `--ce_weight` x cross-entropy on the next-next answer token. The layer
   starts from the target's last one; fc from [N(0, 0.02); I] (the feature passed through).
3. On the benchmark's workloads (`experiments.lib.common.workload`, prompts not trained on): the target's greedy
answers;
   for every answer position t, the draft's chain of `--chain` drafts given the target's features up to t (the
   layer's cache holds the teacher inputs; the chain's own entries are attended as they would be); the acceptance
   at each depth; and a greedy replay of the answer (each step accepts the chain's longest correct prefix plus the
   target's token) giving tokens per verification step for every k <= `--chain`.
4. Prices a step at batch 1 (`--price`): a plain decode step and a verification step of k + 1 tokens in the
   generator (n-gram drafts; a feature-fed draft's verification is the same step), and the draft chain of k tokens
   (a jitted scan: fc, the target's last layer in its stored format, the reduced head; batch 1, a 256-entry cache).
   Predicted speed-up at k = tokens per step / ((verification + chain) / plain), with the steps that verify as the
   replay counts them (every step here: greedy chains always propose).

    python -m experiments.studies.feature_draft_study --json_out=experiments/results/feature_draft_study_cpu.json

The record (`--json_out`) carries the flags, git state, device, the training history, per-workload acceptance by
depth, tokens per step by k, the step prices and the predictions.
"""

from __future__ import annotations

import time

from absl import app, flags

from experiments import distill_draft  # noqa: F401  (defines the data and training flags this study shares)
from experiments.lib.common import check_out_flag, price_steps, write_record

flags.DEFINE_integer("chain", 4, "drafts per chain (the largest k evaluated)")
flags.DEFINE_float("ce_weight", 0.1, "weight of the token cross-entropy next to the feature regression")
flags.DEFINE_bool("price", True, "time a plain and a verification step in the generator, and the draft chain")
flags.DEFINE_list("price_ks", ["1", "2", "3", "4"], "k values to price (each <= --chain)")
flags.DEFINE_integer("extra_text_tokens", 0, "also train on up to this many tokens of other text (the long "
                     "descriptions of the installed Python packages), labelled with the target's own argmax: a "
                     "dense forward of the target costs far less per token than generating text with it")
flags.DEFINE_string("json_out", None, "write the record here")
check_out_flag("json_out")
FLAGS = flags.FLAGS


def package_text_windows(tok, n_tokens: int, seq_len: int, seed: int):
    """(int32 [N, seq_len], names): up to `n_tokens` tokens of English text from this machine, the long descriptions
    (README text) of the installed Python packages (`importlib.metadata`; which ones depends on the machine: their
    names come back, in the order used), in a seeded order, concatenated and cut into windows (a window may span
    two descriptions)."""
    import importlib.metadata
    import random

    import numpy as np

    bodies = []
    for dist in importlib.metadata.distributions():
        meta = dist.metadata
        body = (meta.get_payload() or meta.get("Description") or "") if meta is not None else ""
        if len(body) > 500:
            bodies.append((meta["Name"] or "?", body))
    ids: list[int] = []
    names: list[str] = []
    for name, body in sorted(bodies, key=lambda b: (random.Random(f"{seed}:{b[1][:64]}").random(), b)):
        ids += tok.encode(body)
        names.append(name)
        if len(ids) >= n_tokens:
            break
    n = min(len(ids), n_tokens) // seq_len
    return np.asarray(ids[: n * seq_len], np.int32).reshape(n, seq_len), names


def chain_attention(cfg, teacher_k, teacher_v, own):
    """An attend function (`models.llama` signature) for depth j >= 2 of every start at once: the query of start t
    sees the teacher entries 0..t (`teacher_k/v` [B, T, nKV, D]) and the chain's own entries of depths 2..j at t
    (`own`: a list of (k, v) [B, T, nKV, D], the current depth's appended here)."""
    import jax
    import jax.numpy as jnp

    b, t = teacher_k.shape[:2]
    g = cfg.q_per_kv
    scale = cfg.head_dim**-0.5
    visible = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]  # [T(query), S]

    def attend(layer, q, k, v, state):
        del layer
        qb = q.reshape(b, t, cfg.num_kv_heads, g, cfg.head_dim).astype(jnp.float32)
        entries = own + [(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), v.reshape(b, t, cfg.num_kv_heads,
                                                                                      cfg.head_dim))]
        s_t = jnp.einsum("btkgd,bskd->btkgs", qb, teacher_k) * scale
        s_t = jnp.where(visible[None, :, None, None, :], s_t, -jnp.inf)
        s_o = jnp.stack([jnp.einsum("btkgd,btkd->btkg", qb, ek) * scale for ek, _ in entries], axis=-1)
        p = jax.nn.softmax(jnp.concatenate([s_t, s_o], axis=-1), axis=-1)
        o = jnp.einsum("btkgs,bskd->btkgd", p[..., :t], teacher_v)
        o = o + sum(p[..., t + i, None] * ev[:, :, :, None, :] for i, (_, ev) in enumerate(entries))
        return o.reshape(b * t, cfg.num_heads, cfg.head_dim).astype(q.dtype), state

    return attend


def draft_layer(tr, frozen, dcfg, feat, nxt, positions, attend, state=None):
    """The draft's layer over inputs (feature [M, H], next token [M]) at `positions` [M]: fc([embed(next); feature])
    then the decoder layer (`tr`: "fc", "fc_b", "layers"; `frozen`: the target's embedding and final norm) ->
    (output [M, H], `attend`'s final state)."""
    import jax.numpy as jnp

    from models.llama import embed_tokens, run_layers

    z = jnp.concatenate([embed_tokens(frozen, nxt, jnp.float32), feat], -1) @ tr["fc"] + tr["fc_b"]
    return run_layers(frozen.replace(layers=tr["layers"]), dcfg, z, positions, attend, state)


def head_logits(h, frozen, cfg, head_rows):
    """The target's final norm and (reduced) head `head_rows` [H, N] over draft outputs h [M, H] -> [M, N]."""
    from models.llama import rms_norm

    return rms_norm(h, frozen.final_norm, cfg.rms_norm_eps) @ head_rows


def teacher_inputs(toks, fts):
    """The draft's teacher-forced inputs of sequences `toks` [B, T] with the target's features `fts` [B, T, H]:
    input t (t < T - 1) is (f[t], x[t + 1]) at position t + 1 -> (features [B(T-1), H], tokens, positions, B, T - 1)."""
    import jax.numpy as jnp

    b, t = toks.shape
    positions = jnp.tile(jnp.arange(1, t, dtype=jnp.int32), b)
    return fts[:, :-1].reshape(b * (t - 1), -1), toks[:, 1:].reshape(-1), positions, b, t - 1


def training_targets(fts, labs, msk):
    """What input t of `teacher_inputs` is trained towards: (the target's feature f[t + 1] [B(T-1), H], the label
    `labs[t + 1]` (the target's token after x[t + 1], i.e. x[t + 2]) [B(T-1)], its mask [B(T-1)])."""
    b, t = labs.shape
    return fts[:, 1:].reshape(b * (t - 1), -1), labs[:, 1:].reshape(-1), msk[:, 1:].reshape(-1)


def draft_chains(tr, frozen, dcfg, head_rows, ids, toks, fts, chain: int, return_hidden: bool = False):
    """int [B, T - 1, chain]: for every start t of `toks` [B, T], the chain of `chain` drafts the draft makes given
    the target's features `fts` [B, T, H] up to t (its cache: the teacher inputs 0..t), draft j proposing
    x[t + 1 + j]; each draft after the first feeds the previous output back as the feature and attends to the
    teacher entries and the chain's own earlier entries (`chain_attention`). `ids` [N]: the head's token ids.
    `return_hidden`: also the layer's outputs [B, T - 1, chain, H] the drafts come from."""
    import jax.numpy as jnp

    from models.llama import dense_causal_attention

    feat, nxt, positions, b, t = teacher_inputs(toks, fts)
    kv_shape = (b, t, dcfg.num_kv_heads, dcfg.head_dim)
    empty = (jnp.zeros(kv_shape, jnp.float32), jnp.zeros(kv_shape, jnp.float32))

    def keep_kv(attend):  # the attend function, also returning this call's (k, v) as its state (the scan's carry)
        def wrapped(layer, q, k, v, state):
            out, _ = attend(layer, q, k, v, None)
            return out, (k.reshape(kv_shape).astype(jnp.float32), v.reshape(kv_shape).astype(jnp.float32))
        return wrapped

    def draft(h):
        return ids[jnp.argmax(head_logits(h, frozen, dcfg, head_rows), -1)]

    h, (tk, tv) = draft_layer(tr, frozen, dcfg, feat, nxt, positions, keep_kv(dense_causal_attention(dcfg, b, t)),
                              empty)
    drafts, outs = [draft(h)], [h]
    own = []
    for j in range(2, chain + 1):
        h, kv = draft_layer(tr, frozen, dcfg, h, drafts[-1], positions + (j - 1),
                            keep_kv(chain_attention(dcfg, tk, tv, list(own))), empty)
        own.append(kv)
        drafts.append(draft(h))
        outs.append(h)
    tokens = jnp.stack(drafts, -1).reshape(b, t, chain)
    return (tokens, jnp.stack(outs, 1).reshape(b, t, chain, -1)) if return_hidden else tokens


def accepted_lengths(drafts, tokens, answer, k: int):
    """int [B, T]: at each start t, how many of the chain's first k drafts (`drafts` [B, T, chain], draft j of
    start t proposing x[t + 1 + j]) match the target's tokens (`tokens` [B, T + 1]) in a row, within the answer
    (`answer` bool [B, T + 1]: x[i] is an answer token)."""
    import numpy as np

    b, t = drafts.shape[:2]
    out = np.zeros((b, t), np.int64)
    alive = np.ones((b, t), bool)
    for j in range(1, k + 1):
        idx = np.arange(t) + 1 + j
        ok = np.zeros((b, t), bool)
        inside = idx < tokens.shape[1]
        ok[:, inside] = (drafts[:, inside, j - 1] == tokens[:, idx[inside]]) & answer[:, idx[inside]]
        alive &= ok
        out += alive
    return out


def replay_steps(lengths, answer) -> tuple[int, int]:
    """(tokens emitted after the first, verification steps) of a greedy replay: the prefill emits the answer's first
    token x[a]; each step then starts at t = i - 1 (i: the last emitted token), accepts `lengths[t]` drafts and
    emits them plus one token, until the answer ends. `lengths` [T] of one sequence, `answer` bool [T + 1]."""
    import numpy as np

    where = np.flatnonzero(answer)
    if len(where) < 2:
        return 0, 0
    i, end, steps = int(where[0]), int(where[-1]), 0
    emitted = 0
    while i < end:
        n = min(int(lengths[i - 1]) + 1, end - i)
        emitted += n
        i += n
        steps += 1
    return emitted, steps


def main(argv):
    del argv
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm import tqdm

    from experiments.distill_draft import copy_prompts, generate_answers, head_token_ids, make_examples, open_prompts
    from experiments.lib.common import workload
    from experiments.lib.serving.env import device_info, git_info, load_average, versions
    from models import load_model
    from models.draft import reduced_head
    from models.linear import matmul
    from models.llama import compute_logits, dense_causal_attention, embed_tokens, hidden_states, rms_norm, run_layers
    from models.quant import quantize

    ks = sorted({int(k) for k in FLAGS.price_ks})
    if FLAGS.chain < 1 or any(not 1 <= k <= FLAGS.chain for k in ks):
        raise app.UsageError(f"--chain must be >= 1 and every --price_ks in [1, --chain]; got {FLAGS.chain}, {ks}")
    t_start = time.perf_counter()
    record = {"flags": {k: getattr(FLAGS, k) for k in (
        "target", "target_quant", "num_prompts", "gen_tokens", "gen_minutes", "steps", "batch_size", "seq_len", "lr",
        "head_vocab", "eval_workloads", "eval_prompts", "eval_tokens", "seed", "chain", "ce_weight", "price",
        "price_ks", "extra_text_tokens", "max_minutes")}, "git": git_info(), "device": device_info(),
        "versions": versions(), "load_before": load_average("feature_draft_study")}
    target = load_model(FLAGS.target)  # float: the draft's initial layer, embedding, norm and head rows
    speaker = target if FLAGS.target_quant == "none" else load_model(FLAGS.target, quant=FLAGS.target_quant)
    cfg, tok = target.config, target.tokenizer
    if cfg.sliding_window is not None:
        raise app.UsageError("the chain evaluation attends over whole prefixes: a sliding-window target is not handled")
    hidden = cfg.hidden_size

    # 1. training text and the target's features over it
    n_open = max(1, FLAGS.num_prompts // 2)
    gen_deadline = t_start + FLAGS.gen_minutes * 60
    pairs = generate_answers(speaker, open_prompts(n_open, FLAGS.seed), FLAGS.gen_tokens, 0.0, FLAGS.seed,
                             t_start + FLAGS.gen_minutes * 30, "generating answers (open)")
    texts = [tok.decode(a, decode_special_tokens=False) for _, a in pairs]
    pairs += generate_answers(speaker, [c for c, _ in copy_prompts(texts, FLAGS.num_prompts - n_open, FLAGS.seed)],
                              FLAGS.gen_tokens, 0.0, FLAGS.seed + 1, gen_deadline, "generating answers (copy)")
    stops = [tok.eos_token_id, *(cfg.eos_token_ids or ())]
    ids = np.asarray(head_token_ids([a for _, a in pairs], FLAGS.head_vocab or cfg.vocab_size, stops), np.int32)
    remap = np.full(cfg.vocab_size, -1, np.int32)
    remap[ids] = np.arange(len(ids), dtype=np.int32)

    def features(tokens):
        return np.concatenate([np.asarray(hidden_states(speaker.params, cfg, jnp.asarray(tokens[i: i + 4])))
                               .reshape(-1, tokens.shape[1], hidden) for i in range(0, len(tokens), 4)])

    tokens, labels, mask = make_examples(pairs, FLAGS.seq_len)
    feats = features(tokens)  # [N, T, H]: f[t] predicts tokens[t + 1]
    extra_tokens, extra_sources = 0, []
    if FLAGS.extra_text_tokens:
        windows, extra_sources = package_text_windows(tok, FLAGS.extra_text_tokens, FLAGS.seq_len, FLAGS.seed)
        argmax = jax.jit(lambda p, h: jnp.argmax(compute_logits(p, cfg, h), -1).astype(jnp.int32))
        head_params = speaker.params.replace(layers=None)
        w_feats, w_labels = [], []
        for i in tqdm(range(0, len(windows), 4), desc="the target's features over other text", unit="batch"):
            f = features(windows[i: i + 4])
            w_feats.append(f)
            w_labels.append(np.asarray(argmax(head_params, jnp.asarray(f.reshape(-1, hidden)))).reshape(f.shape[:2]))
        if w_feats:
            extra_tokens = int(windows.size)
            tokens = np.concatenate([tokens, windows])
            feats = np.concatenate([feats, *w_feats])
            labels = np.concatenate([labels, *w_labels])  # label t: the target's argmax after token t
            mask = np.concatenate([mask, np.ones(windows.shape, np.float32)])
    f_scale = float(np.sqrt(np.mean(feats[mask > 0] ** 2)))
    gen_s = time.perf_counter() - t_start

    # 2. the draft
    dcfg = dataclasses.replace(cfg, num_layers=1)
    frozen = target.params.replace(layers=None)
    head_rows = jnp.asarray(reduced_head(target, ids).params.lm_head)  # [H, N]
    rng = np.random.default_rng(FLAGS.seed)
    fc0 = np.concatenate([rng.normal(0, 0.02, (hidden, hidden)), np.eye(hidden)]).astype(np.float32)
    trainable = {"fc": jnp.asarray(fc0), "fc_b": jnp.zeros((hidden,), jnp.float32),
                 "layers": jax.tree_util.tree_map(lambda a: a[-1:], target.params.layers)}

    def loss_fn(tr, toks, fts, labs, msk):
        feat, nxt, positions, b, t = teacher_inputs(toks, fts)
        h, _ = draft_layer(tr, frozen, dcfg, feat, nxt, positions, dense_causal_attention(dcfg, b, t))
        f_next, lab, m = training_targets(fts, labs, msk)
        reg = jnp.mean(optax.losses.huber_loss((h - f_next) / f_scale, delta=1.0), -1)  # smooth L1, per dimension
        logq = jax.nn.log_softmax(head_logits(h, frozen, cfg, head_rows), -1)
        nll = -jnp.take_along_axis(logq, jnp.maximum(lab, 0)[:, None], -1)[:, 0]
        cm = m * (lab >= 0)
        agree = (jnp.argmax(logq, -1) == lab) * cm
        denom = jnp.maximum(1.0, m.sum())
        return (jnp.sum(reg * m) + FLAGS.ce_weight * jnp.sum(nll * cm)) / denom, jnp.sum(agree) / denom

    steps = FLAGS.steps
    sched = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, max(1, min(100, steps // 20)), steps, FLAGS.lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    opt_state = opt.init(trainable)

    @jax.jit
    def train_step(tr, opt_state, toks, fts, labs, msk):
        (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(tr, toks, fts, labs, msk)
        updates, opt_state = opt.update(grads, opt_state, tr)
        return optax.apply_updates(tr, updates), opt_state, loss, agree

    head_labels = np.where(mask > 0, remap[labels], -1)
    deadline = t_start + FLAGS.max_minutes * 60
    history = []
    bar = tqdm(range(steps), desc="training the feature draft", unit="step")
    for step in bar:
        if time.perf_counter() > deadline:
            bar.write(f"time budget of {FLAGS.max_minutes} min reached at step {step}")
            break
        pick = rng.integers(0, len(tokens), size=FLAGS.batch_size)
        trainable, opt_state, loss, agree = train_step(trainable, opt_state, jnp.asarray(tokens[pick]),
                                                       jnp.asarray(feats[pick]), jnp.asarray(head_labels[pick]),
                                                       jnp.asarray(mask[pick]))
        history.append((float(loss), float(agree)))
        bar.set_postfix(loss=f"{history[-1][0]:.3f}", top1=f"{history[-1][1]:.2f}")

    # 3. chains on the benchmark's workloads
    ids_dev = jnp.asarray(ids)
    chains = jax.jit(lambda tr, toks, fts: draft_chains(tr, frozen, dcfg, head_rows, ids_dev, toks, fts,
                                                        FLAGS.chain))
    evaluation = {}
    for name in FLAGS.eval_workloads:
        ev = generate_answers(speaker, workload(name, FLAGS.eval_prompts, 0), FLAGS.eval_tokens, 0.0, FLAGS.seed,
                              float("inf"), f"target answers ({name} workload)")
        e_tok, _, e_msk = make_examples(ev, max(len(q) + len(a) for q, a in ev))  # whole: no answer cut off
        e_feat = features(e_tok)
        drafts = np.concatenate([np.asarray(chains(trainable, jnp.asarray(e_tok[i: i + 4]),
                                                   jnp.asarray(e_feat[i: i + 4])))
                                 for i in range(0, len(e_tok), 4)])  # [B, T - 1, chain]
        answer = np.zeros(e_tok.shape, bool)
        answer[:, 1:] = e_msk[:, :-1] > 0  # x[i] is an answer token where label i - 1 is
        # start t (input x[t + 1]) is a decoding step when x[t + 1] is an answer token and not the last one
        starts = answer[:, 1:] & np.pad(answer[:, 2:], ((0, 0), (0, 1)))
        full = accepted_lengths(drafts, e_tok, answer, FLAGS.chain)
        depth, reached = [], []
        for j in range(1, FLAGS.chain + 1):  # acceptance of draft j given drafts 1..j-1 accepted
            reach, hit = (full >= j - 1) & starts, (full >= j) & starts
            depth.append(float(hit.sum() / max(1, reach.sum())))
            reached.append(int(reach.sum()))
        by_k = {}
        for k in range(1, FLAGS.chain + 1):
            lengths = np.minimum(full, k)  # the first k drafts' run of matches
            em, st = map(sum, zip(*[replay_steps(lengths[i], answer[i]) for i in range(len(e_tok))]))
            by_k[k] = {"tokens_per_step": em / st if st else None, "steps": int(st), "tokens": int(em)}
        evaluation[name] = {"acceptance_by_depth": depth, "starts_reaching_depth": reached, "by_k": by_k,
                            "prompts": len(ev),
                            "answer_tokens": int(answer.sum())}
        print(f"{name}: acceptance by depth {[round(a, 3) for a in depth]}, tokens per step "
              f"{ {k: v['tokens_per_step'] and round(v['tokens_per_step'], 2) for k, v in by_k.items()} }", flush=True)

    # 4. prices at batch 1
    prices, chain_ms, predictions = {}, {}, {}
    if FLAGS.price:
        prices = price_steps(speaker, ks, workload("copy", 4, FLAGS.seed), FLAGS.eval_tokens)
        last = jax.tree_util.tree_map(lambda a: a[-1:], speaker.params.layers)  # the stored format
        fc_q = quantize(trainable["fc"], "int8")
        head_q = quantize(head_rows, "int8")
        cache_len = 256
        kv = jnp.zeros((2, cache_len, dcfg.num_kv_heads, dcfg.head_dim), jnp.float32)

        def one(carry, _):
            feat, nxt, pos, kv = carry
            z = matmul(jnp.concatenate([embed_tokens(speaker.params, nxt, jnp.float32), feat], -1), fc_q)

            def attend(layer, q, k, v, state):
                state = state.at[0, pos[0]].set(k[0].astype(jnp.float32)).at[1, pos[0]].set(v[0].astype(
                    jnp.float32))
                qb = q.reshape(dcfg.num_kv_heads, dcfg.q_per_kv, dcfg.head_dim).astype(jnp.float32)
                s = jnp.einsum("kgd,skd->kgs", qb, state[0]) * dcfg.head_dim**-0.5
                s = jnp.where(jnp.arange(cache_len) <= pos[0], s, -jnp.inf)
                o = jnp.einsum("kgs,skd->kgd", jax.nn.softmax(s, -1), state[1])
                return o.reshape(1, dcfg.num_heads, dcfg.head_dim).astype(q.dtype), state

            h, kv = run_layers(speaker.params.replace(layers=last), dcfg, z, pos, attend, kv)
            logits = matmul(rms_norm(h, frozen.final_norm, cfg.rms_norm_eps), head_q)
            return (h, ids_dev[jnp.argmax(logits, -1)], pos + 1, kv), None

        for k in ks:
            run = jax.jit(lambda f, n, p, c, _k=k: jax.lax.scan(one, (f, n, p, c), None, length=_k)[0][1])
            args = (jnp.zeros((1, hidden), jnp.float32), jnp.zeros((1,), jnp.int32), jnp.full((1,), 100, jnp.int32),
                    kv)
            jax.block_until_ready(run(*args))
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                jax.block_until_ready(run(*args))
                times.append(time.perf_counter() - t0)
            chain_ms[k] = 1e3 * float(np.median(times))
            p = prices[k]
            if p["plain_ms"] and p["verify_ms"]:
                cost = (p["verify_ms"] + chain_ms[k]) / p["plain_ms"]
                predictions[k] = {"step_cost_in_plain_steps": cost, **{
                    name: ev["by_k"][k]["tokens_per_step"] / cost for name, ev in evaluation.items()
                    if ev["by_k"][k]["tokens_per_step"]}}
            print(f"k={k}: draft chain {chain_ms[k]:.2f} ms; predicted speed-up {predictions.get(k)}", flush=True)

    record.update({"train_examples": len(pairs), "extra_text_tokens": extra_tokens, "extra_text_sources": extra_sources,
                   "train_label_tokens": int(mask.sum()), "head_tokens": len(ids),
                   "feature_rms": f_scale, "generation_s": gen_s, "steps_run": len(history), "loss_top1": history,
                   "evaluation": evaluation, "step_prices": prices, "chain_ms": chain_ms,
                   "predicted_speedup": predictions, "seconds": time.perf_counter() - t_start,
                   "load_after": load_average()})
    write_record(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
