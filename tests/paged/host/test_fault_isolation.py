"""One job's failure ends that job alone; a failed step loses nothing and leaves the generator usable.

Faults are injected where validation cannot see them coming: a tokenizer that raises on one token, a text stream
that raises, a sampler that returns an impossible token, an engine whose step raises. In every case the healthy jobs
finish with exactly the tokens they produce alone and the page accounting stays exact.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.lora import projection_shapes, save_lora
from paged import DynamicGenerator, Job, SamplingSettings
from paged.errors import InvalidConfigError, JobFailure, StepError
from paged.filters import RegexFilter
from paged.host.async_generator import AsyncDynamicGenerator
from paged.testing import (
    ByteTokenizer,
    FakeEngine,
    FaultInjector,
    InjectedFault,
    drain,
    page_refs,
    tiny_config,
    tiny_model,
)

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
        gen.pool.check(expected_refs=page_refs(gen))
    for _ in range(500):
        if not gen.num_remaining_jobs():
            break
        step()
        gen.pool.check(expected_refs=page_refs(gen))
    check_clean(gen)
    for ident, r in finals.items():
        j = jobs[ident]
        expect = [(j.input_ids[-1] + 1 + i) % 258 for i in range(j.max_new_tokens)]
        if POISON in expect[: r["new_tokens"]] or r["eos_reason"] == "error":
            assert r["eos_reason"] == "error" and POISON in expect, r
        else:
            assert r["eos_reason"] == "max_new_tokens" and j.sequence[j.prompt_len :] == expect


# ---------------------------------------------------------------------------------------------- real tiny model
CFG = tiny_config(96)
MODEL = tiny_model(CFG, seed=1)


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


# ---------------------------------------------------------------------------------------------- fault injector
def test_the_fault_injector_is_seeded_validated_and_removable():
    def run(seed):
        engine = FakeEngine(num_pages=64)
        gen = DynamicGenerator(tokenizer=TOK, engine=engine)
        faults = FaultInjector(gen, step=0.3, seed=seed)
        gen.enqueue(healthy())
        failed = []
        for i in range(200):
            if not gen.num_remaining_jobs():
                break
            try:
                gen.iterate()
            except StepError as e:
                assert isinstance(e.__cause__, InjectedFault)
                failed.append(i)
        check_clean(gen)
        assert faults.injected["step"] == len(failed) > 0 and faults.calls["step"] >= len(failed)
        return failed

    assert run(1) == run(1) != run(2)
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine())
    with FaultInjector(gen, step=1.0):
        gen.enqueue(Job([1, 2], 2, gen_settings=GREEDY))
        with pytest.raises(StepError, match="injected step fault #1"):
            gen.iterate()
        with pytest.raises(InvalidConfigError, match="fault hook already"):
            FaultInjector(gen)
    assert gen.fault_hook is None and drain(gen).finals  # removed: the job runs
    for bad in (-0.1, 1.5, "0.1", True):
        with pytest.raises(InvalidConfigError, match="must be a probability"):
            FaultInjector(gen, masks=bad)


SOAK_CFG = tiny_config(258, max_position_embeddings=128)
SOAK_TOK = ByteTokenizer()
SOAK_MODEL = tiny_model(SOAK_CFG, seed=3, tokenizer=SOAK_TOK)
# n-gram speculation with sample-then-match (sampled output is plain sampling's, whatever was drafted), on-demand
# pages with preemption (vllm), one LoRA slot; 14 usable pages of 8 tokens for up to 4 jobs of up to 6 pages
SOAK = dict(num_pages=15, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=64, max_loras=1,
            max_lora_rank=4, use_ngram_draft=True, num_draft_tokens=3, draft_acceptance="match", policy="vllm")


def soak_templates():
    rng = np.random.default_rng(5)

    def ids(n):
        return [int(t) for t in rng.integers(97, 123, size=n)]

    rep = ids(5) * 4
    a, b, c, d, e, neg = ids(11), ids(17), ids(9), ids(14), ids(30), ids(6)
    sampled = SamplingSettings(temperature=0.9, top_k=50)
    return {
        "plain": lambda: Job(a, 10, gen_settings=GREEDY),
        "sampled": lambda: Job(b, 12, gen_settings=sampled, seed=11),
        "copy": lambda: Job(rep, 14, gen_settings=GREEDY),  # prompt lookup drafts and gets them accepted
        "filtered": lambda: Job(c, 12, gen_settings=sampled, seed=4, filters=RegexFilter("[a-z]{2,5}( [a-z]{2,5})*")),
        "cfg": lambda: Job([d, neg], 8, gen_settings=SamplingSettings.greedy(cfg_scale=1.5)),
        "lora": lambda: Job(d, 10, gen_settings=GREEDY, lora="a"),
        "long": lambda: Job(e, 16, gen_settings=GREEDY),  # 6 pages: preemption
    }


def soak_generator(adapter):
    gen = DynamicGenerator(SOAK_MODEL, **SOAK)
    gen.load_lora("a", adapter)
    return gen


def soak_adapter(path):
    rng = np.random.default_rng(2)
    shapes = projection_shapes(SOAK_CFG)
    a = {(layer, p): rng.normal(0, 0.3, size=(4, shapes[p][0])) for layer in range(2) for p in ("q", "v", "down")}
    b = {(layer, p): rng.normal(0, 0.3, size=(shapes[p][1], 4)) for layer in range(2) for p in ("q", "v", "down")}
    save_lora(path, SOAK_CFG, a, b, r=4, lora_alpha=8.0)
    return path


@pytest.mark.slow
def test_seeded_soak_with_injected_faults(tmp_path):
    """Thousands of seeded random operations (enqueue of plain, sampled, n-gram-drafted, filtered, CFG, LoRA and
    preempted jobs; iterate; cancel; drain) with faults injected into the engine step, the drafting and the mask
    computation. After every drain: each job ended exactly once (or was cancelled before it ended), every job that
    did not fail has its solo output, a failed job failed only by an injected mask fault, and the pages are exact."""
    adapter = soak_adapter(tmp_path / "lora")
    templates = soak_templates()
    solo = {}
    for name, make in templates.items():
        g = soak_generator(adapter)
        j = make()
        g.enqueue(j)
        r = drain(g).finals[None]
        assert r["eos_reason"] in ("max_new_tokens", "end_filter", "stop_token"), (name, r)
        solo[name] = list(j.sequence)
    gen = soak_generator(adapter)
    faults = FaultInjector(gen, step=0.05, draft=0.05, masks=0.05, seed=7)
    rng = random.Random(7)
    jobs: dict[int, tuple[str, Job]] = {}
    finals: dict[int, list[dict]] = {}
    cancelled: set[int] = set()
    stats = collections.Counter()

    def step():
        try:
            results = gen.iterate()
        except StepError as e:
            assert isinstance(e.__cause__, InjectedFault), e
            stats["step_errors"] += 1
            return
        for r in results:
            if r["eos"]:
                finals.setdefault(r["identifier"], []).append(r)

    def check_drained():
        stats["failed_by_masks"] = stats["matched_solo"] = 0
        assert not gen.pending and not gen.active and gen.pool.num_referenced == 0
        gen.pool.check(expected_refs={})
        for ident, (name, job) in jobs.items():
            ends = finals.get(ident, [])
            if ident in cancelled and not ends:
                continue
            assert len(ends) == 1, (ident, name, ends)
            r = ends[0]
            if r["eos_reason"] == "error":
                assert name == "filtered" and "InjectedFault" in r["error"], (name, r)
                stats["failed_by_masks"] += 1
            else:
                assert job.sequence == solo[name], (ident, name)
                stats["matched_solo"] += 1

    for _ in range(2500):
        op = rng.random()
        if op < 0.35:
            name = rng.choice(list(templates))
            ident = len(jobs)
            job = templates[name]()
            job.identifier = ident
            gen.enqueue(job)
            jobs[ident] = (name, job)
        elif op < 0.9:
            step()
        elif op < 0.97:
            live = [i for i, (_, j) in jobs.items() if j in gen.pending or j in gen.active]
            if live:
                ident = rng.choice(live)
                gen.cancel(jobs[ident][1])
                cancelled.add(ident)
        else:
            for _ in range(2000):
                if not gen.num_remaining_jobs():
                    break
                step()
            check_drained()
            stats["drains"] += 1
        gen.pool.check(expected_refs=page_refs(gen))
    for _ in range(2000):
        if not gen.num_remaining_jobs():
            break
        step()
    check_drained()
    m = gen.metrics()
    # the run exercised what it is for
    assert faults.injected["step"] > 10 and faults.injected["draft"] > 5 and faults.injected["masks"] > 5, faults
    assert stats["failed_by_masks"] > 0 and stats["drains"] > 20 and len(cancelled) > 20, stats
    assert m["preemptions"] > 5 and m["accepted_draft_tokens"] > 20, m
