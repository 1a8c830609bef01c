"""experiments/matmul_quality.py on a tiny random model: the comparisons it reports measure what they say."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from experiments.matmul_quality import _common_prefix, greedy_report, teacher_forced_report
from paged.testing import tiny_config, tiny_model

CFG = tiny_config(64)
MODEL = tiny_model(CFG, seed=1, scale=0.2)
SEQS = [[1, 5, 9, 3, 7, 2, 11], [4, 4, 8, 15, 16, 23, 42, 8, 1], [3, 2]]


def test_teacher_forced_identical_runs_agree_and_a_perturbed_model_does_not():
    # float weights: every matmul impl computes the same dot, so "reference" must agree with "xla" exactly
    noisy = dataclasses.replace(MODEL, params=jax.tree_util.tree_map(
        lambda w: w + 0.3 * np.random.default_rng(0).normal(size=w.shape).astype(w.dtype), MODEL.params))
    report = teacher_forced_report(MODEL, ["xla", "reference"], SEQS, {"noisy": (noisy, "xla")})
    positions = sum(len(s) - 1 for s in SEQS)
    assert report["xla"]["positions"] == positions == report["noisy"]["positions"]
    assert report["reference"]["top1_agreement"] == 1.0
    assert report["reference"]["mean_kl"] == pytest.approx(0.0, abs=1e-6)
    assert report["reference"]["perplexity"] == pytest.approx(report["xla"]["perplexity"], rel=1e-5)
    assert report["noisy"]["mean_kl"] > 0.01 and report["noisy"]["top1_agreement"] < 1.0
    assert report["noisy"]["max_kl"] >= report["noisy"]["mean_kl"]
    assert 1.0 < report["xla"]["perplexity"] < 10 * CFG.vocab_size


@pytest.mark.slow
def test_greedy_report_counts_identical_outputs():
    report, outs = greedy_report(MODEL, ["xla", "reference"], [s[:4] for s in SEQS[:2]], max_new_tokens=5)
    assert [len(o) for o in outs["xla"]] == [5, 5]
    assert outs["reference"] == outs["xla"]
    assert report["reference"] == {"new_tokens": 10, "identical": 2, "prompts": 2, "mean_common_prefix": 5.0}


def test_common_prefix():
    assert _common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert _common_prefix([1, 2], [1, 2, 3]) == 2
    assert _common_prefix([], [1]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--model=tiny"], "--model=tiny has no tokenizer"),
    (["--impls=xla,bogus"], "--impls: dequant_matmul: unknown implementation 'bogus'"),
    (["--impls=auto"], "--impls needs an implementation besides 'auto'"),
    (["--impls="], "--impls needs at least one"),
    (["--greedy_prompts=0"], "--greedy_prompts must be >= 1"),
    (["--quant=foo"], "--quant=foo is not one of"),
])
def test_bad_flags_are_usage_errors_before_the_model_loads(argv, message):
    from absl import app, flags

    from experiments import matmul_quality
    from tests.experiments.helpers import parse_flags

    parse_flags(matmul_quality, argv)
    try:
        with pytest.raises(app.UsageError, match=re.escape(message)):
            matmul_quality.check_flags()
    finally:
        flags.FLAGS.unparse_flags()
