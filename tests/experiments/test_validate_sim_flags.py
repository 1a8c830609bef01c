"""validate_sim's flag checks, before the model loads (its other tests: test_compare_policies.py and
test_calibration.py)."""

from __future__ import annotations

import pytest
from absl import app

from tests.experiments.helpers import parse_flags


@pytest.mark.parametrize("argv, match", [
    (["--input_len=0"], "--input_len must be >= 1"),
    (["--fit_out=f.json"], "--fit_out names the fit --fit_interleaved measures"),
    (["--grid_decode=1,2"], "--grid_decode says how --fit_interleaved measures its fit"),
    (["--fit_source=grid"], "--fit_source says how --fit_interleaved measures its fit"),
    (["--min_rank_gap=-1"], "--min_rank_gap must be a finite fraction >= 0"),
    (["--workload=trace", "--trace_file=/nonexist.csv"], "--workload=trace: /nonexist.csv"),
    # (fit_and_validate's pre-check: these had passed --check_flags_only and failed once the run had started)
    (["--page_budget=0"], "--page_budget must be >= 1"),
    (["--page_budget=1"], "--page_budget=1: request 0 needs"),
    (["--plot"], "--plot is not used by validate_sim"),
])
def test_validate_sim_checks_its_flags_before_loading_the_model(cp, monkeypatch, argv, match):
    from experiments import validate_sim
    from experiments.lib.serving import env

    def too_late(*a, **k):
        raise AssertionError("the bad flag was not caught before the model loads")

    monkeypatch.setattr(cp, "RealBackend", too_late)
    monkeypatch.setattr(env, "load_average", too_late)
    parse_flags(validate_sim, ["--model=tiny", "--num_requests=4", "--rates=1", *argv])
    with pytest.raises(app.UsageError, match=match):
        validate_sim.main([])


def test_check_flags_only_runs_nothing(cp, monkeypatch, capsys):
    from experiments import validate_sim
    from experiments.lib.serving import env

    monkeypatch.setattr(env, "load_average", lambda *a, **k: pytest.fail("ran past --check_flags_only"))
    parse_flags(validate_sim, ["--model=tiny", "--num_requests=4", "--rates=1", "--check_flags_only"])
    validate_sim.main([])
    assert "the flags are fine" in capsys.readouterr().out


def test_the_calibration_flag_names_are_the_flags_define_flags_defines(cp):
    """validate_sim refuses these without --fit_interleaved: the list must not drift from the definitions."""
    from absl import flags

    from experiments import validate_sim  # noqa: F401 (defines them)
    from experiments.lib import calibration

    defined = {f.name for f in flags.FLAGS.get_flags_for_module(calibration.__name__)}
    assert defined == set(calibration.FLAG_NAMES)


def test_the_record_keeps_validate_sims_own_flags(cp):
    """The record's flags had been compare_policies' alone: min_rank_gap (which decides the reproducible pairs),
    real_repeats and the fit's flags were missing."""
    from experiments import validate_sim

    assert {"min_rank_gap", "real_repeats", "fit_interleaved", "max_step_error"} <= set(validate_sim.RECORD_FLAGS)
    assert set(cp.OUR_FLAGS) <= set(validate_sim.RECORD_FLAGS)
