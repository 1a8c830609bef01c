"""Shape buckets: the finite set of `BatchShape`s a generator pads its batches to, so the step compiles a known,
small number of times. `BucketSpec.all_shapes()` lists them for `warmup()`; `BucketSpec.shape_for()` picks the
smallest bucket that fits a batch.

What is a bucket, and why (SmolLM2-135M on the 2-core CPU; docs/performance.md, "Compilation"):

- A bucket is a token layout. The step's forward compiles once per layout (~2 s: 30 layers under `lax.scan`, plus
  one attention branch per context bucket), its sampler once per sampled row count (~2 s: ~150 small kernels).
  Nothing else is a compile-time shape:
  - context length: the page table is always `max_pages_per_row` wide; attention reads the smallest of the
    context buckets `pages` (x`page_growth` from `min_context`) holding the longest row, chosen at run time inside
    the one compiled variant. Decode attention reads every page of its bucket on every step, so the buckets stay
    x2 apart; each adds only an attention branch (~0.3 s) to a variant instead of a variant (~4 s);
  - penalty history (always `history_len` = max_penalty_range wide), logit bias (`BIAS_WIDTH` sparse entries per
    row, plus a dense fallback), top-k and logits returns: runtime values (`paged.device.step`).
- Decode-only layouts: `decode_rows` 1, 2, 4, ... max_batch_size rows, one token slot each. A decode step's
  matmuls and sampler run over every padded row, so the rows stay within 2x of the real count.
- Prefill layouts: `p` prefill windows of `q` tokens for every `p` in 1 .. max_prefill_rows, `q` in `windows`:
  x`growth` from `min_q_len` to max_chunk_size (a prefill step is compute-bound on the CPU, ~3 ms per padded
  token, so windows stay within 2x of the chunk), plus max_chunk_size + max_batch_size - 1 for a full chunk with
  decode rows. The step's decode rows (up to max_batch_size - p) ride in the last window's padding right after its
  chunk, at token slots given at run time: no extra slots, so the decode row count is no bucket dimension (a
  bucket of dedicated decode slots would cost one compute-bound token per padded slot). Such a step samples the
  smallest of the decode row counts holding its rows (`BatchShape.sample_rows`): no sampler variant of its own.

Default engine (max_batch_size 16, max_chunk_size 256, max_prefill_rows 1): 5 decode + 6 prefill layouts = 11
forward variants and 5 sampler variants (1, 2, 4, 8, 16 rows); `decode_steps > 1` adds one burst variant per
decode layout. The previous scheme (every layout x context x history bucket, static bias width, top-k and logits
switches) had 280 variants for the same engine, and compiled more while serving.

Speculative verification (`verify_len` W = k + 1 > 0, from `EngineConfig.verification`) adds one verification
bucket per plain one (`verify_shapes`): decode-only layouts of n windows of W slots (n = 1, 2, 4, ... as the decode
layouts), and the prefill layouts with their step rows at a stride of W in the last window (the full-chunk window
grows to max_chunk_size + (max_batch_size - 1) * W). Their sampler runs over n * W sample points, one variant per
row count n (`paged.device.verify.verify_sample`). With W = 0 nothing changes: the same buckets as without
speculation.
"""
from __future__ import annotations

import dataclasses
import functools

from paged.device.config import EngineConfig
from paged.device.state import BatchShape
from paged.device.step import resolved_attn_impl
from pallas_kernels.paged_attention import PrefillDecodeLayout

# Sparse logit-bias entries per row. Rows with more (token healing's allowed set, long ban lists) use the dense
# [S, V] bias instead, built and copied only on the steps that have such a row.
BIAS_WIDTH = 256


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
    # so padding here costs bandwidth on every step; 2 wastes at most half (a quarter on average). These are
    # branches inside one compiled variant (`page_switch`), so finer buckets cost little compile time.
    page_growth: int = 2
    min_q_len: int = 16
    min_context: int = 256  # smallest per-row context bucket, in tokens
    history_len: int = 0  # penalty history width R (the engine's max_penalty_range; 0: penalties off)
    # Context buckets chosen at run time inside each variant (XLA and reference attention, whose cost grows with
    # the page-table width). Off for the Pallas kernel, which visits only each row's real pages by itself.
    page_switch: bool = True
    verify_len: int = 0  # W = 1 + drafts per verification row (0: no verification buckets)

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_chunk_size < 1 or self.max_pages_per_row < 1:
            raise ValueError(f"BucketSpec needs positive sizes, got {self}")
        if self.max_prefill_rows < 1:
            raise ValueError(f"BucketSpec needs max_prefill_rows >= 1, got {self}")
        if self.verify_len == 1 or self.verify_len < 0:
            raise ValueError(f"BucketSpec needs verify_len 0 (off) or >= 2 (1 + drafts), got {self.verify_len}")

    @classmethod
    def from_config(cls, config: EngineConfig, attn_impl: str | None = None, head_dim: int = 64) -> BucketSpec:
        """The buckets of a resolved `EngineConfig` (with verification buckets where the engine verifies drafts:
        `EngineConfig.verification`); `attn_impl`: the implementation attention resolves to ("auto" resolved;
        default: the config's, resolved on the current backend for the model's `head_dim`)."""
        impl = resolved_attn_impl(config.attn_impl if attn_impl is None else attn_impl, head_dim=head_dim,
                                  page_size=config.page_size)
        return cls(
            max_batch_size=config.max_batch_size, max_chunk_size=config.max_chunk_size,
            max_pages_per_row=config.max_pages_per_row, max_prefill_rows=config.max_prefill_rows,
            page_size=config.page_size, history_len=config.max_penalty_range, page_switch=impl != "pallas",
            verify_len=0 if config.verification is None else config.verification.num_draft_tokens + 1,
        )

    @functools.cached_property
    def decode_rows(self) -> tuple[int, ...]:
        return (0, *_geometric(1, self.max_batch_size, 2))

    @functools.cached_property
    def prefill_rows(self) -> tuple[int, ...]:
        """Every count (not powers of two): a prefill layout's decode part is max_batch_size minus this."""
        return tuple(range(min(self.max_prefill_rows, self.max_batch_size) + 1))

    @functools.cached_property
    def q_lens(self) -> tuple[int, ...]:
        return _geometric(min(self.min_q_len, self.max_chunk_size), self.max_chunk_size, self.growth)

    @functools.cached_property
    def windows(self) -> tuple[int, ...]:
        """Prefill window sizes: `q_lens`, and one more holding a full chunk plus a decode token of every other row
        (a prefill step's decode rows ride in its window's padding)."""
        top = self.max_chunk_size + self.max_batch_size - 1
        return self.q_lens + ((top,) if top > self.max_chunk_size else ())

    @functools.cached_property
    def verify_windows(self) -> tuple[int, ...]:
        """Prefill window sizes of the mixed verification buckets: `q_lens`, and one holding a full chunk plus W
        slots for every other row."""
        top = self.max_chunk_size + (self.max_batch_size - 1) * self.verify_len
        return self.q_lens + ((top,) if top > self.max_chunk_size else ())

    @functools.cached_property
    def pages(self) -> tuple[int, ...]:
        """Context buckets (pages per row) attention chooses from at run time."""
        lo = min(max(1, self.min_context // self.page_size), self.max_pages_per_row)
        return _geometric(lo, self.max_pages_per_row, self.page_growth)

    @functools.cached_property
    def sample_rows(self) -> tuple[int, ...]:
        """Row counts the sampler is compiled for (the decode row buckets)."""
        return self.decode_rows[1:]

    def layouts(self) -> list[PrefillDecodeLayout]:
        out = [PrefillDecodeLayout(0, 1, sd) for sd in self.decode_rows if sd]
        for sp in self.prefill_rows[1:]:
            out += [PrefillDecodeLayout(sp, qm, 0) for qm in self.windows]
        return out

    def shape(self, layout: PrefillDecodeLayout) -> BatchShape:
        """The bucket of a layout: the page table and the sampler inputs are as wide as this spec allows; a prefill
        layout carries max_batch_size - prefill rows decode rows in its last window."""
        sp = layout.num_prefill_rows
        rows = self.max_batch_size if sp else layout.num_decode_rows
        return BatchShape(layout=layout, pages_per_row=self.max_pages_per_row, history_len=self.history_len,
                          num_bias=BIAS_WIDTH, page_buckets=self.pages if self.page_switch else (),
                          tail_decode_rows=self.max_batch_size - sp if sp else 0,
                          sample_rows=tuple(n for n in self.sample_rows if sp and sp <= n < rows) + (rows,))

    def _verify_decode_shape(self, n: int) -> BatchShape:
        w = self.verify_len
        return BatchShape(layout=PrefillDecodeLayout(n, w, 0), pages_per_row=self.max_pages_per_row,
                          history_len=self.history_len, num_bias=BIAS_WIDTH,
                          page_buckets=self.pages if self.page_switch else (), sample_rows=(n,), verify_len=w)

    def _verify_mixed_shape(self, sp: int, window: int) -> BatchShape:
        shape = dataclasses.replace(self.shape(PrefillDecodeLayout(sp, window, 0)), verify_len=self.verify_len)
        if not shape.tail_decode_rows:  # max_batch_size == prefill rows: no room for step rows
            raise ValueError(f"{self} has no room for verification rows beside {sp} prefill rows")
        return shape

    def verify_shapes(self) -> list[BatchShape]:
        """The verification buckets (empty when `verify_len` is 0)."""
        if not self.verify_len:
            return []
        out = [self._verify_decode_shape(n) for n in self.decode_rows if n]
        for sp in self.prefill_rows[1:]:
            if sp < self.max_batch_size:
                out += [self._verify_mixed_shape(sp, qm) for qm in self.verify_windows]
        return out

    def all_shapes(self) -> list[BatchShape]:
        return [self.shape(lay) for lay in self.layouts()] + self.verify_shapes()

    def verify_shape_for(self, prefill_lens: list[int], num_step_rows: int, max_pages: int) -> BatchShape:
        """Smallest verification bucket for prefill chunks of `prefill_lens` tokens and `num_step_rows` step rows
        (verification rows of at most W tokens, and 1-token rows), rows needing up to `max_pages` pages."""
        if not self.verify_len:
            raise ValueError("this BucketSpec has no verification buckets (verify_len=0)")
        sp = len(prefill_lens)
        if sp > min(self.max_prefill_rows, self.max_batch_size):
            raise ValueError(f"{sp} prefill rows exceed max_prefill_rows={self.max_prefill_rows}")
        if sp + num_step_rows > self.max_batch_size:
            raise ValueError(f"{sp} + {num_step_rows} rows exceed max_batch_size={self.max_batch_size}")
        if num_step_rows == 0:
            raise ValueError("a verification batch needs at least one step row")
        if max_pages > self.max_pages_per_row:
            raise ValueError(f"{max_pages} pages per row exceed max_pages_per_row={self.max_pages_per_row}")
        if not sp:
            return self._verify_decode_shape(next(x for x in self.decode_rows if x >= num_step_rows))
        if max(prefill_lens) > self.max_chunk_size:
            raise ValueError(f"prefill chunk of {max(prefill_lens)} tokens exceeds max_chunk_size="
                             f"{self.max_chunk_size}")
        need = max(max(prefill_lens), min(prefill_lens) + num_step_rows * self.verify_len)
        return self._verify_mixed_shape(sp, next(x for x in self.verify_windows if x >= need))

    def row_counts(self) -> tuple[int, ...]:
        """The distinct sampled row counts of the buckets: one sampler variant each."""
        return tuple(sorted({n for s in self.all_shapes() if not s.verify_len for n in s.sampled_row_counts}))

    def shape_for(self, prefill_lens: list[int], num_decode: int, max_pages: int, history: int = 0) -> BatchShape:
        """Smallest bucket for `len(prefill_lens)` prefill rows of those lengths, `num_decode` single-token rows and
        rows needing up to `max_pages` pages. `history` (penalty tokens) is not a bucket dimension: a longer
        history than `history_len` is cut to its most recent `history_len` tokens."""
        del history
        sp = len(prefill_lens)
        if sp > min(self.max_prefill_rows, self.max_batch_size):
            raise ValueError(f"{sp} prefill rows exceed max_prefill_rows={self.max_prefill_rows}")
        if sp + num_decode > self.max_batch_size:
            raise ValueError(f"{sp} + {num_decode} rows exceed max_batch_size={self.max_batch_size}")
        if sp + num_decode == 0:
            raise ValueError("a batch needs at least one row")
        if max_pages > self.max_pages_per_row:
            raise ValueError(f"{max_pages} pages per row exceed max_pages_per_row={self.max_pages_per_row}")
        need = num_decode
        if sp:
            if max(prefill_lens) > self.max_chunk_size:
                raise ValueError(f"prefill chunk of {max(prefill_lens)} tokens exceeds max_chunk_size="
                                 f"{self.max_chunk_size}")
            # the longest chunk fits a window; the shortest one (in the last window) leaves room for the decode rows
            need = max(max(prefill_lens), min(prefill_lens) + num_decode)
        shape = self._shapes.get((sp, need))  # the bucket depends on these two only: each is built once
        if shape is None:
            if sp:
                shape = self.shape(PrefillDecodeLayout(sp, next(x for x in self.windows if x >= need), 0))
            else:
                shape = self.shape(PrefillDecodeLayout(0, 1, next(x for x in self.decode_rows if x >= need)))
            self._shapes[(sp, need)] = shape
        return shape

    @functools.cached_property
    def _shapes(self) -> dict[tuple[int, int], BatchShape]:
        """`shape_for`'s buckets by (prefill rows, token slots the last window or the decode rows need)."""
        return {}
