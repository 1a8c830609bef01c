"""Speculative verification on the device (pure, jitted): the drafted tokens of a row are checked in the ragged step
and accepted without loss. The host side (drafters, `Speculator`, the generator's step) is `paged.speculation`.

- `accept_drafts`: per row, how many drafts survive and the target's next token. Greedy rows: the longest prefix
  where draft == the target's argmax, then the target's token there (the correction, or the bonus token after the
  last draft): the same tokens as non-speculative greedy decoding. Sampling rows: rejection sampling (Leviathan et
  al. 2023; Chen et al. 2023): draft x at position j is accepted with probability min(1, p_j(x) / q_j(x)); at the
  first rejection the next token is drawn from norm(max(0, p_j - q_j)); after all drafts, from p. p is the
  target's `processed_logprobs` at that position, exactly what the non-speculative sampler draws from (penalties
  over a history that includes the earlier drafts, bias, bans, temperature, truncation); q the draft model's own
  final distribution, or one-hot for a proposer without one (n-gram). Every random number comes from
  (seed, position): the acceptance uniform and the residual draw from keys folded from the row's
  `fold_in(key(seed), position)` with their own tags, so a seeded job is reproducible. With `match` (the
  generator's `draft_acceptance="match"` or `"exllamav2"`) sampling rows take the greedy rule against the target's
  own draws instead (sample, then match, as ExLlamaV2), which emits exactly the draws of non-speculative sampling.
- `verify_sample`: the sampler of a verification bucket (`BatchShape.verify_len` W): logits and the ordinary
  sampler at every sample point (S' * W of them), then `accept_drafts`; compiles once per row count S'. The
  distributions stay on the device; the host gets `[S', W]` tokens and log-probs and `[S']` accepted counts
  (top-k / logits per position only when asked).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from models.weights import Weights
from paged.device.sampling import first_argmax, gumbel_max_at, row_keys, threefry_draws_supported, top_k_f32
from paged.device.state import Batch, BatchShape, EngineState, Results
from paged.device.step import (
    StepStatics,
    _sample_rows,
    forward_inputs,
    forward_points,
    fuses_sampler,
    lm_head,
    sample_inputs,
)

ACCEPT_TAG = 0x0ACC  # fold_in tags of the acceptance uniform and the residual draw under a point's key
RESIDUAL_TAG = 0x0E51
RESIDUAL_CANDIDATES = 64  # the residual draw's tokens when p is truncated to at most this many (`_gumbel_argmax`)


def _point_keys(seeds: jax.Array, positions: jax.Array, tag: int) -> jax.Array:
    """[S, N] typed keys: fold_in(fold_in(key(seed), position), tag); seeds [S], positions [S, N]."""
    s, n = positions.shape
    keys = row_keys(jnp.repeat(seeds, n), positions.reshape(-1))
    return jax.vmap(lambda k: jax.random.fold_in(k, tag))(keys).reshape(s, n)


def _gumbel_argmax(lr: jax.Array, keys: jax.Array, rows: jax.Array) -> jax.Array:
    """i32 [S]: argmax(lr + Gumbel noise of each row's key over all V tokens), lr f32 [S, V] (-inf: not drawable,
    never NaN), for the `rows` (bool [S]) that need it (the others' tokens are unspecified). Where each of those rows
    has at most `RESIDUAL_CANDIDATES` drawable tokens (`residual_fits`: a truncated p, top-k or top-p), only the
    noise of each row's `RESIDUAL_CANDIDATES` largest entries is generated (`paged.device.sampling.gumbel_at`: the same
    values as the full draw, so the same token); otherwise (one wide row is enough), or where JAX's random
    configuration is not the one `gumbel_at` reproduces, the noise of all V tokens. A full draw took ~0.8 ms of a
    batch-1 verification's sampler at V = 49152 on the 2-core CPU."""
    v = lr.shape[-1]

    def dense() -> jax.Array:
        g = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys)
        return first_argmax(lr + g)

    if not threefry_draws_supported() or v <= RESIDUAL_CANDIDATES:
        return dense()

    def sparse() -> jax.Array:
        vals, ids = top_k_f32(lr, RESIDUAL_CANDIDATES)  # [S, C], descending: every drawable token of a fitting row
        return gumbel_max_at(vals, jax.random.key_data(keys), ids, v)

    return jax.lax.cond(residual_fits(lr, rows), sparse, dense)


def residual_fits(lr: jax.Array, rows: jax.Array) -> jax.Array:
    """bool []: every row of `rows` (bool [S]) has at most `RESIDUAL_CANDIDATES` drawable (> -inf) entries in lr
    [S, V], so `_gumbel_argmax` draws over its candidates alone."""
    return jnp.all((jnp.sum(lr > -jnp.inf, axis=-1) <= RESIDUAL_CANDIDATES) | ~rows)


def accept_drafts(
    final: jax.Array,
    token: jax.Array,
    drafts: jax.Array,
    num_drafts: jax.Array,
    greedy: jax.Array,
    seeds: jax.Array,
    positions: jax.Array,
    draft_logprobs: jax.Array | None = None,
    *,
    always_accept: bool = False,
    residual_renorm: bool = True,
    match: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(tokens i32 [S, W], num_accepted i32 [S]) for S rows of W = k + 1 positions.

    final f32 [S, W, V]: the target's final log-distribution p_j at each position (position j predicts the token
    after the row's j-th input token, i.e. judges draft j); token i32 [S, W]: the target's own draw from p_j (the
    argmax for greedy rows); drafts i32 [S, k] (-1 padded); num_drafts i32 [S] (0..k); greedy bool [S]; seeds u32
    [S]; positions i32 [S, W]: the position each p_j samples; draft_logprobs f32 [S, k, V]: q_j, the distribution
    draft j was drawn from (None: one-hot, a deterministic proposer).

    Row s emits tokens[s, :num_accepted[s] + 1]: the accepted drafts, then the next token. `match`: sampling rows
    take the greedy rows' rule instead of rejection sampling (sample, then match, ExLlamaV2's rule): draft j is
    accepted where it equals the target's own draw `token[:, j]`, and the draw at the first mismatch follows; also
    lossless (every emitted token is the target's draw), and since each draw uses the key plain decoding uses at
    that position, a seeded job emits the tokens it would without speculation (up to the float differences between
    a verification row's logits and a decode row's). A draft model then draws with the target's keys
    (`paged.speculation.draft.DraftModel.coupled`), so a draft is accepted with probability at least (1 - TV) / (1 +
    TV) per position (Gumbel-max coupling; rejection sampling: 1 - TV = sum min(p, q); independent draws: sum p q).
    `always_accept` and `residual_renorm=False` are deliberately wrong rules, kept for the tests that show the
    losslessness test fails them: accept every draft; draw the correction from p instead of norm(max(0, p - q)).
    """
    s, w, v = final.shape
    k = w - 1
    j = jnp.arange(k)
    valid = j[None, :] < num_drafts[:, None]  # [S, k]
    d = jnp.clip(drafts, 0, v - 1)
    p_x = jnp.exp(jnp.take_along_axis(final[:, :k], d[..., None], axis=-1)[..., 0])  # [S, k]
    if draft_logprobs is None:
        q_x = jnp.ones_like(p_x)
    else:
        q_x = jnp.exp(jnp.take_along_axis(draft_logprobs, d[..., None], axis=-1)[..., 0])
    u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32)))(
        _point_keys(seeds, positions[:, :k], ACCEPT_TAG))  # [S, k] in [0, 1)
    # accept with probability min(1, p / q); never where p(x) = 0, nor where q(x) = 0: a draft its own distribution
    # could not have drawn (a draft row whose mask left none of its head's tokens: every q -inf, the token a
    # placeholder), which p / q = inf would take every time
    ok_sampled = (u * q_x < p_x) & (q_x > 0)
    if always_accept:
        ok_sampled = jnp.ones_like(ok_sampled)
    ok = jnp.where(greedy[:, None] | match, drafts == token[:, :k], ok_sampled) & valid
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # leading accepted drafts
    plain = jnp.take_along_axis(token, a[:, None], axis=1)[:, 0]  # the target's draw at the next position
    rejected = (a < num_drafts) & ~greedy  # sampled rows that stopped at a rejection: draw from the residual

    def residual() -> jax.Array:
        p = jnp.exp(jnp.take_along_axis(final, a[:, None, None], axis=1)[:, 0])  # [S, V]
        ai = jnp.minimum(a, k - 1)
        if draft_logprobs is None:
            x = jnp.take_along_axis(d, ai[:, None], axis=1)[:, 0]
            q = jax.nn.one_hot(x, v, dtype=jnp.float32)
        else:
            q = jnp.exp(jnp.take_along_axis(draft_logprobs, ai[:, None, None], axis=1)[:, 0])
        r = jnp.maximum(p - q, 0.0) if residual_renorm else p
        lr = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)), -jnp.inf)
        pos_a = jnp.take_along_axis(positions, a[:, None], axis=1)  # [S, 1]
        keys = _point_keys(seeds, pos_a, RESIDUAL_TAG)[:, 0]
        t = _gumbel_argmax(lr, keys, rejected)
        # r is 0 everywhere only where p = q, which accepts with probability 1 (rounding aside): draw from p then
        return jnp.where(rejected & jnp.any(r > 0, axis=-1), t, plain)

    nxt = plain if match else jax.lax.cond(jnp.any(rejected), residual, lambda: plain)
    jw = jnp.arange(w)[None, :]
    dpad = jnp.concatenate([drafts, jnp.full((s, 1), -1, drafts.dtype)], axis=1)
    tokens = jnp.where(jw < a[:, None], dpad, jnp.where(jw == a[:, None], nxt[:, None], -1))
    return tokens.astype(jnp.int32), a


@functools.partial(jax.jit, static_argnames=("statics", "match"))
def verify_sample(
    head: Weights,
    h: jax.Array,
    inputs: dict[str, Any],
    verify: dict[str, jax.Array],
    want_top_k: jax.Array,
    draft_logprobs: jax.Array | None,
    *,
    statics: StepStatics,
    match: bool = False,
) -> Results:
    """The sampler of a verification step: h [S' * W, H] (every sample point, `step_forward` of a verification
    bucket), `inputs` the per-point sampler inputs (`sample_inputs(batch)`), `verify` the drafts (`drafts` [S', k],
    or [R >= S', k] of which the first S' rows count: a draft model's burst still on the device; `num_drafts`
    [S']), `draft_logprobs` [S', k, V] or None (one-hot drafts). Results are per position: token and
    logprob [S', W] (see `accept_drafts`; logprob under p), top_ids / top_logprobs [S', W, K], logits and final
    [S', W, V], num_accepted [S']. `match`: sample-then-match acceptance for sampling rows (`accept_drafts`).
    Compiles once per S' (and per presence of `draft_logprobs`)."""
    return _verify_rows(head, h, inputs, verify, want_top_k, draft_logprobs, statics, match)


@functools.partial(jax.jit, static_argnames=("statics", "shape", "match"), donate_argnames=("state",))
def verify_step_jit(
    params: Weights,
    state: EngineState,
    batch: Batch,
    draft_feed: tuple[jax.Array, jax.Array] | None,
    verify: dict[str, jax.Array],
    want_top_k: jax.Array,
    draft_logprobs: jax.Array | None,
    *,
    statics: StepStatics,
    shape: BatchShape,
    match: bool = False,
) -> tuple[EngineState, Results]:
    """`step_forward` (with its `draft_feed`) then `verify_sample` in one program, for a decode-only verification
    bucket (`paged.device.step.fuses_sampler(shape)`; `shape` is `forward_shape` of it, `batch` the whole batch): the
    same results, one dispatch. Compiles once per bucket (and per presence of `draft_feed` and `draft_logprobs`)."""
    if not fuses_sampler(shape):
        raise ValueError(f"verify_step_jit needs a decode-only verification bucket, got {shape}")
    state, (h,) = forward_points(params, state, forward_inputs(batch), draft_feed, statics, shape)
    return state, _verify_rows(lm_head(params), h, sample_inputs(batch), verify, want_top_k, draft_logprobs, statics,
                               match)


def _verify_rows(head: Weights, h: jax.Array, inputs: dict[str, Any], verify: dict[str, jax.Array],
                 want_top_k: jax.Array, draft_logprobs: jax.Array | None, statics: StepStatics,
                 match: bool) -> Results:
    """`verify_sample`'s body (not jitted: `verify_step_jit` puts it in one program with the forward)."""
    num_drafts = verify["num_drafts"]
    s = num_drafts.shape[0]
    drafts = verify["drafts"][:s]
    w = drafts.shape[1] + 1
    res = _sample_rows(head, statics, h, inputs, want_top_k)
    v = res.final.shape[-1]
    final = res.final.reshape(s, w, v)
    sampling = inputs["sampling"]
    tokens, a = accept_drafts(final, res.token.reshape(s, w), drafts, num_drafts, sampling.greedy.reshape(s, w)[:, 0],
                              sampling.seed.reshape(s, w)[:, 0], inputs["positions"].reshape(s, w), draft_logprobs,
                              match=match)
    logprob = jnp.take_along_axis(final, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    kk = res.top_ids.shape[-1]
    return Results(token=tokens, logprob=logprob, top_ids=res.top_ids.reshape(s, w, kk),
                   top_logprobs=res.top_logprobs.reshape(s, w, kk), logits=res.logits.reshape(s, w, v), final=final,
                   num_accepted=a)
