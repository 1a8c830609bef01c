"""Streaming demo: several multilingual chat prompts run concurrently on the embedded SmolLM2; the first streams
live, the others are shown when they finish. Every streamed chunk is checked to be clean text (no U+FFFD).

    python -m experiments.stream_demo
    python -m experiments.stream_demo --prompts "Say hi in Japanese.|Écris une phrase en français." --temperature 0.7
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "embedded name, HF directory, or .gguf file")
flags.DEFINE_string(
    "prompts",
    "Write one sentence about the sea, then repeat it in French.|"
    "Translate 'good morning, friend' into Spanish, German and Chinese.|"
    "List three emoji that mean happiness and explain each briefly.|"
    "Écris une courte phrase sur le café.",
    "prompts separated by |")
flags.DEFINE_integer("max_new_tokens", 96, "tokens per job at most")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("seed", 0, "base seed (job i uses seed + i)")


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from models import load_model
    from paged import DynamicGenerator, Job, SamplingSettings

    model = load_model(FLAGS.model)
    tok = model.tokenizer
    prompts = [p for p in FLAGS.prompts.split("|") if p]
    gen = DynamicGenerator(model, max_batch_size=max(1, len(prompts)), max_seq_len=512, max_chunk_size=128)
    settings = SamplingSettings(temperature=FLAGS.temperature, top_k=50, top_p=0.9, repetition_penalty=1.05)
    for i, p in enumerate(prompts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), encode_special_tokens=True)
        gen.enqueue(Job(ids, FLAGS.max_new_tokens, gen_settings=settings, seed=FLAGS.seed + i, identifier=i,
                        stop_conditions=[tok.eos_token_id]))
    print(f"### [0] {prompts[0]}")
    finals, dirty = {}, 0
    t0 = time.perf_counter()
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] != "streaming":
                continue
            dirty += "\ufffd" in r["text"]
            if r["identifier"] == 0:
                sys.stdout.write(r["text"])
                sys.stdout.flush()
            if r["eos"]:
                finals[r["identifier"]] = r
    print()
    for i in range(1, len(prompts)):
        print(f"\n### [{i}] {prompts[i]}\n{finals[i]['full_completion']}")
    tokens = sum(f["new_tokens"] for f in finals.values())
    print(f"\n[{len(prompts)} jobs, {tokens} tokens in {time.perf_counter() - t0:.1f}s incl. compilation; "
          f"chunks with U+FFFD: {dirty}; metrics: {gen.metrics()}]", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
