"""End-to-end decode and prefill throughput through the generator, against the roofline of the bytes a step must
read at the copy rate measured in the same run.

    python -m experiments.bench_e2e                                   # preset:smollm2-135m@q4_1, batch 1,4,16
    python -m experiments.bench_e2e --model preset:llama3-8b@q4_0 --cache_dtype bfloat16 --page_size 16 \\
        --batch_sizes 1,16,64,256 --decode_steps 8 --json_out e2e.json --plot e2e.png

`--model` defaults to preset:smollm2-135m@q4_1 here (not the shared flag's 'smollm2-135m'): SmolLM2-135M's
architecture with random weights, no download, every matrix Q4_1, which the native CPU kernel runs fastest of the
preset formats on the CPU (on the 2-core EPYC host, busy: 230 tok/s at batch 1 against 17-32 in float32, 12 in
bf16; the whole default run takes ~35 s). Any model spec works
(`preset:NAME[@FORMAT]`, the embedded name, a .gguf, an HF directory, 'tiny'). The engine flags are the shared ones
(`--page_size`, `--cache_dtype`, `--decode_steps`: decode steps per device call, `--max_chunk_size`: the prefill
chunk, ...); the engine is sized for the largest of `--batch_sizes` (so `--max_batch_size` is not taken).

What runs, all through one `DynamicGenerator` (greedy rows, no penalties, `--temperature` not used):
1. the device's copy rate (`experiments.lib.serving.hardware.measure_memory_bandwidth`: in place over
   `--copy_mb` MiB, the best of `--copy_repeats` timings);
2. prefill: one prompt of `--prefill_tokens` random tokens prefilled `--max_chunk_size` tokens per step, timed
   to its first token (after an untimed run of the same prompt length);
3. per batch size b: b jobs of `--context` random prompt tokens are prefilled (not timed; the jobs prefilled first
   decode meanwhile), `--warmup_steps` decode steps run untimed, then `--tokens` decode steps are timed with every
   row decoding (`experiments.lib.step_timing`).
Per point: tokens/s; the bytes one step must read (weights once + every row's KV up to its context in whole pages:
`experiments.lib.roofline`); the roofline tokens/s (b x copy rate / bytes per step) and the fraction of it
achieved; the step split into host (scheduling, batch building, results), launch (dispatching the jitted call)
and device (waiting for the results) from the generator's and engine's timers. Prints a table, writes one JSON
record (`--json_out`) and a log-log plot of tokens/s against the roofline by batch size (`--plot`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time

from absl import app, flags

from experiments.lib import engine_flags
from experiments.lib.common import check_out_flag, write_record
from experiments.lib.roofline import decode_step_bytes, prefill_work, roofline_tokens_per_s
from experiments.lib.serving.hardware import measure_memory_bandwidth
from experiments.lib.step_timing import prefill, time_decode

FLAGS = flags.FLAGS
engine_flags.define()  # --model, --dtype, --quant, every EngineConfig field (--decode_steps: 4), --policy, ...
DEFAULT_MODEL = "preset:smollm2-135m@q4_1"
CPU_BATCH_SIZES = ("1", "4", "16")
GPU_BATCH_SIZES = ("1", "16", "64", "256")
flags.DEFINE_list("batch_sizes", None, f"decode rows per point (default: {','.join(CPU_BATCH_SIZES)} on the CPU, "
                  f"{','.join(GPU_BATCH_SIZES)} on an accelerator)")
flags.DEFINE_integer("context", 512, "prompt tokens of each row, cached before its decode steps")
flags.DEFINE_integer("tokens", 32, "timed decode steps per point (a burst of --decode_steps counts that many)")
flags.DEFINE_integer("warmup_steps", None, "untimed decode steps before the timed ones (default: 2 x "
                     "--decode_steps; the first compiles the point's decode variants)")
flags.DEFINE_integer("prefill_tokens", 1024, "prompt tokens of the prefill measurement (0: none); prefilled "
                     "--max_chunk_size tokens per step")
flags.DEFINE_integer("copy_mb", None, "MiB of the copy-rate buffer (default: 512 on the CPU, beyond its caches; "
                     "1024 on an accelerator)")
flags.DEFINE_integer("copy_repeats", 5, "timings of the copy; the best counts")
flags.DEFINE_string("json_out", None, "write the record here")
check_out_flag("json_out")
flags.DEFINE_string("plot", None, "write a PNG of tokens/s against the roofline by batch size here")
check_out_flag("plot")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The script's own flags, checked."""

    model: str
    batch_sizes: tuple[int, ...]
    context: int
    tokens: int
    warmup_steps: int
    prefill_tokens: int


def settings(on_accelerator: bool) -> Settings:
    """The flags as `Settings`; app.UsageError naming the flag for a bad value."""
    sizes = FLAGS.batch_sizes or (GPU_BATCH_SIZES if on_accelerator else CPU_BATCH_SIZES)
    try:
        batch_sizes = tuple(int(b) for b in sizes)
    except ValueError:
        raise app.UsageError(f"--batch_sizes={','.join(sizes)}: give integers >= 1, e.g. 1,16,64") from None
    if not batch_sizes or min(batch_sizes) < 1:
        raise app.UsageError(f"--batch_sizes={','.join(sizes)}: give integers >= 1, e.g. 1,16,64")
    if FLAGS.max_batch_size is not None:
        raise app.UsageError("--max_batch_size is not taken: the engine is sized for the largest of --batch_sizes")
    for name, lo in (("context", 0), ("tokens", 1), ("prefill_tokens", 0), ("warmup_steps", 0), ("copy_mb", 1),
                     ("copy_repeats", 1)):
        value = getattr(FLAGS, name)
        if value is not None and value < lo:
            raise app.UsageError(f"--{name} must be >= {lo}, got {value}")
    warm = FLAGS.warmup_steps if FLAGS.warmup_steps is not None else 2 * FLAGS.decode_steps
    return Settings(model=FLAGS.model if FLAGS["model"].present else DEFAULT_MODEL,
                    batch_sizes=tuple(sorted(set(batch_sizes))), context=FLAGS.context, tokens=FLAGS.tokens,
                    warmup_steps=warm, prefill_tokens=FLAGS.prefill_tokens)


def decode_budget(s: Settings, batch: int, config) -> int:
    """New tokens each job of a `batch`-row point may generate: the decode steps it takes while the others prefill
    (one per prefill step: at most a prompt's chunks per job), the warm-up and timed steps, and a burst past
    them."""
    prefill_steps = batch * max(1, -(-s.context // config.max_chunk_size))
    return prefill_steps + s.warmup_steps + s.tokens + 2 * config.decode_steps + 1


def engine_config(s: Settings, max_positions: int):
    """The shared engine flags' `EngineConfig`, sized for the largest batch: `max_seq_len` (unless given) holds the
    longest job of any point and the prefill prompt, `num_pages` (unless given) the largest batch's jobs or the
    prefill prompt, whichever needs more (they never run together); penalties off."""
    base = engine_flags.engine_config(max(s.batch_sizes), max_penalty_range=0)
    ps, top = base.page_size, max(s.batch_sizes)
    decode_len = s.context + decode_budget(s, top, base)
    need = -(-max(decode_len, s.prefill_tokens + 1) // ps) * ps
    if base.max_seq_len is not None and base.max_seq_len < need:
        raise app.UsageError(f"--max_seq_len={base.max_seq_len} is too short: this run's longest job needs {need} "
                             "tokens (--context + the decode steps of the largest batch, or --prefill_tokens)")
    if need > max_positions:
        raise app.UsageError(f"the longest job needs {need} positions, more than the model's {max_positions}: lower "
                             "--context, --tokens or --prefill_tokens")
    pages = 1 + max(top * -(-decode_len // ps), -(-(s.prefill_tokens + 1) // ps))
    return dataclasses.replace(base, max_seq_len=base.max_seq_len or need, num_pages=base.num_pages or pages)


def random_jobs(n: int, length: int, vocab: int, max_new: int, rng) -> list:
    from paged import Job, SamplingSettings

    return [Job(rng.integers(0, vocab, size=max(1, length)).tolist(), max_new,
                gen_settings=SamplingSettings.greedy()) for _ in range(n)]


def measure_prefill(gen, s: Settings, cost, copy_gbps: float, rng) -> dict | None:
    """Prefill tokens/s of one `s.prefill_tokens` prompt (the second of two runs), with its bytes against the copy
    rate and its FLOP/s (a prefill step is compute-bound: its copy fraction is small)."""
    if not s.prefill_tokens:
        return None
    chunk = gen.engine.config.max_chunk_size
    for _ in range(2):  # the first run compiles the chunk's variants
        gen.clear_queue()
        job = random_jobs(1, s.prefill_tokens, gen.engine.vocab_size, 1, rng)[0]
        s0, p0 = gen.steps, gen.metrics()["tokens_prefilled"]
        t0 = time.perf_counter()
        gen.enqueue(job)
        while job.new_tokens == 0:
            gen.iterate()
        seconds = time.perf_counter() - t0
    steps, tokens = gen.steps - s0, gen.metrics()["tokens_prefilled"] - p0
    gen.clear_queue()
    work = prefill_work(cost, s.prefill_tokens, chunk, gen.engine.config.page_size)
    rec = dict(prompt_tokens=s.prefill_tokens, chunk=chunk, steps=steps, tokens_prefilled=tokens, seconds=seconds,
               tokens_per_s=s.prefill_tokens / seconds, ms_per_step=1e3 * seconds / max(steps, 1),
               bytes_per_step=work["bytes_per_step"], gbps=work["bytes"] / seconds / 1e9,
               gflops=work["flops"] / seconds / 1e9)
    rec["copy_fraction"] = rec["gbps"] / copy_gbps
    return rec


def measure_decode(gen, s: Settings, batch: int, cost, copy_gbps: float, rng) -> dict:
    """One point: `batch` rows prefilled, warmed up, then `s.tokens` decode steps timed (`step_timing`)."""
    gen.clear_queue()
    prefill(gen, random_jobs(batch, s.context, gen.engine.vocab_size,
                             decode_budget(s, batch, gen.engine.config), rng))
    if s.warmup_steps:
        time_decode(gen, s.warmup_steps)
    w = time_decode(gen, s.tokens)
    gen.clear_queue()
    page = gen.engine.config.page_size
    step_bytes = decode_step_bytes(cost, w.kv_positions, page, w.steps)
    roof = roofline_tokens_per_s(copy_gbps * 1e9, step_bytes, batch)
    rec = dict(batch=batch, steps=w.steps, calls=w.calls, tokens=w.tokens, seconds=w.seconds,
               tokens_per_s=w.tokens_per_s, ms_per_step=w.ms_per_step,
               context_mean=sum(w.kv_positions) / batch, context_min=min(w.kv_positions),
               context_max=max(w.kv_positions), bytes_per_step=step_bytes,
               weight_bytes_per_step=cost.weight_bytes, kv_bytes_per_step=step_bytes - cost.weight_bytes,
               gbps=step_bytes * w.steps / w.seconds / 1e9, roofline_tokens_per_s=roof,
               roofline_fraction=w.tokens_per_s / roof, **w.split_ms())
    rec["host_launch_fraction"] = (rec["host_ms"] + rec["launch_ms"]) / rec["ms_per_step"]
    return rec


HEADER = (f"{'batch':>5} {'context':>7} {'tok/s':>9} {'ms/step':>8} {'host':>6} {'launch':>6} {'device':>7} "
          f"{'MB/step':>8} {'GB/s':>7} {'roofline tok/s':>14}  roofline fraction")


def row_line(r: dict) -> str:
    return (f"{r['batch']:5d} {r['context_mean']:7.0f} {r['tokens_per_s']:9.1f} {r['ms_per_step']:8.2f} "
            f"{r['host_ms']:6.2f} {r['launch_ms']:6.2f} {r['device_ms']:7.2f} {r['bytes_per_step'] / 1e6:8.1f} "
            f"{r['gbps']:7.1f} {r['roofline_tokens_per_s']:14.1f}  {r['roofline_fraction']:.3f}")


def plot(path: str, record: dict) -> None:
    """Log-log: measured decode tokens/s and the roofline's by batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = record["decode"]
    b = [p["batch"] for p in pts]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(b, [p["roofline_tokens_per_s"] for p in pts], "k--", marker="x",
            label=f"roofline (copy {record['copy']['bandwidth_gbps']:.0f} GB/s)")
    ax.plot(b, [p["tokens_per_s"] for p in pts], "o-", label="measured")
    for p in pts:
        ax.annotate(f"{100 * p['roofline_fraction']:.0f}%", (p["batch"], p["tokens_per_s"]),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(b, [str(x) for x in b])
    ax.set_xlabel("batch (rows decoding)")
    ax.set_ylabel("decode tokens/s")
    ctx = sum(p["context_mean"] for p in pts) / len(pts)
    ax.set_title(f"{record['model']} on {record['device']['name']}\ncontext ~{ctx:.0f} tokens, "
                 f"{record['setup']['decode_steps']} steps/call, cache {record['setup']['cache_dtype']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv):
    del argv
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    engine_flags.validate()
    import jax
    import numpy as np

    from experiments.lib.common import load_experiment_model
    from experiments.lib.serving import env
    from experiments.lib.serving.hardware import leaf_bytes, model_cost
    from paged import DynamicGenerator
    from paged.device.step import resolved_attn_impl

    on_accelerator = jax.default_backend() != "cpu"
    s = settings(on_accelerator)
    load_before = env.load_average("(bench_e2e)")
    t0 = time.perf_counter()
    model = load_experiment_model(s.model, dtype=FLAGS.dtype, quant=None if FLAGS.quant == "none" else FLAGS.quant)
    config = engine_config(s, model.config.max_position_embeddings)
    gen = DynamicGenerator(model, config=config, policy=FLAGS.policy,
                           compilation_cache_dir=FLAGS.compilation_cache_dir)
    load_s = time.perf_counter() - t0
    copy = measure_memory_bandwidth(FLAGS.copy_mb, FLAGS.copy_repeats)
    copy_gbps = copy["bandwidth_gbps"]
    device = jax.devices()[0]
    name = (device.device_kind if on_accelerator
            else f"{env.cpu_model() or 'cpu'} ({env.device_info()['cpus_usable']} cores)")
    print(f"{s.model} on {name}: copy {copy_gbps:.1f} GB/s")
    cost = model_cost(model.config, gen.engine.model.params, gen.engine.state)
    print(f"weights read per step {cost.weight_bytes / 1e6:.1f} MB, KV {cost.kv_bytes_per_token / 1e3:.1f} kB per "
          f"token ({config.cache_dtype}, pages of {config.page_size})")
    rng = np.random.default_rng(FLAGS.seed or 0)
    pre = measure_prefill(gen, s, cost, copy_gbps, rng)
    if pre:
        print(f"prefill {pre['prompt_tokens']} tokens in chunks of {pre['chunk']}: {pre['tokens_per_s']:.1f} tok/s, "
              f"{pre['ms_per_step']:.1f} ms/chunk, {pre['gbps']:.1f} GB/s ({pre['copy_fraction']:.3f} of copy), "
              f"{pre['gflops']:.0f} GFLOP/s")
    print(f"decode, {config.decode_steps} steps per call; host / launch / device: ms per step")
    print(HEADER)
    points = []
    for batch in s.batch_sizes:
        rec = measure_decode(gen, s, batch, cost, copy_gbps, rng)
        points.append(rec)
        print(row_line(rec), flush=True)
    record = dict(
        model=s.model, date=datetime.datetime.now().isoformat(timespec="seconds"),
        device={"name": name, "kind": device.device_kind, "platform": device.platform, **env.host_setup()},
        setup=dict(context=s.context, tokens=s.tokens, warmup_steps=s.warmup_steps,
                   prefill_tokens=s.prefill_tokens, batch_sizes=list(s.batch_sizes), dtype=FLAGS.dtype,
                   quant=FLAGS.quant, decode_steps=config.decode_steps, cache_dtype=config.cache_dtype,
                   page_size=config.page_size, attn_impl=str(gen.engine.attn_impl),
                   attn_resolved=str(resolved_attn_impl(gen.engine.attn_impl, head_dim=model.config.head_dim,
                                                        page_size=config.page_size)),
                   matmul_impl=str(gen.engine.matmul_impl),
                   matmul_auto=env.matmul_auto(), policy=FLAGS.policy, engine=gen.engine.config.to_dict(),
                   model_load_s=load_s),
        weights=dict(resident_bytes=leaf_bytes(gen.engine.model.params), bytes_per_step=cost.weight_bytes,
                     kv_bytes_per_token=cost.kv_bytes_per_token),
        copy=copy, prefill=pre, decode=points, versions=env.versions(), commit=env.git_info(),
        load_avg_before=load_before, load_avg_after=env.load_average())
    write_record(FLAGS.json_out, record)
    if FLAGS.plot:
        plot(FLAGS.plot, record)


if __name__ == "__main__":
    app.run(main)
