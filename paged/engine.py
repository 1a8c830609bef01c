"""`Engine`: the host-side owner of the device state. It pads a list of `RowInput`s to a bucket, runs the jitted
step, and returns host results. The scheduler and generator sit on top of it; it holds no job logic.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.linear import MATMUL_IMPLS
from models.loader import DTYPES, Model
from paged.batch import RowInput, build_batch
from paged.buckets import BucketSpec
from paged.state import BatchShape, EngineState
from paged.step import ATTN_IMPLS, step
from paged.step import decode_steps as multi_step

CACHE_DTYPES = {**DTYPES, "int8": jnp.int8}  # int8: per-token-per-head scales, dequantized inside attention


def enable_compilation_cache(path: str | os.PathLike) -> None:
    """Persist compiled steps under `path`, so a second start skips compilation."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass
class StepOutput:
    """Host copy of one step's results, indexed by input row (not by batch slot)."""

    token: np.ndarray  # [n] int32
    logprob: np.ndarray  # [n] float32
    top_ids: np.ndarray  # [n, K]
    top_logprobs: np.ndarray  # [n, K]
    logits: np.ndarray | None  # [n, V]
    shape: BatchShape
    seconds: float


class Engine:
    def __init__(
        self,
        model: Model,
        *,
        num_pages: int = 512,
        page_size: int = 64,
        max_batch_size: int = 16,
        max_chunk_size: int = 256,
        max_seq_len: int = 2048,
        max_prefill_rows: int = 2,
        max_penalty_range: int = 1024,
        cache_dtype: str = "float32",
        attn_impl: str = "auto",
        matmul_impl: str = "auto",
        compilation_cache_dir: str | os.PathLike | None = None,
    ):
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl {attn_impl!r} is not one of {ATTN_IMPLS}")
        if matmul_impl not in MATMUL_IMPLS:
            raise ValueError(f"matmul_impl {matmul_impl!r} is not one of {MATMUL_IMPLS}")
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype {cache_dtype!r} is not one of {tuple(CACHE_DTYPES)}")
        if max_seq_len < 1 or max_chunk_size < 1 or max_batch_size < 1:
            raise ValueError("max_seq_len, max_chunk_size and max_batch_size must be positive")
        if compilation_cache_dir is not None:
            enable_compilation_cache(compilation_cache_dir)
        self.model = model
        self.cfg = model.config
        self.page_size = page_size
        self.vocab_size = self.cfg.vocab_size
        self.max_seq_len = max_seq_len
        self.attn_impl = attn_impl
        self.matmul_impl = matmul_impl
        self.state = EngineState.create(self.cfg, num_pages, page_size, CACHE_DTYPES[cache_dtype])
        self.spec = BucketSpec(
            max_batch_size=max_batch_size, max_chunk_size=max_chunk_size,
            max_pages_per_row=-(-max_seq_len // page_size), max_prefill_rows=max_prefill_rows, page_size=page_size,
            history_buckets=(0, max_penalty_range) if max_penalty_range > 0 else (0,),
        )
        self.steps = 0
        self.tokens_processed = 0
        # Where the wall time of `run` goes (seconds, cumulative): padding the rows into a batch on the host,
        # dispatching the jitted call (tracing on a new shape, then enqueueing), and waiting for the device result
        # (compute not hidden behind the dispatch, plus the device->host copy).
        self.timings = {"build_s": 0.0, "dispatch_s": 0.0, "wait_s": 0.0}

    @property
    def num_pages(self) -> int:
        return self.state.num_pages

    def shape_for(self, rows: Sequence[RowInput]) -> BatchShape:
        pages = max(-(-(r.start_pos + len(r.tokens)) // self.page_size) for r in rows)
        hist = max((len(r.history) for r in rows), default=0)
        shape = self.spec.shape_for(
            [len(r.tokens) for r in rows if not r.is_decode], sum(r.is_decode for r in rows), pages, hist
        )
        bias = max((len(r.bias) for r in rows if r.bias), default=0)
        return dataclasses.replace(shape, num_bias=1 << (bias - 1).bit_length()) if bias else shape

    def run(
        self, rows: Sequence[RowInput], *, return_top_k: int = 0, return_logits: bool = False, num_steps: int = 1
    ) -> StepOutput:
        """One step (or `num_steps` decode steps, results `[num_steps, n]`) over `rows`."""
        t_build = time.perf_counter()
        shape = self.shape_for(rows)
        if num_steps > 1:
            last = max(r.start_pos + num_steps for r in rows)
            shape = dataclasses.replace(shape, pages_per_row=max(
                shape.pages_per_row, self.spec.shape_for([], len(rows), -(-last // self.page_size), 0).pages_per_row))
        batch, slots = build_batch(rows, shape, self.page_size)
        t0 = time.perf_counter()
        kw = dict(cfg=self.cfg, shape=shape, return_top_k=return_top_k, return_logits=return_logits,
                  attn_impl=self.attn_impl, matmul_impl=self.matmul_impl)
        if num_steps > 1:
            self.state, res = multi_step(self.model.params, self.state, batch, num_steps=num_steps, **kw)
        else:
            self.state, res = step(self.model.params, self.state, batch, **kw)
        t_dispatched = time.perf_counter()
        res = jax.device_get(res)  # the one host sync of the step
        t_done = time.perf_counter()
        dt = t_done - t0
        self.timings["build_s"] += t0 - t_build
        self.timings["dispatch_s"] += t_dispatched - t0
        self.timings["wait_s"] += t_done - t_dispatched
        self.steps += num_steps
        self.tokens_processed += sum(len(r.tokens) for r in rows) if num_steps == 1 else num_steps * len(rows)
        idx = np.asarray(slots)
        pick = (lambda a: a[idx]) if num_steps == 1 else (lambda a: a[:, idx])  # results are [S] or [n, S]
        return StepOutput(
            token=pick(res.token), logprob=pick(res.logprob), top_ids=pick(res.top_ids),
            top_logprobs=pick(res.top_logprobs), logits=None if res.logits is None else pick(res.logits),
            shape=shape, seconds=dt,
        )

    def warmup(self, shapes: Sequence[BatchShape] | None = None, progress: bool = False, decode_steps: int = 1) -> int:
        """Compile the step for every bucket (default: all of `spec.all_shapes()`), and with `decode_steps` > 1
        also `decode_steps` for every decode-only bucket; returns how many variants were compiled.

        Warm-up batches are all padding, so they only write the null page and leave the cache untouched."""
        shapes = list(self.spec.all_shapes() if shapes is None else shapes)
        work = [(shape, 1) for shape in shapes]
        if decode_steps > 1:
            work += [(shape, decode_steps) for shape in shapes if not shape.layout.num_prefill_rows]
        it = work
        if progress:
            from tqdm import tqdm

            it = tqdm(work, desc="compiling step buckets", unit="shape")
        for shape, n in it:
            batch, _ = build_batch([], shape, self.page_size)
            # the same static arguments, passed the same way, as `run`: jit keys its cache on how they are passed
            kw = dict(cfg=self.cfg, shape=shape, return_top_k=0, return_logits=False, attn_impl=self.attn_impl,
                      matmul_impl=self.matmul_impl)
            if n > 1:
                self.state, res = multi_step(self.model.params, self.state, batch, num_steps=n, **kw)
            else:
                self.state, res = step(self.model.params, self.state, batch, **kw)
            jax.block_until_ready(res.token)
        return len(work)
