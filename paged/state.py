"""Device-side pytrees of the engine: `EngineState` (the paged KV cache), `Batch` (one step's ragged input),
`Results` (one step's output), and `BatchShape`, the static bucket a batch is padded to.

Contract (see docs/architecture.md, "The device step"):
- A batch has `S = num_prefill_rows + num_decode_rows` rows. Prefill rows come first, each owning a window of
  `max_q_len` token slots (the first `query_lens[s]` are real); decode rows follow with one token slot each.
  So `T = num_prefill_rows * max_q_len + num_decode_rows`. Padding rows have `query_lens = 0`, `kv_lens = 0`.
- `kv_lens[s]` counts the row's cached tokens after this step's tokens are written.
- `page_table[s]` lists the row's pages (`P` of them, padded with the null page 0). Token at position j is stored at
  page `page_table[s, j // page_size]`, offset `j % page_size`.
- Every row's last real token is sampled on the device; the host ignores the tokens of prefill chunks that do not
  reach the end of the prompt (`RowInput.sample` is False).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from paged.sampling import SamplingParams
from pallas_kernels.paged_attention import PrefillDecodeLayout

NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """Static shape bucket of a batch. Every distinct value costs one compilation of the step."""

    layout: PrefillDecodeLayout
    pages_per_row: int  # P
    history_len: int = 0  # R: tokens of history for penalties (0 when no row uses penalties)
    num_bias: int = 0  # B: sparse logit-bias entries per row

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens


@struct.dataclass
class EngineState:
    """The paged KV cache of every layer, head-major. Donated to `step`, so updated in place."""

    k: jnp.ndarray  # [L, KH, num_pages, page_size, D] (float, or int8 with scales)
    v: jnp.ndarray  # [L, KH, num_pages, page_size, D]
    k_scale: jnp.ndarray | None = None  # [L, KH, num_pages, page_size] float32, int8 cache only
    v_scale: jnp.ndarray | None = None  # [L, KH, num_pages, page_size] float32, int8 cache only

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
    def create(cfg, num_pages: int, page_size: int, dtype=jnp.float32) -> EngineState:
        """An empty cache. `dtype` float32/bfloat16/float16, or int8 (per-token-per-head scales alongside)."""
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
    token_ids: jnp.ndarray  # [T] int32
    positions: jnp.ndarray  # [T] int32 (absolute position of each token; 0 for padding)
    query_lens: jnp.ndarray  # [S] int32
    kv_lens: jnp.ndarray  # [S] int32
    page_table: jnp.ndarray  # [S, P] int32
    sampling: SamplingParams  # fields [S]
    history: jnp.ndarray  # [S, R] int32, -1 padded: previous tokens for penalties
    bias_ids: jnp.ndarray  # [S, B] int32, -1 padded
    bias_values: jnp.ndarray  # [S, B] float32


@struct.dataclass
class Results:
    token: jnp.ndarray  # [S] int32 (meaningful for rows that sample)
    logprob: jnp.ndarray  # [S] float32
    top_ids: jnp.ndarray  # [S, K] int32
    top_logprobs: jnp.ndarray  # [S, K] float32
    logits: jnp.ndarray | None = None  # [S, V] float32 when requested (pre-sampling, raw model logits)


def token_rows(layout: PrefillDecodeLayout) -> np.ndarray:
    """[T] the row that owns each token slot."""
    pre = np.repeat(np.arange(layout.num_prefill_rows), layout.max_q_len)
    dec = layout.num_prefill_rows + np.arange(layout.num_decode_rows)
    return np.concatenate([pre, dec]).astype(np.int32)


def token_offsets(layout: PrefillDecodeLayout) -> np.ndarray:
    """[T] index of each token slot within its row's window."""
    pre = np.tile(np.arange(layout.max_q_len), layout.num_prefill_rows)
    return np.concatenate([pre, np.zeros(layout.num_decode_rows, np.int64)]).astype(np.int32)


def tree_nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
