"""Constrained-decoding benchmark: time per decode step at several batch sizes with none, half or all of the rows
filtered by a realistic JSON schema (nested object, enum, array, numbers, required fields), on the embedded
SmolLM2 (or --model).

A step is counted when every job of the batch is decoding (no prefill chunk rides along, nobody has finished), so
each configuration compares like with like: the same rows, the same buckets. Every job samples (temperature 0.7,
seeded) with `max_new_tokens` large enough for the schema's object. The record holds, per configuration, the
median and mean step wall time (the host loop included: the masks are computed on the host, one parallel
llguidance call per step), the time inside that call, and the overhead against the unfiltered run of the same
batch size. The generator is warmed up first (a filtered batch compiles nothing more: the mask is one traced
switch), and the tokenizer's llguidance table (built once, ~1 s for 49k tokens) is built before timing.

    python -m experiments.bench_filters --json_out experiments/results/filters_cpu.json
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags

from experiments.lib.common import check_out_flag, write_record

flags.DEFINE_string("model", "smollm2-135m", "model (a name, a .gguf, or an HF directory)")
flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "jobs per run")
flags.DEFINE_list("fractions", ["0", "0.5", "1"], "fraction of the batch's jobs that are filtered")
flags.DEFINE_integer("max_new_tokens", 160, "tokens per job at most (enough for the schema's object)")
flags.DEFINE_integer("seed", 0, "sampling seed of job 0 (job i uses seed + i)")
flags.DEFINE_string("json_out", None, "write the record here")
check_out_flag("json_out")
FLAGS = flags.FLAGS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 32},
                                                     "city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "address", "scores", "active"],
    "additionalProperties": False,
}
PROMPT = "Invent a user record for a website's database. Reply with JSON only."


def run_config(gen, tok, batch: int, fraction: float, timer: dict) -> dict:
    from paged import Job, SamplingSettings
    from paged.filters import JsonSchemaFilter

    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), encode_special_tokens=True)
    settings = SamplingSettings(temperature=0.7, top_k=0, top_p=1.0)
    n_filtered = round(batch * fraction)
    jobs = [Job(ids, FLAGS.max_new_tokens, gen_settings=settings, seed=FLAGS.seed + i, identifier=i,
                filters=JsonSchemaFilter(SCHEMA) if i < n_filtered else None) for i in range(batch)]
    gen.enqueue(jobs)
    steps, mask_s = [], []
    finals = {}
    while gen.num_remaining_jobs():
        all_decoding = len(gen.active) == batch and all(j.kv_position >= len(j.sequence) - 1 for j in gen.active)
        timer["s"] = 0.0
        t0 = time.perf_counter()
        results = gen.iterate()
        dt = time.perf_counter() - t0
        if all_decoding and not any(r["eos"] for r in results) and len(gen.active) == batch:
            steps.append(dt)
            mask_s.append(timer["s"])
        for r in results:
            if r["eos"]:
                finals[r["identifier"]] = r
    valid = 0
    for i in range(n_filtered):
        try:
            json.loads(finals[i]["full_completion"])
            valid += 1
        except (ValueError, KeyError):
            pass
    return {"batch": batch, "filtered": n_filtered, "steps": len(steps),
            "median_step_ms": 1e3 * statistics.median(steps) if steps else None,
            "mean_step_ms": 1e3 * statistics.fmean(steps) if steps else None,
            "mean_mask_ms": 1e3 * statistics.fmean(mask_s) if mask_s else None,
            "filtered_outputs_parsing_as_json": valid,
            "eos_reasons": sorted(f["eos_reason"] for f in finals.values())}


def main(argv):
    del argv
    from experiments.lib.common import load_experiment_model
    from experiments.lib.serving.env import device_info, git_info, load_average, versions
    from paged import DynamicGenerator
    from paged.filters import ll_tokenizer
    from paged.host import generator as generator_module

    load_before = load_average("before the filter benchmark")
    model = load_experiment_model(FLAGS.model)
    tok = model.tokenizer
    t0 = time.perf_counter()
    ll_tokenizer(tok)
    table_s = time.perf_counter() - t0
    timer = {"s": 0.0}
    inner = generator_module.compute_masks

    def timed(states):
        t = time.perf_counter()
        out = inner(states)
        timer["s"] += time.perf_counter() - t
        return out

    generator_module.compute_masks = timed
    sizes = [int(b) for b in FLAGS.batch_sizes]
    gen = DynamicGenerator(model, max_batch_size=max(sizes), max_seq_len=256, max_chunk_size=256)
    t0 = time.perf_counter()
    gen.warmup()
    warmup_s = time.perf_counter() - t0
    rows = []
    for b in sizes:
        base = None
        for f in (float(x) for x in FLAGS.fractions):
            rec = run_config(gen, tok, b, f, timer)
            if f == 0:
                base = rec["median_step_ms"]
            if base and rec["median_step_ms"]:
                rec["overhead_vs_unfiltered"] = rec["median_step_ms"] / base - 1
            rows.append(rec)
            over = rec.get("overhead_vs_unfiltered")
            print(f"batch {b:3d}  filtered {rec['filtered']:3d}  steps {rec['steps']:4d}  median step "
                  f"{rec['median_step_ms'] or float('nan'):7.2f} ms  mask {rec['mean_mask_ms'] or 0:6.2f} ms  "
                  f"overhead {'' if over is None else f'{100 * over:+.1f}%'}  json ok "
                  f"{rec['filtered_outputs_parsing_as_json']}/{rec['filtered']}", flush=True)
    record = {"experiment": "bench_filters", "flags": {f.name: f.value for f in FLAGS.get_flags_for_module(__name__)},
              "schema": SCHEMA, "prompt": PROMPT, "git": git_info(), "device": device_info(), "versions": versions(),
              "load_avg_before": load_before, "load_avg_after": load_average(), "llguidance_table_s": table_s,
              "warmup_s": warmup_s, "results": rows, "notes": __doc__}
    if FLAGS.json_out:
        write_record(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
