"""`paged.host.scheduler.Scheduler`: admission (the policy starts waiting jobs while rows and pages allow) and the plan
of a step (chunked prefill within the token budget and prefill rows, one decode row per decoding job, the row's
logit bias). Driven here directly, `admit()` then `plan()`, on the generator's own scheduler over the fake engine: no
model and no compilation."""

from __future__ import annotations

import math

import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.testing import ByteTokenizer, FakeEngine

TOK = ByteTokenizer()


def generator(**engine) -> DynamicGenerator:
    kw = dict(num_pages=32, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=128, max_prefill_rows=1)
    return DynamicGenerator(tokenizer=TOK, engine=FakeEngine(**{**kw, **engine}))


def plan(g: DynamicGenerator):
    started = []
    g.scheduler.admit(started.append)
    rows, owners, failed = g.scheduler.plan()
    assert not failed
    return started, rows, owners


def test_prefill_is_chunked_within_the_token_budget_and_the_prefill_rows():
    g = generator()
    jobs = [Job(list(range(1, 41)), 4), Job(list(range(1, 6)), 4), Job(list(range(1, 6)), 4)]
    g.enqueue(jobs)
    started, rows, owners = plan(g)
    assert started == jobs  # four rows and enough pages: every job starts
    assert owners == [jobs[0]] and [len(r.tokens) for r in rows] == [16]  # one prefill row, max_chunk_size tokens
    assert rows[0].start_pos == 0 and not rows[0].sample  # the prompt is not finished: nothing sampled yet
    jobs[0].kv_position = 16  # (as the step's output would advance it)
    _, rows, owners = plan(g)
    assert owners == [jobs[0]] and (rows[0].start_pos, len(rows[0].tokens)) == (16, 16)
    jobs[0].kv_position = 32
    _, rows, owners = plan(g)
    assert owners == [jobs[0]] and len(rows[0].tokens) == 8 and rows[0].sample  # the last chunk samples
    two = generator(max_prefill_rows=2)
    more = [Job(list(range(1, 11)), 4), Job(list(range(1, 11)), 4), Job(list(range(1, 11)), 4)]
    two.enqueue(more)
    _, rows, owners = plan(two)
    assert owners == more[:2] and [len(r.tokens) for r in rows] == [10, 6]  # the budget's rest goes to the second


def test_a_decoding_job_gets_one_row_of_its_last_token():
    g = generator()
    job = Job([5, 6, 7], 4)
    g.enqueue(job)
    plan(g)
    job.kv_position = 3
    job.sequence.append(9)  # its first sampled token
    job.new_tokens = 1
    _, rows, owners = plan(g)
    assert owners == [job] and rows[0].tokens == [9] and rows[0].start_pos == 3 and rows[0].sample


def test_a_decoding_job_after_a_prefilling_one_gets_its_row():
    """Running jobs in any order (a preempted job re-admitted after others): a prefill chunk planned first does not
    stop the decode rows after it."""
    g = generator()
    prefilling, decoding = Job(list(range(1, 41)), 4), Job([5, 6, 7], 4)
    g.enqueue([prefilling, decoding])
    plan(g)
    decoding.kv_position = 3
    decoding.sequence.append(9)
    decoding.new_tokens = 1
    _, rows, owners = plan(g)
    assert owners == [prefilling, decoding] and [len(r.tokens) for r in rows] == [16, 1] and rows[1].tokens == [9]


def test_admission_waits_for_rows_and_pages():
    g = generator(max_batch_size=2)
    jobs = [Job([1, 2, 3], 4) for _ in range(3)]
    g.enqueue(jobs)
    started, _, _ = plan(g)
    assert started == jobs[:2] and g.pending == [jobs[2]]  # two rows
    small = generator(num_pages=4, page_size=8)  # 3 usable pages (page 0 is the null page)
    big = [Job(list(range(1, 17)), 8), Job(list(range(1, 17)), 8)]  # 24 tokens each: 3 pages
    small.enqueue(big)
    started, _, _ = plan(small)
    assert started == big[:1] and small.pending == big[1:]


def test_the_row_bias_bans_stop_tokens_before_min_new_tokens():
    g = generator()
    settings = SamplingSettings(temperature=1.0, token_bias={7: 2.0})
    job = Job([1, 2, 3], 8, stop_conditions=[4], min_new_tokens=2, gen_settings=settings)
    g.enqueue(job)
    _, rows, _ = plan(g)
    assert rows[0].bias == {7: 2.0, 4: -math.inf}  # output token 0: the stop token cannot end the job yet
    assert g.scheduler.sample_bias(job, 4) == {7: 2.0, 4: -math.inf}  # output token 1
    assert g.scheduler.sample_bias(job, 5) == {7: 2.0}  # output token 2 may stop
    banned = generator(vocab_size=2)
    every = Job([1, 0], 4, gen_settings=SamplingSettings(banned_tokens=[0]))
    banned.enqueue(every)
    every.explored[2] = {1}  # a banned-string rewind banned the only other token at that position
    banned.scheduler.admit(lambda job: None)
    _, _, failed = banned.scheduler.plan()
    assert [j for j, _ in failed] == [every] and "every token of the vocabulary is banned" in str(failed[0][1])


@pytest.mark.parametrize("budget", [-1, 2.5, True])
def test_a_prefill_budget_that_is_not_a_count_is_the_policys_error(budget):
    from paged.errors import PolicyError
    from paged.policies import FCFSPolicy

    class Bad(FCFSPolicy):
        def prefill_budget(self, decode_rows, view):
            return budget

    g = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(), policy=Bad())
    g.enqueue(Job([1, 2, 3], 4))
    g.scheduler.admit(lambda job: None)
    with pytest.raises(PolicyError, match="prefill_budget"):
        g.scheduler.plan()
