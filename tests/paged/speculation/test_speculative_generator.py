"""Speculative decoding through the real `DynamicGenerator` (phase 2 of the feature: the generator wiring).

Two engines: the hand-checkable fake (`paged.testing.FakeEngine`, which verifies one-hot n-gram drafts greedily) for
everything downstream of the step (stop tokens and strings, banned-string rewinds, UTF-8 hold-back,
min/max_new_tokens, per-token extras, token healing, page accounting under random enqueue / cancel / iterate and
preemption), and tiny random JAX models for greedy identity with every drafter, mixed prefill/speculation batches
and seeded reruns at temperature > 0. In every case the output must be the non-speculative generator's, result for
result."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models import ModelConfig, init_random_weights
from models.draft import reduced_head, truncated_model
from models.loader import Model
from paged import DynamicGenerator, Job, SamplingSettings
from paged.compat import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicGeneratorAsync
from paged.device.config import Verification
from paged.errors import InvalidConfigError
from paged.testing import (
    ByteTokenizer,
    ContextFakeEngine,
    FakeEngine,
    drain,
    quantized_tiny_model,
    tiny_config,
    tiny_model,
    verification_for,
)
from pallas_kernels.native import unavailable_reason as native_unavailable

# each test builds generators with draft models: their compiled programs go once the maps near the limit (conftest)
pytestmark = pytest.mark.usefixtures("release_compiled_programs_near_the_map_limit")

TOK = ByteTokenizer()
GREEDY = SamplingSettings.greedy()
SKIP = ("job", "time_enqueued", "time_prefill", "time_generate", "cached_tokens", "cached_pages", "preemptions",
        "accepted_draft_tokens", "rejected_draft_tokens", "serial")


class CopyFakeEngine(ContextFakeEngine):
    """Mostly copies the token `PERIOD` positions back (so prompt lookup drafts well), except where a hash of the
    whole context read back through the page table says otherwise: a stale or misplaced KV entry (a rejected draft
    left visible, a page registered over unaccepted tokens) changes the output."""

    PERIOD = 6

    def next_token(self, r):
        ps = self.page_size
        end = r.start_pos + len(r.tokens)
        ctx = [self.written[(r.pages[p // ps], p % ps)] for p in range(end)]
        acc = sum((p + 1) * t for p, t in enumerate(ctx))
        if end < self.PERIOD or acc % 5 == 0:
            return 97 + acc % 26
        return ctx[end - self.PERIOD]


def stream_of(results) -> dict:
    """Per identifier: its streaming results without the keys that legitimately differ (timing, cache hits)."""
    out = collections.defaultdict(list)
    for r in results:
        if r["stage"] != "streaming":
            continue
        d = {}
        for k, v in r.items():
            if k in SKIP:
                continue
            d[k] = np.asarray(v).tolist() if k == "logits" else v
        out[r["identifier"]].append(d)
    return dict(out)


def fake_jobs():
    """Jobs exercising every per-token path; prompts repeat so that prompt lookup proposes (and is often right)."""
    rep = "the cat sat. the cat sat. the cat "
    return [
        Job(TOK.encode(rep), 20, gen_settings=GREEDY, identifier="plain"),
        Job(TOK.encode(rep + "sat."), 24, gen_settings=GREEDY, identifier="stop", stop_conditions=["ca", 256]),
        Job(TOK.encode("abcabcabcab"), 18, gen_settings=GREEDY, identifier="banned", banned_strings=["cab", "BC"]),
        Job(TOK.encode("xyzxyzxyzx"), 9, min_new_tokens=6, gen_settings=GREEDY, identifier="min",
            stop_conditions=[ord("y"), ord("z")]),
        Job(TOK.encode("hello hello hel"), 7, gen_settings=GREEDY, identifier="extras", return_probs=True,
            return_top_tokens=3, return_logits=True),
        Job(TOK.encode("ababab\xc3"), 6, gen_settings=GREEDY, identifier="utf8"),
        Job(TOK.encode("heal heal hea"), 8, gen_settings=GREEDY, identifier="healing", token_healing=True),
        Job(TOK.encode("qq"), 1, gen_settings=GREEDY, identifier="one"),
    ]


def run_fake(engine_cls=FakeEngine, spec=None, policy="exllamav2", jobs=None, **engine_kw):
    kw = dict(num_pages=64, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=96)
    engine = engine_cls(**{**kw, **engine_kw}, verification=verification_for(**(spec or {})))
    gen = DynamicGenerator(tokenizer=TOK, engine=engine, policy=policy, **(spec or {}))
    gen.enqueue(jobs if jobs is not None else fake_jobs())
    c = drain(gen)
    gen.pool.check({})
    return gen, c


NGRAM = dict(use_ngram_draft=True, num_draft_tokens=4, max_ngram=3)


@pytest.mark.parametrize("engine_cls", [FakeEngine, CopyFakeEngine])
@pytest.mark.parametrize("k", [1, 4])
def test_ngram_speculation_streams_exactly_the_non_speculative_results(engine_cls, k):
    _, ref = run_fake(engine_cls)
    gen, got = run_fake(engine_cls, {**NGRAM, "num_draft_tokens": k})
    assert stream_of(got.results) == stream_of(ref.results)
    m = gen.metrics()
    assert 0 < m["drafted_tokens"] and m["accepted_draft_tokens"] <= m["drafted_tokens"]
    if engine_cls is CopyFakeEngine:  # copies: prompt lookup drafts well (the counting fake rarely repeats itself)
        assert m["drafted_tokens"] > 30 and m["acceptance_rate"] > 0.3 and m["accepted_draft_tokens"] > 10
    assert sum(f["accepted_draft_tokens"] for f in got.finals.values()) == m["accepted_draft_tokens"]
    assert sum(f["rejected_draft_tokens"] for f in got.finals.values()) == m["rejected_draft_tokens"]
    assert len(m["accepted_at_position"]) == k and m["accepted_at_position"][0] >= m["accepted_at_position"][-1]
    assert m["acceptance_rate"] == m["accepted_draft_tokens"] / m["drafted_tokens"]
    for f in ref.finals.values():
        assert f["accepted_draft_tokens"] == f["rejected_draft_tokens"] == 0  # present without speculation too


def test_rewinds_stop_strings_and_limits_really_happen_with_drafts():
    """The scenario is not vacuous: drafts were accepted past a banned string (then rewound), max_new_tokens is
    never exceeded, stop tokens before min_new_tokens are skipped, and a stop string ends a job mid-row."""
    gen, c = run_fake(CopyFakeEngine, NGRAM)
    assert any(r.get("suppressed_tokens") for r in c.results if r["identifier"] == "banned")
    for j in fake_jobs():
        f = c.finals[j.identifier]
        assert f["new_tokens"] <= j.max_new_tokens
    assert c.finals["min"]["new_tokens"] >= 6
    assert gen.metrics()["accepted_draft_tokens"] > 0


def test_no_drafter_leaves_the_step_alone():
    """Without a drafter the generator builds no speculator and the engine never sees a verification row."""
    gen, _ = run_fake(FakeEngine)
    assert gen.speculation is None and not any(r.verify for rows in gen.engine.calls for r in rows)
    gen, _ = run_fake(FakeEngine, NGRAM)
    assert any(r.verify for rows in gen.engine.calls for r in rows)


def test_drafts_never_write_past_the_reserved_pages():
    """Every verification row's positions lie inside its own pages (the fake records the writes)."""
    gen, _ = run_fake(CopyFakeEngine, {**NGRAM, "num_draft_tokens": 6}, page_size=8)
    for rows in gen.engine.calls:
        for r in rows:
            assert r.start_pos + len(r.tokens) <= len(r.pages) * 8


@pytest.mark.parametrize("policy", ["vllm", "priority"])
def test_preemption_with_speculation_keeps_outputs_and_pages_exact(policy):
    """On-demand pages with preemption by recompute, speculation on: the outputs are those of ample pages
    without speculation, and the preempted jobs' drafter state is reset (the n-gram index resyncs)."""
    rng = random.Random(3)
    specs = []
    for _ in range(10):
        text = rng.choice(["abcabcabc", "the cat the cat ", "xyxyxy"]) + "".join(rng.choice("abc ") for _ in range(5))
        specs.append(dict(text=text, n=rng.randint(4, 16), prio=rng.randint(0, 2), banned=rng.random() < 0.3))

    def jobs():
        return [Job(TOK.encode(s["text"]), s["n"], gen_settings=GREEDY, priority=s["prio"], identifier=i,
                    banned_strings=["ca"] if s["banned"] else None) for i, s in enumerate(specs)]

    _, ref = run_fake(CopyFakeEngine, jobs=jobs(), page_size=4, num_pages=64, max_seq_len=48)
    released = collections.Counter()
    gen = DynamicGenerator(tokenizer=TOK, engine=CopyFakeEngine(num_pages=14, page_size=4, max_batch_size=4,
                                                                max_chunk_size=16, max_seq_len=48,
                                                                verification=verification_for(**NGRAM)),
                           policy=policy, **NGRAM)
    release = gen.scheduler.on_release

    def spy(job):
        released[job.identifier] += 1
        release(job)

    gen.scheduler.on_release = spy
    jobs_ = jobs()
    gen.enqueue(jobs_)
    got = drain(gen)
    gen.pool.check({})
    assert gen.metrics()["preemptions"] > 0 and gen.metrics()["accepted_draft_tokens"] > 0
    assert stream_of(got.results) == stream_of(ref.results)
    for j in jobs_:  # each preemption dropped the job's drafter state
        assert released[j.identifier] == j.preemptions
    assert not gen.speculation.speculator.drafter._index  # and so did the end of every job


ops = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.sampled_from(["", "abcabcab", "the cat the cat "]),
                  st.text(alphabet="abc", min_size=1, max_size=10), st.integers(1, 14), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("iterate"), st.integers(1, 4)),
    ),
    min_size=1, max_size=60,
)


def test_page_accounting_is_exact_under_random_operations_with_speculation():
    totals: collections.Counter = collections.Counter()

    @settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(ops=ops, num_pages=st.integers(10, 24), policy=st.sampled_from(["exllamav2", "vllm"]))
    def check(ops, num_pages, policy):
        gen = DynamicGenerator(tokenizer=TOK, engine=CopyFakeEngine(num_pages=num_pages, page_size=4, max_batch_size=3,
                                                                    max_chunk_size=8, max_seq_len=40,
                                                                    verification=verification_for(**NGRAM)),
                               policy=policy, **NGRAM)
        jobs, cancelled, finals = [], set(), {}

        def verify():
            refs = collections.Counter(p for j in gen.active for p in j.pages)
            gen.pool.check(dict(refs))
            for j in gen.active:  # the cache holds exactly the job's accepted tokens below its KV position
                assert j.kv_position <= len(j.sequence)
                for pos in range(j.kv_position):
                    assert gen.engine.written[(j.pages[pos // 4], pos % 4)] == j.sequence[pos], (j, pos)

        for op in ops:
            if op[0] == "enqueue":
                _, prefix, suffix, n, ban = op
                j = Job(TOK.encode(prefix + suffix), n, gen_settings=GREEDY, identifier=len(jobs),
                        banned_strings=["ca"] if ban else None)
                if -(-(j.prompt_len + n) // 4) > num_pages or j.prompt_len + n > 40:
                    continue
                gen.enqueue(j)
                jobs.append(j)
            elif op[0] == "cancel" and jobs:
                j = jobs[op[1] % len(jobs)]
                if j.identifier not in finals:
                    totals["cancelled_running"] += j in gen.active
                    cancelled.add(j.identifier)
                gen.cancel(j)
            else:
                for _ in range(op[1]):
                    for r in gen.iterate():
                        assert r["identifier"] not in cancelled
                        if r["eos"]:
                            finals[r["identifier"]] = r
                    verify()
            verify()
        drain(gen)
        gen.pool.check({})
        assert gen.pool.num_referenced == 0 and not gen.speculation.speculator.drafter._index
        totals["accepted"] += gen.metrics()["accepted_draft_tokens"]
        totals["preemptions"] += gen.metrics()["preemptions"]

    check()
    # the examples exercised what they are for (the exact counts vary with hypothesis' generation across processes)
    assert totals["accepted"] > 20 and totals["cancelled_running"] >= 1, totals


# ---------------------------------------------------------------------------------------------- configuration
CFG = tiny_config(258)
MODEL = tiny_model(CFG, seed=0, tokenizer=TOK)
OTHER = tiny_model(CFG, seed=7, tokenizer=TOK, source="tiny-other")
SETTINGS = dict(num_pages=48, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=64, max_penalty_range=0)
# the same engine with a penalty history, for rows that carry one (test_speculative, test_fused_step: one definition,
# so their programs stay the same and the compilation cache shares them)
PENALISED = {**SETTINGS, "max_penalty_range": 16}


def test_invalid_speculation_arguments():
    with pytest.raises(InvalidConfigError, match="not both"):
        DynamicGenerator(MODEL, draft_model=MODEL, use_ngram_draft=True, **SETTINGS)
    with pytest.raises(InvalidConfigError, match="num_draft_tokens"):
        DynamicGenerator(MODEL, use_ngram_draft=True, num_draft_tokens=0, **SETTINGS)
    with pytest.raises(InvalidConfigError, match="max_ngram"):
        DynamicGenerator(MODEL, use_ngram_draft=True, max_ngram=0, **SETTINGS)
    # bounded: 10**6 had been accepted, and the first iterate() compiled a 1,000,001-wide verification (21 GB)
    for drafter in (dict(use_ngram_draft=True), dict(draft_model=OTHER)):
        with pytest.raises(InvalidConfigError, match=r"num_draft_tokens=1000000 exceeds the maximum of 64"):
            DynamicGenerator(MODEL, num_draft_tokens=10**6, **drafter, **SETTINGS)
        with pytest.raises(InvalidConfigError, match=r"num_draft_tokens=64 must be below max_seq_len=64"):
            DynamicGenerator(MODEL, num_draft_tokens=64, **drafter, **SETTINGS)
    short = ModelConfig(**{**CFG.__dict__, "max_position_embeddings": 32})
    with pytest.raises(InvalidConfigError, match="max_seq_len=64 exceeds the draft model's max_position_embeddings=32"):
        DynamicGenerator(MODEL, draft_model=Model(config=short, params=OTHER.params, tokenizer=TOK, source="short"),
                         **SETTINGS)
    small = tiny_config(96, num_layers=1)
    with pytest.raises(InvalidConfigError, match="a vocabulary of 96 ids but the model has 258; a draft whose "
                                                 "vocabulary differs needs both models' tokenizers"):
        DynamicGenerator(MODEL, draft_model=Model(config=small, params=init_random_weights(small), tokenizer=None,
                                                  source="small"), **SETTINGS)
    # with both tokenizers another size is fine (the draft proposes only its own ids: lossless), as GGUF tokenizers
    # the size of their models, padding listed as tokens, are; a mismatch within the shared ids is still refused
    small_draft = DynamicGenerator(MODEL, draft_model=Model(config=small, params=init_random_weights(small),
                                                            tokenizer=TOK, source="small"), **SETTINGS)
    assert small_draft.speculation.speculator.draft.engine.vocab_size == 258

    class Padded(ByteTokenizer):  # a GGUF tokenizer: the model's padded ids listed as [PADi] tokens
        def __init__(self, size, differ_at=None):
            self.vocab_size, self.differ_at = size, differ_at

        def token_bytes(self, t):
            if t == self.differ_at:
                return b"?"
            return super().token_bytes(t) if t < 258 else f"[PAD{t}]".encode()

    gguf_like = [tiny_config(v, num_layers=1) for v in (272, 264)]
    big, little = (Model(config=c, params=init_random_weights(c, seed=1), tokenizer=Padded(c.vocab_size),
                         source=f"gguf-{c.vocab_size}") for c in gguf_like)
    assert DynamicGenerator(big, draft_model=little, **SETTINGS).speculation.speculator.draft.engine.vocab_size == 272
    odd = Model(config=gguf_like[1], params=little.params, tokenizer=Padded(264, differ_at=100), source="odd")
    with pytest.raises(InvalidConfigError, match="token 100"):
        DynamicGenerator(big, draft_model=odd, **SETTINGS)
    with pytest.raises(InvalidConfigError, match="none of the reduced head's token ids is below 258"):
        DynamicGenerator(MODEL, draft_model=reduced_head(padded_model(MODEL, 272), [260, 270]), **SETTINGS)

    class OtherBytes(ByteTokenizer):
        def token_bytes(self, t):
            return b"?" if t == 65 else super().token_bytes(t)

    other_tok = Model(config=CFG, params=OTHER.params, tokenizer=OtherBytes(), source="other-tok")
    with pytest.raises(InvalidConfigError, match="tokenizer"):
        DynamicGenerator(MODEL, draft_model=other_tok, **SETTINGS)
    # a vocabulary padded past the tokenizer's (as Qwen2.5's 151936 ids for 151665 tokens): the ids past the
    # tokenizer have no text to compare (had raised a TokenizerError for id 258)
    class Strict(ByteTokenizer):  # as models.tokenizer.Tokenizer: no bytes for an id past the vocabulary
        def token_bytes(self, t):
            if t >= self.vocab_size:
                raise IndexError(f"token id {t} is out of range")
            return super().token_bytes(t)

    padded = tiny_config(264, num_layers=1)
    target, draft = (Model(config=padded, params=init_random_weights(padded, seed=s), tokenizer=Strict(),
                           source=f"padded-{s}") for s in (0, 1))
    assert DynamicGenerator(target, draft_model=draft, **SETTINGS).speculation is not None
    with pytest.raises(InvalidConfigError, match="draft model needs"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(), draft_model=MODEL)
    with pytest.raises(InvalidConfigError, match="draft_acceptance must be one of"):
        DynamicGenerator(MODEL, use_ngram_draft=True, draft_acceptance="always", **SETTINGS)
    with pytest.raises(InvalidConfigError, match="draft_acceptance needs a drafter"):
        DynamicGenerator(MODEL, draft_acceptance="match", **SETTINGS)

    # an engine's roles are fixed when it is built: one built for other drafts, or none, is refused
    with pytest.raises(InvalidConfigError, match=r"built without verification; this speculation needs one built with "
                                                  r"EngineConfig\(verification="):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(), use_ngram_draft=True)
    with pytest.raises(InvalidConfigError, match="match=True"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(verification=Verification(4)), use_ngram_draft=True,
                         draft_acceptance="exllamav2")
    with pytest.raises(InvalidConfigError, match="num_draft_tokens=3"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(verification=Verification(4)), use_ngram_draft=True,
                         num_draft_tokens=3)


def test_compat_aliases_accept_the_speculation_arguments():
    g = ExLlamaV2DynamicGenerator(MODEL, None, TOK, use_ngram_draft=True, num_draft_tokens=3, max_ngram=2, **SETTINGS)
    assert g.speculation is not None and g.speculation.k == 3 and g.speculation.speculator.drafter.max_ngram == 2
    g = ExLlamaV2DynamicGenerator(MODEL, None, TOK, draft_model=truncated_model(MODEL, 1), **SETTINGS)
    assert g.speculation.speculator.draft is not None
    a = ExLlamaV2DynamicGeneratorAsync(MODEL, None, TOK, use_ngram_draft=True, **SETTINGS)
    assert a.generator.speculation is not None
    g = ExLlamaV2DynamicGenerator(MODEL, None, TOK, use_ngram_draft=True, draft_acceptance="match", **SETTINGS)
    assert g.speculation.speculator.acceptance == "match" and g.engine.verify_match
    with pytest.raises(InvalidConfigError, match="not both"):
        ExLlamaV2DynamicGenerator(MODEL, None, TOK, draft_model=MODEL, use_ngram_draft=True, **SETTINGS)


# ---------------------------------------------------------------------------------------------- tiny JAX models
PROMPTS = ["the cat sat on the mat. the cat sat", "abcabcabcabcabcabcabc", "hello world, hello", "zq"]


def model_jobs(settings=GREEDY, seed=None, max_new=12):
    return [Job(TOK.encode(p), max_new + i, gen_settings=settings, identifier=i, return_probs=True,
                seed=None if seed is None else seed + i) for i, p in enumerate(PROMPTS)]


def run_model(spec=None, jobs=None, **kw):
    gen = DynamicGenerator(MODEL, **{**SETTINGS, **kw}, **(spec or {}))
    gen.enqueue(jobs if jobs is not None else model_jobs())
    c = drain(gen)
    gen.pool.check({})
    return gen, c


def same_stream(a, b):
    """Equal streams; probabilities within float noise (a verification row computes them in another batch)."""
    sa, sb = stream_of(a.results), stream_of(b.results)
    assert sa.keys() == sb.keys()
    for i in sa:
        assert [r["token_ids"] for r in sa[i]] == [r["token_ids"] for r in sb[i]], i
        assert [r["text"] for r in sa[i]] == [r["text"] for r in sb[i]], i
        pa = [p for r in sa[i] for p in r.get("token_probs", [])]
        pb = [p for r in sb[i] for p in r.get("token_probs", [])]
        np.testing.assert_allclose(pa, pb, rtol=1e-4, atol=1e-5)


def corpus_of(reference, jobs=(0, 1)):
    """A corpus table (`paged.speculation.ngram_corpus`) of a run's outputs for some of its jobs, with their prompts'
    tails."""
    from paged.speculation.ngram_corpus import NgramCorpus

    outs = {i: [t for r in rs for t in r["token_ids"]] for i, rs in stream_of(reference.results).items()}
    return NgramCorpus.build([TOK.encode(PROMPTS[i])[-4:] + outs[i] for i in jobs], CFG.vocab_size, min_count=1)


@pytest.fixture(scope="module")
def greedy_reference():
    return run_model()[1]


# fast tier: n-gram and an unrelated draft model; the self-draft in the slow tier
@pytest.mark.parametrize("drafter", [pytest.param("self", marks=pytest.mark.slow), "unrelated", "ngram", "corpus"])
@pytest.mark.slow
def test_greedy_identity_with_every_drafter(drafter, greedy_reference):
    """Four jobs of different prompt lengths: the long prompts prefill (one chunk per step) while the short ones
    already speculate, so verification rows and prefill chunks share steps. "corpus": prompt lookup with a corpus
    table (`paged.speculation.ngram_corpus`) of the model's own outputs on the first two prompts."""
    spec = {"self": dict(draft_model=MODEL), "unrelated": dict(draft_model=OTHER),
            "ngram": dict(use_ngram_draft=True, max_ngram=3), "corpus": None}[drafter]
    if drafter == "corpus":
        spec = dict(use_ngram_draft=True, max_ngram=3, ngram_corpus=corpus_of(greedy_reference))
    gen, c = run_model(dict(num_draft_tokens=3, **spec))
    same_stream(c, greedy_reference)
    m = gen.metrics()
    assert m["drafted_tokens"] > 0
    if drafter == "corpus":
        assert m["corpus_drafted_tokens"] > 0 and m["corpus_accepted_draft_tokens"] > 0
    if drafter == "self":
        assert m["acceptance_rate"] == 1.0 and m["mean_accepted_length"] > 3.0
    if drafter == "unrelated":
        assert m["acceptance_rate"] < 0.3
    for f in c.finals.values():
        assert f["accepted_draft_tokens"] + f["rejected_draft_tokens"] <= f["new_tokens"] * 3


@pytest.mark.slow
def test_a_draft_with_a_reduced_head(greedy_reference):
    """A reduced LM head (`models.draft.reduced_head`) drafts only its tokens: over every token in shuffled order
    it is the target itself (every draft accepted: its columns map back to the right ids); over a random half of
    the vocabulary the output is still the target's, and only the drafts the head can say are accepted."""
    ids = np.random.default_rng(3).permutation(CFG.vocab_size)
    gen, c = run_model(dict(num_draft_tokens=3, draft_model=reduced_head(MODEL, ids)))
    same_stream(c, greedy_reference)
    assert gen.metrics()["acceptance_rate"] == 1.0 and gen.metrics()["drafted_tokens"] > 20
    half = reduced_head(MODEL, ids[: CFG.vocab_size // 2])
    gen, c = run_model(dict(num_draft_tokens=3, draft_model=half))
    same_stream(c, greedy_reference)
    m = gen.metrics()
    assert 0.0 < m["acceptance_rate"] < 1.0
    said = [t for r in stream_of(greedy_reference.results).values() for x in r for t in x["token_ids"]]
    in_head = np.isin(said, ids[: CFG.vocab_size // 2])
    assert 0 < in_head.mean() < 1  # the target says tokens on both sides of the cut


def padded_model(model: Model, vocab: int, zero_head: bool = False) -> Model:
    """`model` with its vocabulary padded to `vocab` ids past the tokenizer's, as real checkpoints pad theirs: new
    embedding rows random, new head columns random or zero (`zero_head`: a logit of 0, which the greedy argmax
    over the model's own tokens beats, as a trained model never says its padded ids)."""
    rng = np.random.default_rng(11)
    p, h, extra = model.params, model.config.hidden_size, vocab - model.config.vocab_size
    head = np.asarray(p.embed).T if p.lm_head is None else np.asarray(p.lm_head)
    cols = np.zeros((h, extra)) if zero_head else rng.normal(size=(h, extra))
    params = p.replace(embed=np.concatenate([np.asarray(p.embed), rng.normal(size=(extra, h))]).astype(np.float32),
                       lm_head=np.concatenate([head, cols], axis=1).astype(np.float32))
    cfg = ModelConfig(**{**model.config.__dict__, "vocab_size": vocab, "tie_word_embeddings": False})
    return Model(config=cfg, params=params, tokenizer=model.tokenizer, source=f"{model.source}+pad{extra}")


@pytest.mark.slow
def test_a_draft_whose_vocabulary_is_padded_differently(greedy_reference):
    """Qwen2.5-7B (152064 ids) drafted by Qwen2.5-0.5B (151936), one tokenizer of 151665 tokens: the draft's
    logits are matched to the target's ids (`models.draft.matched_vocab`). The target's own model padded larger
    drafts for it with every draft accepted (its padded ids are dropped, so the ids line up); and a target padded
    larger, drafted by the unpadded model, gives its own output with every draft accepted (the draft's q is 0 past
    its vocabulary)."""
    gen, c = run_model(dict(num_draft_tokens=3, draft_model=padded_model(MODEL, 272)))
    same_stream(c, greedy_reference)
    assert gen.metrics()["acceptance_rate"] == 1.0 and gen.metrics()["drafted_tokens"] > 20
    big = padded_model(MODEL, 272, zero_head=True)
    alone = DynamicGenerator(big, **SETTINGS)
    alone.enqueue(model_jobs())
    reference = drain(alone)
    said = [t for r in stream_of(reference.results).values() for x in r for t in x["token_ids"]]
    assert max(said) < 258  # (the padded ids' logits of 0 lose to the model's tokens at greedy)
    gen = DynamicGenerator(big, draft_model=MODEL, num_draft_tokens=3, **SETTINGS)
    gen.enqueue(model_jobs())
    same_stream(drain(gen), reference)
    m = gen.metrics()
    assert m["acceptance_rate"] == 1.0 and m["drafted_tokens"] > 20
    gen.pool.check({})


@pytest.mark.slow  # fast tier: mixed steps with the n-gram drafter and the fake engine
def test_mixed_steps_happen_with_a_draft_model():
    """A verification row shares a step with a prefill chunk (the draft mirrors the chunk) and the output stays
    the reference one."""
    seen = []
    gen = DynamicGenerator(MODEL, **SETTINGS, draft_model=truncated_model(MODEL, 1), num_draft_tokens=2)
    run = gen.engine.run

    def spy(rows, **kw):
        seen.append((any(r.verify for r in rows), any(len(r.tokens) > 1 and not r.verify for r in rows)))
        return run(rows, **kw)

    gen.engine.run = spy
    jobs = model_jobs()
    gen.enqueue(jobs[3])
    early = gen.iterate() + gen.iterate()  # job 3 decodes (and speculates) before the others arrive
    gen.enqueue(jobs[:3])
    c = drain(gen)
    c.results[:0] = early
    assert (True, True) in seen
    ref = run_model(jobs=model_jobs())[1]
    same_stream(c, ref)


@pytest.mark.parametrize("drafter", [pytest.param("model", marks=pytest.mark.slow), "ngram"])
@pytest.mark.slow
def test_same_seed_same_output_at_temperature(drafter):
    sampled = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    spec = dict(draft_model=truncated_model(MODEL, 1)) if drafter == "model" else dict(use_ngram_draft=True)
    outs = []
    for _ in range(2):
        _, c = run_model(dict(num_draft_tokens=3, **spec), jobs=model_jobs(sampled, seed=5))
        outs.append({i: f["full_completion"] for i, f in c.finals.items()} | {
            ("ids", i): t for i, t in ((i, [x for r in c.results if r["identifier"] == i and r["stage"] == "streaming"
                                            for x in r["token_ids"]]) for i in c.finals)})
    assert outs[0] == outs[1]
    assert all(len(v) > 0 for k, v in outs[0].items() if isinstance(k, tuple))


@pytest.mark.parametrize("rule, drafter, temperature", [("match", "model", 0.5), ("match", "ngram", 0.01),
                                                         ("match", "corpus", 0.01), ("exllamav2", "self", 0.01)])
@pytest.mark.slow
def test_sample_then_match_emits_the_non_speculative_draws(rule, drafter, temperature):
    """draft_acceptance="match" / "exllamav2": a seeded sampled job emits exactly the tokens it emits without
    speculation (each position's draw uses plain decoding's key), accepted drafts and corrections alike, whatever the
    drafter. The unrelated draft model draws with the target's Gumbel noise ("match"), so on these flat tiny models
    it often draws the target's token; prompt lookup's drafts and the target's own greedy drafts ("exllamav2") are
    accepted at temperature 0.01 (still sampled: greedy is below 0.01), where the draws are predictable; so are a
    corpus table's (`ngram_corpus`, here of the plain run's own outputs for two of the jobs)."""
    sampled = SamplingSettings(temperature=temperature, top_k=0, top_p=1.0, repetition_penalty=1.0)
    ref = run_model(jobs=model_jobs(sampled, seed=5))[1]
    spec = {"model": dict(draft_model=OTHER), "self": dict(draft_model=MODEL),
            "ngram": dict(use_ngram_draft=True, max_ngram=2),
            "corpus": dict(use_ngram_draft=True, max_ngram=2, ngram_corpus=corpus_of(ref))}[drafter]
    gen, c = run_model(dict(num_draft_tokens=3, draft_acceptance=rule, **spec), jobs=model_jobs(sampled, seed=5))
    same_stream(c, ref)
    m = gen.metrics()
    assert m["accepted_draft_tokens"] > 0 and m["rejected_draft_tokens"] > 0
    if drafter == "corpus":
        assert m["corpus_accepted_draft_tokens"] > 0


@pytest.mark.slow
def test_sample_then_match_with_penalties_and_truncation():
    """The same identity with ExLlamaV2's default truncation (top-k 50, top-p 0.8), a repetition penalty over a
    window and frequency / presence penalties, which see the earlier drafts of a verification row."""
    sampled = SamplingSettings(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
    kw = dict(max_penalty_range=16)
    ref = run_model(jobs=model_jobs(sampled, seed=9), **kw)[1]
    gen, c = run_model(dict(num_draft_tokens=3, draft_acceptance="match", draft_model=OTHER),
                       jobs=model_jobs(sampled, seed=9), **kw)
    same_stream(c, ref)
    m = gen.metrics()
    assert m["accepted_draft_tokens"] > 0 and m["rejected_draft_tokens"] > 0


@pytest.mark.slow
def test_stop_strings_banned_strings_and_limits_on_a_real_model(greedy_reference):
    """Settings built from the reference output (so they trigger): a stop string, a banned string, min/max tokens;
    the self-draft (every draft accepted) must reproduce the non-speculative results exactly."""
    ref_text = {i: f["full_completion"] for i, f in greedy_reference.finals.items()}

    def jobs():
        return [
            Job(TOK.encode(PROMPTS[0]), 12, gen_settings=GREEDY, identifier="stop", stop_conditions=[ref_text[0][5:7]]),
            Job(TOK.encode(PROMPTS[1]), 13, gen_settings=GREEDY, identifier="ban", banned_strings=[ref_text[1][4:6]]),
            Job(TOK.encode(PROMPTS[2]), 9, min_new_tokens=4, gen_settings=GREEDY, identifier="min",
                stop_conditions=[TOK.encode(ref_text[2])[1]]),
            Job(TOK.encode(PROMPTS[3]), 2, gen_settings=GREEDY, identifier="max"),
        ]

    _, ref = run_model(jobs=jobs())
    gen, got = run_model(dict(draft_model=MODEL, num_draft_tokens=3), jobs=jobs())
    same_stream(got, ref)
    assert got.finals["max"]["new_tokens"] == 2
    assert gen.metrics()["acceptance_rate"] == 1.0


@pytest.mark.skipif(native_unavailable() is not None, reason=f"native kernels: {native_unavailable()}")
@pytest.mark.parametrize("spec", [dict(use_ngram_draft=True, max_ngram=3), dict(draft="self")],
                         ids=["ngram", "self-draft"])
@pytest.mark.slow
def test_greedy_identity_is_bitwise_with_the_native_kernels(spec):
    """With the native matmul (int8 activations) and attention, a verification row's logits are the decode step's,
    bit for bit, at every position, next to other rows or alone: so greedy outputs with speculation are the plain
    ones token for token on the CPU default path too, not just with float matmuls. (A rotary embedding rounded
    differently in the two kinds of step, one fused multiply-add apart, once made 9 of 16 SmolLM2 copy prompts part at
    near-ties: `models.invariant.rounded`.)"""
    model = quantized_tiny_model(TOK)
    if spec.get("draft") == "self":
        spec = dict(draft_model=model)

    def run(kw, max_batch_size):
        gen = DynamicGenerator(model, **{**SETTINGS, "max_batch_size": max_batch_size}, matmul_impl="native",
                               attn_impl="native", **kw)
        jobs = [Job(TOK.encode(p), 24, gen_settings=GREEDY, identifier=i, return_logits=True)
                for i, p in enumerate(PROMPTS)]
        gen.enqueue(jobs)
        c = drain(gen)
        logits = {i: np.concatenate([np.asarray(r["logits"]).reshape(-1, model.config.vocab_size)
                                     for r in c.results if r["identifier"] == i and r.get("logits") is not None])
                  for i in range(len(PROMPTS))}
        return gen, {j.identifier: list(np.asarray(j.sequence).ravel()) for j in jobs}, logits

    # prompt lookup alone and at batch 4; the draft model at batch 4 only (its rows next to other rows; a row alone
    # is checked with prompt lookup), which saves the suite ~30 s of compiling
    for batch in (4,) if "draft_model" in spec else (1, 4):
        _, ref_tokens, ref_logits = run({}, batch)
        gen, tokens, logits = run(dict(num_draft_tokens=3, **spec), batch)
        assert tokens == ref_tokens
        for i in ref_logits:
            assert np.array_equal(logits[i], ref_logits[i]), (batch, i, np.abs(logits[i] - ref_logits[i]).max())
        m = gen.metrics()
        assert m["accepted_draft_tokens"] > 10, m


def pallas_path_identity() -> None:
    """The body of the next test, run in a process of its own: plain and prompt-lookup greedy decoding of four jobs
    at batch 4 through the GPU path's kernels (Pallas attention and matmul, interpreted), logits compared bit for
    bit. Contexts reach ~105 keys (pages of 8, key blocks of 64: two blocks), prefill chunks share steps with decode
    and verification rows."""
    model = quantized_tiny_model(TOK)

    def run(kw):
        gen = DynamicGenerator(model, **{**SETTINGS, "max_seq_len": 160, "num_pages": 96, "max_chunk_size": 24},
                               matmul_impl="pallas", attn_impl="pallas", **kw)
        jobs = [Job(TOK.encode(p * 2), 32, gen_settings=GREEDY, identifier=i, return_logits=True)
                for i, p in enumerate(PROMPTS)]
        gen.enqueue(jobs)
        c = drain(gen)
        return gen, [np.concatenate([np.asarray(r["logits"]).reshape(-1, model.config.vocab_size)
                                     for r in c.results if r["identifier"] == i and r.get("logits") is not None])
                     for i in range(len(PROMPTS))]

    _, ref = run({})
    gen, got = run(dict(num_draft_tokens=3, use_ngram_draft=True, max_ngram=3))
    assert gen.metrics()["accepted_draft_tokens"] > 15, gen.metrics()
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.shape == b.shape == (32, model.config.vocab_size), (i, a.shape, b.shape)
        differ = np.nonzero(np.any(a != b, axis=1))[0]
        assert not differ.size, f"job {i}: logits differ from position {differ[0]} on"


@pytest.mark.slow
def test_greedy_identity_is_bitwise_on_the_gpu_paths_kernels_interpreted():
    """Greedy speculation gives plain decoding's bits through the GPU path's algorithms too: the Pallas kernels in
    interpret mode, with XLA's backend optimisations off so that LLVM's code generation (which fuses and contracts
    the interpreted kernel bodies differently per shape) does not mask what the kernels compute. It caught the
    attention's old default of splitting decode steps' keys over programs (`pallas_kernels/tuning.py`), which gave a
    decode token other bits than the same query in a verification row. What it cannot show is the rounding of the
    compiled Triton dots: the `gpu` tier checks those on a GPU."""
    import os
    import subprocess
    import sys

    from tests.compile_settings import TEST_XLA_FLAGS

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{TEST_XLA_FLAGS} --xla_backend_optimization_level=0"}
    code = "from tests.paged.speculation.test_speculative_generator import pallas_path_identity; pallas_path_identity()"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- SmolLM2 (slow)
@pytest.mark.real_weights
@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_smollm2_greedy_identity(drafter):
    from models import load_model

    model = load_model("smollm2-135m", quant="keep")
    tok = model.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over "
                                                                    "the lazy dog. The quick brown fox"}]),
               tok.apply_chat_template([{"role": "user", "content": "Name three colours."}])]

    # The default CPU path: the kept Q4_1 blocks through the native kernel (int8 activations), whose rows are
    # bitwise independent of each other, as the native attention's queries are; with float matmuls XLA's own dot
    # is not (~4e-4 between a row alone and next to another), so the identity there holds up to near-ties only.
    def run(spec):
        gen = DynamicGenerator(model, max_batch_size=2, max_seq_len=256, max_chunk_size=64, page_size=16,
                               max_penalty_range=0, **spec)
        gen.enqueue([Job(tok.encode(p), 24, gen_settings=GREEDY, identifier=i, stop_conditions=[tok.eos_token_id])
                     for i, p in enumerate(prompts)])
        c = drain(gen)
        return gen, {i: [t for r in c.results if r["identifier"] == i and r["stage"] == "streaming"
                         for t in r["token_ids"]] for i in range(len(prompts))}

    _, ref = run({})
    spec = dict(use_ngram_draft=True) if drafter == "ngram" else dict(draft_model=truncated_model(model, 8))
    gen, got = run(dict(num_draft_tokens=4, **spec))
    assert got == ref
    assert gen.metrics()["drafted_tokens"] > 0


@pytest.mark.parametrize("k", [2, 4])
def test_draft_positions_get_their_own_bias(k):
    """Stop tokens are banned before min_new_tokens and allowed after it, position by position inside one
    verification row (a row that used its first position's bias throughout would skip the stop token)."""
    script = {ord("z"): (10, list(b"ab ab ab ab"))}

    def jobs():
        return [Job(TOK.encode("zab ab ab "), 10, min_new_tokens=m, gen_settings=GREEDY, identifier=m,
                    stop_conditions=[ord("b")]) for m in (2, 3, 4)]

    refs = {m: stream_of(run_fake(FakeEngine, jobs=[j], script=script)[1].results) for m, j in
            zip((2, 3, 4), jobs())}
    for j in jobs():
        gen, got = run_fake(FakeEngine, {**NGRAM, "num_draft_tokens": k}, jobs=[j], script=script)
        assert stream_of(got.results) == refs[j.identifier]
        assert gen.metrics()["accepted_draft_tokens"] > 0


def test_drafts_stop_at_max_new_tokens():
    """A row never verifies more drafts than the job may still emit: nothing is written at or past the position of
    the job's last token, even with pages to spare."""
    prompt = TOK.encode("the cat sat. the cat sat. the cat ")
    for n in (1, 2, 5, 7):
        gen, c = run_fake(CopyFakeEngine, {**NGRAM, "num_draft_tokens": 6}, jobs=[Job(prompt, n, gen_settings=GREEDY)],
                          page_size=64, num_pages=8, max_seq_len=128)
        assert c.finals[None]["new_tokens"] == n
        assert max(r.start_pos + len(r.tokens) for rows in gen.engine.calls for r in rows) <= len(prompt) + n - 1


@pytest.mark.parametrize("stop", ["d", "f"])
def test_the_statistics_count_only_what_the_job_emitted(stop):
    """A stop token among a row's accepted drafts ends the job there: the drafts past it (accepted or not) and the
    row's own token count nowhere, so the tokens the rows emitted are mean_accepted_length x verification_rows, and
    the job's final counts are the generator's (they had counted all of the row's drafts: 4 accepted drafts for a
    job of 3 tokens, mean accepted length 5 for rows that emitted 2)."""
    prompt = TOK.encode("abcdef" * 4 + "ab")  # the fake copies 6 tokens back: "cdefab..." drafted and accepted
    gen, c = run_fake(CopyFakeEngine, {**NGRAM, "num_draft_tokens": 6},
                      jobs=[Job(prompt, 20, gen_settings=GREEDY, stop_conditions=[ord(stop)])],
                      page_size=64, num_pages=8, max_seq_len=128)
    f, m = c.finals[None], gen.metrics()
    assert f["eos_reason"] == "stop_token" and m["verification_rows"] > 0
    plain = sum(1 for rows in gen.engine.calls for r in rows if r.sample and not r.verify)
    assert f["new_tokens"] == plain + round(m["mean_accepted_length"] * m["verification_rows"])
    assert (f["accepted_draft_tokens"], f["rejected_draft_tokens"]) == (m["accepted_draft_tokens"],
                                                                        m["rejected_draft_tokens"])
    assert m["accepted_draft_tokens"] <= f["new_tokens"] - plain
    assert sum(m["accepted_at_position"]) == m["accepted_draft_tokens"]


def test_the_draft_cache_mirrors_the_target_cache():
    """The draft model's cache holds, at every position of a job it records as written, the K/V the target's cache
    holds there (draft = the target's weights): the prompt's prefill chunks reach it through the mirror (forward
    only), the rest through its drafting. A broken mirror can pass the identity tests on a tiny random model, whose
    next token hardly depends on the context; this compares the caches themselves."""
    gen = DynamicGenerator(MODEL, **SETTINGS, draft_model=MODEL, num_draft_tokens=3)
    # three jobs at once (their rows share mirror calls); the first's 35 prompt tokens take three prefill chunks
    jobs = [Job(TOK.encode(p), 16, gen_settings=GREEDY) for p in PROMPTS[:3]]
    gen.enqueue(jobs)
    checked = 0
    while gen.num_remaining_jobs():
        gen.iterate()
        checked += check_draft_cache(gen, jobs)
    assert checked >= 9


def check_draft_cache(gen, jobs, hashed: dict | None = None) -> int:
    """Assert that the draft cache holds the target's K/V (draft = the target's weights) at every position of each
    job that it records as written; returns the number of jobs checked. With `hashed` (a dict the caller keeps
    across steps), also over the pages of each running job that were hashed before this step (the prompt cache
    may share them from this step on), whatever the draft records."""
    draft = gen.speculation.speculator.draft
    ps = draft.engine.config.page_size
    checked = 0
    for job in jobs:
        n = draft.kv.get(job, 0)
        if hashed is not None and job in draft.kv:
            n = max(n, hashed.get(job, 0) * ps)
            hashed[job] = len(job.page_hashes)
        if not n or not job.pages:
            continue
        pos = np.arange(n)
        pages, off = np.asarray(job.pages)[pos // ps], pos % ps
        for name in ("k", "v"):
            target = np.asarray(getattr(gen.engine.state, name))[:, :, pages, off]
            mirrored = np.asarray(getattr(draft.engine.state, name))[:, :, pages, off]
            assert np.abs(target).max() > 0
            np.testing.assert_allclose(mirrored, target, atol=1e-4, rtol=1e-4)
        checked += 1
    return checked
