"""fit_and_validate's flag checks, before it measures anything (the measurement runs the real model: a benchmark,
not a test). It defines its flags only as a script, so it runs as one here."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from tests.experiments.helpers import run_expecting_usage_error


@pytest.mark.parametrize("argv, match", [
    ([], "--name must be a plain name"),
    (["--name=a/b"], "--name must be a plain name"),
    (["--name=cpu_x", "--rates=1"], "--rates takes two rates"),
    (["--name=cpu_x", "--policies=vllm,sjf"], "at least 3 policies"),
    (["--name=cpu_x", "--real_repeats=0"], "--real_repeats must be >= 1"),
])
def test_fit_and_validate_rejects_bad_flags_before_measuring(argv, match):
    r = run_expecting_usage_error("experiments.fit_and_validate", *argv)
    assert match in r.stderr and f"+ {sys.executable} -m" not in r.stderr  # nothing ran


@pytest.mark.parametrize("bad, match", [
    ("--num_requests=0", "--num_requests must be >= 1"),
    ("--policies=vllm,sjf,bogus", "--policies=bogus is not one of"),
    ("--rates=0,1", "--rates must be distinct rates > 0"),
])
def test_the_flags_passed_to_validate_sim_are_checked_before_profiling(bad, match):
    r = run_expecting_usage_error("experiments.fit_and_validate", "--name=cpu_x", "--nointerleave", bad)
    assert match in r.stderr and f"+ {sys.executable} -m" not in r.stderr  # nothing ran


def test_the_validation_record_is_read_back_gzipped_or_not(tmp_path):
    from experiments import fit_and_validate

    rec = {"errors": [], "rank_agreement": []}
    with gzip.open(tmp_path / "v.json.gz", "wt") as f:
        json.dump(rec, f)
    (tmp_path / "v.json").write_text(json.dumps(rec))
    assert fit_and_validate.read_record(str(tmp_path / "v.json.gz")) == rec
    assert fit_and_validate.read_record(str(tmp_path / "v.json")) == rec
