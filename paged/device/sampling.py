"""On-device, per-row token sampling for the paged engine.

Everything here is pure and jittable and vectorised over the batch rows `S`; each row carries its own settings
(`SamplingRows`, every field shape [S]). `sample` draws exactly from `processed_logprobs`, the final per-row
log-distribution, which speculative decoding can reuse for verification.

Order of operations (per row), and where it follows ExLlamaV2 (`ExLlamaV2Sampler.sample` + C++ `sample_basic`):

0. Classifier-free guidance (`apply_cfg`), before everything else as in ExLlamaV2: a row paired with its negative
   prompt's row becomes the scale's mix of the two log-distributions.
1. Repetition, frequency and presence penalties, counted over `history` (the most recent R tokens of prompt +
   output), each occurrence weighted by `penalty_weights`: full within `penalty_range` of the end, then fading
   linearly to neutral over `penalty_decay` more tokens (ExLlamaV2's `token_repetition_range` / `_decay`).
   Repetition is HF-style and multiplicative (positive logit / p, negative logit * p), frequency subtracts
   `freq * weight` per occurrence, presence subtracts `pres` once per distinct token; repetition and presence use
   the most recent occurrence's weight, as ExLlamaV2's backwards pass does.
2. Additive bias: sparse (`bias_ids`/`bias_values`), plus optionally a dense `[S, V]` bias for rows with many
   entries (`adjusted_logits`; it, CFG and the penalties run under a `lax.cond`, skipped when no row uses them; the
   logits these steps and DRY adjust are clamped to +-`LOGIT_LIMIT`, a ban's -inf kept).
   ExLlamaV2 sets blocked tokens to -1e30 and then adds `token_bias`; both collapse into this one step here (a value
   of -inf bans a token).
3. DRY (`apply_dry`), then the constrained-decoding token mask.
4. Greedy rows (temperature < 0.01, the same threshold as ExLlamaV2) stop here: the token is the argmax, and the
   reported distribution is log_softmax of these logits at temperature 1 with no truncation.
5. Temperature, applied before the softmax (unless `temperature_last`), with quadratic smoothing where
   `smoothing_factor` > 0 (ExLlamaV2: exp(-factor * (x - max)^2 / T)).
6. top_k -> top_p -> top_a -> min_p -> tfs -> typical -> mirostat, each on the distribution renormalised after the
   previous step, as in `sample_basic`; then the post-softmax temperature (`temperature_last` and/or dynamic
   temperature), XTC (`_xtc`) and skew (`_skew`). Differences from ExLlamaV2, on purpose:
   - Thresholds keep ties: top_k keeps every token whose probability equals the k-th largest, top_p keeps every
     token tied with the last one needed to reach the mass, typical keeps ties of the last score. This makes the
     result independent of token ids and of sort stability (bf16 logits tie often).
   - typical uses the correct score |-log q - H| (ExLlamaV2's C++ computes `x + log(x)`).
   - XTC draws from the exact mixture of removing and not removing (ExLlamaV2's deterministic variant, without
     its index bugs); skew reweights the distribution to what ExLlamaV2's warped draw picks, so both are part of
     the distribution speculative decoding verifies against.
   - Mirostat's mu is per job (the host keeps it, `paged.host.scheduler`), not shared by a batch.
7. Renormalise and draw with Gumbel-max (argmax of log q + Gumbel noise), which can never pick a token outside the
   kept set. The key of row i is `fold_in(key(seed[i]), positions[i])`, so a row's draw depends only on its own
   (seed, position, logits, settings), not on the rest of the batch.

Every option is a runtime value in `SamplingRows` and each step above runs under a `lax.cond` that skips it when
no row of the batch uses it: rows that do not use an option do not pay for it, and no option compiles a variant.

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

# CFG, the penalties, the bias and DRY clamp the logits they adjust to +-this (`clamp_logits`; a ban's -inf stays): a
# batch that uses none of them pays nothing. Divided by a temperature down to 0.01 they stay within 1e6, where float32
# resolves hundredths. Unclamped, a bias of 1e10 scaled to 1e12, where XLA:CPU's two evaluations of x / T in one
# program (a division, and a multiplication by the reciprocal) differed by 4096: exp(4096) overflowed and the row's
# every log-probability became -inf (NaN from 1e30). Model logits lie far inside it; a bias at the limit still decides
# the draw.
LOGIT_LIMIT = 1e4

# Every per-row field, its neutral ("off") value, and whether it is stored as an int. temperature 0 means greedy, so
# `SamplingRows.make(n)` gives n greedy rows. Floats live in one f32 [S, F] array and ints in one i32 [S, I] array
# (the seed as its u32 bits): two transfers per step however many options there are.
_FIELDS: dict[str, tuple[Any, bool]] = {
    "temperature": (0.0, False),
    "top_k": (0, True),
    "top_p": (1.0, False),
    "min_p": (0.0, False),
    "typical": (0.0, False),
    "repetition_penalty": (1.0, False),
    "frequency_penalty": (0.0, False),
    "presence_penalty": (0.0, False),
    "penalty_range": (1 << 30, True),  # penalties see the history tokens at distance < range from the end ...
    "penalty_decay": (0, True),  # ... then fade linearly to neutral over this many more (ExLlamaV2's decay)
    "top_a": (0.0, False),  # keep p >= top_a * p_max^2
    "tfs": (0.0, False),  # tail-free sampling, on for 0 < tfs < 1
    "smoothing_factor": (0.0, False),  # quadratic sampling, on for > 0
    "min_temp": (0.0, False),  # dynamic temperature, on where max_temp > min_temp
    "max_temp": (0.0, False),
    "temp_exponent": (1.0, False),
    "temperature_last": (0, True),  # 1: temperature after truncation, as p^(1/T)
    "skew": (0.0, False),
    "xtc_probability": (0.0, False),
    "xtc_threshold": (0.1, False),
    "mirostat": (0, True),  # 1: truncate to p >= 2^-mirostat_mu (the job's mu, kept on the host)
    "mirostat_mu": (0.0, False),
    "dry_multiplier": (0.0, False),  # DRY, on for > 0
    "dry_base": (1.75, False),
    "dry_allowed_length": (2, True),
    "dry_max_ngram": (20, True),
    "dry_range": (0, True),  # 0: the whole history window
    "cfg_scale": (1.0, False),  # classifier-free guidance (`apply_cfg`), where cfg_partner >= 0
    "cfg_partner": (-1, True),  # the row (sample point) holding this row's negative-prompt logits; -1: no CFG
    "seed": (0, True),
}
NEUTRAL: dict[str, Any] = {name: v for name, (v, _) in _FIELDS.items()}
_FLOATS = tuple(n for n, (_, is_int) in _FIELDS.items() if not is_int)
_INTS = tuple(n for n, (_, is_int) in _FIELDS.items() if is_int)
_COLUMN = {**{n: i for i, n in enumerate(_FLOATS)}, **{n: i for i, n in enumerate(_INTS)}}


@flax.struct.dataclass
class SamplingRows:
    """Per-row sampling settings, packed: `floats` f32 [S, F] and `ints` i32 [S, I]; each setting is a property of
    shape [S] (`rows.temperature`, `rows.top_k`, ..., added below the class from `NEUTRAL`, which lists the names
    and neutral values; `temperature_last` and `mirostat` read as bool)."""

    floats: jax.Array  # f32 [S, len(_FLOATS)]
    ints: jax.Array  # i32 [S, len(_INTS)]; the seed column holds the u32 seed's bits

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
        n = len(rows)
        floats = np.asarray([[row.get(k, base[k]) for k in _FLOATS] for row in rows], np.float32).reshape(n, -1)
        ints = np.zeros((n, len(_INTS)), np.int64)
        for i, row in enumerate(rows):
            for j, k in enumerate(_INTS):
                v = int(row.get(k, base[k]))
                ints[i, j] = (v & 0xFFFFFFFF) if k == "seed" else v  # any Python int is a valid seed
        seed = _COLUMN["seed"]
        out = ints.astype(np.int32)
        out[:, seed] = ints[:, seed].astype(np.uint32).view(np.int32)
        return SamplingRows(floats=floats, ints=out)

    def _col(self, name: str) -> jax.Array:
        return (self.ints if name in _INTS else self.floats)[..., _COLUMN[name]]

    @property
    def seed(self) -> jax.Array:
        """u32 [S]."""
        col = self._col("seed")
        if isinstance(col, np.ndarray):  # host-built rows stay numpy
            return col.view(np.uint32)
        return jax.lax.bitcast_convert_type(col, jnp.uint32)

    @property
    def greedy(self) -> jax.Array:
        """bool [S]: rows that take the argmax instead of drawing."""
        return ~(self.temperature >= GREEDY_TEMPERATURE)  # written so that NaN also means greedy


def _column(name: str) -> property:
    flag = name in ("temperature_last", "mirostat")  # stored 0/1, read as bool

    def get(self: SamplingRows) -> jax.Array:
        col = self._col(name)
        return col != 0 if flag else col

    return property(get, doc=f"`{name}` of every row, [S] (neutral value {NEUTRAL[name]!r}: see `_FIELDS`).")


for _name in NEUTRAL:  # rows.temperature, rows.top_k, ...; the seed has its own property
    if _name != "seed":
        setattr(SamplingRows, _name, _column(_name))


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


def penalty_weights(params: SamplingRows, history: jax.Array) -> jax.Array:
    """f32 [S, R]: how strongly each history token is penalised. History is right-aligned (the last entry is the
    most recent token); at distance d from the end (0: the last token) a token has weight 1 while d < penalty_range;
    with penalty_decay > 0, 1 - (d - range) / decay beyond it, reaching 0 at d = range + decay (ExLlamaV2's
    sustain and decay, exactly: its backwards pass starts decaying one token after the range); padding (-1) has
    weight 0."""
    r = history.shape[-1]
    d = jnp.arange(r - 1, -1, -1, dtype=jnp.int32)[None, :]  # [1, R]
    rng, decay = params.penalty_range[:, None], params.penalty_decay[:, None]  # [S, 1]
    faded = 1.0 - (d - rng).astype(jnp.float32) / jnp.maximum(decay, 1).astype(jnp.float32)
    w = jnp.where(d < rng, 1.0, jnp.where(decay > 0, jnp.clip(faded, 0.0, 1.0), 0.0))
    return jnp.where(history >= 0, w, 0.0)


def apply_penalties(logits: jax.Array, params: SamplingRows, history: jax.Array) -> jax.Array:
    """Repetition (multiplicative, HF-style), frequency (per occurrence) and presence penalties, each scaled by the
    `penalty_weights` of the occurrences: frequency sums them, repetition and presence take the most recent
    occurrence's (as ExLlamaV2's backwards pass over the context). [S, V] -> [S, V]."""
    s, v = logits.shape
    w = penalty_weights(params, history)  # [S, R]
    counts = _row_scatter_add(history, w, v)  # [S, V]: weighted occurrences

    def latest() -> jax.Array:  # the weight of each token's most recent occurrence (the largest: w falls with d)
        ids = jnp.where(history >= 0, history, v)
        rows = jnp.broadcast_to(jnp.arange(s)[:, None], history.shape)
        return jnp.zeros((s, v), jnp.float32).at[rows, ids].max(w, mode="drop")

    # Without decay every weight is 0 or 1, and the latest occurrence's weight is whether there is one.
    recent = jax.lax.cond(jnp.any(params.penalty_decay > 0), latest, lambda: (counts > 0).astype(jnp.float32))
    present = recent > 0  # [S, V]
    # [S, V]: from 1 (weight 0) to the full penalty (weight 1), written so that weight 1 gives the penalty exactly (1 +
    # (p - 1) * w rounds a penalty of 1e-30 to 0, and the logits to inf)
    rep = (1.0 - recent) + params.repetition_penalty[:, None] * recent
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(present, penalised, logits)
    logits = logits - params.frequency_penalty[:, None] * counts
    return clamp_logits(logits - params.presence_penalty[:, None] * recent)


def token_bits(words: jax.Array, ids: jax.Array) -> jax.Array:
    """bool [S, N]: bit `ids[s, n]` of row s's packed token set `words` i32 [S, ceil(V/32)] (token t is bit t % 32
    of word t // 32, as llguidance packs its masks). ids must be in [0, V)."""
    w = jnp.take_along_axis(words, ids >> 5, axis=-1)
    return ((w >> (ids & 31)) & 1) != 0


def dry_used(params: SamplingRows) -> jax.Array:
    return jnp.any(params.dry_multiplier > 0)


def apply_dry(logits: jax.Array, params: SamplingRows, history: jax.Array,
              breakers: jax.Array | None = None) -> jax.Array:
    """DRY ("don't repeat yourself", ExLlamaV2's variant of p-e-w's sampler) over the history window. [S, V].

    Sequence breakers (`breakers`, a packed token set per row; None: none) and tokens older than `dry_range`
    (when > 0) cut every match. For each earlier position j of the history, L_j is the length of the longest run of
    tokens ending just before j that equals the run ending at the last token (at most dry_max_ngram - 1 tokens,
    none of them a breaker), and h[j] (not a breaker) is the token that followed it. With L* the largest L_j that
    is >= dry_allowed_length, every token t loses dry_multiplier * dry_base^(L* - dry_allowed_length) for each
    position j with L_j = L* and h[j] = t (ExLlamaV2 penalises the children of the longest suffix found in its
    n-gram trie, times their count). A logit penalty like the repetition penalty, so greedy rows get it too; rows
    with dry_multiplier <= 0 are untouched."""
    s, v = logits.shape
    r = history.shape[-1]
    on = params.dry_multiplier > 0  # [S]
    tok = history
    idx = jnp.arange(r, dtype=jnp.int32)[None, :]  # [1, R]
    blocked = (tok < 0) | (tok >= v)  # padding, and ids beyond the vocabulary (injected embeddings)
    if breakers is not None:
        blocked = blocked | token_bits(breakers, jnp.clip(tok, 0, v - 1))
    rng = params.dry_range[:, None]
    blocked = blocked | ((rng > 0) & (r - 1 - idx >= rng))  # outside the DRY range
    max_len = jnp.where(on, jnp.clip(params.dry_max_ngram - 1, 0, r), 0)  # [S]
    follow = ~blocked & (idx >= 1) & on[:, None]  # [S, R]: positions whose token may be penalised

    def cond(carry):
        k, alive, _ = carry
        return (k <= r - 1) & jnp.any(alive)

    def body(carry):
        k, alive, length = carry
        prev = jnp.roll(tok, k, axis=1)  # prev[:, j] = tok[:, j - k] (wrapped entries are masked by idx >= k)
        prev_blocked = jnp.roll(blocked, k, axis=1) | (idx < k)
        suffix = jax.lax.dynamic_index_in_dim(tok, r - k, axis=1)  # [S, 1]: the k-th token from the end
        suffix_blocked = jax.lax.dynamic_index_in_dim(blocked, r - k, axis=1)
        ok = alive & (prev == suffix) & ~prev_blocked & ~suffix_blocked & (k <= max_len)[:, None]
        return k + 1, ok, length + ok

    _, _, length = jax.lax.while_loop(cond, body, (jnp.int32(1), follow, jnp.zeros((s, r), jnp.int32)))
    allowed = params.dry_allowed_length[:, None]
    eligible = follow & (length >= allowed)
    best = jnp.max(jnp.where(eligible, length, -1), axis=-1, keepdims=True)  # [S, 1]: L*, -1 if none
    chosen = eligible & (length == best)
    penalty = params.dry_multiplier[:, None] * params.dry_base[:, None] ** (best - allowed).astype(jnp.float32)
    return clamp_logits(logits - _row_scatter_add(jnp.where(chosen, tok, -1), jnp.broadcast_to(penalty, (s, r)), v))


def apply_cfg(logits: jax.Array, params: SamplingRows) -> jax.Array:
    """Classifier-free guidance (ExLlamaV2's order: before everything else): a row with `cfg_partner` p >= 0 becomes
    `cfg_scale * log_softmax(logits[row]) + (1 - cfg_scale) * log_softmax(logits[p])`; other rows are unchanged.
    [S, V] -> [S, V] f32. (`adjusted_logits` runs it inside the penalties' `lax.cond`, so a batch without CFG rows
    pays nothing for it.)"""
    partner = params.cfg_partner  # [S]
    on = partner >= 0
    x = logits.astype(jnp.float32)
    lp = jax.nn.log_softmax(x, axis=-1)
    neg = jnp.take(lp, jnp.clip(partner, 0, x.shape[0] - 1), axis=0)
    s = params.cfg_scale[:, None]
    return jnp.where(on[:, None], clamp_logits(s * lp + (1.0 - s) * neg), x)


def cfg_used(params: SamplingRows) -> jax.Array:
    """bool []: whether any row is guided by a CFG partner row."""
    return jnp.any(params.cfg_partner >= 0)


def apply_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array,
               bias_dense: jax.Array | None = None) -> jax.Array:
    """Add the sparse bias (ids [S, B], -1 = padding; duplicates add up) and, if given, the dense bias [S, V] (for
    rows with more entries than B; zero elsewhere). [S, V] -> [S, V]."""
    bias = _row_scatter_add(bias_ids, bias_values.astype(jnp.float32), logits.shape[-1])
    return clamp_logits(logits + (bias if bias_dense is None else bias + bias_dense))


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
                    token_mask_on: jax.Array | None = None, dry_breakers: jax.Array | None = None) -> jax.Array:
    """f32 [S, V]: classifier-free guidance (`apply_cfg`), penalties, then the bias, then DRY (`apply_dry`, sequence
    breakers `dry_breakers`), then the token mask (constrained decoding: packed allowed-token bits [S, ceil(V/32)],
    applied where `token_mask_on`). Each part runs under a `lax.cond` and is skipped (it would be the identity) when
    no row uses it: CFG when no row has a partner, penalties when every row's are neutral, the sparse bias when
    every id is padding, the dense bias [S, V] unless `bias_dense_on` (bool []), DRY unless a row has
    dry_multiplier > 0, the mask unless `token_mask_on`. Adding a row's bias entries once each, sparse plus dense
    (one of them zero), gives the same floats as one scatter of all of them."""
    x = _biased_logits(logits, params, history, bias_ids, bias_values, bias_dense, bias_dense_on)
    if history.shape[-1]:
        x = jax.lax.cond(dry_used(params), lambda: apply_dry(x, params, history, dry_breakers), lambda: x)
    if token_mask is None:
        return x
    on = jnp.asarray(True) if token_mask_on is None else token_mask_on
    return jax.lax.cond(on, lambda: apply_token_mask(x, token_mask), lambda: x)


def clamp_logits(x: jax.Array) -> jax.Array:
    """`x` within +-LOGIT_LIMIT; -inf (a ban) and NaN (a broken row, reported as such) stay."""
    return jnp.where(x == -jnp.inf, x, jnp.clip(x, -LOGIT_LIMIT, LOGIT_LIMIT))


def _biased_logits(logits, params, history, bias_ids, bias_values, bias_dense, bias_dense_on) -> jax.Array:
    x = logits.astype(jnp.float32)
    # CFG first, inside the penalties' cond (one [S, V] cond fewer for the batches that use neither)
    if history.shape[-1]:
        x = jax.lax.cond(penalties_used(params) | cfg_used(params), lambda: apply_penalties(
            jax.lax.cond(cfg_used(params), lambda: apply_cfg(x, params), lambda: x), params, history), lambda: x)
    else:
        x = jax.lax.cond(cfg_used(params), lambda: apply_cfg(x, params), lambda: x)
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


def top_k_f32(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` of an f32 [S, V] along V, kept as XLA:CPU's fast TopK: without the barrier, slicing the result
    (e.g. `vals[:, -1]`) lets XLA fold the slices into the sort+slice that TopK is matched from, and it falls back
    to a full sort of every row (~100x slower). Integer top_k is always a full sort on CPU, so keys here are f32."""
    vals, idx = jax.lax.top_k(x, k)
    return jax.lax.optimization_barrier(vals), jax.lax.optimization_barrier(idx)


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
    [S] > 0; cand_key [S, C]: the C largest keys of each row, descending (`top_k_f32`), cand_weight [S, C] their weights
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
    """(keep bool [S, V], ids i32 [S, C], inside bool [S]): the tokens kept by top_k -> top_p -> top_a -> min_p ->
    tfs -> typical -> mirostat (ExLlamaV2's order, each on the distribution renormalised after the previous one),
    and per row C token ids that contain the whole kept set where `inside` (never for rows that keep everything,
    unless C = V).

    `logp` [S, V] is the temperature-scaled log-softmax. Greedy rows and rows with every filter off keep all tokens.
    No sort of the vocabulary: each filter's cut is found among the `candidates` (static) most likely tokens
    (`lax.top_k`), or, for rows where it lies beyond them, by an exact bracketing search over the row (tfs alone
    sorts such rows). Each part is skipped (lax.cond) when no row in the batch needs it."""
    s, v = logp.shape
    c = min(candidates, v)
    sampled = ~params.greedy  # [S]
    top_k_on = sampled & (params.top_k > 0) & (params.top_k < v)
    top_p_on = sampled & (params.top_p > 0) & (params.top_p < 1)
    top_a_on = sampled & (params.top_a > 0)
    tfs_on = sampled & (params.tfs > 0) & (params.tfs < 1)
    prefix_on = top_k_on | top_p_on | top_a_on | tfs_on | (sampled & (params.min_p > 0))
    typical_on = sampled & (params.typical > 0) & (params.typical < 1)
    mirostat_on = sampled & params.mirostat

    def prefix() -> tuple[jax.Array, jax.Array, jax.Array]:
        # top_k -> top_p -> top_a -> min_p -> tfs each keep the tokens above a log-prob cut, so together they keep
        # logp >= one cut.
        vals, ids = top_k_f32(logp, c)  # [S, C] descending
        cut_k = _mass_cut(logp, None, params.top_k.astype(jnp.float32), top_k_on, vals, None)
        # top_p on the distribution renormalised over the top_k set: take tokens while the mass before < top_p.
        cand_p = jnp.where(vals >= cut_k[:, None], jnp.exp(vals), 0.0)

        def p() -> jax.Array:
            return jnp.where(logp >= cut_k[:, None], jnp.exp(logp), 0.0)

        mass = _kept_mass(logp, vals, cut_k, top_p_on)  # the whole top_k set's mass
        cut_p = _mass_cut(logp, p, params.top_p * mass, top_p_on, vals, cand_p)
        cut_kp = jnp.maximum(cut_k, cut_p)
        # top_a: keep p' >= a * p'_max^2 on the distribution renormalised over the top_k/top_p set (mass Z), i.e.
        # logp >= log(a) + 2 * logp_max - log(Z).
        mass_kp = jax.lax.cond(jnp.any(top_a_on), lambda: _kept_mass(logp, vals, cut_kp, top_a_on),
                               lambda: jnp.ones((s,), jnp.float32))
        cut_a = jnp.where(top_a_on, jnp.log(jnp.maximum(params.top_a, 0.0)) + 2.0 * vals[:, 0] - jnp.log(mass_kp),
                          -jnp.inf)
        # min_p is a ratio to the max, so renormalisation does not change it; log(0) = -inf keeps everything.
        cut_m = vals[:, 0] + jnp.log(jnp.maximum(params.min_p, 0.0))
        # The most probable token always survives (guards min_p > 1, top_a > 1).
        cut = jnp.minimum(jnp.maximum(jnp.maximum(cut_kp, cut_a), cut_m), vals[:, 0])
        cut = jax.lax.cond(jnp.any(tfs_on), lambda: jnp.maximum(cut, _tfs_cut(logp, vals, cut, params.tfs, tfs_on)),
                           lambda: cut)
        cut = jnp.where(prefix_on, cut, -jnp.inf)
        return cut, ids, (vals[:, -1] < cut) | (c == v)

    cut, ids, inside = jax.lax.cond(
        jnp.any(prefix_on),
        prefix,
        lambda: (jnp.full((s,), -jnp.inf), jnp.zeros((s, c), jnp.int32), jnp.zeros((s,), jnp.bool_)),
    )
    keep = (logp >= cut[:, None]) & (logp > -jnp.inf)

    def typical() -> tuple[jax.Array, jax.Array, jax.Array]:
        # Locally typical sampling on the distribution renormalised over `keep`: take tokens in increasing
        # |-log q - H| until their mass reaches `typical`. Rarely used, so done on whole rows (no candidate path).
        lq = jax.nn.log_softmax(jnp.where(keep, logp, -jnp.inf), axis=-1)  # [S, V]
        q = jnp.exp(lq)
        neg_entropy = jnp.sum(jnp.where(q > 0, q * lq, 0.0), axis=-1, keepdims=True)  # [S, 1]; 0 log 0 := 0
        key = jnp.where(q > 0, -jnp.abs(lq - neg_entropy), -jnp.inf)  # minus the score: the walk takes larger first
        cand_key, cand_ids = top_k_f32(key, c)
        cut = _mass_cut(key, lambda: q, params.typical, typical_on, cand_key, jnp.take_along_axis(q, cand_ids, -1))
        inside_t = typical_on & ((cand_key[:, -1] < cut) | (c == v))  # every kept token is a typical candidate
        return keep & (key >= cut[:, None]), jnp.where(inside_t[:, None], cand_ids, ids), inside | inside_t

    keep, ids, inside = jax.lax.cond(jnp.any(typical_on), typical, lambda: (keep, ids, inside))

    def mirostat() -> jax.Array:
        # Mirostat (v2, as ExLlamaV2): keep the tokens with surprise -log2 q <= mu, q renormalised over `keep`,
        # and always the most probable one.
        m, log_sum = _per_row(_normaliser, (logp, keep), ids, inside)  # [S, 1] each
        cut = jnp.minimum(m + log_sum - params.mirostat_mu[:, None] * np.float32(np.log(2.0)), m)
        return keep & ((logp >= cut) | ~mirostat_on[:, None])

    keep = jax.lax.cond(jnp.any(mirostat_on), mirostat, lambda: keep)
    return keep & (logp > -jnp.inf), ids, inside  # banned tokens are never kept (a cut of -inf keeps "all")


def _kept_mass(logp: jax.Array, vals: jax.Array, cut: jax.Array, on: jax.Array) -> jax.Array:
    """f32 [S]: the probability mass of logp >= cut, on the candidates `vals` where they hold the whole set."""
    inside = (vals[:, -1] < cut) | (vals.shape[-1] == logp.shape[-1])
    mass_c = jnp.sum(jnp.where(vals >= cut[:, None], jnp.exp(vals), 0.0), axis=-1)
    return jax.lax.cond(
        jnp.all(inside | ~on),
        lambda: mass_c,
        lambda: jnp.where(inside, mass_c, jnp.sum(jnp.where(logp >= cut[:, None], jnp.exp(logp), 0.0), axis=-1)),
    )


def _tfs_cut(logp: jax.Array, vals: jax.Array, cut: jax.Array, tfs: jax.Array, on: jax.Array) -> jax.Array:
    """f32 [S]: tail-free sampling's cut on the set logp >= cut (ExLlamaV2's `tfs_cpu`): with p_0 >= p_1 >= ... the
    kept probabilities, d_i = |p_i - 2 p_(i+1) + p_(i+2)| for i < n - 2, keep k + 1 tokens where k counts the
    leading i whose cumulative d_i / sum(d) is <= tfs (ties with the last one kept too). Rows with fewer than 3
    tokens, flat rows (sum(d) = 0) and rows not `on` get -inf. Sorted on the candidates where they hold the kept
    set, else by a full sort of the row (slow on the CPU: pair tfs with top_k)."""
    c, v = vals.shape[-1], logp.shape[-1]

    def on_sorted(srt: jax.Array) -> jax.Array:  # [S, N] descending
        n_cols = srt.shape[-1]
        kept = (srt >= cut[:, None]) & (srt > -jnp.inf)
        n = jnp.sum(kept, axis=-1)
        p = jnp.where(kept, jnp.exp(srt - srt[:, :1]), 0.0)
        d = jnp.abs(p[:, :-2] - 2.0 * p[:, 1:-1] + p[:, 2:])  # [S, N - 2]
        valid = jnp.arange(n_cols - 2)[None, :] < (n - 2)[:, None]
        d = jnp.where(valid, d, 0.0)
        total = jnp.sum(d, axis=-1, keepdims=True)
        cum = jnp.cumsum(d, axis=-1) / jnp.where(total > 0, total, 1.0)
        k = jnp.sum(valid & (cum <= tfs[:, None]), axis=-1)
        t = jnp.take_along_axis(srt, k[:, None], axis=-1)[:, 0]
        return jnp.where(on & (n >= 3) & (total[:, 0] > 0), t, -jnp.inf)

    if c < 3:
        return jnp.full(cut.shape, -jnp.inf)
    inside = (vals[:, -1] < cut) | (c == v)
    return jax.lax.cond(jnp.all(inside | ~on), lambda: on_sorted(vals),
                        lambda: on_sorted(-jnp.sort(-logp, axis=-1)))


def _post_temperature(logp: jax.Array, keep: jax.Array, ids: jax.Array, inside: jax.Array,
                      params: SamplingRows) -> jax.Array:
    """f32 [S]: the temperature applied after truncation, as q^(1/T) renormalised over the kept set (1 for other
    rows): `temperature` where `temperature_last`, or dynamic temperature where max_temp > min_temp (it replaces
    temperature_last's T when both are set, as ExLlamaV2): T = min_temp + (max_temp - min_temp) * (H / log n)^
    temp_exponent, H the entropy of the n kept tokens."""
    sampled = ~params.greedy
    dynamic = sampled & (params.max_temp > params.min_temp)

    def stats(lp: jax.Array, kept: jax.Array) -> tuple[jax.Array, jax.Array]:
        m, log_sum = _normaliser(lp, kept)
        lq = jnp.where(kept, lp - m - log_sum, -jnp.inf)
        entropy = -jnp.sum(jnp.where(kept, jnp.exp(lq) * lq, 0.0), axis=-1, keepdims=True)
        return entropy, jnp.sum(kept, axis=-1, keepdims=True).astype(jnp.float32)

    entropy, n = (a[:, 0] for a in _per_row(stats, (logp, keep), ids, inside))
    h_max = jnp.where(n > 1, jnp.log(jnp.maximum(n, 1.0)), 1.0)
    ratio = jnp.clip(entropy / h_max, 0.0, 1.0)
    t_dyn = params.min_temp + (params.max_temp - params.min_temp) * ratio ** params.temp_exponent
    t = jnp.where(dynamic, t_dyn, jnp.where(sampled & params.temperature_last, params.temperature, 1.0))
    return jnp.maximum(t, np.float32(1e-4))  # T -> 0 is the argmax; 1e-4 is that in float32


def _xtc(final: jax.Array, params: SamplingRows, exempt: jax.Array | None) -> jax.Array:
    """XTC ("exclude top choices"): with probability xtc_probability, every token with q >= xtc_threshold except
    the least probable of them is removed. Drawn here from the exact mixture, P * q_removed + (1 - P) * q: removed
    tokens get q (1 - P), the rest q (1 + P x / (1 - x)), x the removed mass (what ExLlamaV2's deterministic XTC
    computes). The same draws as tossing the coin, with no second random number, and a single distribution for
    speculative verification. Tokens in `exempt` (packed per row; None: none) are never removed nor counted; all
    tokens tied at the least probability are spared."""
    s, v = final.shape
    on = ~params.greedy & (params.xtc_probability > 0)
    q = jnp.exp(final)
    over = (q >= params.xtc_threshold[:, None]) & (final > -jnp.inf)
    if exempt is not None:
        over = over & ~token_bits(exempt, jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (s, v)))
    q_min = jnp.min(jnp.where(over, q, jnp.inf), axis=-1, keepdims=True)
    removed = over & (q > q_min) & on[:, None]
    x = jnp.minimum(jnp.sum(jnp.where(removed, q, 0.0), axis=-1, keepdims=True), np.float32(1.0 - 1e-7))
    pr = params.xtc_probability[:, None]
    return jnp.where(removed, final + jnp.log1p(-pr), final + jnp.log1p(pr * x / (1.0 - x)))


def _skew(final: jax.Array, params: SamplingRows, ids: jax.Array, inside: jax.Array) -> jax.Array:
    """ExLlamaV2's skew: its multinomial draw walks the kept tokens in descending order with r' = r^exp(-skew), so
    token i of that order is drawn with C_i^a - C_(i-1)^a, a = exp(skew), C the cumulative probability. Tokens tied
    in q share their group's probability equally (order-free). Computed on the candidates where they hold every
    kept token, else on a full sort."""
    s, v = final.shape
    on = ~params.greedy & (params.skew != 0)
    a = jnp.exp(params.skew)[:, None]

    def reweight(q_sorted: jax.Array, q: jax.Array) -> jax.Array:  # [S, N] descending, [S, M] -> log p [S, M]
        cum = jnp.concatenate([jnp.zeros((s, 1), jnp.float32), jnp.cumsum(q_sorted, axis=-1)], axis=-1)
        cum = cum / jnp.maximum(cum[:, -1:], np.float32(1e-30))  # exactly 1 at the end: C^a cannot underflow there
        search = jax.vmap(lambda srt, x, side: jnp.searchsorted(srt, x, side=side), (0, 0, None))
        gt = search(-q_sorted, -q, "left")  # entries > q
        ge = search(-q_sorted, -q, "right")  # entries >= q
        above, upto = jnp.take_along_axis(cum, gt, -1), jnp.take_along_axis(cum, ge, -1)
        share = (jnp.maximum(upto, 0.0) ** a - jnp.maximum(above, 0.0) ** a) / jnp.maximum(ge - gt, 1)
        return jnp.where(q > 0, jnp.log(jnp.maximum(share, 0.0)), -jnp.inf)

    def sparse() -> jax.Array:
        qc = jnp.exp(jnp.take_along_axis(final, ids, axis=-1))  # [S, C]
        new = reweight(-jnp.sort(-qc, axis=-1), qc)
        rows = jnp.broadcast_to(jnp.arange(s)[:, None], ids.shape)
        return jnp.full((s, v), -jnp.inf, jnp.float32).at[rows, ids].set(new)

    def dense() -> jax.Array:
        q = jnp.exp(final)
        return reweight(-jnp.sort(-q, axis=-1), q)

    new = jax.lax.cond(jnp.all(inside | ~on), sparse, dense)
    return jnp.where(on[:, None], new, final)


def _final(logits, params, history, bias_ids, bias_values, candidates, bias_dense=None, bias_dense_on=None,
           token_mask=None, token_mask_on=None, dry_breakers=None, xtc_exempt=None):
    """(final [S, V], ids [S, C], inside [S], adjusted [S, V]): `processed_logprobs`, the candidates of
    `_truncation`, and the adjusted logits (`adjusted_logits`: a greedy row's token is their first maximum)."""
    x = adjusted_logits(logits, params, history, bias_ids, bias_values, bias_dense, bias_dense_on, token_mask,
                        token_mask_on, dry_breakers)  # [S, V]
    greedy = params.greedy[:, None]  # [S, 1]
    sampled = ~params.greedy
    temperature = jnp.where(greedy | params.temperature_last[:, None], 1.0, params.temperature[:, None])
    smooth = sampled & (params.smoothing_factor > 0)

    def smoothed() -> jax.Array:  # quadratic sampling: exp(-factor * (x - max)^2 / T)
        top = jnp.max(x, axis=-1, keepdims=True)
        key = jnp.where(smooth[:, None], -params.smoothing_factor[:, None] * jnp.square(x - top), x)
        return jax.nn.log_softmax(key / temperature, axis=-1)

    # Each [S, V] cond below computes its result in both branches: a branch that passed an [S, V] operand through
    # would cost a copy of it (~3 ms at 64 x 49152 on the CPU) in every batch that does not use the option.
    logp = jax.lax.cond(jnp.any(smooth), smoothed, lambda: jax.nn.log_softmax(x / temperature, axis=-1))  # [S, V]
    keep, ids, inside = _truncation(logp, params, candidates)
    post = sampled & (params.temperature_last | (params.max_temp > params.min_temp))
    xtc = sampled & (params.xtc_probability > 0)
    skew = sampled & (params.skew != 0)

    def normalised(lp: jax.Array) -> jax.Array:  # renormalise over the kept set
        m, log_sum = _per_row(_normaliser, (lp, keep), ids, inside)
        return _log_softmax_kept(lp, keep, m, log_sum)

    def reshaped() -> jax.Array:
        # temperature_last / dynamic temperature (q^(1/T) renormalised over the kept set), then XTC, then skew
        t = jax.lax.cond(jnp.any(post), lambda: _post_temperature(logp, keep, ids, inside, params),
                         lambda: jnp.ones(sampled.shape, jnp.float32))
        final = normalised(logp / t[:, None])
        final = jax.lax.cond(jnp.any(xtc), lambda: _xtc(final, params, xtc_exempt), lambda: final)
        return jax.lax.cond(jnp.any(skew), lambda: _skew(final, params, ids, inside), lambda: final)

    final = jax.lax.cond(jnp.any(post | xtc | skew), reshaped, lambda: normalised(logp))
    return final, ids, inside, x


def processed_logprobs(
    logits: jax.Array,
    params: SamplingRows,
    *,
    history: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
    candidates: int = CANDIDATES,
    dry_breakers: jax.Array | None = None,
    xtc_exempt: jax.Array | None = None,
) -> jax.Array:
    """f32 [S, V]: the final per-row log-distribution `sample` draws from (-inf outside the kept set).

    Greedy rows: log_softmax of the penalised, biased logits at temperature 1, untruncated (their token is its argmax).
    `candidates` (static) only trades speed: see `_truncation`.
    """
    return _final(logits, params, history, bias_ids, bias_values, candidates, dry_breakers=dry_breakers,
                  xtc_exempt=xtc_exempt)[0]


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """[S] typed PRNG keys: fold_in(key(seed), position) per row."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def threefry_draws_supported() -> bool:
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
    where `threefry_draws_supported`; the tests check it bit for bit against `jax.random.gumbel`.
    """
    b0, b1 = _threefry2x32(key_data[:, :1], key_data[:, 1:], jnp.zeros(ids.shape, jnp.uint32), ids.astype(jnp.uint32))
    mantissa = ((b0 ^ b1) >> np.uint32(32 - 23)) | np.uint32(0x3F800000)  # a float in [1, 2)
    floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - np.float32(1.0)
    tiny = np.float32(np.finfo(np.float32).tiny)
    u = jnp.maximum(tiny, floats * (np.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def gumbel_max_at(values: jax.Array, key_data: jax.Array, ids: jax.Array, vocab_size: int) -> jax.Array:
    """i32 [S]: the Gumbel-max draw over each row's candidates: argmax of `values` [S, C] (the log-probabilities of
    tokens `ids` [S, C]) plus their noise (`gumbel_at`), ties to the lowest id as `first_argmax`. The token of the
    draw over all `vocab_size` tokens where every token outside `ids` has -inf."""
    score = values + gumbel_at(key_data, ids)
    top = score == jnp.max(score, axis=-1, keepdims=True)
    return jnp.min(jnp.where(top, ids, vocab_size), axis=-1).astype(jnp.int32)


def first_argmax(x: jax.Array, m: jax.Array | None = None) -> jax.Array:
    """i32 [S]: `jnp.argmax(x, axis=-1)` of f32 [S, V] (the first maximal index; the first NaN where a row has one),
    computed as a max and then the first index equal to it. XLA:CPU runs its variadic argmax reduction several
    times slower than these plain reductions: 0.77 vs 0.33 ms at 5 x 49152, 4.6 vs 2.3 ms at 64 rows
    (`experiments.bench_sampling --only greedy`; docs/performance.md, "The greedy argmax"). `m`: the rows' max [S, 1],
    when the caller has it already."""
    v = x.shape[-1]
    if v >= 1 << 24:  # the indices below are float32: exact below 2^24
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    m = jnp.max(x, axis=-1, keepdims=True) if m is None else m
    nan = jnp.isnan(x)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == m)
    return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.float32), np.float32(v)), axis=-1).astype(jnp.int32)


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
    dry_breakers: jax.Array | None = None,
    xtc_exempt: jax.Array | None = None,
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
                                         token_mask_on=token_mask_on, dry_breakers=dry_breakers,
                                         xtc_exempt=xtc_exempt)
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
    dry_breakers: jax.Array | None = None,
    xtc_exempt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(final f32 [S, V], token i32 [S], logprob f32 [S]): `sample` without the top-k, returning the distribution
    it drew from (`processed_logprobs`), so a caller can take its top tokens however it likes. A batch whose rows
    are all greedy with nothing adjusting their logits (`plain_greedy`) takes `greedy_final`: the same distribution
    in one normalisation and a third of the passes over [S, V]."""
    plain = plain_greedy(params, history, bias_ids, bias_dense, bias_dense_on, token_mask, token_mask_on)
    return jax.lax.cond(plain, lambda: greedy_final(logits), lambda: _sample_final(
        logits, params, positions, history, bias_ids, bias_values, candidates, bias_dense, bias_dense_on,
        token_mask, token_mask_on, dry_breakers, xtc_exempt))


def plain_greedy(params: SamplingRows, history: jax.Array, bias_ids: jax.Array, bias_dense: jax.Array | None = None,
                 bias_dense_on: jax.Array | None = None, token_mask: jax.Array | None = None,
                 token_mask_on: jax.Array | None = None) -> jax.Array:
    """bool []: every row is greedy and `adjusted_logits` would be the identity (no CFG partner, neutral penalties, no
    DRY, no bias entry, dense bias or token mask in use), so each row's final distribution is log_softmax(logits) and
    its token the argmax."""
    ok = jnp.all(params.greedy) & ~cfg_used(params)
    if history.shape[-1]:
        ok &= ~penalties_used(params) & ~dry_used(params)
    if bias_ids.shape[-1]:
        ok &= ~jnp.any(bias_ids >= 0)
    if bias_dense is not None:
        ok &= ~(jnp.asarray(True) if bias_dense_on is None else bias_dense_on)
    if token_mask is not None:
        ok &= ~(jnp.asarray(True) if token_mask_on is None else token_mask_on)
    return ok


def greedy_final(logits: jax.Array, impl: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
    """(final [S, V], token [S], logprob [S]) of rows that are greedy and unadjusted: final = log_softmax(logits)
    (one normalisation; the general path renormalises over the kept set, every token for a greedy row, which moves
    a value by a rounding at most), the token the first maximal logit (the argmax of the model's logits, as HF's
    greedy search; the max is the log_softmax's own), its log-probability.

    `impl`: "xla" (`greedy_final_xla`), "native" (`pallas_kernels.native_greedy`: the same tokens, the values within a
    few ulp, several times faster at V = 49152), "auto" (native where it can run: the CPU backend, the library built;
    `JPG_NATIVE_GREEDY=0` keeps XLA's)."""
    from pallas_kernels import native_greedy

    if impl not in ("auto", "xla", "native"):
        raise ValueError(f"impl must be 'auto', 'xla' or 'native', got {impl!r}")
    if impl == "native" or (impl == "auto" and native_greedy.unavailable_reason() is None):
        return native_greedy.native_greedy_final(logits)
    return greedy_final_xla(logits)


def greedy_final_xla(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`greedy_final` in XLA's ops: the max, log-sum-exp, `first_argmax`."""
    x = logits.astype(jnp.float32)
    m = jnp.max(x, axis=-1, keepdims=True)
    lse = m + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True))
    final = x - lse
    token = first_argmax(x, m)
    return final, token, jnp.take_along_axis(final, token[:, None], axis=-1)[:, 0]


def _sample_final(logits, params, positions, history, bias_ids, bias_values, candidates, bias_dense, bias_dense_on,
                  token_mask, token_mask_on, dry_breakers, xtc_exempt):
    final, ids, inside, adjusted = _final(logits, params, history, bias_ids, bias_values, candidates, bias_dense,
                                          bias_dense_on, token_mask, token_mask_on, dry_breakers, xtc_exempt)
    v = final.shape[-1]
    greedy = params.greedy  # [S]
    best = jax.lax.cond(  # the token of greedy rows: the first maximal adjusted logit (as `greedy_final`; the
        jnp.any(greedy),  # normalised `final` can tie two logits a rounding apart)
        lambda: first_argmax(adjusted),
        lambda: jnp.zeros(greedy.shape, jnp.int32),
    )

    def draw() -> jax.Array:
        supported = threefry_draws_supported()
        keys = row_key_data(params.seed, positions) if supported else row_keys(params.seed, positions)

        def dense() -> jax.Array:  # Gumbel-max: an exact draw from softmax(final)
            def noise() -> jax.Array:
                if supported:
                    return gumbel_at(keys, jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), final.shape))
                return jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)

            # The cond (never false here) keeps the noise out of the argmax's fusion: XLA:CPU runs an argmax fused
            # with the noise computation several times slower than the two apart.
            noise = jax.lax.cond(jnp.any(~greedy), noise, lambda: jnp.zeros(final.shape, jnp.float32))
            return first_argmax(final + noise)

        def sparse() -> jax.Array:  # the same, where every kept token is a candidate
            return gumbel_max_at(jnp.take_along_axis(final, ids, axis=-1), keys, ids, v)

        drawn = jax.lax.cond(jnp.all(inside | greedy), sparse, dense) if supported else dense()
        return jnp.where(greedy, best, drawn)

    token = jax.lax.cond(jnp.all(greedy), lambda: best, draw)  # all-greedy batches skip the noise
    logprob = jnp.take_along_axis(final, token[:, None], axis=-1)[:, 0]
    return final, token, logprob
