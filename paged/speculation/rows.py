"""The vocabulary of speculative decoding on the host: a step's row as the speculator sees it (`SpecRow`), a
drafter's answer (`Proposal`), the plan of a step (`SpecPlan`), what a row produced (`Accepted`), the verification
row of a decode row (`verification_row`), and the bounds every drafter shares (`ACCEPTANCE_RULES`,
`MAX_DRAFT_TOKENS`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from paged.device.batch import RowInput
from paged.errors import InvalidConfigError

# how sampled rows accept drafts: rejection sampling; sample-then-match with a draft model's draws coupled to the
# target's; sample-then-match against greedy drafts, as ExLlamaV2 (`accept_drafts`, `paged.speculation.draft`)
ACCEPTANCE_RULES = ("rejection", "match", "exllamav2")
MAX_DRAFT_TOKENS = 64  # the most drafts a row verifies per step: its program is that wide (k + 1 query tokens a row)


@dataclasses.dataclass
class SpecRow:
    """One row of the scheduler's step, as the speculator needs to see it."""

    key: Hashable  # the job (per-job drafter state is kept under it until `release`)
    row: RowInput  # the scheduler's row
    sequence: Sequence[int]  # the job's tokens so far, prompt + output (`row.tokens` are its last ones)
    max_drafts: int = 0  # drafts this row may verify (0: a prefill chunk, or no room left)
    bias_at: Callable[[int], Mapping[int, float] | None] | None = None  # bias at draft offset j >= 1 (None: row's)
    penalty_window: int = 0  # the job's history window: penalties and DRY (0: none)
    host_drafts: bool = False  # a draft model's drafts must reach the host before verification (a grammar's masks
    # follow them; a row with a `penalty_window` or a history needs them too, which `plan` sees by itself)


@dataclasses.dataclass
class Proposal:
    """A drafter's answer for one step's rows (`Drafter.propose`), by row: `want` the drafts to verify (at most what
    was asked), `drafts` the tokens on the host (None: only on the device, `on_device`, i32 `[R, k]` by the target's
    batch row), `classes` each row's evidence class for the adaptive gate (the length of prompt lookup's match, a
    corpus draft's is negative, 0: no evidence), `draft_logprobs` the distributions the drafts were drawn from
    (`[S', k, V]` by batch row) where the target's rejection sampling needs them."""

    want: list[int]
    drafts: list[list[int]] | None
    classes: list[int]
    draft_logprobs: Any = None
    on_device: Any = None


@dataclasses.dataclass
class SpecPlan:
    """`Speculator.plan`'s answer: the rows to run (`engine.run(plan.rows, draft_logprobs=plan.draft_logprobs,
    draft_tokens=plan.draft_tokens)`). With a draft model the verification rows' draft tokens are placeholders
    (zeros) unless a drafting row needed them on the host (`SpecRow.host_drafts`, a penalty window or history):
    the drafts themselves are `draft_tokens`, on the device, and the accepted ones come back in the step's tokens."""

    rows: list[RowInput]
    draft_logprobs: jax.Array | None
    inputs: list[SpecRow]
    num_drafts: list[int]  # drafts verified per row (0: an ordinary row)
    classes: list[int] | None = None  # each row's evidence class (n-gram match length, < 0 a corpus's; 0 a model)
    draft_tokens: jax.Array | None = None  # a draft model's drafts on the device (`engine.run(draft_tokens=)`)

    @property
    def verifying(self) -> bool:
        return any(self.num_drafts)


@dataclasses.dataclass
class Accepted:
    """What one row of a step produced: `tokens` to feed the job in order (none for a prefill chunk that does not
    sample), with the target's `logprobs`, `top_ids` / `top_logprobs` ([n, K]) and `logits` ([n, V] or None) at
    each; `kv_advance` tokens of the row now have valid KV."""

    tokens: list[int]
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    logits: np.ndarray | None
    kv_advance: int
    num_drafted: int = 0
    num_accepted: int = 0
    corpus: bool = False  # drafted from the n-gram drafter's corpus table (its own statistics)


# a draft model samples with seed ^ this: its draws are independent of the target's (rejection sampling); with
# sample-then-match it draws with the seed itself, coupled with the target's draws (`paged.speculation.draft`)
DRAFT_SEED_SALT = 0x5D2AF7E3


def check_num_draft_tokens(k: Any, max_seq_len: int | None = None) -> None:
    """`InvalidConfigError` unless 1 <= k <= MAX_DRAFT_TOKENS and k < max_seq_len (when known): a verification
    program is k + 1 tokens a row wide, so an unbounded k would compile (and allocate) without limit."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidConfigError(f"num_draft_tokens must be an int >= 1, got {k!r}")
    if k > MAX_DRAFT_TOKENS:
        raise InvalidConfigError(f"num_draft_tokens={k} exceeds the maximum of {MAX_DRAFT_TOKENS} (each verification "
                                 "row is num_draft_tokens + 1 tokens wide); 2-8 is the useful range")
    if max_seq_len is not None and k >= max_seq_len:
        raise InvalidConfigError(f"num_draft_tokens={k} must be below max_seq_len={max_seq_len} (a row verifies its "
                                 "drafts inside the sequence)")


def verification_row(spec: SpecRow, drafts: Sequence[int]) -> RowInput:
    """The verification row of a decode row: its token and the drafts, sampling at every position, with the
    penalty history and bias of each position (`SpecRow.penalty_window`, `SpecRow.bias_at`)."""
    row = spec.row
    drafts = [int(t) for t in drafts]
    hist = None
    if spec.penalty_window and len(row.history):
        base = list(spec.sequence[-spec.penalty_window :])
        hist = [(base + drafts[:j])[-spec.penalty_window :] for j in range(len(drafts) + 1)]
    bias = None
    if spec.bias_at is not None:
        bias = [row.bias] + [spec.bias_at(j) for j in range(1, len(drafts) + 1)]
    return dataclasses.replace(row, tokens=[*row.tokens, *drafts], verify=True, position_history=hist,
                               position_bias=bias)
