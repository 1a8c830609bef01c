"""The paged step against the dense model forward: random page permutations, page sizes, chunk splits and mixes of
prefill and decode rows; donation; seed invariance; multi-step decode."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from models import init_random_weights
from models.llama import forward
from paged.device.batch import RowInput, build_batch
from paged.device.buckets import BucketSpec
from paged.device.state import EngineState
from paged.device.step import decode_burst, step
from paged.testing import tiny_config

pytestmark = pytest.mark.fresh_programs  # (counts compiled variants)

CFG = tiny_config(96)
PARAMS = init_random_weights(CFG, seed=0)


def dense_logits(tokens: list[int], cfg=CFG, params=PARAMS) -> np.ndarray:
    return np.asarray(forward(params, cfg, jnp.asarray([tokens], jnp.int32)))[0]


def run_schedule(seqs, page_size, rng, attn_impl, cfg=CFG, params=PARAMS, max_chunk=16):
    """Feed every sequence through the paged step in random chunks; return logits per (seq, position)."""
    max_len = max(len(s) for s in seqs)
    pages_per_seq = -(-max_len // page_size)
    num_pages = 1 + len(seqs) * pages_per_seq
    perm = list(rng.permutation(np.arange(1, num_pages)))
    pages = [[perm.pop() for _ in range(pages_per_seq)] for _ in seqs]
    spec = BucketSpec(max_batch_size=len(seqs), max_chunk_size=max_chunk, max_pages_per_row=pages_per_seq,
                      max_prefill_rows=2, page_size=page_size, min_q_len=4, min_context=page_size)
    state = EngineState.create(cfg, num_pages, page_size)
    done = [0] * len(seqs)
    got = {}
    while any(d < len(s) for d, s in zip(done, seqs)):
        rows, owners = [], []
        n_prefill = 0
        for i, s in enumerate(seqs):
            if done[i] >= len(s) or rng.random() < 0.2:
                continue
            n = int(rng.integers(1, max_chunk + 1)) if rng.random() < 0.5 else 1
            n = min(n, len(s) - done[i])
            if n > 1:
                if n_prefill == 2:
                    n = 1
                else:
                    n_prefill += 1
            rows.append(RowInput(tokens=s[done[i] : done[i] + n], start_pos=done[i], pages=pages[i]))
            owners.append(i)
        if not rows:
            continue
        shape = spec.shape_for([len(r.tokens) for r in rows if not r.is_decode],
                               sum(r.is_decode for r in rows), pages_per_seq, 0)
        batch, slots = build_batch(rows, shape, page_size)
        state, res = step(PARAMS if params is None else params, state, batch, cfg=cfg, shape=shape,
                          return_logits=True, attn_impl=attn_impl)
        logits = np.asarray(res.logits)
        for r, i, slot in zip(rows, owners, slots):
            done[i] += len(r.tokens)
            got[(i, done[i] - 1)] = logits[slot]
    return got


SLOW = pytest.mark.slow


@pytest.mark.parametrize("page_size", [pytest.param(8, marks=SLOW), 16, pytest.param(64, marks=SLOW),
                                       pytest.param(256, marks=SLOW)])
def test_paged_step_matches_dense_forward(page_size):
    rng = np.random.default_rng(page_size)
    seqs = [list(rng.integers(0, CFG.vocab_size, size=int(rng.integers(3, 40)))) for _ in range(4)]
    got = run_schedule(seqs, page_size, rng, "xla")
    assert {(i, len(s) - 1) for i, s in enumerate(seqs)} <= got.keys() and len(got) > 2 * len(seqs)
    for i, s in enumerate(seqs):
        ref = dense_logits(s)
        for (j, pos), logits in got.items():
            if j == i:
                np.testing.assert_allclose(logits, ref[pos], atol=2e-4 * np.abs(ref).max(), rtol=0)


@pytest.mark.slow  # fast tier: a lighter test covers the same path
def test_reference_attention_impl_matches_dense():
    rng = np.random.default_rng(5)
    seqs = [list(rng.integers(0, CFG.vocab_size, size=n)) for n in (17, 5, 30)]
    got = run_schedule(seqs, 8, rng, "reference")
    for (i, pos), logits in got.items():
        ref = dense_logits(seqs[i])
        np.testing.assert_allclose(logits, ref[pos], atol=2e-4 * np.abs(ref).max(), rtol=0)


@pytest.mark.slow  # fast tier: a lighter test covers the same path
def test_sliding_window_model():
    cfg = dataclasses.replace(CFG, model_type="mistral", sliding_window=6)
    rng = np.random.default_rng(11)
    seqs = [list(rng.integers(0, cfg.vocab_size, size=n)) for n in (20, 13)]
    got = run_schedule(seqs, 8, rng, "xla", cfg=cfg)
    for (i, pos), logits in got.items():
        ref = dense_logits(seqs[i], cfg)
        np.testing.assert_allclose(logits, ref[pos], atol=2e-4 * np.abs(ref).max(), rtol=0)


def test_state_is_donated_and_updated_in_place():
    spec = BucketSpec(max_batch_size=1, max_chunk_size=4, max_pages_per_row=2, page_size=8, min_context=8)
    state = EngineState.create(CFG, 4, 8)
    ptr = state.k.unsafe_buffer_pointer()
    rows = [RowInput(tokens=[1, 2, 3], start_pos=0, pages=[1])]
    shape = spec.shape_for([3], 0, 1, 0)
    batch, _ = build_batch(rows, shape, 8)
    new_state, _ = step(PARAMS, state, batch, cfg=CFG, shape=shape)
    assert state.k.is_deleted()  # donated: the old buffer is gone
    assert new_state.k.unsafe_buffer_pointer() == ptr  # and its memory was reused in place
    assert float(jnp.abs(new_state.k[:, :, 1, :3]).sum()) > 0  # the three tokens were written to page 1
    assert float(jnp.abs(new_state.k[:, :, 2:]).sum()) == 0


@pytest.mark.slow  # fast tier: test_sampling.py::test_seed_invariance_across_batch_composition (the sampler alone)
def test_seeded_sampling_is_independent_of_batch_composition():
    spec = BucketSpec(max_batch_size=8, max_chunk_size=8, max_pages_per_row=2, page_size=8, min_context=16)
    # temperature 1.5 over the random model's flat logits: a draw rarely equals the argmax
    settings = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "seed": 1234}
    target = [5, 9, 33, 2]

    def run(others: int, seed: int = 1234):
        state = EngineState.create(CFG, 2 + 2 * (others + 1), 8)
        rows = [RowInput(tokens=[7 + o], start_pos=0, pages=[2 + 2 * o, 3 + 2 * o],
                         sampling={**settings, "seed": 99 + o}) for o in range(others)]
        rows.insert(others // 2, RowInput(tokens=target, start_pos=0, pages=[1, 2 + 2 * others],
                                          sampling={**settings, "seed": seed}))
        toks = []
        for _ in range(6):
            shape = spec.shape_for([len(r.tokens) for r in rows if not r.is_decode],
                                   sum(r.is_decode for r in rows), 2, 0)
            batch, slots = build_batch(rows, shape, 8)
            state, res = step(PARAMS, state, batch, cfg=CFG, shape=shape)
            new = np.asarray(res.token)
            toks.append(int(new[slots[others // 2]]))
            rows = [dataclasses.replace(r, tokens=[int(new[s])], start_pos=r.start_pos + len(r.tokens))
                    for r, s in zip(rows, slots)]
        return toks

    alone = run(0)
    assert run(3) == alone
    assert run(5) == alone
    # it really samples: most draws differ from the argmax after the same context, and another seed draws others
    greedy = dense_logits(target + alone)[len(target) - 1 : -1].argmax(-1).tolist()
    assert sum(a != g for a, g in zip(alone, greedy)) >= 4, (alone, greedy)
    other = run(0, seed=4321)
    assert sum(a != b for a, b in zip(other, alone)) >= 4, (other, alone)


@pytest.mark.slow  # fast tier: a lighter test covers the same path
def test_multi_step_decode_matches_single_steps():
    spec = BucketSpec(max_batch_size=2, max_chunk_size=8, max_pages_per_row=4, page_size=8, min_context=32)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]

    def prefill():
        state = EngineState.create(CFG, 9, 8)
        rows = [RowInput(tokens=p, start_pos=0, pages=[1 + 4 * i + j for j in range(4)])
                for i, p in enumerate(prompts)]
        shape = spec.shape_for([5, 3], 0, 4, 0)
        batch, slots = build_batch(rows, shape, 8)
        state, res = step(PARAMS, state, batch, cfg=CFG, shape=shape)
        first = [int(np.asarray(res.token)[s]) for s in slots]
        return state, rows, first

    state, rows, first = prefill()
    dec = [dataclasses.replace(r, tokens=[t], start_pos=len(r.tokens)) for r, t in zip(rows, first)]
    shape = spec.shape_for([], 2, 4, 0)
    batch, slots = build_batch(dec, shape, 8)
    state, res = decode_burst(PARAMS, state, batch, cfg=CFG, shape=shape, num_steps=5)
    multi = np.asarray(res.token)[:, slots].T.tolist()

    state, rows, first = prefill()
    single = [[], []]
    toks = first
    for k in range(5):
        dec = [RowInput(tokens=[t], start_pos=len(p) + k, pages=r.pages) for r, t, p in zip(rows, toks, prompts)]
        batch, slots = build_batch(dec, shape, 8)
        state, res = step(PARAMS, state, batch, cfg=CFG, shape=shape)
        toks = [int(np.asarray(res.token)[s]) for s in slots]
        for i in range(2):
            single[i].append(toks[i])
    assert multi == single
    # and both agree with dense greedy decoding
    from models.llama import greedy_generate

    for i, p in enumerate(prompts):
        assert [first[i]] + multi[i] == greedy_generate(PARAMS, CFG, p, 6)


def test_jax_compilation_is_bucketed():
    spec = BucketSpec(max_batch_size=16, max_chunk_size=256, max_pages_per_row=32, page_size=64)
    shapes = spec.all_shapes()
    assert len(shapes) == len(set(shapes))
    # any admissible batch maps to one of the listed shapes
    for pre, dec, pages in [([], 1, 1), ([200], 15, 32), ([3, 17], 0, 5), ([], 16, 9)]:
        assert spec.shape_for(pre, dec, pages, 0) in shapes
    with pytest.raises(ValueError, match="max_chunk_size"):
        spec.shape_for([257], 0, 1, 0)

    # Real steps: batches of different sizes in one bucket compile once; each new bucket compiles once more.
    from paged.device.engine import count_compiles

    cfg = dataclasses.replace(CFG, rope_theta=12345.0)  # a config no other test uses: none of its variants exist yet
    small = BucketSpec(max_batch_size=4, max_chunk_size=16, max_pages_per_row=2, max_prefill_rows=1, page_size=8,
                       min_context=16)
    assert small.q_lens == (16,) and small.decode_rows == (0, 1, 2, 4) and small.pages == (2,)
    state = EngineState.create(cfg, 9, 8)
    used = set()

    def run(prefill_len: int, num_decode: int) -> int:
        nonlocal state
        rows = [RowInput(tokens=[7] * prefill_len, start_pos=0, pages=[1, 2])] if prefill_len else []
        rows += [RowInput(tokens=[3], start_pos=4, pages=[3 + 2 * i, 4 + 2 * i]) for i in range(num_decode)]
        shape = small.shape_for([prefill_len] if prefill_len else [], num_decode, 2, 0)
        used.add(shape)
        batch, _ = build_batch(rows, shape, 8)
        state, res = step(PARAMS, state, batch, cfg=cfg, shape=shape)
        res.token.block_until_ready()
        return count_compiles()["step"]

    before = count_compiles()["step"]
    assert [run(n, 0) - before for n in (3, 9, 16, 5)] == [1, 1, 1, 1]  # one prefill row: the 16-token bucket
    # a new bucket compiles once more: 3 and 4 decode rows share the 4-row bucket
    assert [run(0, d) - before for d in (3, 4, 3)] == [2, 2, 2]
    assert len(used) == 2


def test_engines_that_differ_only_in_their_forward_share_the_samplers_programs():
    """The sampler's programs are keyed by what they read (`sampler_statics`: vocabulary, hidden size, norm epsilon, a
    quantized head's matmul): another attention kernel or fewer layers compile their forward again, not the sampler,
    and give the same outputs; another vocabulary, or a quantized head under another matmul, is another program."""
    from models.draft import truncated_model
    from paged import DynamicGenerator, Job, SamplingSettings
    from paged.device.engine import count_compiles
    from paged.device.step import StepStatics, lm_head, sampler_statics
    from paged.testing import ByteTokenizer, drain, quantized_tiny_model, tiny_model

    tok = ByteTokenizer()
    cfg = dataclasses.replace(tiny_config(258), rope_theta=23456.0)  # no other test's programs
    model = tiny_model(cfg, tokenizer=tok)

    def run(m, **kw) -> tuple[dict, dict]:
        before = count_compiles()
        g = DynamicGenerator(m, num_pages=24, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=64, **kw)
        g.enqueue([Job(tok.encode("hello"), 3, gen_settings=SamplingSettings(temperature=1.0), seed=i, identifier=i)
                   for i in range(2)])
        finals = {k: f["full_completion"] for k, f in drain(g).finals.items()}
        return finals, {k: v - before[k] for k, v in count_compiles().items()}

    first, compiled = run(model, attn_impl="xla")
    assert compiled["sample"] > 0 and compiled["step"] > 0
    other_kernel, compiled = run(model, attn_impl="reference")
    assert other_kernel == first and compiled["sample"] == 0 and compiled["step"] > 0
    _, compiled = run(truncated_model(model, 1), attn_impl="xla")  # fewer layers: a draft model's shape
    assert compiled["sample"] == 0 and compiled["step"] > 0

    def key(m, **kw):
        return sampler_statics(StepStatics(m.config, **kw), lm_head(m.params))

    assert key(model, matmul_impl="xla") == key(model, matmul_impl="reference")  # a float head: no matmul impl
    other_vocab = tiny_model(dataclasses.replace(cfg, vocab_size=300))
    assert key(other_vocab) != key(model)
    q = quantized_tiny_model(tok)  # a Q4_1 head: its matmul is part of the sampler's program
    assert key(q, matmul_impl="xla") != key(q, matmul_impl="reference")


@pytest.mark.slow  # fast tier: a lighter test covers the same path
@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_attention_impls_give_the_same_step(impl):
    """The Pallas kernel (interpret mode on CPU) and the reference inside the real step match the XLA path."""
    rng = np.random.default_rng(21)
    seqs = [list(rng.integers(0, CFG.vocab_size, size=n)) for n in (11, 4)]
    got = {}
    for name in ("xla", impl):
        got[name] = run_schedule(seqs, 8, np.random.default_rng(3), name)
    assert got["xla"].keys() == got[impl].keys()
    for key in got["xla"]:
        np.testing.assert_allclose(got[impl][key], got["xla"][key], atol=2e-4, rtol=0)


def test_int8_kv_cache_stays_close_to_float():
    rng = np.random.default_rng(8)
    seqs = [list(rng.integers(0, CFG.vocab_size, size=n)) for n in (19, 7)]

    def run(dtype):
        state = EngineState.create(CFG, 9, 8, dtype)
        assert state.quantized == (dtype == jnp.int8)
        pages = [[1, 2, 3, 4], [5, 6, 7, 8]]
        spec = BucketSpec(max_batch_size=2, max_chunk_size=32, max_pages_per_row=4, page_size=8, min_context=32)
        rows = [RowInput(tokens=s, start_pos=0, pages=p) for s, p in zip(seqs, pages)]
        shape = spec.shape_for([19, 7], 0, 4, 0)
        batch, slots = build_batch(rows, shape, 8)
        state, res = step(PARAMS, state, batch, cfg=CFG, shape=shape, return_logits=True)
        return np.asarray(res.logits)[slots], state

    ref, _ = run(jnp.float32)
    q, state = run(jnp.int8)
    assert state.k.dtype == jnp.int8 and float(jnp.abs(state.k_scale).sum()) > 0
    scale = np.abs(ref).max()
    assert np.abs(q - ref).max() < 0.02 * scale  # int8 KV: small, bounded deviation
    assert (q.argmax(-1) == ref.argmax(-1)).all()


def test_engine_run_accounts_its_wall_time():
    from models.loader import Model
    from paged.device.engine import Engine

    eng = Engine(Model(config=CFG, params=PARAMS, tokenizer=None, source="tiny"), num_pages=8, page_size=8,
                 max_batch_size=2, max_chunk_size=8, max_seq_len=32, max_penalty_range=0)
    assert eng.timings == {"build_s": 0.0, "dispatch_s": 0.0, "wait_s": 0.0}
    out = eng.run([RowInput(tokens=[1, 2, 3], start_pos=0, pages=[1])])
    t = eng.timings
    assert t["build_s"] > 0 and t["dispatch_s"] > 0 and t["wait_s"] > 0
    assert out.seconds == pytest.approx(t["dispatch_s"] + t["wait_s"], rel=1e-6)
