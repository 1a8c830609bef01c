"""Per-token cost of per-job LoRA in the batched step: decode steps of `--lora_rows` rows with no adapter, with every
row on one adapter, and with the rows spread over `--lora_adapters` adapters (round robin).

    python -m experiments.bench_lora --lora_rows 16 --lora_rank 16 --json_out experiments/results/lora_cpu.json

The model is the engine flags' `--model` / `--quant` (default: the embedded SmolLM2, Q4_1 kept). The engine holds
`max(--lora_adapters)` slots (`max_loras`); random adapters of rank `--lora_rank` adapt all seven
projections (the worst case). "none, no stack" is an engine built without LoRA (`max_loras=0`): the difference to
"none" is what holding a stack costs a batch that uses none (the adapters' matmuls are skipped by a `lax.cond`).
Each configuration runs `--lora_iters` decode steps (every row one token at a `--lora_context` position) after a
warm-up, the configurations interleaved step by step (so a drifting machine load hits all alike); reported: the
median step time, per-token time and the overhead per token against "none, no stack". Timings on a shared machine
are only meaningful when it is idle (check `uptime`).
"""

from __future__ import annotations

import platform
import statistics
import time

from absl import app, flags

from experiments.lib import engine_flags
from experiments.lib.common import check_out_flag

FLAGS = flags.FLAGS
engine_flags.define()  # --model, --quant (keep: a GGUF's blocks as stored), shared with the other scripts
flags.DEFINE_integer("lora_rows", 16, "decode rows per step")
flags.DEFINE_integer("lora_rank", 16, "LoRA rank r of the random adapters")
flags.DEFINE_list("lora_adapters", ["1", "4"], "adapter counts to mix in the batch (besides none)")
flags.DEFINE_integer("lora_context", 128, "position of each row's token (its KV length)")
flags.DEFINE_integer("lora_iters", 20, "timed decode steps per configuration")
if "json_out" not in FLAGS:
    flags.DEFINE_string("json_out", None, "write the figures here as JSON")
    check_out_flag("json_out")


def random_adapter(cfg, rank: int, seed: int):
    import hashlib

    import numpy as np

    from models.lora import PROJECTIONS, LoraAdapter, projection_shapes

    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for p, (fan_in, fan_out) in projection_shapes(cfg).items():
            weights[(layer, p)] = (rng.normal(0, 0.02, (fan_in, rank)).astype(np.float32),
                                   rng.normal(0, 0.02, (rank, fan_out)).astype(np.float32))
    return LoraAdapter(rank=rank, scale=1.0, targets=tuple(PROJECTIONS.values()), weights=weights,
                       digest=hashlib.sha256(f"bench-{seed}".encode()).digest(), source=f"random-{seed}")


def measure(model, *, rows: int, rank: int, counts: list[int], context: int, iters: int) -> tuple[list[dict], str]:
    """The figures of every configuration (see the module docstring) and the engines' matmul implementation."""
    from paged.device.batch import RowInput
    from paged.device.engine import Engine

    cfg = model.config
    page_size = 16
    pages_per_row = -(-(context + 1) // page_size)
    common = dict(page_size=page_size, num_pages=1 + rows * pages_per_row, max_batch_size=rows,
                  max_seq_len=pages_per_row * page_size, max_chunk_size=64, max_embedding_tokens=0)

    def batch(slots: list[int]) -> list:
        return [RowInput(tokens=[(7 * i + 3) % cfg.vocab_size], start_pos=context,
                         pages=list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row)), lora_slot=s)
                for i, s in enumerate(slots)]

    plain = Engine(model, max_loras=0, **common)
    engine = Engine(model, max_loras=max(counts), max_lora_rank=rank, **common)
    for slot in range(max(counts)):
        engine.load_lora(slot, random_adapter(cfg, rank, slot))
    configs = [("none, no stack", plain, [0] * rows), ("none", engine, [0] * rows)] + [
        (f"{n} adapter{'s' if n > 1 else ''}", engine, [1 + i % n for i in range(rows)]) for n in counts]
    batches = [(name, eng, batch(slots)) for name, eng, slots in configs]
    for _, eng, rs in batches:  # compile and warm every configuration first
        eng.run(rs)
        eng.run(rs)
    times: dict[str, list[float]] = {name: [] for name, _, _ in batches}
    for _ in range(iters):  # interleaved, so that a drifting machine load hits every configuration alike
        for name, eng, rs in batches:
            t0 = time.perf_counter()
            eng.run(rs)
            times[name].append(time.perf_counter() - t0)
    results = []
    for name, _, slots in configs:
        ts = times[name]
        med = statistics.median(ts)
        results.append({"config": name, "adapters": len({s for s in slots if s}), "step_ms_median": med * 1e3,
                        "step_ms_min": min(ts) * 1e3, "per_token_ms": med * 1e3 / rows})
    base = results[0]["per_token_ms"]
    for r in results:
        r["overhead_per_token_ms"] = r["per_token_ms"] - base
        r["overhead_pct"] = 100.0 * (r["per_token_ms"] / base - 1.0)
    return results, str(engine.matmul_impl)


def main(argv):
    del argv
    from experiments.lib.common import write_record

    model = engine_flags.load_model()
    results, matmul_impl = measure(model, rows=FLAGS.lora_rows, rank=FLAGS.lora_rank,
                                   counts=[int(x) for x in FLAGS.lora_adapters], context=FLAGS.lora_context,
                                   iters=FLAGS.lora_iters)
    for r in results:
        print(f"{r['config']:<24} step {r['step_ms_median']:8.2f} ms (min {r['step_ms_min']:8.2f})   per token "
              f"{r['per_token_ms']:7.3f} ms   {r['overhead_pct']:+6.1f}%")
    names = ("model", "quant", "lora_rows", "lora_rank", "lora_adapters", "lora_context", "lora_iters",
             "cpu_dispatch")
    write_record(FLAGS.json_out, {
        "what": f"decode step of {FLAGS.lora_rows} rows at position {FLAGS.lora_context}, rank-{FLAGS.lora_rank} "
                "adapters on all seven projections; median of --lora_iters steps, configurations interleaved",
        "model": FLAGS.model, "quant": FLAGS.quant, "matmul_impl": matmul_impl,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "results": results,
        "command": "python -m experiments.bench_lora " + " ".join(
            f"--{k}={','.join(v) if isinstance(v := FLAGS[k].value, list) else v}" for k in names),
    })


if __name__ == "__main__":
    app.run(main)
