"""What a matmul implementation does to the model's output: teacher-forced logits and greedy text, against a baseline.

A kernel that passes the conformance suite within its tolerance can still change what the model says; this measures
by how much, on a real model. Two checks, each against the first implementation of `--impls` (the baseline):

- **teacher-forced**: the same token sequences (seeded texts, chat-formatted) through `models.llama.forward` with each
  implementation forced for every matmul; per implementation the perplexity of the texts, the fraction of positions
  whose top-1 token equals the baseline's, and the mean and largest KL(baseline || impl) per position;
- **greedy**: each prompt decoded greedily by the generator with `matmul_impl` set to the implementation; how many
  prompts give the same text, and the mean length of the common prefix (in tokens).

    python -m experiments.matmul_quality --impls xla,native,auto --json_out experiments/results/matmul_quality_cpu.json

`auto` in the greedy check is what serving uses (on the CPU: native for decode rows, XLA for prefill); in the
teacher-forced check an impl name is forced on every row (`auto` would pick XLA for these long sequences).
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from experiments.lib import engine_flags
from experiments.lib.common import CHAT, TEXTS, chat_prompt, check_out_flag, write_record

FLAGS = flags.FLAGS
engine_flags.define()  # --model, --quant (keep: a GGUF's blocks as stored), ... shared with the other scripts
flags.DEFINE_list("impls", ["xla", "native", "auto"], "matmul implementations; the first is the baseline")
flags.DEFINE_bool("float_reference", True, "teacher-forced check: also run the model loaded as float32 (a GGUF's "
                  "blocks dequantized at load: the exact product every matmul implementation approximates)")
flags.DEFINE_integer("greedy_tokens", 64, "greedy check: tokens per prompt")
flags.DEFINE_integer("greedy_prompts", 8, "greedy check: chat prompts (cycled from the built-in list)")
# (the shared help offers 'tiny', which has no tokenizer: this check needs one)
FLAGS["model"].help = ("'smollm2-135m' (embedded), an HF directory or a .gguf file: a model with a tokenizer (not "
                       "'tiny' or a preset)")
if "json_out" not in FLAGS:  # other experiment scripts define it too (same meaning)
    flags.DEFINE_string("json_out", None, "write the record here")
    check_out_flag("json_out")


def teacher_forced_sequences(tokenizer, max_len: int = 160) -> list[list[int]]:
    """The built-in texts, each asked back as a chat turn and answered with itself: prompt and answer tokens."""
    seqs = []
    for text in TEXTS:
        chat = chat_prompt(tokenizer, "Please repeat after me.") + text + "<|im_end|>\n"
        seqs.append(tokenizer.encode(chat, encode_special_tokens=True)[:max_len])
    for q in CHAT:
        seqs.append(tokenizer.encode(chat_prompt(tokenizer, q), encode_special_tokens=True)[:max_len])
    return seqs


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def teacher_forced_report(model, impls: list[str], seqs: list[list[int]],
                          extra: dict[str, tuple] | None = None) -> dict[str, dict]:
    """Per implementation: perplexity over `seqs`, and (for all but the first) top-1 agreement with the first and
    KL(first || impl) per position. Sequences are right-padded into one batch; only real positions count. `extra`
    adds labelled `(model, impl)` runs compared the same way (e.g. the model loaded as float32)."""
    import jax.numpy as jnp

    from models.llama import forward

    t = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), t), np.int32)
    mask = np.zeros((len(seqs), t), bool)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
        mask[i, :len(s) - 1] = True  # positions that predict a real next token
    runs = {impl: (model, impl) for impl in impls}
    for label, run in (extra or {}).items():
        if label in runs:
            raise ValueError(f"extra run {label!r} has the name of an implementation; give it another label")
        runs[label] = run
    logp = {}
    for label, (m, impl) in runs.items():
        logits = np.asarray(forward(m.params, m.config, jnp.asarray(tokens), matmul_impl=impl), np.float64)
        logp[label] = _log_softmax(logits)
    nxt = np.concatenate([tokens[:, 1:], np.zeros((len(seqs), 1), np.int32)], axis=1)
    base = logp[impls[0]]
    report = {}
    for impl in runs:
        lp = logp[impl]
        nll = -np.take_along_axis(lp, nxt[..., None], -1)[..., 0][mask]
        entry = {"perplexity": float(np.exp(nll.mean())), "positions": int(mask.sum())}
        if impl != impls[0]:
            kl = (np.exp(base) * (base - lp)).sum(-1)[mask]
            entry.update(top1_agreement=float((lp.argmax(-1) == base.argmax(-1))[mask].mean()),
                         mean_kl=float(kl.mean()), max_kl=float(kl.max()))
        report[impl] = entry
    return report


def greedy_report(model, impls: list[str], prompts: list[list[int]], max_new_tokens: int) -> dict[str, dict]:
    """Per implementation: the greedy outputs of `prompts` through the generator, and (for all but the first) how
    many equal the first implementation's and the mean common-prefix length."""
    from paged import DynamicGenerator, Job, SamplingSettings

    outs = {}
    for impl in impls:
        gen = DynamicGenerator(model, max_batch_size=len(prompts), max_seq_len=512, matmul_impl=impl)
        stop = [model.tokenizer.eos_token_id] if getattr(model.tokenizer, "eos_token_id", None) is not None else None
        jobs = [Job(p, max_new_tokens, gen_settings=SamplingSettings.greedy(), stop_conditions=stop,
                    identifier=i) for i, p in enumerate(prompts)]
        gen.enqueue(jobs)
        got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r["stage"] == "streaming":
                    got[r["identifier"]] += list(r.get("token_ids", []))
        outs[impl] = [got[i] for i in range(len(prompts))]
    report = {}
    for impl in impls:
        entry = {"new_tokens": sum(len(o) for o in outs[impl])}
        if impl != impls[0]:
            prefix = [_common_prefix(a, b) for a, b in zip(outs[impls[0]], outs[impl])]
            entry.update(identical=sum(a == b for a, b in zip(outs[impls[0]], outs[impl])), prompts=len(prompts),
                         mean_common_prefix=float(np.mean(prefix)))
        report[impl] = entry
    return report, outs


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_flags() -> None:
    """Every flag checked before the model loads: app.UsageError naming the flag."""
    from pallas_kernels.registry import KernelError, matmul_registry

    if FLAGS.model == "tiny" or FLAGS.model.startswith("preset:"):
        raise app.UsageError(f"--model={FLAGS.model} has no tokenizer; matmul_quality needs a model with one (e.g. "
                             "the default smollm2-135m)")
    engine_flags.validate()
    if not FLAGS.impls:
        raise app.UsageError("--impls needs at least one matmul implementation (the first is the baseline)")
    reg = matmul_registry()
    for impl in FLAGS.impls:
        try:
            reg.get(impl)
        except KernelError as e:
            raise app.UsageError(f"--impls: {e}") from None
    if all(i == "auto" for i in FLAGS.impls):
        raise app.UsageError("--impls needs an implementation besides 'auto' (the teacher-forced check forces a "
                             "named one on every row)")
    for name in ("greedy_tokens", "greedy_prompts"):
        if getattr(FLAGS, name) < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")


def main(argv):
    del argv
    from experiments.lib.serving.env import device_info, git_info, load_average, versions
    from models import load_model

    check_flags()
    model = engine_flags.load_model()
    tok = model.tokenizer
    if tok is None:
        raise app.UsageError(f"--model {FLAGS.model} has no tokenizer; matmul_quality needs a model with one")
    record = {"flags": {k: getattr(FLAGS, k) for k in ("model", "quant", "impls", "float_reference",
                                                        "greedy_tokens", "greedy_prompts")},
              "git": git_info(), "device": device_info(), "versions": versions(),
              "load_before": load_average("matmul_quality")}
    tf_impls = [i for i in FLAGS.impls if i != "auto"]
    extra = {}
    if FLAGS.float_reference and FLAGS.quant != "none":
        extra["float32 weights"] = (load_model(FLAGS.model, load_tokenizer=False), "xla")
    record["teacher_forced"] = teacher_forced_report(model, tf_impls, teacher_forced_sequences(tok), extra)
    prompts = [tok.encode(chat_prompt(tok, CHAT[i % len(CHAT)]), encode_special_tokens=True)
               for i in range(FLAGS.greedy_prompts)]
    record["greedy"], outs = greedy_report(model, FLAGS.impls, prompts, FLAGS.greedy_tokens)
    record["greedy_texts"] = {impl: [tok.decode(o) for o in outs[impl]] for impl in FLAGS.impls}
    record["load_after"] = load_average()
    base = FLAGS.impls[0]
    print(f"teacher-forced ({record['teacher_forced'][tf_impls[0]]['positions']} positions), baseline {base}:")
    for impl, e in record["teacher_forced"].items():
        extra = ("" if impl == base else f"  top-1 agreement {100 * e['top1_agreement']:.2f}%  KL mean "
                 f"{e['mean_kl']:.2e} max {e['max_kl']:.2e}")
        print(f"  {impl:>15}: perplexity {e['perplexity']:.3f}{extra}")
    print(f"greedy ({FLAGS.greedy_prompts} prompts x {FLAGS.greedy_tokens} tokens), baseline {base}:")
    for impl, e in record["greedy"].items():
        if impl != base:
            print(f"  {impl:>8}: {e['identical']}/{e['prompts']} identical, mean common prefix "
                  f"{e['mean_common_prefix']:.1f} tokens")
    write_record(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
