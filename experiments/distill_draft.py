"""Distil a small draft model for speculative decoding from the target (default: the embedded SmolLM2-135M).

The draft keeps the target's tokenizer, embedding and tied LM head (frozen: the draft's distribution lives in the
same vocabulary), and `--layers` decoder layers initialised from the target's (the first ones, or spread evenly over
the depth with `--init=spread`). Training data is text the target generates from a seeded prompt set (sampled at
`--gen_temperature`); the loss is the KL divergence from the target's next-token distribution to the draft's, at
every position (distillation: the draft learns to predict what the target would say, which is what acceptance
needs). optax AdamW with warm-up and cosine decay; the weights are the project's flax `Weights` pytree.

Writes `--out/model.safetensors` (HF tensor names) and `--out/config.json`, which `models.load_model(out)` reads;
the draft has no tokenizer files: pass the target's (`DynamicGenerator(target, draft_model=load_model(out,
load_tokenizer=False))`). Stops at `--max_minutes` (default 30) whatever `--steps` says, with a tqdm bar.

Full run (~30 min on the 2-core CPU):
    python -m experiments.distill_draft --out=/tmp/smollm2-draft-4l
Smoke run (~1 min):
    python -m experiments.distill_draft --out=/tmp/draft-smoke --num_prompts=4 --gen_tokens=24 --steps=3 \
        --batch_size=2 --seq_len=48 --max_minutes=2
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

flags.DEFINE_string("target", "smollm2-135m", "target model (anything models.load_model accepts)")
flags.DEFINE_string("out", None, "output directory (model.safetensors + config.json)")
flags.DEFINE_integer("layers", 4, "decoder layers of the draft")
flags.DEFINE_enum("init", "first", ["first", "spread"], "initialise from the target's first layers, or spread evenly")
flags.DEFINE_integer("num_prompts", 96, "prompts in the seeded prompt set")
flags.DEFINE_integer("gen_tokens", 160, "tokens the target generates per prompt")
flags.DEFINE_float("gen_temperature", 0.7, "sampling temperature of the generated training text")
flags.DEFINE_integer("steps", 400, "training steps (capped by --max_minutes)")
flags.DEFINE_integer("batch_size", 8, "sequences per step")
flags.DEFINE_integer("seq_len", 128, "tokens per training sequence")
flags.DEFINE_float("lr", 3e-4, "peak learning rate")
flags.DEFINE_float("kl_temperature", 1.0, "temperature of both distributions in the KL loss")
flags.DEFINE_integer("seed", 0, "seed of the prompt set, the generation and the batches")
flags.DEFINE_float("max_minutes", 30.0, "wall-clock budget for generation + training")
FLAGS = flags.FLAGS

TOPICS = ["the ocean", "a small town", "python programming", "the history of Rome", "cooking pasta", "climate",
          "a robot", "friendship", "mathematics", "the moon", "gardening", "music theory", "a detective story",
          "machine learning", "coffee", "mountains", "a letter to a friend", "the internet", "birds", "chess"]
TASKS = ["Write a short story about {}.", "Explain {} to a child.", "Give three facts about {}.",
         "Write a poem about {}.", "Summarise what you know about {}.", "Write a dialogue about {}.",
         "Rewrite this sentence in your own words: {} is more interesting than it seems.",
         "Write Python code that prints a list of words about {}."]


def prompt_set(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [rng.choice(TASKS).format(rng.choice(TOPICS)) for _ in range(n)]


def draft_params(target, layers: int, init: str):
    import jax
    import numpy as np

    total = target.config.num_layers
    idx = list(range(layers)) if init == "first" else np.linspace(0, total - 1, layers).round().astype(int).tolist()
    sliced = jax.tree_util.tree_map(lambda a: a[np.asarray(idx)], target.params.layers)
    return target.params.replace(layers=sliced), idx


def save_hf(params, cfg, target_cfg_dict: dict, out: str) -> None:
    """`params` (a `Weights` with tied embeddings, float) as HF-named safetensors + config.json."""
    import numpy as np
    from safetensors.numpy import save_file

    d = cfg.head_dim
    nq, nkv, f = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": np.asarray(params.embed, np.float32),
                                "model.norm.weight": np.asarray(params.final_norm, np.float32)}
    lw = params.layers
    if lw.fused_groups != 1:  # regrouped for tensor parallelism (models.fused): the columns are not [q | k | v]
        raise ValueError("save the model's own weights, not an engine's tensor-parallel copy (fused_groups > 1)")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = np.asarray(lw.wqkv[i], np.float32).T  # [out, in]
        t[p + "self_attn.q_proj.weight"] = qkv[:nq]
        t[p + "self_attn.k_proj.weight"] = qkv[nq : nq + nkv]
        t[p + "self_attn.v_proj.weight"] = qkv[nq + nkv :]
        t[p + "self_attn.o_proj.weight"] = np.asarray(lw.wo[i], np.float32).T
        gu = np.asarray(lw.w_gate_up[i], np.float32).T
        t[p + "mlp.gate_proj.weight"] = gu[:f]
        t[p + "mlp.up_proj.weight"] = gu[f:]
        t[p + "mlp.down_proj.weight"] = np.asarray(lw.w_down[i], np.float32).T
        t[p + "input_layernorm.weight"] = np.asarray(lw.attn_norm[i], np.float32)
        t[p + "post_attention_layernorm.weight"] = np.asarray(lw.mlp_norm[i], np.float32)
    os.makedirs(out, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump({**target_cfg_dict, "num_hidden_layers": cfg.num_layers}, fh, indent=2)


def hf_config(cfg) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32",
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else None}


def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required")
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm import tqdm

    from models import load_model
    from models.llama import forward
    from paged import DynamicGenerator, SamplingSettings

    t_start = time.perf_counter()
    deadline = t_start + FLAGS.max_minutes * 60
    target = load_model(FLAGS.target)
    rs = target.config.rope_scaling
    if (rs is not None and rs.rope_type != "default") or not target.config.tie_word_embeddings:
        raise app.UsageError("this script writes a tied-embedding Llama draft without rope scaling")
    tok = target.tokenizer
    # 1. training text: the target's own continuations of a seeded prompt set
    prompts = prompt_set(FLAGS.num_prompts, FLAGS.seed)
    gen = DynamicGenerator(target, max_batch_size=16, max_seq_len=FLAGS.gen_tokens + 128)
    settings = SamplingSettings(temperature=FLAGS.gen_temperature, top_p=0.95)
    seqs: list[list[int]] = []
    bar = tqdm(range(0, len(prompts), 16), desc="generating training text", unit="batch")
    for i in bar:
        chunk = prompts[i : i + 16]
        texts = gen.generate(chunk, FLAGS.gen_tokens, gen_settings=settings, seed=FLAGS.seed * 1000 + i,
                             completion_only=False)
        seqs += [tok.encode(t) for t in texts]
        if time.perf_counter() > deadline - 60:
            break
    del gen
    stream = np.asarray([t for s in seqs for t in s], np.int32)
    n_windows = max(1, (len(stream) - 1) // FLAGS.seq_len)
    windows = stream[: n_windows * FLAGS.seq_len].reshape(n_windows, FLAGS.seq_len)
    # 2. the draft: target layers, frozen embedding/head
    params, idx = draft_params(target, FLAGS.layers, FLAGS.init)
    dcfg = dataclasses.replace(target.config, num_layers=FLAGS.layers)
    trainable = {"layers": params.layers, "final_norm": params.final_norm}
    frozen_embed = params.embed
    total_steps = FLAGS.steps
    sched = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, max(1, total_steps // 20), total_steps, FLAGS.lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    opt_state = opt.init(trainable)
    tau = FLAGS.kl_temperature

    @jax.jit
    def teacher(tokens):
        return jax.nn.log_softmax(forward(target.params, target.config, tokens) / tau, axis=-1)

    @jax.jit
    def train_step(trainable, opt_state, tokens, teacher_logp):
        def loss_fn(tr):
            p = params.replace(layers=tr["layers"], final_norm=tr["final_norm"], embed=frozen_embed)
            logq = jax.nn.log_softmax(forward(p, dcfg, tokens) / tau, axis=-1)
            kl = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - logq), axis=-1)  # [B, T]
            agree = jnp.mean(jnp.argmax(logq, -1) == jnp.argmax(teacher_logp, -1))
            return jnp.mean(kl), agree

        (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, agree

    rng = np.random.default_rng(FLAGS.seed)
    history = []
    bar = tqdm(range(total_steps), desc="distilling", unit="step")
    for step in bar:
        if time.perf_counter() > deadline:
            bar.write(f"time budget of {FLAGS.max_minutes} min reached at step {step}")
            break
        batch = jnp.asarray(windows[rng.integers(0, len(windows), size=FLAGS.batch_size)])
        trainable, opt_state, loss, agree = train_step(trainable, opt_state, batch, teacher(batch))
        history.append((float(loss), float(agree)))
        bar.set_postfix(kl=f"{history[-1][0]:.3f}", top1=f"{history[-1][1]:.2f}")
    final = params.replace(layers=trainable["layers"], final_norm=trainable["final_norm"])
    save_hf(final, dcfg, hf_config(target.config), FLAGS.out)
    with open(os.path.join(FLAGS.out, "distill_log.json"), "w") as fh:
        json.dump({"flags": {k: getattr(FLAGS, k) for k in ("target", "layers", "init", "num_prompts", "gen_tokens",
                                                            "gen_temperature", "steps", "batch_size", "seq_len",
                                                            "lr", "kl_temperature", "seed", "max_minutes")},
                   "init_layers": idx, "train_tokens": int(windows.size), "steps_run": len(history),
                   "loss_top1": history, "seconds": time.perf_counter() - t_start}, fh)
    print(f"wrote {FLAGS.out}: {FLAGS.layers} layers (from target layers {idx}), {len(history)} steps, "
          f"last KL {history[-1][0] if history else float('nan'):.3f}")


if __name__ == "__main__":
    app.run(main)
