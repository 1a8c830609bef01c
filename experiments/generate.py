"""Main job: stream a generation from the embedded SmolLM2-135M-Instruct (or any supported model) on the CPU.

    python -m experiments.generate --prompt "Write a haiku about paged attention."

This is the single-job streaming path over the paged engine; continuous batching of many jobs arrives with
`paged.DynamicGenerator`.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "embedded name, HF directory, or .gguf file")
flags.DEFINE_string("prompt", "What is the capital of France? Answer in one sentence.", "the prompt")
flags.DEFINE_bool("chat", True, "wrap the prompt in the model's chat template (needs a template)")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate at most")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top_k", 50, "top-k (0 = off)")
flags.DEFINE_float("top_p", 0.8, "top-p (1 = off)")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_integer("page_size", 64, "KV-cache page size (tokens)")
flags.DEFINE_integer("max_chunk_size", 256, "prefill chunk (tokens per step)")
flags.DEFINE_integer("max_seq_len", 2048, "longest sequence")
flags.DEFINE_string("compilation_cache_dir", None, "persistent JAX compilation cache directory")


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)  # "no TPU" notices are noise here
    from models import load_model
    from paged.batch import RowInput
    from paged.engine import Engine

    t0 = time.perf_counter()
    model = load_model(FLAGS.model)
    tok = model.tokenizer
    if tok is None:
        raise app.UsageError(f"{FLAGS.model} has no tokenizer; this job needs one")
    text = FLAGS.prompt
    if FLAGS.chat and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.encode(text, encode_special_tokens=True)
    if len(ids) + FLAGS.max_new_tokens > FLAGS.max_seq_len:
        raise app.UsageError("prompt + max_new_tokens exceeds --max_seq_len")
    pages_needed = -(-(len(ids) + FLAGS.max_new_tokens) // FLAGS.page_size)
    engine = Engine(model, num_pages=pages_needed + 1, page_size=FLAGS.page_size, max_batch_size=1,
                    max_chunk_size=FLAGS.max_chunk_size, max_seq_len=FLAGS.max_seq_len,
                    compilation_cache_dir=FLAGS.compilation_cache_dir)
    pages = list(range(1, pages_needed + 1))
    sampling = dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed)
    print(f"[loaded {FLAGS.model} in {time.perf_counter() - t0:.1f}s; prompt {len(ids)} tokens]", file=sys.stderr)

    # Prefill all but the last prompt token in chunks, then decode from the last prompt token (as ExLlamaV2 does).
    pos = 0
    t_first = time.perf_counter()
    while pos < len(ids) - 1:
        chunk = ids[pos : min(pos + FLAGS.max_chunk_size, len(ids) - 1)]
        engine.run([RowInput(tokens=chunk, start_pos=pos, pages=pages, sample=False)])
        pos += len(chunk)
    out: list[int] = []
    printed = ""
    last = ids[-1]
    t_decode = None
    stops = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for _ in range(FLAGS.max_new_tokens):
        res = engine.run([RowInput(tokens=[last], start_pos=pos, pages=pages, sampling=sampling)])
        if t_decode is None:
            t_decode = time.perf_counter()
            ttft = t_decode - t_first
        pos += 1
        last = int(res.token[0])
        if last in stops:
            break
        out.append(last)
        text = tok.decode(out)
        if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    dt = time.perf_counter() - (t_decode or time.perf_counter())
    print(file=sys.stdout)
    rate = (len(out) - 1) / dt if len(out) > 1 and dt > 0 else float("nan")
    print(f"[{len(out)} tokens; first token after {ttft:.2f}s (includes compilation); {rate:.1f} tok/s decode]",
          file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
