"""Tests for paged/device/sampling.py against an independent NumPy reference (float64, per-row loops)."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.device.sampling import (
    NEUTRAL,
    SampleOutput,
    SamplingRows,
    apply_bias,
    apply_penalties,
    first_argmax,
    gumbel_at,
    processed_logprobs,
    row_key_data,
    row_keys,
    sample,
)

# One main shape shared by most tests so each jitted function compiles once.
S, V, R, B, K = 64, 512, 32, 8, 5

_sample = jax.jit(sample, static_argnames="return_top_k")
_processed = jax.jit(processed_logprobs)


# ----------------------------------------------------------------------------------------------------------------
# NumPy reference
# ----------------------------------------------------------------------------------------------------------------


def _softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    e = np.exp(x - m)
    return e / e.sum()


def ref_adjusted(logits: np.ndarray, st: dict, hist: np.ndarray, bias_ids: np.ndarray, bias_vals: np.ndarray):
    """Penalties then sparse bias, one row, float64."""
    x = logits.astype(np.float64).copy()
    rep = st.get("repetition_penalty", 1.0)
    freq = st.get("frequency_penalty", 0.0)
    pres = st.get("presence_penalty", 0.0)
    for tok, count in Counter(int(t) for t in hist if t >= 0).items():
        x[tok] = x[tok] / rep if x[tok] > 0 else x[tok] * rep
        x[tok] -= freq * count + pres
    for tok, val in zip(bias_ids, bias_vals, strict=True):
        if tok >= 0:
            x[tok] += val
    return x


def _cut_count(mass_in_order: np.ndarray, target: float) -> int:
    """Smallest n such that the first n entries reach `target` (all of them if never)."""
    c = np.cumsum(mass_in_order)
    return min(int(np.searchsorted(c, target, side="left")) + 1, len(c))


def ref_final(logits: np.ndarray, st: dict, hist: np.ndarray, bias_ids: np.ndarray, bias_vals: np.ndarray,
              exact_ties: bool = False):
    """Final log-distribution of one row (-inf outside the kept set), float64.

    Returns (log_q, ambiguous): `ambiguous` flags rows where some cut is so close to its threshold (1e-5) that float32
    rounding in the implementation may legitimately decide it the other way; keep-set comparisons skip those rows.
    `exact_ties`: typical scores that are exactly equal (tied logits) are ties, not near-ties.
    """
    eps = 1e-5
    ambiguous = False
    x = ref_adjusted(logits, st, hist, bias_ids, bias_vals)
    temp = st.get("temperature", 0.0)
    if not temp >= 0.01:
        with np.errstate(divide="ignore"):
            return np.log(_softmax(x)), False
    p = _softmax(x / temp)
    keep = p > 0

    def renorm() -> np.ndarray:
        q = np.where(keep, p, 0.0)
        return q / q.sum()

    k = st.get("top_k", 0)
    if 0 < k < len(p):
        ps = np.sort(p)[::-1]
        keep &= p >= ps[k - 1]  # ties with the k-th largest survive
        ambiguous |= 0 < ps[k - 1] - ps[k] < eps * ps[k - 1]
    top_p = st.get("top_p", 1.0)
    if 0 < top_p < 1:
        q = renorm()
        order = np.argsort(-q, kind="stable")
        n = _cut_count(q[order], top_p)
        keep &= q >= q[order[n - 1]]
        ambiguous |= np.min(np.abs(np.cumsum(q[order]) - top_p)) < eps
    min_p = st.get("min_p", 0.0)
    if min_p > 0:
        q = renorm()
        keep &= q >= min_p * q.max()
        ambiguous |= np.min(np.abs(q - min_p * q.max())) < eps * min_p * q.max()
    typical = st.get("typical", 0.0)
    if 0 < typical < 1:
        q = renorm()
        idx = np.flatnonzero(keep)
        logq = np.log(q[idx])
        entropy = -np.sum(q[idx] * logq)
        score = np.abs(-logq - entropy)
        order = np.argsort(score, kind="stable")
        n = _cut_count(q[idx][order], typical)
        kept = idx[score <= score[order[n - 1]]]
        keep = np.zeros_like(keep)
        keep[kept] = True
        ambiguous |= np.min(np.abs(np.cumsum(q[idx][order]) - typical)) < eps
        gap = score[order[n]] - score[order[n - 1]] if n < len(order) else np.inf
        ambiguous |= (0 < gap if exact_ties else True) and gap < 2 * eps
    q = renorm()
    with np.errstate(divide="ignore"):
        return np.where(keep, np.log(np.where(keep, q, 1.0)), -np.inf), bool(ambiguous)


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------

ROW_KINDS = [
    {"temperature": 0.0},
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 7},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.2, "min_p": 0.08},
    {"temperature": 1.0, "typical": 0.6},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.02, "typical": 0.9},
    {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.5},
    {"temperature": 1.1, "repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.2, "top_p": 0.9},
    {"temperature": 0.005, "top_k": 3},  # below the greedy cut: truncation settings must be ignored
    {"temperature": 1.5, "top_k": 20, "min_p": 0.05},
]


def random_rows(rng: np.random.Generator, n: int) -> list[dict]:
    """Cycle through ROW_KINDS with jittered values and random seeds."""
    rows = []
    for i in range(n):
        row = dict(ROW_KINDS[i % len(ROW_KINDS)])
        for key in ("top_p", "min_p", "typical"):
            if key in row:
                row[key] = float(np.clip(row[key] * rng.uniform(0.8, 1.05), 0.01, 0.99))
        if row.get("top_k", 0) > 0:
            row["top_k"] = int(rng.integers(1, row["top_k"] + 1))
        row["seed"] = int(rng.integers(0, 2**32))
        rows.append(row)
    return rows


def random_batch(seed: int, rows: list[dict] | None = None, s: int = S, v: int = V, r: int = R, b: int = B):
    rng = np.random.default_rng(seed)
    rows = random_rows(rng, s) if rows is None else rows
    logits = (rng.standard_normal((s, v)) * 3.0).astype(np.float32)
    history = rng.integers(0, v, size=(s, r)).astype(np.int32)
    # Make repeats likely (frequency counts > 1) and pad a random tail with -1.
    history[:, : r // 2] = rng.integers(0, 16, size=(s, r // 2))
    for i in range(s):
        history[i, rng.integers(r // 2, r + 1) :] = -1
    bias_ids = rng.integers(-1, v, size=(s, b)).astype(np.int32)
    bias_values = rng.normal(0.0, 2.0, size=(s, b)).astype(np.float32)
    bias_values[rng.random((s, b)) < 0.25] = -np.inf
    return logits, rows, history, bias_ids, bias_values


def run_sample(logits, rows, history, bias_ids, bias_values, positions, k: int = K) -> SampleOutput:
    out = _sample(
        jnp.asarray(logits),
        SamplingRows.make(rows),
        positions=jnp.asarray(positions, jnp.int32),
        history=jnp.asarray(history),
        bias_ids=jnp.asarray(bias_ids),
        bias_values=jnp.asarray(bias_values),
        return_top_k=k,
    )
    return jax.tree.map(np.asarray, out)


def run_processed(logits, rows, history, bias_ids, bias_values) -> np.ndarray:
    return np.asarray(
        _processed(
            jnp.asarray(logits),
            SamplingRows.make(rows),
            history=jnp.asarray(history),
            bias_ids=jnp.asarray(bias_ids),
            bias_values=jnp.asarray(bias_values),
        )
    )


def ref_batch(logits, rows, history, bias_ids, bias_values, exact_ties: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """([S, V] reference log-distributions, bool [S] ambiguous rows)."""
    res = [ref_final(logits[i], rows[i], history[i], bias_ids[i], bias_values[i], exact_ties)
           for i in range(len(rows))]
    return np.stack([r[0] for r in res]), np.array([r[1] for r in res])


def assert_same_distribution(got: np.ndarray, want: np.ndarray, ambiguous: np.ndarray, rows: list[dict]) -> None:
    assert ambiguous.sum() <= 4, "too many near-threshold rows for the test to mean much"
    for i in np.flatnonzero(~ambiguous):
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want[i]), err_msg=f"row {i} keep set {rows[i]}")
        finite = np.isfinite(want[i])
        np.testing.assert_allclose(got[i][finite], want[i][finite], atol=2e-4, err_msg=f"row {i} {rows[i]}")


# ----------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------


def test_make_defaults_and_validation() -> None:
    p = SamplingRows.make(3)
    assert all(getattr(p, f).shape == (3,) for f in NEUTRAL)
    assert p.top_k.dtype == np.int32 and p.seed.dtype == np.uint32 and p.temperature.dtype == np.float32
    assert np.all(np.asarray(p.greedy))
    p = SamplingRows.make([{"top_k": 3}, {"temperature": 0.5, "seed": -1}], temperature=1.0, top_p=0.9)
    np.testing.assert_array_equal(p.top_k, [3, 0])
    np.testing.assert_allclose(p.temperature, [1.0, 0.5])
    np.testing.assert_allclose(p.top_p, [0.9, 0.9])
    assert p.seed[1] == 0xFFFFFFFF
    np.testing.assert_array_equal(np.asarray(p.greedy), [False, False])
    with pytest.raises(ValueError, match="unknown"):
        SamplingRows.make([{"topk": 3}])
    with pytest.raises(ValueError, match="unknown"):
        SamplingRows.make(2, temprature=1.0)


def test_penalties_hand_computed() -> None:
    logits = jnp.asarray([[2.0, -1.0, 3.0, -0.5, 1.0, 0.0]] * 4, jnp.float32)
    history = jnp.asarray([[0, 1, 1, 2, 2, 2, -1, -1]] * 4, jnp.int32)
    params = SamplingRows.make(
        [
            {"repetition_penalty": 2.0},
            {"frequency_penalty": 0.5},
            {"presence_penalty": 0.25},
            {"repetition_penalty": 1.5, "frequency_penalty": 0.1, "presence_penalty": 1.0},
        ]
    )
    got = np.asarray(apply_penalties(logits, params, history))
    want = np.array(
        [
            [1.0, -2.0, 1.5, -0.5, 1.0, 0.0],  # positive divided, negative multiplied; absent tokens untouched
            [1.5, -2.0, 1.5, -0.5, 1.0, 0.0],  # minus 0.5 per occurrence
            [1.75, -1.25, 2.75, -0.5, 1.0, 0.0],  # minus 0.25 once per distinct token
            [2 / 1.5 - 1.1, -1.5 - 1.2, 2.0 - 1.3, -0.5, 1.0, 0.0],
        ]
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # "No history": an all-padding history and an empty [S, 0] history are both neutral.
    for empty in (jnp.full((4, 3), -1, jnp.int32), jnp.zeros((4, 0), jnp.int32)):
        np.testing.assert_array_equal(np.asarray(apply_penalties(logits, params, empty)), np.asarray(logits))


def test_sparse_bias() -> None:
    logits = jnp.zeros((2, 5), jnp.float32)
    ids = jnp.asarray([[1, 1, -1, 4], [0, -1, -1, -1]], jnp.int32)
    vals = jnp.asarray([[0.5, 0.25, 9.0, -jnp.inf], [-2.0, 7.0, 7.0, 7.0]], jnp.float32)
    got = np.asarray(apply_bias(logits, ids, vals))
    np.testing.assert_array_equal(got, [[0, 0.75, 0, 0, -np.inf], [-2.0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(apply_bias(logits, ids[:, :0], vals[:, :0])), np.zeros((2, 5)))


def test_greedy_is_argmax_after_penalties_and_bias() -> None:
    rng = np.random.default_rng(1)
    rows = []
    for i in range(S):
        penalties = rng.uniform([1.0, 0.0, 0.0], [2.0, 1.0, 1.0])
        rows.append({
            "repetition_penalty": float(penalties[0]),
            "frequency_penalty": float(penalties[1]),
            "presence_penalty": float(penalties[2]),
            "temperature": [0.0, -1.0, 0.009][i % 3],  # all below the greedy cut
            "top_k": i % 4,  # truncation settings must not affect greedy rows
        })
    logits, rows, history, bias_ids, bias_values = random_batch(2, rows)
    # Penalise / ban the raw argmax of every row so the greedy choice must move.
    history[:, 0] = np.argmax(logits, axis=-1)
    bias_ids[:, 0] = np.argsort(-logits, axis=-1)[:, 1]
    bias_values[:, 0] = -np.inf
    out = run_sample(logits, rows, history, bias_ids, bias_values, positions=np.arange(S))
    for i in range(S):
        adj = ref_adjusted(logits[i], rows[i], history[i], bias_ids[i], bias_values[i])
        assert out.token[i] == np.argmax(adj)
        # Greedy rows report log_softmax of the processed logits at temperature 1.
        np.testing.assert_allclose(out.logprob[i], np.log(_softmax(adj)[out.token[i]]), atol=1e-4)
    assert np.mean(out.token != np.argmax(logits, axis=-1)) > 0.5


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_processed_distribution_matches_reference(seed: int) -> None:
    batch = random_batch(seed)
    got = run_processed(*batch)
    want, ambiguous = ref_batch(*batch)
    assert_same_distribution(got, want, ambiguous, batch[1])
    kept = np.isfinite(want).sum(-1)
    # Sanity of the data: the mix really contains truncated and untruncated rows.
    assert kept.min() < 10 and kept.max() > 100


@pytest.mark.parametrize("field", ["top_p", "min_p", "typical", "top_k"])
def test_single_filter_keep_sets(field: str) -> None:
    rng = np.random.default_rng({"top_p": 21, "min_p": 22, "typical": 23, "top_k": 24}[field])
    values = {
        "top_p": lambda: float(rng.uniform(0.05, 0.99)),
        "min_p": lambda: float(rng.uniform(0.001, 0.5)),
        "typical": lambda: float(rng.uniform(0.05, 0.99)),
        "top_k": lambda: int(rng.integers(1, V + 50)),
    }[field]
    rows = [{"temperature": float(rng.uniform(0.3, 2.0)), field: values(), "seed": i} for i in range(S)]
    logits, rows, history, bias_ids, bias_values = random_batch(20, rows)
    history[:] = -1
    bias_ids[:] = -1
    got = run_processed(logits, rows, history, bias_ids, bias_values)
    want, ambiguous = ref_batch(logits, rows, history, bias_ids, bias_values)
    assert_same_distribution(got, want, ambiguous, rows)
    assert len(set(np.isfinite(want).sum(-1).tolist())) > S // 4  # many different keep-set sizes


def test_top_k_never_outside_top_k() -> None:
    rng = np.random.default_rng(30)
    rows = [{"temperature": 3.0, "top_k": int(rng.integers(1, 9)), "seed": 7 * i} for i in range(S)]
    logits, rows, history, bias_ids, bias_values = random_batch(31, rows)
    history[:] = -1
    bias_ids[:] = -1
    allowed = [set(np.argsort(-logits[i])[: rows[i]["top_k"]].tolist()) for i in range(S)]
    seen = [set() for _ in range(S)]
    for call in range(12):
        out = run_sample(logits, rows, history, bias_ids, bias_values, positions=np.full(S, 1000 + call))
        for i in range(S):
            assert out.token[i] in allowed[i]
            seen[i].add(int(out.token[i]))
    # At temperature 3 the draws are spread: rows with k >= 4 see more than one token.
    assert all(len(seen[i]) > 1 for i in range(S) if rows[i]["top_k"] >= 4)


@pytest.mark.slow  # fast tier: a lighter test covers the same path
def test_empirical_frequencies_match_reference() -> None:
    """Chi-square and total variation of 16384 draws per setting against the reference (deterministic seeds)."""
    rng = np.random.default_rng(40)
    configs = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 6},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 1.0, "typical": 0.7, "min_p": 0.02},
    ]
    s, v, calls = 4096, 32, 16  # a separate small-vocab shape: many rows per call keeps the call count low
    base = np.full((len(configs), v), -np.inf, np.float32)
    for c in range(len(configs)):
        support = rng.choice(v, size=12, replace=False)
        base[c, support] = rng.normal(0.0, 1.0, size=12)
    per = s // len(configs)
    rows = [{**configs[i // per], "seed": 1000 + i} for i in range(s)]
    logits = np.repeat(base, per, axis=0)
    empty = np.zeros((s, 0), np.int32)  # also exercises R = 0 and B = 0
    counts = np.zeros((len(configs), v))
    for pos in range(calls):
        out = run_sample(logits, rows, empty, empty, empty.astype(np.float32), positions=np.full(s, pos), k=0)
        np.add.at(counts, (np.arange(s) // per, out.token), 1)
    n = per * calls
    for c, st in enumerate(configs):
        p = np.exp(ref_final(base[c], st, empty[0], empty[0], empty[0])[0])
        assert counts[c][p == 0].sum() == 0, f"config {st} drew outside the support"
        support = p > 0
        chi2 = np.sum((counts[c][support] - n * p[support]) ** 2 / (n * p[support]))
        df = support.sum() - 1
        # ~5 sigma of the chi2(df) null; a 15% temperature error gives a statistic several times larger.
        assert chi2 < df + 5 * np.sqrt(2 * df), f"config {st}: chi2 {chi2:.1f} with df {df}"
        assert 0.5 * np.abs(counts[c] / n - p).sum() < 0.02


def test_seed_invariance_across_batch_composition() -> None:
    rng = np.random.default_rng(50)
    logits, rows, history, bias_ids, bias_values = random_batch(51)
    # 8 sampling rows of interest; 4 of them share a seed but differ in position.
    mine = [i for i in range(S) if rows[i].get("temperature", 0) >= 0.01][:8]
    for j in mine[:4]:
        rows[j]["seed"] = 123
    positions = rng.integers(0, 4096, size=S)
    big = run_sample(logits, rows, history, bias_ids, bias_values, positions)
    # Same rows at shuffled indices inside a new 64-row batch of unrelated rows.
    other = random_batch(52)
    slots = rng.choice(S, size=8, replace=False)
    mixed = [np.array(x, copy=True) for x in (other[0], other[2], other[3], other[4])]
    mixed_rows = list(other[1])
    mixed_pos = rng.integers(0, 4096, size=S)
    for slot, j in zip(slots, mine, strict=True):
        for arr, src in zip(mixed, (logits, history, bias_ids, bias_values), strict=True):
            arr[slot] = src[j]
        mixed_rows[slot] = rows[j]
        mixed_pos[slot] = positions[j]
    out_mixed = run_sample(mixed[0], mixed_rows, mixed[1], mixed[2], mixed[3], mixed_pos)
    # And alone in a batch of 8 (a different batch size).
    perm = rng.permutation(8)
    sel = [mine[p] for p in perm]
    small = run_sample(logits[sel], [rows[j] for j in sel], history[sel], bias_ids[sel], bias_values[sel],
                       positions[sel])  # fmt: skip
    for slot, j in zip(slots, mine, strict=True):
        assert out_mixed.token[slot] == big.token[j]
        np.testing.assert_allclose(out_mixed.logprob[slot], big.logprob[j], atol=1e-5)
    np.testing.assert_array_equal(small.token, big.token[sel])
    # The position really changes the draw: the same seed and row over many positions gives several tokens.
    j = mine[1]
    tiled = [np.repeat(x[j : j + 1], S, 0) for x in (logits, history, bias_ids, bias_values)]
    rep = run_sample(tiled[0], [rows[j]] * S, tiled[1], tiled[2], tiled[3], np.arange(S))
    assert len(set(rep.token.tolist())) > 1


def test_banned_ids_never_drawn() -> None:
    rng = np.random.default_rng(60)
    rows = [{"temperature": float(rng.uniform(0.5, 4.0)), "seed": i} for i in range(S)]
    rows[0]["temperature"] = 0.0  # greedy rows must also avoid them
    logits, rows, history, bias_ids, bias_values = random_batch(61, rows)
    history[:] = -1
    # Ban the 8 most likely tokens of every row.
    bias_ids[:] = np.argsort(-logits, axis=-1)[:, :B]
    bias_values[:] = -np.inf
    banned = [set(bias_ids[i].tolist()) for i in range(S)]
    for call in range(10):
        out = run_sample(logits, rows, history, bias_ids, bias_values, positions=np.full(S, call))
        assert all(out.token[i] not in banned[i] for i in range(S))
        assert np.all(np.isfinite(out.logprob))
        assert all(not (set(out.top_ids[i].tolist()) & banned[i]) for i in range(S))


def test_logprob_and_top_k_outputs_consistent() -> None:
    batch = random_batch(70)
    rows = batch[1]
    out = run_sample(*batch, positions=np.arange(S) * 3)
    want, ambiguous = ref_batch(*batch)
    assert ambiguous.sum() <= 4
    assert out.top_ids.shape == (S, K) and out.top_logprobs.shape == (S, K)
    assert out.token.dtype == np.int32 and out.top_ids.dtype == np.int32
    for i in np.flatnonzero(~ambiguous):
        assert np.isfinite(want[i][out.token[i]]), f"row {i} drew a token outside the kept set"
        np.testing.assert_allclose(out.logprob[i], want[i][out.token[i]], atol=2e-4)
        assert out.top_ids[i, 0] == np.argmax(want[i])
        assert np.all(out.top_logprobs[i][:-1] >= out.top_logprobs[i][1:])
        np.testing.assert_allclose(out.top_logprobs[i], want[i][out.top_ids[i]], atol=2e-4)
        if not rows[i].get("temperature", 0) >= 0.01:
            assert out.token[i] == out.top_ids[i, 0]
    # return_top_k=0 gives empty [S, 0] arrays and the same tokens.
    out0 = run_sample(*batch, positions=np.arange(S) * 3, k=0)
    assert out0.top_ids.shape == (S, 0) and out0.top_logprobs.shape == (S, 0)
    np.testing.assert_array_equal(out0.token, out.token)


def test_all_greedy_batch_and_empty_history_and_bias() -> None:
    rng = np.random.default_rng(80)
    logits = rng.standard_normal((4, 64)).astype(np.float32)
    out = _sample(jnp.asarray(logits), SamplingRows.make(4), positions=jnp.zeros(4, jnp.int32),
                  history=jnp.zeros((4, 0), jnp.int32), bias_ids=jnp.zeros((4, 0), jnp.int32),
                  bias_values=jnp.zeros((4, 0), jnp.float32), return_top_k=2)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.token), np.argmax(logits, -1))
    ls = logits - logits.max(-1, keepdims=True)
    ls = ls - np.log(np.exp(ls).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out.logprob), ls.max(-1), atol=1e-5)


def test_large_vocab_batch() -> None:
    """V = 49152, S = 64: compiles, runs and stays within a few [S, V] buffers (no [S, V, V])."""
    s, v = 64, 49152
    logits, rows, history, bias_ids, bias_values = random_batch(90, s=s, v=v, r=64, b=4)
    args: dict[str, Any] = dict(
        positions=jnp.arange(s, dtype=jnp.int32), history=jnp.asarray(history), bias_ids=jnp.asarray(bias_ids),
        bias_values=jnp.asarray(bias_values),
    )  # fmt: skip
    params = SamplingRows.make(rows)
    compiled = _sample.lower(jnp.asarray(logits), params, **args, return_top_k=4).compile()
    mem = compiled.memory_analysis()
    if mem is not None and getattr(mem, "temp_size_in_bytes", 0):
        assert mem.temp_size_in_bytes < 64 * s * v * 4  # generous; an [S, V, V] tensor would be ~V/64 times more
    out = jax.tree.map(np.asarray, compiled(jnp.asarray(logits), params, **args))
    checked = 0
    for i in (0, 1, 2, 3, 4, 5, 6):  # one row of each of the first ROW_KINDS
        want, ambiguous = ref_final(logits[i], rows[i], history[i], bias_ids[i], bias_values[i])
        if ambiguous:
            continue
        checked += 1
        assert np.isfinite(want[out.token[i]])
        np.testing.assert_allclose(out.logprob[i], want[out.token[i]], atol=2e-4)
        assert out.top_ids[i, 0] == np.argmax(want)
    assert checked >= 5


# ----------------------------------------------------------------------------------------------------------------
# Sort-free truncation: candidates, bracketing search, sparse noise
# ----------------------------------------------------------------------------------------------------------------


def _processed_with(candidates: int):
    return jax.jit(functools.partial(processed_logprobs, candidates=candidates))


def _sample_with(candidates: int):
    return jax.jit(functools.partial(sample, candidates=candidates, return_top_k=K))


def _hard_rows(rng: np.random.Generator, n: int, v: int) -> list[dict]:
    """Rows whose cuts often fall beyond a few candidates: large top_k, flat top_p/typical, combinations."""
    kinds = [
        {"temperature": 2.0, "top_k": int(rng.integers(v // 4, v))},
        {"temperature": 2.5, "top_p": float(rng.uniform(0.5, 0.99))},
        {"temperature": 2.0, "typical": float(rng.uniform(0.3, 0.99))},
        {"temperature": 1.5, "top_k": int(rng.integers(100, v)), "top_p": float(rng.uniform(0.8, 0.99))},
        {"temperature": 3.0, "top_p": 0.95, "typical": 0.9},
        {"temperature": 1.0, "min_p": 0.001, "typical": 0.95},
        {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "typical": 0.5},
        {"temperature": 1.0},
        {"temperature": 0.0, "top_k": 3},
    ]
    return [{**kinds[i % len(kinds)], "seed": int(rng.integers(0, 2**32))} for i in range(n)]


def _tied_batch(seed: int, rows: list[dict], v: int = V):
    """Logits on a coarse grid (many exact ties, as with bf16 logits) and some banned tokens."""
    logits, rows, history, bias_ids, bias_values = random_batch(seed, rows, v=v)
    logits = np.round(logits * 2.0) / 2.0
    logits[:, :3] = logits[:, 3:4]  # ties at the top too
    return logits, rows, history, bias_ids, bias_values


@pytest.mark.parametrize("candidates", [1, 4, 64, V])
def test_candidates_only_change_speed(candidates: int) -> None:
    """Any number of candidates gives the reference distribution: cuts beyond them are found by the bracketing
    search over the row (exactly, also through ties and into -inf), cuts among them directly."""
    rng = np.random.default_rng(100 + candidates)
    for batch in (random_batch(101, _hard_rows(rng, S, V)), _tied_batch(102, _hard_rows(rng, S, V))):
        args = dict(history=jnp.asarray(batch[2]), bias_ids=jnp.asarray(batch[3]), bias_values=jnp.asarray(batch[4]))
        got = np.asarray(_processed_with(candidates)(jnp.asarray(batch[0]), SamplingRows.make(batch[1]), **args))
        want, ambiguous = ref_batch(*batch, exact_ties=True)
        assert_same_distribution(got, want, ambiguous, batch[1])


@pytest.mark.slow  # fast tier: a lighter test covers the same path
def test_draws_do_not_depend_on_candidates() -> None:
    """The sparse draw (noise only at the candidates) picks the same tokens as the full draw over the vocabulary."""
    rng = np.random.default_rng(110)
    rows = [{**r, "seed": int(rng.integers(0, 2**32))} for r in random_rows(rng, S)]
    for batch in (random_batch(111, rows), random_batch(112, _hard_rows(rng, S, V)), _tied_batch(113, rows)):
        outs = []
        for candidates in (2, 64, V):  # mostly full draws / mostly sparse / always sparse
            out = _sample_with(candidates)(
                jnp.asarray(batch[0]), SamplingRows.make(batch[1]), positions=jnp.arange(S, dtype=jnp.int32) * 7,
                history=jnp.asarray(batch[2]), bias_ids=jnp.asarray(batch[3]), bias_values=jnp.asarray(batch[4]),
            )  # fmt: skip
            outs.append(jax.tree.map(np.asarray, out))
        for out in outs[1:]:
            np.testing.assert_array_equal(out.token, outs[0].token)
            np.testing.assert_allclose(out.logprob, outs[0].logprob, atol=1e-5)
            np.testing.assert_allclose(out.top_logprobs, outs[0].top_logprobs, atol=1e-5)


def test_threefry_draws_match_jax() -> None:
    """`row_key_data` and `gumbel_at` reproduce `row_keys` and `jax.random.gumbel` bit for bit at any ids (the
    draws, sparse or not, rely on it)."""
    seeds = jnp.asarray([0, 1, 2**32 - 1, 12345], jnp.uint32)
    positions = jnp.asarray([0, 7, 3, 2**20], jnp.int32)
    keys = row_keys(seeds, positions)
    key_data = jax.jit(row_key_data)(seeds, positions)
    np.testing.assert_array_equal(np.asarray(key_data), np.asarray(jax.random.key_data(keys)))
    for v in (5, 1000, 49152):
        full = jax.jit(lambda k, v=v: jax.vmap(lambda kk: jax.random.gumbel(kk, (v,), jnp.float32))(k))(keys)
        ids = jnp.asarray(np.random.default_rng(v).integers(0, v, size=(4, 64)), jnp.int32)
        got = jax.jit(gumbel_at)(key_data, ids)
        np.testing.assert_array_equal(np.asarray(got), np.take_along_axis(np.asarray(full), np.asarray(ids), -1))
        every = jax.jit(gumbel_at)(key_data, jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (4, v)))
        np.testing.assert_array_equal(np.asarray(every), np.asarray(full))


def test_small_vocab_unfiltered_rows_draw_from_full_distribution() -> None:
    """Rows without filters in a vocabulary smaller than the candidate count still use all tokens."""
    s, v = 512, 8
    logits = np.tile(np.linspace(-1.0, 1.0, v, dtype=np.float32), (s, 1))
    bias_ids = np.tile(np.asarray([[0, 5]], np.int32), (s, 1))
    bias_values = np.full((s, 2), -np.inf, np.float32)
    rows = [{"temperature": 1.0, "seed": i} for i in range(s)]
    out = _sample(jnp.asarray(logits), SamplingRows.make(rows), positions=jnp.zeros(s, jnp.int32),
                  history=jnp.zeros((s, 0), jnp.int32), bias_ids=jnp.asarray(bias_ids),
                  bias_values=jnp.asarray(bias_values), return_top_k=0)  # fmt: skip
    counts = np.bincount(np.asarray(out.token), minlength=v)
    assert counts[0] == 0 and counts[5] == 0
    assert np.all(counts[[1, 2, 3, 4, 6, 7]] > 0)


def test_top_k_cut_into_banned_tokens() -> None:
    """top_k around and beyond the number of allowed tokens, with cuts found by the bracketing search."""
    ks = [100, 249, 250, 251, 300, 511]
    rows = [{"temperature": 1.0, "top_k": ks[i % len(ks)], "top_p": [1.0, 0.9][i % 2], "seed": i} for i in range(S)]
    logits, rows, history, bias_ids, bias_values = random_batch(120, rows)
    history[:] = -1
    bias_ids[:] = -1
    logits[:, 250:] = -np.inf  # only 250 allowed tokens
    got = np.asarray(_processed_with(4)(jnp.asarray(logits), SamplingRows.make(rows), history=jnp.asarray(history),
                                        bias_ids=jnp.asarray(bias_ids), bias_values=jnp.asarray(bias_values)))
    want, ambiguous = ref_batch(logits, rows, history, bias_ids, bias_values)
    assert_same_distribution(got, want, ambiguous, rows)
    kept = np.isfinite(got).sum(-1)
    for i, row in enumerate(rows):
        if row["top_p"] == 1.0:
            assert kept[i] == min(row["top_k"], 250)


def test_first_argmax_is_jnp_argmax() -> None:
    """`first_argmax` (max, then the first index equal to it) answers what `jnp.argmax` does: ties to the lowest
    index, the first NaN of a row that has one, index 0 for a row of -inf, and any position of the maximum."""
    v = 4099  # not a multiple of any vector width
    x = np.array(jax.random.normal(jax.random.key(3), (9, v)), np.float32)
    x[1, [5, 7, 4000]] = 100.0  # ties: the lowest index wins
    x[2, :] = -np.inf
    x[3, [10, 3000]] = np.nan  # the first NaN, even below the row's maximum
    x[3, 20] = 1e30
    x[4, v - 1] = 50.0  # the last position
    x[5, 0] = 50.0  # the first position
    x[6, :] = 1.0  # all equal
    x[7, [8, 9]] = np.inf
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got[1:8], [5, 0, 10, v - 1, 0, 0, 8])
    assert got.dtype == np.int32


# ----------------------------------------------------------------------------------------------------------------
# The plain-greedy path of `sample_final`
# ----------------------------------------------------------------------------------------------------------------


def _plain_args(s: int, v: int, **over: Any) -> dict[str, Any]:
    args = dict(positions=jnp.zeros(s, jnp.int32), history=jnp.full((s, 4), -1, jnp.int32),
                bias_ids=jnp.full((s, 2), -1, jnp.int32), bias_values=jnp.zeros((s, 2), jnp.float32),
                bias_dense=jnp.zeros((s, v), jnp.float32), bias_dense_on=jnp.asarray(False),
                token_mask=jnp.full((s, -(-v // 32)), -1, jnp.int32), token_mask_on=jnp.asarray(False))
    args.update(over)
    return args


def test_plain_greedy_only_where_nothing_adjusts_the_logits() -> None:
    from paged.device.sampling import plain_greedy

    s, v = 3, 64
    greedy = SamplingRows.make(s)

    def plain(params: SamplingRows, **over: Any) -> bool:
        a = _plain_args(s, v, **over)
        return bool(plain_greedy(params, a["history"], a["bias_ids"], a["bias_dense"], a["bias_dense_on"],
                                 a["token_mask"], a["token_mask_on"]))

    assert plain(greedy)
    assert plain(greedy, history=jnp.zeros((s, 0), jnp.int32), bias_ids=jnp.zeros((s, 0), jnp.int32))
    one = lambda **kw: SamplingRows.make([kw, {}, {}])  # noqa: E731 (row 0 differs)
    assert not plain(one(temperature=0.7))
    assert not plain(one(repetition_penalty=1.1))
    assert not plain(one(presence_penalty=0.5))
    assert not plain(one(dry_multiplier=0.8))
    assert not plain(one(cfg_partner=1))
    assert not plain(greedy, bias_ids=jnp.asarray([[-1, -1], [5, -1], [-1, -1]], jnp.int32))
    assert not plain(greedy, bias_dense_on=jnp.asarray(True))
    assert not plain(greedy, token_mask_on=jnp.asarray(True))


@pytest.mark.parametrize("s", [1, 9])
def test_plain_greedy_matches_the_general_path(s: int) -> None:
    """`greedy_final` (what `sample_final` runs for a plain greedy batch) against the general path on the same
    logits: the same tokens, the distribution and log-probabilities within a rounding; ties go to the first index."""
    from paged.device.sampling import _sample_final, greedy_final

    rng = np.random.default_rng(100 + s)
    v = 1000
    logits = rng.standard_normal((s, v)).astype(np.float32) * 4
    logits[0, [7, 300]] = logits[0].max() + 1.0  # a tie: the first index wins
    a = _plain_args(s, v)
    params = SamplingRows.make(s)
    general = jax.jit(lambda x: _sample_final(x, params, a["positions"], a["history"], a["bias_ids"],
                                              a["bias_values"], 64, a["bias_dense"], a["bias_dense_on"],
                                              a["token_mask"], a["token_mask_on"], None, None))(jnp.asarray(logits))
    fast = jax.jit(greedy_final)(jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(fast[1]), np.asarray(general[1]))
    assert int(fast[1][0]) == 7
    np.testing.assert_allclose(np.asarray(fast[0]), np.asarray(general[0]), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(fast[2]), np.asarray(general[2]), rtol=1e-6, atol=1e-5)


def test_sample_final_takes_the_plain_greedy_path_only_when_it_applies(monkeypatch) -> None:
    """The switch: a plain greedy batch runs `greedy_final` (here replaced by a marker), any batch that adjusts its
    logits or samples does not."""
    import paged.device.sampling as sampling

    s, v = 2, 64
    logits = jnp.asarray(np.random.default_rng(5).standard_normal((s, v)).astype(np.float32))
    marker = lambda x: (jnp.zeros(x.shape, jnp.float32), jnp.full(x.shape[:1], 63, jnp.int32),  # noqa: E731
                        jnp.zeros(x.shape[:1], jnp.float32))
    monkeypatch.setattr(sampling, "greedy_final", marker)

    def tokens(params: SamplingRows, **over: Any) -> list[int]:
        a = _plain_args(s, v, **over)
        return np.asarray(jax.jit(lambda x: sampling.sample_final(x, params, **a))(logits)[1]).tolist()

    assert tokens(SamplingRows.make(s)) == [63, 63]
    want = np.argmax(np.asarray(logits), -1).tolist()
    assert tokens(SamplingRows.make(s), bias_ids=jnp.asarray([[3, -1], [-1, -1]], jnp.int32),
                  bias_values=jnp.asarray([[-1.0, 0.0], [0.0, 0.0]], jnp.float32)) != [63, 63]
    assert tokens(SamplingRows.make([{"repetition_penalty": 1.2}, {}])) == want  # history all padding: no effect
    assert tokens(SamplingRows.make([{"temperature": 0.5, "seed": 1}, {}]))[1] == want[1]


def test_greedy_token_is_the_first_maximal_logit_on_both_paths() -> None:
    """Two logits one float apart at V = 50000: normalising rounds them to the same log-probability, and the token
    must still be the larger logit's on the plain path, on the general path, and for a greedy row batched with a
    sampled one (its token must not depend on the other rows); a NaN row gives its first NaN on both paths."""
    import paged.device.sampling as sampling

    v = 50000
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((2, v)) * 0.01).astype(np.float32)
    logits[0, 100] = np.float32(1.0)
    logits[0, 200] = np.nextafter(np.float32(1.0), np.float32(2.0))  # the larger, at the higher index
    logits[1, [30, 40]] = np.nan
    lse = np.log(np.exp(logits[0].astype(np.float64)).sum())
    assert np.float32(logits[0, 100] - np.float32(lse)) == np.float32(logits[0, 200] - np.float32(lse))  # the trap
    x = jnp.asarray(logits)
    fast = jax.jit(sampling.greedy_final)(x)
    assert np.asarray(fast[1]).tolist() == [200, 30]
    a = _plain_args(2, v)
    for rows in ([{}, {}], [{}, {"temperature": 0.7, "seed": 3}]):
        params = SamplingRows.make(rows)
        general = jax.jit(lambda x, p=params: sampling._sample_final(
            x, p, a["positions"], a["history"], a["bias_ids"], a["bias_values"], 64, a["bias_dense"],
            a["bias_dense_on"], a["token_mask"], a["token_mask_on"], None, None))(x)
        assert int(general[1][0]) == 200, rows
        if len(rows[1]) == 0:
            assert int(general[1][1]) == 30
