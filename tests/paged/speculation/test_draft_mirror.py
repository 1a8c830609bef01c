"""What a draft model's cache holds (`paged.speculation.draft.DraftModel`): wherever it records a job's tokens as
written, the
target's K/V (the target drafting for itself, so the two caches must agree), through the cases where the draft lags
the target: a step whose decode rows do not draft (no room in the last page, the gate closed, a banned-string rewind
before it) and a job that never drafts, whose pages the prompt cache then shares."""

from __future__ import annotations

from itertools import cycle

import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.testing import drain
from tests.paged.speculation.test_speculative_generator import GREEDY, MODEL, SETTINGS, TOK, check_draft_cache

SET = {**SETTINGS, "max_batch_size": 1}  # the generator tests' engine, one row: the same programs as theirs


def run_checked(gen, jobs) -> int:
    """Iterate `gen` to the end, checking the draft cache against the target's after every step: where the draft
    records a job's tokens as written, and over the job's pages hashed before the step (shareable)."""
    checked, hashed = 0, {}
    while gen.num_remaining_jobs():
        gen.iterate()
        checked += check_draft_cache(gen, jobs, hashed)
    gen.pool.check({})
    return checked


@pytest.mark.slow
def test_a_row_with_no_room_to_draft_after_a_full_acceptance():
    """On-demand pages: a row whose token sits in the last slot of its last page has no room for drafts. After a
    step that accepted every draft the draft cache lacks the last draft's K/V; the row's own token fills the page,
    so the draft is fed both before the page can be shared (it used to get the row's token alone). A full acceptance
    that fills a page leaves its last slot to the job's next step, before anyone can share the page."""
    gen = DynamicGenerator(MODEL, **SET, policy="vllm", draft_model=MODEL, num_draft_tokens=3)
    job = Job(TOK.encode("hello world"), 30, gen_settings=GREEDY)
    gen.enqueue(job)
    assert run_checked(gen, [job]) > 0
    assert gen.metrics()["acceptance_rate"] == 1.0


@pytest.mark.parametrize("offset,pattern", [(4, (True, False)), (8, (True, False, False, False)),
                                            (12, (True, True, False, False, False))])
@pytest.mark.slow
def test_a_rewind_before_steps_that_do_not_draft(offset, pattern):
    """A banned string rewinds the job below what the draft recorded, and the next steps do not draft (the gate is
    scripted closed): the record follows the job back, so when it drafts again the draft is fed the new tokens
    instead of trusting the K/V of the ones the rewind took back."""
    def plain(banned=None):
        gen = DynamicGenerator(MODEL, **SET)
        job = Job(TOK.encode("hello world, hello"), 40, gen_settings=GREEDY, banned_strings=banned)
        gen.enqueue(job)
        drain(gen)
        return job.sequence

    free = plain()
    start = len(TOK.encode("hello world, hello"))
    banned = [TOK.decode(free[start + offset:start + offset + 2])]
    ref = plain(banned)
    assert ref != free  # the ban took effect: the job was rewound
    gen = DynamicGenerator(MODEL, **SET, draft_model=MODEL, num_draft_tokens=3, adaptive_draft=True)
    script = cycle(pattern)
    gen.speculation.speculator.gate.decide = lambda rows, sampling_rows: next(script)
    job = Job(TOK.encode("hello world, hello"), 40, gen_settings=GREEDY, banned_strings=banned)
    gen.enqueue(job)
    assert run_checked(gen, [job]) > 0
    assert job.sequence == ref


@pytest.mark.slow
def test_pages_of_a_job_that_never_drafts_are_shared_with_their_draft_kv():
    """A mirostat job never drafts (each token's mu depends on the one before); its full pages still reach the
    draft cache before the prompt cache can share them, so a follow-up job whose prompt is that prompt plus the
    answer reuses both caches' pages, and its drafts (the target drafting for itself) are all accepted."""
    gen = DynamicGenerator(MODEL, **{**SET, "max_batch_size": 2}, draft_model=MODEL, num_draft_tokens=2)
    prompt = TOK.encode("hello world, hello")
    first = Job(prompt, 24, gen_settings=SamplingSettings(mirostat=True, temperature=1.0), seed=1)
    gen.enqueue(first)
    drain(gen)
    follow = Job(list(first.sequence) + TOK.encode(" and"), 12, gen_settings=GREEDY)  # 46 + 12 tokens of max_seq_len 64
    gen.enqueue(follow)
    assert run_checked(gen, [follow]) > 0
    m = gen.metrics()
    assert m["prefix_hits"] > 0 and m["acceptance_rate"] == 1.0, m


@pytest.mark.slow
def test_a_job_admitted_beside_the_catch_up_of_the_page_it_shares():
    """A verification that accepts every draft fills a page with the last draft's K/V missing from the draft cache,
    and the prompt cache may hand that page to a job admitted in the very next step. That step feeds the missing
    token as a chunk before its prefill chunks (not in the burst, which runs after them), so the new job's own
    prompt tokens see the whole page in the draft cache too."""
    gen = DynamicGenerator(MODEL, **{**SET, "max_batch_size": 2}, draft_model=MODEL, num_draft_tokens=3)
    first = Job(TOK.encode("hello world!"), 40, gen_settings=GREEDY)  # 12 tokens: a verification of 4 (k = 3, all
    gen.enqueue(first)  # accepted) ends on the last slot of the second page
    draft, ps = gen.speculation.speculator.draft, SET["page_size"]
    draft.pipeline = False  # (a burst gone ahead, then dropped, would write the missing token by chance)
    follow = None
    while gen.num_remaining_jobs():
        gen.iterate()
        if follow is None and draft.kv.get(first, 0) < len(first.page_hashes) * ps:  # a hashed page lacks a token
            shared = len(first.page_hashes) * ps
            follow = Job(list(first.sequence[:shared]) + TOK.encode(" and then"), 12, gen_settings=GREEDY)
            gen.enqueue(follow)
        check_draft_cache(gen, [first] + ([follow] if follow is not None else []))
    assert follow is not None and follow.cached_tokens > 0 and gen.metrics()["acceptance_rate"] == 1.0


@pytest.mark.slow
def test_a_failed_catch_up_is_fed_again():
    """A catch-up chunk whose draft forward fails (the step raises `StepError`; nothing advanced) is fed again in
    the retried step: the draft records a job's tokens as written only once their chunk ran."""
    from paged.errors import StepError

    gen = DynamicGenerator(MODEL, **SET, draft_model=MODEL, num_draft_tokens=2, adaptive_draft=True)
    script = cycle([False, False, False, True])
    gen.speculation.speculator.gate.decide = lambda rows, sampling_rows: next(script)
    job = Job(TOK.encode("hello world, hello"), 30, gen_settings=GREEDY)
    gen.enqueue(job)
    gen.speculation.speculator.draft.pipeline = False  # (a burst gone ahead, then dropped, would write them by chance)
    engine = gen.speculation.speculator.draft.engine
    real, failed = engine.run_forward, []

    def flaky(rows, *a, **k):
        if not failed and any(len(r.tokens) > 1 and not r.sample for r in rows) and job.new_tokens > 4:
            failed.append(1)  # the first catch-up chunk after the prompt
            raise RuntimeError("device lost")
        return real(rows, *a, **k)

    engine.run_forward = flaky
    checked = 0
    while gen.num_remaining_jobs():
        try:
            gen.iterate()
        except StepError:
            continue
        checked += check_draft_cache(gen, [job])
    assert failed and checked > 0 and gen.metrics()["acceptance_rate"] == 1.0
