"""Decode throughput of the paged step on the current backend: one jitted step per token versus `decode_steps`
(n steps in one call via lax.scan), at several batch sizes.

    python -m experiments.bench_decode --model smollm2-135m --batch_sizes 1,16 --context 256 --multi_steps 1,4,8

Greedy rows, no penalties. Compilation is excluded (each configuration is run once before timing). Prints tokens/s
and the model-bytes bandwidth it implies (weights read once per step), and writes JSON with --json_out.
"""

from __future__ import annotations

import os
import platform
import time

from absl import app, flags

from experiments.lib.common import check_out_flag, int_list_flag, write_record

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "'tiny', the embedded name, an HF dir or a .gguf")
flags.DEFINE_list("batch_sizes", ["1", "16"], "decode rows")
flags.DEFINE_list("multi_steps", ["1", "4", "8"], "decode steps per call (1 = plain step)")
flags.DEFINE_integer("context", 256, "tokens already in each row's cache")
flags.DEFINE_integer("tokens", 32, "decode tokens per row per measurement")
flags.DEFINE_integer("page_size", 64, "tokens per page")
flags.DEFINE_string("json_out", None, "write results here")
check_out_flag("json_out")


def timed_decode(engine, pages: list[list[int]], steps_per_call: int, pos: int, tokens: int) -> float:
    """Seconds to decode `tokens` tokens on every row, `steps_per_call` steps per engine call."""
    from paged.device.batch import RowInput

    t0 = time.perf_counter()
    for done in range(0, tokens, steps_per_call):
        rows = [RowInput(tokens=[1], start_pos=pos + done, pages=p) for p in pages]
        engine.run(rows, num_steps=steps_per_call)
    return time.perf_counter() - t0


def check_flags() -> None:
    """Every flag checked before the model loads: app.UsageError naming the flag."""
    from paged.device.engine import MIN_PAGE_SIZE

    int_list_flag("batch_sizes")
    for name in ("context", "tokens"):
        if getattr(FLAGS, name) < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    ps = FLAGS.page_size
    if ps < MIN_PAGE_SIZE or ps & (ps - 1):
        raise app.UsageError(f"--page_size must be a power of two >= {MIN_PAGE_SIZE}, got {ps}")
    for n in int_list_flag("multi_steps"):
        if FLAGS.tokens % n:  # (the last call would decode past --tokens, and the rates count only --tokens)
            raise app.UsageError(f"--multi_steps: {n} does not divide --tokens={FLAGS.tokens}")


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    check_flags()
    import jax
    import numpy as np

    from experiments.lib.common import load_experiment_model, model_flag
    from paged.device.batch import RowInput
    from paged.device.engine import Engine

    with model_flag("model", FLAGS.model):
        model = load_experiment_model(FLAGS.model)
    weight_bytes = model.params.nbytes()
    ps = FLAGS.page_size
    results = []
    for bs in int_list_flag("batch_sizes"):
        max_len = FLAGS.context + FLAGS.tokens + 8
        per_row = -(-max_len // ps)
        engine = Engine(model, num_pages=1 + bs * per_row, page_size=ps, max_batch_size=bs,
                        max_chunk_size=max(16, FLAGS.context), max_seq_len=per_row * ps)
        pages = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(bs)]
        rng = np.random.default_rng(0)
        # fill the cache with a context (one prefill row at a time)
        for r in range(bs):
            ids = rng.integers(0, model.config.vocab_size, size=FLAGS.context).tolist()
            engine.run([RowInput(tokens=ids, start_pos=0, pages=pages[r], sample=False)])
        for n in int_list_flag("multi_steps"):
            timed_decode(engine, pages, n, FLAGS.context, FLAGS.tokens)  # compile
            dt = timed_decode(engine, pages, n, FLAGS.context, FLAGS.tokens)
            tps = bs * FLAGS.tokens / dt
            steps_per_s = FLAGS.tokens / dt
            rec = dict(batch=bs, steps_per_call=n, tokens_per_s=tps, ms_per_step=1e3 * dt / FLAGS.tokens,
                       weight_gb_per_s=weight_bytes * steps_per_s / 1e9)
            results.append(rec)
            print(f"batch {bs:3d}  steps/call {n:2d}: {tps:8.1f} tok/s  {rec['ms_per_step']:7.1f} ms/step  "
                  f"{rec['weight_gb_per_s']:5.1f} GB/s of weights")
    if FLAGS.json_out:
        write_record(FLAGS.json_out, dict(model=FLAGS.model, context=FLAGS.context, device=str(jax.devices()[0]),
                                          machine=platform.machine(), cpus=os.cpu_count(), load_avg=os.getloadavg(),
                                          results=results))


if __name__ == "__main__":
    app.run(main)
