"""Main job: stream a generation from the embedded SmolLM2-135M-Instruct (or any supported model).

    python -m experiments.generate --prompt "Write a haiku about paged attention."
    python -m experiments.generate --nochat --prompt "Once upon a time" --temperature 0.8 --seed 1

One job through `paged.DynamicGenerator`: the prompt is prefilled in chunks, then tokens stream as they are
sampled. Timing (time to first token, decode rate) goes to stderr.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "embedded name, HF directory, or .gguf file")
flags.DEFINE_string("prompt", "What is the capital of France? Answer in one sentence.", "the prompt")
flags.DEFINE_string("system", None, "optional system message (chat mode)")
flags.DEFINE_bool("chat", True, "wrap the prompt in the model's chat template (needs a template)")
flags.DEFINE_integer("max_new_tokens", 128, "tokens to generate at most")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top_k", 50, "top-k (0 = off)")
flags.DEFINE_float("top_p", 0.8, "top-p (1 = off)")
flags.DEFINE_float("min_p", 0.0, "min-p (0 = off)")
flags.DEFINE_float("repetition_penalty", 1.0, "1 = off")
flags.DEFINE_integer("seed", None, "sampling seed (None = random)")
flags.DEFINE_list("stop", [], "extra stop strings")
flags.DEFINE_integer("page_size", 64, "KV-cache page size (tokens)")
flags.DEFINE_integer("num_pages", None, "KV-cache pages (default: enough for max_batch_size x max_seq_len)")
flags.DEFINE_integer("max_chunk_size", 256, "prefill chunk (tokens per step)")
flags.DEFINE_integer("max_seq_len", 2048, "longest sequence")
flags.DEFINE_string("compilation_cache_dir", None, "persistent JAX compilation cache directory")


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)  # "no TPU" notices are noise here
    from models import load_model
    from paged import DynamicGenerator, Job, SamplingSettings

    t0 = time.perf_counter()
    model = load_model(FLAGS.model)
    tok = model.tokenizer
    if tok is None:
        raise app.UsageError(f"{FLAGS.model} has no tokenizer; this job needs one")
    text = FLAGS.prompt
    if FLAGS.chat and tok.chat_template:
        messages = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else [])
        text = tok.apply_chat_template(messages + [{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.encode(text, encode_special_tokens=True)
    gen = DynamicGenerator(model, num_pages=FLAGS.num_pages, page_size=FLAGS.page_size, max_batch_size=1,
                           max_chunk_size=FLAGS.max_chunk_size, max_seq_len=FLAGS.max_seq_len,
                           compilation_cache_dir=FLAGS.compilation_cache_dir)
    settings = SamplingSettings(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                                min_p=FLAGS.min_p, repetition_penalty=FLAGS.repetition_penalty)
    stops = [t for t in (tok.eos_token_id,) if t is not None] + list(FLAGS.stop)
    print(f"[loaded {FLAGS.model} in {time.perf_counter() - t0:.1f}s; prompt {len(ids)} tokens]", file=sys.stderr)
    gen.enqueue(Job(ids, FLAGS.max_new_tokens, gen_settings=settings, stop_conditions=stops, seed=FLAGS.seed))
    t_start = time.perf_counter()
    final = None
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] == "streaming":
                sys.stdout.write(r["text"])
                sys.stdout.flush()
            if r["eos"]:
                final = r
    print()
    n = final["new_tokens"]
    ttft = final["time_enqueued"] + final["time_prefill"]
    rate = (n - 1) / final["time_generate"] if n > 1 and final["time_generate"] > 0 else float("nan")
    print(f"[{n} tokens, {final['eos_reason']}; first token after {ttft:.2f}s (includes compilation); "
          f"{rate:.1f} tok/s decode; {time.perf_counter() - t_start:.1f}s total]", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
