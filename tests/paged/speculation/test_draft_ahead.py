"""Draft bursts dispatched ahead (`paged.speculation.draft.DraftModel.ahead`) on tiny random models: the streams and
acceptance
of the bursts that wait for the results, and a rewind drops the burst. A module of its own: each module's compiled
programs are released after it (tests/conftest.py), and these generators compile bursts of their own."""

from __future__ import annotations

import pytest

from paged import DynamicGenerator, Job
from paged.testing import drain
from tests.paged.speculation.test_speculative_generator import (
    GREEDY,
    MODEL,
    OTHER,
    PROMPTS,
    SETTINGS,
    TOK,
    check_draft_cache,
    model_jobs,
    same_stream,
)

# each test builds generators with draft models: their compiled programs go once the maps near the limit (conftest)
pytestmark = [pytest.mark.usefixtures("release_compiled_programs_near_the_map_limit"),
              pytest.mark.fresh_programs]  # (counts compiled variants)


@pytest.mark.slow
def test_a_rewind_drops_the_burst_dispatched_ahead():
    """A banned string rewinds a job to an earlier position after a burst for its next row was dispatched ahead:
    that burst drafted for a row the job no longer has and is dropped; the draft cache still holds the target's K/V
    wherever it says it does, and the output is the plain generator's with the same ban."""
    def run(spec, banned=None):
        gen = DynamicGenerator(MODEL, **{**SETTINGS, "max_batch_size": 1}, **spec)
        job = Job(TOK.encode(PROMPTS[2]), 24, gen_settings=GREEDY, banned_strings=banned)
        gen.enqueue(job)
        checked = 0
        while gen.num_remaining_jobs():
            gen.iterate()
            checked += check_draft_cache(gen, [job]) if spec else 0
        return gen, job.sequence[len(TOK.encode(PROMPTS[2])):], checked

    _, free, _ = run({})
    banned = [TOK.decode(free[6:8])]  # written once the job is well into drafting ahead
    _, plain, _ = run({}, banned)
    assert plain[:6] == free[:6] and plain != free
    gen, out, checked = run(dict(draft_model=MODEL, num_draft_tokens=2), banned)
    assert out == plain and checked > 5
    dispatched, used = gen.speculation.speculator.draft.ahead_bursts
    assert 0 < used < dispatched


@pytest.mark.parametrize("draft,num_jobs,max_batch", [("self", 2, 1), ("unrelated", 2, 1), ("self", 4, 4),
                                                        pytest.param("unrelated", 4, 4, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_draft_bursts_dispatched_ahead_change_nothing(draft, num_jobs, max_batch):
    """A draft model dispatches the next step's burst before the host has seen a verification's results where the
    step allows it (every row drafting, no penalty history). One job at a time (every step after the first few
    goes ahead; the self-draft accepts every draft, so each burst ahead feeds a catch-up token) and then four at
    once (jobs finish and join, so bursts ahead are dropped): the same streams and the same acceptance as with the
    bursts after the results, pages exact. One job at a time after `warmup()`: the bursts that go ahead run the
    compiled window that warm-up made for the catch-up bursts (`draft_burst_jit(window=)`), and nothing compiles."""
    from paged.device.engine import count_compiles

    spec = dict(draft_model=MODEL if draft == "self" else OTHER, num_draft_tokens=2)
    out = {}
    for pipeline in (True, False):
        gen = DynamicGenerator(MODEL, **{**SETTINGS, "max_batch_size": max_batch}, **spec)
        draft_model = gen.speculation.speculator.draft
        draft_model.pipeline = pipeline
        warm = None
        if pipeline and max_batch == 1 and draft == "self":
            gen.warmup()
            warm = count_compiles()
        gen.enqueue(model_jobs(max_new=20)[:num_jobs])
        out[pipeline] = (drain(gen), gen.metrics(), list(draft_model.ahead_bursts))
        gen.pool.check({})
        if warm is not None:
            assert count_compiles() == warm
    (c_on, m_on, ahead_on), (c_off, m_off, ahead_off) = out[True], out[False]
    same_stream(c_on, c_off)
    for key in ("drafted_tokens", "accepted_draft_tokens", "accepted_at_position"):
        assert m_on[key] == m_off[key], key
    assert ahead_off == [0, 0]
    assert 0 < ahead_on[1] <= ahead_on[0]
    if max_batch == 1:  # all but each job's first verification and its last few (no room in its pages)
        assert ahead_on[1] >= m_on["verification_rows"] - 2 * num_jobs
    else:
        assert ahead_on[1] < ahead_on[0]  # some went ahead for rows the next step did not have
    if draft == "self":
        assert m_on["acceptance_rate"] == 1.0


@pytest.mark.slow
def test_a_failed_step_does_not_hand_its_burst_ahead_to_the_retry(monkeypatch):
    """A verification step that fails after its dispatch (`StepError`: the generator retries the same rows) had
    already sent the next burst ahead from its results; that burst drafted a whole verification further on, so the
    retry must not take it (`DraftModel.drop_ahead`): with the target drafting for itself every draft is still
    accepted, and the stream is plain decoding's."""
    import paged.device.engine as engine_mod
    from paged.errors import StepError

    def run(fail_at=None):
        gen = DynamicGenerator(MODEL, **{**SETTINGS, "max_batch_size": 1}, draft_model=MODEL, num_draft_tokens=2)
        job = Job(TOK.encode("hello world"), 40, gen_settings=GREEDY)
        gen.enqueue(job)
        draft = gen.speculation.speculator.draft
        real, steps = engine_mod._to_host, 0
        while gen.num_remaining_jobs():
            steps += 1
            if steps == fail_at:
                assert draft.ahead_bursts[1] > 0  # bursts go ahead by now

                def lost(*a, **k):  # the results cannot be read back, after the burst went ahead from them
                    raise RuntimeError("device lost")

                monkeypatch.setattr(engine_mod, "_to_host", lost)
                with pytest.raises(StepError):
                    gen.iterate()
                monkeypatch.setattr(engine_mod, "_to_host", real)
                continue
            gen.iterate()
            check_draft_cache(gen, [job])
        return job.sequence, gen.metrics()

    ref, _ = run()
    got, m = run(fail_at=6)
    assert got == ref
    assert m["acceptance_rate"] == 1.0, (m["accepted_draft_tokens"], m["drafted_tokens"])
