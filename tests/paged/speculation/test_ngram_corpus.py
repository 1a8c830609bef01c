"""The n-gram drafter's corpus table (`paged.speculation.ngram_corpus`): building, chained proposals, files, the
combined drafter, and a generator given `ngram_corpus=` (output unchanged, drafts taken from the table)."""

from __future__ import annotations

import numpy as np
import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.errors import InvalidConfigError, InvalidConfigTypeError
from paged.speculation.ngram import NgramIndex, replay
from paged.speculation.ngram_corpus import (
    FORMAT,
    NgramCorpus,
    NgramCorpusError,
    corpus_class,
    load_corpus,
    propose_lookup,
)
from paged.testing import ByteTokenizer, FakeEngine, drain, verification_for

TOK = ByteTokenizer()


def test_build_keeps_each_contexts_most_frequent_continuation():
    seqs = [[1, 2, 3, 1, 2, 3, 1, 2, 4], [1, 2, 3], [7, 1, 2]]
    c = NgramCorpus.build(seqs, 10, min_ngram=2, max_ngram=3, min_count=1)
    two, three = c.entries(2), c.entries(3)
    assert two[(1, 2)] == (3, 3, 4)  # (1, 2) -> 3 three times, 4 once
    assert three[(3, 1, 2)] == (3, 1, 2)  # 3 and 4 once each: the tie goes to the smaller id
    assert two[(2, 3)] == (1, 2, 2)
    assert (3, 7) not in two  # no context crosses from one sequence into the next
    assert (7, 1) in two and c.corpus_tokens == 15
    assert set(c.arrays) == {2, 3} and c.entries(1) == {} and len(c) == len(two) + len(three)
    pruned = NgramCorpus.build(seqs, 10, min_ngram=2, max_ngram=3, min_count=2)
    assert (3, 1, 2) not in pruned.entries(3) and pruned.entries(2)[(1, 2)] == (3, 3, 4)
    assert len(pruned) < len(c)
    # every context is found through the hashed index, with its own order and confidence
    for n, table in ((2, two), (3, three)):
        for ctx, (tok, count, total) in table.items():
            hit = c.lookup(list(ctx))
            assert hit == (tok, count / total, n), ctx
    assert c.lookup([9, 9]) is None and c.lookup([2]) is None  # unseen; shorter than min_ngram


def test_large_counts_keep_their_confidence():
    """Counts past the packed width are scaled down together: the confidence stays within 1e-6."""
    ctx = np.asarray([[1, 2]], np.int32)
    c = NgramCorpus({2: (ctx, np.asarray([[5, 3_000_000, 9_000_001]], np.int64))}, 10, 2, 2, 1, 0)
    tok, conf, n = c.lookup([1, 2])
    assert (tok, n) == (5, 2) and conf == pytest.approx(3_000_000 / 9_000_001, abs=1e-6)
    with pytest.raises(NgramCorpusError, match="count <= total"):
        NgramCorpus({2: (ctx, np.asarray([[5, 4, 3]], np.int64))}, 10, 2, 2, 1, 0)
    with pytest.raises(NgramCorpusError, match="orders 2..3"):
        NgramCorpus({2: (ctx, np.asarray([[5, 1, 1]], np.int64))}, 10, 2, 3, 1, 0)
    with pytest.raises(NgramCorpusError, match="vocab_size"):
        NgramCorpus({2: (ctx, np.asarray([[5, 1, 1]], np.int64))}, 1 << 21, 2, 2, 1, 0)
    with pytest.raises(NgramCorpusError, match="2 contexts of 2 tokens but 1 value rows"):
        NgramCorpus({2: (np.asarray([[1, 2], [3, 4]]), np.asarray([[5, 1, 1]]))}, 10, 2, 2, 1, 0)
    with pytest.raises(NgramCorpusError, match="outside the vocabulary"):  # checked before any narrowing cast
        NgramCorpus({2: (np.asarray([[1, 2 + (1 << 32)]]), np.asarray([[5, 1, 1]]))}, 10, 2, 2, 1, 0)
    with pytest.raises(NgramCorpusError, match="integer arrays"):
        NgramCorpus({2: (np.asarray([[1.0, 2.0]]), np.asarray([[5, 1, 1]]))}, 10, 2, 2, 1, 0)
    assert c.lookup(np.asarray([1, 2], np.int64))[0] == 5  # numpy token ids too


def test_build_rejects_what_it_cannot_use():
    with pytest.raises(NgramCorpusError, match="outside the vocabulary of 10"):
        NgramCorpus.build([[1, 2, 10]], 10)
    with pytest.raises(NgramCorpusError, match="min_count"):
        NgramCorpus.build([[1, 2]], 10, min_count=0)
    with pytest.raises(NgramCorpusError, match="min_ngram"):
        NgramCorpus.build([[1, 2]], 10, min_ngram=3, max_ngram=2)
    with pytest.raises(NgramCorpusError, match="max_ngram <= 64"):  # before counting, not after
        NgramCorpus.build(iter_fails_if_read(), 10, max_ngram=65)
    with pytest.raises(NgramCorpusError, match="integers, got 1.5"):  # not cut to 1
        NgramCorpus.build([[1, 2, 1.5]], 10)
    with pytest.raises(NgramCorpusError, match="integers, got 1.5"):  # the same from a sequence read once
        NgramCorpus.build([iter([1, 2, 1.5])], 10)
    with pytest.raises(NgramCorpusError, match="integers, got True"):
        NgramCorpus.build([[1, 2, True]], 10)
    assert NgramCorpus.build([np.array([1, 2, 3] * 2), [np.int32(1), 2, 3]], 10).entries(2)[(1, 2)] == (3, 3, 3)


def iter_fails_if_read():
    raise AssertionError("read the sequences")
    yield []


def test_proposals_chain_the_longest_context_and_stop_at_low_confidence():
    # after (5, 6): 7 always; after (6, 7): 8 twice, 9 once; after (5, 6, 7): 9 twice (longer wins over (6, 7))
    seqs = [[5, 6, 7, 9, 1], [5, 6, 7, 9, 1], [0, 6, 7, 8], [4, 6, 7, 8], [3, 6, 7, 8], [2, 6, 7, 9]]
    c = NgramCorpus.build(seqs, 10, min_ngram=2, max_ngram=3, min_count=1, min_confidence=0.0)
    assert c.lookup([5, 6, 7]) == (9, 1.0, 3)
    assert c.lookup([0, 6, 7]) == (8, 1.0, 3)
    assert c.lookup([1, 6, 7]) == (8, 3 / 6, 2)  # (1, 6, 7) unseen: (6, 7) -> 8 or 9, three times each
    assert c.propose([5, 6], 4) == ([7, 9, 1], 1.0)  # (5, 6) -> 7, (5, 6, 7) -> 9, (6, 7, 9) -> 1, then no context
    assert c.propose([5, 6], 2) == ([7, 9], 1.0)
    assert c.propose([1, 6, 7], 1) == ([8], 0.5)
    assert c.propose([8, 8], 3) == ([], 0.0)  # no context matches
    picky = NgramCorpus.build(seqs, 10, min_ngram=2, max_ngram=3, min_count=1, min_confidence=0.6)
    assert picky.propose([1, 6, 7], 3) == ([], 0.0)  # 0.5 < 0.6 at once
    assert picky.propose([5, 6], 4) == ([7, 9, 1], 1.0)


def test_save_and_load(tmp_path):
    c = NgramCorpus.build([[1, 2, 3, 1, 2, 3, 1, 2, 4]] * 2, 10, min_ngram=2, max_ngram=4, min_confidence=0.25)
    path = tmp_path / "table"  # no .npz: the name is kept as given
    c.save(path)
    got = NgramCorpus.load(path)
    assert all(got.entries(n) == c.entries(n) for n in (2, 3, 4)) and got.min_confidence == 0.25
    assert (got.vocab_size, got.min_ngram, got.max_ngram, got.min_count, got.corpus_tokens) == (10, 2, 4, 2, 18)
    assert NgramCorpus.load(str(path), min_confidence=0.9).min_confidence == 0.9
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(NgramCorpusError, match="not a corpus"):
        NgramCorpus.load(tmp_path / "other.npz")
    with pytest.raises(NgramCorpusError, match="cannot read"):
        NgramCorpus.load(tmp_path / "missing.npz")
    (tmp_path / "text.txt").write_text("hello world")  # (numpy had called it "pickled data")
    with pytest.raises(NgramCorpusError, match=r"^NgramCorpus.load: '.*text.txt' is not a corpus that NgramCorpus.save "
                                               r"wrote \(an .npz, a zip archive; this file starts with b'hell'\)$"):
        NgramCorpus.load(tmp_path / "text.txt")
    with open(path, "rb") as fh:
        z = dict(np.load(fh))
    z["values_2"] = z["values_2"].copy()
    z["values_2"][0, 0] = 10  # a token id outside the saved vocabulary
    with open(tmp_path / "bad.npz", "wb") as fh:
        np.savez(fh, **z)
    with pytest.raises(NgramCorpusError, match="bad.npz.*outside the vocabulary of 10"):
        NgramCorpus.load(tmp_path / "bad.npz")
    np.save(tmp_path / "array.npy", np.zeros(3))
    with pytest.raises(NgramCorpusError, match="an .npz"):
        NgramCorpus.load(tmp_path / "array.npy")
    del z["meta"]
    with open(tmp_path / "damaged.npz", "wb") as fh:
        np.savez(fh, **z)
    with pytest.raises(NgramCorpusError, match="damaged"):
        NgramCorpus.load(tmp_path / "damaged.npz")
    whole = path.read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    with pytest.raises(NgramCorpusError, match="cut.npz"):
        NgramCorpus.load(tmp_path / "cut.npz")
    flipped = bytearray(whole)
    at = whole.index(b"values_2.npy") + 40  # inside that member's compressed data: a failed CRC or inflate
    flipped[at] ^= 0xFF
    (tmp_path / "flipped.npz").write_bytes(bytes(flipped))
    with pytest.raises(NgramCorpusError, match="flipped.npz.*damaged"):
        NgramCorpus.load(tmp_path / "flipped.npz")
    np.savez(tmp_path / "object.npz", format=np.array([FORMAT], dtype=object))  # would need pickle to read
    with pytest.raises(NgramCorpusError, match="object.npz.*damaged"):
        NgramCorpus.load(tmp_path / "object.npz")
    short = {**z, "meta": np.array([10, 2, 4, 2, 18]), "contexts_3": z["contexts_3"].ravel()[:-1]}
    with open(tmp_path / "short.npz", "wb") as fh:  # a member one entry short of whole contexts
        np.savez(fh, **short)
    with pytest.raises(NgramCorpusError, match="short.npz.*a multiple of 3"):
        NgramCorpus.load(tmp_path / "short.npz")
    for meta in (np.array([10.5, 2, 4, 2, 18]), np.array([10, 2, 99, 2, 18])):  # a float; orders past 64
        with open(tmp_path / "meta.npz", "wb") as fh:
            np.savez(fh, **{**z, "meta": meta})
        with pytest.raises(NgramCorpusError, match="meta.npz.*damaged"):
            NgramCorpus.load(tmp_path / "meta.npz")


def test_the_combined_drafter_prefers_long_prompt_matches():
    c = NgramCorpus.build([[1, 2, 3, 4, 5]] * 2, 10, min_ngram=2, max_ngram=3, min_confidence=0.0)
    index = NgramIndex(4)
    index.append([8, 9, 6, 7, 8, 9])  # prompt lookup: (8, 9) matched, 2 tokens -> its drafts
    assert propose_lookup(index, c, 3) == ([6, 7, 8], 2)
    index = NgramIndex(4)
    index.append([2, 7, 1, 2])  # prompt lookup: only (2) matched -> the corpus, (1, 2) -> 3, 4, 5
    assert index.propose_match(3) == ([7, 1, 2], 1)
    assert propose_lookup(index, c, 3) == ([3, 4, 5], corpus_class(1.0)) == ([3, 4, 5], -4)
    assert propose_lookup(index, None, 3) == ([7, 1, 2], 1)
    index = NgramIndex(4)
    index.append([6, 0, 6])  # a 1-token prompt match, nothing in the corpus: prompt lookup's
    assert propose_lookup(index, c, 2) == ([0, 6], 1)
    assert propose_lookup(index, c, 0) == ([], 1)
    assert [corpus_class(x) for x in (0.0, 0.29, 0.3, 0.6, 0.89, 0.9, 1.0)] == [-1, -1, -2, -3, -3, -4, -4]


def test_replay_with_a_corpus():
    """The replay (experiments/ngram_bound.py) drafts from the corpus as the generator does."""
    prompt, out = [9, 8, 1], [2, 3, 4, 5, 6]
    c = NgramCorpus.build([[1, 2, 3, 4, 5, 6]] * 2, 10, min_ngram=2, max_ngram=3, min_confidence=0.0)
    plain = replay(prompt, out, k=4, max_ngram=4, max_new_tokens=100)
    assert plain.drafted == 0 and plain.steps == 5
    got = replay(prompt, out, k=4, max_ngram=4, max_new_tokens=100, corpus=c)
    # the prefill step emits 2; then (1, 2) -> 3, (1, 2, 3) -> 4, ... -> 6: all accepted, 5 tokens in 2 steps
    assert (got.steps, got.verifications, got.drafted, got.accepted) == (2, 1, 4, 4)
    assert (got.corpus_drafted, got.corpus_accepted) == (4, 4) and plain.corpus_drafted == 0


# ---------------------------------------------------------------------------------------------- the generator
KW = dict(num_pages=64, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=96)
NGRAM_ROLE = verification_for(use_ngram_draft=True)  # (the default k)
PROMPTS = ["one two three", "four five six", "seven eight", "nine ten eleven twelve"]


def jobs(max_new=24):
    return [Job(TOK.encode(p), max_new, gen_settings=SamplingSettings.greedy(), identifier=i)
            for i, p in enumerate(PROMPTS)]


def run(**spec):
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(**KW, verification=verification_for(**spec)), **spec)
    gen.enqueue(jobs())
    c = drain(gen)
    gen.pool.check({})
    return gen, c


def tokens_of(c) -> dict:
    out: dict = {}
    for r in c.results:
        if r["stage"] == "streaming":
            out.setdefault(r["identifier"], []).extend(r.get("token_ids", []))
    return out


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_generator_drafts_from_the_corpus_and_its_output_is_unchanged(adaptive):
    """A corpus of the engine's own outputs on these prompts makes its drafts right; prompt lookup alone finds little
    in them (the fake engine's counting rarely repeats). The output is plain decoding's either way."""
    _, ref = run()
    outputs = tokens_of(ref)
    corpus = NgramCorpus.build([TOK.encode(p)[-4:] + outputs[i] for i, p in enumerate(PROMPTS)], 258, min_count=1,
                               min_confidence=0.0)
    spec = dict(use_ngram_draft=True, num_draft_tokens=3, max_ngram=3, adaptive_draft=adaptive)
    lookup, c1 = run(**spec)
    gen, c2 = run(**spec, ngram_corpus=corpus)
    assert tokens_of(c1) == tokens_of(c2) == outputs
    m, m1 = gen.metrics(), lookup.metrics()
    assert m1["corpus_drafted_tokens"] == 0
    assert m["corpus_drafted_tokens"] > 20 and m["corpus_accepted_draft_tokens"] > 0.8 * m["corpus_drafted_tokens"]
    assert m["accepted_draft_tokens"] > m1["accepted_draft_tokens"] + 20 and m["steps"] < m1["steps"]
    assert m["corpus_accepted_draft_tokens"] <= m["accepted_draft_tokens"]
    if adaptive:  # the gate learns the corpus's classes apart from prompt lookup's
        classes = gen.speculation.speculator.gate.stats()["acceptance_by_class"]
        assert any(cls < 0 for cls in classes)


def test_ngram_corpus_arguments_are_checked(tmp_path):
    corpus = NgramCorpus.build([[1, 2, 3, 1, 2, 3]], 258)
    with pytest.raises(InvalidConfigError, match="use_ngram_draft=True"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(**KW), ngram_corpus=corpus)
    with pytest.raises(InvalidConfigTypeError, match="NgramCorpus or the path"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(**KW), use_ngram_draft=True, ngram_corpus={1: 2})
    small = NgramCorpus.build([[1, 2, 3, 1, 2, 3]], 100)
    with pytest.raises(InvalidConfigError, match="vocabulary of 100 tokens, the model has 258"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(**KW, verification=NGRAM_ROLE), use_ngram_draft=True,
                         ngram_corpus=small)
    with pytest.raises(NgramCorpusError, match="cannot read"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(**KW, verification=NGRAM_ROLE), use_ngram_draft=True,
                         ngram_corpus=str(tmp_path / "missing.npz"))
    corpus.save(tmp_path / "c.npz")
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(**KW, verification=NGRAM_ROLE), use_ngram_draft=True,
                           ngram_corpus=tmp_path / "c.npz")
    assert gen.speculation.speculator.corpus.entries(2) == corpus.entries(2) != {}
    assert load_corpus(corpus, 258) is corpus
