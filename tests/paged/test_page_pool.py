"""Page-pool invariants under long random sequences of enqueue / cancel / iterate (hypothesis), plus unit checks
of hashing, collisions and LRU."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged import Job, SamplingSettings
from paged.page_pool import PagePool, chain_hashes
from tests.paged.fakes import ByteTokenizer, FakeEngine

TOK = ByteTokenizer()


def held_refs(gen) -> dict[int, int]:
    refs: dict[int, int] = {}
    for j in gen.active:
        for p in j.pages:
            refs[p] = refs.get(p, 0) + 1
    return refs


ops = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.sampled_from(["", "AAAAAAAA", "AAAAAAAABBBBBBBB", "CCCCCCCCCCCCCCCC"]),
                  st.text(alphabet="abc", min_size=1, max_size=12), st.integers(1, 12), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("iterate"), st.integers(1, 4)),
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, page_size=st.sampled_from([4, 8]), num_pages=st.integers(8, 24))
def test_pool_invariants_hold_under_random_operations(ops, page_size, num_pages):
    from paged import DynamicGenerator

    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=num_pages, page_size=page_size,
                                                            max_batch_size=3, max_chunk_size=8, max_seq_len=64))
    jobs = []
    for op in ops:
        if op[0] == "enqueue":
            _, prefix, suffix, n, ban = op
            # the fake emits last+1, so "...a" continues "bcd...": banning "cd" forces rewinds
            j = Job(TOK.encode(prefix + suffix), n, gen_settings=SamplingSettings.greedy(),
                    banned_strings=["cd"] if ban else None)
            try:
                gen.enqueue(j)
                jobs.append(j)
            except ValueError:
                pass  # too large for this pool: rejected without side effects
        elif op[0] == "cancel" and jobs:
            gen.cancel(jobs[op[1] % len(jobs)])
        else:
            for _ in range(op[1]):
                gen.iterate()
        gen.pool.check(held_refs(gen))
        # every active job's written context is what the cache holds for it (shared pages included)
        eng = gen.engine
        for j in gen.active:
            for pos in range(j.kv_position):
                page = j.pages[pos // page_size]
                assert eng.written[(page, pos % page_size)] == j.sequence[pos], (j, pos)
    while gen.num_remaining_jobs():
        gen.iterate()
    gen.pool.check({})
    assert gen.pool.num_referenced == 0


def test_chain_hash_depends_on_the_whole_prefix():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = chain_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert a[0] != b[0] and a[1] != b[1]  # same second page, different prefix -> different hash


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
