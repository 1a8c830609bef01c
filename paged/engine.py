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

from models.loader import DTYPES, Model
from paged.batch import RowInput, build_batch
from paged.buckets import BucketSpec, next_pow2
from paged.config import EngineConfig
from paged.engine_api import StepOutput
from paged.errors import InvalidConfigError
from paged.state import BatchShape, EngineState
from paged.step import decode_steps as multi_step
from paged.step import step

CACHE_DTYPES = {**DTYPES, "int8": jnp.int8}  # int8: per-token-per-head scales, dequantized inside attention
MIN_PAGE_SIZE = 8  # the attention kernels' smallest page tile


def enable_compilation_cache(path: str | os.PathLike) -> None:
    """Persist compiled steps under `path`, so a second start skips compilation."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class Engine:
    """Implements `paged.engine_api.EngineProtocol` with the jitted step."""

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
                                        CACHE_DTYPES[self.config.cache_dtype])
        self.spec = BucketSpec.from_config(self.config)
        # Where the wall time of `run` goes (seconds, cumulative): padding the rows into a batch on the host,
        # dispatching the jitted call (tracing on a new shape, then enqueueing), and waiting for the device result
        # (compute not hidden behind the dispatch, plus the device->host copy).
        self.timings = {"build_s": 0.0, "dispatch_s": 0.0, "wait_s": 0.0}

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def attn_impl(self) -> str:
        return self.config.attn_impl

    @property
    def matmul_impl(self) -> str:
        return self.config.matmul_impl

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
        return dataclasses.replace(shape, num_bias=next_pow2(bias)) if bias else shape

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
