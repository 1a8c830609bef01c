"""Kernel benchmark: paged attention and dequant-matmul implementations (built-in, registered, or `module:function`)
on chosen shapes, each checked against the reference before it is timed, with bandwidth and FLOP utilisation
against this device's peaks measured in the same run.

    python -m experiments.bench_kernels --json_out experiments/results/kernels_cpu.json
    python -m experiments.bench_kernels --ops attention --attn_impls xla,my_module:my_attention \\
        --attn_shapes decode16x2048,prefill256x512 --plot /tmp/attn.png
    python -m experiments.bench_kernels --attn_impls pallas --sweep          # on a GPU: tune the kernel per shape
    python -m experiments.bench_kernels --ops attention --attn_impls pallas --attn_shapes mixed512+64x2048 \
        --sweep --sweep_fix block_q=16,pages_per_block=4     # a mixed step: decode rows split over keys or not

Shapes: attention `decode{rows}x{ctx}` (rows decode tokens, each with ctx cached tokens), `prefill{q}x{ctx}` (one
chunk of q <= ctx tokens ending at ctx), `mixed{q}+{rows}x{ctx}` (a chunk and rows decode tokens), with `--heads`
(KV heads x query heads per KV head x head dim; default SmolLM2's 3x3x64) and `--page_size`; or `conformance`,
the quick case space of `pallas_kernels.testing`. Matmul `{n}x{in}x{out}` with `--kinds`.

Each point: one untimed call (compile), then `--repeats` timings of `--iters` back-to-back calls; the record keeps
the minimum and the median per call. Peaks (`experiments.lib.peaks`): best-of-5 jit(a * 1.0001) over 128 MiB
(bandwidth) and a float32 2048^3 dot (FLOP/s; bfloat16 8192^3 on a GPU), measured before the points and again after
them; the higher of those and the device's recorded peak (experiments/data/peaks.json) is used, raised to a point's
achieved rate where that is higher still, so no utilisation exceeds 100%: the output and the record (`peaks.used`)
say which peak was used and where it came from. Bytes counted: attention reads every row's K and V (ctx x KV heads x
head dim x 2 x itemsize, plus scales) and q; the matmul reads its weight leaves and x. FLOPs: attention
4 x tokens x attended keys x heads x head dim; matmul 2 x n x in x out. On the CPU the Pallas kernels run
interpreted (correctness only), so they are timed only when named; the defaults there are "native" (what "auto" runs
on the CPU, where it is built), "xla" and "reference". Matmul shapes also time a dense dot in the backend's fastest
dense dtype (`dense_baseline_dtype`: float32 on the CPU, bfloat16 on a GPU) and give each kernel's speed-up over it.

`--sweep` times every tuning of `sweep_grid` (narrowed by `--sweep_fix`) and records the best per shape, with every
candidate's timing (`tuned[].timings`). The attention grid splits keys (`k_splits > 1`) only where a shape has decode
rows: all rows of a decode shape, only the decode rows of a mixed shape (`split_max_q=1`: the chunk is attended
whole), none of a prefill shape.
"""

from __future__ import annotations

import re
import statistics
import time

from absl import app, flags

from experiments.lib.common import check_out_flag, write_record
from experiments.lib.kernel_bench import (
    achieved_rates,
    apply_utilisation,
    default_impls,
    dense_baseline_dtype,
    native_attention_reason,
    native_matmul_reason,
    sweep_grid,
)

FLAGS = flags.FLAGS
flags.DEFINE_list("ops", ["attention", "matmul"], "kernel families to run: attention, matmul")
flags.DEFINE_list("attn_impls", None, "attention implementations: names or module:function paths "
                  "(default: native,xla,reference on the CPU, native where it is built; pallas,xla on a GPU)")
flags.DEFINE_list("matmul_impls", None, "dequant-matmul implementations (default: as --attn_impls)")
flags.DEFINE_list("attn_shapes", ["decode16x512", "decode16x2048", "prefill256x512", "mixed128+8x1024"],
                  "attention shapes (see the module docstring), or 'conformance'")
flags.DEFINE_list("matmul_shapes", ["1x576x1536", "16x576x1536", "1x1536x576", "64x576x1536"],
                  "matmul shapes n x in x out, or 'conformance'")
flags.DEFINE_list("kinds", ["q4_1", "int8"], "weight kinds for the matmul shapes (q4_1, q4_0, int8)")
flags.DEFINE_string("heads", "3x3x64", "attention heads: KV heads x query heads per KV head x head dim")
flags.DEFINE_integer("page_size", 64, "attention page size")
flags.DEFINE_enum("cache_dtype", "float32", ["float32", "bfloat16", "int8"], "attention KV cache dtype")
flags.DEFINE_string("attn_tuning", None, "tuning for the attention implementations that take one "
                    "('block_q=16,pages_per_block=4' or a JSON file)")
flags.DEFINE_string("matmul_tuning", None, "tuning for the matmul implementations that take one")
flags.DEFINE_boolean("sweep", False, "tune: time every tuning of the sweep grid for implementations with a tuning "
                     "type and record the best per shape")
flags.DEFINE_string("sweep_fix", None, "with --sweep: only the grid's tunings with these field values "
                    "('block_q=16,pages_per_block=4': time the key splits at the default blocking of a mixed step)")
flags.DEFINE_integer("iters", 10, "back-to-back calls per timing")
flags.DEFINE_integer("repeats", 5, "timings per point (min and median are recorded)")
flags.DEFINE_boolean("dense_baseline", True, "also time a dense x @ W of each matmul shape in the fastest dense "
                     "dtype of the backend (float32 on the CPU, bfloat16 on a GPU): what a quantized matmul must "
                     "beat; each quantized point gets its speed-up over it (vs_dense)")
flags.DEFINE_boolean("remeasure_peaks", True, "measure the peaks again after the points (the higher counts: a "
                     "busy moment at the start gives low peaks)")
flags.DEFINE_boolean("record_peaks", False, "write the peaks measured in this run into experiments/data/peaks.json "
                     "for this device where they exceed the recorded ones (run on an idle machine)")
flags.DEFINE_boolean("check", True, "check every implementation against the reference before timing it")
flags.DEFINE_string("json_out", None, "write the JSON record here")
check_out_flag("json_out")
flags.DEFINE_string("plot", None, "write a per-shape bar chart of median times here (.png)")
check_out_flag("plot")


# ------------------------------------------------------------------------------------------------- shapes
def attention_inputs(spec: str, heads: str, page_size: int, cache: str, seed: int = 0) -> tuple[str, dict, dict]:
    """(label, paged_attention keyword arguments, cost {bytes, flops}) for one shape spec."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import PrefillDecodeLayout, layout_query_start
    from pallas_kernels.testing import quantize_pages

    m = re.fullmatch(r"decode(\d+)x(\d+)|prefill(\d+)x(\d+)|mixed(\d+)\+(\d+)x(\d+)", spec)
    if not m:
        raise app.UsageError(f"attention shape {spec!r}: expected decode<rows>x<ctx>, prefill<q>x<ctx> or "
                             "mixed<q>+<rows>x<ctx>")
    kh, g, d = (int(x) for x in heads.split("x"))
    if m.group(1):
        rows, ctx, q_len = int(m.group(1)), int(m.group(2)), 0
    elif m.group(3):
        rows, q_len, ctx = 0, int(m.group(3)), int(m.group(4))
    else:
        q_len, rows, ctx = int(m.group(5)), int(m.group(6)), int(m.group(7))
    layout = PrefillDecodeLayout(1 if q_len else 0, q_len or 1, rows)
    s = layout.num_rows
    ps = page_size
    p = -(-ctx // ps)
    num_pages = 1 + s * p
    rng = np.random.default_rng(seed)
    table = rng.permutation(np.arange(1, num_pages)).reshape(s, p).astype(np.int32)
    q_lens = np.asarray([q_len] * (1 if q_len else 0) + [1] * rows, np.int32)
    kv_lens = np.full((s,), ctx, np.int32)
    kp = jnp.asarray(rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32))
    vp = jnp.asarray(rng.normal(size=(kh, num_pages, ps, d)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(layout.num_tokens, kh * g, d)).astype(np.float32))
    ks = vs = None
    itemsize = 4
    if cache == "int8":
        kp, ks = quantize_pages(kp)
        vp, vs = quantize_pages(vp)
        itemsize = 1 + 4 / d
    elif cache == "bfloat16":
        q, kp, vp = q.astype(jnp.bfloat16), kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16)
        itemsize = 2
    inputs = dict(q=q, k_pages=kp, v_pages=vp, query_start=layout_query_start(layout), query_lens=jnp.asarray(q_lens),
                  kv_lens=jnp.asarray(kv_lens), page_table=jnp.asarray(table), sm_scale=d**-0.5, layout=layout,
                  sliding_window=None, soft_cap=None, k_scales=ks, v_scales=vs)
    attended = rows * ctx + sum(ctx - q_len + i + 1 for i in range(q_len))
    cost = {"bytes": int(2 * s * ctx * kh * d * itemsize + q.size * q.dtype.itemsize),
            "flops": int(4 * attended * kh * g * d)}
    return f"{spec} h{heads} ps{ps} {cache}", inputs, cost


def conformance_attention() -> list[tuple[str, dict, dict]]:
    from pallas_kernels import testing

    out = []
    for case in testing.attention_cases("quick"):
        inputs = testing.build_attention_inputs(case)
        itemsize = 1 if case.cache == "int8" else (2 if case.cache == "bfloat16" else 4)
        kv = int(sum(inputs["kv_lens"])) * case.kv_heads * case.head_dim * 2 * itemsize
        qn = int(sum(inputs["query_lens"]))
        out.append((f"conformance:{case.name}", inputs, {"bytes": kv, "flops": 4 * qn * int(max(inputs["kv_lens"]))
                                                          * case.kv_heads * case.q_per_kv * case.head_dim}))
    return out


def matmul_inputs(spec: str, kind: str, seed: int = 0) -> tuple[str, tuple, dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.quant_format import random_quantized

    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", spec)
    if not m:
        raise app.UsageError(f"matmul shape {spec!r}: expected <n>x<in>x<out>")
    n, k, out = (int(x) for x in m.groups())
    rng = np.random.default_rng(seed)
    qa = random_quantized(rng, kind, 32, k, out)
    x = jnp.asarray(rng.normal(size=(n, k)).astype(np.float32))
    wbytes = sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(qa))
    return f"{spec} {kind}", (x, qa), {"bytes": wbytes + x.nbytes, "flops": 2 * n * k * out}


ATTN_SHAPE = r"decode(\d+)x(\d+)|prefill(\d+)x(\d+)|mixed(\d+)\+(\d+)x(\d+)"
MATMUL_SHAPE = r"(\d+)x(\d+)x(\d+)"


def check_flags() -> None:
    """Every flag checked before the peaks are measured: app.UsageError naming the flag."""
    import jax

    from pallas_kernels.quant_format import KINDS
    from pallas_kernels.registry import KernelError, attention_registry, matmul_registry

    backend, tuned = jax.default_backend(), 0
    ops = ("attention", "matmul")
    if not FLAGS.ops or any(o not in ops for o in FLAGS.ops):
        raise app.UsageError(f"--ops takes a comma-separated list of {', '.join(ops)}, got {','.join(FLAGS.ops)!r}")
    for name in ("iters", "repeats", "page_size"):
        if getattr(FLAGS, name) < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")

    def shapes(name: str, pattern: str, expected: str) -> None:
        values = getattr(FLAGS, name)
        if values == ["conformance"]:
            return
        if not values:
            raise app.UsageError(f"--{name} needs at least one shape ({expected}) or 'conformance'")
        for v in values:
            m = re.fullmatch(pattern, v)
            sizes = [int(x) for x in m.groups() if x is not None] if m else []
            mixed = v.startswith("mixed")  # (mixed<q>+<rows>: either may be 0, not both)
            if not m or (min(sizes[-1:] if mixed else sizes) < 1) or (mixed and sizes[0] + sizes[1] < 1):
                raise app.UsageError(f"--{name}: {v!r} is not a shape {expected} (sizes >= 1), or 'conformance'")
            if v.startswith(("prefill", "mixed")) and sizes[0] > sizes[-1]:
                raise app.UsageError(f"--{name}: {v!r}: the chunk of {sizes[0]} query tokens ends at the context of "
                                     f"{sizes[-1]}, so it can be at most {sizes[-1]} tokens")

    def impls_and_tuning(reg, impls_flag: str, tuning_flag: str, defaults) -> int:
        """Checks the family's implementations and their tunings; returns how many of them take a tuning."""
        impls = getattr(FLAGS, impls_flag)
        if impls is not None and not impls:
            raise app.UsageError(f"--{impls_flag} needs at least one implementation (leave it out for the defaults)")
        named = (f"--{impls_flag}={','.join(impls)}" if impls
                 else f"the default --{impls_flag} here ({','.join(defaults)})")
        tuned = []
        for name in impls or defaults:
            try:
                impl = reg.get(name)
            except KernelError as e:
                raise app.UsageError(f"--{impls_flag}: {e}") from None
            if impl.tuning_type is None:
                continue
            tuned.append(name)
            for flag in (tuning_flag, "sweep_fix") if FLAGS.sweep else (tuning_flag,):
                try:
                    reg.parse_tuning(impl, getattr(FLAGS, flag))
                except KernelError as e:
                    raise app.UsageError(f"--{flag}: {e}") from None
        if not tuned and getattr(FLAGS, tuning_flag):
            raise app.UsageError(f"--{tuning_flag}: none of {named} takes a tuning (no tuning_type); drop it or name "
                                 "an implementation that does")
        return len(tuned)

    if "attention" in FLAGS.ops:
        heads = re.fullmatch(r"(\d+)x(\d+)x(\d+)", FLAGS.heads)
        if not heads or min(int(x) for x in heads.groups()) < 1:
            raise app.UsageError(f"--heads takes <KV heads>x<query heads per KV head>x<head dim> (each >= 1), got "
                                 f"{FLAGS.heads!r}")
        shapes("attn_shapes", ATTN_SHAPE, "decode<rows>x<ctx>, prefill<q>x<ctx> or mixed<q>+<rows>x<ctx>")
        tuned += impls_and_tuning(attention_registry(), "attn_impls", "attn_tuning",
                                  default_impls(backend, native_attention_reason(FLAGS.heads)))
    if "matmul" in FLAGS.ops:
        shapes("matmul_shapes", MATMUL_SHAPE, "<n>x<in>x<out>")
        for v in FLAGS.matmul_shapes:
            if v != "conformance" and int(v.split("x")[1]) % 32:
                raise app.UsageError(f"--matmul_shapes: {v!r}: <in> must be a multiple of 32 (the group size)")
        if not FLAGS.kinds or any(k not in KINDS for k in FLAGS.kinds):
            raise app.UsageError(f"--kinds takes a comma-separated list of {', '.join(KINDS)}, got "
                                 f"{','.join(FLAGS.kinds)!r}")
        tuned += impls_and_tuning(matmul_registry(), "matmul_impls", "matmul_tuning",
                                  default_impls(backend, native_matmul_reason()))
    if FLAGS.sweep_fix and not FLAGS.sweep:
        raise app.UsageError("--sweep_fix narrows the --sweep grid: add --sweep, or drop it")
    if FLAGS.sweep_fix and not tuned:
        raise app.UsageError("--sweep_fix: no implementation timed here takes a tuning (no tuning_type), so there is "
                             "no grid to narrow")


# ------------------------------------------------------------------------------------------------- timing
def time_calls(fn, iters: int, repeats: int) -> dict:
    """Per-call seconds: min and median over `repeats` timings of `iters` back-to-back calls, after one untimed
    call (compilation, first touch)."""
    import jax

    jax.block_until_ready(fn())
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / iters)
    return {"min_s": min(per_call), "median_s": statistics.median(per_call), "repeats": repeats, "iters": iters}


def attention_runner(impl, inputs: dict, tuning):
    from pallas_kernels.testing import run_attention

    return lambda: run_attention(impl, inputs, tuning=tuning)


def attention_error(impl, inputs: dict, tuning) -> float:
    import numpy as np

    from pallas_kernels.testing import reference_attention, run_attention

    got = np.asarray(run_attention(impl, inputs, tuning=tuning).astype("float32"))
    return float(np.abs(got - reference_attention(inputs)).max())


def matmul_runner(impl, args: tuple, tuning):
    import jax

    from pallas_kernels.dequant_matmul import dequant_matmul

    f = jax.jit(lambda x, qa: dequant_matmul(x, qa, impl=impl, config=tuning))
    return lambda: f(*args)


def matmul_error(impl, args: tuple, tuning) -> float:
    import numpy as np

    from pallas_kernels.testing import numpy_matmul

    got = np.asarray(matmul_runner(impl, args, tuning)(), np.float64)
    want = numpy_matmul(np.asarray(args[0]), args[1])
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-9))


def main(argv):
    del argv
    import logging

    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    import dataclasses

    import jax

    from experiments.lib import peaks as peak_table
    from experiments.lib.serving.env import device_info, git_info, load_average, versions
    from experiments.lib.serving.hardware import measure_peaks
    from pallas_kernels.registry import attention_registry, matmul_registry

    check_flags()
    gpu = jax.default_backend() == "gpu"
    backend = jax.default_backend()
    load = load_average("before the kernel benchmark")
    peaks = measure_peaks()
    print(f"device {jax.devices()[0]}: copy {peaks['bandwidth_gbps']:.1f} GB/s, {peaks['matmul']['dtype']} matmul "
          f"{peaks['matmul_gflops']:.1f} GFLOP/s (measured before the points)")
    rows: list[dict] = []
    tuned: list[dict] = []

    families = []
    if "attention" in FLAGS.ops:
        reg = attention_registry()
        shapes = conformance_attention() if FLAGS.attn_shapes == ["conformance"] else [
            attention_inputs(s, FLAGS.heads, FLAGS.page_size, FLAGS.cache_dtype) for s in FLAGS.attn_shapes]
        impls = FLAGS.attn_impls or default_impls(backend, native_attention_reason(FLAGS.heads))
        families.append(("attention", reg, impls, shapes, FLAGS.attn_tuning, attention_runner, attention_error))
    if "matmul" in FLAGS.ops:
        reg = matmul_registry()
        if FLAGS.matmul_shapes == ["conformance"]:
            from pallas_kernels import testing

            shapes = []
            for c in testing.matmul_cases("quick"):
                x, qa = testing.build_matmul_inputs(c)
                wb = sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(qa))
                shapes.append((f"conformance:{c.name}", (x, qa), {"bytes": wb + x.nbytes,
                                                                   "flops": 2 * c.n * c.k * c.out}))
        else:
            shapes = [matmul_inputs(s, k) for s in FLAGS.matmul_shapes for k in FLAGS.kinds]
        impls = FLAGS.matmul_impls or default_impls(backend, native_matmul_reason())
        families.append(("matmul", reg, impls, shapes, FLAGS.matmul_tuning, matmul_runner, matmul_error))

    tol = {"attention": 3e-2 if FLAGS.cache_dtype == "bfloat16" else (2e-3 if gpu else 1e-4), "matmul": 2e-3}
    for family, reg, impls, shapes, tuning_text, runner, error in families:
        for impl_name in impls:
            impl = reg.get(impl_name)
            tuning = reg.parse_tuning(impl, tuning_text) if impl.tuning_type is not None else None
            for label, inputs, cost in shapes:
                rec = {"op": family, "shape": label, "impl": impl_name,
                       "tuning": dataclasses.asdict(tuning) if tuning is not None else None, **cost}
                if FLAGS.check and impl_name != "reference":
                    err = error(impl, inputs, tuning)
                    rec["max_error"] = err
                    limit = max(tol[family], impl.tolerance or 0.0)  # an approximate-by-design kernel's own bound
                    rec["correct"] = err <= limit
                    if not rec["correct"]:
                        print(f"{family} {label:40s} {impl_name:12s} WRONG: max error {err:.3g} > {limit}; not timed")
                        rows.append(rec)
                        continue
                candidates = [tuning]
                sweeping = FLAGS.sweep and impl.tuning_type is not None
                if sweeping:
                    fix = dataclasses.asdict(reg.parse_tuning(impl, FLAGS.sweep_fix)) if FLAGS.sweep_fix else None
                    if fix is not None:  # the fields the text named (the parsed tuning has defaults for the rest)
                        fix = {k: fix[k] for k in (p.partition("=")[0].strip() for p in FLAGS.sweep_fix.split(","))}
                    candidates = sweep_grid(family, label, inputs, fix)
                    if not candidates:
                        raise app.UsageError(f"--sweep_fix {FLAGS.sweep_fix!r} leaves no tuning of the {family} "
                                             f"sweep for {label}")
                best = None
                timings = []
                for t in candidates:
                    try:
                        timing = time_calls(runner(impl, inputs, t), FLAGS.iters, FLAGS.repeats)
                    except Exception as e:  # noqa: BLE001 (a tuning the kernel rejects for this shape)
                        if len(candidates) == 1:
                            raise
                        print(f"  skip {t}: {type(e).__name__}: {str(e)[:80]}")
                        continue
                    if sweeping:
                        timings.append({"tuning": dataclasses.asdict(t), "min_s": timing["min_s"],
                                        "median_s": timing["median_s"]})
                        print(f"  {t}: median {timing['median_s'] * 1e3:8.3f} ms")
                    if best is None or timing["median_s"] < best[1]["median_s"]:
                        best = (t, timing)
                t, timing = best
                if sweeping:
                    rec["tuning"] = dataclasses.asdict(t)
                    tuned.append({"op": family, "impl": impl_name, "shape": label, "tuning": rec["tuning"],
                                  "median_s": timing["median_s"], "candidates": len(candidates),
                                  "timings": timings})
                rec.update(timing)
                med = timing["median_s"]
                rec["gbps"] = cost["bytes"] / med / 1e9
                rec["gflops"] = cost["flops"] / med / 1e9
                rows.append(rec)
                print(f"{family} {label:40s} {impl_name:12s} min {timing['min_s'] * 1e3:8.3f} ms  median "
                      f"{med * 1e3:8.3f} ms  {rec['gbps']:7.1f} GB/s  {rec['gflops']:7.1f} GFLOP/s")
    if "matmul" in FLAGS.ops and FLAGS.dense_baseline and FLAGS.matmul_shapes != ["conformance"]:
        dense_baselines(rows, dense_baseline_dtype(backend))
    measured = [peak_table.measured_peaks(peaks, "before the points")]
    after = None
    if FLAGS.remeasure_peaks:
        after = measure_peaks()
        measured.append(peak_table.measured_peaks(after, "after the points"))
    device = device_info()
    key = peak_table.device_key(device)
    table = peak_table.load_table()
    recorded = peak_table.recorded_peaks(table, key, peaks["matmul"]["dtype"])
    used = peak_table.choose_peaks(measured, recorded, achieved_rates(rows))
    apply_utilisation(rows, used)
    print_utilisation(rows, used)
    if FLAGS.record_peaks:
        best = {m: peak_table.pick_peak([x[m] for x in measured]) for m in peak_table.METRICS}
        table, changed = peak_table.updated_table(table, key, best, date=time.strftime("%Y-%m-%d"),
                                                  source=FLAGS.json_out or "experiments.bench_kernels",
                                                  matmul_dtype=peaks["matmul"]["dtype"])
        if changed:
            peak_table.write_table(table)
        print(f"peaks table ({peak_table.TABLE_PATH}), {key}: " + (f"raised {', '.join(changed)}" if changed else
                                                                     "unchanged (the recorded peaks are higher)"))
    peaks = {**peaks, "bandwidth_gbps": used["bandwidth_gbps"].value, "matmul_gflops": used["matmul_gflops"].value,
             "used": {m: dataclasses.asdict(p) for m, p in used.items()}, "device_key": key,
             "measured_before": {m: peaks[m] for m in peak_table.METRICS},
             "measured_after": None if after is None else {m: after[m] for m in peak_table.METRICS},
             "recorded": {m: dataclasses.asdict(p) for m, p in recorded.items()}}
    record = {"experiment": "bench_kernels", "flags": {f.name: f.value for f in FLAGS.get_flags_for_module(__name__)},
              "git": git_info(), "device": device, "versions": versions(), "load_avg_before": load,
              "load_avg_after": load_average(), "peaks": peaks, "dense_baseline": dense_baseline_dtype(backend),
              "results": rows, "tuned": tuned,
              "notes": __doc__}
    if FLAGS.json_out:
        write_record(FLAGS.json_out, record)
    if FLAGS.plot:
        plot_results(rows, FLAGS.plot)
        print(f"wrote {FLAGS.plot}")
    if any(r.get("correct") is False for r in rows):
        raise SystemExit(1)


def dense_baselines(rows: list[dict], dtype: str) -> None:
    """Time a dense `x @ W` in `dtype` (float32 accumulation) per matmul shape, add it to `rows` (shape
    "<spec> dense_<dtype>"), and give every quantized row of that shape its speed-up over it (`vs_dense`: dense time
    / quantized time; `dense_dtype` names the baseline)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    dt = jnp.dtype(dtype)
    for spec in FLAGS.matmul_shapes:
        n, k, out = (int(v) for v in spec.split("x"))
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(n, k)), dt)
        w = jnp.asarray(rng.normal(size=(k, out)) / np.sqrt(k), dt)
        f = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
        timing = time_calls(lambda f=f, x=x, w=w: f(x, w), FLAGS.iters, FLAGS.repeats)
        med = timing["median_s"]
        cost = {"bytes": dt.itemsize * (k * out + n * k), "flops": 2 * n * k * out}
        rec = {"op": "matmul", "shape": f"{spec} dense_{dtype}", "impl": "jnp.dot", "tuning": None, **cost, **timing,
               "gbps": cost["bytes"] / med / 1e9, "gflops": cost["flops"] / med / 1e9}
        rows.append(rec)
        print(f"matmul {rec['shape']:40s} {'jnp.dot':12s} min {timing['min_s'] * 1e3:8.3f} ms  median "
              f"{med * 1e3:8.3f} ms  {rec['gbps']:7.1f} GB/s  {rec['gflops']:7.1f} GFLOP/s")
        for r in rows:
            if r["op"] == "matmul" and r["shape"].split(" ")[0] == spec and "median_s" in r and r is not rec:
                r["vs_dense"], r["dense_dtype"] = med / r["median_s"], dtype
                print(f"  {r['shape']:30s} {r['impl']:12s} speed-up over dense {dtype}: {r['vs_dense']:5.2f}x")


def print_utilisation(rows: list[dict], used: dict) -> None:
    print(f"utilisation against copy {used['bandwidth_gbps'].value:.1f} GB/s ({used['bandwidth_gbps'].source}) and "
          f"dot {used['matmul_gflops'].value:.1f} GFLOP/s ({used['matmul_gflops'].source}):")
    for r in rows:
        if "bandwidth_frac" in r:
            print(f"  {r['op']} {r['shape']:40s} {r['impl']:12s} {100 * r['bandwidth_frac']:5.1f}% of copy  "
                  f"{100 * r['flops_frac']:5.1f}% of dot")


def plot_results(rows: list[dict], path: str) -> None:
    """One bar group per shape, one bar per implementation: median ms (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "median_s" in r]
    shapes = list(dict.fromkeys(f"{r['op']}: {r['shape']}" for r in timed))
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(shapes) * max(1, len(impls)) / 2), 4.5))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for i, s in enumerate(shapes):
            for r in timed:
                if f"{r['op']}: {r['shape']}" == s and r["impl"] == impl:
                    xs.append(i + j * width)
                    ys.append(r["median_s"] * 1e3)
        ax.bar(xs, ys, width, label=impl)
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(shapes))])
    ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("median ms per call")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
