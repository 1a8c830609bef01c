"""Which formulation of a quantized matmul is fastest on this CPU, for every matrix of the model?

For each weight matrix of the model (SmolLM2 by default: the fused QKV, O, fused gate-up, down, and the tied LM
head) at each row count, one jitted `lax.scan` over the index of `--stack_layers` stacked copies (so the weights stream
from memory as in the model, instead of sitting in the cache; each step reads layer i of the stack, as
`models/llama.py` does) of:

- `f32`: float32 weights, `x @ w`;
- `xla_q4_1`, `xla_int8`: the project's XLA path (`dequant_matmul_xla`): dequantize the group-32 blocks, float dot;
- `xla_intdot_channel`: int8 per-output-channel weights, int8 activations (one scale per row) and XLA's integer dot
  (`lax.dot_general(..., preferred_element_type=int32)`), scales after the dot (issue 18's proposal);
- `xla_intdot_group`: the same with group-32 weight scales and one activation scale per row and group: a batched
  integer dot over the groups, then scales and a sum over groups;
- `native_q4_1`, `native_int8`: the C++ AVX2 kernel (`pallas_kernels/native.py`), when it is built.

The LM head is one matrix (no scan). Min and median of `--timings` timings (each the mean of `--calls` calls back to
back); GB/s is the weight bytes of the formulation over the time.

    python -m experiments.bench_int_formulations --x_rows 1,16 --json_out experiments/results/int_formulations_cpu.json
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.lib.common import check_out_flag, write_record

FLAGS = flags.FLAGS

flags.DEFINE_list("x_rows", ["1", "16"], "rows of x (decode batch sizes)")
flags.DEFINE_integer("stack_layers", 30, "stacked copies scanned over (SmolLM2: 30)")
flags.DEFINE_integer("timings", 7, "timings per formulation and shape")
flags.DEFINE_integer("calls", 1, "calls per timing, back to back (a timing is their mean): steadier on a noisy host")
flags.DEFINE_list("formulations", ["f32", "xla_q4_1", "xla_int8", "xla_intdot_channel", "xla_intdot_group",
                                   "native_q4_1", "native_int8"], "formulations to time")
if "json_out" not in FLAGS:  # other experiment scripts define it too (same meaning)
    flags.DEFINE_string("json_out", None, "write the record here")
    check_out_flag("json_out")

# SmolLM2-135M: hidden 576, intermediate 1536, 9 q heads + 2 x 3 kv heads of 64, vocabulary 49152
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}


def _int8_rows(x: jnp.ndarray, block: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """x [N, K] -> int8 [N, K/block, block] and float32 scales [N, K/block, 1] (max-abs / 127 per block)."""
    n, k = x.shape
    xb = x.reshape(n, k // block, block)
    s = jnp.maximum(jnp.abs(xb).max(-1, keepdims=True), 1e-12) / 127.0
    return jnp.round(xb / s).astype(jnp.int8), s


def intdot_channel(x, q, scales):
    """q int8 [K, O], scales [1, O]: one int32 dot, then the two scales."""
    xq, xs = _int8_rows(x, x.shape[1])
    acc = jax.lax.dot_general(xq[:, 0, :], q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xs[:, 0, :] * scales.astype(jnp.float32)


def intdot_group(x, q, scales, group=32):
    """q int8 [K, O], scales [K/group, O]: per group an int32 dot (batched over groups), scaled, summed."""
    k, o = q.shape
    xq, xs = _int8_rows(x, group)  # [N, G, g], [N, G, 1]
    qg = q.reshape(k // group, group, o)
    acc = jax.lax.dot_general(xq, qg, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.int32)  # [G, N, O]
    return jnp.einsum("gno,gn,go->no", acc.astype(jnp.float32), xs[:, :, 0].T, scales.astype(jnp.float32))


def _weights(kind: str, k: int, o: int, layers: int, rng):
    from models import quant

    w = rng.normal(0, 0.05, (k, o)).astype(np.float32)
    if kind == "f32":
        one = jnp.asarray(w)
    elif kind in ("q4_1", "int8"):
        one = quant.quantize(w, kind, 32)
    elif kind == "int8_channel":
        one = quant.quantize(w, "int8", None)
    if layers == 1:
        return one
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (layers, *a.shape)).copy(), one)


def formulation(name: str):
    """(weight kind, fn(x, w_one_layer_or_stack, layer_index_or_None) -> y)."""
    from pallas_kernels import native
    from pallas_kernels.dequant_matmul import dequant_matmul_xla

    if name == "f32":
        return "f32", lambda x, w: x @ w
    if name in ("xla_q4_1", "xla_int8"):
        return name[4:], lambda x, w: dequant_matmul_xla(x, w)
    if name == "xla_intdot_channel":
        return "int8_channel", lambda x, w: intdot_channel(x, w.values, w.scales)
    if name == "xla_intdot_group":
        return "int8", lambda x, w: intdot_group(x, w.values, w.scales)
    if name in ("native_q4_1", "native_int8"):
        return name[7:], lambda x, w: native.native_matmul(x, w)
    raise app.UsageError(f"--formulations: unknown {name!r}")


def time_one(name: str, shape: str, rows: int, layers: int, repeats: int, rng, calls: int = 1) -> dict:
    from models import quant
    from pallas_kernels import native

    kind, fn = formulation(name)
    k, o = SHAPES[shape]
    n_layers = 1 if shape == "head" else layers
    w = _weights(kind, k, o, n_layers, rng)
    x = jnp.asarray(rng.normal(0, 1, (rows, k)), jnp.float32)
    if n_layers == 1:
        run = jax.jit(lambda x, w: fn(x, w))
    else:  # as models/llama.py does: scan over the layer index, each formulation reading layer i of the stack
        stacked = name.startswith("native")  # the native kernel reads the stack in place (`layer=`), no slice copy

        def run(x, w):
            def body(acc, i):
                y = (native.native_matmul(x, w, layer=i) if stacked
                     else fn(x, jax.tree_util.tree_map(lambda a: a[i], w)))
                return acc + y.sum(), None
            return jax.lax.scan(body, jnp.zeros((), jnp.float32), jnp.arange(n_layers))[0]
        run = jax.jit(run)
    one = w if n_layers == 1 else jax.tree_util.tree_map(lambda a: a[0], w)
    got = np.asarray(jax.jit(fn)(x, one))
    from pallas_kernels.quant_format import dequantize
    want = np.asarray(x) @ np.asarray(one if kind == "f32" else dequantize(one))
    rel_err = float(np.abs(got - want).max() / np.abs(want).max())
    if rel_err > 0.05:
        raise AssertionError(f"{name} on {shape}: relative error {rel_err:.3f} against the dequantized product")
    jax.block_until_ready(run(x, w))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = run(x, w)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    nbytes = quant.nbytes(w)
    return {"formulation": name, "shape": shape, "in": k, "out": o, "rows": rows, "layers": n_layers,
            "min_ms": 1e3 * min(times), "median_ms": 1e3 * float(np.median(times)),
            "weight_bytes": nbytes, "gb_s": nbytes / min(times) / 1e9, "max_rel_err": rel_err}


def main(argv):
    del argv
    from experiments.lib.serving.env import device_info, load_average, versions
    from pallas_kernels import native

    names = list(FLAGS.formulations)
    if not native.available():
        print(f"native kernel unavailable ({native.unavailable_reason()}); its formulations are skipped")
        names = [n for n in names if not n.startswith("native")]
    record = {"flags": {k: getattr(FLAGS, k) for k in ("x_rows", "stack_layers", "timings", "calls", "formulations")},
              "device": device_info(), "versions": versions(), "load_before": load_average("bench_int_formulations"),
              "runs": []}
    rng = np.random.default_rng(0)
    for rows in [int(r) for r in FLAGS.x_rows]:
        for shape in SHAPES:
            line = []
            for name in names:
                r = time_one(name, shape, rows, FLAGS.stack_layers, FLAGS.timings, rng, FLAGS.calls)
                record["runs"].append(r)
                line.append(f"{name} {r['min_ms']:.2f}")
            print(f"rows {rows:3d} {shape:8s} (ms, min): " + "  ".join(line), flush=True)
    record["load_after"] = load_average()
    totals = {}
    for r in record["runs"]:
        key = (r["rows"], r["formulation"])
        totals[key] = totals.get(key, 0.0) + r["min_ms"]
    record["model_totals_ms"] = [{"rows": k[0], "formulation": k[1], "min_ms_sum": v} for k, v in totals.items()]
    print("\nwhole model (all matrices, sum of mins):")
    for (rows, name), v in totals.items():
        print(f"  rows {rows:3d} {name:20s} {v:8.2f} ms")
    write_record(FLAGS.json_out, record)


if __name__ == "__main__":
    app.run(main)
