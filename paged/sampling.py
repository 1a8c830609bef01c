"""On-device, per-row token sampling for the paged engine.

Everything here is pure and jittable and vectorised over the batch rows `S`; each row carries its own settings
(`SamplingRows`, every field shape [S]). `sample` draws exactly from `processed_logprobs`, the final per-row
log-distribution, which speculative decoding can reuse for verification.

Order of operations (per row), and where it follows ExLlamaV2 (`ExLlamaV2Sampler.sample` + C++ `sample_basic`):

1. Repetition, frequency and presence penalties, counted over `history` (the most recent R tokens of prompt +
   output). Repetition is HF-style and multiplicative (positive logit / p, negative logit * p), frequency subtracts
   `freq * count`, presence subtracts `pres` once per distinct token. ExLlamaV2 does the same in one pass over the
   whole sequence; its range/decay window is replaced by "whatever the caller puts in `history`".
2. Additive bias: sparse (`bias_ids`/`bias_values`), plus optionally a dense `[S, V]` bias for rows with many
   entries (`adjusted_logits`; both it and the penalties run under a `lax.cond`, skipped when no row uses them).
   ExLlamaV2 sets blocked tokens to -1e30 and then adds `token_bias`; both collapse into this one step here (a value
   of -inf bans a token).
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

Nothing sorts the vocabulary (a full sort of [64, 49152] f32 takes ~1 s on XLA:CPU). Each filter keeps the entries
at or above a cut in some key (log-prob for top_k/top_p/min_p, minus the score for typical): walking a row in
descending key order, take entries until the count (top_k) or weight (top_p, typical) before the next one reaches
the target; the cut is the key of the last entry taken, so ties with it are kept. `_mass_cut` reads the cut off
the `CANDIDATES` largest keys (`lax.top_k`, ~100x cheaper than the sort) when the walk ends among them, which is
the common case (top_k 50 always), and otherwise bisects the key's float bits over the whole row (`_bracket_cut`,
one masked sum per halving, under a `lax.cond` so only batches that need it pay). The bisection ends on a single
float, so the cut is the same key value a sort would give; only float summation order differs. The final
normaliser and the Gumbel noise are computed on the candidates alone where a row's kept set lies within them
(`gumbel_at` gives the same noise values as the full draw, so the same token).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# Truncation looks for its cuts among this many most likely tokens per row (`lax.top_k`; a full sort of the
# vocabulary costs ~100x more on CPU). Cuts beyond them are still exact (a bracketing search over the row, slower).
CANDIDATES = 64

# Rows with temperature below this are greedy (ExLlamaV2 ext:147-151 uses the same cut).
GREEDY_TEMPERATURE = 0.01

# Neutral ("off") value of every field, and the dtype it is stored with. temperature 0 means greedy, so
# `SamplingRows.make(n)` gives n greedy rows.
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
class SamplingRows:
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
    def make(rows: Sequence[Mapping[str, Any]] | int, **defaults: Any) -> SamplingRows:
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
        return SamplingRows(**fields)

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


def apply_penalties(logits: jax.Array, params: SamplingRows, history: jax.Array) -> jax.Array:
    """Repetition (multiplicative, HF-style), frequency (per occurrence) and presence penalties. [S, V] -> [S, V]."""
    counts = token_counts(history, logits.shape[-1])  # [S, V]
    present = counts > 0  # [S, V]
    rep = params.repetition_penalty[:, None]  # [S, 1]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(present, penalised, logits)
    logits = logits - params.frequency_penalty[:, None] * counts
    return logits - jnp.where(present, params.presence_penalty[:, None], 0.0)


def apply_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array,
               bias_dense: jax.Array | None = None) -> jax.Array:
    """Add the sparse bias (ids [S, B], -1 = padding; duplicates add up) and, if given, the dense bias [S, V] (for
    rows with more entries than B; zero elsewhere). [S, V] -> [S, V]."""
    bias = _row_scatter_add(bias_ids, bias_values.astype(jnp.float32), logits.shape[-1])
    return logits + (bias if bias_dense is None else bias + bias_dense)


def apply_token_mask(logits: jax.Array, token_mask: jax.Array) -> jax.Array:
    """-inf where a row's packed bitmask `token_mask` i32 [S, ceil(V/32)] has a 0 bit (token t is bit t % 32 of word
    t // 32, as llguidance packs it). [S, V] -> [S, V]."""
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    bits = (token_mask[:, ids >> 5] >> (ids & 31)) & 1  # [S, V]
    return jnp.where(bits != 0, logits, -jnp.inf)


def penalties_used(params: SamplingRows) -> jax.Array:
    """bool []: whether any row has a repetition, frequency or presence penalty (else `apply_penalties` is the
    identity and is skipped)."""
    return jnp.any((params.repetition_penalty != 1.0) | (params.frequency_penalty != 0.0)
                   | (params.presence_penalty != 0.0))


def adjusted_logits(logits: jax.Array, params: SamplingRows, history: jax.Array, bias_ids: jax.Array,
                    bias_values: jax.Array, bias_dense: jax.Array | None = None,
                    bias_dense_on: jax.Array | None = None, token_mask: jax.Array | None = None,
                    token_mask_on: jax.Array | None = None) -> jax.Array:
    """f32 [S, V]: penalties, then the bias, then the token mask (constrained decoding: packed allowed-token bits
    [S, ceil(V/32)], applied where `token_mask_on`). Each part runs under a `lax.cond` and is skipped (it would be
    the identity) when no row uses it: penalties when every row's are neutral, the sparse bias when every id is
    padding, the dense bias [S, V] unless `bias_dense_on` (bool []), the mask unless `token_mask_on`. Adding a row's
    bias entries once each, sparse plus dense (one of them zero), gives the same floats as one scatter of all of
    them."""
    x = _biased_logits(logits, params, history, bias_ids, bias_values, bias_dense, bias_dense_on)
    if token_mask is None:
        return x
    on = jnp.asarray(True) if token_mask_on is None else token_mask_on
    return jax.lax.cond(on, lambda: apply_token_mask(x, token_mask), lambda: x)


def _biased_logits(logits, params, history, bias_ids, bias_values, bias_dense, bias_dense_on) -> jax.Array:
    x = logits.astype(jnp.float32)
    if history.shape[-1]:
        x = jax.lax.cond(penalties_used(params), lambda: apply_penalties(x, params, history), lambda: x)
    has_sparse = bias_ids.shape[-1] > 0
    if bias_dense is None:
        if has_sparse:
            x = jax.lax.cond(jnp.any(bias_ids >= 0), lambda: apply_bias(x, bias_ids, bias_values), lambda: x)
        return x
    on = jnp.asarray(True) if bias_dense_on is None else bias_dense_on
    sparse_on = jnp.any(bias_ids >= 0) if has_sparse else jnp.asarray(False)
    return jax.lax.cond(
        on,
        lambda: apply_bias(x, bias_ids, bias_values, bias_dense),
        lambda: jax.lax.cond(sparse_on, lambda: apply_bias(x, bias_ids, bias_values), lambda: x),
    )


def _ordered(x: jax.Array) -> jax.Array:
    """f32 -> i32 with the same order and the same ties (-0.0 and +0.0 both map to 0), so that bisection on the
    i32 reaches every float exactly. NaN is not expected. `_unordered` is the inverse (0 -> +0.0)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b < 0, (b ^ jnp.int32(0x7FFFFFFF)) + 1, b)


def _unordered(o: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(o < 0, (o - 1) ^ jnp.int32(0x7FFFFFFF), o), jnp.float32)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` of an f32 [S, V] along V, kept as XLA:CPU's fast TopK: without the barrier, slicing the result
    (e.g. `vals[:, -1]`) lets XLA fold the slices into the sort+slice that TopK is matched from, and it falls back
    to a full sort of every row (~100x slower). Integer top_k is always a full sort on CPU, so keys here are f32."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    """[S, C] -> [S, C]: sums of the entries before each one. A product with a triangular matrix: for the small C
    here as fast as `jnp.cumsum`, and much quicker to compile on XLA:CPU."""
    c = x.shape[-1]
    return jnp.dot(x, np.triu(np.ones((c, c), np.float32), 1), precision=jax.lax.Precision.HIGHEST)


def _bracket_cut(key: jax.Array, weight: jax.Array | None, target: jax.Array, need: jax.Array,
                 hint: jax.Array) -> jax.Array:
    """`_mass_cut` over the whole row, for the `need` rows whose walk goes past the last candidate (`hint`).

    Bisection on the order-preserving i32 image of `key` narrows a bracket (lo, hi] holding the cut, the smallest
    key value with weight(key > value) < target, down to a single i32 (at most 32 halvings, each one masked sum over
    the row). It starts from (just below the smallest finite key, hint]: the weight above the hint is that of
    candidates before it, < target. The sums only shrink as the cut value grows, so the bracket ends exactly at the
    cut (a key value); only if lo never moved can the walk go past every finite key, into the -inf ones.
    """
    def above(o: jax.Array) -> jax.Array:  # [S]: weight of the entries with key > unordered(o)
        # A float comparison: the same as ordered(key) > o, since `_ordered` is monotone and keeps ties.
        gt = key > _unordered(o)[:, None]
        return jnp.sum(gt, axis=-1).astype(jnp.float32) if weight is None else jnp.sum(jnp.where(gt, weight, 0.0), -1)

    def halve(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = state
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow; lo < mid < hi
        up = open_(lo, hi) & (above(mid) < target)  # mid is at or past the cut: new hi
        return jnp.where(open_(lo, hi) & ~up, mid, lo), jnp.where(up, mid, hi)

    def open_(lo: jax.Array, hi: jax.Array) -> jax.Array:
        width = jax.lax.bitcast_convert_type(hi, jnp.uint32) - jax.lax.bitcast_convert_type(lo, jnp.uint32)
        return need & (width > 1)

    lo = _ordered(jnp.min(jnp.where(key > -jnp.inf, key, jnp.inf), axis=-1)) - 1
    lo, hi = jax.lax.while_loop(lambda st: jnp.any(open_(*st)), halve, (lo, _ordered(hint)))
    return jnp.where(above(lo) < target, -jnp.inf, _unordered(hi))


def _mass_cut(key: jax.Array, weight: Callable[[], jax.Array] | None, target: jax.Array, on: jax.Array,
              cand_key: jax.Array, cand_weight: jax.Array | None) -> jax.Array:
    """f32 [S]: per row, where a walk down the row in descending `key` order stops when it takes entries until the
    weight before the next one reaches `target`: the smallest key value with weight(key > value) < target. Keeping
    `key >= cut` keeps the whole tie group of the last entry taken. Rows not `on` get -inf (keep everything).

    key [S, V]; weight() [S, V] >= 0 (0 where key is -inf), or None for 1 per entry (then target is a count); target
    [S] > 0; cand_key [S, C]: the C largest keys of each row, descending (`_top_k`), cand_weight [S, C] their weights
    (None with weight None).
    When the candidates' weight reaches the target the cut is among them (exact, and the common case); otherwise
    `_bracket_cut` searches the row, under a `lax.cond` so that it costs nothing when no row needs it.
    """
    c, v = cand_key.shape[-1], key.shape[-1]
    if cand_weight is None:  # counts
        before, total = jnp.arange(c, dtype=jnp.float32)[None, :], jnp.float32(c)
    else:
        before, total = _exclusive_cumsum(cand_weight), jnp.sum(cand_weight, axis=-1)
    n = jnp.sum(before < target[:, None], axis=-1)  # entries taken (before is non-decreasing)
    cut = jnp.take_along_axis(cand_key, jnp.maximum(n - 1, 0)[:, None], axis=-1)[:, 0]
    if c < v:
        # The walk goes past the last candidate (unless that is -inf: then it has reached the -inf tie group).
        need = on & (total < target) & (cand_key[:, -1] > -jnp.inf)
        cut = jax.lax.cond(
            jnp.any(need),
            lambda: jnp.where(need, _bracket_cut(key, None if weight is None else weight(), target, need,
                                                 cand_key[:, -1]), cut),
            lambda: cut,
        )
    return jnp.where(on, cut, -jnp.inf)


def _per_row(stats: Callable[..., tuple[jax.Array, ...]], arrays: Sequence[jax.Array], ids: jax.Array,
             inside: jax.Array) -> tuple[jax.Array, ...]:
    """Per-row statistics `stats(*arrays)` ([S, 1] reductions over the kept set) computed on the candidates `ids` for
    rows whose kept set lies within them (`inside`), and on the whole row for the others (only if there are any).
    Either way a row's result depends on that row alone, never on the rest of the batch."""
    on_ids = stats(*(jnp.take_along_axis(x, ids, axis=-1) for x in arrays))

    def whole_rows() -> tuple[jax.Array, ...]:
        return tuple(jnp.where(inside[:, None], a, b) for a, b in zip(on_ids, stats(*arrays), strict=True))

    return jax.lax.cond(jnp.all(inside), lambda: on_ids, whole_rows)


def _normaliser(lp: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(max, log(sum(exp(lp - max)))) over the kept entries of each row, [S, 1] each: the log-softmax over the kept
    set is then (lp - max) - log_sum (the same arithmetic as `jax.nn.log_softmax`)."""
    m = jnp.max(jnp.where(keep, lp, -jnp.inf), axis=-1, keepdims=True)
    return m, jnp.log(jnp.sum(jnp.where(keep, jnp.exp(lp - m), 0.0), axis=-1, keepdims=True))


def _log_softmax_kept(lp: jax.Array, keep: jax.Array, m: jax.Array, log_sum: jax.Array) -> jax.Array:
    return jnp.where(keep, (lp - m) - log_sum, -jnp.inf)


def _truncation(logp: jax.Array, params: SamplingRows, candidates: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(keep bool [S, V], ids i32 [S, C], inside bool [S]): the tokens kept by top_k -> top_p -> min_p -> typical,
    and per row C token ids that contain the whole kept set where `inside` (never for rows that keep everything,
    unless C = V).

    `logp` [S, V] is the temperature-scaled log-softmax. Greedy rows and rows with every filter off keep all tokens.
    No sort of the vocabulary: each filter's cut is found among the `candidates` (static) most likely tokens
    (`lax.top_k`), or, for rows where it lies beyond them, by an exact bracketing search over the row. Each part is
    skipped (lax.cond) when no row in the batch needs it."""
    s, v = logp.shape
    c = min(candidates, v)
    sampled = ~params.greedy  # [S]
    top_k_on = sampled & (params.top_k > 0) & (params.top_k < v)
    top_p_on = sampled & (params.top_p > 0) & (params.top_p < 1)
    prefix_on = top_k_on | top_p_on | (sampled & (params.min_p > 0))
    typical_on = sampled & (params.typical > 0) & (params.typical < 1)

    def prefix() -> tuple[jax.Array, jax.Array, jax.Array]:
        # top_k -> top_p -> min_p each keep the tokens above a log-prob cut, so together they keep logp >= one cut.
        vals, ids = _top_k(logp, c)  # [S, C] descending
        cut_k = _mass_cut(logp, None, params.top_k.astype(jnp.float32), top_k_on, vals, None)
        # top_p on the distribution renormalised over the top_k set: take tokens while the mass before < top_p.
        cand_p = jnp.where(vals >= cut_k[:, None], jnp.exp(vals), 0.0)
        inside_k = (vals[:, -1] < cut_k) | (c == v)  # the top_k set lies within the candidates

        def p() -> jax.Array:
            return jnp.where(logp >= cut_k[:, None], jnp.exp(logp), 0.0)

        mass_c = jnp.sum(cand_p, axis=-1)  # the whole top_k set's mass where it lies within the candidates
        mass = jax.lax.cond(
            jnp.all(inside_k | ~top_p_on),
            lambda: mass_c,
            lambda: jnp.where(inside_k, mass_c, jnp.sum(p(), axis=-1)),
        )
        cut_p = _mass_cut(logp, p, params.top_p * mass, top_p_on, vals, cand_p)
        # min_p is a ratio to the max, so renormalisation does not change it; log(0) = -inf keeps everything.
        cut_m = vals[:, 0] + jnp.log(jnp.maximum(params.min_p, 0.0))
        # The most probable token always survives (guards min_p > 1).
        cut = jnp.minimum(jnp.maximum(jnp.maximum(cut_k, cut_p), cut_m), vals[:, 0])
        cut = jnp.where(prefix_on, cut, -jnp.inf)
        return cut, ids, (vals[:, -1] < cut) | (c == v)

    cut, ids, inside = jax.lax.cond(
        jnp.any(prefix_on),
        prefix,
        lambda: (jnp.full((s,), -jnp.inf), jnp.zeros((s, c), jnp.int32), jnp.zeros((s,), jnp.bool_)),
    )
    keep = logp >= cut[:, None]

    def typical() -> tuple[jax.Array, jax.Array, jax.Array]:
        # Locally typical sampling on the distribution renormalised over `keep`: take tokens in increasing
        # |-log q - H| until their mass reaches `typical`. Rarely used, so done on whole rows (no candidate path).
        lq = jax.nn.log_softmax(jnp.where(keep, logp, -jnp.inf), axis=-1)  # [S, V]
        q = jnp.exp(lq)
        neg_entropy = jnp.sum(jnp.where(q > 0, q * lq, 0.0), axis=-1, keepdims=True)  # [S, 1]; 0 log 0 := 0
        key = jnp.where(q > 0, -jnp.abs(lq - neg_entropy), -jnp.inf)  # minus the score: the walk takes larger first
        cand_key, cand_ids = _top_k(key, c)
        cut = _mass_cut(key, lambda: q, params.typical, typical_on, cand_key, jnp.take_along_axis(q, cand_ids, -1))
        inside_t = typical_on & ((cand_key[:, -1] < cut) | (c == v))  # every kept token is a typical candidate
        return keep & (key >= cut[:, None]), jnp.where(inside_t[:, None], cand_ids, ids), inside | inside_t

    return jax.lax.cond(jnp.any(typical_on), typical, lambda: (keep, ids, inside))


def _final(logits, params, history, bias_ids, bias_values, candidates, bias_dense=None, bias_dense_on=None,
           token_mask=None, token_mask_on=None):
    """(final [S, V], ids [S, C], inside [S]): `processed_logprobs`, and the candidates of `_truncation`."""
    x = adjusted_logits(logits, params, history, bias_ids, bias_values, bias_dense, bias_dense_on, token_mask,
                        token_mask_on)  # [S, V]
    greedy = params.greedy[:, None]  # [S, 1]
    temperature = jnp.where(greedy, 1.0, params.temperature[:, None])
    logp = jax.nn.log_softmax(x / temperature, axis=-1)  # [S, V]
    keep, ids, inside = _truncation(logp, params, candidates)
    m, log_sum = _per_row(_normaliser, (logp, keep), ids, inside)
    return _log_softmax_kept(logp, keep, m, log_sum), ids, inside  # renormalise over the kept set


def processed_logprobs(
    logits: jax.Array,
    params: SamplingRows,
    *,
    history: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
    candidates: int = CANDIDATES,
) -> jax.Array:
    """f32 [S, V]: the final per-row log-distribution `sample` draws from (-inf outside the kept set).

    Greedy rows: log_softmax of the penalised, biased logits at temperature 1, untruncated (their token is its argmax).
    `candidates` (static) only trades speed: see `_truncation`.
    """
    return _final(logits, params, history, bias_ids, bias_values, candidates)[0]


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """[S] typed PRNG keys: fold_in(key(seed), position) per row."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def _threefry_draws_supported() -> bool:
    """Whether `row_key_data` and `gumbel_at` reproduce `row_keys` and `jax.random.gumbel` under the current JAX
    configuration (decided when tracing; otherwise `sample` uses JAX's own functions)."""
    try:
        return (
            jax.config.jax_default_prng_impl == "threefry2x32"
            and bool(jax.config.jax_threefry_partitionable)
            and not bool(jax.config.jax_high_dynamic_range_gumbel)
        )
    except AttributeError:
        return False


def _threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block cipher, 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
    SC 2011), as JAX's threefry PRNG uses it. Plain elementwise u32 arithmetic: XLA:CPU fuses it into one loop,
    several times faster to run and to compile than the primitive's lowering."""
    def rotl(v: jax.Array, r: int) -> jax.Array:
        return (v << np.uint32(r)) | (v >> np.uint32(32 - r))

    ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in ((13, 15, 26, 6), (17, 29, 16, 24))[i % 2]:
            x0 = x0 + x1
            x1 = rotl(x1, r) ^ x0
        x0, x1 = x0 + ks[(i + 1) % 3], x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def row_key_data(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """u32 [S, 2]: `jax.random.key_data(row_keys(seeds, positions))`, computed directly: key(seed) is (0, seed) and
    fold_in hashes the counter (0, position) under it."""
    zero = jnp.zeros(seeds.shape, jnp.uint32)
    k0, k1 = _threefry2x32(zero, seeds.astype(jnp.uint32), zero, positions.astype(jnp.uint32))
    return jnp.stack([k0, k1], axis=-1)


def gumbel_at(key_data: jax.Array, ids: jax.Array) -> jax.Array:
    """f32 [S, N]: entries `ids` [S, N] of `jax.random.gumbel(key_i, (V,))` for each row's key (data [S, 2] u32),
    without drawing all V.

    With partitionable threefry, element j of a 1-D draw hashes the counter (0, j) under the key and xors the two
    output words; then the same uniform in [tiny, 1) and -log(-log(u)) as `jax.random.gumbel` (mode "low"). Valid
    where `_threefry_draws_supported`; the tests check it bit for bit against `jax.random.gumbel`.
    """
    b0, b1 = _threefry2x32(key_data[:, :1], key_data[:, 1:], jnp.zeros(ids.shape, jnp.uint32), ids.astype(jnp.uint32))
    mantissa = ((b0 ^ b1) >> np.uint32(32 - 23)) | np.uint32(0x3F800000)  # a float in [1, 2)
    floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - np.float32(1.0)
    tiny = np.float32(np.finfo(np.float32).tiny)
    u = jnp.maximum(tiny, floats * (np.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def sample(
    logits: jax.Array,
    params: SamplingRows,
    *,
    positions: jax.Array,
    history: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
    return_top_k: int = 0,
    candidates: int = CANDIDATES,
    bias_dense: jax.Array | None = None,
    bias_dense_on: jax.Array | None = None,
    token_mask: jax.Array | None = None,
    token_mask_on: jax.Array | None = None,
) -> SampleOutput:
    """Draw one token per row from `processed_logprobs` (greedy rows: its argmax).

    logits f32 [S, V]; positions i32 [S] (position of the token being drawn); history i32 [S, R] (-1 padding, R may
    be 0); bias_ids i32 [S, B] (-1 padding, B may be 0); bias_values f32 [S, B]; optionally bias_dense f32 [S, V],
    added where bias_dense_on (bool []), and token_mask i32 [S, ceil(V/32)] (allowed-token bits; the other tokens
    get -inf) where token_mask_on (bool []). `return_top_k` and `candidates` (see `_truncation`) must be static.

    The draw is argmax(final + Gumbel noise of the row's key over all V tokens). When every sampling row's kept set
    lies within its candidates, only the candidates' noise is generated (`gumbel_at`): the same values, hence the
    same token, as the full draw, since tokens outside the kept set have final = -inf.
    """
    final, token, logprob = sample_final(logits, params, positions=positions, history=history, bias_ids=bias_ids,
                                         bias_values=bias_values, candidates=candidates, bias_dense=bias_dense,
                                         bias_dense_on=bias_dense_on, token_mask=token_mask,
                                         token_mask_on=token_mask_on)
    if return_top_k > 0:
        top_logprobs, top_ids = jax.lax.top_k(final, return_top_k)
    else:
        top_logprobs = jnp.zeros((final.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((final.shape[0], 0), jnp.int32)
    return SampleOutput(token=token, logprob=logprob, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)


def sample_final(
    logits: jax.Array,
    params: SamplingRows,
    *,
    positions: jax.Array,
    history: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
    candidates: int = CANDIDATES,
    bias_dense: jax.Array | None = None,
    bias_dense_on: jax.Array | None = None,
    token_mask: jax.Array | None = None,
    token_mask_on: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(final f32 [S, V], token i32 [S], logprob f32 [S]): `sample` without the top-k, returning the distribution
    it drew from (`processed_logprobs`), so a caller can take its top tokens however it likes."""
    final, ids, inside = _final(logits, params, history, bias_ids, bias_values, candidates, bias_dense,
                                bias_dense_on, token_mask, token_mask_on)
    v = final.shape[-1]
    greedy = params.greedy  # [S]
    best = jax.lax.cond(  # the token of greedy rows
        jnp.any(greedy),
        lambda: jnp.argmax(final, axis=-1).astype(jnp.int32),
        lambda: jnp.zeros(greedy.shape, jnp.int32),
    )

    def draw() -> jax.Array:
        supported = _threefry_draws_supported()
        keys = row_key_data(params.seed, positions) if supported else row_keys(params.seed, positions)

        def dense() -> jax.Array:  # Gumbel-max: an exact draw from softmax(final)
            def noise() -> jax.Array:
                if supported:
                    return gumbel_at(keys, jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), final.shape))
                return jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)

            # The cond (never false here) keeps the noise out of the argmax's fusion: XLA:CPU runs an argmax fused
            # with the noise computation several times slower than the two apart.
            noise = jax.lax.cond(jnp.any(~greedy), noise, lambda: jnp.zeros(final.shape, jnp.float32))
            return jnp.argmax(final + noise, axis=-1).astype(jnp.int32)

        def sparse() -> jax.Array:  # the same, where every kept token is a candidate
            score = jnp.take_along_axis(final, ids, axis=-1) + gumbel_at(keys, ids)  # [S, C]
            top = score == jnp.max(score, axis=-1, keepdims=True)
            return jnp.min(jnp.where(top, ids, v), axis=-1).astype(jnp.int32)  # ties -> lowest id, like argmax

        drawn = jax.lax.cond(jnp.all(inside | greedy), sparse, dense) if supported else dense()
        return jnp.where(greedy, best, drawn)

    token = jax.lax.cond(jnp.all(greedy), lambda: best, draw)  # all-greedy batches skip the noise
    logprob = jnp.take_along_axis(final, token[:, None], axis=-1)[:, 0]
    return final, token, logprob
