"""On-device, per-row token sampling for the paged engine.

Everything here is pure and jittable and vectorised over the batch rows `S`; each row carries its own settings
(`SamplingParams`, every field shape [S]). `sample` draws exactly from `processed_logprobs`, the final per-row
log-distribution, which speculative decoding can reuse for verification.

Order of operations (per row), and where it follows ExLlamaV2 (`ExLlamaV2Sampler.sample` + C++ `sample_basic`):

1. Repetition, frequency and presence penalties, counted over `history` (the most recent R tokens of prompt +
   output). Repetition is HF-style and multiplicative (positive logit / p, negative logit * p), frequency subtracts
   `freq * count`, presence subtracts `pres` once per distinct token. ExLlamaV2 does the same in one pass over the
   whole sequence; its range/decay window is replaced by "whatever the caller puts in `history`".
2. Sparse additive bias (`bias_ids`/`bias_values`). ExLlamaV2 sets blocked tokens to -1e30 and then adds
   `token_bias`; both collapse into this one step here (a value of -inf bans a token).
3. Greedy rows (temperature < 0.01, the same threshold as ExLlamaV2) stop here: the token is the argmax, and the
   reported distribution is log_softmax of these logits at temperature 1 with no truncation.
4. Temperature, applied before the softmax (ExLlamaV2's default, `temperature_last=False`).
5. top_k -> top_p -> min_p -> typical, each on the distribution renormalised after the previous step, as in
   `sample_basic` (top_a, tfs, mirostat, XTC, skew, DRY, dynamic temperature are not implemented).
   Differences from ExLlamaV2, on purpose:
   - Thresholds keep ties: top_k keeps every token whose probability equals the k-th largest, top_p keeps every
     token tied with the last one needed to reach the mass, typical keeps ties of the last score. This makes the
     result independent of token ids and of sort stability (bf16 logits tie often).
   - typical uses the correct score |-log q - H| (ExLlamaV2's C++ computes `x + log(x)`).
6. Renormalise and draw with Gumbel-max (argmax of log q + Gumbel noise), which can never pick a token outside the
   kept set. The key of row i is `fold_in(key(seed[i]), positions[i])`, so a row's draw depends only on its own
   (seed, position, logits, settings), not on the rest of the batch.

A row whose every token is banned has no distribution; the caller must keep at least one token allowed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# Rows with temperature below this are greedy (ExLlamaV2 ext:147-151 uses the same cut).
GREEDY_TEMPERATURE = 0.01

# Neutral ("off") value of every field, and the dtype it is stored with. temperature 0 means greedy, so
# `SamplingParams.make(n)` gives n greedy rows.
NEUTRAL: dict[str, Any] = {
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "typical": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "seed": 0,
}
_DTYPES: dict[str, Any] = {
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "min_p": np.float32,
    "typical": np.float32,
    "repetition_penalty": np.float32,
    "frequency_penalty": np.float32,
    "presence_penalty": np.float32,
    "seed": np.uint32,
}


@flax.struct.dataclass
class SamplingParams:
    """Per-row sampling settings; every field has shape [S]."""

    temperature: jax.Array  # f32 [S]; < 0.01 (including <= 0) -> greedy
    top_k: jax.Array  # i32 [S]; 0 = off
    top_p: jax.Array  # f32 [S]; off unless 0 < top_p < 1
    min_p: jax.Array  # f32 [S]; 0 = off; keep p >= min_p * p_max
    typical: jax.Array  # f32 [S]; off unless 0 < typical < 1
    repetition_penalty: jax.Array  # f32 [S]; 1 = off
    frequency_penalty: jax.Array  # f32 [S]; 0 = off
    presence_penalty: jax.Array  # f32 [S]; 0 = off
    seed: jax.Array  # u32 [S]

    @staticmethod
    def make(rows: Sequence[Mapping[str, Any]] | int, **defaults: Any) -> SamplingParams:
        """Build numpy-backed params from per-row dicts (host helper).

        A missing key takes its value from `defaults`, else from `NEUTRAL`; `make(n)` gives n greedy rows.
        Unknown keys raise `ValueError` so typos do not silently sample with neutral settings.
        """
        if isinstance(rows, int):
            rows = [{}] * rows
        for d in [defaults, *rows]:
            unknown = set(d) - set(NEUTRAL)
            if unknown:
                raise ValueError(f"unknown sampling settings {sorted(unknown)}; known: {sorted(NEUTRAL)}")
        base = {**NEUTRAL, **defaults}
        fields = {}
        for name, dtype in _DTYPES.items():
            values = [row.get(name, base[name]) for row in rows]
            if name == "seed":
                values = [int(v) & 0xFFFFFFFF for v in values]  # any Python int is a valid seed
            fields[name] = np.asarray(values, dtype=dtype).reshape(len(rows))
        return SamplingParams(**fields)

    @property
    def greedy(self) -> jax.Array:
        """bool [S]: rows that take the argmax instead of drawing."""
        return ~(self.temperature >= GREEDY_TEMPERATURE)  # written so that NaN also means greedy


@flax.struct.dataclass
class SampleOutput:
    token: jax.Array  # i32 [S]
    logprob: jax.Array  # f32 [S]; log prob of `token` under the final distribution
    top_ids: jax.Array  # i32 [S, K]; K most probable tokens of the final distribution, descending
    top_logprobs: jax.Array  # f32 [S, K]


def _row_scatter_add(ids: jax.Array, values: jax.Array, vocab_size: int) -> jax.Array:
    """Dense [S, V] sum of `values` scattered at `ids` [S, N]; ids < 0 or >= V are dropped."""
    s, n = ids.shape
    ids = jnp.where(ids >= 0, ids, vocab_size)  # negative padding -> out of range -> dropped by mode="drop"
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], (s, n))
    return jnp.zeros((s, vocab_size), jnp.float32).at[rows, ids].add(values, mode="drop")


def token_counts(history: jax.Array, vocab_size: int) -> jax.Array:
    """f32 [S, V]: occurrences of each token in `history` [S, R] (entries -1 are padding)."""
    return _row_scatter_add(history, jnp.ones(history.shape, jnp.float32), vocab_size)


def apply_penalties(logits: jax.Array, params: SamplingParams, history: jax.Array) -> jax.Array:
    """Repetition (multiplicative, HF-style), frequency (per occurrence) and presence penalties. [S, V] -> [S, V]."""
    counts = token_counts(history, logits.shape[-1])  # [S, V]
    present = counts > 0  # [S, V]
    rep = params.repetition_penalty[:, None]  # [S, 1]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(present, penalised, logits)
    logits = logits - params.frequency_penalty[:, None] * counts
    return logits - jnp.where(present, params.presence_penalty[:, None], 0.0)


def apply_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """Add the sparse bias (ids [S, B], -1 = padding; duplicates add up). [S, V] -> [S, V]."""
    return logits + _row_scatter_add(bias_ids, bias_values.astype(jnp.float32), logits.shape[-1])


def _threshold_at_count(sorted_vals: jax.Array, n: jax.Array) -> jax.Array:
    """[S, 1]: the value of the n-th entry (1-based) of each sorted row; n is clamped to >= 1."""
    return jnp.take_along_axis(sorted_vals, jnp.maximum(n - 1, 0)[:, None], axis=-1)


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    c = jnp.cumsum(x, axis=-1)
    return jnp.concatenate([jnp.zeros_like(c[:, :1]), c[:, :-1]], axis=-1)


def _prefix_truncation(logp: jax.Array, params: SamplingParams) -> jax.Array:
    """bool [S, V]: top_k -> top_p -> min_p keep mask. Each step keeps a prefix of the descending-sorted row, so
    one sort serves all three; the final cut is turned back into a probability threshold (so ties are kept)."""
    v = logp.shape[-1]
    s = -jnp.sort(-logp, axis=-1)  # [S, V] descending log-probs
    rank = jnp.arange(v)[None, :]  # [1, V]

    def close_ties(keep: jax.Array) -> jax.Array:
        return s >= _threshold_at_count(s, keep.sum(-1))

    k = params.top_k[:, None]
    keep = close_ties((k <= 0) | (rank < k))

    # top_p on the distribution renormalised over the top_k set: keep a token while the mass before it < top_p.
    p = jnp.where(keep, jnp.exp(s), 0.0)
    before = _exclusive_cumsum(p)  # [S, V]
    top_p = params.top_p[:, None]
    top_p_on = (top_p > 0) & (top_p < 1)
    keep = close_ties(keep & (~top_p_on | (before < top_p * p.sum(-1, keepdims=True))))

    # min_p is a ratio to the max, so renormalisation does not change it; log(0) = -inf keeps everything.
    keep = keep & (s >= s[:, :1] + jnp.log(jnp.maximum(params.min_p[:, None], 0.0)))
    keep = keep | (rank == 0)  # the most probable token always survives (guards min_p > 1)
    return logp >= _threshold_at_count(s, keep.sum(-1))


def _typical_truncation(logp: jax.Array, keep: jax.Array, mass: jax.Array) -> jax.Array:
    """bool [S, V]: locally typical sampling on the distribution renormalised over `keep`; rows with mass outside
    (0, 1) are returned unchanged. Keeps the tokens of smallest |-log q - H| until their mass reaches `mass`."""
    lq = jax.nn.log_softmax(jnp.where(keep, logp, -jnp.inf), axis=-1)  # [S, V]
    q = jnp.exp(lq)
    entropy = -jnp.sum(jnp.where(q > 0, q * lq, 0.0), axis=-1, keepdims=True)  # [S, 1]; 0 log 0 := 0 (banned ids)
    score = jnp.where(q > 0, jnp.abs(lq + entropy), jnp.inf)  # [S, V]
    s_score, s_q = jax.lax.sort((score, q), dimension=1, num_keys=1)  # ascending score
    m = mass[:, None]
    n = jnp.sum(_exclusive_cumsum(s_q) < m, axis=-1)
    on = (m > 0) & (m < 1)
    return keep & (~on | (score <= _threshold_at_count(s_score, n)))


def truncation_mask(logp: jax.Array, params: SamplingParams) -> jax.Array:
    """bool [S, V]: tokens kept by top_k -> top_p -> min_p -> typical.

    `logp` [S, V] is the temperature-scaled log-softmax. Greedy rows and rows with every filter off keep all tokens.
    Each sort is skipped (lax.cond) when no row in the batch needs it.
    """
    sampled = ~params.greedy  # [S]
    top_p_on = (params.top_p > 0) & (params.top_p < 1)
    prefix_on = sampled & ((params.top_k > 0) | top_p_on | (params.min_p > 0))  # [S]
    keep = jax.lax.cond(
        jnp.any(prefix_on),
        lambda: _prefix_truncation(logp, params) | ~prefix_on[:, None],
        lambda: jnp.ones(logp.shape, jnp.bool_),
    )
    typical_on = sampled & (params.typical > 0) & (params.typical < 1)
    mass = jnp.where(typical_on, params.typical, 1.0)  # 1.0 = off
    return jax.lax.cond(jnp.any(typical_on), lambda: _typical_truncation(logp, keep, mass), lambda: keep)


def processed_logprobs(
    logits: jax.Array,
    params: SamplingParams,
    *,
    history: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
) -> jax.Array:
    """f32 [S, V]: the final per-row log-distribution `sample` draws from (-inf outside the kept set).

    Greedy rows: log_softmax of the penalised, biased logits at temperature 1, untruncated (their token is its argmax).
    """
    x = apply_bias(apply_penalties(logits.astype(jnp.float32), params, history), bias_ids, bias_values)  # [S, V]
    greedy = params.greedy[:, None]  # [S, 1]
    temperature = jnp.where(greedy, 1.0, params.temperature[:, None])
    logp = jax.nn.log_softmax(x / temperature, axis=-1)  # [S, V]
    keep = truncation_mask(logp, params)
    return jax.nn.log_softmax(jnp.where(keep, logp, -jnp.inf), axis=-1)  # renormalise over the kept set


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """[S] typed PRNG keys: fold_in(key(seed), position) per row."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def sample(
    logits: jax.Array,
    params: SamplingParams,
    *,
    positions: jax.Array,
    history: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
    return_top_k: int = 0,
) -> SampleOutput:
    """Draw one token per row from `processed_logprobs` (greedy rows: its argmax).

    logits f32 [S, V]; positions i32 [S] (position of the token being drawn); history i32 [S, R] (-1 padding, R may
    be 0); bias_ids i32 [S, B] (-1 padding, B may be 0); bias_values f32 [S, B]. `return_top_k` must be static.
    """
    final = processed_logprobs(logits, params, history=history, bias_ids=bias_ids, bias_values=bias_values)
    v = final.shape[-1]
    greedy = params.greedy  # [S]
    best = jnp.argmax(final, axis=-1).astype(jnp.int32)  # [S]

    def draw() -> jax.Array:
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(row_keys(params.seed, positions))
        drawn = jnp.argmax(final + noise, axis=-1).astype(jnp.int32)  # Gumbel-max: exact draw from softmax(final)
        return jnp.where(greedy, best, drawn)

    token = jax.lax.cond(jnp.all(greedy), lambda: best, draw)  # all-greedy batches skip the noise
    logprob = jnp.take_along_axis(final, token[:, None], axis=-1)[:, 0]
    if return_top_k > 0:
        top_logprobs, top_ids = jax.lax.top_k(final, return_top_k)
    else:
        top_logprobs = jnp.zeros((final.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((final.shape[0], 0), jnp.int32)
    return SampleOutput(token=token, logprob=logprob, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)
