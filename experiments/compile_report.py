"""Print the step's shape buckets for a generator configuration and compile them, timing each.

    python -m experiments.compile_report --model tiny --max_batch_size 8 --max_chunk_size 128
    python -m experiments.compile_report --model smollm2-135m --history_lens 0 --limit 5

Shows how many compilations `warmup()` pays for a given set of limits, and that each bucket compiles exactly once.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "'tiny' (random 2-layer model), the embedded name, an HF dir or a .gguf")
flags.DEFINE_integer("max_batch_size", 8, "rows per step")
flags.DEFINE_integer("max_chunk_size", 128, "prefill tokens per row per step")
flags.DEFINE_integer("max_seq_len", 1024, "longest sequence")
flags.DEFINE_integer("page_size", 64, "tokens per page")
flags.DEFINE_integer("max_prefill_rows", 2, "prefill rows per step")
flags.DEFINE_list("history_lens", ["0"], "penalty-history buckets to compile")
flags.DEFINE_integer("limit", 0, "compile only the first N buckets (0 = all)")
flags.DEFINE_string("json_out", None, "write the per-bucket timings here")


def main(argv):
    del argv
    import jax

    from experiments.common import load_experiment_model
    from paged.engine import Engine
    from paged.step import count_compiles

    model = load_experiment_model(FLAGS.model)
    engine = Engine(model, num_pages=16, page_size=FLAGS.page_size, max_batch_size=FLAGS.max_batch_size,
                    max_chunk_size=FLAGS.max_chunk_size, max_seq_len=FLAGS.max_seq_len,
                    max_prefill_rows=FLAGS.max_prefill_rows)
    spec = engine.spec
    shapes = spec.all_shapes(history_lens=tuple(int(h) for h in FLAGS.history_lens))
    print(f"decode rows {spec.decode_rows}, prefill rows {spec.prefill_rows}, q lens {spec.q_lens}, "
          f"pages/row {spec.pages}, history {FLAGS.history_lens}")
    print(f"{len(shapes)} buckets")
    if FLAGS.limit:
        shapes = shapes[: FLAGS.limit]
    rows = []
    before = count_compiles()["step"]
    for shape in shapes:
        t0 = time.perf_counter()
        engine.warmup([shape])
        dt = time.perf_counter() - t0
        lay = shape.layout
        rows.append(dict(prefill_rows=lay.num_prefill_rows, max_q_len=lay.max_q_len, decode_rows=lay.num_decode_rows,
                         pages_per_row=shape.pages_per_row, history_len=shape.history_len, seconds=dt))
        print(f"  prefill {lay.num_prefill_rows}x{lay.max_q_len:<5} decode {lay.num_decode_rows:<3} "
              f"pages {shape.pages_per_row:<3} hist {shape.history_len:<5} {dt:6.2f}s")
    compiled = count_compiles()["step"] - before
    again = time.perf_counter()
    engine.warmup(shapes)  # every bucket again: must hit the jit cache
    print(f"compiled {compiled} variants for {len(shapes)} buckets "
          f"({sum(r['seconds'] for r in rows):.1f}s); re-running all took {time.perf_counter() - again:.2f}s "
          f"and compiled {count_compiles()['step'] - before - compiled} more; backend {jax.default_backend()}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(dict(flags=FLAGS.flag_values_dict(), buckets=rows), f, indent=1, default=str)


if __name__ == "__main__":
    app.run(main)
