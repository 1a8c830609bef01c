"""`experiments.lib.calibration`: a step-time fit's samples gathered in slices (on the simulator here: no model, no
JAX compile), and `validate_sim --fit_interleaved`, which runs one slice before each round of real runs and one after
the last, on the tiny random model."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from experiments.lib import calibration
from paged.device.config import EngineConfig
from paged.sim import SimulatedEngine, StepTimeModel
from tests.compile_settings import script_env

CONFIG = EngineConfig(page_size=16, max_batch_size=4, max_chunk_size=64, max_seq_len=128, num_pages=33,
                      max_penalty_range=0)
PLAN = calibration.CalibrationPlan(grid_prefill=(0, 16), grid_decode=(0, 2), grid_context=(16, 48), iters=2,
                                   serving_concurrency=(1, 3), serving_prompts=(16,), serving_requests_per_row=1)


def calibration_on_the_simulator(plan=PLAN) -> calibration.Calibration:
    engine = SimulatedEngine(CONFIG, StepTimeModel.constant(0.01))
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=200))
    return calibration.Calibration(model, engine, plan, log=lambda line: None)


def test_every_slice_adds_a_grid_pass_and_a_serving_round():
    cal = calibration_on_the_simulator()
    # `both`: the grid's shapes with a prefill chunk only (16 tokens alone or beside 2 decode rows, at each context)
    assert sorted(case for case, _ in cal.cases) == [(16, 0, 16, 16), (16, 0, 48, 48), (16, 2, 16, 16),
                                                      (16, 2, 48, 48)]
    cal.run_slice()
    cal.run_slice()
    assert cal.slices == 2 and all(len(p) == 2 for p in cal.passes)
    assert [(lv["slice"], lv["concurrency"], lv["requests"]) for lv in cal.levels] == [
        (0, 1, 1), (0, 3, 3), (1, 1, 1), (1, 3, 3)]
    # the same seeded calibration prompts in every slice: the same steps
    first, second = cal.levels[:2], cal.levels[2:]
    assert [lv["steps"] for lv in first] == [lv["steps"] for lv in second]
    assert len(cal.shapes) == len(cal.seconds) == sum(lv["steps"] for lv in cal.levels)
    shapes, seconds, points = cal.grid_points()
    assert len(points) == 4 and all(p["seconds"] == pytest.approx(sum(p["passes"]) / 2) for p in points)
    fit = cal.fit(model_name="test", setup={"synthetic": True}, by="the test", narrow_tokens=0)
    assert fit.fit_stats["slices"] == 2 and fit.fit_stats["samples"] == len(points) + len(cal.shapes)
    assert "by the test on 4 grid shapes with a prefill chunk and" in fit.notes and "(2 slice(s))" in fit.notes


def test_a_grid_only_plan_times_every_shape_and_a_fit_needs_samples():
    cal = calibration_on_the_simulator(calibration.CalibrationPlan(
        source="grid", grid_prefill=(0, 16), grid_decode=(0, 2), grid_context=(16,), iters=1))
    # every shape but the empty step: 2 decode rows; 16 tokens alone and beside 2 decode rows
    assert sorted((p, d) for (p, d, _, _), _ in cal.cases) == [(0, 2), (16, 0), (16, 2)]
    with pytest.raises(ValueError, match="no calibration samples"):
        cal.fit(model_name="test", setup={}, by="the test", narrow_tokens=0)
    cal.run_slice()
    assert cal.levels == [] and all(len(p) == 1 for p in cal.passes)
    with pytest.raises(ValueError, match="source must be one of"):
        calibration.CalibrationPlan(source="replay")


@pytest.mark.parametrize("flag,match", [("--serving_concurrency=4,x", "--serving_concurrency takes"),
                                        ("--grid_prefill=", "--grid_prefill takes"),
                                        ("--serving_prompts=0", "--serving_prompts take integers >= 1"),
                                        ("--serving_requests_per_row=0", "--serving_requests_per_row must be >= 1")])
def test_validate_sim_names_a_bad_calibration_flag_before_loading_the_model(cp, monkeypatch, flag, match):
    from absl import app

    from experiments import validate_sim
    from tests.experiments.helpers import parse_flags

    def no_model():
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cp, "RealBackend", no_model)
    parse_flags(validate_sim, ["--rates=1,2", "--fit_interleaved", flag])
    with pytest.raises(app.UsageError, match=match):
        validate_sim.main([])


@pytest.mark.slow
def test_validate_sim_measures_its_fit_between_the_real_runs(tmp_path):
    out, fit_out = tmp_path / "rec.json", tmp_path / "fit.json"
    p = subprocess.run([sys.executable, "-m", "experiments.validate_sim", "--model=tiny", "--fit_interleaved",
                        f"--fit_out={fit_out}", "--real_repeats=2", "--rates=20", "--num_requests=4",
                        "--policies=exllamav2,sjf", "--input_len=24", "--output_len=6", "--max_seq_len=128",
                        "--page_size=16", "--grid_prefill=0,16", "--grid_decode=0,2", "--grid_context=16",
                        "--serving_concurrency=1,2", "--serving_prompts=16", "--serving_requests_per_row=1",
                        "--warmup_requests=1", "--noprogress", "--nosave_steps", f"--json_out={out}"],
                       capture_output=True, text=True, env={**script_env(), "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    # a calibration slice before each round of real runs over the policies, and one after the last
    assert rec["fit_interleaved"] and rec["timeline"] == [
        {"calibration_slice": 1}, {"real": "exllamav2", "rate": 20.0, "repeat": 0},
        {"real": "sjf", "rate": 20.0, "repeat": 0}, {"calibration_slice": 2},
        {"real": "exllamav2", "rate": 20.0, "repeat": 1}, {"real": "sjf", "rate": 20.0, "repeat": 1},
        {"calibration_slice": 3}]
    # the simulator is priced by the fit measured here, which is written to --fit_out
    fit = StepTimeModel.load(fit_out)
    assert rec["step_time_model"] == fit.to_dict() and fit.fit_stats["slices"] == 3
    assert "validate_sim.py --fit_interleaved" in fit.notes and fit.setup["name"] == "fit"
    assert [lv["slice"] for lv in fit.fit_stats["serving"]] == [0, 0, 1, 1, 2, 2]
    assert "the fit measured between the real runs (3 slices)" in p.stdout
