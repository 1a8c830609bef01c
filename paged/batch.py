"""Host-side construction of a `Batch` from per-row inputs, padded to a `BatchShape` (numpy, no device work)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from paged.sampling import SamplingParams
from paged.state import NULL_PAGE, Batch, BatchShape


@dataclasses.dataclass
class RowInput:
    """One row of a step: `tokens` are this step's new tokens, the first at position `start_pos`; `pages` is the
    row's page list, covering at least positions `0 .. start_pos + len(tokens) - 1`."""

    tokens: Sequence[int]
    start_pos: int
    pages: Sequence[int]
    sample: bool = True
    sampling: Mapping | None = None  # keyword values for SamplingParams.make (missing: neutral/greedy)
    history: Sequence[int] = ()  # previous tokens for penalties, oldest first
    bias: Mapping[int, float] | None = None  # sparse additive logit bias (-inf bans)

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == 1


def build_batch(rows: Sequence[RowInput], shape: BatchShape, page_size: int) -> tuple[Batch, list[int]]:
    """Lay `rows` out in `shape`: multi-token rows in prefill windows, single-token rows in decode slots.

    Returns the batch and, for each input row, its row index in the batch (where its results come out).
    """
    lay = shape.layout
    s_count, t_count, p = shape.num_rows, shape.num_tokens, shape.pages_per_row
    pre = [i for i, r in enumerate(rows) if not r.is_decode]
    dec = [i for i, r in enumerate(rows) if r.is_decode]
    if len(pre) > lay.num_prefill_rows or len(dec) > lay.num_decode_rows:
        raise ValueError(f"{len(pre)} prefill + {len(dec)} decode rows do not fit {lay}")
    token_ids = np.zeros(t_count, np.int32)
    positions = np.zeros(t_count, np.int32)
    query_lens = np.zeros(s_count, np.int32)
    kv_lens = np.zeros(s_count, np.int32)
    page_table = np.full((s_count, p), NULL_PAGE, np.int32)
    history = np.full((s_count, shape.history_len), -1, np.int32)
    bias_ids = np.full((s_count, shape.num_bias), -1, np.int32)
    bias_values = np.zeros((s_count, shape.num_bias), np.float32)
    sampling_rows: list[Mapping] = [{} for _ in range(s_count)]
    slot_of = [0] * len(rows)
    for j, i in enumerate(pre):
        slot_of[i] = j
    for j, i in enumerate(dec):
        slot_of[i] = lay.num_prefill_rows + j
    for i, r in enumerate(rows):
        s = slot_of[i]
        n = len(r.tokens)
        if n > (lay.max_q_len if not r.is_decode else 1):
            raise ValueError(f"row {i} has {n} tokens, more than the window of {lay.max_q_len}")
        t0 = s * lay.max_q_len if s < lay.num_prefill_rows else lay.num_prefill_rows * lay.max_q_len + (
            s - lay.num_prefill_rows)
        token_ids[t0 : t0 + n] = r.tokens
        positions[t0 : t0 + n] = np.arange(r.start_pos, r.start_pos + n)
        query_lens[s] = n
        kv_lens[s] = r.start_pos + n
        need = -(-kv_lens[s] // page_size)
        if len(r.pages) < need:
            raise ValueError(f"row {i} needs {need} pages for {kv_lens[s]} tokens but has {len(r.pages)}")
        if need > p:
            raise ValueError(f"row {i} needs {need} pages, more than the bucket's {p}")
        page_table[s, : min(len(r.pages), p)] = list(r.pages)[:p]
        if shape.history_len and len(r.history):
            h = list(r.history)[-shape.history_len :]
            history[s, shape.history_len - len(h) :] = h
        if r.bias:
            if len(r.bias) > shape.num_bias:
                raise ValueError(f"row {i} has {len(r.bias)} bias entries, more than the bucket's {shape.num_bias}")
            ids = list(r.bias)
            bias_ids[s, : len(ids)] = ids
            bias_values[s, : len(ids)] = [r.bias[k] for k in ids]
        if r.sampling:
            sampling_rows[s] = r.sampling
    batch = Batch(
        token_ids=jnp.asarray(token_ids),
        positions=jnp.asarray(positions),
        query_lens=jnp.asarray(query_lens),
        kv_lens=jnp.asarray(kv_lens),
        page_table=jnp.asarray(page_table),
        sampling=SamplingParams.make(sampling_rows),
        history=jnp.asarray(history),
        bias_ids=jnp.asarray(bias_ids),
        bias_values=jnp.asarray(bias_values),
    )
    return batch, slot_of
