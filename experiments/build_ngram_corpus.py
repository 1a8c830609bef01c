"""Build the n-gram drafter's corpus table (`paged.speculation.ngram_corpus.NgramCorpus`) from the model's own answers.

The model answers a seeded prompt set with greedy decoding and continuous batching (`experiments.lib.answers`): open
requests (none of them a benchmark prompt), then copy requests over those answers (`--num_prompts`, half each,
as the distilled draft's training text). Every answer, with the last `--max_ngram` tokens of its prompt (the chat
template's "assistant" header, so the table knows how answers begin), goes into the table; `--prompts_file`
adds the model's answers to prompts of your own (JSONL, a "prompt" per line), `--text_files` plain text files,
tokenized with the model's tokenizer. The table is written as `.npz` (`--out`), and a
JSON log next to it (`<out>.json`: flags, answers, tokens, contexts, seconds).

    python -m experiments.build_ngram_corpus --out=/tmp/smollm2-corpus.npz        # ~10 min on the 2-core CPU
    python -m experiments.build_ngram_corpus --out=/tmp/corpus-smoke.npz --num_prompts=8 --gen_tokens=16
    python -m experiments.generate --ngram_draft --ngram_corpus=/tmp/smollm2-corpus.npz --adaptive_draft

docs/notes/speculative-journal.md, "A corpus table for the n-gram drafter (2026-11-29, AMD EPYC host)", has what it
gains.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from experiments.lib.common import check_out_flag, read_jsonl

flags.DEFINE_string("model", "smollm2-135m", "the model (anything models.load_model accepts)")
flags.DEFINE_string("quant", "keep", "its weights, as the benchmark runs it: keep (GGUF blocks), none, int8, int4")
flags.DEFINE_string("out", None, "the table's path (.npz)")
check_out_flag("out")  # checked when the flags are parsed: not after the model has answered everything
flags.DEFINE_integer("num_prompts", 4000, "prompts the model answers (half open requests, half copy requests over "
                     "its open answers); 0: only --text_files")
flags.DEFINE_integer("gen_tokens", 128, "tokens per answer (at most)")
flags.DEFINE_integer("gen_batch", 32, "jobs generating at once")
flags.DEFINE_float("gen_minutes", 30.0, "stop asking new prompts after this long")
flags.DEFINE_string("prompts_file", None, "JSONL of your own prompts that the model answers too (a table for your "
                    "domain): a \"prompt\" string per line, answered alone in the chat template, greedy, up to "
                    "--gen_tokens (other keys, such as generate.py's system, messages or stop, are ignored)")
flags.DEFINE_list("text_files", [], "plain text files added to the corpus (one sequence per file)")
flags.DEFINE_integer("min_ngram", 2, "shortest context kept")
flags.DEFINE_integer("max_ngram", 6, "longest context kept")
flags.DEFINE_integer("min_count", 2, "a context is kept when its top continuation was seen at least this often")
flags.DEFINE_float("min_confidence", 0.3, "a proposal's chain stops where the product of its drafts' confidences "
                   "falls under this (saved with the table)")
flags.DEFINE_integer("seed", 0, "seed of the prompt set")
FLAGS = flags.FLAGS


def prompt_of(obj, lineno: int, index: int) -> str:
    """A `--prompts_file` line's "prompt" (`experiments.lib.common.read_jsonl`'s parser)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
        raise ValueError('needs a non-empty "prompt" string')
    return obj["prompt"]


def check_flags() -> None:
    """app.UsageError naming the flag for a bad value: before the model loads and answers anything."""
    from experiments.lib.common import check_quant_flag
    from paged.speculation.ngram_corpus import MAX_NGRAM

    if not FLAGS.out:
        raise app.UsageError("--out is required (the table's .npz path)")
    if (not 1 <= FLAGS.min_ngram <= FLAGS.max_ngram <= MAX_NGRAM or FLAGS.min_count < 1
            or not 0 <= FLAGS.min_confidence <= 1):
        raise app.UsageError(f"need 1 <= --min_ngram <= --max_ngram <= {MAX_NGRAM}, --min_count >= 1 and "
                             "--min_confidence in [0, 1]")
    check_quant_flag("quant")
    if FLAGS.num_prompts < 0:
        raise app.UsageError(f"--num_prompts must be >= 0 (0: only --prompts_file / --text_files), got "
                             f"{FLAGS.num_prompts}")
    if FLAGS.num_prompts == 0 and not FLAGS.text_files and not FLAGS.prompts_file:
        raise app.UsageError("nothing to build from: give --num_prompts > 0, --prompts_file or --text_files")
    for name in ("gen_tokens", "gen_batch"):
        if getattr(FLAGS, name) < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    if FLAGS.num_prompts > 0 and not FLAGS.gen_minutes > 0:
        raise app.UsageError(f"--gen_minutes must be > 0 (the time the model answers --num_prompts), got "
                             f"{FLAGS.gen_minutes}")


def main(argv):
    del argv
    check_flags()
    own = read_jsonl(FLAGS.prompts_file, "--prompts_file", prompt_of, app.UsageError) if FLAGS.prompts_file else []
    own_texts = []  # read before the model answers anything: a bad path fails at once
    for path in FLAGS.text_files:
        try:
            with open(path, encoding="utf-8") as fh:
                own_texts.append(fh.read())
        except (OSError, UnicodeDecodeError) as e:
            raise app.UsageError(f"--text_files {path}: cannot read it as UTF-8 text: {e}") from None
    from experiments.lib.answers import answer_prompt_set, generate_answers
    from experiments.lib.common import model_flag
    from models import load_model
    from paged.speculation.ngram_corpus import NgramCorpus

    t0 = time.perf_counter()
    with model_flag("model", FLAGS.model):
        model = load_model(FLAGS.model, quant=None if FLAGS.quant == "none" else FLAGS.quant)
    tok = model.tokenizer
    if tok is None:
        raise app.UsageError(f"--model {FLAGS.model} has no tokenizer: the corpus is the model's own text")
    sequences: list[list[int]] = []
    answers = 0
    if FLAGS.num_prompts > 0:
        deadline = t0 + FLAGS.gen_minutes * 60
        pairs, _ = answer_prompt_set(model, FLAGS.num_prompts, FLAGS.gen_tokens, 0.0, FLAGS.seed,
                                     t0 + FLAGS.gen_minutes * 30, deadline, FLAGS.gen_batch, desc="answering")
        sequences += [list(p[-FLAGS.max_ngram:]) + list(a) for p, a in pairs]
        answers = len(pairs)
    if own:
        pairs = generate_answers(model, own, FLAGS.gen_tokens, 0.0, FLAGS.seed + 2, time.perf_counter() + 1e9,
                                 "answering (--prompts_file)", FLAGS.gen_batch)
        sequences += [list(p[-FLAGS.max_ngram:]) + list(a) for p, a in pairs]
        answers += len(pairs)
    for text in own_texts:
        sequences.append([int(t) for t in tok.encode(text, encode_special_tokens=False)])
    corpus = NgramCorpus.build(sequences, model.config.vocab_size, min_ngram=FLAGS.min_ngram,
                               max_ngram=FLAGS.max_ngram, min_count=FLAGS.min_count,
                               min_confidence=FLAGS.min_confidence)
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    corpus.save(FLAGS.out)
    log = {"flags": {k: getattr(FLAGS, k) for k in ("model", "quant", "out", "num_prompts", "gen_tokens", "gen_batch",
                                                     "gen_minutes", "prompts_file", "text_files", "min_ngram",
                                                     "max_ngram", "min_count", "min_confidence", "seed")},
           "answers": answers, "corpus_tokens": corpus.corpus_tokens, "contexts": len(corpus),
           "contexts_by_order": {str(n): len(c) for n, (c, _) in corpus.arrays.items()},
           "seconds": time.perf_counter() - t0}
    with open(f"{FLAGS.out}.json", "w") as fh:
        json.dump(log, fh, indent=2)
    print(f"{corpus}\nwrote {FLAGS.out} and {FLAGS.out}.json in {log['seconds']:.0f} s")


if __name__ == "__main__":
    app.run(main)
