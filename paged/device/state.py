"""Device-side pytrees of the engine: `EngineState` (the paged KV cache), `Batch` (one step's ragged input),
`Results` (one step's output), and `BatchShape`, the static bucket a batch is padded to.

Contract (see docs/architecture.md, "The device step"):
- A batch has `S = num_prefill_rows + num_decode_rows` rows: prefill rows first, then decode rows; the real rows of
  each kind come before that kind's padding rows. Prefill row s owns the window of `max_q_len` token slots starting
  at `s * max_q_len` (the first `query_lens[s]` are real). A decode row has one token: in a decode-only batch row j
  owns slot j; in a prefill batch the decode rows' tokens follow the chunk in the last window
  (`Batch.decode_tokens`), so `T = num_prefill_rows * max_q_len` (+ the layout's decode slots, if any). Padding
  rows have `query_lens = 0`, `kv_lens = 0`.
- `kv_lens[s]` counts the row's cached tokens after this step's tokens are written.
- `page_table[s]` lists the row's pages (`P` of them, padded with the null page 0). Token at position j is stored at
  page `page_table[s, j // page_size]`, offset `j % page_size`.
- Every row's last real token is sampled on the device (the first `S'` rows, `S'` one of the bucket's
  `sample_rows`); the host ignores the tokens of prefill chunks that do not reach the end of the prompt
  (`RowInput.sample` is False).
- Verification buckets (`BatchShape.verify_len = W = k + 1 > 0`, speculative decoding): every row owns `W` *sample
  points* instead of one, and the sampler runs over `S' * W` of them (point j of row s is sampler row `s * W + j`).
  A verification row (`RowInput.verify`: the last accepted token and up to k drafts) samples at every one of its
  positions; any other row samples only its last token (point 0) and its other points are padding. Step rows
  (verification rows and 1-token rows) own `W` token slots each: in a decode-only verification bucket the layout is
  `PrefillDecodeLayout(n, W, 0)` (every row a window of W); in a mixed one they sit in the padding of the last
  prefill window at a stride of W (`decode_tokens`), after the chunks.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from models.lora import LoraStack
from paged.device.sampling import SamplingRows
from pallas_kernels.paged_attention import PrefillDecodeLayout

NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """Static shape bucket of a batch: the step's forward compiles once per (layout, tail_decode_rows, page_buckets,
    sample_rows), its sampler once per sampled row count; `history_len` and `num_bias` are fixed per engine.

    Rows: `layout.num_prefill_rows` prefill rows, then decode rows (one token each): the layout's decode slots
    (decode-only batches) and `tail_decode_rows` rows whose tokens sit in the padding of the last prefill window, at
    token indices given at run time (`Batch.decode_tokens`), so that a prefill step carries its decode rows without
    extra token slots.

    `page_buckets`: the context sizes (pages per row) attention can read. The step picks the smallest one holding the
    batch's longest row at run time (`lax.switch`), so one compiled variant serves every context length while
    attention reads only that many pages. Empty: attention reads all `pages_per_row` (the Pallas kernel visits only
    each row's real pages by itself).

    `sample_rows`: the row counts the forward hands to the sampler (the first n rows: every real row comes before
    the padding rows); a step samples the smallest one holding its real rows. Empty: all rows."""

    layout: PrefillDecodeLayout
    pages_per_row: int  # P: page-table width
    history_len: int = 0  # R: tokens of history for penalties (0: the engine has penalties off)
    num_bias: int = 0  # B: sparse logit-bias entries per row (rows with more use the dense bias)
    page_buckets: tuple[int, ...] = ()  # ascending, the last one == pages_per_row; () = (pages_per_row,)
    tail_decode_rows: int = 0  # decode rows packed into the last prefill window's padding
    sample_rows: tuple[int, ...] = ()  # ascending, the last one == num_rows; () = (num_rows,)
    # W = 1 + max drafts per row: each row samples W points and step rows own W token slots (0: no verification;
    # the non-speculative buckets, whose compiled variants are exactly those of an engine without speculation)
    verify_len: int = 0

    def __post_init__(self):
        if self.page_buckets and (self.page_buckets[-1] != self.pages_per_row
                                  or list(self.page_buckets) != sorted(set(self.page_buckets))):
            raise ValueError(f"page_buckets must ascend to pages_per_row={self.pages_per_row}, got {self.page_buckets}")
        if self.tail_decode_rows and not self.layout.num_prefill_rows:
            raise ValueError(f"tail_decode_rows need a prefill window, got {self}")
        if self.sample_rows and (self.sample_rows[-1] != self.num_rows
                                 or list(self.sample_rows) != sorted(set(self.sample_rows))):
            raise ValueError(f"sample_rows must ascend to num_rows={self.num_rows}, got {self.sample_rows}")

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows + self.tail_decode_rows

    @property
    def points_per_row(self) -> int:
        """Sample points per row: `verify_len` in a verification bucket, else 1."""
        return self.verify_len or 1

    @property
    def step_rows_in_windows(self) -> bool:
        """A decode-only verification bucket: every row (a step row) owns a window of `verify_len` slots."""
        return bool(self.verify_len) and not self.num_decode_rows

    @property
    def num_decode_rows(self) -> int:
        return self.layout.num_decode_rows + self.tail_decode_rows

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def sampled_row_counts(self) -> tuple[int, ...]:
        return self.sample_rows or (self.num_rows,)

    def sample_rows_for(self, num_real_rows: int) -> int:
        """The smallest sampled row count holding `num_real_rows` rows."""
        return next(n for n in self.sampled_row_counts if n >= num_real_rows)


@struct.dataclass
class EngineState:
    """The paged KV cache of every layer, head-major. Donated to `step`, so updated in place."""

    k: jnp.ndarray  # [L, KH, num_pages, page_size, D] (float, or int8 with scales)
    v: jnp.ndarray  # [L, KH, num_pages, page_size, D]
    k_scale: jnp.ndarray | None = None  # [L, KH, num_pages, page_size] float32, int8 cache only
    v_scale: jnp.ndarray | None = None  # [L, KH, num_pages, page_size] float32, int8 cache only
    # Injected embeddings (`paged.embeddings`): token id `vocab_size + r` embeds as row r. None: no table.
    extra_embed: jnp.ndarray | None = None  # [max_embedding_tokens, H] float32
    # LoRA adapters (`models.lora.LoraStack`, `max_loras` slots); a row's `Batch.lora_slots` entry picks one.
    lora: LoraStack | None = None

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def nbytes(self) -> int:
        return tree_nbytes(self)

    @staticmethod
    def create(cfg, num_pages: int, page_size: int, dtype=jnp.float32, embedding_rows: int = 0, lora_slots: int = 0,
               lora_rank: int = 16) -> EngineState:
        """An empty cache. `dtype` float32/bfloat16/float16, or int8 (per-token-per-head scales alongside);
        `embedding_rows` > 0 adds a zero table of injected embeddings, `lora_slots` > 0 an empty LoRA stack of
        that many adapters of rank up to `lora_rank`."""
        state = EngineState._create(cfg, num_pages, page_size, dtype)
        if embedding_rows:
            state = state.replace(extra_embed=jnp.zeros((embedding_rows, cfg.hidden_size), jnp.float32))
        if lora_slots:
            state = state.replace(lora=LoraStack.create(cfg, lora_slots, lora_rank))
        return state

    @staticmethod
    def _create(cfg, num_pages: int, page_size: int, dtype) -> EngineState:
        if page_size < 8 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 8, got {page_size}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the reserved null page), got {num_pages}")
        shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        if jnp.dtype(dtype) == jnp.int8:
            return EngineState(k=jnp.zeros(shape, jnp.int8), v=jnp.zeros(shape, jnp.int8),
                               k_scale=jnp.zeros(shape[:-1], jnp.float32), v_scale=jnp.zeros(shape[:-1], jnp.float32))
        return EngineState(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


@struct.dataclass
class Batch:
    # forward inputs: T token slots, S rows
    token_ids: jnp.ndarray  # [T] int32
    positions: jnp.ndarray  # [T] int32 (absolute position of each token; 0 for padding)
    token_rows: jnp.ndarray  # [T] int32: the row owning each token slot, S for padding slots
    query_lens: jnp.ndarray  # [S] int32
    kv_lens: jnp.ndarray  # [S] int32
    page_table: jnp.ndarray  # [S, P] int32
    decode_tokens: jnp.ndarray  # [Sd] int32: the token slot of each decode row (T for padding rows)
    last_tokens: jnp.ndarray  # [S] int32: the token slot of each row's last token (0 for padding rows)
    # sampler inputs: the first S' rows (S' one of the shape's sample_rows)
    sampling: SamplingRows  # fields [S']
    sample_positions: jnp.ndarray  # [S'] int32: position of the token each row samples (its kv_lens)
    history: jnp.ndarray  # [S', R] int32, -1 padded: previous tokens for penalties
    bias_ids: jnp.ndarray  # [S', B] int32, -1 padded
    bias_values: jnp.ndarray  # [S', B] float32
    # Rows with more than B bias entries (token healing, long ban lists) put theirs here instead; added only where
    # bias_dense_on. None when the batch was built without the vocabulary size (no such rows allowed then).
    bias_dense: jnp.ndarray | None = None  # [S', V] float32
    bias_dense_on: jnp.ndarray | None = None  # bool []
    # Constrained decoding: packed allowed-token bits (token t = bit t % 32 of word t // 32; all ones for rows
    # without a filter), applied only where token_mask_on. None when built without the vocabulary size.
    token_mask: jnp.ndarray | None = None  # [S', ceil(V / 32)] int32
    token_mask_on: jnp.ndarray | None = None  # bool []
    # Per-row token sets of the sampler, packed the same way (all zeros for rows without one; None without the
    # vocabulary size): DRY's sequence breakers and XTC's exempt tokens.
    dry_breakers: jnp.ndarray | None = None  # [S', ceil(V / 32)] int32
    xtc_exempt: jnp.ndarray | None = None  # [S', ceil(V / 32)] int32
    # Verification buckets only (None otherwise). The sampler inputs above then have S' * W rows (one per sample
    # point, point j of row s at s * W + j), `sample_positions` the position each point samples.
    sample_tokens: jnp.ndarray | None = None  # [S, W] int32: token slot of each sample point (0 for padding)
    drafts: jnp.ndarray | None = None  # [S', W - 1] int32: the draft tokens of each row (-1 padded)
    num_drafts: jnp.ndarray | None = None  # [S'] int32: drafts to verify per row (0: not a verification row)
    # A forward input: each row's LoRA adapter (0: none; i: slot i - 1 of `EngineState.lora`). None: no adapters.
    lora_slots: jnp.ndarray | None = None  # [S] int32: each row's LoRA adapter (0: none, i: stack slot i - 1)


@struct.dataclass
class Results:
    token: jnp.ndarray  # [S] int32 (meaningful for rows that sample)
    logprob: jnp.ndarray  # [S] float32
    top_ids: jnp.ndarray  # [S, K] int32
    top_logprobs: jnp.ndarray  # [S, K] float32
    logits: jnp.ndarray | None = None  # [S, V] float32 when requested (pre-sampling, raw model logits)
    final: jnp.ndarray | None = None  # [S, V] float32: the distribution sampled from (`processed_logprobs`)
    # Verification steps (`paged.device.verify.verify_sample`): every field above is per sample point, [S', W, ...];
    # `token[s, :num_accepted[s] + 1]` are row s's accepted drafts and then the target's next token.
    num_accepted: jnp.ndarray | None = None  # [S'] int32


def tree_nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
