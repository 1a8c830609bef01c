"""DynamicGenerator on a tiny random-weight model: continuous batching, prefix sharing and seeds give exactly the
tokens each job produces alone."""

from __future__ import annotations

import numpy as np
import pytest

from models.llama import greedy_generate
from paged import DynamicGenerator, Job, SamplingSettings
from paged.testing import drain, quantized_tiny_model, tiny_config, tiny_model
from pallas_kernels import native_attention
from pallas_kernels.native import unavailable_reason as native_unavailable

pytestmark = pytest.mark.fresh_programs  # (counts compiled variants)

CFG = tiny_config(96)
MODEL = tiny_model(CFG, seed=1)


@pytest.fixture(scope="module")
def gen():
    g = DynamicGenerator(MODEL, num_pages=48, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=64)
    return g


def tokens_of(c, ident):
    return [t for r in c.results if r["identifier"] == ident and r["stage"] == "streaming" for t in r["token_ids"]]


@pytest.mark.skipif(native_unavailable() is not None or native_attention.unavailable_reason(64) is not None,
                    reason="needs the native matmul and attention")
def test_a_job_gets_the_same_bits_alone_and_in_a_crowd():
    """On the CPU default path (native matmul with int8 activations, native attention) a job's logits and tokens (a
    seeded sampled job's draws too) do not depend on the batch around it: each job run alone, prompt in chunks of
    64, against the four together, prompts in chunks of 24 sharing steps with the others' decode rows, bit for bit
    at every token. (XLA's row reduction sums one row in another order than many, and XLA's attention for long
    prefill windows differs from the native kernel's per query; with either, most SmolLM2 prompts' greedy text
    changed with the batch: 13 of 16 copy prompts at batch 16 against batch 1. `models.invariant`.)"""
    model = quantized_tiny_model()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 258, size=n)] for n in (3, 41, 17, 70)]

    sampled = SamplingSettings(temperature=0.8)  # job 2 samples, seeded: its draws must not move either

    def jobs(idx):
        return [Job(prompts[i], 12, gen_settings=sampled if i == 2 else SamplingSettings.greedy(), identifier=i,
                    return_logits=True, seed=7 if i == 2 else None) for i in idx]

    def logits_of(c, i):
        return np.concatenate([np.asarray(r["logits"]).reshape(-1, 258) for r in c.results
                               if r["identifier"] == i and r.get("logits") is not None])

    small = DynamicGenerator(model, num_pages=64, page_size=16, max_batch_size=4, max_chunk_size=64, max_seq_len=128,
                             max_penalty_range=0, matmul_impl="native", attn_impl="native")
    alone, alone_tokens = {}, {}
    for i in range(len(prompts)):
        small.enqueue(jobs([i]))
        one = drain(small)
        alone[i], alone_tokens[i] = logits_of(one, i), tokens_of(one, i)
    crowd = DynamicGenerator(model, num_pages=64, page_size=16, max_batch_size=4, max_chunk_size=24, max_seq_len=128,
                             max_penalty_range=0, matmul_impl="native", attn_impl="native")
    crowd.enqueue(jobs(range(len(prompts))))
    c = drain(crowd)
    for i in range(len(prompts)):
        got = logits_of(c, i)
        assert got.shape == alone[i].shape and np.array_equal(got, alone[i]), (i, np.abs(got - alone[i]).max())
        assert tokens_of(c, i) == alone_tokens[i], i


@pytest.mark.slow  # fast tier: a lighter test covers the same path
def test_continuous_batching_matches_each_job_alone(gen):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 96, size=n)) for n in (3, 20, 9, 33, 1, 14)]
    news = [6, 4, 9, 5, 7, 3]
    for i, (p, n) in enumerate(zip(prompts, news)):
        gen.enqueue(Job(p, n, gen_settings=SamplingSettings.greedy(), identifier=i))
    c = drain(gen)
    for i, (p, n) in enumerate(zip(prompts, news)):
        assert tokens_of(c, i) == greedy_generate(MODEL.params, CFG, p, n), f"job {i}"
    gen.pool.check({})


@pytest.mark.slow  # fast tier: prefix sharing on the fake engine (test_generator_fake.py)
def test_shared_prefix_jobs_are_exact_and_share_pages(gen):
    rng = np.random.default_rng(1)
    prefix = list(rng.integers(0, 96, size=24))
    prompts = [prefix + list(rng.integers(0, 96, size=k)) for k in (2, 5, 9)]
    for i, p in enumerate(prompts):
        gen.enqueue(Job(p, 5, gen_settings=SamplingSettings.greedy(), identifier=("shared", i)))
    gen.iterate()
    shared = [j.pages[:3] for j in gen.active]
    assert len(shared) == 3 and all(s == shared[0] for s in shared)
    c = drain(gen)
    for i, p in enumerate(prompts):
        assert tokens_of(c, ("shared", i)) == greedy_generate(MODEL.params, CFG, p, 5)
    # the same prompt again is served from the prompt cache, with the same output
    gen.enqueue(Job(prompts[1], 5, gen_settings=SamplingSettings.greedy(), identifier="again"))
    c = drain(gen)
    assert c.finals["again"]["cached_tokens"] == 24
    assert tokens_of(c, "again") == greedy_generate(MODEL.params, CFG, prompts[1], 5)


def test_seeded_job_samples_the_same_alone_and_in_a_crowd(gen):
    s = SamplingSettings(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.1)
    prompt = [5, 6, 7, 8, 9]
    gen.enqueue(Job(prompt, 8, gen_settings=s, seed=42, identifier="alone"))
    alone = tokens_of(drain(gen), "alone")
    gen.pool.reset_cache()
    rng = np.random.default_rng(3)
    for i in range(3):
        gen.enqueue(Job(list(rng.integers(0, 96, size=7 + i)), 8, gen_settings=s, seed=i, identifier=("crowd", i)))
    gen.enqueue(Job(prompt, 8, gen_settings=s, seed=42, identifier="crowded"))
    assert tokens_of(drain(gen), "crowded") == alone
    # it really samples: greedy decoding with the same penalty and another seed both give other tokens
    gen.enqueue([Job(prompt, 8, gen_settings=SamplingSettings.greedy(repetition_penalty=1.1), identifier="greedy"),
                 Job(prompt, 8, gen_settings=s, seed=43, identifier="other seed")])
    c = drain(gen)
    for other in ("greedy", "other seed"):
        assert len(tokens_of(c, other)) == 8
        assert sum(a != b for a, b in zip(tokens_of(c, other), alone)) >= 4, (other, tokens_of(c, other), alone)


def test_min_new_tokens_and_stop_token(gen):
    from models.llama import forward

    prompt = [1, 2, 3]
    ref = greedy_generate(MODEL.params, CFG, prompt, 6)
    stop = ref[1]
    gen.enqueue(Job(prompt, 6, gen_settings=SamplingSettings.greedy(), stop_conditions=[stop], identifier="s"))
    c = drain(gen)
    assert c.finals["s"]["eos_reason"] == "stop_token" and c.finals["s"]["new_tokens"] == 2
    assert tokens_of(c, "s") == ref[:1]
    # with min_new_tokens=3 the stop token is banned for the first 3 tokens: dense greedy decoding with that ban
    out, reason = [], "max_new_tokens"
    while len(out) < 6:
        logits = np.array(forward(MODEL.params, CFG, np.asarray([prompt + out], np.int32)))[0, -1]
        if len(out) < 3:
            logits[stop] = -np.inf
        t = int(np.argmax(logits))
        if t == stop:
            reason = "stop_token"
            break
        out.append(t)
    assert out[:1] == ref[:1] and out[1] != stop
    gen.enqueue(Job(prompt, 6, gen_settings=SamplingSettings.greedy(), stop_conditions=[stop], min_new_tokens=3,
                    identifier="m"))
    c = drain(gen)
    assert tokens_of(c, "m") == out and c.finals["m"]["eos_reason"] == reason
    assert c.finals["m"]["new_tokens"] == len(out) + (reason == "stop_token") >= 3


def test_return_probs_top_tokens_and_logits(gen):
    from models.llama import forward

    prompt = [4, 4, 4]
    gen.enqueue(Job(prompt, 3, gen_settings=SamplingSettings.greedy(), return_probs=True, return_top_tokens=3,
                    return_logits=True, identifier="x"))
    c = drain(gen)
    rows = [r for r in c.results if r["identifier"] == "x" and r["stage"] == "streaming"]
    tokens = [t for r in rows for t in r["token_ids"]]
    assert tokens == greedy_generate(MODEL.params, CFG, prompt, 3)
    assert [len(r["token_ids"]) for r in rows] == [1, 1, 1]  # no tokenizer: every token is released at once
    # the dense forward over prompt + output gives the reference distribution at each sampled position
    ref = np.asarray(forward(MODEL.params, CFG, np.asarray([prompt + tokens], np.int32)))[0][len(prompt) - 1 : -1]
    ref_probs = np.exp(ref - ref.max(-1, keepdims=True))
    ref_probs /= ref_probs.sum(-1, keepdims=True)
    for r, t, logits, probs in zip(rows, tokens, ref, ref_probs, strict=True):
        assert len(r["token_probs"]) == len(r["top_k_tokens"]) == len(r["top_k_probs"]) == len(r["logits"]) == 1
        top = np.argsort(-probs)[:3].tolist()
        assert r["top_k_tokens"][0] == top and top[0] == t  # greedy: the chosen token is the most probable
        np.testing.assert_allclose(r["top_k_probs"][0], probs[top], rtol=1e-4)
        assert r["top_k_probs"][0] == sorted(r["top_k_probs"][0], reverse=True) and sum(r["top_k_probs"][0]) <= 1
        np.testing.assert_allclose(r["token_probs"][0], probs[t], rtol=1e-4)
        assert r["token_probs"][0] == pytest.approx(r["top_k_probs"][0][0], rel=1e-6)
        assert r["logits"].shape == (1, CFG.vocab_size)
        np.testing.assert_allclose(r["logits"][0], logits, atol=1e-4 * np.abs(logits).max())


def test_token_healing_keeps_the_models_odds_among_the_candidates():
    """The healed first token is drawn from the model's distribution restricted to the tokens that start with the
    dropped text. Healing had added 1e4 to the candidates' logits, which the sampler's clamp to +-1e4 cut back: every
    candidate above 0 became 1e4, tied (greedy took the lowest id, sampling became uniform)."""
    import dataclasses

    from models.llama import forward
    from models.tokenizer import load_tokenizer_from_dir

    tok = load_tokenizer_from_dir("tests/models/data/tiny_bpe")
    cfg = dataclasses.replace(CFG, vocab_size=tok.vocab_size)
    model = tiny_model(cfg, seed=2, tokenizer=tok, source="tiny-bpe")
    ids = tok.encode("the quick brown fox s")  # the last token " s" starts 5 tokens
    dropped = tok.token_bytes(ids[-1])
    cand = [t for t in range(tok.vocab_size) if tok.token_bytes(t).startswith(dropped)]
    assert len(cand) >= 3
    bias = {cand[1]: 20.0, cand[2]: 25.0}  # two candidates far above 0 (the clamp had tied them)
    logits = np.asarray(forward(model.params, cfg, np.asarray([ids[:-1]], np.int32)))[0, -1][cand]
    logits += np.asarray([bias.get(t, 0.0) for t in cand])
    ref = np.exp(logits - logits.max())
    ref /= ref.sum()
    gen = DynamicGenerator(model, num_pages=16, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=64)
    gen.enqueue(Job(ids, 1, token_healing=True, gen_settings=SamplingSettings(temperature=0.0, token_bias=bias),
                    return_top_tokens=3, return_probs=True, identifier="h"))
    r = next(r for r in drain(gen).results if r["stage"] == "streaming" and r["token_ids"])
    order = np.argsort(-ref)[:3]
    assert r["token_ids"][0] == cand[order[0]] == cand[2]
    assert r["top_k_tokens"][0] == [cand[i] for i in order]
    np.testing.assert_allclose(r["top_k_probs"][0], ref[order], rtol=1e-3, atol=1e-6)


def test_token_healing_constrains_the_first_token_and_strips_its_prefix():
    import dataclasses

    from models.tokenizer import load_tokenizer_from_dir

    tok = load_tokenizer_from_dir("tests/models/data/tiny_bpe")
    cfg = dataclasses.replace(CFG, vocab_size=tok.vocab_size)
    model = tiny_model(cfg, seed=2, tokenizer=tok, source="tiny-bpe")
    gen = DynamicGenerator(model, num_pages=16, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=64)
    ids = tok.encode("the quick brown fox jump")
    dropped = tok.token_bytes(ids[-1])
    gen.enqueue(Job(ids, 6, token_healing=True, gen_settings=SamplingSettings(temperature=1.0, top_k=0, top_p=1.0),
                    seed=3, identifier="h"))
    c = drain(gen)
    generated = [t for r in c.results if r["stage"] == "streaming" for t in r["token_ids"]]
    assert tok.token_bytes(generated[0]).startswith(dropped)
    assert c.finals["h"]["prompt_tokens"] == len(ids) - 1
    full = tok.decode(ids[:-1] + generated)
    assert tok.decode(ids[:-1]) + dropped.decode() + c.finals["h"]["full_completion"] == full


def test_warmup_compiles_every_bucket_once_and_forgets_the_prompt_cache():
    from paged.device.engine import count_compiles

    def forwards() -> int:  # the forward of each bucket: alone, or with its sampler in one program (decode-only)
        c = count_compiles()
        return c["step"] + c["fused"]

    g = DynamicGenerator(MODEL, num_pages=12, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=16,
                         max_penalty_range=0)
    start = forwards()  # no other test here uses this geometry: none of its buckets is compiled yet
    g.enqueue(Job(list(range(1, 12)), 3, gen_settings=SamplingSettings.greedy()))
    drain(g)
    assert g.pool.num_cached > 0
    shapes = g.engine.spec.all_shapes()
    assert 0 < forwards() - start < len(shapes)
    n = g.warmup()
    assert n == len(shapes) == forwards() - start  # every bucket, each compiled once
    assert g.pool.num_cached == 0 and g.pool.num_free == g.pool.num_pages
    before = forwards()
    g.warmup()  # everything is compiled now
    assert forwards() == before
    g.enqueue([Job(list(range(1, 12)), 3, gen_settings=SamplingSettings.greedy()),
               Job(list(range(20, 25)), 5, gen_settings=SamplingSettings.greedy())])
    drain(g)  # the generator's own calls hit the warmed-up variants: no compile while serving
    assert forwards() == before


@pytest.mark.parametrize("attn_impl, cache_dtype", [pytest.param("pallas", "float32", marks=pytest.mark.slow),
                                                    ("xla", "int8")])
def test_generator_output_with_other_attention_impls_and_int8_cache(attn_impl, cache_dtype):
    g = DynamicGenerator(MODEL, num_pages=8, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=32,
                         attn_impl=attn_impl, cache_dtype=cache_dtype, max_penalty_range=0)
    prompts = [[7, 3, 9, 1, 4, 4, 2, 8, 5], [11, 12]]
    for i, p in enumerate(prompts):
        g.enqueue(Job(p, 4, gen_settings=SamplingSettings.greedy(), identifier=i))
    c = drain(g)
    for i, p in enumerate(prompts):
        assert tokens_of(c, i) == greedy_generate(MODEL.params, CFG, p, 4)


@pytest.mark.slow  # fast tier: a lighter test covers the same path
def test_multi_step_decode_matches_single_steps_token_for_token():
    """decode_steps=4 runs bursts through `paged.device.step.decode_steps`: greedy, seeded sampling and penalties (whose
    window is the history bucket) give the same tokens and probabilities as one step per iterate."""
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, 96, size=n)) for n in (5, 12, 7)]
    settings = [SamplingSettings.greedy(),
                SamplingSettings(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.0),
                SamplingSettings(temperature=0.7, top_k=0, top_p=1.0, repetition_penalty=1.3, penalty_range=64)]

    def run(steps):
        g = DynamicGenerator(MODEL, num_pages=24, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=48,
                             max_penalty_range=64, decode_steps=steps)
        calls = []
        engine_run = g.engine.run
        g.engine.run = lambda rows, **kw: calls.append(kw.get("num_steps", 1)) or engine_run(rows, **kw)
        g.enqueue([Job(p, 13, gen_settings=s, seed=7 + i, identifier=i, return_probs=True)
                   for i, (p, s) in enumerate(zip(prompts, settings))])
        c = drain(g)
        g.pool.check({})
        return c, g, calls

    one, g1, calls1 = run(1)
    from paged.device.engine import count_compiles

    warm = DynamicGenerator(MODEL, num_pages=24, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=48,
                            max_penalty_range=64, decode_steps=4)
    assert warm.warmup() == len(warm.engine.spec.all_shapes()) + sum(
        1 for s in warm.engine.spec.all_shapes() if not s.layout.num_prefill_rows)
    before = count_compiles()
    four, g4, calls4 = run(4)
    assert count_compiles() == before  # the bursts' variants were compiled by warmup()
    assert set(calls1) == {1} and 4 in calls4 and len(calls4) < len(calls1)
    assert g4.metrics()["tokens_generated"] == g1.metrics()["tokens_generated"] == 39
    for i in range(3):
        assert tokens_of(four, i) == tokens_of(one, i), f"job {i}"
        p1 = [p for r in one.results if r["identifier"] == i for p in r.get("token_probs", [])]
        p4 = [p for r in four.results if r["identifier"] == i for p in r.get("token_probs", [])]
        assert len(p1) == len(p4) == 13
        np.testing.assert_allclose(p4, p1, rtol=1e-5)
