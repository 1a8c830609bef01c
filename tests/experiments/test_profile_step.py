"""experiments/profile_step.py --fit_out on the tiny random model. `--fit_source=grid` with a small grid: every grid
shape is timed in every pass (uniform contexts, then decode steps with one long row and short others), the fit is
written and loads, and the mixed steps read more KV slots (`kv_read`) than their rows' own contexts add up to. The
default (`both`): the grid's shapes with a prefill chunk plus every step of the generator serving the calibration
workload at each concurrency."""

from __future__ import annotations

import subprocess
import sys

import pytest

from paged.sim import FEATURES, StepTimeModel
from tests.compile_settings import script_env
from tests.experiments.helpers import run_expecting_usage_error


@pytest.mark.slow
def test_profile_step_fits_over_uniform_and_mixed_context_steps(tmp_path):
    out = tmp_path / "fit.json"
    env = script_env()
    p = subprocess.run([sys.executable, "-m", "experiments.profile_step", "--model=tiny", "--page_size=16",
                        "--fit_source=grid", "--grid_passes=2",
                        "--grid_prefill=0,16", "--grid_decode=1,2,4", "--grid_context=16,96", "--iters=1",
                        "--fit_max_batch_size=4", "--fit_max_seq_len=128", "--fit_narrow_tokens=0",
                        f"--fit_out={out}"], capture_output=True, text=True, env={**env, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    fit = StepTimeModel.load(out)
    grid = fit.fit_stats["grid"]
    uniform = [g for g in grid if g["other_context"] == g["context"]]
    mixed = [g for g in grid if g["other_context"] != g["context"]]
    # 2 contexts x 2 prefill x 3 decode, less a chunk with 4 decode rows (5 rows > the batch of 4) at each context
    assert len(uniform) == 2 * 2 * 3 - 2 and [(g["decode"], g["context"]) for g in mixed] == [(2, 96), (4, 96)]
    same = {(g["decode"], g["context"]): g for g in uniform if g["prefill"] == 0}
    for g in mixed:  # fewer KV tokens than the uniform step of the same rows, but the same slots read
        u = same[(g["decode"], g["context"])]
        assert g["other_context"] == 16 and g["kv_tokens"] < u["kv_tokens"] and g["kv_read"] == u["kv_read"]
    assert set(fit.coef) == set(FEATURES) and fit.fit_stats["samples"] == len(grid)
    assert all(len(g["passes"]) == 2 and g["seconds"] == pytest.approx(sum(g["passes"]) / 2) for g in grid)
    assert fit.fit_stats["source"] == "grid" and fit.fit_stats["serving"] == []
    assert "fit: base" in p.stdout and "context    96/   16" in p.stdout


@pytest.mark.slow
def test_the_default_fit_adds_every_serving_step_to_the_grids_prefill_shapes(tmp_path):
    out = tmp_path / "fit.json"
    p = subprocess.run([sys.executable, "-m", "experiments.profile_step", "--model=tiny", "--page_size=16",
                        "--grid_prefill=0,16", "--grid_decode=0,2", "--grid_context=16,96", "--iters=1",
                        "--grid_passes=1", "--serving_concurrency=1,3", "--serving_prompts=16,32",
                        "--serving_requests_per_row=1",
                        "--fit_max_batch_size=4", "--fit_max_seq_len=128", "--fit_narrow_tokens=0",
                        f"--fit_out={out}"], capture_output=True, text=True,
                       env={**script_env(), "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    fit = StepTimeModel.load(out)
    stats = fit.fit_stats
    # only the grid's shapes with a prefill chunk: 16 tokens alone or beside 2 decode rows, at each context
    assert stats["source"] == "both" and sorted((g["decode"], g["context"]) for g in stats["grid"]) == [
        (0, 16), (0, 96), (2, 16), (2, 96)] and all(g["prefill"] == 16 for g in stats["grid"])
    levels = stats["serving"]
    assert [(lv["concurrency"], lv["prompt_tokens"], lv["output_tokens"], lv["requests"]) for lv in levels] == [
        (1, 16, 8, 1), (1, 32, 16, 1), (3, 16, 8, 3), (3, 32, 16, 3)]
    # each request (16 or 32 +-90% prompt tokens, half as many output tokens) is served step by step
    assert all(lv["steps"] >= 2 and lv["mean_step_s"] > 0 for lv in levels)
    assert stats["samples"] == len(stats["grid"]) + sum(lv["steps"] for lv in levels)
    assert "serving at concurrency   3, prompts   32 +-90%: 3 requests" in p.stdout
    assert "grid shapes with a prefill chunk" in fit.notes


def test_the_narrow_path_is_the_native_kernels_row_limit(monkeypatch):
    """`narrow_path_tokens`: the native kernel's row limit where wider steps take XLA (AVX2: 128), 0 where the kernel
    takes every step (VNNI) or is not used."""
    import types

    import jax.numpy as jnp
    import pytest

    from experiments.lib.serving import env
    from models.quant import quantize
    from pallas_kernels import native

    if not native.available():
        pytest.skip(f"native kernel: {native.unavailable_reason()}")
    qa = quantize(jnp.ones((64, 32), jnp.float32), "q4_1", 32)
    model = types.SimpleNamespace(params=types.SimpleNamespace(layers={"w": qa, "norm": jnp.ones(4)}))
    eng = types.SimpleNamespace(config=types.SimpleNamespace(matmul_impl="auto"))
    monkeypatch.setattr(native, "resolved_isa", lambda: "avx2")
    assert env.narrow_path_tokens(model, eng) == 128
    monkeypatch.setattr(native, "resolved_isa", lambda: "avx512vnni")
    assert env.narrow_path_tokens(model, eng) == 0
    monkeypatch.setattr(native, "resolved_isa", lambda: "avx2")
    eng.config.matmul_impl = "xla"
    assert env.narrow_path_tokens(model, eng) == 0


@pytest.mark.parametrize("bad, message", [
    ("--concurrency=", "--concurrency takes a comma-separated list of integers >= 1"),
    ("--page_size=4", "--page_size must be a power of two >= 8"),
    ("--fit_out={tmp}/fit.json --grid_passes=0", "--grid_passes must be >= 1"),
])
def test_bad_flags_are_usage_errors_before_the_model_loads(tmp_path, bad, message):
    p = run_expecting_usage_error("experiments.profile_step", "--model=tiny", *bad.format(tmp=tmp_path).split())
    assert message in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "fit.json").exists()
