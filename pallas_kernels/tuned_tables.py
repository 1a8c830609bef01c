"""Measured tunings of the built-in Pallas kernels, per device kind and shape class (the way jax's Pallas ops keep
their tuned block sizes in a table beside the kernel). `default_tuning` looks here first and falls back to its
shape heuristics.

Entries come from `python -m experiments.bench_kernels --sweep --json_out F` on the device (its `tuned` list holds
the best tuning per shape) and are keyed by `jax.devices()[0].device_kind` and `attention_key(...)` /
`matmul_key(...)`. An entry is added only where the sweep beat the heuristic default by more than the run-to-run
spread; the record is `experiments/results/kernels_h100.json` (docs/kernels.md, "Measured on an H100").

Attention: the H100 sweep (decode 64 x 4096 and prefill 2048 x 2048, 8 KV heads x 4 x 128, bf16 pages of 16) found
the heuristic default within 2% of the best of 96 / 24 tunings, so there is no attention entry.
"""

from __future__ import annotations

from typing import Any

from pallas_kernels.tuning import AttentionTuning

H100 = "NVIDIA H100 80GB HBM3"

# device_kind -> attention_key -> tuning
ATTENTION: dict[str, dict[tuple, AttentionTuning]] = {}

# device_kind -> matmul_key -> MatmulTuning fields. H100, 2026-11-24 (bench_kernels --sweep, 64 / 12 candidates):
# the 4096 x 14336 q4_1 GEMV 0.147 -> 0.075 ms, SmolLM2's 576 x 1536 q4_1 GEMV 0.061 -> 0.049 ms.
MATMUL: dict[str, dict[tuple, dict[str, int]]] = {
    H100: {
        ("q4_1", 32, 4096, 14336, 16): dict(block_n=16, block_out=256, block_in=128, split_in=4),
        ("q4_1", 32, 576, 1536, 16): dict(block_n=16, block_out=256, block_in=32, split_in=2),
    },
}


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def attention_key(*, max_query_len: int, num_kv_heads: int, page_size: int, pages_per_row: int) -> tuple:
    """The shape class a tuning applies to: decode or the power-of-two bucket of the longest query, KV heads, page
    size, and the power-of-two bucket of the pages per row."""
    return ("decode" if max_query_len <= 1 else _bucket(max_query_len), num_kv_heads, page_size, _bucket(pages_per_row))


def lookup_attention(device_kind: str, **shape) -> AttentionTuning | None:
    return ATTENTION.get(device_kind, {}).get(attention_key(**shape))


def matmul_key(*, kind: str, group_size: int, k: int, out: int, n: int) -> tuple:
    """The shape class a matmul tuning applies to: the weight's kind, group, in and out, and x's rows rounded up to
    the 16-row block (a GEMV and a batch of up to 16 run the same tiles)."""
    return (kind, group_size, k, out, max(16, _bucket(n)))


def lookup_matmul(device_kind: str, **shape: Any) -> dict[str, int] | None:
    return MATMUL.get(device_kind, {}).get(matmul_key(**shape))
