"""Speculative decoding: verification of drafted tokens in the ragged step, lossless acceptance, and `Speculator`,
the host-side object the generator calls each step.

Device side (pure, jitted):
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

Host side: `Speculator` (drafters: a draft model through `paged.draft.DraftModel`, or n-gram prompt lookup through
`paged.ngram.NgramIndex`). Call sequence for the generator, each `iterate()`:

    rows, owners, failed = scheduler.plan(active)                      # as now
    plan = speculator.plan([SpecRow(key=job, row=row, sequence=job.sequence,
                                    max_drafts=<room: 0 for prefill rows, else min(k, tokens the job may still
                                               emit - 1, slots left in its reserved pages past kv + 1)>,
                                    bias_at=<lambda j: the row bias for the token at output position
                                             new_tokens + j (stop-token bans before min_new_tokens, banned-string
                                             bans at that sequence index)>,
                                    penalty_window=<SamplingSettings.history_window(max_penalty_range)>,
                                    host_drafts=<the job has a grammar filter>)
                            for row, job in zip(rows, owners)])        # runs the draft model (mirror + propose)
    out = engine.run(plan.rows, return_top_k=..., return_logits=..., draft_logprobs=plan.draft_logprobs,
                     draft_tokens=plan.draft_tokens)                   # (a draft model's: see `SpecPlan`)
    for row_result in speculator.accept(plan, out):                    # one `Accepted` per row, in order
        advance the job's KV by `row_result.kv_advance` (1 + accepted drafts for a verification row: the KV of
        rejected drafts is dropped by not counting it), then feed `row_result.tokens` one by one through the
        usual per-token path (stop tokens / strings, banned-string rewinds, max_new_tokens), with
        `row_result.logprobs[i]`, `top_ids[i]`, `top_logprobs[i]`, `logits[i]` for token i; stop at the first
        token that ends the job or rewinds it (the later ones were conditioned on it); add
        `num_drafted` / `num_accepted` to the job's counters.
    speculator.release(job)     when a job finishes, fails or is cancelled (its per-job drafter state)
    speculator.stats()          totals and the per-position acceptance histogram

`plan` with no row able to speculate returns the scheduler's rows untouched and `draft_logprobs=None`, so
`engine.run` takes its ordinary path (and with a draft model, the draft still sees the step's rows: its cache
mirrors the target's). The generator must not use decode bursts (`decode_steps > 1`) while speculating.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.weights import Weights
from paged.batch import RowInput
from paged.errors import InvalidConfigError
from paged.ngram_corpus import load_corpus, propose_lookup
from paged.sampling import first_argmax, gumbel_max_at, row_keys, threefry_draws_supported, top_k_f32
from paged.state import Batch, BatchShape, EngineState, Results
from paged.step import (
    TOP_K_WIDTH,
    _sample_rows,
    forward_inputs,
    forward_points,
    fuses_sampler,
    lm_head,
    sample_inputs,
)

# how sampled rows accept drafts: rejection sampling; sample-then-match with a draft model's draws coupled to the
# target's; sample-then-match against greedy drafts, as ExLlamaV2 (`accept_drafts`, `paged.draft`)
ACCEPTANCE_RULES = ("rejection", "match", "exllamav2")
MAX_DRAFT_TOKENS = 64  # the most drafts a row verifies per step: its program is that wide (k + 1 query tokens a row)
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
    noise of each row's `RESIDUAL_CANDIDATES` largest entries is generated (`paged.sampling.gumbel_at`: the same
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
    (`paged.draft.DraftModel.coupled`), so a draft is accepted with probability at least (1 - TV) / (1 + TV) per
    position (Gumbel-max coupling; rejection sampling: 1 - TV = sum min(p, q); independent draws: sum p q).
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
    ok_sampled = u * q_x < p_x  # accept with probability min(1, p / q); never where p(x) = 0
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


@functools.partial(jax.jit, static_argnames=("cfg", "matmul_impl", "top_k_width", "match"))
def verify_sample(
    head: Weights,
    h: jax.Array,
    inputs: dict[str, Any],
    verify: dict[str, jax.Array],
    want_top_k: jax.Array,
    draft_logprobs: jax.Array | None,
    *,
    cfg: ModelConfig,
    matmul_impl: str = "auto",
    top_k_width: int = TOP_K_WIDTH,
    match: bool = False,
) -> Results:
    """The sampler of a verification step: h [S' * W, H] (every sample point, `step_forward` of a verification
    bucket), `inputs` the per-point sampler inputs (`sample_inputs(batch)`), `verify` the drafts (`drafts` [S', k],
    or [R >= S', k] of which the first S' rows count: a draft model's burst still on the device; `num_drafts`
    [S']), `draft_logprobs` [S', k, V] or None (one-hot drafts). Results are per position: token and
    logprob [S', W] (see `accept_drafts`; logprob under p), top_ids / top_logprobs [S', W, K], logits and final
    [S', W, V], num_accepted [S']. `match`: sample-then-match acceptance for sampling rows (`accept_drafts`).
    Compiles once per S' (and per presence of `draft_logprobs`)."""
    return _verify_rows(head, h, inputs, verify, want_top_k, draft_logprobs, cfg, matmul_impl, top_k_width, match)


@functools.partial(jax.jit, static_argnames=("cfg", "shape", "attn_impl", "matmul_impl", "top_k_width", "match"),
                   donate_argnames=("state",))
def verify_step_jit(
    params: Weights,
    state: EngineState,
    batch: Batch,
    draft_feed: tuple[jax.Array, jax.Array] | None,
    verify: dict[str, jax.Array],
    want_top_k: jax.Array,
    draft_logprobs: jax.Array | None,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    attn_impl: str = "auto",
    matmul_impl: str = "auto",
    top_k_width: int = TOP_K_WIDTH,
    match: bool = False,
) -> tuple[EngineState, Results]:
    """`step_forward` (with its `draft_feed`) then `verify_sample` in one program, for a decode-only verification
    bucket (`paged.step.fuses_sampler(shape)`; `shape` is `forward_shape` of it, `batch` the whole batch): the same
    results, one dispatch. Compiles once per bucket (and per presence of `draft_feed` and `draft_logprobs`)."""
    if not fuses_sampler(shape):
        raise ValueError(f"verify_step_jit needs a decode-only verification bucket, got {shape}")
    state, (h,) = forward_points(params, state, forward_inputs(batch), draft_feed, cfg, shape, attn_impl,
                                 matmul_impl)
    return state, _verify_rows(lm_head(params), h, sample_inputs(batch), verify, want_top_k, draft_logprobs, cfg,
                               matmul_impl, top_k_width, match)


def _verify_rows(head: Weights, h: jax.Array, inputs: dict[str, Any], verify: dict[str, jax.Array],
                 want_top_k: jax.Array, draft_logprobs: jax.Array | None, cfg: ModelConfig, matmul_impl: str,
                 top_k_width: int, match: bool) -> Results:
    """`verify_sample`'s body (not jitted: `verify_step_jit` puts it in one program with the forward)."""
    num_drafts = verify["num_drafts"]
    s = num_drafts.shape[0]
    drafts = verify["drafts"][:s]
    w = drafts.shape[1] + 1
    res = _sample_rows(head, cfg, h, inputs, want_top_k, top_k_width, matmul_impl)
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


# ---------------------------------------------------------------------------------------------------- host side
@dataclasses.dataclass
class SpecRow:
    """One row of the scheduler's step, as the speculator needs to see it."""

    key: Hashable  # the job (per-job drafter state is kept under it until `release`)
    row: RowInput  # the scheduler's row
    sequence: Sequence[int]  # the job's tokens so far, prompt + output (`row.tokens` are its last ones)
    max_drafts: int = 0  # drafts this row may verify (0: a prefill chunk, or no room left)
    bias_at: Callable[[int], Mapping[int, float] | None] | None = None  # bias at draft offset j >= 1 (None: row's)
    penalty_window: int = 0  # the job's history window: penalties and DRY (0: none)
    host_drafts: bool = False  # a draft model's drafts must reach the host before verification (a grammar's masks
    # follow them; a row with a `penalty_window` or a history needs them too, which `plan` sees by itself)


@dataclasses.dataclass
class SpecPlan:
    """`Speculator.plan`'s answer: the rows to run (`engine.run(plan.rows, draft_logprobs=plan.draft_logprobs,
    draft_tokens=plan.draft_tokens)`). With a draft model the verification rows' draft tokens are placeholders
    (zeros) unless a drafting row needed them on the host (`SpecRow.host_drafts`, a penalty window or history):
    the drafts themselves are `draft_tokens`, on the device, and the accepted ones come back in the step's tokens."""

    rows: list[RowInput]
    draft_logprobs: jax.Array | None
    inputs: list[SpecRow]
    num_drafts: list[int]  # drafts verified per row (0: an ordinary row)
    classes: list[int] | None = None  # each row's evidence class (n-gram match length, < 0 a corpus's; 0 a model)
    draft_tokens: jax.Array | None = None  # a draft model's drafts on the device (`engine.run(draft_tokens=)`)

    @property
    def verifying(self) -> bool:
        return any(self.num_drafts)


@dataclasses.dataclass
class Accepted:
    """What one row of a step produced: `tokens` to feed the job in order (none for a prefill chunk that does not
    sample), with the target's `logprobs`, `top_ids` / `top_logprobs` ([n, K]) and `logits` ([n, V] or None) at
    each; `kv_advance` tokens of the row now have valid KV."""

    tokens: list[int]
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    logits: np.ndarray | None
    kv_advance: int
    num_drafted: int = 0
    num_accepted: int = 0


# a draft model samples with seed ^ this: its draws are independent of the target's (rejection sampling); with
# sample-then-match it draws with the seed itself, coupled with the target's draws (`paged.draft`)
DRAFT_SEED_SALT = 0x5D2AF7E3


def check_num_draft_tokens(k: Any, max_seq_len: int | None = None) -> None:
    """`InvalidConfigError` unless 1 <= k <= MAX_DRAFT_TOKENS and k < max_seq_len (when known): a verification
    program is k + 1 tokens a row wide, so an unbounded k would compile (and allocate) without limit."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidConfigError(f"num_draft_tokens must be an int >= 1, got {k!r}")
    if k > MAX_DRAFT_TOKENS:
        raise InvalidConfigError(f"num_draft_tokens={k} exceeds the maximum of {MAX_DRAFT_TOKENS} (each verification "
                                 "row is num_draft_tokens + 1 tokens wide); 2-8 is the useful range")
    if max_seq_len is not None and k >= max_seq_len:
        raise InvalidConfigError(f"num_draft_tokens={k} must be below max_seq_len={max_seq_len} (a row verifies its "
                                 "drafts inside the sequence)")


class Speculator:
    """Drafts tokens for the decoding rows of each step and turns the verification results into accepted tokens.

    `target`: the generator's `paged.engine.Engine` (its verification buckets are enabled here: construct the
    speculator before `warmup()`). One drafter: `draft_model` (a `models.Model` sharing the target's vocabulary and
    tokenizer; its engine gets the target's config, so the same page ids index both caches) or `use_ngram_draft`
    (prompt lookup, `max_ngram`; with `ngram_corpus`, a `paged.ngram_corpus.NgramCorpus` or its path, drafting where
    prompt lookup's match is short). `num_draft_tokens` k >= 1. `acceptance`: how sampled rows accept drafts,
    "rejection" (lossless rejection sampling), "match" (sample, then match, see `accept_drafts`; a draft model's
    draws coupled to the target's) or "exllamav2" (sample, then match, a draft model drafting greedily); greedy rows
    accept the drafts equal to the target's argmax either way. `adaptive`: a step verifies only where its drafts are
    expected to pay for the verification (`paged.draft_gate`, with `draft_token_cost` its rho; None: the backend's
    measured default); else every step with drafts verifies (ExLlamaV2's behaviour). Invalid combinations raise
    `InvalidConfigError`.
    """

    def __init__(self, target: Any, *, draft_model: Any = None, num_draft_tokens: int = 4,
                 use_ngram_draft: bool = False, max_ngram: int = 4, tokenizer: Any = None, adaptive: bool = False,
                 draft_token_cost: float | None = None, acceptance: str = "rejection", ngram_corpus: Any = None):
        if draft_model is not None and use_ngram_draft:
            raise InvalidConfigError("speculative decoding takes one drafter: pass draft_model= or "
                                     "use_ngram_draft=True, not both")
        if draft_model is None and not use_ngram_draft:
            raise InvalidConfigError("Speculator needs a drafter: draft_model= or use_ngram_draft=True")
        check_num_draft_tokens(num_draft_tokens, getattr(getattr(target, "config", None), "max_seq_len", None))
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 1:
            raise InvalidConfigError(f"max_ngram must be an int >= 1, got {max_ngram!r}")
        if acceptance not in ACCEPTANCE_RULES:
            raise InvalidConfigError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
        self.target = target
        self.acceptance = acceptance
        self.k = num_draft_tokens
        self.max_ngram = max_ngram
        self.corpus = None
        if ngram_corpus is not None:
            if not use_ngram_draft:
                raise InvalidConfigError("ngram_corpus= is the n-gram drafter's: pass it with use_ngram_draft=True")
            self.corpus = load_corpus(ngram_corpus, target.vocab_size)
        self.draft = None
        if draft_model is not None:
            from paged.draft import DraftModel

            self.draft = DraftModel(target, draft_model, num_draft_tokens, tokenizer=tokenizer,
                                    coupled=acceptance == "match", greedy=acceptance == "exllamav2")
        self.gate = None
        if adaptive:
            from paged.draft_gate import DraftGate

            step_cost = 0.0
            if draft_model is not None:  # a draft step over a target step: the weight bytes each step reads
                # (a reduced head's draft reads its small head, not the embedding table it gathers from)
                step_cost = draft_model.params.step_read_bytes() / max(target.model.params.step_read_bytes(), 1)
            self.gate = DraftGate(num_draft_tokens, draft_token_cost, draft_step_cost=step_cost)
        if acceptance == "rejection":
            target.enable_verification(num_draft_tokens, draft_probs=self.draft is not None)
        else:  # matching reads no draft distributions
            params = inspect.signature(target.enable_verification).parameters
            if "match" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                raise InvalidConfigError(f"acceptance={acceptance!r} needs an engine whose enable_verification "
                                         f"takes match=True; {type(target).__name__}'s does not")
            target.enable_verification(num_draft_tokens, draft_probs=False, match=True)
        if self.draft is None and hasattr(target, "enable_fed_drafts"):
            target.enable_fed_drafts(False)  # one-hot drafts come from the host (an engine a draft model used before)
        self._ngrams: dict[Hashable, Any] = {}
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0  # verification rows run
        self.accepted_at = np.zeros(num_draft_tokens, np.int64)  # rows whose draft j was accepted
        self.corpus_drafted = 0  # drafts the n-gram corpus proposed (evidence class < 0), verified
        self.corpus_accepted = 0

    # ------------------------------------------------------------------ per job
    def release(self, key: Hashable) -> None:
        """Forget a job (finished, failed or cancelled)."""
        self._ngrams.pop(key, None)
        if self.gate is not None:
            self.gate.release(key)
        if self.draft is not None:
            self.draft.release(key)

    def warmup(self, progress: bool = False) -> int:
        """Compile the draft model's variants (the target's verification buckets come with its own warmup)."""
        return 0 if self.draft is None else self.draft.warmup(progress)

    def stats(self) -> dict:
        return {"drafted_tokens": self.drafted, "accepted_draft_tokens": self.accepted,
                "rejected_draft_tokens": self.drafted - self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": 1 + self.accepted / self.rounds if self.rounds else 0.0,
                "accepted_at_position": self.accepted_at.tolist(),
                "draft_bursts_ahead": self.draft.ahead_bursts[0] if self.draft is not None else 0,
                "draft_bursts_ahead_used": self.draft.ahead_bursts[1] if self.draft is not None else 0,
                "corpus_drafted_tokens": self.corpus_drafted, "corpus_accepted_draft_tokens": self.corpus_accepted,
                **({} if self.gate is None else self.gate.stats())}

    # ------------------------------------------------------------------ per step
    def _propose_ngram(self, spec: SpecRow, n: int) -> tuple[list[int], int]:
        """Up to `n` drafts by prompt lookup (or the corpus, `paged.ngram_corpus.propose_lookup`), and their
        evidence class (the length of the suffix that matched; a corpus draft's is negative)."""
        from paged.ngram import NgramIndex

        index = self._ngrams.get(spec.key)
        if index is None:
            index = self._ngrams[spec.key] = NgramIndex(self.max_ngram)
        index.sync(spec.sequence)
        return propose_lookup(index, self.corpus, n)

    def _plain(self, specs: Sequence[SpecRow]) -> SpecPlan:
        return SpecPlan(rows=[s.row for s in specs], draft_logprobs=None, inputs=list(specs),
                        num_drafts=[0] * len(specs))

    def plan(self, specs: Sequence[SpecRow]) -> SpecPlan:
        """Draft for every decode row with `max_drafts > 0` and lay the step's rows out for verification (see the
        module docstring for the call sequence)."""
        want = [min(self.k, s.max_drafts) if (s.row.is_decode and s.row.sample) else 0 for s in specs]
        sampling_rows = sum(bool(s.row.sample) for s in specs)
        if self.draft is None:
            found = [self._propose_ngram(s, n) if n else ([], 0) for s, n in zip(specs, want)]
            drafts = [d for d, _ in found]
            classes = [length for _, length in found]
            if not any(drafts) or (self.gate is not None and not self.gate.decide(
                    [(s.key, c, len(d)) for s, d, c in zip(specs, drafts, classes)], sampling_rows)):
                return self._plain(specs)
            vrows = [verification_row(s, d) if d else s.row for s, d in zip(specs, drafts)]
            return SpecPlan(rows=vrows, draft_logprobs=None, inputs=list(specs), num_drafts=[len(d) for d in drafts],
                            classes=classes)
        if self.gate is not None and not self.gate.decide([(s.key, 0, n) for s, n in zip(specs, want)],
                                                          sampling_rows):
            want = [0] * len(specs)  # the draft model still mirrors the step's rows (its cache follows the target's)
        # The drafts stay on the device (the target's forward writes them into the rows' token slots) unless a row
        # needs them on the host before the step: its penalty history or its grammar masks follow them.
        host = any(s.host_drafts or s.penalty_window or len(s.row.history) for s, n in zip(specs, want) if n)
        drafts, q, want, on_device = self.draft.propose(self.target, specs, want, host=host)
        if not any(want):
            return self._plain(specs)
        if drafts is None:
            drafts = [[0] * n for n in want]  # placeholders: the forward reads `on_device`
        vrows = [verification_row(s, d[:n]) if n else s.row for s, d, n in zip(specs, drafts, want)]
        return SpecPlan(rows=vrows, draft_logprobs=q, inputs=list(specs), num_drafts=list(want),
                        classes=[0] * len(specs), draft_tokens=on_device)

    def accept(self, plan: SpecPlan, out: Any) -> list[Accepted]:
        """One `Accepted` per row of the plan, in order; updates the drafters' state and the statistics."""
        res: list[Accepted] = []
        per_pos = out.num_accepted is not None
        for i, (row, spec, m) in enumerate(zip(plan.rows, plan.inputs, plan.num_drafts)):
            pick = (lambda a, i=i: a[i]) if not per_pos else (lambda a, i=i: a[i][0])
            if m:
                a = int(out.num_accepted[i])
                n = a + 1
                toks = [int(t) for t in out.token[i, :n]]
                item = Accepted(tokens=toks, logprobs=np.asarray(out.logprob[i, :n]), top_ids=out.top_ids[i, :n],
                                top_logprobs=out.top_logprobs[i, :n],
                                logits=None if out.logits is None else out.logits[i, :n], kv_advance=1 + a,
                                num_drafted=m, num_accepted=a)
                self.drafted += m
                self.accepted += a
                self.rounds += 1
                self.accepted_at[:a] += 1
                if plan.classes is not None and plan.classes[i] < 0:  # a corpus's draft (ngram_corpus.corpus_class)
                    self.corpus_drafted += m
                    self.corpus_accepted += a
                if self.gate is not None:
                    self.gate.record(spec.key, plan.classes[i], m, a)
            elif row.sample:
                item = Accepted(tokens=[int(pick(out.token))], logprobs=np.asarray([pick(out.logprob)]),
                                top_ids=pick(out.top_ids)[None], top_logprobs=pick(out.top_logprobs)[None],
                                logits=None if out.logits is None else pick(out.logits)[None],
                                kv_advance=len(row.tokens))
            else:
                item = Accepted(tokens=[], logprobs=np.zeros(0, np.float32), top_ids=np.zeros((0, 0), np.int32),
                                top_logprobs=np.zeros((0, 0), np.float32), logits=None, kv_advance=len(row.tokens))
            if self.draft is not None:
                self.draft.accepted(spec, item, m)
            res.append(item)
        return res


def verification_row(spec: SpecRow, drafts: Sequence[int]) -> RowInput:
    """The verification row of a decode row: its token and the drafts, sampling at every position, with the
    penalty history and bias of each position (`SpecRow.penalty_window`, `SpecRow.bias_at`)."""
    row = spec.row
    drafts = [int(t) for t in drafts]
    hist = None
    if spec.penalty_window and len(row.history):
        base = list(spec.sequence[-spec.penalty_window :])
        hist = [(base + drafts[:j])[-spec.penalty_window :] for j in range(len(drafts) + 1)]
    bias = None
    if spec.bias_at is not None:
        bias = [row.bias] + [spec.bias_at(j) for j in range(1, len(drafts) + 1)]
    return dataclasses.replace(row, tokens=[*row.tokens, *drafts], verify=True, position_history=hist,
                               position_bias=bias)
