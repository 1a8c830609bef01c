"""Page-pool invariants under long random sequences of enqueue / cancel / iterate (hypothesis), plus unit checks
of hashing, collisions and LRU."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged import Job, SamplingSettings
from paged.errors import JobTooLargeError
from paged.host.page_pool import PagePool, chain_hashes
from paged.testing import ByteTokenizer, FakeEngine, page_refs

TOK = ByteTokenizer()


def fake_completion(prompt: list[int], n: int, ban_cd: bool) -> list[int]:
    """What the fake engine emits: last token + 1, n times. With "cd" banned, a 'c' that a 'd' follows is rewound
    and banned at its position, so the fake takes the next id, 'd', there; a 'c' that is the job's last token stays
    (the job ends before anything can follow it)."""
    out, last = [], prompt[-1]
    while len(out) < n:
        t = (last + 1) % TOK.vocab_size
        if ban_cd and t == ord("c") and len(out) < n - 1:
            t = ord("d")
        out.append(t)
        last = t
    return out


ops = st.lists(
    st.one_of(
        # the 40-token prefix makes jobs that can never fit the smaller pools (rejected at enqueue)
        st.tuples(st.just("enqueue"),
                  st.sampled_from(["", "AAAAAAAA", "AAAAAAAABBBBBBBB", "CCCCCCCCCCCCCCCC", "D" * 40]),
                  st.text(alphabet="abc", min_size=1, max_size=12), st.integers(1, 12), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("iterate"), st.integers(1, 4)),
    ),
    min_size=1, max_size=60,
)


def run_random_operations(ops, page_size, num_pages, totals: Counter) -> None:
    """Apply `ops`; after every operation and every iterate the pool's reference counts are exactly those of the
    live jobs and every job's cache holds its sequence. Every job that was not cancelled finishes with exactly the
    fake's tokens; a cancelled one emits nothing more."""
    from paged import DynamicGenerator

    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=num_pages, page_size=page_size,
                                                            max_batch_size=3, max_chunk_size=8, max_seq_len=64))
    jobs: list[Job] = []
    cancelled: set[int] = set()
    tokens: dict[int, list[int]] = {}
    started: set[int] = set()
    finals: dict[int, dict] = {}

    def check():
        gen.pool.check(page_refs(gen))
        for j in gen.active:  # every active job's written context is what the cache holds (shared pages too)
            for pos in range(j.kv_position):
                page = j.pages[pos // page_size]
                assert gen.engine.written[(page, pos % page_size)] == j.sequence[pos], (j, pos)

    def iterate():
        for r in gen.iterate():
            i = r["identifier"]
            assert i not in cancelled and i not in finals, r  # nothing after a cancel or the final result
            if r["stage"] == "started":
                started.add(i)
            if r["stage"] == "streaming":
                assert i in started
                tokens[i] = tokens.get(i, []) + r["token_ids"]
                totals["rewinds"] += bool(r.get("suppressed_text"))
            if r["eos"]:
                finals[i] = r
        check()

    for op in ops:
        if op[0] == "enqueue":
            _, prefix, suffix, n, ban = op
            # the fake emits last+1, so "...a" continues "bcd...": banning "cd" forces rewinds
            j = Job(TOK.encode(prefix + suffix), n, gen_settings=SamplingSettings.greedy(),
                    banned_strings=["cd"] if ban else None, identifier=len(jobs))
            if -(-(j.prompt_len + n) // page_size) > gen.pool.num_pages:  # can never fit: rejected, nothing queued
                with pytest.raises(JobTooLargeError, match="pages"):
                    gen.enqueue(j)
                assert j not in gen.pending
                totals["rejected"] += 1
            else:
                gen.enqueue(j)
                jobs.append(j)
        elif op[0] == "cancel" and jobs:
            j = jobs[op[1] % len(jobs)]
            if j.identifier not in finals and j.identifier not in cancelled:
                totals["cancelled_running" if j in gen.active else "cancelled_queued"] += 1
                cancelled.add(j.identifier)
            gen.cancel(j)
        else:
            for _ in range(op[1]):
                iterate()
        check()
    for _ in range(1000):
        if not gen.num_remaining_jobs():
            break
        iterate()
    assert gen.num_remaining_jobs() == 0
    gen.pool.check({})
    assert gen.pool.num_referenced == 0
    for j in jobs:
        i = j.identifier
        if i in cancelled:
            continue
        f = finals[i]
        assert f["eos_reason"] == "max_new_tokens" and f["new_tokens"] == j.max_new_tokens
        want = fake_completion(j.input_ids, j.max_new_tokens, bool(j.banned_strings))
        assert tokens[i] == want, (j, tokens[i], want)
        assert f["full_completion"] == TOK.decode(want)
        totals["finished"] += 1
        totals["finished_banned"] += bool(j.banned_strings)
        totals["cached_tokens"] += f["cached_tokens"]


def test_pool_invariants_hold_under_random_operations():
    totals: Counter = Counter()

    @settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(ops=ops, page_size=st.sampled_from([4, 8]), num_pages=st.integers(8, 24))
    def check(ops, page_size, num_pages):
        run_random_operations(ops, page_size, num_pages, totals)

    check()
    # the examples really exercised admission, decoding, rewinds, prefix sharing, rejection and cancellation
    assert totals["finished"] >= 60 and totals["finished_banned"] >= 30 and totals["rewinds"] >= 10, totals
    assert totals["cached_tokens"] > 0 and totals["rejected"] >= 5, totals
    assert totals["cancelled_running"] >= 8 and totals["cancelled_queued"] >= 15, totals


def test_chain_hash_depends_on_the_whole_prefix():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = chain_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert a[0] != b[0] and a[1] != b[1]  # same second page, different prefix -> different hash


def test_chain_hash_depends_on_the_root():
    """The root (a LoRA adapter's digest) enters every page's hash, not only the first's: the same tokens under
    another root, or none, share no page."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    plain, a, b = (chain_hashes(tokens, 4, 2, root=r) for r in (b"", b"adapter-a", b"adapter-b"))
    for i in range(2):
        assert len({plain[i], a[i], b[i]}) == 3, i
    assert chain_hashes(tokens, 4, 2, root=b"adapter-a") == a  # deterministic
    # a later page differs even where the earlier page's hash were equal: the root is mixed in at each page
    assert chain_hashes(tokens[4:], 4, 1, prev=a[0], root=b"adapter-b") != chain_hashes(tokens[4:], 4, 1, prev=a[0],
                                                                                         root=b"adapter-a")


def test_hash_collision_is_caught_by_token_verification():
    pool = PagePool(8, 4)
    h = chain_hashes([1, 2, 3, 4], 4, 1)
    pages, complete = pool.allocate(h, [(1, 2, 3, 4)], 2)
    pool.mark_filled(pages[0], 4)
    # a different sequence that (by construction) claims the same hash must not get the page
    forged_tokens = [(9, 9, 9, 9)]
    assert pool.match(h, forged_tokens) == []
    pages2, complete2 = pool.allocate(h, forged_tokens, 2)
    assert pages2[0] != pages[0] and complete2 == 0
    pool.check()


def test_pending_pages_are_shared_but_not_reported_complete():
    pool = PagePool(8, 4)
    h = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    toks = [(1, 2, 3, 4), (5, 6, 7, 8)]
    p1, c1 = pool.allocate(h, toks, 3)
    p2, c2 = pool.allocate(h, toks, 3)
    assert p1[:2] == p2[:2] and c1 == c2 == 0
    pool.mark_filled(p1[0], 4)
    p3, c3 = pool.allocate(h, toks, 3)
    assert c3 == 1
    pool.release(p1)
    pool.release(p2)
    pool.release(p3)
    pool.check({})
    assert pool.num_cached == 1  # only the complete page survives as prompt cache


def test_allocate_many_references_every_hit_before_taking_fresh_pages():
    """Two page lists admitted together (a CFG job's prompts): the second hits the least recently used cached page
    and the first needs fresh pages beyond the free ones; allocated one after the other, the first would evict the
    second's hit."""
    pool = PagePool(5, 4)  # 4 usable pages
    hx, hy = chain_hashes([1, 2, 3, 4], 4, 1), chain_hashes([5, 6, 7, 8], 4, 1)
    x, _ = pool.allocate(hx, [(1, 2, 3, 4)], 1)
    y, _ = pool.allocate(hy, [(5, 6, 7, 8)], 1)
    for p in (x, y):
        pool.mark_filled(p[0], 4)
        pool.release(p)  # cached, evictable; x least recently used
    requests = [([], [], 3), (hx, [(1, 2, 3, 4)], 1)]
    assert pool.pages_needed_many(requests) == 4 == pool.available
    (a, _), (b, complete) = pool.allocate_many(requests)
    assert b == x and complete == 1 and y[0] in a  # y was evicted, not x
    pool.release(a)
    pool.release(b)
    pool.check({})
    # one cached page hit by both lists is revived once
    both = [(hx, [(1, 2, 3, 4)], 2), (hx, [(1, 2, 3, 4)], 2)]
    assert pool.pages_needed_many(both) == 1 + 1 + 1
