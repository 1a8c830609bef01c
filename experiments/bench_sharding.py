"""Tensor and data parallelism (`mesh="dp=M,tp=N"`, paged/device/sharding.py): tokens/s of the same greedy jobs on each
mesh, and whether their outputs equal the first mesh's.

    python -m experiments.bench_sharding --dp 1,2,4 --tp 1,2,4 --json_out experiments/results/sharding_cpu.json

Every (dp, tp) pair whose product fits the devices runs.
On a machine without enough accelerators the devices are virtual CPU devices (`--cpu_devices`, set before JAX
starts): they share the machine's cores, so on the 2-core CPU the figures show correctness and the partitioning's
overhead, not scaling. On a multi-GPU machine the same command measures real scaling. The model: `--model tiny` (a
random Llama whose 8 query and 4 KV heads tp = 1, 2, 4 divide; SmolLM2-135M has 3 KV heads, so only tp=3 splits it),
or any model source `models.load_model` takes. Each tp runs `--jobs` jobs of `--max_new_tokens` tokens after a
warm-up of the same jobs (compilation excluded).
"""

from __future__ import annotations

import os
import sys


def _cpu_devices_from_argv(default: int = 4) -> int:
    for i, a in enumerate(sys.argv):
        if a.startswith("--cpu_devices="):
            return int(a.split("=", 1)[1])
        if a == "--cpu_devices" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
    return default


if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # before JAX starts: virtual CPU devices (a GPU machine's GPUs are unaffected)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_cpu_devices_from_argv()}").strip()

import time  # noqa: E402

from absl import app, flags  # noqa: E402

from experiments.lib.common import check_out_flag, write_record  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("cpu_devices", 4, "virtual CPU devices (read before JAX starts)")
flags.DEFINE_list("tp", ["1", "2", "4"], "tensor-parallel sizes")
flags.DEFINE_list("dp", ["1"], "data-parallel sizes (each pair with dp * tp <= the devices runs)")
if "model" not in FLAGS:
    flags.DEFINE_string("model", "tiny", "'tiny' (random Llama, 8 q / 4 KV heads) or a model source")
flags.DEFINE_integer("jobs", 8, "concurrent greedy jobs")
flags.DEFINE_integer("max_new_tokens", 64, "tokens per job")
flags.DEFINE_integer("seed", 0, "prompt seed")
if "json_out" not in FLAGS:
    flags.DEFINE_string("json_out", None, "write the record here")
    check_out_flag("json_out")


def bench_model(source: str):
    from models import ModelConfig, init_random_weights, load_model
    from models.loader import Model
    from paged.testing import ByteTokenizer

    if source != "tiny":
        return load_model(source)
    cfg = ModelConfig(model_type="llama", vocab_size=258, hidden_size=256, intermediate_size=768, num_layers=4,
                      num_heads=8, num_kv_heads=4, head_dim=32)
    return Model(config=cfg, params=init_random_weights(cfg, seed=0, scale=0.05), tokenizer=ByteTokenizer(),
                 source="tiny")


def run_once(model, mesh: str, prompts: list[list[int]]) -> tuple[dict, float, int]:
    from paged import DynamicGenerator, Job, SamplingSettings

    gen = DynamicGenerator(model, mesh=mesh, max_batch_size=len(prompts), page_size=16, max_chunk_size=64,
                           max_seq_len=min(256, model.config.max_position_embeddings), max_penalty_range=0)

    def go():
        gen.enqueue([Job(p, FLAGS.max_new_tokens, gen_settings=SamplingSettings.greedy(), identifier=i)
                     for i, p in enumerate(prompts)])
        out, n = {}, 0
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r["eos"]:
                    out[r["identifier"]] = r["full_completion"]
                    n += r["new_tokens"]
        return out, n

    go()  # warm-up: compiles every bucket these jobs need
    t0 = time.perf_counter()
    out, n = go()
    return out, time.perf_counter() - t0, n


def main(argv):
    del argv
    import random

    import jax

    from experiments.lib.serving.env import device_info, git_info, load_average, versions

    model = bench_model(FLAGS.model)
    tok = model.tokenizer
    rng = random.Random(FLAGS.seed)
    words = "the cat sat on a mat while dogs ran far away from home".split()
    prompts = [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))) for _ in range(FLAGS.jobs)]
    record = {"flags": {k: getattr(FLAGS, k) for k in ("dp", "tp", "model", "jobs", "max_new_tokens", "seed",
                                                        "cpu_devices")},
              "git": git_info(), "device": device_info(), "versions": versions(),
              "devices": [str(d) for d in jax.devices()], "load_before": load_average("bench_sharding"), "runs": []}
    ref = None
    pairs = [(int(d), int(t)) for d in FLAGS.dp for t in FLAGS.tp if int(d) * int(t) <= len(jax.devices())]
    for dp, tp in pairs:
        out, dt, n = run_once(model, f"dp={dp},tp={tp}", prompts)
        ref = out if ref is None else ref
        run = {"dp": dp, "tp": tp, "seconds": dt, "new_tokens": n, "tokens_per_s": n / dt,
               "outputs_equal_first": out == ref}
        record["runs"].append(run)
        print(f"dp={dp} tp={tp}: {n / dt:8.1f} tok/s ({n} tokens in {dt:.2f}s), outputs equal to the first: "
              f"{run['outputs_equal_first']}", flush=True)
    record["load_after"] = load_average()
    write_record(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
