"""Print the step's compiled variants for an engine configuration, compile them one by one (timing each), and check
that serving-like calls afterwards compile nothing.

    python -m experiments.compile_report                       # the default engine on SmolLM2-135M
    python -m experiments.compile_report --model tiny --max_batch_size 8 --max_chunk_size 128 --decode_steps 4
    python -m experiments.compile_report --compilation_cache_dir /tmp/jax_cache   # run twice: cold, then warm

The variants (`Engine.variants`, see paged/device/buckets.py): the forward of every layout bucket, the sampler of every
row count, and with `--decode_steps` > 1 the burst of every decode-only bucket. Each is compiled by `Engine.warmup` on a
padding batch; the report then re-runs `warmup` (must hit the jit caches) and steps with top-k, logits, large
logit bias and penalties (runtime values: must not compile either), counting JAX traces and backend compilations.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import engine_flags
from experiments.lib.common import check_out_flag, write_record

FLAGS = flags.FLAGS
engine_flags.define()  # --model, --quant, --compilation_cache_dir and every EngineConfig field
# This report is about the library's defaults (`DynamicGenerator(load_model("smollm2-135m"))`), not the benchmarks'.
FLAGS.set_default("decode_steps", 1)
FLAGS.set_default("quant", "none")
flags.DEFINE_integer("limit", 0, "compile only the first N variants (0 = all)")
flags.DEFINE_string("json_out", None, "write the per-variant timings here")
check_out_flag("json_out")


def _compile_events() -> dict[str, float]:
    import jax

    events: dict[str, float] = {}

    def listen(event: str, duration: float, **kw) -> None:
        name = event.rsplit("/", 1)[-1]
        events[name] = events.get(name, 0.0) + duration
        events[name + "_count"] = events.get(name + "_count", 0) + 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    return events


def main(argv):
    del argv
    import jax
    import numpy as np

    from paged.device.batch import RowInput
    from paged.device.engine import Engine, count_compiles

    events = _compile_events()
    engine_flags.validate()
    model = engine_flags.load_model()
    config = engine_flags.engine_config(max_batch_size=16, max_penalty_range=1024)  # the library's defaults
    decode_steps = config.decode_steps
    engine = Engine(model, config, compilation_cache_dir=FLAGS.compilation_cache_dir)
    spec = engine.spec
    variants = engine.variants(decode_steps)
    print(f"engine {engine.config}")
    print(f"decode rows {spec.decode_rows[1:]}, prefill rows {spec.prefill_rows[1:]}, prefill windows "
          f"{spec.windows}, sampled rows {spec.row_counts()}, context buckets (pages/row, chosen at run time) "
          f"{spec.pages if spec.page_switch else '(all)'}")
    kinds = [v[0] for v in variants]
    print(f"{len(variants)} variants: " + ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)))
    if FLAGS.limit:
        variants = variants[: FLAGS.limit]
    rows, seen = [], set()
    before = count_compiles()
    t_all = time.perf_counter()
    for kind, shape, n in variants:
        if kind == "sample":  # compiled with the first bucket that samples n rows, timed there
            continue
        t0 = time.perf_counter()
        engine.warmup([shape], decode_steps=n) if n > 1 else engine.warmup([shape])
        dt = time.perf_counter() - t0
        lay = shape.layout
        new = {k: v - before.get(k, 0) for k, v in count_compiles().items()}
        # a fused bucket's sampler is inside its own program: no shared sampler variant comes with it
        fresh = [r for r in shape.sampled_row_counts if r not in seen] if kind == "step" else []
        seen.update(fresh)
        rows.append(dict(kind=kind, prefill_rows=lay.num_prefill_rows, window=lay.max_q_len,
                         decode_rows=shape.num_decode_rows, steps=n, new_samplers=fresh, seconds=dt,
                         compiled_so_far=new))
        print(f"  {kind:<12} prefill {lay.num_prefill_rows}x{lay.max_q_len:<4} decode {shape.num_decode_rows:<3} "
              f"steps {n}  {dt:6.2f}s  (+ sampler for {fresh} rows)  compiled so far {new}", flush=True)
    total = time.perf_counter() - t_all
    compiled = {k: v - before.get(k, 0) for k, v in count_compiles().items()}

    # Everything again, then serving-like steps with runtime options: nothing may compile.
    trace0, compile0 = events.get("jaxpr_trace_duration_count", 0), events.get("backend_compile_duration_count", 0)
    t0 = time.perf_counter()
    engine.warmup(decode_steps=decode_steps)
    again = time.perf_counter() - t0
    if not FLAGS.limit:
        v = engine.vocab_size
        rng = np.random.default_rng(0)
        many = {int(t): -float("inf") for t in rng.choice(v, min(v - 1, 400), replace=False)}
        row = lambda i, n, **kw: RowInput(tokens=[3] * n, start_pos=0, pages=[1 + i], **kw)  # noqa: E731
        engine.run([row(0, min(5, engine.config.max_chunk_size), bias=many,
                        sampling={"temperature": 1.0, "top_p": 0.9, "repetition_penalty": 1.2}, history=[1, 2])],
                   return_top_k=8, return_logits=True)
        engine.run([row(i, 1, sampling={"temperature": 0.7, "top_k": 40, "seed": i}) for i in range(2)],
                   return_top_k=128)
        if decode_steps > 1:
            engine.run([row(0, 1)], num_steps=decode_steps, return_top_k=2)
    retraced = events.get("jaxpr_trace_duration_count", 0) - trace0
    recompiled = events.get("backend_compile_duration_count", 0) - compile0
    print(f"compiled {compiled} in {total:.1f}s ({FLAGS.model}, backend {jax.default_backend()}, load average "
          f"{os.getloadavg()[0]:.2f}); warm-up again took {again:.2f}s; afterwards {retraced} traces and "
          f"{recompiled} compilations (want 0 and 0)")
    print(f"JAX compile events (s): { {k: round(x, 2) for k, x in events.items() if not k.endswith('_count')} }")
    if FLAGS.json_out:
        write_record(FLAGS.json_out, dict(
            flags=FLAGS.flag_values_dict(), variants=rows, total_seconds=total, compiled=compiled,
            traces_after=retraced, compiles_after=recompiled, load_avg=os.getloadavg()))


if __name__ == "__main__":
    app.run(main)
