"""Preemption by recompute under random enqueue / cancel / iterate with on-demand pages: no page leaks, reference
counts exact after every step, and every job's output (and its stream) identical to a run with ample pages, with a
fake model whose tokens depend on every KV entry it reads back (`ContextFakeEngine`)."""

from __future__ import annotations

import collections
import random

import pytest

from paged import DynamicGenerator, Job
from paged.clock import VirtualClock
from paged.policies import make_policy
from paged.testing import ByteTokenizer, ContextFakeEngine, drain

TOK = ByteTokenizer()
PREFIXES = ["", "shared prefix one ", "another shared, longer ", "abcdefgh"]


def random_job(rng: random.Random, i: int) -> tuple[Job, dict]:
    text = rng.choice(PREFIXES) + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 9)))
    kw = dict(max_new_tokens=rng.randint(1, 14), priority=rng.randint(0, 2))
    if rng.random() < 0.3:
        kw["banned_strings"] = ["ab"]  # rewinds, and text held across steps
    if rng.random() < 0.3:
        kw["stop_conditions"] = ["zz"]
    return Job(TOK.encode(text), identifier=i, **kw), dict(text=text, **kw)


def reference_output(spec: dict) -> tuple[str, list[int]]:
    kw = {k: v for k, v in spec.items() if k != "text"}
    gen = DynamicGenerator(tokenizer=TOK, engine=ContextFakeEngine(num_pages=64, page_size=4, max_seq_len=64))
    gen.enqueue(Job(TOK.encode(spec["text"]), identifier="ref", **kw))
    c = drain(gen)
    toks = [t for r in c.results if r["stage"] == "streaming" for t in r["token_ids"]]
    return c.finals["ref"]["full_completion"], toks


def check_pool(gen: DynamicGenerator) -> None:
    refs = collections.Counter(p for j in gen.active for p in j.pages)
    gen.pool.check(dict(refs))
    assert all(not j.pages and j.kv_position == 0 for j in gen.pending)


def collect(results, texts, tokens, finals):
    for r in results:
        if r["stage"] == "streaming":
            texts[r["identifier"]] += r["text"]
            tokens[r["identifier"]] += r["token_ids"]
        if r["eos"]:
            finals[r["identifier"]] = r


@pytest.mark.parametrize("policy", ["vllm", "priority", "sarathi", "lpm_on_demand", "edf"])
def test_random_preemption_keeps_pages_exact_and_outputs_identical(policy):
    if policy == "lpm_on_demand":
        policy = make_policy("lpm", allocation="on_demand")
    elif policy == "edf":
        policy = "experiments.policies.edf:EarliestDeadlineFirst"
    total_preemptions = 0
    for seed in range(12):
        rng = random.Random(seed)
        engine = ContextFakeEngine(num_pages=rng.randint(13, 17), page_size=4, max_batch_size=rng.randint(2, 4),
                                   max_chunk_size=8, max_seq_len=48, max_prefill_rows=rng.randint(1, 2))
        # a clock that moves 20 ms per iterate(): lpm's aging and EDF's deadlines take part, and a failure replays
        # from its seed whatever the machine's load
        clock = VirtualClock()
        gen = DynamicGenerator(tokenizer=TOK, engine=engine, policy=policy, decode_steps=rng.choice([1, 3]),
                               clock=clock)
        specs, cancelled, jobs = {}, set(), []
        texts, tokens, finals = collections.defaultdict(str), collections.defaultdict(list), {}

        for i in range(40):
            if rng.random() < 0.5:
                j, spec = random_job(rng, i)
                if rng.random() < 0.3:
                    j.deadline = rng.uniform(0.001, 1.0)
                gen.enqueue(j)
                specs[i] = spec
                jobs.append(j)
            if jobs and rng.random() < 0.08:
                victim = rng.choice(jobs)
                if victim.identifier not in finals:
                    gen.cancel(victim)
                    cancelled.add(victim.identifier)
            collect(gen.iterate(), texts, tokens, finals)
            clock.advance(0.02)
            check_pool(gen)
        while gen.num_remaining_jobs():
            collect(gen.iterate(), texts, tokens, finals)
            clock.advance(0.02)
            check_pool(gen)
        gen.pool.check({})
        total_preemptions += gen.metrics()["preemptions"]
        assert gen.metrics()["preemptions"] == sum(j.preemptions for j in jobs)
        for i, spec in specs.items():
            if i in cancelled:
                continue
            f = finals[i]
            ref_text, ref_tokens = reference_output(spec)
            assert f["full_completion"] == ref_text == texts[i], (seed, i, f["preemptions"])
            assert tokens[i] == ref_tokens, (seed, i)
            assert f["preemptions"] == jobs[[j.identifier for j in jobs].index(i)].preemptions
    assert total_preemptions > 0, "the scenario never preempted: it tests nothing"


def test_preempted_job_streams_every_token_once_and_reuses_its_cached_pages():
    engine = ContextFakeEngine(num_pages=7, page_size=4, max_batch_size=2, max_chunk_size=8, max_seq_len=32)
    gen = DynamicGenerator(tokenizer=TOK, engine=engine, policy="vllm")
    gen.enqueue([Job(TOK.encode("first.."), 14, identifier="a"), Job(TOK.encode("second."), 14, identifier="b")])
    c = drain(gen)
    assert c.finals["b"]["preemptions"] >= 1 and c.finals["a"]["preemptions"] == 0
    for ident in "ab":
        streamed = [t for r in c.results if r["identifier"] == ident and r["stage"] == "streaming"
                    for t in r["token_ids"]]
        assert len(streamed) == 14 == c.finals[ident]["new_tokens"]
        assert c.texts[ident] == c.finals[ident]["full_completion"]
    m = gen.metrics()
    # b's complete, hashed pages were cached when it was preempted, so the recompute skipped them
    assert 0 < m["tokens_recomputed"] < m["preemptions"] * (7 + 14)
    assert m["tokens_prefilled"] == 14 + m["tokens_recomputed"]
    assert c.finals["b"]["cached_tokens"] == 0  # a recompute is not reported as a prompt-cache hit


def test_recompute_reuses_the_cached_pages_of_prompt_and_output():
    """Preempted after 9 generated tokens (sequence of 7 + 9 = 16 tokens, 15 of them computed, page size 4): its 3
    complete pages whose tokens are all released stay cached, so re-admission skips 12 tokens and runs a chunk of
    the last 4, which samples: 3 of them recomputed (12..14), and token 15, which had not run (it was to be the next
    decode row's). Every prefilled token is a prompt token or a recomputed one."""
    gen = DynamicGenerator(tokenizer=TOK, engine=ContextFakeEngine(num_pages=32, page_size=4), policy="vllm")
    j = Job(TOK.encode("prompt!"), 12, identifier="j")
    gen.enqueue(j)
    while j.new_tokens < 9:
        gen.iterate()
    assert len(j.sequence) == 16 and not j.stream.held
    gen.scheduler.preempt(j)
    assert j.pages == [] and gen.pending == [j] and gen.active == []
    gen.pool.check({})
    gen.iterate()  # re-admitted: 12 tokens from the cache, one chunk of 4 recomputed, which samples token 10
    m = gen.metrics()
    assert m["tokens_recomputed"] == 3 and j.kv_position == 16 and j.new_tokens == 10
    assert m["tokens_prefilled"] == 7 + 3
    c = drain(gen)
    ref_text, _ = reference_output(dict(text="prompt!", max_new_tokens=12))
    assert j.full_completion == ref_text and c.finals["j"]["preemptions"] == 1


def test_a_job_preempted_before_it_computed_anything_recomputes_nothing():
    """Preempted right after admission (no step has run for it) and twice mid-prompt: only tokens it had computed
    count as recomputed, once each (they had all been counted, the whole sequence at every re-admission)."""
    gen = DynamicGenerator(tokenizer=TOK, engine=ContextFakeEngine(num_pages=32, page_size=4, max_chunk_size=4),
                           policy="vllm")
    j = Job(TOK.encode("a prompt of 23 tokens.."), 4, identifier="j")
    gen.enqueue(j)
    gen.scheduler.admit(lambda job: None)
    gen.scheduler.preempt(j)  # admitted, nothing run
    gen.iterate()  # tokens 0..3 (the chunk size), then preempted again with 2 pages hashed: 8 come back cached
    gen.iterate()
    assert j.kv_position == 8
    gen.scheduler.preempt(j)
    drain(gen)
    m = gen.metrics()
    assert m["preemptions"] == 2 and m["tokens_recomputed"] == 0  # the cache gave back all it had computed
    assert m["tokens_prefilled"] == 23 and j.new_tokens == 4


def test_preemption_while_a_banned_string_is_held_then_rewound():
    """Text held by the stream (it may still become a banned string) is not hashed at re-admission: the rewind that
    follows takes those tokens back from the job's own pages."""
    from paged.testing import FakeEngine

    script = {ord("P"): (2, [ord(c) for c in "axyzb"])}  # "P?" then a, x, y, z, b... ("xyz" is banned)
    outs = {}
    for preempt in (False, True):
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32, page_size=4, script=script),
                               policy="vllm")
        j = Job(TOK.encode("P?"), 6, banned_strings=["xyz"], identifier="j")
        gen.enqueue(j)
        while j.new_tokens < 3:
            gen.iterate()
        assert [t for t, _ in j.stream.held] == [ord("x"), ord("y")]  # sequence indexes 3 and 4: page 0 ends at 3
        if preempt:
            gen.scheduler.preempt(j)
        c = drain(gen)
        gen.pool.check({})
        outs[preempt] = (c.finals["j"]["eos_reason"], c.finals["j"]["full_completion"], c.texts["j"])
    assert outs[True] == outs[False] and outs[False][0] == "max_new_tokens"
    assert "xyz" not in outs[False][1]


def test_context_fake_engine_notices_a_wrong_kv_entry():
    eng = ContextFakeEngine(num_pages=8, page_size=4)
    gen = DynamicGenerator(tokenizer=TOK, engine=eng)
    gen.enqueue(Job(TOK.encode("hello"), 3, identifier="a"))
    good = drain(gen).finals["a"]["full_completion"]
    eng2 = ContextFakeEngine(num_pages=8, page_size=4)
    gen2 = DynamicGenerator(tokenizer=TOK, engine=eng2)
    gen2.enqueue(Job(TOK.encode("hello"), 3, identifier="a"))
    gen2.iterate()  # prefill + first token
    page = gen2.active[0].pages[0]
    eng2.written[(page, 1)] += 1  # corrupt one cached K/V entry
    assert drain(gen2).finals["a"]["full_completion"][1:] != good[1:]
