"""Shape buckets: the finite set of `BatchShape`s a generator pads its batches to, so the step compiles a known,
small number of times. `BucketSpec.all_shapes()` lists them for `warmup()`; `BucketSpec.shape_for()` picks the
smallest bucket that fits a batch.
"""

from __future__ import annotations

import dataclasses
import itertools

from paged.config import EngineConfig
from paged.state import BatchShape
from pallas_kernels.paged_attention import PrefillDecodeLayout


def _geometric(lo: int, hi: int, factor: int) -> tuple[int, ...]:
    """lo, lo*factor, ... and finally hi itself (hi is always included)."""
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= factor
    out.append(hi)
    return tuple(sorted(set(out)))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0): the bucket of a count that is padded up."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    max_batch_size: int  # rows per step (decode rows + prefill rows)
    max_chunk_size: int  # prefill tokens per row per step
    max_pages_per_row: int  # ceil(max_seq_len / page_size)
    max_prefill_rows: int = 2  # prefill chunks per step
    page_size: int = 64
    # ratio between consecutive prefill chunk buckets (larger: fewer compiles, more padding). A prefill step's
    # matmuls run over every padded token, so 4 cost ~1.6x the real work on mixed prompt lengths; 2 ~1.3x.
    growth: int = 2
    # ratio between consecutive context (pages per row) buckets. Decode attention reads every page of the bucket,
    # so padding here costs bandwidth on every step; 2 wastes at most half (a quarter on average) for one extra
    # bucket or so over 4 (measured: docs/performance.md).
    page_growth: int = 2
    min_q_len: int = 16
    min_context: int = 256  # smallest per-row context bucket, in tokens
    history_buckets: tuple[int, ...] = (0, 1024)  # penalty-history lengths (0: no row uses penalties)

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_chunk_size < 1 or self.max_pages_per_row < 1:
            raise ValueError(f"BucketSpec needs positive sizes, got {self}")

    @classmethod
    def from_config(cls, config: EngineConfig) -> BucketSpec:
        """The buckets of a resolved `EngineConfig`."""
        return cls(
            max_batch_size=config.max_batch_size, max_chunk_size=config.max_chunk_size,
            max_pages_per_row=config.max_pages_per_row, max_prefill_rows=config.max_prefill_rows,
            page_size=config.page_size,
            history_buckets=(0, config.max_penalty_range) if config.max_penalty_range > 0 else (0,),
        )

    @property
    def decode_rows(self) -> tuple[int, ...]:
        return (0, *_geometric(1, self.max_batch_size, 2))

    @property
    def prefill_rows(self) -> tuple[int, ...]:
        return (0, *_geometric(1, self.max_prefill_rows, 2))

    @property
    def q_lens(self) -> tuple[int, ...]:
        return _geometric(min(self.min_q_len, self.max_chunk_size), self.max_chunk_size, self.growth)

    @property
    def pages(self) -> tuple[int, ...]:
        lo = min(max(1, self.min_context // self.page_size), self.max_pages_per_row)
        return _geometric(lo, self.max_pages_per_row, self.page_growth)

    def layouts(self) -> list[PrefillDecodeLayout]:
        out = []
        for sp, sd in itertools.product(self.prefill_rows, self.decode_rows):
            if sp + sd == 0:
                continue
            for qm in self.q_lens if sp else (1,):
                out.append(PrefillDecodeLayout(sp, qm, sd))
        return out

    def all_shapes(self, history_lens: tuple[int, ...] | None = None) -> list[BatchShape]:
        hist = self.history_buckets if history_lens is None else history_lens
        return [
            BatchShape(layout=lay, pages_per_row=p, history_len=r)
            for lay in self.layouts()
            for p in self.pages
            for r in hist
        ]

    def shape_for(self, prefill_lens: list[int], num_decode: int, max_pages: int, history: int) -> BatchShape:
        """Smallest bucket for `len(prefill_lens)` prefill rows of those lengths, `num_decode` single-token rows,
        rows needing up to `max_pages` pages, and `history` tokens of penalty history."""
        sp_need = len(prefill_lens)
        if sp_need > self.max_prefill_rows:
            raise ValueError(f"{sp_need} prefill rows exceed max_prefill_rows={self.max_prefill_rows}")
        sp = next(x for x in self.prefill_rows if x >= sp_need)
        sd = next((x for x in self.decode_rows if x >= num_decode), None)
        if sd is None or sp_need + num_decode > self.max_batch_size:
            raise ValueError(f"{sp_need} + {num_decode} rows exceed max_batch_size={self.max_batch_size}")
        qm = 1
        if sp:
            need = max(prefill_lens)
            qm = next((x for x in self.q_lens if x >= need), None)
            if qm is None:
                raise ValueError(f"prefill chunk of {need} tokens exceeds max_chunk_size={self.max_chunk_size}")
        p = next((x for x in self.pages if x >= max_pages), None)
        if p is None:
            raise ValueError(f"{max_pages} pages per row exceed max_pages_per_row={self.max_pages_per_row}")
        r = next((x for x in self.history_buckets if x >= history), self.history_buckets[-1])
        return BatchShape(layout=PrefillDecodeLayout(sp, qm, sd), pages_per_row=p, history_len=r)
