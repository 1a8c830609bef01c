"""experiments/profile_step.py --fit_out on the tiny random model with a small grid: every grid shape is timed
(uniform contexts, then decode steps with one long row and short others), the fit is written and loads, and the
mixed steps read more KV slots (`kv_read`) than their rows' own contexts add up to."""

from __future__ import annotations

import subprocess
import sys

import pytest

from paged.sim import FEATURES, StepTimeModel
from tests.compile_settings import script_env


@pytest.mark.slow
def test_profile_step_fits_over_uniform_and_mixed_context_steps(tmp_path):
    out = tmp_path / "fit.json"
    env = script_env()
    p = subprocess.run([sys.executable, "-m", "experiments.profile_step", "--model=tiny", "--page_size=16",
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
    assert "fit: base" in p.stdout and "context    96/   16" in p.stdout


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
