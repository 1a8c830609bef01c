"""ExLlamaV2's full sampler (DRY, XTC, mirostat, dynamic temperature, smoothing, top_a, tfs, skew, temperature_last,
repetition decay) against an independent NumPy reference of the documented semantics, in ExLlamaV2's order."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.device.sampling import SamplingRows, apply_dry, apply_penalties, processed_logprobs, sample
from paged.token_sets import pack, unpack

pytestmark = pytest.mark.fresh_programs  # (counts compiled variants)

S, V, R = 24, 256, 24
_processed = jax.jit(processed_logprobs)
_sample = jax.jit(sample, static_argnames="return_top_k")


# ----------------------------------------------------------------------------------------------------------------
# NumPy reference (float64, one row, loops)
# ----------------------------------------------------------------------------------------------------------------


def ref_penalties(x: np.ndarray, st: dict, hist: list[int]) -> np.ndarray:
    """ExLlamaV2's `apply_rep_penalty_cpu`: one backwards pass, penalties decaying after `sustain` tokens."""
    x = x.copy()
    rep, freq, pres = st.get("repetition_penalty", 1.0), st.get("frequency_penalty", 0.0), st.get(
        "presence_penalty", 0.0)
    sust, decay = st.get("penalty_range", 1 << 30), st.get("penalty_decay", 0)
    d_rep = (1.0 - rep) / decay if decay else 0.0
    d_freq, d_pres = (-freq / decay, -pres / decay) if decay else (0.0, 0.0)
    seen = set()
    beg = max(len(hist) - sust - decay, 0)
    for i in range(len(hist) - 1, beg - 1, -1):
        t = hist[i]
        if t not in seen:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
            x[t] -= pres
            seen.add(t)
        x[t] -= freq
        sust -= 1
        if sust < 0:
            rep, freq, pres = rep + d_rep, freq + d_freq, pres + d_pres
    return x


def ref_dry(x: np.ndarray, st: dict, hist: list[int], breakers: set[int]) -> np.ndarray:
    """The longest suffix (allowed_length <= L < max_ngram, no breaker, within dry_range) that occurred earlier
    followed by a non-breaker token; each such follower t loses mult * base^(L - allowed) per occurrence."""
    mult = st.get("dry_multiplier", 0.0)
    if mult <= 0:
        return x
    base, allowed = st.get("dry_base", 1.75), st.get("dry_allowed_length", 2)
    max_ngram, rng = st.get("dry_max_ngram", 20), st.get("dry_range", 0)
    n = len(hist)
    blocked = [t in breakers or (rng > 0 and n - 1 - i >= rng) for i, t in enumerate(hist)]
    for length in range(min(max_ngram - 1, n - 1), allowed - 1, -1):
        suffix = hist[n - length:]
        if any(blocked[n - length:]):
            continue
        counts: dict[int, int] = {}
        for j in range(length, n):
            if hist[j - length: j] == suffix and not any(blocked[j - length: j]) and not blocked[j]:
                counts[hist[j]] = counts.get(hist[j], 0) + 1
        if counts:
            x = x.copy()
            for t, c in counts.items():
                x[t] -= mult * base ** (length - allowed) * c
            return x
    return x


def _renorm(p: np.ndarray, keep: np.ndarray) -> np.ndarray:
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def ref_final(logits: np.ndarray, st: dict, hist: list[int], breakers=frozenset(), exempt=frozenset()) -> np.ndarray:
    x = ref_penalties(logits.astype(np.float64), st, hist)
    x = ref_dry(x, st, hist, set(breakers))
    temp = st.get("temperature", 0.0)
    if temp < 0.01:
        return x - x.max() - np.log(np.exp(x - x.max()).sum())
    t_pre = 1.0 if st.get("temperature_last", 0) else temp
    if st.get("smoothing_factor", 0.0) > 0:
        x = -st["smoothing_factor"] * (x - x.max()) ** 2
    z = x / t_pre
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p > 0
    k = st.get("top_k", 0)
    if 0 < k < len(p):
        keep &= p >= np.sort(p)[::-1][k - 1]
    top_p = st.get("top_p", 1.0)
    if 0 < top_p < 1:
        q = _renorm(p, keep)
        order = np.argsort(-q, kind="stable")
        n = min(int(np.searchsorted(np.cumsum(q[order]), top_p)) + 1, len(q))
        keep &= q >= q[order[n - 1]]
    if st.get("top_a", 0.0) > 0:
        q = _renorm(p, keep)
        keep &= q >= st["top_a"] * q.max() ** 2
    if st.get("min_p", 0.0) > 0:
        q = _renorm(p, keep)
        keep &= q >= st["min_p"] * q.max()
    tfs = st.get("tfs", 0.0)
    if 0 < tfs < 1 and keep.sum() >= 3:
        q = _renorm(p, keep)
        srt = np.sort(q[keep])[::-1]
        d = np.abs(srt[:-2] - 2 * srt[1:-1] + srt[2:])
        if d.sum() > 0:
            cum = np.cumsum(d / d.sum())
            kk = 0
            while kk < len(srt) - 2 and cum[kk] <= tfs:
                kk += 1
            keep &= q >= srt[kk]
    typical = st.get("typical", 0.0)
    if 0 < typical < 1:
        q = _renorm(p, keep)
        idx = np.flatnonzero(keep)
        lq = np.log(q[idx])
        score = np.abs(-lq + np.sum(q[idx] * lq))
        order = np.argsort(score, kind="stable")
        n = min(int(np.searchsorted(np.cumsum(q[idx][order]), typical)) + 1, len(idx))
        new = np.zeros_like(keep)
        new[idx[score <= score[order[n - 1]]]] = True
        keep = new
    if st.get("mirostat", 0):
        q = _renorm(p, keep)
        keep &= (q >= 2.0 ** -st["mirostat_mu"]) | (q == q.max())
    q = _renorm(p, keep)
    dynamic = st.get("max_temp", 0.0) > st.get("min_temp", 0.0)
    if st.get("temperature_last", 0) or dynamic:
        t = temp
        if dynamic:
            n = keep.sum()
            h = -np.sum(q[keep] * np.log(q[keep]))
            h_max = np.log(n) if n > 1 else 1.0
            t = st["min_temp"] + (st["max_temp"] - st["min_temp"]) * (h / h_max) ** st.get("temp_exponent", 1.0)
        q = np.where(keep, q ** (1.0 / t), 0.0)
        q /= q.sum()
    pr = st.get("xtc_probability", 0.0)
    if pr > 0:
        over = [i for i in np.flatnonzero(keep) if q[i] >= st.get("xtc_threshold", 0.1) and i not in exempt]
        if len(over) >= 2:
            q_min = min(q[i] for i in over)
            removed = [i for i in over if q[i] > q_min]
            # the expectation over the coin: removed with probability pr, then renormalised
            without = q.copy()
            without[removed] = 0.0
            q = pr * without / without.sum() + (1 - pr) * q
    skew = st.get("skew", 0.0)
    if skew:
        a = math.exp(skew)
        new = np.zeros_like(q)
        values = sorted(set(q[keep]), reverse=True)
        before = 0.0
        for val in values:  # tie groups in descending order share their group's probability
            members = np.flatnonzero(keep & (q == val))
            after = before + val * len(members)
            new[members] = (after ** a - before ** a) / len(members)
            before = after
        q = new
    with np.errstate(divide="ignore"):
        return np.where(q > 0, np.log(np.where(q > 0, q, 1.0)), -np.inf)


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------

BREAKERS = frozenset({3, 4, 200})
EXEMPT = frozenset({10, 11})
ONE_AT_A_TIME = [
    {"temperature": 0.9, "top_a": 0.2},
    {"temperature": 1.0, "top_k": 30, "top_a": 0.5},
    {"temperature": 1.0, "tfs": 0.7},
    {"temperature": 0.8, "top_k": 40, "tfs": 0.9},
    {"temperature": 1.0, "smoothing_factor": 0.3},
    {"temperature": 0.7, "min_temp": 0.3, "max_temp": 1.8, "temp_exponent": 1.5},
    {"temperature": 0.5, "temperature_last": 1, "top_p": 0.9},
    {"temperature": 1.0, "skew": 0.7},
    {"temperature": 1.0, "top_k": 20, "skew": -0.5},
    {"temperature": 1.0, "xtc_probability": 0.6, "xtc_threshold": 0.02},
    {"temperature": 1.0, "top_k": 12, "xtc_probability": 1.0, "xtc_threshold": 0.05},
    {"temperature": 1.0, "mirostat": 1, "mirostat_mu": 4.0},
    {"temperature": 1.0, "top_k": 50, "mirostat": 1, "mirostat_mu": 2.5},
    {"temperature": 1.0, "dry_multiplier": 0.8, "dry_allowed_length": 2},
    {"temperature": 0.0, "dry_multiplier": 2.0, "dry_base": 2.0, "dry_allowed_length": 1, "dry_max_ngram": 4},
    {"temperature": 1.0, "dry_multiplier": 1.0, "dry_allowed_length": 1, "dry_range": 10, "dry_max_ngram": 5},
    {"temperature": 0.0, "repetition_penalty": 1.5, "frequency_penalty": 0.4, "presence_penalty": 0.3,
     "penalty_range": 6, "penalty_decay": 8},
    {"temperature": 1.0, "repetition_penalty": 1.3, "penalty_range": 3, "penalty_decay": 0},
]
# Several at once: the order of operations matters for each of these.
COMBINED = [
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "top_a": 0.05, "min_p": 0.02, "tfs": 0.97, "typical": 0.95,
     "min_temp": 0.5, "max_temp": 1.5, "xtc_probability": 0.5, "xtc_threshold": 0.03, "skew": 0.3},
    {"temperature": 1.3, "temperature_last": 1, "top_k": 60, "min_p": 0.01, "mirostat": 1, "mirostat_mu": 5.0,
     "dry_multiplier": 0.5, "repetition_penalty": 1.2, "penalty_range": 8, "penalty_decay": 4},
    {"temperature": 0.9, "smoothing_factor": 0.5, "top_p": 0.9, "tfs": 0.95, "xtc_probability": 0.3,
     "xtc_threshold": 0.01, "skew": -0.4, "dry_multiplier": 1.5, "dry_allowed_length": 1},
    {"temperature": 1.0, "top_k": 25, "typical": 0.8, "mirostat": 1, "mirostat_mu": 3.0, "min_temp": 0.2,
     "max_temp": 2.0, "temp_exponent": 0.5},
]


def make_batch(rows: list[dict], seed: int):
    rng = np.random.default_rng(seed)
    s = len(rows)
    logits = (rng.standard_normal((s, V)) * 2.5).astype(np.float32)
    boost = rng.integers(0, V, size=(s, 6))
    np.put_along_axis(logits, boost, rng.uniform(3.0, 6.0, size=(s, 6)).astype(np.float32), axis=-1)
    logits[:, 10] += 4.0  # an exempt token among the likely ones
    hists = []
    for _ in range(s):
        motif = list(rng.integers(5, 40, size=4))
        h = (motif + [int(rng.integers(5, 250))] + motif[:3] + [3] + motif + list(rng.integers(5, 250, size=3))
             + motif[:3])  # repeats (DRY matches), a breaker inside
        hists.append(h[-R:])
    history = np.full((s, R), -1, np.int32)
    for i, h in enumerate(hists):
        history[i, R - len(h):] = h
    return logits, hists, history


def run(rows, logits, history, breakers=BREAKERS, exempt=EXEMPT):
    s = len(rows)
    return np.asarray(_processed(
        jnp.asarray(logits), SamplingRows.make(rows), history=jnp.asarray(history),
        bias_ids=jnp.full((s, 2), -1, jnp.int32), bias_values=jnp.zeros((s, 2), jnp.float32),
        dry_breakers=jnp.asarray(np.stack([pack(breakers, V)] * s)),
        xtc_exempt=jnp.asarray(np.stack([pack(exempt, V)] * s))))


def assert_rows_match(rows, logits, hists, got):
    for i, st in enumerate(rows):
        want = ref_final(logits[i], st, hists[i], BREAKERS, EXEMPT)
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want), err_msg=f"row {i} keep set {st}")
        fin = np.isfinite(want)
        np.testing.assert_allclose(np.exp(got[i][fin]), np.exp(want[fin]), atol=2e-5, rtol=2e-3,
                                   err_msg=f"row {i} {st}")
        # and in log space, where an option that moves only tiny probabilities still shows (ignoring dry_base moved
        # a probability by 3e-11, far under the atol above, and its log-probability by 0.5). Skew's float32
        # transform is looser on the smallest probabilities, the more so the larger |skew| (0.044 at p = 1.5e-6 with
        # skew 0.7, 0.067 at p = 4e-7 with -3: 0.5% of the log), every other option within 1e-5.
        atol, rtol = (0.0, 1e-2) if st.get("skew") else (2e-3, 1e-4)
        np.testing.assert_allclose(got[i][fin], want[fin], atol=atol, rtol=rtol, err_msg=f"row {i} {st} (log)")


# ----------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [ONE_AT_A_TIME, COMBINED], ids=["one_at_a_time", "combined"])
def test_full_sampler_matches_the_reference(rows):
    logits, hists, history = make_batch(rows, seed=len(rows))
    got = run(rows, logits, history)
    assert_rows_match(rows, logits, hists, got)


def test_banned_tokens_stay_out_of_every_option():
    """Tokens at -inf (bans, filters, stop tokens before min_new_tokens) are not part of the kept set: dynamic
    temperature's entropy and count, tail-free sampling's differences and skew's order ignore them (a NaN row or a
    shifted cut otherwise), and a large skew does not underflow."""
    rows = [{"temperature": 1.0, "min_temp": 0.3, "max_temp": 1.7},
            {"temperature": 1.0, "tfs": 0.8},
            {"temperature": 1.0, "top_k": 5, "tfs": 0.5},
            {"temperature": 1.0, "skew": 3.0},
            {"temperature": 1.0, "skew": -3.0, "top_k": 40},
            {"temperature": 1.0, "temperature_last": 1, "xtc_probability": 0.5, "xtc_threshold": 0.01}]
    logits, hists, history = make_batch(rows, seed=7)
    banned = np.random.default_rng(7).random(logits.shape) < 0.9
    banned[:, :4] = False
    logits[banned] = -np.inf
    logits[2, 5:] = -np.inf  # a constrained row: four tokens left
    got = run(rows, logits, history)
    assert np.all(np.isfinite(got).any(axis=-1)) and not np.isnan(got).any()
    assert_rows_match(rows, logits, hists, got)
    extreme = run([{"temperature": 1.0, "skew": 15.0}, {"temperature": 1.0, "skew": -15.0}], logits[:2], history[:2])
    np.testing.assert_allclose(np.exp(extreme).sum(axis=-1), 1.0, rtol=1e-4)  # no underflow to an empty row
    assert SamplingSettings(penalty_range=0, penalty_decay=4, repetition_penalty=1.2).history_window(64) == 4


def test_each_option_changes_the_distribution():
    """Every row's option really acts (a broken switch would leave the plain temperature distribution)."""
    rows = ONE_AT_A_TIME
    logits, _, history = make_batch(rows, seed=len(rows))
    got = run(rows, logits, history)
    plain = run([{"temperature": r["temperature"], **{k: r[k] for k in ("top_k", "top_p") if k in r}}
                 for r in rows], logits, history)
    for i, st in enumerate(rows):
        same_set = np.array_equal(np.isfinite(got[i]), np.isfinite(plain[i]))
        fin = np.isfinite(plain[i])
        assert not same_set or np.max(np.abs(got[i][fin] - plain[i][fin])) > 1e-2, f"row {i} {st} had no effect"


def test_rows_without_options_are_untouched_by_their_neighbours():
    """A plain row gives the same distribution alone and next to rows using every option."""
    plain = {"temperature": 0.8, "top_k": 50, "top_p": 0.8, "repetition_penalty": 1.025}
    rows = [plain, *COMBINED, plain]
    logits, _, history = make_batch(rows, seed=3)
    mixed = run(rows, logits, history)
    alone = run([plain, plain], logits[[0, -1]], history[[0, -1]])
    np.testing.assert_array_equal(mixed[[0, -1]], alone)


def test_penalty_decay_hand_computed():
    """Range 2, decay 2 (ExLlamaV2's pass): distances 0-2 get the full penalty, distance 3 half, then nothing."""
    logits = jnp.asarray([[2.0, 2.0, 2.0, 2.0, -1.0, 3.0]], jnp.float32)
    history = jnp.asarray([[5, 0, 1, 2, 4, 3]], jnp.int32)  # distances: 3->0, 4->1, 2->2, 1->3, 0->4, 5->5
    p = SamplingRows.make([{"repetition_penalty": 2.0, "frequency_penalty": 0.5, "penalty_range": 2,
                            "penalty_decay": 2}])
    got = np.asarray(apply_penalties(logits, p, history))[0]
    # weights: d <= 2 -> 1; d = 3 -> 1/2; d >= 4 -> 0. rep at weight w: 1 + (2 - 1) w
    np.testing.assert_allclose(got, [2.0, 2.0 / 1.5 - 0.25, 1.0 - 0.5, 1.0 - 0.5, -2.0 - 0.5, 3.0], rtol=1e-6)
    ref = ref_penalties(np.asarray(logits[0], np.float64), {"repetition_penalty": 2.0, "frequency_penalty": 0.5,
                                                            "penalty_range": 2, "penalty_decay": 2}, [5, 0, 1, 2, 4, 3])
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_dry_hand_computed_and_breakers():
    v = 16
    x = jnp.zeros((3, v), jnp.float32)
    # 1 2 3 | 4 ... 1 2 3: the suffix "1 2 3" (L = 3) was followed by 4 once and by 5 once
    h = [[1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3], [1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3],
         [-1, -1, 1, 2, 3, 4, 9, 7, 2, 3, 4, 2, 3]]
    p = SamplingRows.make([{"dry_multiplier": 1.0, "dry_base": 2.0, "dry_allowed_length": 2}] * 3)
    breakers = np.stack([pack([], v), pack([2], v), pack([], v)])  # row 1: 2 breaks every match
    got = np.asarray(apply_dry(x, p, jnp.asarray(h, jnp.int32), jnp.asarray(breakers)))
    want0 = np.zeros(v)
    want0[[4, 5]] = -2.0  # 2^(3 - 2) for each follower of the longest suffix
    np.testing.assert_allclose(got[0], want0)
    np.testing.assert_allclose(got[1], np.zeros(v))  # "3" alone (L = 1) is below allowed_length
    want2 = np.zeros(v)
    want2[4] = -2.0  # "2 3" (L = 2) was followed by 4 twice: 2^0 each
    np.testing.assert_allclose(got[2], want2)


def test_xtc_is_the_expectation_of_the_coin_and_sampling_follows_it():
    """Drawing many seeds from the XTC distribution gives the mixture's frequencies (what a per-token coin gives)."""
    v = 8
    logits = np.log(np.asarray([[0.4, 0.3, 0.2, 0.05, 0.05, 0, 0, 0]], np.float64) + 1e-12).astype(np.float32)
    st = {"temperature": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.15}
    n = 4000
    rows = [{**st, "seed": i} for i in range(n)]
    out = _sample(jnp.asarray(np.repeat(logits, n, 0)), SamplingRows.make(rows), positions=jnp.zeros(n, jnp.int32),
                  history=jnp.zeros((n, 0), jnp.int32), bias_ids=jnp.full((n, 1), -1, jnp.int32),
                  bias_values=jnp.zeros((n, 1), jnp.float32), return_top_k=0)
    freq = np.bincount(np.asarray(out.token), minlength=v) / n
    p = np.asarray([0.4, 0.3, 0.2, 0.05, 0.05, 0, 0, 0])
    without = np.asarray([0, 0, 0.2, 0.05, 0.05, 0, 0, 0]) / 0.3  # 0.4 and 0.3 removed, 0.2 (least) kept
    want = 0.5 * without + 0.5 * p
    np.testing.assert_allclose(freq, want, atol=0.025)


def test_token_sets_pack_as_the_device_reads_them():
    ids = [0, 5, 31, 32, 63, 64, 255]
    words = pack(ids, V)
    assert list(unpack(words, V)) == ids
    from paged.device.sampling import token_bits
    bits = np.asarray(token_bits(jnp.asarray(words[None]), jnp.arange(V, dtype=jnp.int32)[None]))[0]
    assert list(np.flatnonzero(bits)) == ids


# ----------------------------------------------------------------------------------------------------------------
# In the generator: per-job state, decode bursts, speculative decoding, validation
# ----------------------------------------------------------------------------------------------------------------

from paged import DynamicGenerator, Job, SamplingSettings  # noqa: E402
from paged.errors import InvalidJobError, InvalidSettingsError  # noqa: E402
from paged.testing import ByteTokenizer, drain, tiny_config, tiny_model  # noqa: E402
from paged.token_sets import DRY_BREAKER_CHARS, XTC_EXEMPT_CHARS, tokens_with_chars  # noqa: E402

CFG = tiny_config(96)
MODEL = tiny_model(CFG, seed=1)
GEN = dict(num_pages=40, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=64, max_penalty_range=32)
FULL = SamplingSettings(temperature=0.9, top_k=30, top_p=0.95, top_a=0.02, tfs=0.97, min_temp=0.5, max_temp=1.4,
                        xtc_probability=0.5, xtc_threshold=0.05, skew=0.3, dry_multiplier=0.8, dry_allowed_length=1,
                        dry_sequence_breakers=(3,), xtc_ignore_tokens=(4,), repetition_penalty=1.2, penalty_range=8,
                        penalty_decay=4)
DRY_GREEDY = SamplingSettings.greedy(dry_multiplier=1.5, dry_allowed_length=1, dry_sequence_breakers=(7,))
DECAY_GREEDY = SamplingSettings.greedy(repetition_penalty=1.6, penalty_range=3, penalty_decay=5)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 11, 12, 13, 11, 12], [30, 31, 30, 31, 30, 31, 30],
           [40, 41, 42, 43, 40, 41, 42]]


def mirostat(tau: float) -> SamplingSettings:
    return SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, mirostat=True,
                            mirostat_tau=tau, mirostat_eta=0.3)


def run_jobs(settings, n=24, **kw):
    g = DynamicGenerator(MODEL, **{**GEN, **kw})
    calls = []
    engine_run = g.engine.run
    g.engine.run = lambda rows, **k: calls.append(k.get("num_steps", 1)) or engine_run(rows, **k)
    jobs = [Job(p, n, gen_settings=s, seed=100 + i, identifier=i, return_probs=True)
            for i, (p, s) in enumerate(zip(PROMPTS, settings))]
    g.enqueue(jobs)
    c = drain(g)
    g.pool.check({})
    toks = {i: [t for r in c.results if r["identifier"] == i for t in r.get("token_ids", [])] for i in range(len(jobs))}
    probs = {i: [p for r in c.results if r["identifier"] == i for p in r.get("token_probs", [])]
             for i in range(len(jobs))}
    return toks, probs, jobs, g, calls


@pytest.mark.slow
def test_bursts_give_the_tokens_of_single_steps():
    """decode_steps=4 slides DRY's and the decaying penalties' history on the device: the same tokens and
    probabilities as one step at a time (the per-row ranges make the slide exact)."""
    settings = [DRY_GREEDY, FULL, DECAY_GREEDY, DRY_GREEDY]
    one, p1, _, _, calls1 = run_jobs(settings)
    four, p4, _, _, calls4 = run_jobs(settings, decode_steps=4)
    assert set(calls1) == {1} and 4 in calls4
    assert four == one
    for i in one:
        np.testing.assert_allclose(p4[i], p1[i], rtol=1e-5)
    plain, pp, _, _, _ = run_jobs([SamplingSettings.greedy(), FULL, SamplingSettings.greedy(), DRY_GREEDY])
    assert plain[0] != one[0]  # DRY broke the greedy loop
    assert not np.allclose(pp[2], p1[2], rtol=1e-3)  # the decaying penalty changed the distribution


def test_mirostat_mu_is_each_jobs_own_and_follows_its_feedback():
    toks, probs, jobs, g, calls = run_jobs([mirostat(2.0), FULL, mirostat(5.0)], decode_steps=4)
    assert set(calls) == {1}  # mirostat's mu changes on the host after every token: no bursts
    for job, tau in ((jobs[0], 2.0), (jobs[2], 5.0)):
        mu = 2 * tau
        for p in probs[job.identifier]:
            mu += 0.3 * (tau - (-math.log2(p)))
        assert job.mirostat_mu == pytest.approx(mu, rel=1e-6)
    assert jobs[0].mirostat_mu != jobs[2].mirostat_mu and jobs[1].mirostat_mu is None
    # the device row carries the job's current mu
    row = g.scheduler.row(jobs[0], [toks[0][-1]], True)
    assert row.sampling["mirostat_mu"] == jobs[0].mirostat_mu
    # a low target surprise keeps the draws among likely tokens
    assert np.mean(-np.log2(probs[0])) < np.mean(-np.log2(probs[2]))


@pytest.mark.slow
def test_speculation_keeps_outputs_with_the_full_sampler():
    """Greedy DRY and decay jobs give exactly their non-speculative tokens with prompt-lookup drafts (the drafts
    enter the per-position histories); mirostat jobs are never drafted for, so their seeded tokens are unchanged;
    a sampled full-option job is seed-deterministic with speculation."""
    settings = [DRY_GREEDY, DECAY_GREEDY, mirostat(3.0), FULL]
    ref, _, _, _, _ = run_jobs(settings)
    spec = dict(use_ngram_draft=True, num_draft_tokens=3, max_ngram=3)
    got, _, jobs, g, _ = run_jobs(settings, **spec)
    again, _, _, _, _ = run_jobs(settings, **spec)
    assert got[0] == ref[0] and got[1] == ref[1] and got[2] == ref[2]
    assert again == got
    assert jobs[2].drafted_tokens == 0 and g.metrics()["drafted_tokens"] > 0
    assert jobs[0].drafted_tokens > 0


def test_invalid_full_sampler_settings_and_jobs():
    with pytest.raises(InvalidSettingsError, match="dry_range"):
        SamplingSettings(dry_range=5, dry_max_ngram=20)
    with pytest.raises(InvalidSettingsError, match="tfs"):
        SamplingSettings(tfs=1.5)
    with pytest.raises(InvalidSettingsError, match="xtc_threshold"):
        SamplingSettings(xtc_threshold=0.0)
    with pytest.raises(InvalidSettingsError, match="mirostat_tau"):
        SamplingSettings(mirostat_tau=0.0)
    with pytest.raises(InvalidSettingsError, match="temperature_last"):
        SamplingSettings(temperature_last=1)
    with pytest.raises(InvalidSettingsError, match="dry_sequence_breakers"):
        SamplingSettings(dry_sequence_breakers="abc")
    g = DynamicGenerator(MODEL, **GEN)
    with pytest.raises(InvalidJobError, match="tokenizer"):  # the default breakers need a tokenizer
        g.enqueue(Job([1, 2, 3], 4, gen_settings=SamplingSettings(dry_multiplier=1.0)))
    with pytest.raises(InvalidSettingsError, match="xtc_ignore_tokens"):
        g.enqueue(Job([1, 2, 3], 4, gen_settings=SamplingSettings(xtc_probability=0.5, xtc_ignore_tokens=(500,))))
    no_history = DynamicGenerator(MODEL, **{**GEN, "max_penalty_range": 0})
    with pytest.raises(InvalidJobError, match="max_penalty_range"):
        no_history.enqueue(Job([1, 2, 3], 4, gen_settings=DRY_GREEDY))
    assert not g.pending and not no_history.pending  # nothing was half-enqueued


def test_default_token_sets_come_from_the_tokenizer():
    tok = ByteTokenizer()
    breakers = set(tokens_with_chars(tok, tok.vocab_size, DRY_BREAKER_CHARS))
    assert {ord("."), ord(","), ord("\n"), ord('"'), ord("(")} <= breakers and ord("a") not in breakers
    assert set(tok.special_token_ids) <= breakers
    exempt = set(tokens_with_chars(tok, tok.vocab_size, XTC_EXEMPT_CHARS))
    assert ord("\n") in exempt and ord(".") not in exempt
    from paged.testing import FakeEngine
    g = DynamicGenerator(tokenizer=tok, engine=FakeEngine(num_pages=16))
    job = Job(tok.encode("hi."), 3, gen_settings=SamplingSettings(dry_multiplier=1.0, xtc_probability=0.5))
    g.enqueue(job)
    assert set(unpack(job.dry_breakers, g.vocab_size)) == breakers
    assert set(unpack(job.xtc_exempt, g.vocab_size)) == exempt
    row = g.scheduler.row(job, list(job.sequence), True)
    assert row.dry_breakers is job.dry_breakers and row.xtc_exempt is job.xtc_exempt


def test_options_compile_nothing_after_warmup():
    """Every option is a runtime value: after warmup(), jobs using all of them (mixed with plain ones) compile no
    new variant."""
    from paged.device.engine import count_compiles

    g = DynamicGenerator(MODEL, **GEN)
    g.warmup()
    before = count_compiles()
    g.enqueue([Job(p, 8, gen_settings=s, seed=i, identifier=i)
               for i, (p, s) in enumerate(zip(PROMPTS, [FULL, mirostat(3.0), DRY_GREEDY, SamplingSettings()]))])
    drain(g)
    assert count_compiles() == before


# ----------------------------------------------------------------------------------------------------------------
# Settings at the edge of what SamplingSettings accepts
# ----------------------------------------------------------------------------------------------------------------
def _at_the_limits() -> list[SamplingSettings]:
    """One job per float setting at +-FLOAT_LIMIT (or its smallest accepted value), with the temperature at the
    lowest sampling value, where quotients by it are largest."""
    from paged.settings import FLOAT_LIMIT as L

    hot = dict(temperature=0.01, top_k=0, top_p=1.0, repetition_penalty=1.0)
    cases = [dict(frequency_penalty=L), dict(frequency_penalty=-L), dict(presence_penalty=L),
             dict(presence_penalty=-L), dict(repetition_penalty=1 / L), dict(repetition_penalty=L),
             dict(token_bias={5: L, 6: L}), dict(token_bias={5: -L, 7: L}), dict(smoothing_factor=L),
             dict(temperature=L), dict(top_a=L), dict(min_temp=0.0, max_temp=L, temp_exponent=L),
             dict(min_temp=0.5, max_temp=L, temp_exponent=1 / L), dict(dry_multiplier=L, dry_base=L),
             dict(mirostat=True, mirostat_tau=L, mirostat_eta=L, mirostat_mu=L),
             dict(mirostat=True, mirostat_tau=1 / L), dict(cfg_scale=L), dict(cfg_scale=-L),
             dict(frequency_penalty=L, presence_penalty=L, repetition_penalty=1 / L, token_bias={9: L},
                  smoothing_factor=L)]
    return [SamplingSettings(**{**hot, **c}) for c in cases]


def _sample_settings(cases: dict[int, SamplingSettings]) -> tuple[np.ndarray, np.ndarray]:
    """(token, logprob) of each case's row, in one batch, followed by the CFG rows' negative-prompt rows (greedy,
    neutral). Case k draws with seed k from logits of its own (normal, seeded by k), after a history of repeats
    (penalties and DRY apply), wherever it sits in the batch."""
    n = len(cases)
    rows, bias_ids, bias_values = [], np.full((2 * n, 2), -1, np.int32), np.zeros((2 * n, 2), np.float32)
    logits = np.zeros((2 * n, V), np.float32)
    for i, (k, s) in enumerate(cases.items()):
        row = s.device_row(seed=k)
        if s.cfg_scale is not None:
            row["cfg_partner"] = n + i  # its negative prompt's logits
        rows.append(row)
        for j, (t, v) in enumerate(s.bias().items()):
            bias_ids[i, j], bias_values[i, j] = t, v
        logits[i] = logits[n + i] = np.random.default_rng(k).normal(0, 8, V)
    rows += [{}] * n
    history = np.tile(np.asarray([5, 6, 7, 5, 6, 7, 5, 6] * 3, np.int32), (2 * n, 1))
    out = _sample(jnp.asarray(logits), SamplingRows.make(rows), positions=jnp.full(2 * n, R, jnp.int32),
                  history=jnp.asarray(history), bias_ids=jnp.asarray(bias_ids), bias_values=jnp.asarray(bias_values),
                  return_top_k=0)
    return np.asarray(out.token)[:n], np.asarray(out.logprob)[:n]


def test_settings_at_the_limits_sample_a_token_with_a_finite_logprob():
    """Every float setting SamplingSettings accepts keeps the float32 sampler finite, alone in a batch and among the
    others: a token with a finite log-probability, the same token either way. (Unclamped, a bias of 1e10 at
    temperature 0.01 had turned a row's every log-probability to -inf, and 1e30 to NaN; `LOGIT_LIMIT`.)"""
    settings = _at_the_limits()
    token, logprob = _sample_settings(dict(enumerate(settings)))
    assert ((0 <= token) & (token < V)).all() and np.isfinite(logprob).all(), list(zip(token, logprob))
    for i, s in enumerate(settings):
        alone_token, alone_logprob = _sample_settings({i: s})
        assert np.isfinite(alone_logprob).all() and alone_token[0] == token[i], (s, alone_token, token[i])
