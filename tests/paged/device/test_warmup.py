"""`warmup()` compiles every variant serving can hit: after it, a workload mixing prompt lengths, batch sizes, logit
bias (small and large), top-k / probs / logits returns, every sampler option, min_new_tokens, token healing, banned
strings and decode bursts traces and compiles nothing. Plus the exactness of the runtime paths that replaced static
switches: the dense bias, top-k wider than the device computes, bursts run as single steps."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.tokenizer import load_tokenizer_from_dir
from paged import DynamicGenerator, Job, SamplingSettings
from paged.device.batch import RowInput, build_batch
from paged.device.buckets import BIAS_WIDTH
from paged.device.engine import Engine, count_compiles, host_top_k
from paged.device.step import TOP_K_WIDTH, StepStatics, lm_head, sample_inputs, step_sample
from paged.testing import drain, tiny_config, tiny_model

pytestmark = pytest.mark.fresh_programs  # (counts compiled variants)

TOK = load_tokenizer_from_dir("tests/models/data/tiny_bpe")  # 601 ids: enough for ban lists wider than BIAS_WIDTH
CFG = tiny_config(TOK.vocab_size, rope_theta=31000.0)  # a config no other module uses
MODEL = tiny_model(CFG, seed=4, tokenizer=TOK, source="tiny-bpe")
SPECIAL = getattr(TOK, "special_token_ids", frozenset())
ORDINARY = np.asarray([i for i in range(CFG.vocab_size) if i not in SPECIAL])


@contextlib.contextmanager
def count_jax_compiles():
    """Counts JAX traces and backend compilations of anything (jitted entry points and eager ops) inside."""
    seen = {"/jax/core/compile/jaxpr_trace_duration": 0, "/jax/core/compile/backend_compile_duration": 0}

    def listen(event: str, duration: float, **kw) -> None:
        if event in seen:
            seen[event] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.choice(ORDINARY, size=n).tolist()


def _workload(rng: np.random.Generator) -> list[list[Job]]:
    """Waves of jobs (each wave enqueued at once, the generator drained in between): batch sizes 1 to beyond max."""
    prefix = _ids(rng, 24)
    sampled = dict(temperature=0.9, top_k=0, top_p=1.0, repetition_penalty=1.0)
    healing = TOK.encode("the quick brown fox jump")
    big_bias = {int(t): float(v) for t, v in zip(ORDINARY[:300], rng.normal(size=300))}  # > BIAS_WIDTH entries
    assert len(big_bias) > BIAS_WIDTH
    waves = [
        [Job(_ids(rng, 3), 4, gen_settings=SamplingSettings.greedy(), return_probs=True)],
        [Job(_ids(rng, 40), 6, gen_settings=SamplingSettings(**{**sampled, "top_k": 20}), seed=1, return_top_tokens=3),
         Job(prefix + _ids(rng, 2), 5, gen_settings=SamplingSettings(**{**sampled, "top_p": 0.8}), seed=2,
             return_top_tokens=100)],  # wider than TOP_K_WIDTH: from the final distribution, on the host
        [Job(prefix + _ids(rng, 5), 5, gen_settings=SamplingSettings.greedy(), return_logits=True),
         Job(_ids(rng, 9), 7, gen_settings=SamplingSettings(**{**sampled, "min_p": 0.05}), seed=3,
             return_top_tokens=64),
         Job(_ids(rng, 17), 6, gen_settings=SamplingSettings(**{**sampled, "typical": 0.7}), seed=4),
         Job(_ids(rng, 5), 8, gen_settings=SamplingSettings.greedy(repetition_penalty=1.3, penalty_range=8)),
         Job(_ids(rng, 12), 8, gen_settings=SamplingSettings(temperature=0.7, frequency_penalty=0.4,
                                                             presence_penalty=0.3, penalty_range=4096), seed=5),
         Job(_ids(rng, 6), 5, gen_settings=SamplingSettings.greedy(banned_tokens=ORDINARY[100:400].tolist())),
         Job(_ids(rng, 7), 5, gen_settings=SamplingSettings(**sampled, token_bias={5: 2.0, 9: -1.5}), seed=6,
             return_probs=True, return_top_tokens=1),
         Job(_ids(rng, 4), 5, gen_settings=SamplingSettings(**sampled, token_bias=big_bias), seed=7),
         Job(_ids(rng, 8), 6, min_new_tokens=4, stop_conditions=[int(ORDINARY[7]), int(ORDINARY[8])],
             gen_settings=SamplingSettings.greedy()),
         Job(healing, 5, token_healing=True, gen_settings=SamplingSettings(**sampled), seed=8),
         Job(TOK.encode("the quick"), 8, banned_strings=[" brown", " fox"], stop_conditions=["jump"],
             gen_settings=SamplingSettings(**sampled), seed=9)],
        # bursts with and without top-k; the jobs end one after another: bursts of 4, 3, 2 and 1 rows
        [Job(_ids(rng, n), m, gen_settings=SamplingSettings.greedy(), return_top_tokens=k)
         for n, m, k in ((2, 7, 0), (3, 13, 5), (4, 19, 0), (5, 25, 2))],
    ]
    return waves


@pytest.mark.slow  # fast tier: tests/paged/host/test_generator.py::test_warmup_compiles_every_bucket_once...
def test_warmup_covers_everything_serving_hits():
    gen = DynamicGenerator(MODEL, num_pages=40, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=64,
                           max_prefill_rows=2, max_penalty_range=32, decode_steps=3)
    variants = gen.engine.variants(decode_steps=3)
    before = count_compiles()
    n = gen.warmup()
    spec = gen.engine.spec
    assert n == len(spec.all_shapes()) + len(spec.decode_rows) - 1  # buckets + a burst per decode-only bucket
    compiled = {k: count_compiles()[k] - before[k] for k in before}
    kinds = [v[0] for v in variants]
    assert compiled == {k: kinds.count(k) for k in before}
    warm = count_compiles()
    calls = []
    engine_run = gen.engine.run
    gen.engine.run = lambda rows, **kw: calls.append((len(rows), kw)) or engine_run(rows, **kw)
    with count_jax_compiles() as seen:
        for wave in _workload(np.random.default_rng(0)):
            gen.enqueue(wave)
            c = drain(gen)
            assert all(r["eos_reason"] != "error" for r in c.finals.values()), c.finals
    assert count_compiles() == warm
    assert seen == {"/jax/core/compile/jaxpr_trace_duration": 0, "/jax/core/compile/backend_compile_duration": 0}
    # the workload did reach what it was meant to: every batch size, bursts, top-k and logits requests
    assert {n for n, _ in calls} == {1, 2, 3, 4}
    assert {n for n, kw in calls if kw.get("num_steps", 1) > 1} == {1, 2, 3, 4}  # every burst bucket
    assert any(kw.get("num_steps", 1) > 1 and kw["return_top_k"] for _, kw in calls)
    assert {kw["return_top_k"] for _, kw in calls} >= {0, 1, 4, 64, 128}
    assert any(kw["return_logits"] for _, kw in calls)


def test_dense_bias_rows_sample_like_sparse_ones():
    """A row with more bias entries than BIAS_WIDTH goes through the dense [S, V] bias: the same final distribution
    and tokens as the same bias in the sparse arrays."""
    eng = Engine(MODEL, num_pages=12, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=32,
                 max_penalty_range=0)
    rng = np.random.default_rng(1)
    bias = {int(t): float(v) for t, v in zip(rng.choice(CFG.vocab_size, 400, replace=False), rng.normal(size=400))}
    bias.update({int(t): -np.inf for t in rng.choice(CFG.vocab_size, 50, replace=False)})
    rows = [RowInput(tokens=[3], start_pos=5, pages=[1], sampling={"temperature": 1.0, "seed": 5}, bias=bias),
            RowInput(tokens=[4], start_pos=6, pages=[2], sampling={"temperature": 0.0}, bias={7: 1.0}),
            RowInput(tokens=[5], start_pos=2, pages=[3], sampling={"temperature": 1.0, "top_k": 9, "seed": 6},
                     bias=dict(list(bias.items())[:30]))]
    shape = eng.shape_for(rows)
    h = jnp.asarray(rng.normal(size=(shape.num_rows, CFG.hidden_size)).astype(np.float32) * 3)
    head = lm_head(MODEL.params)

    def final(shape):
        batch, _ = build_batch(rows, shape, 8, CFG.vocab_size)
        res = step_sample(head, h, sample_inputs(batch), np.bool_(True), statics=StepStatics(CFG))
        return batch, jax.device_get(res)

    dense_batch, dense = final(shape)
    assert bool(dense_batch.bias_dense_on) and float(jnp.abs(dense_batch.bias_dense).sum()) > 0
    sparse_batch, sparse = final(dataclasses.replace(shape, num_bias=512))
    assert not bool(sparse_batch.bias_dense_on)
    np.testing.assert_array_equal(dense.final, sparse.final)
    np.testing.assert_array_equal(dense.token, sparse.token)
    np.testing.assert_array_equal(dense.top_ids, sparse.top_ids)
    assert np.isneginf(dense.final[0, [t for t, v in bias.items() if v == -np.inf]]).all()


def test_top_k_wider_than_the_device_width_matches_lax_top_k():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 5, size=(3, 4, 700)).astype(np.float32)  # many ties
    x[rng.random(x.shape) < 0.6] = -np.inf
    for k in (TOP_K_WIDTH + 1, 200, 700):
        ids, vals = host_top_k(x, k)
        want_vals, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(ids, np.asarray(want_ids))
        np.testing.assert_array_equal(vals, np.asarray(want_vals))


@pytest.mark.parametrize("return_top_k, return_logits", [pytest.param(128, False, marks=pytest.mark.slow), (2, True)])
def test_burst_asking_for_logits_or_wide_top_k_runs_as_single_steps(return_top_k, return_logits):
    eng = Engine(MODEL, num_pages=12, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=32,
                 max_prefill_rows=2, max_penalty_range=16)
    rows = [RowInput(tokens=[11, 12, 13], start_pos=0, pages=[1, 2], sampling={"temperature": 0.0}),
            RowInput(tokens=[21, 22], start_pos=0, pages=[3, 4],
                     sampling={"temperature": 1.0, "repetition_penalty": 1.5, "seed": 3}, history=[21, 22])]

    def decode_rows(out):
        return [RowInput(tokens=[int(t)], start_pos=len(r.tokens), pages=r.pages, sampling=r.sampling,
                         history=list(r.history) + [int(t)] if r.history else ()) for r, t in zip(rows, out.token)]

    first = eng.run(rows)
    burst = eng.run(decode_rows(first), return_top_k=return_top_k, return_logits=return_logits, num_steps=3)
    fast = eng.run(decode_rows(first), num_steps=3)  # the scan variant: the same tokens
    np.testing.assert_array_equal(burst.token, fast.token)
    np.testing.assert_allclose(burst.logprob, fast.logprob, rtol=1e-5)
    assert burst.top_ids.shape == (3, 2, return_top_k) and (burst.logits is not None) == return_logits
    singles = []
    cur = decode_rows(first)
    for _ in range(3):
        out = eng.run(cur, return_top_k=return_top_k, return_logits=return_logits)
        singles.append(out)
        cur = [dataclasses.replace(r, tokens=[int(t)], start_pos=r.start_pos + 1,
                                   history=list(r.history) + [int(t)] if r.history else ())
               for r, t in zip(cur, out.token)]
    np.testing.assert_array_equal(burst.token, np.stack([o.token for o in singles]))
    np.testing.assert_array_equal(burst.top_ids, np.stack([o.top_ids for o in singles]))


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_warmup_covers_speculative_steps(drafter):
    """With speculation on, warmup() compiles the verification buckets (forward and verification sampler per row
    count) and a draft engine's buckets and proposal bursts; a speculative workload (verification rows alone and
    beside prefill chunks, greedy and sampled rows, penalties) then compiles nothing. With it off, the variants are
    exactly the plain ones (test_warmup_covers_everything_serving_hits)."""
    from models.draft import truncated_model
    from paged.speculation.config import SpeculationConfig
    from paged.speculation.speculator import Speculator
    from tests.paged.speculation.test_speculative import _loop

    settings = dict(num_pages=40, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=64,
                    max_prefill_rows=1, max_penalty_range=16)
    jax.clear_caches()  # count this test's compilations alone (the parametrizations share buckets)
    plain = len(Engine(MODEL, **settings).variants())
    kw = dict(use_ngram_draft=True) if drafter == "ngram" else dict(draft_model=truncated_model(MODEL, 1))
    engine = Engine(MODEL, **settings, verification=SpeculationConfig.of(num_draft_tokens=3, **kw).verification())
    spec = Speculator.of(engine, num_draft_tokens=3, **kw)
    engines = [engine] + ([spec.draft.engine] if spec.draft is not None else [])
    kinds = [v[0] for e in engines for v in e.variants()]
    assert len(engine.variants()) == plain + len(engine.spec.verify_shapes()) + len(engine.spec.decode_rows) - 1
    before = count_compiles()
    engine.warmup()
    spec.warmup()
    compiled = {k: count_compiles()[k] - before[k] for k in before}
    assert compiled == {k: kinds.count(k) for k in before}
    warm = count_compiles()
    rng = np.random.default_rng(5)
    motif = _ids(rng, 4)
    prompts = [motif * 3, _ids(rng, 20), _ids(rng, 2) + motif * 2]  # the n-gram drafter matches the motifs
    sampling = [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 30, "seed": 3, "repetition_penalty": 1.2},
                {"temperature": 1.0, "seed": 4}]
    with count_jax_compiles() as seen:
        # the first job is pushed to repeat its motif (a logit bias), so the n-gram drafter finds matches
        outs, _ = _loop(engine, spec, prompts, 9, sampling, biases=[{int(t): 8.0 for t in motif}, None, None])
    assert all(len(o) == 9 for o in outs)
    assert count_compiles() == warm
    assert seen == {"/jax/core/compile/jaxpr_trace_duration": 0, "/jax/core/compile/backend_compile_duration": 0}
    assert spec.stats()["drafted_tokens"] > 0
