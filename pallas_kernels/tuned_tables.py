"""Measured tunings of the built-in Pallas kernels, per device kind and shape class (the way jax's Pallas ops keep
their tuned block sizes in a table beside the kernel). `default_tuning` looks here first and falls back to its
shape heuristics.

Entries come from `python -m experiments.bench_kernels --sweep --json_out F` on the device (its `tuned` list holds
the best tuning per shape) and are keyed by `jax.devices()[0].device_kind` and `attention_key(...)` /
`matmul_key(...)`. An entry is added only where the sweep beat the heuristic default by more than the run-to-run
spread; the record is `experiments/results/kernels_h100.json` (docs/notes/kernels-journal.md, "Measured on an H100").

Attention: the H100 sweep (decode 64 x 4096 and prefill 2048 x 2048, 8 KV heads x 4 x 128, bf16 pages of 16) found
the heuristic default within 2% of the best of 96 / 24 tunings, so there is no attention entry.

An entry must keep a row's arithmetic the same in every kind of step, or a token's bits come to depend on the step
it is in (greedy speculation then parts from plain decoding): an attention entry has `k_splits=1` and, for one
(KV heads, page size, pages) class, the same `pages_per_block` for decode and every query bucket; a matmul entry is
one per matrix, whatever the rows (`matmul_key`). `check_entries` says where a table breaks that.
"""

from __future__ import annotations

from typing import Any

H100 = "NVIDIA H100 80GB HBM3"

# device_kind -> attention_key -> a `pallas_kernels.tuning.AttentionTuning` (this table imports nothing of the
# project: `tuning.default_tuning` reads it)
ATTENTION: dict[str, dict[tuple, Any]] = {}

# device_kind -> matmul_key -> MatmulTuning fields. H100, 2026-11-24 (bench_kernels --sweep, 64 / 12 candidates, at
# 1-16 rows): the 4096 x 14336 q4_1 GEMV 0.147 -> 0.075 ms, SmolLM2's 576 x 1536 q4_1 GEMV 0.061 -> 0.049 ms. Since
# 2026-11-28 an entry's tiles and split also serve larger row counts (not timed there; a 2048-row prefill through the
# first writes 4 partial sums, ~470 MB of float32, where the heuristic would write one).
MATMUL: dict[str, dict[tuple, dict[str, int]]] = {
    H100: {
        ("q4_1", 32, 4096, 14336): dict(block_n=16, block_out=256, block_in=128, split_in=4),
        ("q4_1", 32, 576, 1536): dict(block_n=16, block_out=256, block_in=32, split_in=2),
    },
}


# The GEMV kernel (`dequant_gemv.py`, impl "pallas_gemv"): device_kind -> matmul_key -> GemvTuning fields (a
# `bench_kernels --sweep --matmul_impls pallas_gemv` record's `tuned` list gives MatmulTuning fields, which fit), one
# per matrix as for MATMUL. None measured yet.
GEMV: dict[str, dict[tuple, dict[str, int | str]]] = {}

# How many rows of x "auto" sends to the GEMV on a GPU (the tensor-core kernel above): device_kind -> weight kind ->
# the most rows. Read off `python -m experiments.bench_kernels --matmul_impls pallas,pallas_gemv,xla
# --matmul_shapes 1x4096x14336,4x4096x14336,16x4096x14336,64x4096x14336 --kinds q4_1,int8` on the device: the
# largest row count at which pallas_gemv is still faster. A row's bits differ between the two kernels, so a decode
# token computed in a step below the limit and in one above it (beside a prefill chunk, or in a wide verification
# step) may differ in its last bits; 0 keeps every row count on the tensor-core kernel.
GEMV_MAX_ROWS: dict[str, dict[str, int]] = {}
# Devices without an entry: 0, the measured tensor-core kernel for every row count, until the GEMV has been timed on
# the device (it has not run on a GPU yet). Once measured, 8 is the expected limit: it covers decode at batch 1 and
# its verification steps of up to 7 drafts (one kernel, so greedy speculation keeps plain decoding's bits there).
DEFAULT_GEMV_MAX_ROWS = 0


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def attention_key(*, max_query_len: int, num_kv_heads: int, page_size: int, pages_per_row: int) -> tuple:
    """The shape class a tuning applies to: decode or the power-of-two bucket of the longest query, KV heads, page
    size, and the power-of-two bucket of the pages per row."""
    return ("decode" if max_query_len <= 1 else _bucket(max_query_len), num_kv_heads, page_size, _bucket(pages_per_row))


def lookup_attention(device_kind: str, **shape) -> Any:
    return ATTENTION.get(device_kind, {}).get(attention_key(**shape))


def matmul_key(*, kind: str, group_size: int, k: int, out: int) -> tuple:
    """The shape class a matmul tuning applies to: the weight's kind, group, in and out. Not x's rows: an entry's
    reduction over `in` (`block_in`, `split_in`) serves every row count, so that a row gets the same bits however
    many rows share the call (`dequant_matmul.default_tuning`); its `block_n` serves up to that many rows."""
    return (kind, group_size, k, out)


def lookup_matmul(device_kind: str, **shape: Any) -> dict[str, int] | None:
    return MATMUL.get(device_kind, {}).get(matmul_key(**shape))


def lookup_gemv(device_kind: str, **shape: Any) -> dict[str, int | str] | None:
    return GEMV.get(device_kind, {}).get(matmul_key(**shape))


def gemv_max_rows(device_kind: str, kind: str) -> int:
    """The most rows of x "auto" runs through the GEMV on this device for weights of `kind` (`GEMV_MAX_ROWS`, else
    the unmeasured `DEFAULT_GEMV_MAX_ROWS`)."""
    return GEMV_MAX_ROWS.get(device_kind, {}).get(kind, DEFAULT_GEMV_MAX_ROWS)


def check_entries(attention: dict | None = None, matmul: dict | None = None, gemv: dict | None = None,
                  gemv_max_rows: dict | None = None) -> None:
    """Raise ValueError where a table (default: this module's) would give a row other arithmetic in another kind of
    step: an attention entry that splits keys, or two attention entries of one (KV heads, page size, pages) class
    with different key blocks, a matmul or GEMV key that is not one per matrix, or a GEMV row limit that is not a
    count."""
    attention = ATTENTION if attention is None else attention
    matmul = MATMUL if matmul is None else matmul
    gemv = GEMV if gemv is None else gemv
    gemv_max_rows = GEMV_MAX_ROWS if gemv_max_rows is None else gemv_max_rows
    for device, tunings in attention.items():
        blocks: dict[tuple, int] = {}
        for (_, *cls), t in tunings.items():
            if t.k_splits != 1:
                raise ValueError(f"{device}: attention entry {t} splits keys (k_splits must be 1)")
            if blocks.setdefault(tuple(cls), t.pages_per_block) != t.pages_per_block:
                raise ValueError(f"{device}: attention entries of class {tuple(cls)} use pages_per_block "
                                 f"{blocks[tuple(cls)]} and {t.pages_per_block}; use one for every query bucket")
    for device, tunings in [*matmul.items(), *gemv.items()]:
        for key in tunings:
            if len(key) != 4:
                raise ValueError(f"{device}: matmul key {key} is not (kind, group_size, k, out)")
    for device, limits in gemv_max_rows.items():
        for kind, rows in limits.items():
            if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
                raise ValueError(f"{device}: GEMV_MAX_ROWS[{kind!r}] = {rows!r} is not a row count >= 0")
