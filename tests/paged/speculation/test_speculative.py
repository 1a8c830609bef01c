"""Speculative decoding, phase 1: verification rows in the ragged step, the acceptance rules (greedy and lossless
rejection sampling), the draft model's mirrored cache and the `Speculator`, driven by a minimal host loop (the
generator wiring comes in phase 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import init_random_weights
from models.draft import reduced_head, truncated_model
from models.loader import Model
from paged.device.batch import RowInput
from paged.device.config import Drafting, Verification
from paged.device.engine import Engine
from paged.device.verify import _gumbel_argmax, _point_keys, accept_drafts, residual_fits
from paged.errors import InvalidConfigError
from paged.speculation.config import SpeculationConfig
from paged.speculation.rows import SpecRow
from paged.speculation.speculator import Speculator
from paged.testing import tiny_config
from paged.token_sets import pack
from tests.paged.speculation.test_speculative_generator import CFG, MODEL, OTHER, PENALISED, SETTINGS

# each test builds generators with draft models: their compiled programs go once the maps near the limit (conftest)
pytestmark = pytest.mark.usefixtures("release_compiled_programs_near_the_map_limit")

# The generator tests' model and engine settings: the engines here compile the same programs as the generators
# there (the suite's compilation cache shares them; with a model and engine of their own these tests compiled 33
# programs no other module used, now 5). `ROWS`: rows with a penalty history (test_fused_step's engine too).
ROWS = PENALISED
# penalties strong enough to move every token's probability: the whole final distribution is compared
SAMPLED = {"temperature": 0.8, "top_p": 0.97, "repetition_penalty": 1.5, "frequency_penalty": 0.7, "seed": 4}


def _hist(seq: list[int], end: int, r: int = 16) -> list[int]:
    return seq[max(0, end - r) : end]


# ExLlamaV2's full sampler at once: DRY and the decaying penalties read the drafts in each position's history
FULL = {"temperature": 0.9, "top_a": 0.01, "tfs": 0.999, "min_temp": 0.6, "max_temp": 1.3, "skew": 0.4,
        "xtc_probability": 0.5, "xtc_threshold": 0.015, "smoothing_factor": 0.2, "dry_multiplier": 2.0,
        "dry_allowed_length": 1, "repetition_penalty": 1.4, "penalty_range": 3, "penalty_decay": 4, "seed": 9}
SETS = dict(dry_breakers=pack([11], CFG.vocab_size), xtc_exempt=pack([5], CFG.vocab_size))


def speculating(**kw) -> tuple[Engine, Speculator]:
    """A target engine built for the speculation `kw` describes (`Speculator.of`'s arguments), and its speculator."""
    engine = Engine(MODEL, **SETTINGS, verification=SpeculationConfig.of(**kw).verification())
    return engine, Speculator.of(engine, **kw)


@pytest.mark.parametrize("mixed,first", [pytest.param(False, "penalties", marks=pytest.mark.slow),
                                         (True, "penalties"), (False, "full")])
def test_verification_rows_give_the_results_of_single_positions(mixed, first):
    """A verification row's per-position logits, final distribution (top-k) and the target's token at each position
    are those of feeding the positions one at a time, penalties (and DRY, with the full sampler) seeing the earlier
    drafts; also with a prefill chunk sharing the step (a mixed verification bucket)."""
    a, b = Engine(MODEL, **ROWS, verification=Verification(3)), Engine(MODEL, **ROWS)
    prompts = [[5, 7, 9, 11, 13, 2, 3], [40, 41, 42, 43, 44]]
    pages = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    other = RowInput(tokens=list(range(60, 72)), start_pos=0, pages=[13, 14, 15], sample=False)
    for e in (a, b):
        e.run([RowInput(tokens=p[:-1], start_pos=0, pages=pg, sample=False) for p, pg in zip(prompts, pages)][:1])
        e.run([RowInput(tokens=prompts[1][:-1], start_pos=0, pages=pages[1], sample=False)])
    drafts = [[17, 19, 23], [50]]
    settings = [SAMPLED if first == "penalties" else FULL, {"temperature": 0.0}]
    sets = [SETS if first == "full" else {}, {}]
    drafts[0] = [17, 19, 23] if first == "penalties" else [9, 11, 13]  # a repeat: DRY penalises its continuation
    seqs = [p + d for p, d in zip(prompts, drafts)]
    rows = [RowInput(tokens=[p[-1]] + d, start_pos=len(p) - 1, pages=pg, sampling=st, history=_hist(s, len(p)),
                     verify=True, **ts) for p, d, pg, st, s, ts in zip(prompts, drafts, pages, settings, seqs, sets)]
    if mixed:
        rows.insert(1, other)
    v = CFG.vocab_size
    out = a.run(rows, return_logits=True, return_top_k=v)  # the whole final distribution, per position
    assert out.token.shape == (len(rows), 4) and out.num_accepted is not None
    if mixed:
        assert out.shape.verify_len == 4 and out.shape.tail_decode_rows > 0
        b.run([other])
        out_rows = [0, 2]
    else:
        assert out.shape.step_rows_in_windows
        out_rows = [0, 1]
    for r, p, d, pg, st, s, ts in zip(out_rows, prompts, drafts, pages, settings, seqs, sets):
        for j in range(len(d) + 1):
            pos = len(p) - 1 + j
            o = b.run([RowInput(tokens=[s[pos]], start_pos=pos, pages=pg, sampling=st, history=_hist(s, pos + 1),
                                **ts)], return_logits=True, return_top_k=v)
            np.testing.assert_allclose(out.logits[r, j], o.logits[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(out.top_ids[r, j], o.top_ids[0])
            np.testing.assert_allclose(out.top_logprobs[r, j], o.top_logprobs[0], rtol=1e-5, atol=1e-5)
            # (every position's distribution is computed; tokens are defined up to the first rejection)
            if j == out.num_accepted[r] and st["temperature"] == 0.0:  # the greedy row's next token: the argmax
                assert out.token[r, j] == o.token[0]


def test_greedy_acceptance_keeps_the_matching_prefix_then_the_targets_token():
    a, b = Engine(MODEL, **SETTINGS, verification=Verification(4)), Engine(MODEL, **SETTINGS)
    prompt, pages = [3, 1, 4, 1, 5, 9, 2, 6], [1, 2, 3, 4, 5]
    for e in (a, b):
        e.run([RowInput(tokens=prompt[:-1], start_pos=0, pages=pages, sample=False)])
    seq = list(prompt)
    for _ in range(5):  # the greedy continuation, one position at a time
        o = b.run([RowInput(tokens=[seq[-1]], start_pos=len(seq) - 1, pages=pages)])
        seq.append(int(o.token[0]))
    cont = seq[len(prompt) :]
    row = lambda d: RowInput(tokens=[prompt[-1], *d], start_pos=len(prompt) - 1, pages=pages, verify=True)  # noqa
    out = a.run([row(cont[:4])])
    assert out.num_accepted[0] == 4 and out.token[0].tolist() == cont[:5]  # all accepted, then the bonus token
    wrong = [cont[0], (cont[1] + 1) % CFG.vocab_size, cont[2], cont[3]]
    out = a.run([row(wrong)])
    assert out.num_accepted[0] == 1 and out.token[0, :2].tolist() == cont[:2]  # the correction at the mismatch
    out = a.run([row(cont[:2])])  # fewer drafts than the bucket holds
    assert out.num_accepted[0] == 2 and out.token[0, :3].tolist() == cont[:3]



@pytest.mark.slow
def test_drafts_on_the_device_verify_as_drafts_on_the_host():
    """`Verification(fed_drafts=True)`: a verification row of placeholder tokens with its drafts on the device
    (garbage past the row's drafts) gives what the same row with the drafts in its tokens gives; a fed engine refuses
    a verification without them, and a prompt-lookup `Speculator` cannot take it over (its role is fixed)."""
    a = Engine(MODEL, **SETTINGS, verification=Verification(4))
    b = Engine(MODEL, **SETTINGS, verification=Verification(4, fed_drafts=True))
    prompt, pages = [3, 1, 4, 1, 5, 9, 2, 6], [1, 2, 3, 4, 5]
    for e in (a, b):
        e.run([RowInput(tokens=prompt[:-1], start_pos=0, pages=pages, sample=False)])
    seq = list(prompt)
    for _ in range(3):
        seq.append(int(a.run([RowInput(tokens=[seq[-1]], start_pos=len(seq) - 1, pages=pages)]).token[0]))
    cont = seq[len(prompt) :]
    drafts = [cont[0], cont[1], (cont[2] + 1) % CFG.vocab_size]  # two accepted, then a miss; 3 of the bucket's 4
    row = lambda d: RowInput(tokens=[prompt[-1], *d], start_pos=len(prompt) - 1, pages=pages, verify=True)  # noqa
    want = a.run([row(drafts)])
    on_device = jnp.full((b.fed_rows, 4), 11, jnp.int32).at[0, :3].set(jnp.asarray(drafts))
    got = b.run([row([0, 0, 0])], draft_tokens=on_device)
    assert int(want.num_accepted[0]) == int(got.num_accepted[0]) == 2
    np.testing.assert_array_equal(got.token, want.token)
    np.testing.assert_allclose(got.logprob[0, :3], want.logprob[0, :3], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="draft_tokens="):
        b.run([row(drafts)])
    with pytest.raises(InvalidConfigError, match="fed_drafts=True"):
        Speculator.of(b, use_ngram_draft=True, num_draft_tokens=4)
    assert b.fed_rows == 4
    Speculator.of(a, use_ngram_draft=True, num_draft_tokens=4)  # the engine built for it

# ------------------------------------------------------------------------------------- rejection sampling
P0 = np.array([0.55, 0.25, 0.12, 0.08])
Q0 = np.array([0.08, 0.12, 0.25, 0.55])
P1 = np.array([[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.1, 0.8]])
Q1 = P1[::-1]


def _emitted_pairs(rule: dict, n: int = 20000, one_hot: bool = False, seed: int = 0) -> np.ndarray:
    """Empirical joint distribution [4, 4] of the first two tokens emitted with two drafts drawn from q (or, one_hot,
    fixed drafts), over n seeds; the second token comes from a fresh target draw where the round ended after one."""
    rng = np.random.default_rng(seed)
    d1 = np.zeros(n, np.int64) + 2 if one_hot else rng.choice(4, size=n, p=Q0)
    d2 = np.array([3 if one_hot else rng.choice(4, p=Q1[x]) for x in d1])
    final = np.log(np.stack([np.broadcast_to(P0, (n, 4)), P1[d1], np.full((n, 4), 0.25)], axis=1))  # [n, 3, V]
    q = None if one_hot else np.log(np.stack([np.broadcast_to(Q0, (n, 4)), Q1[d1]], axis=1))
    token = np.zeros((n, 3), np.int32)
    token[:, 0] = rng.choice(4, size=n, p=P0)  # the target's own draws (sample-then-match compares drafts to them)
    token[:, 1] = [rng.choice(4, p=P1[x]) for x in d1]  # the target's own draw at position 1 (the bonus there)
    token[:, 2] = 0
    toks, a = accept_drafts(jnp.asarray(final, jnp.float32), jnp.asarray(token), jnp.asarray(np.stack([d1, d2], 1)),
                            jnp.full((n,), 1 if one_hot else 2, jnp.int32) if one_hot else jnp.full((n,), 2, jnp.int32),
                            jnp.zeros(n, bool), jnp.arange(n, dtype=jnp.uint32), jnp.tile(jnp.arange(3) + 10, (n, 1)),
                            None if q is None else jnp.asarray(q, jnp.float32), **rule)
    toks, a = np.asarray(toks), np.asarray(a)
    t0 = toks[:, 0]
    t1 = np.where(a >= 1, toks[:, 1], [rng.choice(4, p=P1[x]) for x in t0])
    joint = np.zeros((4, 4))
    np.add.at(joint, (t0, t1), 1)
    return joint / n


@pytest.mark.parametrize("rule, lossless", [({}, True), ({"always_accept": True}, False),
                                            ({"residual_renorm": False}, False), ({"match": True}, True)])
@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_is_lossless_and_broken_rules_are_caught(rule, lossless, one_hot):
    """The first two emitted tokens follow the target's distribution (total variation within sampling noise of
    20000 seeds); accepting every draft, or drawing the correction from p instead of norm(max(0, p - q)), does not.
    Sample-then-match (`match`) is lossless too: it emits the target's own draws (here the harness's draws from P0
    and P1, so this case checks only that it never emits a draft that differs from them)."""
    if one_hot and rule.get("residual_renorm") is False:
        pass  # with one-hot q the unnormalised residual is p with the draft kept: still biased, caught as well
    joint = _emitted_pairs(rule, one_hot=one_hot)
    want = P0[:, None] * P1
    tv = 0.5 * np.abs(joint - want).sum()
    assert (tv < 0.025) == lossless, tv


@pytest.mark.parametrize("kept", [1, 50, 64, 65, 1000])
def test_the_residual_draw_over_candidates_is_the_full_draw(kept):
    """The correction after a rejection (`_gumbel_argmax`) draws only the noise of the candidates when every row
    has at most RESIDUAL_CANDIDATES (64) drawable tokens: the same token as argmax(lr + the full draw's noise);
    with a wider row (65, 1000: every token) the full draw. The row with `kept` drawable tokens is the first."""
    from paged.device.sampling import threefry_draws_supported

    assert threefry_draws_supported()  # else every draw is the full one and this compares it with itself
    s, v = 48, 1000
    rng = np.random.default_rng(kept)
    lr = np.full((s, v), -np.inf, np.float32)
    for i in range(s):
        ids = rng.choice(v, size=int(rng.integers(1, kept + 1)) if i else kept, replace=False)
        lr[i, ids] = rng.normal(size=len(ids)).astype(np.float32)
    lr[-1, :] = np.where(np.isfinite(lr[-1]), 0.5, -np.inf)  # ties: the lowest drawable id wins only if its noise
    keys = _point_keys(jnp.arange(s, dtype=jnp.uint32), jnp.full((s, 1), 7, jnp.int32), 0x0E51)[:, 0]
    noise = np.asarray(jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys))
    want = np.argmax(lr + noise, axis=-1)
    got = np.asarray(jax.jit(_gumbel_argmax)(jnp.asarray(lr), keys, jnp.ones(s, bool)))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(lr[np.arange(s), got]).all()
    # the draw over the candidates is taken exactly where every row that needs a draw fits in them
    assert bool(residual_fits(jnp.asarray(lr), jnp.ones(s, bool))) == (kept <= 64)
    rows = jnp.asarray(np.isfinite(lr).sum(-1) <= 64)  # rows that need no draw do not force the full one
    assert bool(residual_fits(jnp.asarray(lr), rows))
    got = np.asarray(jax.jit(_gumbel_argmax)(jnp.asarray(lr), keys, rows))
    np.testing.assert_array_equal(got[np.asarray(rows)], want[np.asarray(rows)])


def test_sample_then_match_keeps_the_drafts_equal_to_the_targets_draws():
    # sampled rows (greedy False): drafts 5 6 7 against the target's draws 5 6 2 (and 4 after the last draft)
    final = jnp.full((2, 4, 9), -np.log(9.0), jnp.float32)
    token = jnp.asarray([[5, 6, 2, 4], [1, 3, 3, 3]], jnp.int32)
    drafts = jnp.asarray([[5, 6, 7], [1, 3, 3]], jnp.int32)
    args = (final, token, drafts, jnp.asarray([3, 3], jnp.int32), jnp.zeros(2, bool), jnp.arange(2, dtype=jnp.uint32),
            jnp.tile(jnp.arange(4), (2, 1)))
    toks, a = accept_drafts(*args, match=True)
    assert np.asarray(a).tolist() == [2, 3]  # the second row: all three, then the draw after the last draft
    assert np.asarray(toks).tolist() == [[5, 6, 2, -1], [1, 3, 3, 3]]  # the correction is the target's draw: 2
    # rejection sampling with these one-hot drafts accepts each with probability p(x) = 1/9 instead
    _, a_rej = accept_drafts(*args)
    assert np.asarray(a_rej).tolist() != [2, 3]


def test_every_draft_is_accepted_when_q_equals_p():
    n, v = 512, 7
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(n, 4, v)) * 2
    final = jnp.asarray(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), jnp.float32)
    drafts = jnp.asarray(rng.integers(0, v, size=(n, 3)), jnp.int32)
    toks, a = accept_drafts(final, jnp.zeros((n, 4), jnp.int32), drafts, jnp.full((n,), 3, jnp.int32),
                            jnp.zeros(n, bool), jnp.arange(n, dtype=jnp.uint32), jnp.tile(jnp.arange(4), (n, 1)),
                            final[:, :3])
    assert (np.asarray(a) == 3).all()
    np.testing.assert_array_equal(np.asarray(toks)[:, :3], np.asarray(drafts))


def test_a_draft_its_distribution_gives_no_probability_is_never_accepted():
    """A draft row whose mask leaves none of its head's tokens draws from an all -inf q and returns a placeholder
    token (0): accepting it wherever p(0) > 0 (p / q = inf) had made token 0 the output half the time under a
    grammar. Rejected, the correction is drawn from the residual max(p - 0, 0) = p: the target's own draw."""
    n, v = 256, 5
    final = jnp.asarray(np.log(np.full((n, 2, v), 1.0 / v)), jnp.float32)  # p uniform: p(0) = 0.2
    q = jnp.full((n, 1, v), -jnp.inf, jnp.float32)
    toks, a = accept_drafts(final, jnp.zeros((n, 2), jnp.int32), jnp.zeros((n, 1), jnp.int32),
                            jnp.ones((n,), jnp.int32), jnp.zeros(n, bool), jnp.arange(n, dtype=jnp.uint32),
                            jnp.tile(jnp.arange(2), (n, 1)), q)
    assert (np.asarray(a) == 0).all()
    share = np.bincount(np.asarray(toks)[:, 0], minlength=v) / n  # each ~0.2: the residual is p
    assert share.min() > 0.1 and share.max() < 0.3, share


# ------------------------------------------------------------------------------------- host loop
def _loop(engine: Engine, spec: Speculator | None, prompts, max_new: int, sampling, pages_per_job: int = 9,
          biases=None):
    """A minimal generator: one prefill chunk per step, decode rows for the others, up to k drafts per decode row
    (limited by max_new), tokens fed in order. Returns the outputs and the steps run."""
    k = spec.k if spec else 0
    biases = biases or [None] * len(prompts)
    jobs = [dict(seq=list(p), kv=0, new=0, pages=list(range(1 + i * pages_per_job, 1 + (i + 1) * pages_per_job)),
                 key=i) for i, p in enumerate(prompts)]
    steps = 0
    while any(j["new"] < max_new for j in jobs):
        specs, chunk = [], False
        for j, st, bias in zip(jobs, sampling, biases):
            if j["new"] >= max_new:
                continue
            rem = len(j["seq"]) - j["kv"]
            if rem > 1:
                if chunk:
                    continue
                chunk = True
                n = min(rem, engine.config.max_chunk_size)
                row = RowInput(tokens=j["seq"][j["kv"] : j["kv"] + n], start_pos=j["kv"], pages=j["pages"],
                               sample=j["kv"] + n == len(j["seq"]), sampling=st, bias=bias)
                specs.append(SpecRow(key=j["key"], row=row, sequence=j["seq"]))
            else:
                row = RowInput(tokens=[j["seq"][-1]], start_pos=j["kv"], pages=j["pages"], sampling=st, bias=bias)
                specs.append(SpecRow(key=j["key"], row=row, sequence=j["seq"],
                                     max_drafts=min(k, max_new - j["new"] - 1)))
        owners = [next(j for j in jobs if j["key"] == s.key) for s in specs]
        if spec is None:
            out = engine.run([s.row for s in specs])
            accepted = [([int(out.token[i])] if s.row.sample else [], len(s.row.tokens)) for i, s in enumerate(specs)]
        else:
            plan = spec.plan(specs)
            out = engine.run(plan.rows, draft_logprobs=plan.draft_logprobs, draft_tokens=plan.draft_tokens)
            accepted = [(r.tokens, r.kv_advance) for r in spec.accept(plan, out)]
        steps += 1
        for j, (toks, adv) in zip(owners, accepted):
            j["kv"] += adv
            for t in toks:
                if j["new"] < max_new:
                    j["seq"].append(t)
                    j["new"] += 1
    return [j["seq"][len(p) :] for j, p in zip(jobs, prompts)], steps


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
           [30, 31, 30, 31, 30]]
GREEDY = [{"temperature": 0.0}] * 3


@pytest.fixture(scope="module")
def greedy_reference():
    return _loop(Engine(MODEL, **SETTINGS), None, PROMPTS, 12, GREEDY)[0]


@pytest.mark.parametrize("drafter", ["ngram", pytest.param("self", marks=pytest.mark.slow),
                                     pytest.param("truncated", marks=pytest.mark.slow),
                                     pytest.param("unrelated", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_greedy_output_is_identical_with_speculation(drafter, greedy_reference):
    kw = {"ngram": dict(use_ngram_draft=True, max_ngram=3), "self": dict(draft_model=MODEL),
          "truncated": dict(draft_model=truncated_model(MODEL, 1)), "unrelated": dict(draft_model=OTHER)}[drafter]
    engine, spec = speculating(num_draft_tokens=3, **kw)
    outs, _ = _loop(engine, spec, PROMPTS, 12, GREEDY)
    assert outs == greedy_reference
    stats = spec.stats()
    assert stats["drafted_tokens"] > 0
    if drafter == "self":
        assert stats["acceptance_rate"] == 1.0
    if drafter == "unrelated":
        assert stats["acceptance_rate"] < 0.5


@pytest.mark.slow
def test_a_reduced_head_over_every_token_is_the_target_at_temperature_one():
    """q of a reduced head (its columns scattered back to their ids, -inf elsewhere) is exactly p when the head
    covers the vocabulary in any order: rejection sampling accepts every draft."""
    draft = reduced_head(MODEL, np.random.default_rng(5).permutation(CFG.vocab_size))
    engine, spec = speculating(num_draft_tokens=3, draft_model=draft)
    sampling = [{"temperature": 1.0, "seed": 11 + i} for i in range(3)]
    outs, _ = _loop(engine, spec, PROMPTS, 10, sampling)
    assert spec.stats()["acceptance_rate"] == 1.0 and spec.stats()["drafted_tokens"] >= 15
    assert _loop(*speculating(num_draft_tokens=3, draft_model=MODEL), PROMPTS, 10, sampling)[0] == outs


def test_the_adaptive_gate_prices_a_draft_step_by_the_bytes_it_reads():
    """A draft step's cost (in target steps) is the weight bytes each step reads: a reduced head's draft reads its
    small head, not the embedding table it gathers its inputs from."""
    small = reduced_head(MODEL, np.arange(8))
    spec = speculating(num_draft_tokens=2, draft_model=small, adaptive=True)[1]
    want = small.params.step_read_bytes() / MODEL.params.step_read_bytes()
    assert spec.gate.draft_step_cost == pytest.approx(want)
    full = speculating(num_draft_tokens=2, draft_model=MODEL, adaptive=True)[1]
    assert full.gate.draft_step_cost == pytest.approx(1.0) and want < 0.95


@pytest.mark.slow
def test_draft_equal_to_the_target_accepts_every_draft_at_temperature_one():
    """Rejection sampling, not sample-then-match: with q = p (the target drafting for itself) every draft is
    accepted, at temperature 1 as well as greedy."""
    engine, spec = speculating(num_draft_tokens=3, draft_model=MODEL)
    sampling = [{"temperature": 1.0, "seed": 11 + i} for i in range(3)]
    outs, _ = _loop(engine, spec, PROMPTS, 10, sampling)
    assert all(len(o) == 10 for o in outs)
    assert spec.stats()["acceptance_rate"] == 1.0 and spec.stats()["drafted_tokens"] >= 15
    assert _loop(*speculating(num_draft_tokens=3, draft_model=MODEL), PROMPTS, 10, sampling)[0] == outs


@pytest.mark.slow
def test_sample_then_match_couples_the_drafts_noise_with_the_targets():
    """Sample-then-match keeps a draft only where it equals the target's own draw. The draft model draws with the
    target's keys (the same Gumbel noise per token at each position), so with q = p at temperature 1 it draws the
    target's tokens and every draft is accepted, as with rejection sampling; with independent draws (the draft's
    seed salted, as for rejection sampling) it would match with probability sum p^2, rare on this flat tiny model.
    Either way the output is plain sampling's."""
    sampling = [{"temperature": 1.0, "seed": 11 + i} for i in range(3)]
    plain, _ = _loop(Engine(MODEL, **SETTINGS), None, PROMPTS, 10, sampling)
    rates = {}
    for rule, coupled in (("match", True), ("match", False), ("exllamav2", False)):
        engine, spec = speculating(num_draft_tokens=3, draft_model=MODEL, acceptance=rule)
        assert spec.draft.coupled == (rule == "match") and spec.draft.greedy == (rule == "exllamav2")
        spec.draft.coupled = coupled
        draft_rows, run = [], spec.draft.engine.draft

        def spy(rows, *a, _run=run, _seen=draft_rows, **k):
            _seen.extend(rows)
            return _run(rows, *a, **k)

        spec.draft.engine.draft = spy
        outs, _ = _loop(engine, spec, PROMPTS, 10, sampling)
        assert outs == plain
        # ExLlamaV2 proposes the draft's argmax (a greedy draft row); the others sample at the job's temperature
        assert {r.sampling["temperature"] for r in draft_rows} == ({0.0} if rule == "exllamav2" else {1.0})
        assert {r.sampling["seed"] in (11, 12, 13) for r in draft_rows} == {coupled}
        assert spec.stats()["drafted_tokens"] >= 15
        rates[rule, coupled] = spec.stats()["acceptance_rate"]
    # coupled: every draft; independent draws: sum p^2; greedy drafts (ExLlamaV2): p(argmax), both rare here
    assert rates["match", True] == 1.0 and rates["match", False] < 0.5 and rates["exllamav2", False] < 0.5, rates


@pytest.mark.slow  # fast tier: the unrelated draft model runs through the generator in test_speculative_generator
def test_draft_cache_mirrors_the_targets_page_ids():
    engine, spec = speculating(num_draft_tokens=2, draft_model=truncated_model(MODEL, 1))
    _loop(engine, spec, PROMPTS[:2], 4, GREEDY)
    used_t = np.flatnonzero(np.abs(np.asarray(engine.state.k[0])).sum(axis=(0, 2, 3)))
    used_d = np.flatnonzero(np.abs(np.asarray(spec.draft.engine.state.k[0])).sum(axis=(0, 2, 3)))
    assert set(used_t) - {0} == set(used_d) - {0} and len(set(used_t) - {0}) >= 4
    assert spec.draft.engine.config.num_pages == engine.config.num_pages
    assert spec.draft.engine.config.page_size == engine.config.page_size


def test_invalid_speculation_configs():
    engine = Engine(MODEL, **SETTINGS)
    with pytest.raises(InvalidConfigError, match="not both"):
        Speculator.of(engine, draft_model=MODEL, use_ngram_draft=True)
    with pytest.raises(InvalidConfigError, match="num_draft_tokens"):
        Speculator.of(engine, use_ngram_draft=True, num_draft_tokens=0)
    with pytest.raises(InvalidConfigError, match="acceptance must be one of"):
        Speculator.of(engine, use_ngram_draft=True, acceptance="accept-all")
    small = tiny_config(64, num_layers=1)
    with pytest.raises(InvalidConfigError, match=r"built without verification; this speculation needs one built "
                                                  r"with EngineConfig\(verification=Verification\(num_draft_tokens=4"):
        Speculator.of(engine, use_ngram_draft=True)  # an engine's roles are fixed when it is built
    target = Engine(MODEL, **SETTINGS, verification=SpeculationConfig("model").verification())
    with pytest.raises(InvalidConfigError, match="vocabulary"):
        Speculator.of(target, draft_model=Model(config=small, params=init_random_weights(small), tokenizer=None,
                                             source="small"))


@pytest.mark.slow
def test_a_catch_up_window_drafts_what_a_decode_step_after_the_catch_up_token_drafts():
    """Where the draft cache lacks the token before a row's (its last draft was accepted), `Engine.draft(catch_up=)`
    feeds that token and the row's in one two-token forward (`draft_burst_jit(window=)`): the same drafts and
    distributions, and the same cache, as feeding the missing token in a forward of its own and then drafting; a
    row without a catch-up token in the same burst drafts as before. Rows sit at slots with gaps (the target's
    verification rows), one sampled with penalties, one greedy."""

    engine = Engine(MODEL, **ROWS, drafting=Drafting(3, pad_rows=4))
    engine.run_forward([RowInput(tokens=[3, 1, 4, 1], start_pos=0, pages=[1], sample=False)])
    engine.run_forward([RowInput(tokens=[5, 9, 2], start_pos=0, pages=[2], sample=False)])
    rows = [RowInput(tokens=[7], start_pos=5, pages=[1], sampling=dict(SAMPLED), history=[3, 1, 4, 1, 6]),
            RowInput(tokens=[9], start_pos=3, pages=[2], sampling={"temperature": 0.0}, history=[5, 9, 2])]
    saved = jax.tree.map(jnp.copy, engine.state)
    engine.run_forward([RowInput(tokens=[6], start_pos=4, pages=[1], sample=False)])  # the missing token alone
    ref_tokens, ref_q, ref_dev = engine.draft(rows, [2, 0], 4, [-1, -1])
    ref_state = engine.state
    engine.state = jax.tree.map(jnp.copy, saved)
    tokens, q, on_device = engine.draft(rows, [2, 0], 4, [6, -1])
    assert tokens.shape == (2, 3) and np.asarray(on_device).shape == (4, 3)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(np.asarray(on_device)[[2, 0]], tokens)  # (the padding rows' drafts are unused)
    np.testing.assert_array_equal(np.asarray(ref_dev)[[2, 0]], tokens)
    np.testing.assert_allclose(np.asarray(q)[[2, 0]], np.asarray(ref_q)[[2, 0]], rtol=0, atol=1e-4)
    for a, b in zip(jax.tree.leaves(engine.state), jax.tree.leaves(ref_state)):  # d_3's KV written by neither
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)
    engine.state = jax.tree.map(jnp.copy, saved)
    none, _, on_device2 = engine.draft(rows, [2, 0], 4, [6, -1], host=False)
    assert none is None  # no host copy, nothing waited for
    np.testing.assert_array_equal(np.asarray(on_device2), np.asarray(on_device))


@pytest.mark.slow
def test_a_burst_dispatched_ahead_drafts_what_the_next_burst_would():
    """`Engine.draft_ahead` drafts for the rows of the last burst from their verification's device results (each
    row continues after its accepted drafts with the target's token; a row whose every draft was accepted feeds its
    last draft first, which no burst wrote): the same drafts, distributions and cache as `Engine.draft` over the
    next rows laid out on the host; and again after the host moved the burst's rows on to what the first burst ahead
    fed (`Engine.advance_burst`: two steps ahead in a row)."""

    engine = Engine(MODEL, **ROWS, drafting=Drafting(2, pad_rows=4))
    engine.run_forward([RowInput(tokens=[3, 1, 4, 1, 6], start_pos=0, pages=[1, 3], sample=False)])
    engine.run_forward([RowInput(tokens=[5, 9, 2], start_pos=0, pages=[2], sample=False)])
    sampled = {k: v for k, v in SAMPLED.items() if "penalty" not in k}  # (rows without a penalty history go ahead)
    rows = [RowInput(tokens=[7], start_pos=5, pages=[1, 3], sampling=sampled),
            RowInput(tokens=[9], start_pos=3, pages=[2], sampling={"temperature": 0.0})]
    drafts, _, _ = engine.draft(rows, [2, 0], 4, [-1, -1])
    start = jax.tree.map(jnp.copy, engine.state)
    # the verification: row 0 (batch row 2) accepts both drafts, the target adds 11; row 1 (batch row 0) accepts
    # none, the target says 13; then row 0 accepts one draft and says 21, row 1 accepts both and says 23
    steps = [({2: [*drafts[0], 11], 0: [13, 0, 0]}, {2: 2, 0: 0}), (None, {2: 1, 0: 2})]
    ahead, emitted_rows = [], []
    for emitted, acc in steps:
        if emitted is None:  # drafts of the first burst ahead, then the target's token
            d = np.asarray(ahead[-1][1])
            emitted = {2: [d[2, 0], 21, 0], 0: [d[0, 0], d[0, 1], 23]}
        e = np.zeros((4, 3), np.int32)
        a = np.zeros(4, np.int32)
        for s in emitted:
            e[s], a[s] = emitted[s], acc[s]
        emitted_rows.append((emitted, acc))
        if ahead:  # the host has the first verification's results: the rows' next tokens
            engine.advance_burst([2, 0], [5 + 3, 3 + 1], [11, 13])
        q, on_device = engine.draft_ahead(jnp.asarray(e), jnp.asarray(a))
        ahead.append((q, on_device, jax.tree.map(jnp.copy, engine.state)))
    # the same two steps laid out on the host
    engine.state = start
    pos = {2: 5, 0: 3}
    for (emitted, acc), (q, on_device, state) in zip(emitted_rows, ahead):
        nxt, catch = [], []
        for s, pages in ((2, [1, 3]), (0, [2])):
            a = acc[s]
            pos[s] += a + 1
            nxt.append(RowInput(tokens=[int(emitted[s][a])], start_pos=pos[s], pages=pages,
                                sampling=sampled if s == 2 else {"temperature": 0.0}))
            catch.append(int(emitted[s][a - 1]) if a == 2 else -1)
        tokens, ref_q, _ = engine.draft(nxt, [2, 0], 4, catch)
        np.testing.assert_array_equal(np.asarray(on_device)[[2, 0]], tokens)
        np.testing.assert_allclose(np.asarray(q)[[2, 0]], np.asarray(ref_q)[[2, 0]], rtol=0, atol=1e-4)
        for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(engine.state)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-4)
