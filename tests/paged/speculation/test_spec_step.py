"""`paged.speculation.spec_step.SpeculativeStep`: how far each row of a step may speculate, and with which bias at
each drafted position. Checked directly on the generator's own speculation step (prompt-lookup drafting over the
fake engine): a row drafts at most min(num_draft_tokens, tokens the job may still emit - 1, slots left in its pages
past its KV position - 1); prefill rows, mirostat, CFG and injected-embedding jobs do not draft; drafting stops
before a position where every token is banned; the stop tokens stay banned at the draft positions before
min_new_tokens. No model, no compilation."""

from __future__ import annotations

import math

import numpy as np

from paged import DynamicGenerator, Job, SamplingSettings
from paged.device.config import Verification
from paged.testing import ByteTokenizer, FakeEngine

TOK = ByteTokenizer()
K = 4


def decoding(job: Job, new: int = 1, vocab_size: int = 258) -> tuple[DynamicGenerator, object]:
    """A generator speculating k = 4 drafts with `job` admitted, `new` tokens generated, its row planned."""
    g = DynamicGenerator(tokenizer=TOK, use_ngram_draft=True, num_draft_tokens=K,
                         engine=FakeEngine(num_pages=32, page_size=8, max_batch_size=4, max_chunk_size=16,
                                           max_seq_len=128, vocab_size=vocab_size, verification=Verification(K)))
    g.enqueue(job)
    g.scheduler.admit(lambda job: None)
    job.sequence.extend([7] * new)
    job.new_tokens = new
    job.kv_position = len(job.sequence) - 1
    rows, owners, failed = g.scheduler.plan()
    assert owners == [job] and not failed
    return g, rows[0]


def test_a_row_drafts_at_most_what_the_job_may_still_emit_and_its_pages_hold():
    job = Job(list(range(1, 11)), 32)  # 10 prompt tokens
    g, row = decoding(job)
    step = g.speculation
    assert len(row.tokens) == 1 and step.max_drafts(job, row) == K
    job.max_new_tokens = 3  # one emitted, two left: a row emits drafts + 1 tokens
    assert step.max_drafts(job, row) == 1
    job.max_new_tokens = 32
    room = len(job.pages) * 8 - job.kv_position - 1
    job.pages = job.pages[:2]  # 16 slots: KV at 10 .. 15 only
    assert step.max_drafts(job, row) == min(K, 16 - job.kv_position - 1) < room
    prefill = g.scheduler.row(job, job.sequence[:4], False)
    assert step.max_drafts(job, prefill) == 0


def test_jobs_whose_positions_depend_on_each_token_do_not_draft():
    for job in (Job(list(range(1, 11)), 32, gen_settings=SamplingSettings(temperature=1.0, mirostat=True)),):
        g, row = decoding(job)
        assert job.mirostat_mu is not None and g.speculation.spec_row(row, job).max_drafts == 0
    job = Job(list(range(1, 11)), 32)
    g, row = decoding(job)
    assert g.speculation.spec_row(row, job).max_drafts == K
    job.embeddings = [np.zeros((1, 4), np.float32)]  # (as a job with injected embeddings carries them)
    assert g.speculation.spec_row(row, job).max_drafts == 0


def test_drafting_stops_before_a_position_where_every_token_is_banned():
    job = Job([1, 0, 1], 32, gen_settings=SamplingSettings(banned_tokens=[0]))
    g, row = decoding(job, vocab_size=2)
    assert g.speculation.spec_row(row, job).max_drafts == K
    job.explored[len(job.sequence) + 2] = {1}  # a rewind banned the other token at the second draft's position
    spec = g.speculation.spec_row(row, job)
    assert spec.max_drafts == 1 and spec.bias_at(1) == {0: -math.inf}


def test_stop_tokens_stay_banned_at_draft_positions_before_min_new_tokens():
    job = Job(list(range(1, 11)), 32, stop_conditions=[3], min_new_tokens=3)
    g, row = decoding(job)  # one token out: output positions 1, 2 may not stop, 3 may
    spec = g.speculation.spec_row(row, job)
    assert spec.max_drafts == K
    assert [spec.bias_at(j).get(3) for j in range(1, K + 1)] == [-math.inf, None, None, None]
    assert row.bias == {3: -math.inf}  # the row's own position (output 1)
