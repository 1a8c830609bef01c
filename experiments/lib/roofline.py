"""The bytes a step must read and the tokens/s the device's copy rate allows for them (`experiments.bench_e2e`).

A decode step reads every weight once (`ModelCost.weight_bytes`: the resident bytes of every parameter, quantized
ones at their real size — quants, scales and mins — less an untied input embedding, of which a step reads only the
looked-up rows) and, for every row, the KV cache up to its context: the row's cached tokens plus the one it
feeds, in whole pages (a paged cache is read a page at a time), at `ModelCost.kv_bytes_per_token` (every layer's K
and V, cache dtype, int8 scales). KV writes and activations are not counted: at decode they are a small fraction.

The roofline of a step is the time the device's copy rate needs for those bytes; its tokens/s is
`rows x copy_rate / bytes_per_step`, and a measured tokens/s divided by it is the fraction of the roofline
achieved. The copy rate is measured in the same run by `experiments.lib.serving.hardware.measure_memory_bandwidth`
(a jitted `a * 1.0001` in place over a large float32 buffer, read + write counted, the best of a few timings). On a
CPU a model whose weights and cache fit in the CPU's caches can exceed a fraction of 1: the copy is timed on a
buffer far larger than the caches.
"""

from __future__ import annotations

from collections.abc import Sequence

from experiments.lib.serving.hardware import ModelCost


def kv_tokens_read(cached: int, page_size: int) -> int:
    """Cache slots a decode step of a row holding `cached` tokens reads: those and the one it feeds, rounded up to
    whole pages."""
    return -(-(cached + 1) // page_size) * page_size


def decode_step_bytes(cost: ModelCost, positions: Sequence[int], page_size: int, steps: int = 1) -> float:
    """Mean bytes per step of `steps` decode steps over rows holding `positions` cached tokens before the first
    (each step adds one token per row): the weights once, every row's KV up to its context in whole pages."""
    slots = sum(kv_tokens_read(p + j, page_size) for p in positions for j in range(steps))
    return cost.weight_bytes + slots * cost.kv_bytes_per_token / steps


def prefill_chunks(prompt_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(tokens cached before, chunk tokens) of each step prefilling a `prompt_tokens` prompt `chunk` at a time."""
    return [(s, min(chunk, prompt_tokens - s)) for s in range(0, prompt_tokens, chunk)]


def prefill_work(cost: ModelCost, prompt_tokens: int, chunk: int, page_size: int) -> dict:
    """Bytes and FLOPs of prefilling one prompt in chunks (`prefill_chunks`): per chunk the weights once and the KV
    up to the chunk's end in whole pages (`kv_tokens_read`); FLOPs as `ModelCost.step_flops` counts them."""
    chunks = prefill_chunks(prompt_tokens, chunk)
    total_bytes = sum(cost.weight_bytes + kv_tokens_read(s + n - 1, page_size) * cost.kv_bytes_per_token
                      for s, n in chunks)
    return {"chunks": len(chunks), "bytes": total_bytes, "bytes_per_step": total_bytes / len(chunks),
            "flops": sum(cost.step_flops([(s, n, True)]) for s, n in chunks)}


def roofline_tokens_per_s(copy_bytes_per_s: float, bytes_per_step: float, rows: int) -> float:
    """Tokens/s of `rows` rows if each step took exactly the time to copy its bytes at the measured rate."""
    return rows * copy_bytes_per_s / bytes_per_step
