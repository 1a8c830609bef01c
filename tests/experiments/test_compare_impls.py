"""experiments/lib/compare_impls.py: which family --compare_to compares and what it pins, and the first divergent
token with its margins (generate --compare_to end to end: tests/experiments/test_generate.py)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.lib.compare_impls import CompareError, Trace, describe_divergence, divergence, plan_comparison
from paged.device.config import EngineConfig

AUTO = {"attention": "auto", "matmul": "auto"}
NONE = {"attention": False, "matmul": False}


def test_comparing_attention_pins_the_matmul_to_one_without_quantized_activations():
    plan = plan_comparison("xla", {"attention": "reference", "matmul": "auto"}, {"attention": True, "matmul": False},
                           auto_matmul_quantizes=True)
    assert (plan.family, plan.under_test, plan.reference, plan.pinned) == ("attention", "reference", "xla", "xla")
    assert "int8" in plan.pinned_why
    test, ref = plan.configs(EngineConfig(attn_impl="reference", attn_tuning=None))
    assert (test.attn_impl, test.matmul_impl, ref.attn_impl, ref.matmul_impl) == ("reference", "xla", "xla", "xla")
    # where auto runs no native matmul (a GPU, or not built), auto is the same in both runs
    plan = plan_comparison("xla", {"attention": "native", "matmul": "auto"}, {"attention": True, "matmul": False},
                           auto_matmul_quantizes=False)
    assert plan.pinned == "auto"
    # a --matmul_impl given is kept in both runs; a name of both families is the family whose flag differs from it
    plan = plan_comparison("xla", {"attention": "native", "matmul": "xla"}, {"attention": True, "matmul": True},
                           auto_matmul_quantizes=True)
    assert (plan.family, plan.pinned) == ("attention", "xla")


def test_the_family_can_be_named_in_the_value():
    both = {"attention": True, "matmul": True}
    impls = {"attention": "native", "matmul": "auto"}
    plan = plan_comparison("attn_impl=xla", impls, both, auto_matmul_quantizes=True)
    assert (plan.family, plan.under_test, plan.reference, plan.pinned) == ("attention", "native", "xla", "auto")
    plan = plan_comparison("matmul_impl=xla", impls, both, auto_matmul_quantizes=True)
    assert (plan.family, plan.under_test, plan.reference, plan.pinned) == ("matmul", "auto", "xla", "native")
    with pytest.raises(CompareError, match="'attn' before '=' names no family: attn_impl or matmul_impl"):
        plan_comparison("attn=xla", impls, both, auto_matmul_quantizes=True)
    with pytest.raises(CompareError, match="not a matmul implementation"):
        plan_comparison("matmul_impl=flash", impls, both, auto_matmul_quantizes=True)


def test_comparing_matmuls_keeps_the_attention_the_same_in_both_runs():
    plan = plan_comparison("xla", {"attention": "auto", "matmul": "native"}, {"attention": False, "matmul": True},
                           auto_matmul_quantizes=True)
    assert (plan.family, plan.under_test, plan.reference, plan.pinned) == ("matmul", "native", "xla", "auto")
    test, ref = plan.configs(EngineConfig())
    assert (test.matmul_impl, ref.matmul_impl, test.attn_impl, ref.attn_impl) == ("native", "xla", "auto", "auto")


@pytest.mark.parametrize("value, impls, given, message", [
    ("flash", AUTO, NONE, "not an attention implementation .* nor a matmul one"),
    ("xla", AUTO, NONE, "both an attention and a matmul implementation: .*--attn_impl.*--matmul_impl.*"
                        "--compare_to=attn_impl=xla or matmul_impl=xla"),
    ("xla", {"attention": "native", "matmul": "native"}, {"attention": True, "matmul": True}, "both an attention"),
    ("xla", {"attention": "xla", "matmul": "auto"}, {"attention": True, "matmul": False}, "both an attention"),
])
def test_a_comparison_that_cannot_be_told_says_what_to_give(value, impls, given, message):
    with pytest.raises(CompareError, match=message):
        plan_comparison(value, impls, given, auto_matmul_quantizes=False)


def _trace(tokens, logits_rows, watch=None) -> Trace:
    t = Trace(watch=watch)
    t.add(tokens, np.asarray(logits_rows, np.float32))
    return t


def test_the_first_divergent_token_with_both_margins():
    vocab = lambda *v: [*v, 0.0]  # noqa: E731  (4 tokens: 0..3)
    test = _trace([2, 1, 3], [vocab(0, 1, 5, 2), vocab(0, 4, 3.99, 1), vocab(0, 0, 0, 9)])
    ref = _trace([2, 2, 1], [vocab(0, 1, 5, 2), vocab(0, 3.99, 4, 1), vocab(0, 7, 0, 0)], watch=test.tokens)
    d = divergence(test, ref, prompt_tokens=10, piece=lambda t: f"<{t}>")
    assert d["index"] == 1 and d["position"] == 11
    assert d["under_test"]["id"] == 1 and d["under_test"]["text"] == "<1>"
    assert d["reference"]["id"] == 2 and d["reference"]["margin"] == pytest.approx(0.01, abs=1e-5)
    assert d["under_test"]["margin"] == pytest.approx(0.01, abs=1e-5)
    assert d["reference"]["logit_gap"] == pytest.approx(0.01, abs=1e-5)  # the reference's row at the divergence
    text = describe_divergence(d, 1)
    assert "generated token 1 (sequence position 11)" in text and "2 '<2>'" in text and "0.01" in text
    same = _trace([2, 1], [vocab(0, 1, 5, 2), vocab(0, 4, 3, 1)])
    assert divergence(same, _trace([2, 1], [vocab(0, 1, 5, 2), vocab(0, 4, 3, 1)]), 3, str) is None
    assert describe_divergence(None, 2) == "no divergence: the same 2 tokens"
    shorter = divergence(same, _trace([2], [vocab(0, 1, 5, 2)]), 3, str)  # one run ended first
    assert shorter["index"] == 1 and shorter["reference"]["id"] is None
