"""Embedding injection (`paged.embeddings`): vectors in place of token embeddings, in the batched paged step, with
the prompt cache telling images apart by content."""

from __future__ import annotations

import numpy as np
import pytest

from paged import DynamicGenerator, Job, MMEmbedding, SamplingSettings
from paged.device.engine import count_compiles
from paged.embeddings import RESERVED_ID_BASE, encode_with_embeddings
from paged.errors import InvalidJobError
from paged.testing import ByteTokenizer, FakeEngine, drain, tiny_config, tiny_model

TOK = ByteTokenizer()
CFG = tiny_config(TOK.vocab_size, max_position_embeddings=256)
MODEL = tiny_model(CFG, seed=5, tokenizer=TOK)
GEN = dict(num_pages=48, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=96, max_embedding_tokens=32)
GREEDY = SamplingSettings.greedy()
RNG = np.random.default_rng(0)
TEXT = list(RNG.integers(0, 256, size=40))


def rows_of(ids) -> np.ndarray:
    """The model's own embedding rows of `ids`."""
    return np.asarray(MODEL.params.embed)[np.asarray(ids)]


def tokens(c, ident):
    return [t for r in c.results if r["identifier"] == ident for t in r.get("token_ids", [])]


def probs(c, ident):
    return [p for r in c.results if r["identifier"] == ident for p in r.get("token_probs", [])]


@pytest.mark.slow
def test_the_models_own_rows_give_exactly_the_token_output():
    """Rows 10..17 of a prompt replaced by their own embedding vectors: the same tokens and probabilities, in a
    batch with plain jobs, sampled as well as greedy."""
    g = DynamicGenerator(MODEL, **GEN)
    emb = MMEmbedding(rows_of(TEXT[10:18]))
    with_emb = TEXT[:10] + emb.token_ids + TEXT[18:]
    sampled = SamplingSettings(temperature=0.9, top_k=20, top_p=0.9)
    g.enqueue([Job(TEXT, 10, gen_settings=GREEDY, identifier="plain", return_probs=True),
               Job(with_emb, 10, gen_settings=GREEDY, identifier="emb", embeddings=[emb], return_probs=True),
               Job(TEXT[3:30], 10, gen_settings=sampled, seed=4, identifier="plain-s"),
               Job(with_emb[3:30], 10, gen_settings=sampled, seed=4, identifier="emb-s", embeddings=[emb]),
               Job(TEXT[5:25], 6, gen_settings=GREEDY, identifier="other")])
    c = drain(g)
    g.pool.check({})
    assert tokens(c, "emb") == tokens(c, "plain") and len(tokens(c, "plain")) == 10
    np.testing.assert_allclose(probs(c, "emb"), probs(c, "plain"), rtol=1e-5)
    assert tokens(c, "emb-s") == tokens(c, "plain-s")
    assert not g.embedding_slots.users  # every job let go of its block


def test_other_vectors_change_the_output():
    g = DynamicGenerator(MODEL, **GEN)
    emb = MMEmbedding(rows_of(TEXT[10:18]) + RNG.normal(0, 1.0, size=(8, CFG.hidden_size)))
    g.enqueue([Job(TEXT, 2, gen_settings=GREEDY, identifier="plain", return_logits=True),
               Job(TEXT[:10] + emb.token_ids + TEXT[18:], 2, gen_settings=GREEDY, identifier="emb",
                   embeddings=[emb], return_logits=True)])
    c = drain(g)
    logits = {i: np.concatenate([np.asarray(r["logits"]).reshape(-1, CFG.vocab_size) for r in c.results
                                 if r["identifier"] == i and "logits" in r]) for i in ("plain", "emb")}
    # the random tiny model barely attends far back: 1e-4 is still ~1000x the float noise of the identity above
    assert np.max(np.abs(logits["emb"][0] - logits["plain"][0])) > 1e-4


def test_after_warmup_an_embedding_job_compiles_nothing_nor_do_the_jobs_after_it():
    """Writing vectors into the table keeps it placed as warmup() compiled for: it had become a "committed" array
    (device_put with its sharding), and every step program then compiled again, for every job after it."""
    g = DynamicGenerator(MODEL, **GEN)
    g.warmup()
    before = count_compiles()
    emb = MMEmbedding(RNG.normal(0, 1.0, size=(3, CFG.hidden_size)))
    g.enqueue(Job(TEXT[:5] + emb.token_ids + TEXT[5:9], 4, gen_settings=GREEDY, embeddings=[emb]))
    drain(g)
    g.enqueue([Job(TEXT[:20], 4, gen_settings=GREEDY), Job(TEXT[20:23], 4, gen_settings=GREEDY)])
    drain(g)
    assert count_compiles() == before


def test_the_same_image_shares_cached_pages_and_another_does_not():
    """Page hashes are over token ids, and a block's ids come from its content: the same vectors (even a new
    MMEmbedding object) hit the prompt cache through the image; other vectors miss from the image's page on."""
    x = RNG.normal(size=(8, CFG.hidden_size)).astype(np.float32)
    y = x + 0.25
    prompt = lambda e: TEXT[:16] + e.token_ids + TEXT[16:26]  # noqa: E731 (pages: text, text, image, text...)
    g = DynamicGenerator(MODEL, **GEN)
    first = MMEmbedding(x)
    g.enqueue(Job(prompt(first), 6, gen_settings=GREEDY, identifier="a", embeddings=[first]))
    a = drain(g)
    again = MMEmbedding(x.copy())
    assert again.token_ids == first.token_ids
    other = MMEmbedding(y)
    assert set(other.token_ids).isdisjoint(first.token_ids) and min(other.token_ids) >= RESERVED_ID_BASE
    g.enqueue(Job(prompt(again), 6, gen_settings=GREEDY, identifier="b", embeddings=[again]))
    b = drain(g)
    g.enqueue(Job(prompt(other), 6, gen_settings=GREEDY, identifier="c", embeddings=[other]))
    c = drain(g)
    assert b.finals["b"]["cached_tokens"] >= 24 and tokens(b, "b") == tokens(a, "a")
    assert c.finals["c"]["cached_tokens"] == 16  # the two text pages only
    fresh = DynamicGenerator(MODEL, **GEN)  # no cache at all: the same output as the cache-miss run
    fresh.enqueue(Job(prompt(other), 6, gen_settings=GREEDY, identifier="c", embeddings=[other]))
    assert tokens(drain(fresh), "c") == tokens(c, "c")


def test_table_rows_are_reused_and_exhaustion_is_a_clear_error():
    g = DynamicGenerator(MODEL, **{**GEN, "max_embedding_tokens": 16})
    blocks = [MMEmbedding(RNG.normal(size=(6, CFG.hidden_size))) for _ in range(4)]
    jobs = [Job(TEXT[:4] + e.token_ids, 3, gen_settings=GREEDY, identifier=i, embeddings=[e])
            for i, e in enumerate(blocks)]
    with pytest.raises(InvalidJobError, match="max_embedding_tokens"):
        g.enqueue(jobs[:3])  # 18 rows at once do not fit 16
    assert not g.pending and not g.embedding_slots.users
    outs = {}
    for j in jobs:  # one at a time they do: finished blocks are evicted least recently used
        g.enqueue(j)
        outs[j.identifier] = tokens(drain(g), j.identifier)
    for i, e in enumerate(blocks):  # each matches a fresh generator's output: no row was overwritten in use
        fresh = DynamicGenerator(MODEL, **GEN)
        fresh.enqueue(Job(TEXT[:4] + e.token_ids, 3, gen_settings=GREEDY, identifier=i, embeddings=[e]))
        assert tokens(drain(fresh), i) == outs[i]
    pending = Job(TEXT[:4] + blocks[0].token_ids, 3, gen_settings=GREEDY, embeddings=[blocks[0]])
    g.enqueue(pending)
    g.cancel(pending)  # a cancelled pending job lets go of its block too
    assert not g.embedding_slots.users


def test_held_blocks_are_never_evicted_and_resident_ones_not_rewritten():
    g = DynamicGenerator(MODEL, **{**GEN, "max_embedding_tokens": 12})
    loads = []
    real = g.engine.load_embeddings
    g.engine.load_embeddings = lambda rows, v: loads.append(len(rows)) or real(rows, v)
    a, b, c = (MMEmbedding(RNG.normal(size=(6, CFG.hidden_size))) for _ in range(3))
    job = lambda e, i, n=12: Job(TEXT[:5] + e.token_ids, n, gen_settings=GREEDY, identifier=i, embeddings=[e])  # noqa: E731
    g.enqueue([job(a, "a"), job(b, "b")])
    g.iterate()
    with pytest.raises(InvalidJobError, match="max_embedding_tokens"):
        g.enqueue(job(c, "c"))  # both blocks are held: no room
    out = drain(g)
    g.enqueue(job(c, "c"))  # a and b are idle now: c evicts the least recently used one
    g.enqueue(job(MMEmbedding(b.embeddings.copy()), "b2"))  # b is still resident: not written again
    out2 = drain(g)
    assert loads == [6, 6, 6]
    assert tokens(out2, "b2") == tokens(out, "b")
    fresh = DynamicGenerator(MODEL, **GEN)
    fresh.enqueue(job(c, "c"))
    assert tokens(drain(fresh), "c") == tokens(out2, "c")


def test_text_alias_in_generate_and_compat():
    g = DynamicGenerator(MODEL, tokenizer=TOK, **GEN)
    emb = MMEmbedding(rows_of(TOK.encode("xyz")), text_alias="<image>")
    assert encode_with_embeddings(TOK, "ab<image>cd", [emb]) == TOK.encode("ab") + emb.token_ids + TOK.encode("cd")
    longer = MMEmbedding(rows_of(TOK.encode("Q")), text_alias="<image>2")  # starts like "<image>": longest wins
    assert encode_with_embeddings(TOK, "<image>2<image>", [emb, longer]) == longer.token_ids + emb.token_ids
    with pytest.raises(InvalidJobError, match="share the text alias"):
        encode_with_embeddings(TOK, "x", [emb, MMEmbedding(np.ones((1, CFG.hidden_size)), text_alias="<image>")])
    got = g.generate("ab<image>cd<image>", 8, gen_settings=GREEDY, embeddings=[emb])
    want = g.generate("abxyzcdxyz", 8, gen_settings=GREEDY)
    assert got == want != ""
    assert g.generate("ab<image>cd<image>", 8, gen_settings=GREEDY, embeddings=emb) == got  # one, as Job takes it
    from paged.compat import ExLlamaV2DynamicGenerator, ExLlamaV2MMEmbedding

    compat = ExLlamaV2DynamicGenerator(MODEL, None, TOK, **{k: v for k, v in GEN.items() if k != "max_batch_size"})
    e2 = ExLlamaV2MMEmbedding(MODEL, embeddings=rows_of(TOK.encode("xyz")), text_alias="{{img}}")
    assert compat.generate("ab{{img}}cd", 5, completion_only=True, gen_settings=compat_greedy(),
                           embeddings=[e2]) == g.generate("abxyzcd", 5, gen_settings=GREEDY)


def compat_greedy():
    from paged.compat import ExLlamaV2Sampler

    return ExLlamaV2Sampler.Settings.greedy()


def test_speculation_leaves_embedding_jobs_undrafted():
    emb = MMEmbedding(rows_of(TEXT[10:18]))
    prompt = TEXT[:10] + emb.token_ids + TEXT[:10] + emb.token_ids  # repeats: prompt lookup would propose ids
    ref = DynamicGenerator(MODEL, **GEN)
    ref.enqueue(Job(prompt, 8, gen_settings=GREEDY, identifier="e", embeddings=[emb]))
    want = tokens(drain(ref), "e")
    g = DynamicGenerator(MODEL, use_ngram_draft=True, num_draft_tokens=3, max_ngram=3, **GEN)
    job = Job(prompt, 8, gen_settings=GREEDY, identifier="e", embeddings=[emb])
    g.enqueue(job)
    assert tokens(drain(g), "e") == want and job.drafted_tokens == 0


def test_invalid_embeddings():
    g = DynamicGenerator(MODEL, **GEN)
    emb = MMEmbedding(np.zeros((3, CFG.hidden_size)))
    with pytest.raises(InvalidJobError, match="hidden size"):
        g.enqueue(Job([1, *MMEmbedding(np.ones((2, 7))).token_ids], 3,
                      embeddings=[MMEmbedding(np.ones((2, 7)))]))
    with pytest.raises(InvalidJobError, match="vocabulary size"):
        g.enqueue(Job([1, *emb.token_ids], 3))  # reserved ids without their embedding
    with pytest.raises(InvalidJobError, match="token healing"):
        g.enqueue(Job([1, *emb.token_ids], 3, embeddings=[emb], token_healing=True))
    with pytest.raises(InvalidJobError, match="max_embedding_tokens=0"):
        DynamicGenerator(MODEL, **{**GEN, "max_embedding_tokens": 0}).enqueue(
            Job([1, *emb.token_ids], 3, embeddings=[emb]))
    with pytest.raises(InvalidJobError, match="embedding table"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=16)).enqueue(
            Job([1, *emb.token_ids], 3, embeddings=[emb]))
    for bad, match in (([1, 2, 3], r"shape \[n >= 1, hidden\]"), (np.full((2, 4), np.nan), "NaN"),
                       (np.zeros((0, 4)), "shape"), (np.ones((2, 4), complex), "dtype is complex128"),
                       (np.ones((2, 4), bool), "dtype is bool"), ([["a", "b"]], "dtype is <U1")):
        with pytest.raises(InvalidJobError, match=match):
            MMEmbedding(bad)
    with pytest.raises(InvalidJobError, match="MMEmbedding"):
        Job([1], 3, embeddings=["image"])
    assert not g.pending
    import ml_dtypes

    assert MMEmbedding(np.ones((2, 4), ml_dtypes.bfloat16)).embeddings.dtype == np.float32  # bf16 is a float
    # a block the prompt does not use holds no table rows (it had taken 30 of 32, refusing the next job's 5)
    small = DynamicGenerator(MODEL, **{**GEN, "max_embedding_tokens": 32})
    unused = MMEmbedding(RNG.normal(size=(30, CFG.hidden_size)))
    used = MMEmbedding(RNG.normal(size=(5, CFG.hidden_size)))
    plain = Job(TEXT[:5], 2, gen_settings=GREEDY, embeddings=[unused])
    assert plain.embeddings == []
    assert Job([1, used.token_ids[3]], 2, embeddings=[used]).embeddings == [used]  # one of its ids is a use
    small.enqueue([plain, Job([1, *used.token_ids], 2, gen_settings=GREEDY, embeddings=[unused, used])])
    drain(small)
    small.pool.check({})


def test_enqueue_is_all_or_nothing_whatever_raises():
    """A clock that raises on its n-th call, or the embedding table's device write failing on the second block:
    `enqueue([a, b])` either queues both or neither, and no embedding row stays held (a clock failing on its second
    call had left `a` queued and `b`'s rows held forever)."""
    emb, emb2 = MMEmbedding(RNG.normal(size=(3, CFG.hidden_size))), MMEmbedding(RNG.normal(size=(2, CFG.hidden_size)))

    def pair():
        return [Job(TEXT[:5], 3, gen_settings=GREEDY, identifier="a"),
                Job(TEXT[:4] + emb.token_ids, 3, gen_settings=GREEDY, identifier="b", embeddings=[emb])]

    def clean(g, jobs):
        assert not g.pending and not g.embedding_slots.users and all(j.serial is None for j in jobs)

    for fail_on in (1, 2, 3):
        calls = [0]

        def clock(calls=calls, fail_on=fail_on):
            calls[0] += 1
            if calls[0] == fail_on:
                raise RuntimeError("clock lost")
            return float(calls[0])

        g = DynamicGenerator(MODEL, **GEN, clock=clock)
        jobs = pair()
        try:
            g.enqueue(jobs)
        except RuntimeError as e:
            assert str(e) == "clock lost"
            clean(g, jobs)
            jobs = pair()
            g.enqueue(jobs)  # usable: the same list goes in whole
        assert [j.identifier for j in g.pending] == ["a", "b"] and g.embedding_slots.users
        assert len({j.time_enqueue for j in jobs}) == 1  # one enqueue time for the list

    g = DynamicGenerator(MODEL, **GEN)
    write = g.engine.load_embeddings
    writes = [0]

    def failing_write(rows, vectors):
        writes[0] += 1
        if writes[0] == 2:
            raise RuntimeError("device write failed")
        write(rows, vectors)

    g.engine.load_embeddings = failing_write
    jobs = [Job(TEXT[:4] + e.token_ids, 3, gen_settings=GREEDY, identifier=i, embeddings=[e])
            for i, e in enumerate((emb, emb2))]
    with pytest.raises(RuntimeError, match="device write failed"):
        g.enqueue(jobs)
    clean(g, jobs)
    assert all(not j.embedding_rows for j in jobs)
    g.enqueue(jobs := [Job(TEXT[:4] + e.token_ids, 3, gen_settings=GREEDY, identifier=i, embeddings=[e])
                       for i, e in enumerate((emb, emb2))])
    assert sorted(drain(g).finals) == [0, 1] and not g.embedding_slots.users and g.pool.num_referenced == 0


@pytest.mark.real_weights
def test_smollm2_its_own_embedding_rows_give_the_same_reply():
    """On the real (Q4_1, tied, quantized-embedding) model: three prompt tokens given as their own dequantized
    embedding rows give the token-for-token reply of the text."""
    import jax.numpy as jnp

    from models import load_model
    from models.llama import embed_tokens

    model = load_model("smollm2-135m")
    g = DynamicGenerator(model, max_batch_size=2, max_seq_len=256)
    ids = model.tokenizer.encode("The capital of France is a city called")
    emb = MMEmbedding(np.asarray(embed_tokens(model.params, jnp.asarray(ids[2:5]))))
    g.enqueue([Job(ids, 12, gen_settings=GREEDY, identifier="text"),
               Job(ids[:2] + emb.token_ids + ids[5:], 12, gen_settings=GREEDY, identifier="emb", embeddings=[emb])])
    c = drain(g)
    assert tokens(c, "emb") == tokens(c, "text") and len(tokens(c, "text")) == 12
