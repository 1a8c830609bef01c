"""A/B of builds of the native CPU matmul, interleaved in one process: which build is faster, by how much, and do
they compute the same bits?

On the project's 2-core hosts the same build's timings move 10-15% between processes (docs/kernels.md), more than
most changes to the kernel gain, so comparing a build in one process with another build in the next is noise. Here
every build (a shared library: the package's own, or one compiled aside, e.g. `g++ -O3 -std=c++17 -shared -fPIC
-I<jaxlib>/include pallas_kernels/cpu/*.cc -o /tmp/b.so`) is registered with XLA under a name of its own, and each
round times every build once, in alternating order, so that the host's drift falls on all of them alike.

What one timing is: a jitted `lax.scan` over `--scan_layers` layers of SmolLM2-135M's matrices in the model's order
(fused QKV, O, fused gate-up, down; Q4_1 in groups of 32, the stored format of the embedded GGUF), and, timed
apart, the tied LM head (int8 in blocks of 32, as the GGUF's Q8_0), each after reading a 160 MB buffer so that the
weights come from memory as in a decode step (`--nocold`: back to back, the caches warm). Random weights; every
build gets the same inputs (the same buffers), and its outputs are compared bit for bit with the first build's
(`same_bits`). Compare builds made the same way (the package's `setup.py` build against another `setup.py` build, saved
aside): how a build is compiled and linked alone moves its 5-row timings by 10-15% (docs/kernels.md). Each build
picks its own instruction set ("auto": the best it has; `isa` in the record is the package's).

    python -m experiments.bench_native_builds --builds package,/tmp/b.so --row_counts 1,5 \
        --json_out experiments/results/native_builds_cpu.json
"""

from __future__ import annotations

import ctypes
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.lib.common import check_out_flag, write_record

FLAGS = flags.FLAGS

flags.DEFINE_list("builds", ["package"], "shared libraries to compare: paths, or 'package' (the installed kernel)")
flags.DEFINE_list("row_counts", ["1", "5"], "rows of x (1: a decode row; k + 1: a verification row)")
flags.DEFINE_integer("scan_layers", 30, "layers scanned over (SmolLM2: 30)")
flags.DEFINE_integer("rounds", 40, "timings per build, part and row count (one per round, builds alternating)")
flags.DEFINE_bool("cold", True, "read a 160 MB buffer before each timing (weights from memory, as in a decode step)")
flags.DEFINE_integer("weights_seed", 0, "seed of the random weights and inputs")
if "json_out" not in FLAGS:  # other experiment scripts define it too (same meaning)
    flags.DEFINE_string("json_out", None, "write the record here")
    check_out_flag("json_out")

# SmolLM2-135M: hidden 576, fused QKV 960 (9 + 2 x 3 heads of 64), intermediate 1536 (fused gate-up 3072), vocab 49152
HIDDEN, QKV, INTER, VOCAB = 576, 960, 1536, 49152


def register(builds: list[str]) -> list[str]:
    """Register each build's matmul handler with XLA under a name of its own; returns the names."""
    from pallas_kernels import native

    if native.unavailable_reason() is not None:  # loads (and registers) the package's own kernel first
        raise app.UsageError(f"the native kernel cannot run here: {native.unavailable_reason()}")
    names = []
    for i, b in enumerate(builds):
        path = native._library_path() if b == "package" else b
        if not path or not os.path.exists(path):
            raise app.UsageError(f"--builds: no shared library at {path!r}")
        lib = ctypes.CDLL(os.path.abspath(path))
        name = f"jpg_quant_matmul_build{i}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.JpgQuantMatmul), platform="cpu")
        names.append(name)
    return names


def weights(layers: int, seed: int) -> dict:
    """Random Q4_1 layer stacks and an int8 head in SmolLM2's shapes."""
    from models.quant import quantize

    rng = np.random.default_rng(seed)

    def stack(k, o):
        qs = [quantize(jnp.asarray(rng.standard_normal((k, o), np.float32) * 0.05), "q4_1", 32)
              for _ in range(layers)]
        return jax.tree.map(lambda *a: jnp.stack(a), *qs)

    return {"wqkv": stack(HIDDEN, QKV), "wo": stack(HIDDEN, HIDDEN), "w_gate_up": stack(HIDDEN, 2 * INTER),
            "w_down": stack(INTER, HIDDEN),
            "head": quantize(jnp.asarray(rng.standard_normal((HIDDEN, VOCAB), np.float32) * 0.05), "int8", 32)}


def programs(target: str, w: dict, layers: int):
    """(layers, head): functions of x [N, 576] that run build `target` (jitted with the weights as arguments, so every
    build reads the same buffers)."""
    from pallas_kernels import native

    def mm(x, qa, layer=None):
        saved, native.TARGET = native.TARGET, target  # native_matmul names its target at trace time
        try:
            return native.native_matmul(x, qa, layer=layer)
        finally:
            native.TARGET = saved

    def stack(x, w):
        def body(x, i):
            a = mm(x, w["wqkv"], i)[:, :HIDDEN]
            b = mm(a, w["wo"], i)
            c = mm(b, w["w_gate_up"], i)[:, :INTER]
            return mm(c, w["w_down"], i) * 1e-2 + x, None

        return jax.lax.scan(body, x, jnp.arange(layers))[0]

    lay, head = jax.jit(stack), jax.jit(lambda x, h: mm(x, h))
    return (lambda x: lay(x, w)), (lambda x: head(x, w["head"]))


def main(argv):
    del argv
    from experiments.lib.serving.env import device_info, git_info, load_average, versions
    from pallas_kernels import native

    builds = FLAGS.builds
    names = register(builds)
    w = weights(FLAGS.scan_layers, FLAGS.weights_seed)
    progs = [programs(n, w, FLAGS.scan_layers) for n in names]
    flush = jnp.ones(40_000_000, jnp.float32)
    read = jax.jit(jnp.sum)
    layer_bytes = sum(native_bytes(w[k]) for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    head_bytes = native_bytes(w["head"])
    flag_names = ("builds", "row_counts", "scan_layers", "rounds", "cold", "weights_seed")
    record = {"flags": {k: getattr(FLAGS, k) for k in flag_names},
              "git": git_info(), "device": device_info(), "versions": versions(), "isa": native.resolved_isa(),
              "load_before": load_average("bench_native_builds"), "results": []}
    rng = np.random.default_rng(FLAGS.weights_seed + 1)
    for n in (int(r) for r in FLAGS.row_counts):
        x = jnp.asarray(rng.standard_normal((n, HIDDEN), np.float32))
        outs = [[np.asarray(f(x)) for f in p] for p in progs]  # compiles, and the bits to compare
        times = [[[], []] for _ in progs]
        for rnd in range(FLAGS.rounds):
            order = range(len(progs)) if rnd % 2 == 0 else reversed(range(len(progs)))
            for b in order:
                for part in (0, 1):
                    if FLAGS.cold:
                        read(flush).block_until_ready()
                    t0 = time.perf_counter()
                    progs[b][part](x).block_until_ready()
                    times[b][part].append(time.perf_counter() - t0)
        for b, build in enumerate(builds):
            row = {"build": build, "rows": n,
                   "same_bits": all(np.array_equal(outs[b][i], outs[0][i]) for i in (0, 1))}
            for part, key, nbytes in ((0, "layers", layer_bytes), (1, "head", head_bytes)):
                t = np.asarray(times[b][part]) * 1e3
                row[f"{key}_ms_median"] = float(np.median(t))
                row[f"{key}_ms_p25"] = float(np.percentile(t, 25))
                row[f"{key}_gb_s"] = nbytes / 1e6 / float(np.median(t))
            record["results"].append(row)
            print(f"{build}: {n} rows  layers {row['layers_ms_median']:.3f} ms (p25 {row['layers_ms_p25']:.3f}, "
                  f"{row['layers_gb_s']:.1f} GB/s)  head {row['head_ms_median']:.3f} ms (p25 {row['head_ms_p25']:.3f}, "
                  f"{row['head_gb_s']:.1f} GB/s)  same bits as {builds[0]}: {row['same_bits']}", flush=True)
    record["load_after"] = load_average("bench_native_builds")
    write_record(FLAGS.json_out, record)


def native_bytes(qa) -> int:
    """Bytes the kernel reads for `qa` (values, scales, mins)."""
    return sum(int(a.size) * a.dtype.itemsize for a in (qa.values, qa.scales, qa.mins) if a is not None)


if __name__ == "__main__":
    app.run(main)
