"""experiments/bench_sim.py: a bad flag is a usage error naming it, before the workload is built or anything runs."""

from __future__ import annotations

import pytest

from tests.experiments.helpers import run_expecting_usage_error


@pytest.mark.parametrize("bad, message", [
    ("--seed=-1", "--seed must be >= 0"),
    ("--workload=sharegpt --input_len=100", "--input_len: only for --workload=poisson"),
    ("--json_out={tmp}/x.json --profile={tmp}/x.json", "--json_out and --profile name the same file"),
])
def test_bad_flags_are_usage_errors(tmp_path, bad, message):
    p = run_expecting_usage_error("experiments.bench_sim", "--num_requests=3", *bad.format(tmp=tmp_path).split())
    assert message in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()
