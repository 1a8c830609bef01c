"""Tuning of the ragged paged attention kernel: the `AttentionTuning` block sizes and the default table.

The defaults are measured entries of `pallas_kernels.tuned_tables` where a sweep has filled one in
(`experiments.bench_kernels --sweep`), otherwise heuristics: keys per compute block near 64, one token per program
for decode, 16 query tokens per program for prefill, and no key split.

No default splits a row's keys (`k_splits=1`): every query then folds its keys block by block from key 0 in one
online softmax, whether it is a decode token, a verification row's or a prefill chunk's, and however many other
rows share the step. A split (flash-decoding: parts of the key range in separate programs, merged afterwards)
rounds differently, and the earlier default split only decode steps, by a count that depended on the step's tokens
and the page table's width, so a decode token got other bits than the same query in a verification row or next
to another row's prefill (`test_a_query_gets_the_same_bits_in_every_kind_of_step`); on an H200 greedy outputs with
prompt lookup then differed from plain decoding's (2026-11-28, docs/kernels.md). `k_splits > 1` stays available as
an explicit tuning (`attn_tuning="k_splits=8"`) for long contexts at small batch, where it fills more of the GPU,
at the cost of that invariance.

`split_max_q` (default 0: every row is split) narrows a split to the short rows: with `k_splits > 1` and
`split_max_q > 0`, a row of at most `split_max_q` query tokens (a decode row at 1) is split over the `k_splits`
programs, while a longer row (a prefill chunk) is attended whole by the first split, with the same arithmetic as
`k_splits=1`: its output keeps the unsplit bits, and only the split rows get other bits. It is meant for mixed steps
(one prefill chunk and many decode rows), where splitting the chunk too only adds partials to merge.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.tuned_tables import lookup_attention


def _is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """Block sizes of `ragged_paged_attention_pallas`.

    block_q: query tokens per program (a power of two). One program attends a block of `block_q` consecutive
        tokens of the flat token axis for one KV head; the block may span several rows.
    pages_per_block: pages loaded and scored per inner-loop step (a power of two); keys per step is
        `pages_per_block * page_size`.
    k_splits: the key range of every row is split into this many parts, attended by separate programs and merged
        afterwards (split-K / flash-decoding). 1 in every default; more only as an explicit tuning, for long contexts
        at small batch, and then a row's bits depend on the kind of step it is in (see the module docstring).
    split_max_q: with `k_splits > 1`, only rows of at most this many query tokens are split over the `k_splits`
        programs; longer rows are attended whole by the first split (their output has the bits of `k_splits=1`).
        0 (the default): every row is split. No effect with `k_splits=1`.
    num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
    """

    block_q: int = 16
    pages_per_block: int = 4
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    split_max_q: int = 0

    def __post_init__(self):
        for name in ("block_q", "pages_per_block"):
            value = getattr(self, name)
            if not _is_power_of_two(value):
                raise ValueError(f"AttentionTuning.{name} must be a power of two >= 1, got {name}={value!r}")
        if not isinstance(self.k_splits, int) or self.k_splits < 1:
            raise ValueError(f"AttentionTuning.k_splits must be an int >= 1, got k_splits={self.k_splits!r}")
        if not _is_power_of_two(self.num_warps) or self.num_warps > 32:
            raise ValueError(f"AttentionTuning.num_warps must be a power of two in [1, 32], got "
                             f"num_warps={self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"AttentionTuning.num_stages must be an int >= 1, got num_stages={self.num_stages!r}")
        if not isinstance(self.split_max_q, int) or isinstance(self.split_max_q, bool) or self.split_max_q < 0:
            raise ValueError(f"AttentionTuning.split_max_q must be an int >= 0 (0: split every row), got "
                             f"split_max_q={self.split_max_q!r}")


TARGET_KEYS_PER_BLOCK = 64


def default_tuning(
    *, max_query_len: int, num_kv_heads: int, page_size: int, pages_per_row: int
) -> AttentionTuning:
    """The tuning used when the caller passes none: a measured entry of `pallas_kernels.tuned_tables` for this
    device and shape class if there is one, else the heuristics below. Everything here is static (shapes, not
    values)."""
    import jax

    measured = lookup_attention(jax.devices()[0].device_kind, max_query_len=max_query_len,
                                num_kv_heads=num_kv_heads, page_size=page_size, pages_per_row=pages_per_row)
    if measured is not None:
        return measured
    ppb = 1
    while ppb * 2 * page_size <= TARGET_KEYS_PER_BLOCK and ppb * 2 <= max(pages_per_row, 1):
        ppb *= 2
    if max_query_len <= 1:  # decode: one token per program
        return AttentionTuning(block_q=1, pages_per_block=ppb)
    block_q = 1
    while block_q < 16 and block_q < max_query_len:
        block_q *= 2
    return AttentionTuning(block_q=block_q, pages_per_block=ppb, k_splits=1)
