"""Measured tunings of the built-in Pallas kernels, per device kind and shape class (the way jax's Pallas ops keep
their tuned block sizes in a table beside the kernel). `default_tuning` looks here first and falls back to its
shape heuristics.

Entries come from `python -m experiments.bench_kernels --sweep --json_out F` on the device (its `tuned` list holds
the best tuning per shape) and are keyed by `jax.devices()[0].device_kind` and `attention_key(...)`. No entry has
been measured yet: the project's GPU runs so far had no time for a sweep (see docs/kernels.md), so every shape uses
the heuristics.
"""

from __future__ import annotations

from pallas_kernels.tuning import AttentionTuning

# device_kind -> attention_key -> tuning
ATTENTION: dict[str, dict[tuple, AttentionTuning]] = {}


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def attention_key(*, max_query_len: int, num_kv_heads: int, page_size: int, pages_per_row: int) -> tuple:
    """The shape class a tuning applies to: decode or the power-of-two bucket of the longest query, KV heads, page
    size, and the power-of-two bucket of the pages per row."""
    return ("decode" if max_query_len <= 1 else _bucket(max_query_len), num_kv_heads, page_size, _bucket(pages_per_row))


def lookup_attention(device_kind: str, **shape) -> AttentionTuning | None:
    return ATTENTION.get(device_kind, {}).get(attention_key(**shape))
