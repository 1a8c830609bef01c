"""One job's failure ends that job alone; a failed step loses nothing and leaves the generator usable.

Faults are injected where validation cannot see them coming: a tokenizer that raises on one token, a text stream
that raises, a sampler that returns an impossible token, an engine whose step raises. In every case the healthy jobs
finish with exactly the tokens they produce alone and the page accounting stays exact.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models import ModelConfig, init_random_weights
from models.loader import Model
from paged import DynamicGenerator, Job, SamplingSettings
from paged.async_generator import AsyncDynamicGenerator
from paged.errors import JobFailure, StepError
from tests.paged.fakes import ByteTokenizer, FakeEngine, drain

GREEDY = SamplingSettings.greedy()
POISON = 250  # the failing tokenizer raises on this token


class FailingTokenizer(ByteTokenizer):
    def __init__(self, poison=POISON):
        self.poison = poison

    def token_bytes(self, t):
        if t == self.poison:
            raise RuntimeError(f"cannot decode token {t}")
        return super().token_bytes(t)


TOK = FailingTokenizer()


class FlakyEngine(FakeEngine):
    """A fake engine whose step raises on the calls listed in `fail_calls` (0-based), before touching anything."""

    def __init__(self, fail_calls=(), **kw):
        super().__init__(**kw)
        self.fail_calls = set(fail_calls)
        self.attempts = 0

    def run(self, rows, **kw):
        self.attempts += 1
        if self.attempts - 1 in self.fail_calls:
            raise RuntimeError("device lost")
        return super().run(rows, **kw)


class ImpossibleTokenEngine(FakeEngine):
    """Reports log-probability -inf (nothing was allowed) for rows whose context starts with token `bad_first`."""

    def __init__(self, bad_first, **kw):
        super().__init__(**kw)
        self.bad_first = bad_first

    def run(self, rows, **kw):
        out = super().run(rows, **kw)
        for i, r in enumerate(rows):
            if self.written.get((r.pages[0], 0)) == self.bad_first:
                out.logprob[i] = -math.inf
        return out


def healthy():
    return [Job(TOK.encode(p), 6, gen_settings=GREEDY, identifier=p)
            for p in ("hello", "abc", "a prompt that spans several pages")]


def solo(engine_factory=FakeEngine) -> dict:
    out = {}
    for j in healthy():
        g = DynamicGenerator(tokenizer=TOK, engine=engine_factory())
        g.enqueue(j)
        out[j.identifier] = drain(g).finals[j.identifier]["full_completion"]
    return out


def check_clean(gen):
    assert not gen.active and not gen.pending and gen.pool.num_referenced == 0
    gen.pool.check(expected_refs={})


def test_a_job_whose_text_cannot_be_decoded_ends_alone():
    want = solo()
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=64))
    gen.enqueue(healthy())
    # the fake continues 248 -> 249 -> 250: its third token cannot be decoded
    bad = Job([248], 5, gen_settings=GREEDY, identifier="bad")
    gen.enqueue(bad)
    c = drain(gen)
    final = c.finals.pop("bad")
    assert final["eos"] and final["eos_reason"] == "error"
    assert "RuntimeError: cannot decode token 250" in final["error"]
    assert final["full_completion"] == c.texts.get("bad", "") == "\ufffd"  # byte 249 is never valid UTF-8
    assert final["new_tokens"] == 2  # 249 and 250 were sampled; 250 failed while being decoded
    assert {k: v["full_completion"] for k, v in c.finals.items()} == want
    assert gen.metrics()["jobs_failed"] == 1 and gen.metrics()["jobs_completed"] == 3
    check_clean(gen)


def test_a_token_sampled_with_probability_zero_ends_its_job():
    want = solo()
    gen = DynamicGenerator(tokenizer=TOK, engine=ImpossibleTokenEngine(bad_first=ord("z"), num_pages=64))
    gen.enqueue(healthy())
    gen.enqueue(Job(TOK.encode("zebra"), 5, gen_settings=GREEDY, identifier="bad"))
    c = drain(gen)
    final = c.finals.pop("bad")
    assert final["eos_reason"] == "error" and "log-probability -inf" in final["error"]
    assert final["new_tokens"] == 0
    assert {k: v["full_completion"] for k, v in c.finals.items()} == want
    check_clean(gen)


def test_a_stream_that_raises_ends_only_its_job():
    want = solo()
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=64), decode_steps=3)
    gen.enqueue(healthy())
    bad = Job(TOK.encode("xyz"), 8, gen_settings=GREEDY, identifier="bad", stop_conditions=["never"])
    gen.enqueue(bad)
    feed, calls = bad.stream.feed, []

    def feed_then_fail(token):
        calls.append(token)
        if len(calls) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return feed(token)

    bad.stream.feed = feed_then_fail
    c = drain(gen)
    assert c.finals.pop("bad")["eos_reason"] == "error"
    assert {k: v["full_completion"] for k, v in c.finals.items()} == want
    check_clean(gen)


def test_a_failed_step_loses_no_results_and_the_generator_recovers():
    want = solo()
    engine = FlakyEngine(fail_calls={0, 3, 4}, num_pages=64)
    gen = DynamicGenerator(tokenizer=TOK, engine=engine)
    gen.enqueue(healthy())
    with pytest.raises(StepError, match="device lost") as info:
        gen.iterate()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert all(j.kv_position == 0 for j in gen.active)  # no job advanced
    assert gen.num_remaining_jobs() == 3
    results = []
    failures = 0
    while gen.num_remaining_jobs():
        try:
            results += gen.iterate()
        except StepError:
            failures += 1
    assert failures == 2
    started = [r["identifier"] for r in results if r["stage"] == "started"]
    assert sorted(started) == sorted(want)  # the "started" results of the failed call came with the next one
    texts = {}
    for r in results:
        texts[r["identifier"]] = texts.get(r["identifier"], "") + r.get("text", "")
    assert texts == want
    assert gen.metrics()["steps_failed"] == 3
    check_clean(gen)


def test_generate_reports_a_failed_job_after_the_others_finish():
    gen = DynamicGenerator(tokenizer=FailingTokenizer(poison=ord("d")), engine=FakeEngine(num_pages=64))
    stash = Job([ord("w")], 3, gen_settings=GREEDY, identifier="other")  # another caller's job keeps its results
    gen.enqueue(stash)
    with pytest.raises(JobFailure, match="prompt 1 failed: RuntimeError: cannot decode token 100"):
        gen.generate(["x", "ab"], 4, gen_settings=GREEDY)  # "ab" continues with c, then d
    assert drain(gen).finals["other"]["full_completion"] == "xyz"
    check_clean(gen)


def test_async_errors_reach_only_their_own_stream():
    async def main():
        agen = AsyncDynamicGenerator(DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=64)))
        jobs = [agen.submit(j) for j in healthy()]
        bad = agen.submit(Job([248], 5, gen_settings=GREEDY, identifier="bad"))

        async def collect(aj):
            return [r async for r in aj]

        outs = await asyncio.gather(*(collect(aj) for aj in [*jobs, bad]))
        await agen.close()
        return outs, agen

    outs, agen = asyncio.run(main())
    *good, bad = outs
    assert bad[-1]["eos_reason"] == "error"
    assert {o[-1]["identifier"]: o[-1]["full_completion"] for o in good} == solo()
    check_clean(agen.generator)


def test_async_persistent_step_failure_fails_the_running_jobs_only():
    async def main():
        engine = FlakyEngine(fail_calls={1, 2, 3}, num_pages=64, max_batch_size=2)
        agen = AsyncDynamicGenerator(DynamicGenerator(tokenizer=TOK, engine=engine), max_step_retries=2)
        first = [agen.submit(Job(TOK.encode(p), 6, gen_settings=GREEDY, identifier=p)) for p in ("ab", "cd")]
        later = agen.submit(Job(TOK.encode("hello"), 6, gen_settings=GREEDY, identifier="hello"))

        async def collect(aj):
            try:
                return [r async for r in aj]
            except StepError as e:
                return e

        outs = await asyncio.gather(*(collect(aj) for aj in [*first, later]))
        await agen.close()
        return outs, agen

    (a, b, c), agen = asyncio.run(main())
    assert isinstance(a, StepError) and isinstance(b, StepError)
    assert c[-1]["eos"] and c[-1]["full_completion"] == "pqrstu"
    check_clean(agen.generator)


# ---------------------------------------------------------------------------------------------- property test
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["enqueue", "poison", "cancel", "iterate", "iterate", "iterate"]),
                              st.integers(0, 10_000)), min_size=5, max_size=60),
       fail_calls=st.sets(st.integers(0, 40), max_size=8))
def test_page_accounting_is_exact_with_injected_faults(ops, fail_calls):
    engine = FlakyEngine(fail_calls=fail_calls, num_pages=24, page_size=4, max_batch_size=3, max_chunk_size=8,
                         max_seq_len=48)
    gen = DynamicGenerator(tokenizer=TOK, engine=engine)
    rng = np.random.default_rng(0)
    jobs, finals = [], {}

    def refs():
        out = {}
        for j in gen.active:
            for p in j.pages:
                out[p] = out.get(p, 0) + 1
        return out

    def step():
        try:
            for r in gen.iterate():
                if r["eos"]:
                    finals[r["identifier"]] = r
        except StepError:
            pass

    for op, x in ops:
        if op in ("enqueue", "poison"):
            n = int(rng.integers(1, 20))
            start = 240 if op == "poison" else 1 + x % 200  # poisoned prompts reach token 250 and fail
            prompt = [(start + i) % 256 for i in range(n)]
            j = Job(prompt, 1 + x % 12, gen_settings=GREEDY, identifier=len(jobs))
            gen.enqueue(j)
            jobs.append(j)
        elif op == "cancel" and jobs:
            gen.cancel(jobs[x % len(jobs)])
        else:
            step()
        gen.pool.check(expected_refs=refs())
    for _ in range(500):
        if not gen.num_remaining_jobs():
            break
        step()
        gen.pool.check(expected_refs=refs())
    check_clean(gen)
    for ident, r in finals.items():
        j = jobs[ident]
        expect = [(j.input_ids[-1] + 1 + i) % 258 for i in range(j.max_new_tokens)]
        if POISON in expect[: r["new_tokens"]] or r["eos_reason"] == "error":
            assert r["eos_reason"] == "error" and POISON in expect, r
        else:
            assert r["eos_reason"] == "max_new_tokens" and j.sequence[j.prompt_len :] == expect


# ---------------------------------------------------------------------------------------------- real tiny model
CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
MODEL = Model(config=CFG, params=init_random_weights(CFG, seed=1), tokenizer=None, source="tiny")


@pytest.mark.slow  # fast tier: the same families on the fake engine (hypothesis) above
def test_real_engine_healthy_jobs_unharmed_by_bad_jobs():
    kw = dict(num_pages=32, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=64)
    prompts = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [20, 21], "c": list(range(30, 50))}
    sampled = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0)

    def jobs():
        return [Job(p, 6, gen_settings=sampled, seed=7, identifier=k) for k, p in prompts.items()]

    alone = {}
    for j in jobs():
        g = DynamicGenerator(MODEL, **kw)
        g.enqueue(j)
        alone[j.identifier] = j
        drain(g)
    gen = DynamicGenerator(MODEL, **kw)
    gen.enqueue(jobs())
    gen.iterate()
    with pytest.raises(ValueError, match="return_top_tokens"):
        gen.enqueue(Job([1, 2], 3, return_top_tokens=1000))
    bad = Job([1, 2, 3], 8, gen_settings=sampled, identifier="bad")
    gen.enqueue(bad)
    feed = bad.stream.feed
    bad.stream.feed = lambda t: feed(t) if bad.new_tokens < 2 else (_ for _ in ()).throw(RuntimeError("boom"))
    c = drain(gen)
    assert c.finals.pop("bad")["eos_reason"] == "error"
    for k, r in c.finals.items():
        assert r["job"].sequence == alone[k].sequence, k
    check_clean(gen)
