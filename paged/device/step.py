"""The device step: a jitted forward `step_forward(params, state, batch) -> (state, hidden)` and a jitted sampler
`step_sample(head, hidden, inputs) -> results`, composed by `step`.

embed -> layers (write this step's K/V into their pages, attend through the page table) -> the hidden state of each
row's last real token; then final norm + LM head -> on-device sampling. `state` is donated, so the cache is updated
in place.

What compiles, and why it is split in two (docs/performance.md, "Compilation"; the buckets in `paged.device.buckets`):
- `step_forward` compiles once per bucket (`forward_shape`: token layout, context buckets, sampled row counts).
  The context length is not a compile-time shape: the page table is always `pages_per_row` wide and attention reads
  the smallest of `shape.page_buckets` that holds the longest row, picked at run time by `lax.switch` (each branch
  is one attention call; the layer stack around it is compiled once). Decode rows are attended in cache-sized
  groups by a loop that stops after the last real row, so padding rows cost no attention. In a prefill bucket the
  decode rows' tokens sit in the last window's padding (`Batch.decode_tokens`) and are gathered for attention.
- `step_sample` compiles once per sampled row count `S'`. Every sampler option is a runtime value: penalties
  (history always `R` wide), the sparse bias (always `B` wide) and the dense bias for rows with more entries each
  run under a `lax.cond` that skips them when no row uses them; the top `TOP_K_WIDTH` tokens are computed under a
  cond when asked for; the raw logits and the final distribution are always outputs (the host copies them only when
  asked). The sampler costs as much to compile as the 30-layer forward (it is ~150 small kernels), so keeping it
  out of the per-layout variants halves the compile time of each.

With the `fuse_sampler` setting a decode-only bucket runs forward and sampler as one program (`fused_step_jit`;
verification buckets `paged.device.verify.verify_step_jit`): one dispatch and no hand-off between two programs per
step, at the price of compiling the sampler into each such bucket's program (`fuses_sampler`).

The `decode_steps` setting runs several decode steps in one call (`decode_burst`, a `lax.scan` over forward +
sampler), feeding each sampled token back in: fewer dispatches per token, at the price of the host seeing stop
conditions only every n tokens. It compiles once per decode layout and burst length.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.llama import compute_logits, embed_tokens, run_layers
from models.weights import Weights
from paged.device.sampling import sample_final
from paged.device.sharding import constrain_cache, constrain_tokens, per_kv_head
from paged.device.state import NULL_PAGE, Batch, BatchShape, EngineState, Results
from pallas_kernels.paged_attention import (
    IMPLS,
    PrefillDecodeLayout,
    auto_impl,
    decode_chunk_rows,
    layout_query_start,
    paged_attention,
    quantize_kv,
)
from pallas_kernels.quant_format import QuantizedArray
from pallas_kernels.registry import Tuned, split_tuning, with_tuning

ATTN_IMPLS = IMPLS  # "auto" (Pallas on GPU where the shape allows, native on the CPU, else XLA), "xla", "pallas",
# "reference", "native"

# The sampler always prepares this many top tokens of the final distribution when any are asked for (under a
# lax.cond: free otherwise); the host slices what each job wants. Wider requests are served on the host from the
# final distribution (`Results.final`), so no request compiles another variant.
TOP_K_WIDTH = 64

# Decode rows riding in a prefill step are attended this many at a time (any number of them 0 .. max_batch_size - 1
# may be real, and a computed group's padding rows cost as much attention as real ones: ~10 ms a row at a 512-token
# context on the CPU). Decode-only buckets use cache-sized groups: there at most half the rows are padding.
TAIL_DECODE_GROUP = 2


@dataclasses.dataclass(frozen=True)
class StepStatics:
    """The static arguments of every jitted entry point of the step, in one frozen (hashable) value: the model's
    config, the attention and quantized-matmul implementations (a registered name, or a `Tuned` name with its
    tuning: `EngineConfig.attn_impl` / `attn_tuning`), and the number of top tokens the sampler prepares. An engine
    makes one (`paged.device.engine.Engine.statics`) and hands it to each call; any other value is another program.
    The bucket (`BatchShape`) and a call's own static choices (burst length, drafts, `match`) are passed beside it."""

    cfg: ModelConfig
    attn_impl: str | Tuned = "auto"
    matmul_impl: str | Tuned = "auto"
    top_k_width: int = TOP_K_WIDTH


def sampler_statics(statics: StepStatics, head: Weights) -> StepStatics:
    """The part of `statics` a sampler program (`step_sample`, `verify_sample`: the final norm, the LM head `head` as
    `lm_head` gives it, the sampler) reads, the rest neutral: the vocabulary, the hidden size and the norm's epsilon,
    the matmul implementation where the head is quantized, the top-k width. Engines that differ only in their forward
    (attention kernel, layers, MLP, heads, rope: a draft model, another kernel under test) then share their sampler
    programs instead of tracing and compiling them again (the persistent cache would give the compiled one back, but
    not the tracing and lowering, ~1 s of a tiny model's sampler on the CPU)."""
    cfg = statics.cfg
    quantized = any(isinstance(w, QuantizedArray) for w in (head.embed, head.lm_head))
    return StepStatics(
        ModelConfig(model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=1,
                    num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, rms_norm_eps=cfg.rms_norm_eps),
        matmul_impl=statics.matmul_impl if quantized else "auto", top_k_width=statics.top_k_width)


def resolved_attn_impl(attn_impl: str | Tuned, *, head_dim: int, page_size: int) -> str | Tuned:
    """The implementation `paged_attention` runs for `attn_impl` on the current backend and this model's shape
    ("auto" resolved by `pallas_kernels.paged_attention.auto_impl`; a `Tuned` keeps its tuning)."""
    name, tuning = split_tuning(attn_impl)
    if name == "auto":
        name = auto_impl(head_dim, page_size)
    return with_tuning(name, tuning)


def impl_name(attn_impl: str | Tuned) -> str:
    """The implementation's name without its tuning."""
    return split_tuning(attn_impl)[0]


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _decode_rows_attention(q, kc, vc, ks, vs, layer, query_lens, kv_lens, page_table, common,
                           max_group: int | None = None, width: int = 1) -> jnp.ndarray:
    """XLA-path attention of decode rows (q [Sd * width, nH, D]: `width` token slots per row, the first
    `query_lens` real; 1 for plain decode rows, W for the step rows of a verification bucket), in groups of rows
    whose gathered pages fit the CPU cache (`decode_chunk_rows`; at most `max_group`), looping only up to the group
    of the last real row (query_lens > 0): rows after it, the padding of the bucket, cost nothing. -> [Sd * width,
    nH, D], zeros for padding rows."""
    t, nh, d = q.shape
    sd = t // width
    kh, ps = kc.shape[-4], kc.shape[-2]
    p = page_table.shape[1]
    g = min(decode_chunk_rows(_next_pow2(sd), p * ps * kh * d * 4 * 2), sd, max_group or sd)
    n = -(-sd // g)
    pad = n * g - sd
    if pad:
        q = jnp.pad(q, ((0, pad * width), (0, 0), (0, 0)))
        query_lens, kv_lens = jnp.pad(query_lens, (0, pad)), jnp.pad(kv_lens, (0, pad))
        page_table = jnp.pad(page_table, ((0, pad), (0, 0)), constant_values=NULL_PAGE)
    last = jnp.max(jnp.where(query_lens > 0, jnp.arange(n * g) + 1, 0))  # rows up to the last real one
    lay = PrefillDecodeLayout(0, 1, g) if width == 1 else PrefillDecodeLayout(g, width, 0)
    qstart = layout_query_start(lay)

    def group(i: jnp.ndarray, out: jnp.ndarray) -> jnp.ndarray:
        cut = lambda a, m=1: jax.lax.dynamic_slice_in_dim(a, i * g * m, g * m, axis=0)  # noqa: E731
        o = paged_attention(cut(q, width), kc, vc, qstart, cut(query_lens), cut(kv_lens), cut(page_table),
                            layout=lay, impl="xla", k_scales=ks, v_scales=vs, layer=layer, **common)
        return jax.lax.dynamic_update_slice_in_dim(out, o, i * g * width, axis=0)

    zeros = jnp.zeros((n * g * width, nh, d), q.dtype)
    # the cond skips the loop, operands and all, when no row is real (a prefill step without decode rows)
    out = jax.lax.cond(last > 0, lambda: jax.lax.fori_loop(0, -(-last // g), group, zeros), lambda: zeros)
    return out[: sd * width]


def _attention(shape: BatchShape, impl: str, q, kc, vc, ks, vs, layer, batch: Batch, page_table,
               common: dict[str, Any]) -> jnp.ndarray:
    """Paged attention of the whole batch over `page_table`'s pages (q [T, nH, D] -> [T, nH, D]). On the XLA path
    the prefill windows and the decode rows are two calls (as the XLA path itself splits them), the decode rows
    (gathered from their token slots) through `_decode_rows_attention`; other implementations take the ragged batch
    in one call."""
    lay = shape.layout
    sp, qm = lay.num_prefill_rows, lay.max_q_len
    if impl_name(impl) != "xla":
        if shape.step_rows_in_windows:  # (a decode-only verification bucket: all windows)
            qstart = jnp.arange(sp, dtype=jnp.int32) * qm
        else:
            qstart = jnp.concatenate([jnp.arange(sp, dtype=jnp.int32) * qm, batch.decode_tokens])
        def kernel(q, kc, vc, ks, vs, qstart, query_lens, kv_lens, page_table, layer):
            return paged_attention(q, kc, vc, qstart, query_lens, kv_lens, page_table, impl=impl, layout=lay,
                                   k_scales=ks, v_scales=vs, layer=layer, **common)

        # under a mesh: per device, on its KV heads (the kernels are custom calls XLA cannot partition)
        return per_kv_head(kernel, q, kc, vc, ks, vs, qstart, batch.query_lens, batch.kv_lens, page_table, layer)
    dec_args = (batch.query_lens[sp:], batch.kv_lens[sp:], page_table[sp:], common)
    if not sp:  # decode-only: row j's token is slot j
        return _decode_rows_attention(q, kc, vc, ks, vs, layer, *dec_args)
    pre = PrefillDecodeLayout(sp, qm, 0)
    o = paged_attention(q[: sp * qm], kc, vc, layout_query_start(pre), batch.query_lens[:sp], batch.kv_lens[:sp],
                        page_table[:sp], impl="xla", layout=pre, k_scales=ks, v_scales=vs, layer=layer, **common)
    if lay.num_decode_rows:
        o = jnp.concatenate([o, jnp.zeros((lay.num_decode_rows, *o.shape[1:]), o.dtype)])
    if not shape.num_decode_rows:
        return o
    # The window output is zero past each chunk, where the decode rows' tokens sit; padding rows point past T.
    # In a verification bucket each decode (step) row owns W slots from its decode_tokens entry.
    w = shape.verify_len or 1
    slots = batch.decode_tokens if w == 1 else (batch.decode_tokens[:, None] + jnp.arange(w)).reshape(-1)
    qd = jnp.take(q, slots, axis=0, mode="fill", fill_value=0)  # [Sd * W, nH, D]
    # Any number of them may be real: small groups, so that a group's padding rows waste little attention.
    od = _decode_rows_attention(qd, kc, vc, ks, vs, layer, *dec_args, max_group=TAIL_DECODE_GROUP, width=w)
    return o.at[slots].set(od, mode="drop")


def page_bucket_index(kv_lens: jnp.ndarray, page_size: int, page_buckets: tuple[int, ...]) -> jnp.ndarray:
    """int32 []: index of the smallest of `page_buckets` holding every row's `kv_lens` tokens."""
    need = jnp.max((kv_lens + page_size - 1) // page_size)
    return jnp.sum(jnp.asarray(page_buckets[:-1], jnp.int32) < need).astype(jnp.int32)


def forward_inputs(batch: Batch) -> Batch:
    """The batch without its sampler inputs (which the forward does not read, and whose row count varies)."""
    return batch.replace(sampling=None, sample_positions=None, history=None, bias_ids=None, bias_values=None,
                         bias_dense=None, bias_dense_on=None, token_mask=None, token_mask_on=None, drafts=None,
                         num_drafts=None, dry_breakers=None, xtc_exempt=None)


def _forward(params: Weights, state: EngineState, batch: Batch, statics: StepStatics,
             shape: BatchShape) -> tuple[EngineState, jnp.ndarray]:
    """Run the model over the batch's tokens, writing K/V; returns the new state and the hidden state `[S, H]` of
    each row's last real token (verification buckets: `[S * W, H]`, every sample point)."""
    cfg = statics.cfg
    ps = state.page_size
    s_count = shape.num_rows
    rows = batch.token_rows  # [T], S for padding slots
    real = rows < s_count  # [T]
    pos = batch.positions
    # Positions past the page table (a blind burst or draft running past a row's last page) write the null page
    # rather than wherever a clamped index would land.
    real = real & (pos < batch.page_table.shape[1] * ps)
    write_page = jnp.where(real, batch.page_table[jnp.minimum(rows, s_count - 1), pos // ps], NULL_PAGE)  # [T]
    write_off = jnp.where(real, pos % ps, 0)
    common = dict(sm_scale=cfg.head_dim**-0.5, sliding_window=cfg.sliding_window)
    impl = resolved_attn_impl(statics.attn_impl, head_dim=cfg.head_dim, page_size=ps)
    buckets = shape.page_buckets if impl_name(impl) != "pallas" and shape.page_buckets else (shape.pages_per_row,)
    bucket = page_bucket_index(batch.kv_lens, ps, buckets) if len(buckets) > 1 else None

    def attend(layer, q, k, v, kv):
        kc, vc, ks, vs = kv
        # k, v: [T, KH, D]; the index (layer, :, [T], [T]) addresses [T, KH, (D)] slots
        if ks is not None:  # int8 cache: per-token-per-head scales written beside the values
            k, k_sc = quantize_kv(k)
            v, v_sc = quantize_kv(v)
            ks = ks.at[layer, :, write_page, write_off].set(k_sc)
            vs = vs.at[layer, :, write_page, write_off].set(v_sc)
        kc = kc.at[layer, :, write_page, write_off].set(k.astype(kc.dtype))
        vc = vc.at[layer, :, write_page, write_off].set(v.astype(vc.dtype))

        def over(pages: int):  # attention reading the first `pages` pages of every row
            # the whole stacked cache and the layer: no copy of the layer's pool
            return lambda q, kc, vc, ks, vs: _attention(shape, impl, q, kc, vc, ks, vs, layer, batch,
                                                        batch.page_table[:, :pages], common)

        if bucket is None:
            o = over(buckets[0])(q, kc, vc, ks, vs)
        else:
            o = jax.lax.switch(bucket, [over(p) for p in buckets], q, kc, vc, ks, vs)
        return o, (kc, vc, ks, vs)

    if state.extra_embed is None:
        h = embed_tokens(params, batch.token_ids)
    else:  # injected embeddings: id vocab_size + r is row r of the table
        h = embed_tokens(params, jnp.minimum(batch.token_ids, cfg.vocab_size - 1))
        extra = batch.token_ids - cfg.vocab_size
        rows = jnp.take(state.extra_embed, jnp.clip(extra, 0, state.extra_embed.shape[0] - 1), axis=0)
        h = jnp.where((extra >= 0)[:, None], rows.astype(h.dtype), h)
    lora = None
    if state.lora is not None and batch.lora_slots is not None:  # each token runs through its row's adapter
        lora = (state.lora, jnp.where(batch.token_rows < s_count,
                                      batch.lora_slots[jnp.minimum(batch.token_rows, s_count - 1)], 0))
    h = constrain_tokens(h)  # data parallel: each replica computes its share of the tokens (rows)
    h, (k, v, ks, vs) = run_layers(params, cfg, h, pos, attend, (state.k, state.v, state.k_scale, state.v_scale),
                                   statics.matmul_impl, lora)
    k, v, ks, vs = constrain_cache(k, v, ks, vs)  # under a mesh: the cache stays split by KV head
    new = EngineState(k=k, v=v, k_scale=ks, v_scale=vs, extra_embed=state.extra_embed, lora=state.lora)
    if shape.verify_len:  # every sample point: [S * W, H], point j of row s at s * W + j
        return new, h[batch.sample_tokens.reshape(-1)]
    if not shape.layout.num_prefill_rows:  # decode-only: row j's token is slot j
        return new, h
    return new, h[batch.last_tokens]


def lm_head(params: Weights) -> Weights:
    """The weights the sampler needs (final norm, LM head or tied embedding), without the layers."""
    return params.replace(layers=None)


def sample_inputs(batch: Batch) -> dict[str, Any]:
    """The sampler inputs of a batch (its first `S'` rows; nothing that depends on the token layout)."""
    return dict(sampling=batch.sampling, positions=batch.sample_positions, history=batch.history,
                bias_ids=batch.bias_ids, bias_values=batch.bias_values, bias_dense=batch.bias_dense,
                bias_dense_on=batch.bias_dense_on, token_mask=batch.token_mask, token_mask_on=batch.token_mask_on,
                dry_breakers=batch.dry_breakers, xtc_exempt=batch.xtc_exempt)


def _sample_rows(head: Weights, statics: StepStatics, h: jnp.ndarray, inputs: dict[str, Any],
                 want_top_k: jnp.ndarray, keep_logits: bool = True, keep_final: bool = True) -> Results:
    """Logits of the rows' last tokens `h` [S, H] and the sampler; top tokens (`statics.top_k_width` of them) only
    where `want_top_k` (bool [], a runtime value). `keep_logits` / `keep_final`: also return the raw logits / the
    final distribution (both are materialized anyway, so returning them costs no compute)."""
    logits = compute_logits(head, statics.cfg, h, statics.matmul_impl)  # [S, V]
    inputs = dict(inputs)
    final, token, logprob = sample_final(logits, inputs.pop("sampling"), **inputs)
    s, w = final.shape[0], min(statics.top_k_width, final.shape[1])
    top_logprobs, top_ids = jax.lax.cond(
        want_top_k,
        lambda: tuple(jax.lax.top_k(final, w)),
        lambda: (jnp.zeros((s, w), jnp.float32), jnp.zeros((s, w), jnp.int32)),
    )
    return Results(token=token, logprob=logprob, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs,
                   logits=logits if keep_logits else None, final=final if keep_final else None)


def forward_shape(shape: BatchShape) -> BatchShape:
    """The part of a bucket the forward is compiled for (the sampler's widths are not its business)."""
    return dataclasses.replace(shape, history_len=0, num_bias=0)


@functools.partial(jax.jit, static_argnames=("statics", "shape"), donate_argnames=("state",))
def step_forward(
    params: Weights,
    state: EngineState,
    batch: Batch,
    draft_feed: tuple[jnp.ndarray, jnp.ndarray] | None = None,
    *,
    statics: StepStatics,
    shape: BatchShape,
) -> tuple[EngineState, tuple[jnp.ndarray, ...]]:
    """The forward half of a step over `forward_inputs(batch)`: the new state, and the hidden states of the rows'
    last tokens for each of `shape.sampled_row_counts` (the first n rows, `[n, H]` each; `[n * W, H]`, every
    sample point, in a verification bucket). Compiles once per `forward_shape(shape)` (and per presence of
    `draft_feed`).

    `draft_feed` (tokens i32 [R, k], index i32 [R, k]): drafts that are still on the device (a draft model's burst,
    `draft_burst_jit`), written into the batch's token slots before the forward: `token_ids[index] = tokens`, an
    index past the last slot writes nothing. A verification step then needs no host round trip between the
    draft's burst and the target's forward (`paged.device.engine.Engine.run(draft_tokens=)`)."""
    return forward_points(params, state, batch, draft_feed, statics, shape)


def forward_points(params: Weights, state: EngineState, batch: Batch,
                   draft_feed: tuple[jnp.ndarray, jnp.ndarray] | None, statics: StepStatics,
                   shape: BatchShape) -> tuple[EngineState, tuple[jnp.ndarray, ...]]:
    """`step_forward`'s body (not jitted: `fused_step_jit` and `paged.device.verify.verify_step_jit` put it in one
    program with a sampler)."""
    if draft_feed is not None:
        tokens, index = draft_feed
        batch = batch.replace(token_ids=jnp.asarray(batch.token_ids).at[index.reshape(-1)].set(
            tokens.reshape(-1).astype(jnp.int32), mode="drop"))
    state, h = _forward(params, state, batch, statics, shape)
    w = shape.points_per_row
    return state, tuple(h[: n * w] for n in shape.sampled_row_counts)


@functools.partial(jax.jit, static_argnames=("statics",))
def step_sample(
    head: Weights,
    h: jnp.ndarray,
    inputs: dict[str, Any],
    want_top_k: jnp.ndarray,
    *,
    statics: StepStatics,
) -> Results:
    """The sampling half of a step: logits of `h` [S', H] through `head` (`lm_head(params)`), and the sampler over
    `inputs` (`sample_inputs(batch)`). Compiles once per row count S' (R, B and V are fixed per engine)."""
    return _sample_rows(head, statics, h, inputs, want_top_k)


def fuses_sampler(shape: BatchShape) -> bool:
    """Whether a bucket can run its forward and its sampler as one program (`fused_step_jit`,
    `paged.device.verify.verify_step_jit`): it samples a single row count, as every decode-only bucket does (plain and
    verification), so the program compiles once for it. Buckets with prefill windows sample one of several row
    counts and keep the two halves apart (the sampler compiles once per row count, shared by those buckets)."""
    decode_only = shape.step_rows_in_windows if shape.verify_len else not shape.layout.num_prefill_rows
    return decode_only and len(shape.sampled_row_counts) == 1


@functools.partial(jax.jit, static_argnames=("statics", "shape"), donate_argnames=("state",))
def fused_step_jit(
    params: Weights,
    state: EngineState,
    batch: Batch,
    want_top_k: jnp.ndarray,
    *,
    statics: StepStatics,
    shape: BatchShape,
) -> tuple[EngineState, Results]:
    """`step_forward` then `step_sample` in one program, for a bucket where `fuses_sampler(shape)` (`shape` is
    `forward_shape` of it; `batch` the whole batch, sampler inputs included): the same results, one dispatch and
    no hand-off between two programs (docs/performance.md, "One program per decode step"). Compiles once per
    bucket."""
    if not fuses_sampler(shape):
        raise ValueError(f"fused_step_jit needs a bucket that samples one row count without prefill windows, got "
                         f"{shape}")
    state, (h,) = forward_points(params, state, forward_inputs(batch), None, statics, shape)
    return state, _sample_rows(lm_head(params), statics, h, sample_inputs(batch), want_top_k)


def step(
    params: Weights,
    state: EngineState,
    batch: Batch,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    return_top_k: int = 0,
    return_logits: bool = False,
    attn_impl: str = "auto",
    matmul_impl: str = "auto",
) -> tuple[EngineState, Results]:
    """One engine step over a ragged batch of prefill chunks and decode rows: `step_forward` then `step_sample` on
    the batch's sampled rows. `state` is donated. Results have `top_ids`/`top_logprobs` `[S', return_top_k]` and
    `logits` only if asked."""
    statics = StepStatics(cfg, attn_impl, matmul_impl)
    state, hs = step_forward(params, state, forward_inputs(batch), statics=statics, shape=forward_shape(shape))
    h = hs[shape.sampled_row_counts.index(batch.sample_positions.shape[0])]
    head = lm_head(params)
    res = step_sample(head, h, sample_inputs(batch), jnp.asarray(return_top_k > 0),
                      statics=sampler_statics(statics, head))
    if 0 < return_top_k <= res.top_ids.shape[1]:
        top_logprobs, top_ids = res.top_logprobs[:, :return_top_k], res.top_ids[:, :return_top_k]
    elif return_top_k > 0:  # wider than the sampler prepares: from the final distribution
        top_logprobs, top_ids = jax.lax.top_k(res.final, min(return_top_k, res.final.shape[1]))
    else:
        top_logprobs, top_ids = res.top_logprobs[:, :0], res.top_ids[:, :0]
    return state, res.replace(top_ids=top_ids, top_logprobs=top_logprobs,
                              logits=res.logits if return_logits else None)


@functools.partial(
    jax.jit,
    static_argnames=("statics", "shape", "num_steps", "return_logits"),
    donate_argnames=("state",),
)
def decode_burst_jit(
    params: Weights,
    state: EngineState,
    batch: Batch,
    want_top_k: jnp.ndarray,
    *,
    statics: StepStatics,
    shape: BatchShape,
    num_steps: int,
    return_logits: bool = False,
) -> tuple[EngineState, Results]:
    """`num_steps` decode steps in one call (see `decode_burst`; `shape` is `forward_shape` of the bucket). Results
    are stacked `[num_steps, S, ...]`; the final distribution is not returned, the raw logits only with
    `return_logits` (static: the generator never asks for them in a burst)."""
    return _burst(params, state, batch, want_top_k, None, statics, shape, num_steps, return_logits, keep_final=False)


def _burst(params: Weights, state: EngineState, batch: Batch, want_top_k: jnp.ndarray, forced: jnp.ndarray | None,
           statics: StepStatics, shape: BatchShape, num_steps: int, return_logits: bool,
           keep_final: bool, mask_first: bool = False) -> tuple[EngineState, Results]:
    """The scan of `decode_burst_jit`: each step's sampled token is fed to the next step, or, where `forced`
    (i32 [num_steps, S], -1: no) is given and >= 0, `forced[t]` is fed after step t instead. `mask_first`: the
    batch's token mask applies to the first step only (`_unmasked`)."""
    if shape.layout.num_prefill_rows or batch.sample_positions.shape[0] != shape.num_rows:
        raise ValueError("decode_steps needs a decode-only batch shape (num_prefill_rows == 0) sampling every row")
    active = batch.query_lens > 0  # [S]
    head = lm_head(params)

    def body(carry, forced_t):
        state, b = carry
        state, h = _forward(params, state, forward_inputs(b), statics, shape)
        res = _sample_rows(head, statics, h, sample_inputs(b), want_top_k, keep_logits=return_logits,
                           keep_final=keep_final)
        tok = res.token if forced_t is None else jnp.where(forced_t >= 0, forced_t, res.token)
        b = _advance(b, tok, active)
        return (state, _unmasked(b) if mask_first else b), res

    (state, _), res = jax.lax.scan(body, (state, batch), forced, length=num_steps)
    return state, res


def _advance(b: Batch, tok: jnp.ndarray, active: jnp.ndarray) -> Batch:
    """A decode-only batch one step on: each active row's token is `tok` (i32 [S]), one position later, with it at
    the end of the row's penalty history."""
    tok = jnp.where(active, tok, 0)
    history = b.history
    if history.shape[1]:
        history = jnp.concatenate([history[:, 1:], jnp.where(active, tok, -1)[:, None]], axis=1)
    return b.replace(token_ids=tok, positions=b.positions + active, kv_lens=b.kv_lens + active,
                     sample_positions=b.sample_positions + active, history=history)


def _unmasked(b: Batch) -> Batch:
    """`b` with its token mask off: a draft burst's rows carry the mask of their first position (a filter's, the
    only one the host knows before the drafts exist); later drafts are proposed unmasked, their own positions'
    masks applied by the verification."""
    return b if b.token_mask_on is None else b.replace(token_mask_on=jnp.zeros((), jnp.bool_))


def catch_up_shape(shape: BatchShape) -> BatchShape:
    """The bucket of a draft burst's catch-up forward for the decode-only bucket `shape`: one window of two token
    slots per row (the layout of a decode-only verification bucket of width 2), window s holding row s's catch-up
    token and its token, or its token alone."""
    return dataclasses.replace(shape, layout=PrefillDecodeLayout(shape.num_rows, 2, 0), tail_decode_rows=0,
                               sample_rows=(shape.num_rows,), verify_len=2)


def _catch_up_window(batch: Batch, catch_up: jnp.ndarray) -> Batch:
    """The forward inputs of `catch_up_shape`'s bucket for a decode-only `batch` (row s's token in slot s): window s
    feeds `catch_up[s]` at the position before the row's token, then the token, where `catch_up[s] >= 0`; the token
    alone where not."""
    s = batch.query_lens.shape[0]
    rows = jnp.arange(s, dtype=jnp.int32)
    active = batch.query_lens > 0
    c = active & (catch_up >= 0)
    tok, pos = batch.token_ids[:s], batch.positions[:s]
    pair = lambda a, b: jnp.stack([a, b], axis=1).reshape(-1)  # noqa: E731  [S, 2] -> [2S]: window s is 2s, 2s + 1
    qlen = active.astype(jnp.int32) + c
    return Batch(token_ids=pair(jnp.where(c, catch_up, tok), jnp.where(c, tok, 0)), positions=pair(pos - c, pos),
                 token_rows=pair(jnp.where(active, rows, s), jnp.where(c, rows, s)), query_lens=qlen,
                 kv_lens=batch.kv_lens, page_table=batch.page_table, decode_tokens=jnp.zeros(0, jnp.int32),
                 last_tokens=rows * 2 + jnp.maximum(qlen - 1, 0), sample_tokens=jnp.stack([rows * 2, rows * 2 + 1], 1),
                 sample_positions=None, history=None, bias_ids=None, bias_values=None, sampling=None,
                 lora_slots=batch.lora_slots)


def _moved_on(batch: Batch, catch_up: jnp.ndarray, emitted: jnp.ndarray, num_accepted: jnp.ndarray, s: int,
              num_drafts: int) -> tuple[Batch, jnp.ndarray]:
    """`draft_burst_jit(window=)`'s rows: (the batch with each moved row at its next token, the catch-up tokens)."""
    active = batch.query_lens > 0
    a = num_accepted[:s]
    moved = active & (a >= 0)
    a = jnp.where(moved, a, 0)
    rows = jnp.arange(s, dtype=jnp.int32)
    tok = emitted[rows, a]
    catch_up = jnp.where(moved, jnp.where(a == num_drafts, emitted[rows, jnp.maximum(a - 1, 0)], -1), catch_up[:s])
    adv = jnp.where(moved, a + 1, 0)
    token_ids = batch.token_ids.at[:s].set(jnp.where(moved, tok, batch.token_ids[:s]))
    return batch.replace(token_ids=token_ids, positions=batch.positions + adv, kv_lens=batch.kv_lens + adv,
                         sample_positions=batch.sample_positions + adv), catch_up


@functools.partial(
    jax.jit, static_argnames=("statics", "shape", "num_drafts", "pad_rows"), donate_argnames=("state",),
)
def draft_burst_jit(
    params: Weights,
    state: EngineState,
    batch: Batch,
    window: tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray] | None = None,
    *,
    statics: StepStatics,
    shape: BatchShape,
    num_drafts: int,
    pad_rows: int = 0,
) -> tuple[EngineState, jnp.ndarray, jnp.ndarray]:
    """A draft model's proposal for every row of a decode-only `batch` (`shape` is `forward_shape` of its bucket):
    `num_drafts` steps of the `decode_burst_jit` scan, each feeding the previous step's sample; row s's drafts are
    the samples of the steps, and the last draft's KV is not written (`paged.speculation.draft.DraftModel.accepted`
    counts it).

    `window` (catch_up i32 [S], emitted i32 [S, W], num_accepted i32 [S]): step 0 runs as a window of two token
    slots per row (`catch_up_shape`), which feeds a token the draft cache lacks before the row's, and rows can move
    on from a verification whose results are still on the device:
    - where `num_accepted[s] = a >= 0`, row s continues after that verification (`emitted`, `num_accepted`: its
      results by batch row; `batch` the burst batch that drafted the verified rows): its token is emitted[s, a],
      a + 1 positions past the batch's; where a == num_drafts the draft cache lacks the last draft's KV too (no
      burst writes it), and emitted[s, a - 1] is fed before it. This is the burst dispatched before the host has
      seen the verification (`paged.speculation.draft.DraftModel.ahead`); the rows keep their sampler inputs (settings,
      bias;
      the caller's rows have no penalty history).
    - where a < 0, row s drafts from the batch's token, fed after `catch_up[s]` where that is >= 0 (the row's last
      draft was accepted and the target added the bonus token), alone where not.
    Step 0 samples at each row's token with the batch's sampler inputs: the drafts a decode step after the catch-up
    token would draw, for one draft forward of two tokens instead of two of one. Without `window` step 0 is a
    decode step of one token per row (cheaper where no row needs a catch-up token). Compiles once per bucket with a
    window and once without.

    Returns the new state, the drafts i32 `[S, num_drafts]` (`[max(S, pad_rows), num_drafts]`, zero rows after the
    S-th: the fixed row count of a target's `step_forward(draft_feed=)`, whatever S), and the distributions they
    were drawn from, f32 `[S, num_drafts, V]` log-probabilities (`processed_logprobs`: the q of rejection
    sampling), on the device."""
    if shape.layout.num_prefill_rows or batch.sample_positions.shape[0] != shape.num_rows:
        raise ValueError("a draft burst needs a decode-only batch shape sampling every row")
    if window is None:
        state, res = _burst(params, state, batch, jnp.asarray(False), None, statics, shape, num_drafts,
                            return_logits=False, keep_final=True, mask_first=True)
        tokens, final = res.token.T, jnp.swapaxes(res.final, 0, 1)  # [S, k], [S, k, V]
    else:
        batch, catch_up = _moved_on(batch, *window, shape.num_rows, num_drafts)
        win = _catch_up_window(batch, catch_up)
        state, h = _forward(params, state, win, statics, catch_up_shape(shape))  # [2S, H]
        first = _sample_rows(lm_head(params), statics, h[win.last_tokens], sample_inputs(batch), jnp.asarray(False),
                             keep_logits=False, keep_final=True)
        tokens, final = first.token[:, None], first.final[:, None]
        if num_drafts > 1:
            state, res = _burst(params, state, _unmasked(_advance(batch, first.token, batch.query_lens > 0)),
                                jnp.asarray(False), None, statics, shape, num_drafts - 1, return_logits=False,
                                keep_final=True)
            tokens = jnp.concatenate([tokens, res.token.T], axis=1)
            final = jnp.concatenate([final, jnp.swapaxes(res.final, 0, 1)], axis=1)
    if pad_rows > tokens.shape[0]:
        tokens = jnp.pad(tokens, ((0, pad_rows - tokens.shape[0]), (0, 0)))
    return state, tokens, final


def decode_burst(
    params: Weights,
    state: EngineState,
    batch: Batch,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    num_steps: int,
    return_top_k: int = 0,
    return_logits: bool = False,
    attn_impl: str = "auto",
    matmul_impl: str = "auto",
) -> tuple[EngineState, Results]:
    """`num_steps` decode steps in one call; `batch` must be decode-only (no prefill rows) and its page tables must
    already cover positions up to `kv_lens + num_steps - 1`. Results are stacked `[num_steps, S, ...]`."""
    width = max(TOP_K_WIDTH, return_top_k)
    state, res = decode_burst_jit(params, state, batch, jnp.asarray(return_top_k > 0),
                                  statics=StepStatics(cfg, attn_impl, matmul_impl, width), shape=forward_shape(shape),
                                  num_steps=num_steps, return_logits=return_logits)
    k = return_top_k
    return state, res.replace(top_ids=res.top_ids[..., :k], top_logprobs=res.top_logprobs[..., :k])


__all__ = [
    "ATTN_IMPLS",
    "TOP_K_WIDTH",
    "StepStatics",
    "decode_burst",
    "catch_up_shape",
    "decode_burst_jit",
    "draft_burst_jit",
    "forward_inputs",
    "forward_points",
    "forward_shape",
    "fused_step_jit",
    "fuses_sampler",
    "lm_head",
    "page_bucket_index",
    "sample_inputs",
    "sampler_statics",
    "step",
    "step_forward",
    "step_sample",
]
