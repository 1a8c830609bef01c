"""An OpenAI-compatible HTTP server on one `DynamicGenerator` (paged/server/; docs/server.md).

    python -m experiments.serve --model smollm2-135m --port 8000
    python -m experiments.serve --model path/to/hf_dir --max_batch_size 32 --max_queue 256 --shutdown_grace_s 10
    python -m experiments.serve --max_loras 2 --lora_adapter poet=path/to/adapter --lora_adapter coder=path/to/other

Then, with the `openai` package:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi!"}])

It takes the model and engine flags every experiment takes (experiments/lib/engine_flags.py: --model, --quant,
--max_batch_size, --page_size, --policy, ...; --max_batch_size defaults to 16 and --max_penalty_range to 1024, so
requests may use penalties and DRY), compiles every step bucket first (--compile_buckets), and serves until SIGTERM
or Ctrl-C, then stops gracefully (running requests get --shutdown_grace_s seconds). `--model tiny` serves a random
2-layer model with a byte tokenizer and a plain chat template (for tests).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import sys

from absl import app, flags

from experiments.lib import engine_flags

FLAGS = flags.FLAGS
engine_flags.define()  # --model, --quant, cache and engine flags, --policy, --compilation_cache_dir, --progress
flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)")
flags.DEFINE_integer("port", 8000, "port to listen on")
flags.DEFINE_string("served_model_name", None, "the model id clients name in requests (default: --model)")
flags.DEFINE_integer("max_queue", None, "most jobs waiting for admission; requests past it get HTTP 429 (default: "
                     "no limit)")
flags.DEFINE_float("admission_wait_ms", 10.0, "after a step in which requests ended, while jobs run and none "
                   "waits, wait up to this long for as many new requests before the next step, so that a client's "
                   "next request joins the next step (0: never wait; docs/server.md)")
flags.DEFINE_float("shutdown_grace_s", 30.0, "on SIGTERM: seconds running requests get to finish before they are "
                   "ended")
flags.DEFINE_string("chat_template", None, "a Jinja chat template file, instead of the tokenizer's")
flags.DEFINE_multi_string("lora_adapter", [], "NAME=PATH: a PEFT LoRA adapter directory served as model NAME (and "
                          "as the `lora` extra field); repeat for several; needs --max_loras")
flags.DEFINE_bool("speculative_ngram", False, "speculative decoding with n-gram prompt lookup")
flags.DEFINE_integer("speculative_tokens", 4, "--speculative_ngram: tokens drafted per job and step")
flags.DEFINE_bool("compile_buckets", True, "compile every step bucket before serving (generator.warmup), so no "
                  "request waits for a compilation")
flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"], "server log level")

TINY_VOCAB = 258  # paged.testing.ByteTokenizer's


def load_model():
    """The model the flags name; `tiny` with a byte tokenizer (the experiments' tiny model has none)."""
    if FLAGS.model == "tiny":
        from paged.testing import ByteTokenizer, tiny_config, tiny_model

        engine_flags.apply_cpu_dispatch()
        return tiny_model(tiny_config(TINY_VOCAB), tokenizer=ByteTokenizer())
    model = engine_flags.load_model()  # (an unknown or broken --model is a usage error there)
    if model.tokenizer is None:
        raise app.UsageError(f"--model {FLAGS.model} has no tokenizer; the server takes and returns text")
    return model


def build_generator(model):
    from paged import DynamicGenerator
    from paged.errors import GeneratorError

    kw = engine_flags.generator_kwargs(16, max_penalty_range=1024)
    if FLAGS.speculative_ngram:
        kw.update(use_ngram_draft=True, num_draft_tokens=FLAGS.speculative_tokens)
    try:
        gen = DynamicGenerator(model, **kw)
    except GeneratorError as e:
        raise app.UsageError(str(e)) from e
    for name, path in lora_adapters():
        try:
            gen.load_lora(name, path)
        except (GeneratorError, ValueError) as e:
            raise app.UsageError(f"--lora_adapter {name}={path}: {e}") from e
    return gen


def check_flags() -> str | None:
    """Check the flags before anything loads (app.UsageError naming the flag); returns the chat template to serve
    (None: the tokenizer's)."""
    from paged.server.translate import SIMPLE_CHAT_TEMPLATE

    engine_flags.validate()
    if FLAGS.max_queue is not None and FLAGS.max_queue < 1:
        raise app.UsageError(f"--max_queue must be >= 1, got {FLAGS.max_queue}")
    if FLAGS.admission_wait_ms < 0:
        raise app.UsageError(f"--admission_wait_ms must be >= 0, got {FLAGS.admission_wait_ms}")
    if FLAGS.shutdown_grace_s < 0:
        raise app.UsageError(f"--shutdown_grace_s must be >= 0, got {FLAGS.shutdown_grace_s}")
    if not 1 <= FLAGS.port <= 65535:  # (70000 had been served on 70000 mod 65536, -5 had failed after loading)
        raise app.UsageError(f"--port must be in [1, 65535], got {FLAGS.port}")
    check_host(FLAGS.host)
    check_lora_adapters()
    if FLAGS.chat_template:
        try:
            with open(FLAGS.chat_template, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise app.UsageError(f"--chat_template {FLAGS.chat_template}: cannot read it ({e})") from None
    return SIMPLE_CHAT_TEMPLATE if FLAGS.model == "tiny" else None


def lora_adapters() -> list[tuple[str, str]]:
    """--lora_adapter's (NAME, PATH) pairs; app.UsageError for one not written NAME=PATH."""
    pairs = []
    for spec in FLAGS.lora_adapter:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise app.UsageError(f"--lora_adapter {spec!r}: expected NAME=PATH")
        pairs.append((name, path))
    return pairs


def check_lora_adapters() -> None:
    """--lora_adapter before the model loads: NAME=PATH, distinct names other than the served model's, existing
    directories, and room for them all (--max_loras)."""
    pairs = lora_adapters()
    served = FLAGS.served_model_name or FLAGS.model
    seen: set[str] = set()
    for name, path in pairs:
        if name in seen:
            raise app.UsageError(f"--lora_adapter: the name {name!r} is given twice")
        if name == served:
            raise app.UsageError(f"--lora_adapter {name}={path}: {name!r} is the served model's name; a request "
                                 "naming it could not reach both (name the adapter otherwise, or set "
                                 "--served_model_name)")
        if not os.path.isdir(path):
            raise app.UsageError(f"--lora_adapter {name}={path}: {path} is not a directory (a PEFT adapter: "
                                 "adapter_config.json and adapter_model.safetensors)")
        seen.add(name)
    if pairs and FLAGS.max_loras < len(pairs):
        raise app.UsageError(f"--lora_adapter: {len(pairs)} adapter(s) need --max_loras >= {len(pairs)}, got "
                             f"{FLAGS.max_loras}")


def check_host(host: str) -> None:
    """An IP address, or a name that resolves (app.UsageError otherwise; whether this machine can listen there shows
    when the server binds). Dotted numbers that are no IPv4 address are refused without a lookup."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", host):
        raise app.UsageError(f"--host {host}: not an IPv4 address")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise app.UsageError(f"--host {host}: the name does not resolve ({e})") from None


def main(argv):
    del argv
    from paged.server import create_app, serve

    template = check_flags()
    logging.basicConfig(level=FLAGS.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = load_model()
    gen = build_generator(model)
    if FLAGS.compile_buckets:
        n = gen.warmup(progress=FLAGS.progress)
        print(f"compiled {n} step variants", file=sys.stderr)
    name = FLAGS.served_model_name or FLAGS.model
    application = create_app(gen, model_name=name, chat_template=template, max_queue=FLAGS.max_queue,
                             admission_wait_ms=FLAGS.admission_wait_ms)
    print(f"serving {name} on http://{FLAGS.host}:{FLAGS.port}/v1 (docs/server.md)", file=sys.stderr, flush=True)
    serve(application, host=FLAGS.host, port=FLAGS.port, grace_s=FLAGS.shutdown_grace_s, log_level=FLAGS.log_level)
    print("server stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    app.run(main)
