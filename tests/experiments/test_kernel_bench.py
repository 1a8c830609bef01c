"""experiments/lib/kernel_bench.py, bench_kernels' choices: the implementations timed by default per backend, the
dense baseline per backend, and utilisation never above 100% (the timing itself runs in
tests/pallas_kernels/test_kernel_registry.py, slow tier)."""

from __future__ import annotations

import pytest

from experiments.lib import kernel_bench


def test_default_implementations_per_backend():
    assert kernel_bench.default_impls("gpu", None) == ["pallas", "xla"]
    assert kernel_bench.default_impls("cpu", None) == ["native", "xla", "reference"]  # what "auto" runs on the CPU
    assert kernel_bench.default_impls("cpu", "not built") == ["xla", "reference"]


def test_the_dense_baseline_is_the_backends_fastest_dense_dot():
    assert kernel_bench.dense_baseline_dtype("cpu") == "float32"
    assert kernel_bench.dense_baseline_dtype("gpu") == "bfloat16"


def test_utilisation_is_never_above_100_percent():
    from experiments.lib.peaks import Peak, choose_peaks

    rows = [{"op": "matmul", "shape": "1x8x8 q4_1", "impl": "xla", "gbps": 40.0, "gflops": 1.0},
            {"op": "attention", "shape": "decode1x64", "impl": "native", "gbps": 10.0, "gflops": 3.0},
            {"op": "matmul", "shape": "1x8x8 q4_1", "impl": "wrong", "correct": False}]  # not timed
    measured = [{"bandwidth_gbps": Peak(25.0, "measured before"), "matmul_gflops": Peak(2.0, "measured before")}]
    used = choose_peaks(measured, {}, kernel_bench.achieved_rates(rows))
    kernel_bench.apply_utilisation(rows, used)
    assert rows[0]["bandwidth_frac"] == 1.0 and rows[1]["bandwidth_frac"] == 0.25  # raised to the matmul's 40 GB/s
    assert "matmul 1x8x8 q4_1 xla" in used["bandwidth_gbps"].source
    assert rows[1]["flops_frac"] == 1.0 and rows[0]["flops_frac"] == pytest.approx(1 / 3)
    assert "bandwidth_frac" not in rows[2]


def test_the_attention_sweep_splits_only_decode_rows():
    """--sweep's attention grid: a decode shape splits every row's keys; a mixed shape (a chunk and decode rows)
    splits only the decode rows (split_max_q=1, the chunk attended whole), so a GPU run times split decode rows
    against unsplit ones; a prefill shape splits nothing. --sweep_fix narrows the grid to the named fields."""
    from pallas_kernels.paged_attention import PrefillDecodeLayout
    from pallas_kernels.tuning import AttentionTuning

    def grid(layout, fix=None):
        return kernel_bench.sweep_grid("attention", "shape", {"layout": layout}, fix)

    mixed = grid(PrefillDecodeLayout(1, 512, 64))
    assert AttentionTuning(block_q=16, pages_per_block=4, k_splits=4, split_max_q=1) in mixed
    assert AttentionTuning(block_q=16, pages_per_block=4) in mixed
    assert {t.split_max_q for t in mixed if t.k_splits > 1} == {1}
    assert {t.split_max_q for t in mixed if t.k_splits == 1} == {0}
    assert {t.k_splits for t in mixed} == {1, 2, 4, 8}
    decode = grid(PrefillDecodeLayout(0, 1, 64))
    assert {t.k_splits for t in decode} == {1, 2, 4, 8} and {t.split_max_q for t in decode} == {0}
    assert {t.k_splits for t in grid(PrefillDecodeLayout(1, 2048, 0))} == {1}
    fixed = grid(PrefillDecodeLayout(1, 512, 64), {"block_q": 16, "pages_per_block": 4})
    assert fixed == [AttentionTuning(block_q=16, pages_per_block=4)] + [
        AttentionTuning(block_q=16, pages_per_block=4, k_splits=ks, split_max_q=1) for ks in (2, 4, 8)]


@pytest.mark.parametrize("bad, message", [
    ("--ops=bogus", "--ops takes a comma-separated list of attention, matmul"),
    ("--attn_impls=bogus", "--attn_impls: paged_attention: unknown implementation 'bogus'"),
    ("--iters=0", "--iters must be >= 1"),
])
def test_bench_kernels_bad_flags_are_usage_errors_before_the_peaks(bad, message):
    from tests.experiments.helpers import run_expecting_usage_error

    p = run_expecting_usage_error("experiments.bench_kernels", bad)
    assert message in p.stderr, p.stderr[-2000:]
    assert "GB/s" not in p.stdout  # no peaks measured


CHECK_FLAGS = """
import json, sys
from absl import app, flags
from experiments import bench_kernels
for argv in json.loads(sys.stdin.read()):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["bench_kernels", *argv])
    try:
        bench_kernels.check_flags()
        print("ok")
    except app.UsageError as e:
        print("UsageError:", e)
"""


def test_bench_kernels_checks_shapes_and_tunings_in_one_process():
    """In one process (bench_kernels' flags are defined at import, absl keeps one registry per process): a chunk
    longer than its context and a tuning no listed implementation takes are usage errors; the good ones pass."""
    import json
    import subprocess
    import sys

    from tests.compile_settings import ROOT, script_env

    cases = [
        (["--ops=attention", "--attn_shapes=prefill512x256"], "512 query tokens ends at the context of 256"),
        (["--ops=attention", "--attn_shapes=mixed300+4x256"], "the chunk of 300 query tokens"),
        (["--ops=attention", "--attn_shapes=mixed0+0x256"], "is not a shape"),
        (["--ops=attention", "--attn_shapes=decode4x0"], "is not a shape"),
        (["--ops=attention", "--attn_impls=xla", "--attn_tuning=block_q=16"],
         "--attn_tuning: none of --attn_impls=xla takes a tuning"),
        (["--ops=matmul", "--matmul_impls=xla", "--matmul_tuning=block_n=64"],
         "--matmul_tuning: none of --matmul_impls=xla takes a tuning"),
        (["--ops=attention", "--attn_tuning=block_q=16"], "--attn_tuning: none of the default --attn_impls here"),
        (["--sweep_fix=block_q=16"], "--sweep_fix narrows the --sweep grid: add --sweep"),
        (["--sweep", "--attn_impls=xla", "--matmul_impls=xla", "--sweep_fix=block_q=16"],
         "--sweep_fix: no implementation timed here takes a tuning"),
        (["--ops=attention", "--attn_shapes=prefill256x256,mixed128+8x1024,mixed0+8x64,decode1x1"], "ok"),
        (["--ops=attention", "--attn_impls=xla,pallas", "--attn_tuning=block_q=16"], "ok"),
        # one flag for both families: the attention kernel's grid, with a matmul family that takes no tuning
        (["--attn_impls=pallas", "--matmul_impls=xla", "--sweep", "--sweep_fix=block_q=16,pages_per_block=4"], "ok"),
    ]
    p = subprocess.run([sys.executable, "-c", CHECK_FLAGS], input=json.dumps([c for c, _ in cases]),
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=script_env(JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert len(lines) == len(cases), p.stdout
    for (argv, expected), line in zip(cases, lines):
        assert expected in line and (expected == "ok") == (line == "ok"), (argv, line)
