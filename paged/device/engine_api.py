"""The interface between the host loop and whatever runs the model: `EngineProtocol` and its `StepOutput`.

`DynamicGenerator` talks to its engine only through this protocol. The real `paged.device.engine.Engine` runs the jitted
step; a hand-checkable fake (tests), a simulated engine with a step-time model, or a draft-model engine implement
the same few members.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from paged.device.batch import RowInput
from paged.device.buckets import BucketSpec
from paged.device.config import EngineConfig


@dataclasses.dataclass
class StepOutput:
    """Host copy of one step's results, indexed by input row (not by batch slot). With `num_steps > 1` every array
    gains a leading `[num_steps]` axis.

    A verification step (some row has `RowInput.verify`; speculative decoding) returns per-position results
    instead: every array gains a `[W]` axis after the row axis (W = `verify_len` = 1 + drafts per row), so `token`
    and `logprob` are `[n, W]`, `top_ids` / `top_logprobs` `[n, W, K]`, `logits` `[n, W, V]`, and `num_accepted`
    `[n]` is set. Row i emits `token[i, :num_accepted[i] + 1]`: its accepted drafts, then the target's next token
    (the correction at the first rejected draft, or the bonus token when all were accepted); `logprob`, `top_*`
    and `logits` at those positions are the target's at each (what a non-speculative step would report there).
    A row that is not a verification row has `num_accepted` 0 and its result at position 0. Entries past
    `num_accepted[i]` are undefined (token -1)."""

    token: np.ndarray  # [n] int32
    logprob: np.ndarray  # [n] float32
    top_ids: np.ndarray  # [n, K]
    top_logprobs: np.ndarray  # [n, K]
    logits: np.ndarray | None  # [n, V]
    shape: Any  # the BatchShape the rows were padded to (None for engines without buckets)
    seconds: float
    num_accepted: np.ndarray | None = None  # [n] int32, verification steps only


@runtime_checkable
class EngineProtocol(Protocol):
    """What the generator needs from an engine.

    - `config`: the resolved `EngineConfig` (page size, number of pages, max_seq_len, batch limits, ...);
    - `spec`: the shape buckets (`BucketSpec`) the engine pads to; the generator never plans a step they cannot hold;
    - `vocab_size`: ids at or above it are rejected at `enqueue()`;
    - `timings`: cumulative seconds by phase (reported by `generator.metrics()`; may be empty);
    - `run(rows, ...)`: one step (or `num_steps` decode steps) over the rows; must not keep references to `rows`;
    - `warmup(...)`: compile or prepare every bucket; returns how many variants it prepared.
    - optional `clock`: the engine's own clock (the simulator's virtual clock, `paged.clock.VirtualClock`), which
      `DynamicGenerator` adopts when it is given no `clock=`, so every timing is in that clock's time.
    """

    config: EngineConfig
    spec: BucketSpec
    vocab_size: int
    timings: dict[str, float]

    def run(self, rows: Sequence[RowInput], *, return_top_k: int = 0, return_logits: bool = False,
            num_steps: int = 1) -> StepOutput: ...
    # (The JAX `Engine.run` also takes `draft_logprobs=` and `draft_tokens=` for verification steps: see
    # `paged.speculation.speculator`.)

    def warmup(self, progress: bool = False, decode_steps: int = 1) -> int: ...
