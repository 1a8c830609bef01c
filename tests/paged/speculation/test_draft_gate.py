"""Adaptive speculation (`paged.speculation.draft_gate.DraftGate`, `DynamicGenerator(adaptive_draft=True)`): the
acceptance model,
the step-cost model and the decisions by hand; on the fake engines, that a step verifies only where the drafts are
expected to pay (fewer verification rows where prompt lookup is poor, as many where it is good, all of them at zero
cost) while the stream stays the non-speculative one."""

from __future__ import annotations

import pytest

from paged import DynamicGenerator
from paged.errors import InvalidConfigError
from paged.speculation import draft_gate as dg
from paged.speculation.draft_gate import DraftGate
from paged.testing import FakeEngine, verification_for
from tests.paged.speculation.test_speculative_generator import (
    MODEL,
    NGRAM,
    OTHER,
    SETTINGS,
    TOK,
    CopyFakeEngine,
    model_jobs,
    run_fake,
    run_model,
    same_stream,
    stream_of,
)


def test_acceptance_estimates_pool_a_job_with_its_evidence_class():
    g = DraftGate(4, token_cost=0.2)
    assert g.alpha("a", 3) == 0.5  # no evidence: Laplace
    for _ in range(10):
        g.record("a", 3, drafted=4, accepted=4)  # 40 successes, no failure
    assert g.alpha("a", 3) > 0.95
    assert g.alpha("a", 1) == 0.5  # another class: its own statistics
    assert 0.9 < g.alpha("b", 3) < 0.99  # a new job starts from the class's global rate
    for _ in range(10):
        g.record("b", 3, drafted=4, accepted=0)  # one failure per round
    assert g.alpha("b", 3) < 0.4 < g.alpha("a", 3)  # its own evidence outweighs the prior
    g.release("b")
    assert g.alpha("b", 3) > 0.5  # forgotten: back to the (now mixed) global rate
    g.record("c", 2, drafted=4, accepted=2)  # a run stopped at the first rejection: 2 successes, 1 failure
    assert g._global[2] == [2, 3]


def test_expected_gain_and_step_cost_by_hand():
    assert DraftGate.expected_extra(0.5, 3) == pytest.approx(0.875)
    assert DraftGate.expected_extra(0.9, 0) == 0
    g = DraftGate(4, token_cost=0.2)
    assert g.step_cost(1) == pytest.approx(4 * 0.2 / 1.2)  # 1.67x a decode step: 0.67 tokens
    assert g.step_cost(16) == pytest.approx(4 * 0.2 * 256 / 4.2)  # every row padded to k + 1 tokens
    assert DraftGate(4, token_cost=0.2, draft_step_cost=0.1).step_cost(4) == pytest.approx(
        4 * 0.2 * 16 / 1.8 + 4 * 0.1 * 4)
    assert DraftGate(4, token_cost=0.0).step_cost(16) == 0.0


def test_decisions_follow_gain_against_cost_and_explore(monkeypatch):
    g = DraftGate(4, token_cost=0.2, explore_every=3)
    assert not g.decide([("a", 3, 0)], rows=1) and g.gated_steps == 0  # nothing drafted: not a decision
    assert g.decide([("a", 3, 4)], rows=1)  # alpha 0.5: 0.94 expected tokens > 0.67
    assert not g.decide([("a", 3, 4), ("b", 3, 4), ("c", 3, 4), ("d", 3, 4)], rows=4)  # 3.75 < 7.1
    for _ in range(20):
        g.record("a", 3, drafted=4, accepted=0)
    decisions = [g.decide([("a", 3, 4)], rows=1) for _ in range(8)]
    # the gated 4-row step above counts: after more than 3 gated steps in a row, one explores
    assert decisions == [False, False, True, False, False, False, True, False]
    assert g.gated_steps == 1 + 6 and g.explored_steps == 2
    assert g.stats()["acceptance_by_class"] == {3: 0.0}
    monkeypatch.setattr(dg.jax, "default_backend", lambda: "cpu")
    assert DraftGate(4).rho == dg.TOKEN_COST["cpu"] == 0.12  # measured (paged/speculation/draft_gate.py)
    monkeypatch.setattr(dg.jax, "default_backend", lambda: "gpu")  # a GPU: verification nearly free
    assert DraftGate(4).rho == DraftGate(4, token_cost=None).rho == dg.TOKEN_COST["gpu"] < dg.TOKEN_COST["cpu"]


def test_adaptive_gates_poor_drafts_and_keeps_the_stream():
    """The counting fake rarely repeats itself: prompt lookup is mostly wrong, so most steps do not verify."""
    _, ref = run_fake(FakeEngine)
    fixed, _ = run_fake(FakeEngine, NGRAM)
    gen, got = run_fake(FakeEngine, {**NGRAM, "adaptive_draft": True, "draft_token_cost": 0.2})
    assert stream_of(got.results) == stream_of(ref.results)
    m, f = gen.metrics(), fixed.metrics()
    assert m["gated_steps"] > 0 and m["verification_rows"] < f["verification_rows"]
    assert f["gated_steps"] == 0


def test_adaptive_verifies_good_drafts_and_everything_at_zero_cost():
    _, ref = run_fake(CopyFakeEngine)
    fixed, _ = run_fake(CopyFakeEngine, NGRAM)
    free, got = run_fake(CopyFakeEngine, {**NGRAM, "adaptive_draft": True, "draft_token_cost": 0.0})
    assert stream_of(got.results) == stream_of(ref.results)
    assert free.metrics()["verification_rows"] == fixed.metrics()["verification_rows"]  # any gain beats no cost
    assert free.metrics()["gated_steps"] == 0
    good, got = run_fake(CopyFakeEngine, {**NGRAM, "adaptive_draft": True, "draft_token_cost": 0.05})
    assert stream_of(got.results) == stream_of(ref.results)
    assert good.metrics()["verification_rows"] >= 0.5 * fixed.metrics()["verification_rows"]


@pytest.mark.parametrize("drafter", ["ngram", "self", "unrelated"])
@pytest.mark.slow
def test_adaptive_greedy_identity_on_a_tiny_model(drafter):
    spec = {"ngram": dict(use_ngram_draft=True, max_ngram=3), "self": dict(draft_model=MODEL),
            "unrelated": dict(draft_model=OTHER)}[drafter]
    ref = run_model()[1]
    gen, c = run_model(dict(num_draft_tokens=3, adaptive_draft=True, draft_token_cost=0.2, **spec))
    same_stream(c, ref)
    m = gen.metrics()
    if drafter == "self":  # the target drafting for itself: always accepted, so it keeps verifying
        assert m["acceptance_rate"] == 1.0 and m["verification_rows"] > 0
    if drafter == "unrelated":  # a draft model that is always wrong stops being run for verification
        fixed = run_model(dict(num_draft_tokens=3, draft_model=OTHER))[0].metrics()
        assert m["gated_steps"] > 0 and m["verification_rows"] < fixed["verification_rows"]


def test_adaptive_seeded_sampling_is_reproducible_on_a_fresh_generator():
    from paged import SamplingSettings

    sampled = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    outs = [{i: f["full_completion"] for i, f in run_model(
        dict(use_ngram_draft=True, num_draft_tokens=3, adaptive_draft=True), jobs=model_jobs(sampled, seed=5))[1]
        .finals.items()} for _ in range(2)]
    assert outs[0] == outs[1]


def test_invalid_adaptive_arguments():
    with pytest.raises(InvalidConfigError, match="adaptive_draft must be a bool"):
        DynamicGenerator(MODEL, use_ngram_draft=True, adaptive_draft="yes", **SETTINGS)
    for bad in (-0.1, float("nan"), "0.2", True):
        with pytest.raises(InvalidConfigError, match="draft_token_cost"):
            DynamicGenerator(MODEL, use_ngram_draft=True, adaptive_draft=True, draft_token_cost=bad, **SETTINGS)
    with pytest.raises(InvalidConfigError, match="need a drafter"):
        DynamicGenerator(MODEL, adaptive_draft=True, **SETTINGS)
    with pytest.raises(InvalidConfigError, match="applies to adaptive_draft=True only"):
        DynamicGenerator(MODEL, use_ngram_draft=True, draft_token_cost=0.2, **SETTINGS)
    spec = dict(use_ngram_draft=True, adaptive_draft=True, draft_token_cost=0.5)
    g = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(verification=verification_for(**spec)), **spec)
    assert g.speculation.speculator.gate.rho == 0.5


@pytest.mark.slow
def test_a_gated_step_runs_no_draft_forward_and_the_draft_catches_up():
    """With a draft model, a decode row that does not draft in a step is not mirrored on the draft
    (`paged.speculation.draft`): a
    step the gate closes runs no draft forward over its decode rows (but for a row whose token fills its page), and
    when the job next drafts, the draft feeds the tokens it missed as catch-up chunks. With the target drafting for
    itself every draft is then accepted, and the draft cache holds the target's K/V wherever it records it as
    written (mirroring a row right after a full acceptance, as before, left the last draft's KV missing there); the
    stream is plain decoding's. The gate is scripted here: closed for three steps, open for one."""
    from itertools import cycle

    from paged.testing import drain
    from tests.paged.speculation.test_speculative_generator import check_draft_cache

    ref = run_model(jobs=model_jobs(max_new=24))[1]
    gen = DynamicGenerator(MODEL, **SETTINGS, draft_model=MODEL, num_draft_tokens=2, adaptive_draft=True)
    spec = gen.speculation.speculator
    draft = spec.draft
    script = cycle([False, False, False, True])
    spec.gate.decide = lambda rows, sampling_rows: next(script)
    calls = []
    for name in ("run_forward", "draft"):  # every forward the draft engine runs goes through one of these
        fn = getattr(draft.engine, name)
        setattr(draft.engine, name, lambda *a, _fn=fn, _name=name, **k: (calls.append(_name), _fn(*a, **k))[1])
    jobs = model_jobs(max_new=24)
    seen, hashed = {"gated decode steps": 0, "checked": 0}, {}
    iterate = gen.iterate

    def checked_iterate():
        before, rows_before = len(calls), gen.metrics()["verification_rows"]
        prefilling = any(len(j.sequence) == len(j.input_ids) for j in jobs)  # a prompt's chunks may run (mirrored)
        # a row whose token fills its page feeds the draft what it lacks of the page (the prompt cache may share it),
        # and so does a row after a page that a full acceptance filled (it lacks its last draft's K/V)
        ps = SETTINGS["page_size"]
        fills = any(j.pages and ((j.kv_position + 1) % ps == 0 or draft.kv.get(j, 0) < j.kv_position // ps * ps)
                    for j in jobs)
        out = iterate()
        if gen.metrics()["verification_rows"] == rows_before and not prefilling and not fills:
            seen["gated decode steps"] += 1
            assert len(calls) == before, "a step that verified nothing ran the draft over its decode rows"
        seen["checked"] += check_draft_cache(gen, jobs, hashed)
        return out

    gen.iterate = checked_iterate
    gen.enqueue(jobs)
    c = drain(gen)
    gen.pool.check({})
    m = gen.metrics()
    assert seen["gated decode steps"] >= 6 and seen["checked"] > 0, seen
    assert m["verification_rows"] > 0 and m["acceptance_rate"] == 1.0  # caught up: the drafts are the target's
    same_stream(c, ref)
