"""`Engine`: the host-side owner of the device state. It pads a list of `RowInput`s to a bucket, runs the jitted
step, and returns host results. The scheduler and generator sit on top of it; it holds no job logic.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.loader import DTYPES, Model
from paged.device import step as step_module
from paged.device import verify as verify_module
from paged.device.batch import RowInput, build_batch
from paged.device.buckets import BucketSpec
from paged.device.config import EngineConfig
from paged.device.engine_api import StepOutput
from paged.device.sharding import make_mesh, shard_params, shard_state, to_host
from paged.device.state import Batch, BatchShape, EngineState, Results
from paged.device.step import (
    TOP_K_WIDTH,
    StepStatics,
    decode_burst_jit,
    draft_burst_jit,
    forward_inputs,
    forward_shape,
    fused_step_jit,
    fuses_sampler,
    lm_head,
    sample_inputs,
    sampler_statics,
    step_forward,
    step_sample,
)
from paged.device.verify import verify_sample, verify_step_jit
from paged.errors import InvalidConfigError
from pallas_kernels import native, native_attention, registry
from pallas_kernels.dequant_gemv import gpu_unsupported_reason as gemv_gpu_reason
from pallas_kernels.dequant_matmul import gpu_unsupported_reason as matmul_gpu_reason
from pallas_kernels.paged_attention import PrefillDecodeLayout
from pallas_kernels.paged_attention import gpu_unsupported_reason as attention_gpu_reason
from pallas_kernels.quant_format import QuantizedArray
from pallas_kernels.registry import Tuned, split_tuning, with_tuning

CACHE_DTYPES = {**DTYPES, "int8": jnp.int8}  # int8: per-token-per-head scales, dequantized inside attention
MIN_PAGE_SIZE = 8  # the attention kernels' smallest page tile


def check_kernels_fit(model: Model, config: EngineConfig) -> None:
    """On a GPU, `InvalidConfigError` when an explicitly chosen built-in Pallas kernel cannot run this model natively
    (its shape rules: `gpu_unsupported_reason` of each kernel). "auto" never fails here: it falls back to "xla"
    per shape. Off the GPU the kernels run interpreted, where every shape works. `matmul_impl="native"` and
    `attn_impl="native"` (the CPU kernels) fail here wherever they cannot run: on a GPU backend, or where they were not
    built."""
    mm, mm_tuning = split_tuning(config.matmul_impl)
    leaves = jax.tree.leaves(model.params, is_leaf=lambda a: isinstance(a, QuantizedArray))
    quantized = [a for a in leaves if isinstance(a, QuantizedArray)]
    if mm == "native" and quantized and (why := native.unavailable_reason()) is not None:
        raise InvalidConfigError(f"matmul_impl='native' cannot run here: {why}. Use matmul_impl='auto' (the native "
                                 "kernel on the CPU where it is built, the Pallas kernel on a GPU, XLA elsewhere)")
    attn, attn_tuning = split_tuning(config.attn_impl)
    if attn == "native" and (why := native_attention.unavailable_reason(model.config.head_dim)) is not None:
        raise InvalidConfigError(f"attn_impl='native' cannot run here: {why}. Use attn_impl='auto' (the native "
                                 "kernel on the CPU where it runs, the Pallas kernel on a GPU, XLA elsewhere)")
    if not registry.on_gpu():
        return
    attn_tuning = attn_tuning if attn_tuning is not None else config.attn_tuning
    if attn == "pallas":
        ppb = getattr(attn_tuning, "pages_per_block", None)
        reason = attention_gpu_reason(model.config.head_dim, config.page_size, ppb)
        if reason:
            raise InvalidConfigError(f"attn_impl='pallas' cannot run this model on the GPU: {reason}. Use "
                                     "attn_impl='auto' (falls back to 'xla' for such shapes) or 'xla'")
    mm_tuning = mm_tuning if mm_tuning is not None else config.matmul_tuning
    if mm in ("pallas", "pallas_gemv"):
        why_not = matmul_gpu_reason if mm == "pallas" else gemv_gpu_reason
        for qa in quantized:
            reason = why_not(qa, mm_tuning)
            if reason:
                raise InvalidConfigError(f"matmul_impl={mm!r} cannot run this model's {qa.shape[0]}x{qa.shape[1]} "
                                         f"{qa.kind} weights on the GPU: {reason}. Use matmul_impl='auto' (falls "
                                         "back to 'xla' per matrix) or 'xla'")


def _under_mesh(method):
    """Run an `Engine` method with its mesh in context (`jax.set_mesh`, thread-local), so that the step's sharding
    constraints see it; a plain call on one device."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.mesh is None:
            return method(self, *args, **kwargs)
        with jax.set_mesh(self.mesh):
            return method(self, *args, **kwargs)

    return wrapper


def enable_compilation_cache(path: str | os.PathLike) -> None:
    """Persist compiled steps under `path`, so a second start skips compilation."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class Engine:
    """Implements `paged.device.engine_api.EngineProtocol` with the jitted step."""

    def __init__(
        self,
        model: Model,
        config: EngineConfig | None = None,
        *,
        compilation_cache_dir: str | os.PathLike | None = None,
        **settings,
    ):
        """`config` (an `EngineConfig`), or its fields as keywords (`Engine(model, num_pages=64, page_size=16)`);
        model-dependent defaults are resolved against the model's config."""
        if config is None:
            config = EngineConfig.from_kwargs(**settings)
        elif settings:
            raise InvalidConfigError(f"pass either config= or engine settings, not both (got {sorted(settings)})")
        if config.page_size < MIN_PAGE_SIZE:
            raise InvalidConfigError(f"Engine: page_size must be a power of two >= {MIN_PAGE_SIZE}, got "
                                     f"{config.page_size}")
        self.model = model
        self.cfg = model.config
        self.config = config.resolve(model.config.max_position_embeddings)
        if compilation_cache_dir is not None:
            enable_compilation_cache(compilation_cache_dir)
        self.vocab_size = self.cfg.vocab_size
        self.state = EngineState.create(self.cfg, self.config.num_pages, self.config.page_size,
                                        CACHE_DTYPES[self.config.cache_dtype], self.config.max_embedding_tokens,
                                        self.config.max_loras, self.config.max_lora_rank)
        self.mesh = make_mesh(self.config.mesh, self.cfg)  # None: one device
        if self.mesh is not None:  # tensor parallel: weights and cache placed by their logical axes
            self.model = model = dataclasses.replace(model, params=shard_params(model.params, self.mesh, self.cfg))
            self.state = shard_state(self.state, self.mesh)
        self.embedding_rows = self.config.max_embedding_tokens  # rows of the injected-embedding table
        self.lora_slots = self.config.max_loras  # adapters the LoRA stack holds (`load_lora`)
        check_kernels_fit(model, self.config)
        self.spec = BucketSpec.from_config(self.config, head_dim=self.cfg.head_dim)
        self._head = lm_head(model.params)  # what the sampler reads: final norm and LM head
        # every jitted call's static arguments, in one hashable value
        self.statics = StepStatics(self.cfg, self.attn_impl, self.matmul_impl, TOP_K_WIDTH)
        self.sample_statics = sampler_statics(self.statics, self._head)  # the sampler programs' (shared more widely)
        # Where the wall time of `run` goes (seconds, cumulative): padding the rows into a batch on the host,
        # dispatching the jitted call (tracing on a new shape, then enqueueing), and waiting for the device result
        # (compute not hidden behind the dispatch, plus the device->host copy).
        self.timings = {"build_s": 0.0, "dispatch_s": 0.0, "wait_s": 0.0}
        # Its roles, fixed here (`EngineConfig.verification` / `.drafting`, `paged.device.config.Verification`):
        verify = self.config.verification  # (its verification buckets are in `spec` already)
        self.verify_probs = verify is not None and verify.draft_probs  # the drafts come with their distributions
        self.verify_match = verify is not None and verify.match  # sampled rows: sample-then-match acceptance
        # > 0: verification steps take their drafts from the device (a draft model's burst, `run(draft_tokens=)`)
        self.fed_rows = self.config.max_batch_size if verify is not None and verify.fed_drafts else 0
        drafting = self.config.drafting
        self.draft_len = 0 if drafting is None else drafting.num_draft_tokens  # > 0: `draft` proposes this many
        self.draft_rows = 0 if drafting is None else drafting.pad_rows  # the rows its drafts are padded to
        self._last_burst: tuple[Batch, BatchShape] | None = None  # the last proposal burst's batch (`draft_ahead`)
        self._no_move_arrays: dict[int, tuple] = {}  # by bucket rows: the `_no_move` window inputs

    @_under_mesh
    def load_embeddings(self, rows: Sequence[int], vectors: np.ndarray) -> None:
        """Write injected embeddings `vectors` [n, H] into rows `rows` of the table (`paged.embeddings`): a host-side
        scatter and one copy of the table, no compilation."""
        old = self.state.extra_embed
        table = np.array(old)
        table[np.asarray(rows, np.int64)] = vectors
        # placed as the old table was: an array given its sharding is "committed", and a jitted program compiled
        # for uncommitted arguments (one device, no mesh: what warmup() compiled) misses its cache on one
        self.state = self.state.replace(extra_embed=jax.device_put(table, old.sharding if old.committed else None))

    @_under_mesh
    def load_lora(self, slot: int, adapter: Any) -> None:
        """Write a `models.lora.LoraAdapter` into slot `slot` (0-based) of the LoRA stack (rows whose `lora_slot` is
        `slot + 1` then run through it), in place on the device (`models.lora.write_slot`: one small compiled
        update for every slot, outside the step's variants). `None` clears the slot."""
        from models.lora import slot_arrays, write_slot

        stack = self.state.lora
        if stack is None or not 0 <= slot < stack.slots:
            raise InvalidConfigError(f"Engine: no LoRA slot {slot} (max_loras={self.lora_slots})")
        if adapter is not None and adapter.rank > stack.rank:
            raise InvalidConfigError(f"LoRA adapter {adapter.source or '(in memory)'}: rank {adapter.rank} exceeds "
                                     f"the engine's max_lora_rank={stack.rank}; raise max_lora_rank")
        if adapter is None:
            a = {g: np.zeros((x.shape[0], *x.shape[2:]), np.float32) for g, x in stack.a.items()}
            b = {g: np.zeros((x.shape[0], *x.shape[2:]), np.float32) for g, x in stack.b.items()}
        else:
            arrays = slot_arrays(adapter, self.cfg, stack.rank)
            a, b = {g: ab[0] for g, ab in arrays.items()}, {g: ab[1] for g, ab in arrays.items()}
        self.state = self.state.replace(lora=write_slot(stack, np.int32(slot), a, b))

    # ------------------------------------------------------------------ speculative decoding
    def verify_plan(self, rows: Sequence[RowInput]) -> tuple[BatchShape, int, list[int]]:
        """(bucket, sampled row count S', batch row of each input row) of a verification step over `rows`, without
        building it: a draft model lays its proposals out in the same rows (`draft`)."""
        shape = self.verify_shape_for(rows)
        sampled = shape.sample_rows_for(len(rows))
        sp = 0 if shape.step_rows_in_windows else shape.layout.num_prefill_rows
        pre = sorted((i for i, r in enumerate(rows) if not r.is_step_row), key=lambda i: -len(rows[i].tokens))
        slots = [0] * len(rows)
        for j, i in enumerate(pre):
            slots[i] = j
        for j, i in enumerate(i for i, r in enumerate(rows) if r.is_step_row):
            slots[i] = sp + j
        return shape, sampled, slots

    def verify_shape_for(self, rows: Sequence[RowInput]) -> BatchShape:
        pages = max(-(-(r.start_pos + len(r.tokens)) // self.page_size) for r in rows)
        return self.spec.verify_shape_for([len(r.tokens) for r in rows if not r.is_step_row],
                                          sum(r.is_step_row for r in rows), pages)

    @_under_mesh
    def draft(self, rows: Sequence[RowInput], slots: Sequence[int], num_rows: int,
              catch_up: Sequence[int], *, host: bool = True) -> tuple[np.ndarray | None, jax.Array, jax.Array]:
        """Propose `draft_len` tokens for each of `rows` (1-token decode rows of this draft model's cache) in one
        jitted call (`paged.device.step.draft_burst_jit`): row i sits in batch row `slots[i]` of a decode bucket of
        `num_rows` rows (the target's verification rows, so that the distributions line up with them); where
        `catch_up[i] >= 0` the cache lacks that token, at position `rows[i].start_pos - 1`, and the burst's first
        forward feeds it before the row's token (`draft_burst_jit(window=)`). Returns the drafts (host, i32
        `[len(rows), draft_len]`; None unless `host`: then nothing waits for the burst, and the burst's time
        shows in the target's `timings["wait_s"]` instead of this engine's), their distributions
        (device, f32 log-probs `[num_rows, draft_len, V]`, by batch row), and the drafts on the device (i32
        `[max(num_rows, pad_rows), draft_len]` by batch row, `pad_rows` from `Drafting.pad_rows`, zero rows after
        `num_rows`: a fed target's `run(draft_tokens=)`)."""
        if not self.draft_len:
            raise InvalidConfigError("this engine does not draft: build it with EngineConfig(drafting=Drafting(k))")
        t0 = time.perf_counter()
        shape = self.spec.shape(PrefillDecodeLayout(0, 1, num_rows))
        batch, got_slots = build_batch(rows, shape, self.page_size, self.vocab_size, slots=slots)
        window = None
        if any(t >= 0 for t in catch_up):
            feed = np.full(shape.num_rows, -1, np.int32)
            feed[list(got_slots)] = list(catch_up)
            window = (feed, *self._no_move(shape))
        t1 = time.perf_counter()
        self.state, tokens, q = draft_burst_jit(self.model.params, self.state, batch, window, statics=self.statics,
                                                shape=forward_shape(shape), num_drafts=self.draft_len,
                                                pad_rows=self.draft_rows)
        self._last_burst = (batch, shape)
        t2 = time.perf_counter()
        got = np.asarray(to_host(tokens))[np.asarray(got_slots, np.int64)] if host else None
        self.timings["build_s"] += t1 - t0
        self.timings["dispatch_s"] += t2 - t1
        self.timings["wait_s"] += time.perf_counter() - t2
        return got, q, tokens

    @_under_mesh
    def draft_ahead(self, emitted: jax.Array, num_accepted: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Propose the next `draft_len` tokens for the rows of the last proposal burst (`draft`, or this after
        `advance_burst`), before their verification's results reach the host: `emitted` (i32 `[S', W]`) and
        `num_accepted` (i32 `[S']`) are that verification's results by batch row, on the device
        (`paged.device.step.draft_burst_jit(window=)`: each row continues after its accepted drafts and the target's
        token). Nothing waits. Returns the distributions and the drafts on the device, as `draft(host=False)`."""
        if self._last_burst is None:
            raise InvalidConfigError("draft_ahead() follows a proposal burst: call draft() first")
        t0 = time.perf_counter()
        batch, shape = self._last_burst
        window = (np.full(shape.num_rows, -1, np.int32), emitted, num_accepted)
        self.state, tokens, q = draft_burst_jit(
            self.model.params, self.state, batch, window, statics=self.statics, shape=forward_shape(shape),
            num_drafts=self.draft_len, pad_rows=self.draft_rows)
        self.timings["dispatch_s"] += time.perf_counter() - t0
        return q, tokens

    def _no_move(self, shape: BatchShape) -> tuple[jax.Array, jax.Array]:
        """(emitted, num_accepted) of a burst window that moves no row (`draft`'s catch-up tokens): device arrays,
        as a verification's results are in `draft_ahead`, so that both calls run the one compiled window."""
        if shape.num_rows not in self._no_move_arrays:
            self._no_move_arrays[shape.num_rows] = (jnp.zeros((shape.num_rows, self.draft_len + 1), jnp.int32),
                                                    jnp.full(shape.num_rows, -1, jnp.int32))
        return self._no_move_arrays[shape.num_rows]

    def advance_burst(self, slots: Sequence[int], positions: Sequence[int], tokens: Sequence[int]) -> None:
        """Move the last proposal burst's rows at batch rows `slots` to their next token: `tokens` at `positions`
        (what a burst dispatched ahead fed, learnt from the verification's results), so that a `draft_ahead` after
        it drafts for the rows' next step."""
        batch, shape = self._last_burst
        idx = np.asarray(slots, np.int64)
        tid, pos, kv, sp = (np.array(a) for a in (batch.token_ids, batch.positions, batch.kv_lens,
                                                    batch.sample_positions))
        tid[idx], pos[idx] = tokens, positions
        kv[idx] = sp[idx] = np.asarray(positions, np.int32) + 1
        self._last_burst = (batch.replace(token_ids=tid, positions=pos, kv_lens=kv, sample_positions=sp), shape)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def attn_impl(self) -> str | Tuned:
        """The attention implementation the step runs, with the config's tuning (a hashable static argument)."""
        return with_tuning(self.config.attn_impl, self.config.attn_tuning)

    @property
    def matmul_impl(self) -> str | Tuned:
        return with_tuning(self.config.matmul_impl, self.config.matmul_tuning)

    @property
    def num_pages(self) -> int:
        return self.state.num_pages

    def shape_for(self, rows: Sequence[RowInput]) -> BatchShape:
        pages = max(-(-(r.start_pos + len(r.tokens)) // self.page_size) for r in rows)
        hist = max((len(r.history) for r in rows), default=0)
        return self.spec.shape_for(
            [len(r.tokens) for r in rows if not r.is_decode], sum(r.is_decode for r in rows), pages, hist
        )

    def _forward(self, batch: Batch, shape: BatchShape,
                 draft_feed: tuple[jax.Array, np.ndarray] | None = None) -> tuple[jax.Array, ...]:
        """The jitted forward of `shape`'s bucket over `batch` (K/V written, `self.state` replaced: it is donated);
        returns the hidden states of each of `shape.sampled_row_counts` (`step_forward`; `draft_feed` its device
        drafts and their token slots)."""
        self.state, hs = step_forward(self.model.params, self.state, forward_inputs(batch), draft_feed,
                                      statics=self.statics, shape=forward_shape(shape))
        return hs

    def fused(self, shape: BatchShape) -> bool:
        """Whether a step of `shape`'s bucket runs forward and sampler as one program (`fuse_sampler`, a bucket that
        `paged.device.step.fuses_sampler`, and not a draft engine, whose rows never sample through `run`)."""
        return self.config.fuse_sampler and not self.draft_len and fuses_sampler(shape)

    def _dispatch(self, batch: Batch, shape: BatchShape, want_top_k: bool, num_steps: int) -> Results:
        """Run the jitted step (or `num_steps` decode steps) on `batch`; returns the device results of its sampled
        rows."""
        want = np.bool_(want_top_k)
        if num_steps == 1 and self.fused(shape):
            self.state, res = fused_step_jit(self.model.params, self.state, batch, want, statics=self.statics,
                                             shape=forward_shape(shape))
            return res
        if num_steps > 1:
            self.state, res = decode_burst_jit(self.model.params, self.state, batch, want, num_steps=num_steps,
                                               statics=self.statics, shape=forward_shape(shape))
            return res
        hs = self._forward(batch, shape)
        return self._sample(hs[shape.sampled_row_counts.index(batch.sample_positions.shape[0])], batch, want)

    def _sample(self, h: jax.Array, batch: Batch, want: np.bool_) -> Results:
        return step_sample(self._head, h, sample_inputs(batch), want, statics=self.sample_statics)

    @_under_mesh
    def run(
        self, rows: Sequence[RowInput], *, return_top_k: int = 0, return_logits: bool = False, num_steps: int = 1,
        draft_logprobs: jax.Array | None = None, draft_tokens: jax.Array | None = None,
        after_dispatch: Callable[[Results], None] | None = None,
    ) -> StepOutput:
        """One step (or `num_steps` decode steps, results `[num_steps, n]`) over `rows`.

        Nothing here compiles once `warmup()` has run: top-k, logits and every sampler setting are runtime values of
        the same variants. `return_top_k` up to `TOP_K_WIDTH` comes from the device's top tokens; wider, from the
        final distribution on the host. Only what is asked for is copied to the host. A burst that asks for logits
        or more than `TOP_K_WIDTH` top tokens runs as single steps (the generator never asks for logits in one).

        Rows with `verify` make it a verification step (`EngineConfig.verification`; results per position, see
        `StepOutput`); `draft_logprobs` (device f32 `[S', k, V]` by batch row, from the draft engine's `draft()`
        laid out by `verify_plan`) is then required if the engine verifies a draft model's proposals, and
        `draft_tokens` (device i32 `[fed_rows, k]` by batch row, `draft(pad_rows=fed_rows)`) if it takes its drafts
        from the device (`Verification.fed_drafts`; the verification rows' draft tokens are then placeholders).
        `after_dispatch` (a verification step only) is called with the step's device results, by batch row, once the
        step is dispatched and before anything waits for it (a draft model's next burst:
        `paged.speculation.draft.DraftModel`)."""
        if any(r.verify for r in rows):
            if num_steps != 1:
                raise ValueError("a verification step is a single step (num_steps=1)")
            return self._run_verify(rows, return_top_k, return_logits, draft_logprobs, draft_tokens, after_dispatch)
        k = min(return_top_k, self.vocab_size)
        wide = k > TOP_K_WIDTH
        if num_steps > 1 and (return_logits or wide):
            return self._run_single_steps(rows, return_top_k, return_logits, num_steps)
        t_build = time.perf_counter()
        shape = self.shape_for(rows)
        sampled = shape.sample_rows_for(len(rows)) if num_steps == 1 else shape.num_rows
        batch, slots = build_batch(rows, shape, self.page_size, self.vocab_size, sample_rows=sampled)
        t0 = time.perf_counter()
        res = self._dispatch(batch, shape, 0 < k <= TOP_K_WIDTH, num_steps)
        t_dispatched = time.perf_counter()
        idx = np.asarray(slots)
        pick = (lambda a: a[idx]) if num_steps == 1 else (lambda a: a[:, idx])  # results are [S] or [n, S]
        got = _to_host(res, k, return_logits, wide)  # the one host sync of the step: only what was asked for
        t_done = time.perf_counter()
        dt = t_done - t0
        self.timings["build_s"] += t0 - t_build
        self.timings["dispatch_s"] += t_dispatched - t0
        self.timings["wait_s"] += t_done - t_dispatched
        token = pick(got["token"])
        if wide:
            top_ids, top_logprobs = host_top_k(pick(got["final"]), k)
        elif k:
            top_ids, top_logprobs = pick(got["top_ids"])[..., :k], pick(got["top_logprobs"])[..., :k]
        else:
            top_ids, top_logprobs = np.zeros((*token.shape, 0), np.int32), np.zeros((*token.shape, 0), np.float32)
        return StepOutput(
            token=token, logprob=pick(got["logprob"]), top_ids=top_ids, top_logprobs=top_logprobs,
            logits=pick(got["logits"]) if return_logits else None, shape=shape, seconds=dt,
        )

    @_under_mesh
    def run_forward(self, rows: Sequence[RowInput]) -> None:
        """The forward of a step over `rows` (their K/V written into the cache) without the sampler and without
        waiting for the device: a draft model's mirror of the target's rows, whose samples nobody reads
        (`paged.speculation.draft.DraftModel`). Same compiled variants as `run`."""
        t_build = time.perf_counter()
        shape = self.shape_for(rows)
        batch, _ = build_batch(rows, shape, self.page_size, self.vocab_size,
                               sample_rows=shape.sample_rows_for(len(rows)))
        t0 = time.perf_counter()
        self._forward(batch, shape)
        self.timings["build_s"] += t0 - t_build
        self.timings["dispatch_s"] += time.perf_counter() - t0

    def _verify(self, batch: Batch, shape: BatchShape, sampled: int, feed: tuple[jax.Array, np.ndarray] | None,
                want: np.bool_, q: jax.Array | None) -> Results:
        """The device work of a verification step over `batch` (`sampled` rows; `feed` the device drafts and their
        token slots, `q` the draft's distributions or None): forward and verification sampler, in one program
        where the bucket is `fused`."""
        verify = _verify_inputs(batch, feed)
        if self.fused(shape):
            self.state, res = verify_step_jit(self.model.params, self.state, batch, feed, verify, want, q,
                                              statics=self.statics, shape=forward_shape(shape),
                                              match=self.verify_match)
            return res
        h = self._forward(batch, shape, feed)[shape.sampled_row_counts.index(sampled)]
        return verify_sample(self._head, h, sample_inputs(batch), verify, want, q, statics=self.sample_statics,
                             match=self.verify_match)

    def _run_verify(self, rows: Sequence[RowInput], return_top_k: int, return_logits: bool,
                    draft_logprobs: jax.Array | None, draft_tokens: jax.Array | None = None,
                    after_dispatch: Callable[[Results], None] | None = None) -> StepOutput:
        if not self.spec.verify_len:
            raise InvalidConfigError("verification rows need an engine built with EngineConfig(verification=...)")
        if self.verify_probs and draft_logprobs is None:
            raise ValueError("this engine verifies a draft model's proposals: pass draft_logprobs=")
        if bool(self.fed_rows) != (draft_tokens is not None):
            raise ValueError("this engine takes its drafts from the device: pass draft_tokens=" if self.fed_rows else
                             "draft_tokens= needs an engine built with Verification(fed_drafts=True)")
        k = min(return_top_k, self.vocab_size)
        wide = k > TOP_K_WIDTH
        t_build = time.perf_counter()
        shape, sampled, _ = self.verify_plan(rows)
        batch, slots = build_batch(rows, shape, self.page_size, self.vocab_size, sample_rows=sampled)
        feed = None if draft_tokens is None else (draft_tokens, _feed_index(batch, self.fed_rows))
        t0 = time.perf_counter()
        res = self._verify(batch, shape, sampled, feed, np.bool_(0 < k <= TOP_K_WIDTH),
                           draft_logprobs if self.verify_probs else None)
        t_dispatched = time.perf_counter()
        if after_dispatch is not None:
            after_dispatch(res)
        idx = np.asarray(slots)
        got = _to_host(res, k, return_logits, wide, num_accepted=res.num_accepted)
        t_done = time.perf_counter()
        self.timings["build_s"] += t0 - t_build
        self.timings["dispatch_s"] += t_dispatched - t0
        self.timings["wait_s"] += t_done - t_dispatched
        token = got["token"][idx]
        if wide:
            top_ids, top_logprobs = host_top_k(got["final"][idx], k)
        elif k:
            top_ids, top_logprobs = got["top_ids"][idx][..., :k], got["top_logprobs"][idx][..., :k]
        else:
            top_ids, top_logprobs = np.zeros((*token.shape, 0), np.int32), np.zeros((*token.shape, 0), np.float32)
        return StepOutput(token=token, logprob=got["logprob"][idx], top_ids=top_ids, top_logprobs=top_logprobs,
                          logits=got["logits"][idx] if return_logits else None, shape=shape,
                          seconds=t_done - t0, num_accepted=got["num_accepted"][idx])

    def _run_single_steps(self, rows: Sequence[RowInput], return_top_k: int, return_logits: bool,
                          num_steps: int) -> StepOutput:
        """`num_steps` decode steps as single steps, each sampled token fed back on the host as the burst's scan
        does on the device (history slides by one within `history_len`); results stacked `[num_steps, n]`."""
        r_max = self.spec.history_len
        outs = []
        for _ in range(num_steps):
            out = self.run(rows, return_top_k=return_top_k, return_logits=return_logits)
            outs.append(out)
            rows = [dataclasses.replace(
                r, tokens=[int(t)], start_pos=r.start_pos + len(r.tokens),
                history=(list(r.history) + [int(t)])[-r_max:] if r_max and len(r.history) else r.history,
            ) for r, t in zip(rows, out.token)]
        stack = lambda name: np.stack([getattr(o, name) for o in outs])  # noqa: E731
        return StepOutput(token=stack("token"), logprob=stack("logprob"), top_ids=stack("top_ids"),
                          top_logprobs=stack("top_logprobs"), logits=stack("logits") if return_logits else None,
                          shape=outs[0].shape, seconds=sum(o.seconds for o in outs))

    def variants(self, decode_steps: int = 1) -> list[tuple[str, BatchShape, int]]:
        """Every compiled variant `run` can use with this configuration, as (entry point, bucket, n): the forward
        ("step") of each bucket that runs it alone, and the sampler ("sample") of each row count n such a bucket
        samples (with the first bucket that samples n rows); forward and sampler in one program ("fused", n = 1) of
        each bucket that fuses them (`fused`: the decode-only ones); with `decode_steps` > 1 the burst
        ("decode_burst", n = steps) of each decode-only bucket. With speculation: the verification sampler
        ("verify") of each row count of the verification buckets that run it alone, forward and verification
        sampler in one program ("fused_verify") of the decode-only verification buckets, and on a draft engine the
        proposal bursts ("draft_burst", n = 1 with a window for catch-up tokens and rows moved on from a
        verification on the device, 0 without) of each decode-only bucket, and no plain sampler (its rows run
        through `run_forward` and `draft`)."""
        shapes = self.spec.all_shapes()
        out = [(("fused_verify" if s.verify_len else "fused") if self.fused(s) else "step", s, 1) for s in shapes]
        seen: dict[str, set[int]] = {"sample": set(), "verify": set()}
        for s in shapes:
            if self.fused(s):  # its sampler is inside its program
                continue
            kind = "verify" if s.verify_len else "sample"
            if kind == "sample" and self.draft_len:  # a draft engine never samples through `run` (see warmup)
                continue
            for n in s.sampled_row_counts:
                if n not in seen[kind]:
                    seen[kind].add(n)
                    out.append((kind, s, n))
        plain_decode = [s for s in shapes if not s.layout.num_prefill_rows and not s.verify_len]
        if decode_steps > 1:
            out += [("decode_burst", s, decode_steps) for s in plain_decode]
        if self.draft_len:
            out += [("draft_burst", s, n) for s in plain_decode for n in (1, 0)]
        return out

    @_under_mesh
    def warmup(self, shapes: Sequence[BatchShape] | None = None, progress: bool = False, decode_steps: int = 1) -> int:
        """Compile every variant `run` can hit (`variants`; default: for the buckets of `spec.all_shapes()`): the
        forward of each bucket and the sampler of each row count (one program per decode-only bucket where they are
        `fused`), with `decode_steps` > 1 the burst of each
        decode-only bucket, with speculation the verification sampler of each row count and a draft engine's
        proposal burst of each decode-only bucket. Returns the number of step variants (buckets, plus bursts); the
        samplers come with them.

        Warm-up batches are all padding, so they only write the null page and leave the cache untouched."""
        shapes = list(self.spec.all_shapes() if shapes is None else shapes)
        work = [(shape, 1, "step") for shape in shapes]
        plain_decode = [s for s in shapes if not s.layout.num_prefill_rows and not s.verify_len]
        if decode_steps > 1:
            work += [(shape, decode_steps, "burst") for shape in plain_decode]
        if self.draft_len:  # the proposal bursts: with a window (catch-up tokens, bursts dispatched ahead) and without
            work += [(shape, self.draft_len, kind) for shape in plain_decode for kind in ("draft", "draft_no_catch_up")]
        it = work
        if progress:
            from tqdm import tqdm

            it = tqdm(work, desc="compiling step buckets", unit="shape")
        no = np.bool_(False)

        def warm_q(rows: int, shape: BatchShape) -> jax.Array | None:  # a draft's distributions, as `draft` gives
            return (jnp.zeros((rows, shape.verify_len - 1, self.vocab_size), jnp.float32) if self.verify_probs
                    else None)

        sampled: dict[bool, set[tuple]] = {False: set(), True: set()}
        outs = []
        # Nothing waits for the warm-up steps to finish (async dispatch): they run while the next variant traces
        # and compiles.
        for shape, n, kind in it:
            batch, _ = build_batch([], shape, self.page_size, self.vocab_size)
            if kind == "burst":
                outs.append(self._dispatch(batch, shape, False, n).token)
                continue
            if kind.startswith("draft"):
                window = (np.full(shape.num_rows, -1, np.int32), *self._no_move(shape)) if kind == "draft" else None
                self.state, tokens, _ = draft_burst_jit(
                    self.model.params, self.state, batch, window, statics=self.statics, shape=forward_shape(shape),
                    num_drafts=n, pad_rows=self.draft_rows)
                outs.append(tokens)
                continue
            verify = bool(shape.verify_len)
            fed = None
            if verify and self.fed_rows:
                fed = jnp.zeros((self.fed_rows, shape.verify_len - 1), jnp.int32)  # on the device, as `draft`'s
                fed = (fed, _feed_index(batch, self.fed_rows))
            if self.fused(shape):  # forward and sampler in one program, as `run` calls it
                res = (self._verify(batch, shape, shape.num_rows, fed, no, warm_q(shape.num_rows, shape)) if verify
                       else self._dispatch(batch, shape, False, 1))
                outs.append(res.token)
                continue
            hs = self._forward(batch, shape, fed)
            if not verify and self.draft_len:  # a draft engine's rows: `run_forward` (mirror) and `draft` (its burst
                continue  # has its own sampler), never `run`: no plain sampler (~6 s of compile each on the CPU)
            for h, rows in zip(hs, shape.sampled_row_counts, strict=True):  # the sampler of every row count
                key = (rows, h.sharding)  # (under a dp mesh the hidden states' placement depends on the bucket)
                if key in sampled[verify]:
                    continue
                sampled[verify].add(key)
                small, _ = build_batch([], shape, self.page_size, self.vocab_size, sample_rows=rows)
                if not verify:
                    outs.append(self._sample(h, small, no).token)
                    continue
                outs.append(verify_sample(self._head, h, sample_inputs(small), _verify_inputs(small, fed), no,
                                          warm_q(rows, shape), statics=self.sample_statics,
                                          match=self.verify_match).token)
        jax.block_until_ready((outs, self.state))
        return len(work)


def _feed_index(batch: Batch, rows: int) -> np.ndarray:
    """i32 `[rows, k]`: the token slot of draft j of each verification row of `batch` (`sample_tokens[s, 1 + j]`),
    one past the last slot (written nowhere) where the row has no draft j; the rows after the batch's sampled ones
    likewise (`step_forward(draft_feed=)`)."""
    num = np.asarray(batch.num_drafts)
    s, k = num.shape[0], np.asarray(batch.drafts).shape[1]
    if s > rows:
        raise ValueError(f"a verification step of {s} sampled rows, more than the {rows} rows of its device drafts")
    t = np.asarray(batch.token_ids).shape[0]
    out = np.full((rows, k), t, np.int32)
    slots = np.asarray(batch.sample_tokens)[:s, 1 : k + 1]
    out[:s] = np.where(np.arange(k)[None, :] < num[:, None], slots, t)
    return out


def _to_host(res, k: int, return_logits: bool, wide: bool, **extra) -> dict:
    """Copy to the host only what the caller asked for: tokens and log-probs (plus `extra` arrays), the device's top
    tokens when 0 < k <= TOP_K_WIDTH, the logits, and the final distribution for wider top-k requests."""
    want = {"token": res.token, "logprob": res.logprob, **extra}
    if 0 < k <= TOP_K_WIDTH:
        want.update(top_ids=res.top_ids, top_logprobs=res.top_logprobs)
    if return_logits:
        want["logits"] = res.logits
    if wide:
        want["final"] = res.final
    return to_host(want)


def _verify_inputs(batch: Batch, feed: tuple[jax.Array, np.ndarray] | None = None) -> dict:
    """The verification inputs of a batch: the drafts of each row and how many there are; with `feed` (drafts
    still on the device and their token slots) the drafts are those (the verification sampler reads their first
    S' rows)."""
    return dict(drafts=batch.drafts if feed is None else feed[0], num_drafts=batch.num_drafts)


def host_top_k(final: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids i32, values f32) `[..., k]`: the k largest entries of `final` `[..., V]`, descending, ties broken by the
    lower id: what `lax.top_k` gives, for requests wider than the device computes."""
    flat = final.reshape(-1, final.shape[-1])
    ids = np.empty((flat.shape[0], k), np.int32)
    for i, row in enumerate(flat):
        neg = -row
        kth = np.partition(neg, k - 1)[k - 1]
        cand = np.flatnonzero(neg <= kth)  # ascending ids: every entry >= the k-th largest, ties included
        ids[i] = cand[np.argsort(neg[cand], kind="stable")[:k]]
    ids = ids.reshape(*final.shape[:-1], k)
    return ids, np.take_along_axis(final, ids, axis=-1)


def count_compiles() -> dict[str, int]:
    """Compiled variants held by each jitted entry point: "step" the forward (one per layout that runs it alone),
    "sample" the sampler (one per row count), "fused" forward and sampler in one program (one per decode layout,
    `fused_step_jit`), "decode_burst" the multi-step bursts, "draft_burst" a draft model's proposals (two per
    decode layout: with a two-slot window for catch-up tokens and rows moved on from a verification on the device,
    and without), "verify" the speculative verification sampler (one per row
    count), "fused_verify" forward and verification sampler in one program (one per decode-only verification
    layout, `paged.device.verify.verify_step_jit`)."""
    s, v = step_module, verify_module  # (their homes: tests patch this module's names)
    entry = {"step": s.step_forward, "sample": s.step_sample, "fused": s.fused_step_jit,
             "decode_burst": s.decode_burst_jit, "draft_burst": s.draft_burst_jit, "verify": v.verify_sample,
             "fused_verify": v.verify_step_jit}
    return {name: fn._cache_size() for name, fn in entry.items()}
