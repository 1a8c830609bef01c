"""What a draft model's cache holds (`paged.draft.DraftModel`): wherever it records a job's tokens as written, the
target's K/V (the target drafting for itself, so the two caches must agree), through the cases where the draft lags
the target: a step whose decode rows do not draft (no room in the last page, the gate closed, a banned-string rewind
before it) and a job that never drafts, whose pages the prompt cache then shares."""

from __future__ import annotations

from itertools import cycle

import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.testing import drain
from tests.paged.test_speculative_generator import GREEDY, MODEL, TOK, check_draft_cache

SET = dict(num_pages=64, page_size=8, max_batch_size=1, max_chunk_size=16, max_seq_len=96, max_penalty_range=0)


def run_checked(gen, jobs) -> int:
    """Iterate `gen` to the end, checking the draft cache against the target's after every step."""
    checked = 0
    while gen.num_remaining_jobs():
        gen.iterate()
        checked += check_draft_cache(gen, jobs)
    gen.pool.check({})
    return checked


def test_a_row_with_no_room_to_draft_after_a_full_acceptance():
    """On-demand pages: a row whose token sits in the last slot of its last page has no room for drafts. After a
    step that accepted every draft the draft cache lacks the last draft's K/V; the row's own token fills the page,
    so the draft is fed both before the page can be shared (it used to get the row's token alone)."""
    gen = DynamicGenerator(MODEL, **SET, policy="vllm", draft_model=MODEL, num_draft_tokens=3)
    job = Job(TOK.encode("hello world"), 30, gen_settings=GREEDY)
    gen.enqueue(job)
    assert run_checked(gen, [job]) > 0
    assert gen.metrics()["acceptance_rate"] == 1.0


@pytest.mark.parametrize("offset,pattern", [(4, (True, False)), (8, (True, False, False, False)),
                                            (12, (True, True, False, False, False))])
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
    gen = DynamicGenerator(MODEL, **SET, draft_model=MODEL, num_draft_tokens=3, adaptive_draft=True)
    script = cycle(pattern)
    gen.speculation.speculator.gate.decide = lambda rows, sampling_rows: next(script)
    job = Job(TOK.encode("hello world, hello"), 40, gen_settings=GREEDY, banned_strings=banned)
    gen.enqueue(job)
    assert run_checked(gen, [job]) > 0
    assert job.sequence == ref


def test_pages_of_a_job_that_never_drafts_are_shared_with_their_draft_kv():
    """A mirostat job never drafts (each token's mu depends on the one before); its full pages still reach the
    draft cache before the prompt cache can share them, so a follow-up job whose prompt is that prompt plus the
    answer reuses both caches' pages, and its drafts (the target drafting for itself) are all accepted."""
    gen = DynamicGenerator(MODEL, **{**SET, "max_batch_size": 2}, draft_model=MODEL, num_draft_tokens=2)
    prompt = TOK.encode("hello world, hello")
    first = Job(prompt, 30, gen_settings=SamplingSettings(mirostat=True, temperature=1.0), seed=1)
    gen.enqueue(first)
    drain(gen)
    follow = Job(list(first.sequence) + TOK.encode(" and"), 20, gen_settings=GREEDY)
    gen.enqueue(follow)
    assert run_checked(gen, [follow]) > 0
    m = gen.metrics()
    assert m["prefix_hits"] > 0 and m["acceptance_rate"] == 1.0, m
