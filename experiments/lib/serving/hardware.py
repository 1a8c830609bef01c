"""Hardware probes and a gpt-fast-style utilisation estimate for the serving benchmark.

Peaks are measured on this machine at the start of each invocation (nothing cached): memory bandwidth by a timed
large-array streaming op under jit (`a * 1.0001`: one read and one write of every byte), peak FLOP/s by a timed
large `jnp.dot` (float32 on the CPU, bfloat16 on an accelerator); the best (fastest) of a few repeats counts.

Work per engine step is estimated from the rows the step ran (see `UTILISATION_NOTES`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

UTILISATION_NOTES = (
    "Estimated, useful work only (bucket padding not counted). Bytes per step = weight bytes (all parameter leaves, "
    "quantized ones at their resident size; an untied input-embedding table is excluded since a step reads only the "
    "looked-up rows) + KV-cache bytes read: for every row, (start_pos + row tokens) x layers x 2 (K,V) x kv_heads x "
    "(head_dim x cache itemsize + scale bytes for an int8 cache). KV writes and activations are ignored. FLOPs per "
    "step = 2 x (layer matmul params) x tokens + 2 x hidden x vocab x rows (logits of each row's last token) + "
    "attention 4 x layers x heads x head_dim x (attended positions, causal within a chunk). Achieved rates divide "
    "by the benchmark duration (wall, host time included) and, separately, by the summed engine step time. Peaks: "
    "best-of-N timed jit(a * 1.0001) in place over a large f32 buffer (2 x bytes moved) and jnp.dot of square matrices "
    "(2 n^3 FLOPs; float32 on the CPU, bfloat16 on an accelerator), measured at the start of the invocation."
)


def best_time(fn, repeats: int, iters: int = 1) -> float:
    """Seconds per call: the fastest of `repeats` timings of `iters` back-to-back calls of `fn()` (blocking on the
    last result), after one untimed call. On an accelerator a single short call is mostly dispatch latency: pass
    `iters` > 1 there."""
    import jax

    jax.block_until_ready(fn())  # compile + first touch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def _accelerator() -> bool:
    import jax

    return jax.default_backend() != "cpu"


def measure_memory_bandwidth(size_mb: int | None = None, repeats: int = 5) -> dict:
    """GB/s of an in-place jitted `a * 1.0001` over a float32 buffer (the buffer donated: one read and one write of
    every byte), the best of `repeats` timings of `iters` back-to-back calls: 128 MiB (beyond the caches) and 1 call
    on the CPU, 1 GiB and 20 calls on an accelerator (where one call is mostly launch latency). In place matters on
    the CPU: a fresh output per call makes the kernel zero new pages, and that is most of what gets timed (3-4 GB/s
    on the 2-core EPYC host where the in-place pass runs at 41-68 GB/s; 2026-12-06)."""
    import jax
    import jax.numpy as jnp

    acc = _accelerator()
    size_mb = size_mb or (1024 if acc else 128)
    iters = 20 if acc else 1
    scale = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    buf = jax.block_until_ready(scale(jnp.ones((size_mb * 2**20 // 4,), jnp.float32)))  # compiled, pages touched
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            buf = scale(buf)
        jax.block_until_ready(buf)
        best = min(best, (time.perf_counter() - t0) / iters)
    moved = 2 * buf.nbytes
    del buf
    return {"bandwidth_gbps": moved / best / 1e9, "bytes_moved": int(moved), "best_seconds": best, "repeats": repeats,
            "method": f"best of {repeats} timings of {iters} calls: jit(a * 1.0001) in place (donated) over a "
                      f"{size_mb} MiB float32 buffer, read + write"}


def measure_matmul_flops(n: int | None = None, repeats: int = 5) -> dict:
    """FLOP/s of a jitted square `jnp.dot`: float32 2048^3 on the CPU; bfloat16 8192^3 (the tensor-core ceiling)
    with 10 calls per timing on an accelerator."""
    import jax
    import jax.numpy as jnp

    acc = _accelerator()
    n = n or (8192 if acc else 2048)
    dtype = jnp.bfloat16 if acc else jnp.float32
    iters = 10 if acc else 1
    rng = np.random.default_rng(0)  # random operands: zeros can run faster than real data
    a = jnp.asarray(rng.normal(size=(n, n)), dtype)
    b = jnp.asarray(rng.normal(size=(n, n)), dtype)
    f = jax.jit(jnp.dot)
    t = best_time(lambda: f(a, b), repeats, iters)
    flops = 2 * n**3
    name = jnp.dtype(dtype).name
    return {"matmul_flops": flops / t, "matmul_gflops": flops / t / 1e9, "best_seconds": t, "repeats": repeats,
            "dtype": name, "method": f"best of {repeats} timings of {iters} calls: jit(jnp.dot) {name} {n}x{n} @ "
                                     f"{n}x{n} (2 n^3 FLOPs)"}


def measure_peaks(size_mb: int | None = None, matmul_n: int | None = None, repeats: int = 5) -> dict:
    bw = measure_memory_bandwidth(size_mb, repeats)
    mm = measure_matmul_flops(matmul_n, repeats)
    return {"bandwidth_gbps": bw["bandwidth_gbps"], "matmul_gflops": mm["matmul_gflops"], "bandwidth": bw,
            "matmul": mm}


# ------------------------------------------------------------------------------------------- work estimate
@dataclasses.dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # parameter bytes a step reads
    matmul_params: int  # layer matmul parameters (per token)
    head_params: int  # hidden x vocab (per row: logits of its last token)
    kv_bytes_per_token: int  # cache bytes of one token over all layers, K and V
    attn_flops_per_pair: int  # FLOPs per (query token, attended position) over all layers

    def step_bytes(self, rows: Sequence[tuple[int, int, bool]]) -> int:
        return self.weight_bytes + sum((s + n) * self.kv_bytes_per_token for s, n, _ in rows)

    def step_flops(self, rows: Sequence[tuple[int, int, bool]]) -> int:
        tokens = sum(n for _, n, _ in rows)
        pairs = sum(n * s + n * (n + 1) // 2 for s, n, _ in rows)  # causal: token i of the chunk sees s + i + 1
        return 2 * self.matmul_params * tokens + 2 * self.head_params * len(rows) + self.attn_flops_per_pair * pairs


def leaf_bytes(tree) -> int:
    import jax

    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def model_cost(cfg, params, cache_state=None, cache_itemsize: int = 4) -> ModelCost:
    """Work constants of a Llama-family `cfg` / `params` (a `models.weights.Weights`) and KV cache
    (`paged.device.state.EngineState`, for its dtype and int8 scales)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv, layers = cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
    per_layer = h * (nq + 2 * nkv) * d + nq * d * h + h * 2 * f + f * h
    total = leaf_bytes(params)
    if getattr(params, "lm_head", None) is not None:
        total -= leaf_bytes(params.embed)  # the untied input embedding: only looked-up rows are read
    scale_bytes = 0
    if cache_state is not None:
        cache_itemsize = cache_state.k.dtype.itemsize
        if getattr(cache_state, "k_scale", None) is not None:
            scale_bytes = cache_state.k_scale.dtype.itemsize
    return ModelCost(weight_bytes=int(total), matmul_params=layers * per_layer, head_params=h * cfg.vocab_size,
                     kv_bytes_per_token=layers * 2 * nkv * (d * cache_itemsize + scale_bytes),
                     attn_flops_per_pair=4 * layers * nq * d)


def engine_cost(engine) -> ModelCost | None:
    """`model_cost` of a real `paged.device.engine.Engine`; None for engines without a model (fakes)."""
    model = getattr(engine, "model", None)
    cfg = getattr(engine, "cfg", None) or getattr(model, "config", None)
    if model is None or cfg is None or getattr(model, "params", None) is None:
        return None
    return model_cost(cfg, model.params, getattr(engine, "state", None))


def utilisation(cost: ModelCost | None, steps, duration: float, peaks: dict | None) -> dict | None:
    """Achieved bytes/s and FLOP/s of the recorded steps (`runner.StepRecord`s), over the wall duration and over
    the summed engine time, with fractions of the measured peaks."""
    if cost is None:
        return None
    total_bytes = total_flops = 0
    for s in steps:
        reps = max(1, s.num_steps)
        total_bytes += reps * cost.step_bytes(s.rows)
        total_flops += reps * cost.step_flops(s.rows)
    engine_s = sum(s.seconds for s in steps)
    out = {
        "weight_bytes_per_step": cost.weight_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
        "matmul_params": cost.matmul_params,
        "steps": len(steps),
        "total_bytes": int(total_bytes),
        "total_flops": int(total_flops),
        "achieved_gbps": total_bytes / duration / 1e9 if duration > 0 else None,
        "achieved_gflops": total_flops / duration / 1e9 if duration > 0 else None,
        "engine_seconds": engine_s,
        "achieved_gbps_engine_time": total_bytes / engine_s / 1e9 if engine_s > 0 else None,
        "achieved_gflops_engine_time": total_flops / engine_s / 1e9 if engine_s > 0 else None,
    }
    for key, peak_key, frac in (("achieved_gbps", "bandwidth_gbps", "bandwidth_fraction"),
                                ("achieved_gflops", "matmul_gflops", "flops_fraction")):
        peak = (peaks or {}).get(peak_key)
        for suffix in ("", "_engine_time"):
            v = out[key + suffix]
            out[frac + suffix] = v / peak if (peak and v is not None) else None
    return out
