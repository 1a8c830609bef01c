"""Scheduler, page pool and streaming behaviour of DynamicGenerator on a hand-checkable fake engine."""

from __future__ import annotations

import numpy as np
import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.errors import (
    InvalidJobError,
    InvalidJobTypeError,
    InvalidSettingsError,
    JobFailure,
    JobTooLargeError,
    StepError,
)
from paged.testing import ByteTokenizer, Collected, FakeEngine, drain, fake_logprob, fake_top_k

TOK = ByteTokenizer()


def make(**kw):
    script = kw.pop("script", None)
    policy = kw.pop("policy", "exllamav2")
    return DynamicGenerator(tokenizer=TOK, engine=FakeEngine(script=script, **kw), policy=policy)


def job(prompt, n=5, **kw):
    return Job(TOK.encode(prompt) if isinstance(prompt, str) else prompt, n, identifier=kw.pop("identifier", prompt),
               gen_settings=kw.pop("gen_settings", SamplingSettings.greedy()), **kw)


EXTRAS = ("token_probs", "top_k_tokens", "top_k_probs")


def assert_extras(c, ident, prompt_len, probs=False, top=0):
    """Every streaming result of `ident` carries, per released token, exactly the fake engine's probability and
    top-k for that token at its position (prompt_len + index among the released tokens); results that release no
    token carry none. Returns the released tokens."""
    rows = [r for r in c.results if r["identifier"] == ident and r["stage"] == "streaming"]
    assert rows, ident
    released = []
    for r in rows:
        toks = r["token_ids"]
        if not toks or not (probs or top):
            assert not any(key in r for key in EXTRAS), (ident, r)
            released += toks
            continue
        pos = [prompt_len + len(released) + i for i in range(len(toks))]
        if probs:
            want = [float(np.exp(np.float32(fake_logprob(t, p)))) for t, p in zip(toks, pos)]
            assert r["token_probs"] == pytest.approx(want, rel=1e-6, abs=0), (ident, toks, pos)
        else:
            assert "token_probs" not in r
        if top:
            want_ids = [fake_top_k(t, p, top)[0] for t, p in zip(toks, pos)]
            want_probs = [np.exp(np.float32(fake_top_k(t, p, top)[1])).tolist() for t, p in zip(toks, pos)]
            assert r["top_k_tokens"] == want_ids, (ident, toks, pos)
            assert len(r["top_k_probs"]) == len(toks) and all(len(x) == top for x in r["top_k_probs"])
            for got, want in zip(r["top_k_probs"], want_probs):
                assert got == pytest.approx(want, rel=1e-6, abs=0), (ident, toks, pos)
        else:
            assert "top_k_tokens" not in r and "top_k_probs" not in r
        released += toks
    return released


def test_result_stages_and_counts():
    gen = make()
    gen.enqueue(job("abc", 4))  # fake: next = last + 1 -> "defg"
    c = drain(gen)
    stages = [r["stage"] for r in c.results]
    assert stages[0] == "started" and stages.count("streaming") == 4
    final = c.finals["abc"]
    assert final["eos_reason"] == "max_new_tokens" and final["full_completion"] == "defg" == c.texts["abc"]
    assert final["new_tokens"] == 4 and final["prompt_tokens"] == 3 and final["cached_tokens"] == 0
    for key in ("job", "serial", "identifier", "time_enqueued", "time_prefill", "time_generate", "held"):
        assert key in final
    assert [r["token_ids"] for r in c.results if r["stage"] == "streaming"] == [[100], [101], [102], [103]]


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_probs_and_top_k_stay_aligned_with_the_released_tokens(decode_steps):
    """token_probs / top_k_tokens / top_k_probs are the engine's values for each released token at its position:
    through UTF-8 and stop-string hold-back (held tokens keep their extras until released), a banned-string rewind
    (the taken-back tokens' extras are dropped), a stop token (its extras are dropped) and multi-step bursts."""
    script = {ord("Q"): (1, list(b"bad ok")), ord("P"): (1, list(b"one xxy two xy three xy four xyz five")),
              ord("U"): (1, list("\u00e9\U0001f600".encode()))}
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(max_batch_size=6, script=script),
                           decode_steps=decode_steps)
    gen.enqueue([
        job("Q", 6, identifier="banned", banned_strings=["bad"], return_probs=True, return_top_tokens=3),
        job("P", 40, identifier="stop-string", stop_conditions=["xyz"], return_probs=True, return_top_tokens=3),
        job([1, 2, 3], 60, identifier="stop-token", stop_conditions=[40], return_probs=True, return_top_tokens=1),
        job("U", 6, identifier="utf8", return_probs=True),
        job("abc", 24, identifier="plain", return_top_tokens=2),
    ])
    c = drain(gen)
    assert len(c.finals) == 5
    # "bad" is rewound: 'b' is banned at its position, the fake takes 'c' (other extras than 'b' would have)
    assert assert_extras(c, "banned", 1, probs=True, top=3) == list(b"cad ok")
    assert c.finals["banned"]["full_completion"] == "cad ok"
    assert len([r for r in c.results if r.get("suppressed_text")]) == 1
    # "x" and "xy" are held and released with a later token ("xx": the first 'x' alone, while the second waits);
    # the stop string's own tokens come out (with their extras) in the final result, whose text stops before it
    stop = assert_extras(c, "stop-string", 1, probs=True, top=3)
    assert stop == list(b"one xxy two xy three xy four xyz")
    assert c.finals["stop-string"]["full_completion"] == "one xxy two xy three xy four "
    assert c.finals["stop-string"]["token_ids"] == list(b"xyz") and c.finals["stop-string"]["text"] == ""
    held_back = [r for r in c.results if r["identifier"] == "stop-string" and r["stage"] == "streaming"
                 and not r["token_ids"]]
    assert len(held_back) == 8  # "x" and "y" four times; "z" completes the last "xyz"
    assert [r["token_ids"] for r in c.results if r["identifier"] == "stop-string" and r.get("text") == "xy "] == [
        list(b"xy ")] * 3
    # the stop token (40) ends the job; its extras are not released
    assert assert_extras(c, "stop-token", 3, probs=True, top=1) == list(range(4, 40))
    assert c.finals["stop-token"]["held"]["token_ids"] == [40]
    # "\u00e9" and "\U0001f600" arrive in 2 + 4 byte tokens: held until complete, then released with their extras
    assert assert_extras(c, "utf8", 1, probs=True) == list("\u00e9\U0001f600".encode())
    assert [len(r["token_ids"]) for r in c.results if r["identifier"] == "utf8" and r["stage"] == "streaming"] == [
        0, 2, 0, 0, 0, 4]
    assert assert_extras(c, "plain", 3, top=2) == list(range(ord("d"), ord("d") + 24))
    if decode_steps > 1:
        assert len(gen.engine.bursts) >= 5  # the stop-string, stop-token and plain jobs ran in bursts
    else:
        assert gen.engine.bursts == []
    gen.pool.check({})


def test_chunked_prefill_reports_progress_and_samples_in_the_last_chunk():
    gen = make(max_chunk_size=16)
    gen.enqueue(job("x" * 40, 2))
    c = drain(gen)
    prefill = [r for r in c.results if r["stage"] == "prefill"]
    assert [r["curr_progress"] for r in prefill] == [16, 32]
    assert all(r["max_progress"] == 40 for r in prefill)
    assert c.finals["x" * 40]["full_completion"] == "yz"


def test_stop_token_and_min_new_tokens():
    gen = make(script={ord("q"): (1, [ord("a"), 256, ord("b"), 256])})
    gen.enqueue(job("q", 10, stop_conditions=[256], identifier="stop"))
    c = drain(gen)
    f = c.finals["stop"]
    assert f["eos_reason"] == "stop_token" and f["full_completion"] == "a" and f["eos_triggering_token_id"] == 256
    gen = make(script={ord("q"): (1, [ord("a"), 256, ord("b"), 256])})
    gen.enqueue(job("q", 10, stop_conditions=[256], min_new_tokens=2, identifier="min"))
    f = drain(gen).finals["min"]
    # the stop token was banned at token 2 (fake takes id 257 instead), allowed at token 4
    assert f["new_tokens"] == 4 and f["eos_reason"] == "stop_token"


def test_stop_string_split_across_tokens_is_held_and_excluded():
    text = "hello END world"
    gen = make(script={ord("p"): (1, list(text.encode()))})
    gen.enqueue(job("p", 30, stop_conditions=["END"], identifier="s"))
    c = drain(gen)
    f = c.finals["s"]
    assert f["eos_reason"] == "stop_string" and f["eos_triggering_string"] == "END"
    assert f["full_completion"] == "hello " == c.texts["s"]
    assert f["held"]["text"] == "END"
    streamed = [r["text"] for r in c.results if r["stage"] == "streaming"]
    assert "E" not in "".join(streamed) and streamed.count("") >= 2  # "E", "N" were held back


def test_incomplete_utf8_is_held_back():
    emitted = list("é😀".encode())  # 2 + 4 bytes
    gen = make(script={ord("u"): (1, emitted)})
    gen.enqueue(job("u", len(emitted), identifier="u"))
    c = drain(gen)
    texts = [r["text"] for r in c.results if r["stage"] == "streaming"]
    assert texts == ["", "é", "", "", "", "😀"]
    assert c.finals["u"]["full_completion"] == "é😀"


def test_max_skips_limits_how_often_a_big_job_is_passed_over():
    # 8 usable pages of 8 tokens; a running job holds 4, the big job needs 6, small ones need 1
    gen = make(num_pages=9, page_size=8, max_batch_size=8)
    gen.enqueue(job("r", 30, identifier="runner"))  # 31 tokens -> 4 pages
    gen.iterate()
    big = job("B" * 40, 5, identifier="big", max_skips=2)  # 45 tokens -> 6 pages: waits for the runner
    gen.enqueue(big)
    smalls = [job("s", 2, identifier=f"small{i}") for i in range(4)]
    gen.enqueue(smalls)
    started = []
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] == "started":
                started.append(r["identifier"])
    assert started.index("big") == 2  # two small jobs passed it, then the queue waited for it
    assert big.skips == 2
    assert started[:2] == ["small0", "small1"]


def test_prefix_dedup_shares_pages_and_prompt_cache_hits():
    prefix = "P" * 32  # 4 full pages of 8
    gen = make(num_pages=40, page_size=8, max_batch_size=4)
    gen.enqueue([job(prefix + "a", 3, identifier="a"), job(prefix + "b", 3, identifier="b")])
    gen.iterate()  # admits both
    a, b = gen.active
    assert a.pages[:4] == b.pages[:4]  # shared physical pages for the common prefix
    assert set(a.pages[4:]).isdisjoint(b.pages[4:])
    first = drain(gen).finals
    assert (first["a"]["cached_tokens"], first["b"]["cached_tokens"]) == (0, 32)  # b's came from a, in flight
    used_pages = gen.pool.num_cached
    gen.enqueue(job(prefix + "c", 3, identifier="c"))
    f = drain(gen).finals["c"]
    assert f["cached_tokens"] == 32 and f["cached_pages"] == 4
    m = gen.metrics()
    # 4 full prompt pages looked up per request; b's 4, shared with a while a wrote them, are hits (they had been
    # misses: incomplete when looked up), as are c's 4 from the cache
    assert (m["prefix_queries"], m["prefix_hits"]) == (12, 8)
    assert m["pages_used"] == 0 and used_pages >= 4
    d = job(prefix + "d", 3, identifier="d")  # a preempted job's re-admission is no new lookup
    gen.enqueue(d)
    gen.iterate()
    gen.scheduler.preempt(d)
    drain(gen)
    assert (gen.metrics()["prefix_queries"], gen.metrics()["prefix_hits"]) == (16, 12)


def test_generated_pages_are_cached_for_a_follow_up_turn():
    gen = make(num_pages=40, page_size=8)
    gen.enqueue(job("A", 24, identifier="turn1"))  # 25 tokens: 3 complete pages incl. generated text
    out = drain(gen).finals["turn1"]
    follow = TOK.encode("A" + out["full_completion"]) + TOK.encode("more")
    gen.enqueue(job(follow, 2, identifier="turn2"))
    assert drain(gen).finals["turn2"]["cached_tokens"] == 24


def test_lru_eviction_keeps_recently_used_prefixes():
    gen = make(num_pages=9, page_size=8, max_batch_size=1)
    for name in ("A", "B"):
        gen.enqueue(job(name * 17, 1, identifier=name))  # 2 full prompt pages each, 3 pages reserved
        drain(gen)
    gen.enqueue(job("A" * 17, 1, identifier="A2"))  # touch A again
    drain(gen)
    gen.enqueue(job("C" * 33, 1, identifier="C"))  # needs 5 pages: evicts B's pages (least recent) first
    drain(gen)
    gen.enqueue(job("A" * 17, 1, identifier="A3"))
    gen.enqueue(job("B" * 17, 1, identifier="B2"))
    c = drain(gen)
    assert c.finals["A3"]["cached_tokens"] == 16
    assert c.finals["B2"]["cached_tokens"] == 0


def test_cancel_and_clear_queue_free_pages_and_emit_nothing():
    gen = make(num_pages=20)
    j1, j2, j3 = job("a", 20, identifier=1), job("b", 20, identifier=2), job("c", 20, identifier=3)
    gen.enqueue([j1, j2, j3])
    gen.iterate()
    gen.cancel(j2)
    c = drain(gen)
    assert all(r["identifier"] != 2 for r in c.results if r["stage"] == "streaming")
    assert {i: f["full_completion"] for i, f in c.finals.items()} == {1: "bcdefghijklmnopqrstu",
                                                                      3: "defghijklmnopqrstuvw"}
    gen.pool.check({})
    gen.enqueue([job("d", 50, identifier=4), job("e", 50, identifier=5)])
    gen.iterate()
    gen.clear_queue()
    assert gen.num_remaining_jobs() == 0 and gen.pool.num_referenced == 0
    gen.pool.check({})
    for not_a_job in ("job-1", None, 42):  # (had been a silent no-op: the caller's job went on running)
        with pytest.raises(InvalidJobTypeError, match=r"cancel\(\) takes the paged.Job that enqueue\(\) was given"):
            gen.cancel(not_a_job)
    gen.cancel(job("f", 3))  # never enqueued: nothing to do


@pytest.mark.parametrize("how", ["cancel", "clear_queue"])
def test_generate_raises_when_another_caller_cancels_its_jobs(how):
    """cancel() or clear_queue() from elsewhere (here: after generate()'s second step) ends generate() with a
    JobFailure naming the prompts, at once, while another caller's job goes on; it had returned their partial text as
    if they had finished (after running the other caller's job to its end)."""
    gen = make(num_pages=40)
    other = job("o", 30, identifier="other")
    gen.enqueue(other)
    iterate, steps = gen.iterate, []

    def cancel_after_the_second_step():
        out = iterate()
        steps.append(out)
        if len(steps) == 2:
            if how == "cancel":
                for j in [j for j in gen.active if j.identifier[0] == "generate"]:
                    gen.cancel(j)
            else:
                gen.clear_queue()
        return out

    gen.iterate = cancel_after_the_second_step
    with pytest.raises(JobFailure, match=r"prompt 0 failed: it was cancelled before it finished .*; prompt 1 failed"):
        gen.generate(["abc", "xyz"], 20, gen_settings=SamplingSettings.greedy())
    assert len(steps) == 2
    gen.iterate = iterate
    if how == "cancel":
        alone = make(num_pages=40)
        alone.enqueue(job("o", 30, identifier="other"))
        assert drain(gen).finals["other"]["full_completion"] == drain(alone).finals["other"]["full_completion"]
    assert gen.num_remaining_jobs() == 0
    gen.pool.check({})


def test_generate_does_not_swallow_other_jobs_results():
    gen = make()
    other = job("z", 3, identifier="other")
    gen.enqueue(other)
    assert gen.generate("abc", 3, gen_settings=SamplingSettings.greedy()) == "def"
    assert gen.generate(["a", "b"], 2, gen_settings=SamplingSettings.greedy(), completion_only=False) == ["abc",
                                                                                                        "bcd"]
    c = drain(gen)
    seen = [r for r in c.results if r["identifier"] == "other"]
    assert seen  # still delivered to whoever iterates next
    assert "".join(r["text"] for r in seen if r["stage"] == "streaming") == "{|}"


def test_cancelling_a_job_that_generate_finished_keeps_its_last_results():
    """generate() ran another caller's job to its end and kept its results for the next iterate(): a cancel() of that
    finished job is a no-op (documented), so its owner still sees the final result; a cancel of a running job whose
    results are kept drops them (no result after a cancel)."""
    gen = make()
    other = job("q", 2, identifier="other")
    gen.enqueue(other)
    assert gen.generate("ab", 6, gen_settings=SamplingSettings.greedy()) == "cdefgh"
    assert other not in gen.active and other not in gen.pending and gen.num_remaining_jobs() == 1
    gen.cancel(other)
    results = gen.iterate()
    assert [(r["identifier"], r["eos"]) for r in results if r["stage"] == "streaming"][-1] == ("other", True)
    assert gen.num_remaining_jobs() == 0
    long = job("q", 20, identifier="long")  # still running when generate() returns, its tokens so far kept
    gen.enqueue(long)
    gen.generate("ab", 2, gen_settings=SamplingSettings.greedy())
    assert long in gen.active
    gen.cancel(long)
    assert gen.iterate() == [] and gen.num_remaining_jobs() == 0
    gen.pool.check({})


def test_generate_with_no_prompts_returns_no_completions():
    gen = make()
    assert gen.generate([], 3) == [] and gen.generate([], 3, return_last_results=True) == ([], [])
    assert gen.num_remaining_jobs() == 0


@pytest.mark.parametrize("bad, exc", [
    (lambda: Job([], 5), InvalidJobError),
    (lambda: Job(["a"], 5), InvalidJobError),
    (lambda: Job([1.5, 2], 5), InvalidJobError),
    (lambda: Job([1, 2], 0), InvalidJobError),
    (lambda: Job([1, 2], 5, stop_conditions=[1.5]), InvalidJobError),
    (lambda: Job([1, 2], 5, stop_conditions=[None]), InvalidJobError),
    (lambda: Job([1, 2], 5, min_new_tokens=6), InvalidJobError),
    (lambda: Job([1, 2], 5, max_skips=None), InvalidJobError),
    (lambda: SamplingSettings(temperature=-1), InvalidSettingsError),
    (lambda: SamplingSettings(top_p=0), InvalidSettingsError),
    (lambda: SamplingSettings(top_p=1.5), InvalidSettingsError),
    (lambda: SamplingSettings(top_k=-3), InvalidSettingsError),
])
def test_bad_job_inputs_raise_named_errors(bad, exc):
    with pytest.raises(exc):
        bad()


def test_bad_enqueues_leave_the_generator_serving():
    gen = make(num_pages=5, page_size=8, max_seq_len=64)
    good = job("ok", 4, identifier="good")
    gen.enqueue(good)
    gen.iterate()
    with pytest.raises(InvalidJobError, match="vocab"):
        gen.enqueue(Job([1, 999], 3))
    with pytest.raises(JobTooLargeError, match="max_seq_len"):
        gen.enqueue(Job([1] * 60, 10))
    with pytest.raises(JobTooLargeError, match="pages"):
        gen.enqueue(Job([1] * 40, 10))
    with pytest.raises(InvalidJobError, match="already enqueued"):
        gen.enqueue(good)
    with pytest.raises(InvalidJobError, match="stop token"):
        gen.enqueue(Job([1], 3, stop_conditions=[5000]))
    c = drain(gen)
    assert c.finals["good"]["full_completion"] == "lmno"
    gen.pool.check({})


def test_banned_string_rewinds_and_bans_the_first_token():
    text = "say bad word"
    gen = make(num_pages=20, page_size=4, script={ord("p"): (1, list(text.encode()))})
    gen.enqueue(job("p", len(text), banned_strings=["BAD"], identifier="b"))
    results = []
    while gen.num_remaining_jobs():
        results += gen.iterate()
        for j in gen.active:  # what the cache holds for the job is its (rewritten) sequence
            for pos in range(j.kv_position):
                assert gen.engine.written[(j.pages[pos // 4], pos % 4)] == j.sequence[pos]
    c = Collected(results, {"b": "".join(r["text"] for r in results if r["stage"] == "streaming")},
                  {"b": results[-1]})
    f = c.finals["b"]
    # 'b' was banned where "bad" began; the fake then takes the next id, 'c', and the script continues
    assert f["full_completion"] == "say cad word" == c.texts["b"]
    rewinds = [r for r in c.results if r.get("suppressed_text")]
    assert len(rewinds) == 1 and rewinds[0]["suppressed_text"] == "bad"
    assert f["new_tokens"] == len(text)
    gen.pool.check({})


def test_banned_strings_with_other_jobs_in_the_batch():
    gen = make(num_pages=30, page_size=4, max_batch_size=3,
               script={ord("p"): (1, list(b"oh no NO")), ord("q"): (1, list(b"fine text"))})
    gen.enqueue([job("p", 8, banned_strings=["no"], identifier="p"), job("q", 9, identifier="q"),
                 job("abc", 5, identifier="abc")])
    c = drain(gen)
    assert c.finals["q"]["full_completion"] == "fine text"
    assert c.finals["abc"]["full_completion"] == "defgh"
    # "no" and "NO" (banned strings match any case) are each rewound: the 'n' / 'N' is banned, the fake takes 'o' / 'O'
    assert c.finals["p"]["full_completion"] == "oh oo OO" and c.finals["p"]["new_tokens"] == 8
    assert [r["suppressed_text"] for r in c.results if r.get("suppressed_text")] == ["no", "NO"]
    gen.pool.check({})


def test_fcfs_never_skips_and_shortest_prompt_first_reorders():
    for policy, expected in (("fcfs", ["big", "small0", "small1"]),
                             ("shortest_prompt_first", ["small0", "small1", "big"])):
        gen = make(num_pages=9, page_size=8, max_batch_size=8, policy=policy)
        gen.enqueue(job("r", 30, identifier="runner"))
        gen.iterate()
        gen.enqueue([job("B" * 40, 5, identifier="big"), job("s", 2, identifier="small0"),
                     job("t", 2, identifier="small1")])
        started = []
        while gen.num_remaining_jobs():
            started += [r["identifier"] for r in gen.iterate() if r["stage"] == "started"]
        assert started == expected, policy


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown policy"):
        make(policy="lottery")


def test_generate_abort_event_cancels_its_jobs():
    import threading

    gen = make()
    ev = threading.Event()
    ev.set()
    assert gen.generate("abc", 10, abort_event=ev) is None
    assert gen.num_remaining_jobs() == 0
    gen.pool.check({})


@pytest.mark.parametrize("show", [False, True])
def test_special_tokens_hidden_unless_decode_special_tokens(show):
    gen = make(script={ord("q"): (1, [ord("a"), 257, ord("b")])})
    gen.enqueue(job("q", 3, decode_special_tokens=show, identifier="sp"))
    f = drain(gen).finals["sp"]
    assert f["full_completion"] == ("a<bos>b" if show else "ab")


def test_metrics_split_the_host_loop_time():
    gen = DynamicGenerator(engine=FakeEngine(), tokenizer=ByteTokenizer())
    gen.enqueue([Job(list(b"hello"), 6), Job(list(b"world!"), 4)])
    m0 = gen.metrics()
    assert m0["time_schedule_s"] == m0["time_engine_s"] == m0["time_results_s"] == 0.0
    drain(gen)
    m = gen.metrics()
    assert m["time_schedule_s"] > 0 and m["time_engine_s"] > 0 and m["time_results_s"] > 0
    assert not any(k.startswith("time_engine_") and k != "time_engine_s" for k in m)  # the fake has no timers
    gen.engine.timings = {"wait_s": 1.5}
    assert gen.metrics()["time_engine_wait_s"] == 1.5


def _multi_step_jobs():
    """A stop token mid-burst, a stop string, a length that is no multiple of 4, min_new_tokens, banned strings,
    probabilities: every reason a burst must stop or be skipped."""
    return [
        job("uvw", 3, identifier="banned", banned_strings=["xy"]),  # no bursts while it runs: it ends early
        job("abc", 30, identifier="plain"),
        job([1, 2, 3], 40, identifier="stop-token", stop_conditions=[17]),  # emits 4 .. 17: stops mid-burst
        job("Ahij", 25, identifier="stop-string", stop_conditions=["stu"]),
        # "t" is banned early; 125 comes up once min_new_tokens are out, mid-way through what would be a burst
        job("pqr", 23, identifier="min-new", min_new_tokens=9, stop_conditions=[ord("t"), 125]),
        job("ABC", 21, identifier="probs", return_probs=True, return_top_tokens=2),
    ]


MULTI_STEP_COMPLETIONS = {
    "banned": "yz{",  # "xy" is rewound: 'x' banned at its position, the fake takes 'y'
    "plain": "defghijklmnopqrstuvwxyz{|}~\x7f\ufffd\ufffd",  # bytes 0x80, 0x81 are not UTF-8
    "stop-token": bytes(range(4, 17)).decode(),
    "stop-string": "klmnopqr",
    "min-new": "suvwxyz{|",  # 't' banned until 9 tokens are out; then 125 ('}') stops it
    "probs": "DEFGHIJKLMNOPQRSTUVWX",
}


@pytest.mark.parametrize("max_batch_size", [2, 6])
def test_multi_step_decode_gives_the_same_results_in_fewer_engine_calls(max_batch_size):
    def run(steps):
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(max_batch_size=max_batch_size), decode_steps=steps)
        gen.enqueue(_multi_step_jobs())
        c = drain(gen)
        gen.pool.check()
        assert gen.pool.num_referenced == 0  # every page released
        return c, gen

    one, g1 = run(1)
    four, g4 = run(4)
    assert g1.engine.bursts == [] and set(g4.engine.bursts) == {4}
    engine_calls = len(g4.engine.calls) - sum(b - 1 for b in g4.engine.bursts)  # the fake records every step
    assert engine_calls < len(g1.engine.calls) - 10
    assert four.texts == one.texts
    for ident, final in one.finals.items():
        other = four.finals[ident]
        for key in ("eos_reason", "new_tokens", "full_completion", "held", "cached_tokens"):
            assert other[key] == final[key], (ident, key)
    tokens = lambda c: {i: [t for r in c.results if r["stage"] == "streaming" and r["identifier"] == i
                            for t in r["token_ids"]] for i in c.finals}
    assert tokens(four) == tokens(one)
    assert len(one.finals) == len(four.finals) == 6
    assert {i: f["full_completion"] for i, f in one.finals.items()} == MULTI_STEP_COMPLETIONS
    for c in (one, four):  # exact probabilities of every token, also those produced inside bursts
        assert assert_extras(c, "probs", 3, probs=True, top=2) == list(range(ord("D"), ord("D") + 21))
        assert assert_extras(c, "stop-string", 4) == list(b"klmnopqrstu")
    assert one.finals["stop-token"]["eos_reason"] == "stop_token" and one.finals["stop-string"]["eos_reason"] == \
        "stop_string"


def test_multi_step_decode_waits_for_admission_and_is_validated():
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(max_batch_size=2), decode_steps=4)
    gen.enqueue([job("abc", 9, identifier=1), job("def", 20, identifier=2), job("ghi", 6, identifier=3)])
    seen = []
    while gen.num_remaining_jobs():
        before = len(gen.engine.bursts)
        slot_free_for_waiting_job = bool(gen.pending) and len(gen.active) < gen.max_batch_size
        gen.iterate()
        seen.append((slot_free_for_waiting_job, len(gen.engine.bursts) > before))
    assert any(burst for _, burst in seen)  # bursts run while job 3 waits for a slot that is not free
    assert not any(free and burst for free, burst in seen)  # never once a slot frees: job 3 is admitted first
    with pytest.raises(ValueError, match="decode_steps"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(), decode_steps=0)


def test_generate_keeps_its_results_when_another_caller_steps_between_its_steps():
    """Another thread looping iterate() (here: a call before each of generate()'s own) steps generate()'s jobs too;
    their results reach generate(), never that caller (which had taken them: generate() lost tokens, or took its
    finished jobs for cancelled ones)."""
    alone = make()
    want = alone.generate(["abc", "xyz"], 20, gen_settings=SamplingSettings.greedy())
    gen = make(num_pages=40)
    gen.enqueue(job("o", 30, identifier="other"))
    iterate, seen = gen.iterate, []

    def another_caller_first():
        seen.extend(iterate())
        return iterate()

    gen.iterate = another_caller_first
    assert gen.generate(["abc", "xyz"], 20, gen_settings=SamplingSettings.greedy()) == want
    assert seen and {r["identifier"] for r in seen} == {"other"}
    gen.iterate = iterate
    rest = drain(gen).results
    text = "".join(r.get("text", "") for r in seen + rest if r["stage"] == "streaming")
    final = [r for r in rest if r["eos"]] or [r for r in seen if r["eos"]]
    assert len(final) == 1 and text == final[0]["full_completion"]  # the other caller's job: every token, once
    gen.pool.check({})


def test_no_result_of_a_job_after_its_cancel():
    """A failed step keeps the results it had produced (its jobs' "started") for the next iterate(); a job cancelled
    in between gets none of them (cancel() emits no result)."""
    gen = make()
    j = job("abc", 5, identifier="J")
    gen.enqueue(j)

    def fail_once(point):
        gen.fault_hook = None
        raise RuntimeError("a device error")

    gen.fault_hook = fail_once
    with pytest.raises(StepError):
        gen.iterate()
    gen.cancel(j)
    assert gen.iterate() == [] and gen.num_remaining_jobs() == 0
    gen.pool.check({})
