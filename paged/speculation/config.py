"""`SpeculationConfig`: how a generator speculates, in one frozen value validated once.

`DynamicGenerator(draft_model=..., use_ngram_draft=..., num_draft_tokens=..., ...)` builds it with
`SpeculationConfig.of(...)` (None without a drafter), and the speculation objects take it whole
(`SpeculativeStep`, `Speculator`, `DraftModel`) instead of eight loose keyword arguments each checking them again.
The draft model itself is weights, not configuration: it is handed in beside the config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from paged.device.config import Verification
from paged.errors import InvalidConfigError
from paged.speculation.ngram_corpus import check_corpus_type
from paged.speculation.rows import ACCEPTANCE_RULES, check_num_draft_tokens

DRAFTERS = ("ngram", "model")


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    """`drafter`: "ngram" (prompt lookup over the job's own tokens, `max_ngram`; with `ngram_corpus` also a table of
    the model's habits) or "model" (a draft model). `num_draft_tokens` k: drafts per decoding row and step (1 to
    `MAX_DRAFT_TOKENS`). `adaptive`: verify only where the drafts are expected to pay (`draft_gate`, with
    `draft_token_cost` its rho; None: the backend's measured default). `acceptance`: how sampled rows accept drafts
    (`ACCEPTANCE_RULES`). Every field is checked here (`InvalidConfigError`)."""

    drafter: str
    num_draft_tokens: int = 4
    max_ngram: int = 4
    adaptive: bool = False
    draft_token_cost: float | None = None
    acceptance: str = "rejection"
    ngram_corpus: Any = dataclasses.field(default=None, compare=False)  # an NgramCorpus or the path of one

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise InvalidConfigError(f"speculation: drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        check_num_draft_tokens(self.num_draft_tokens)
        m = self.max_ngram
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidConfigError(f"max_ngram must be an int >= 1, got {m!r}")
        if not isinstance(self.adaptive, bool):
            raise InvalidConfigError(f"adaptive_draft must be a bool, got {self.adaptive!r}")
        c = self.draft_token_cost
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0):
            raise InvalidConfigError(f"draft_token_cost must be a finite number >= 0 (the cost of one query token "
                                     f"over a step's fixed cost) or None, got {c!r}")
        if c is not None and not self.adaptive:
            raise InvalidConfigError("draft_token_cost applies to adaptive_draft=True only")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise InvalidConfigError(f"draft_acceptance must be one of {ACCEPTANCE_RULES} (lossless rejection "
                                     f"sampling, sample-then-match with coupled draws, or with greedy drafts as "
                                     f"ExLlamaV2), got {self.acceptance!r}")
        if self.ngram_corpus is not None:
            if self.drafter != "ngram":
                raise InvalidConfigError("ngram_corpus is the n-gram drafter's table: pass it with "
                                         "use_ngram_draft=True")
            check_corpus_type(self.ngram_corpus)

    def verification(self) -> Verification:
        """The role the target engine needs (`EngineConfig.verification`): verification rows of up to
        `num_draft_tokens` drafts; a draft model's drafts read on the device (`fed_drafts`) and, under rejection
        sampling, with their distributions (`draft_probs`); sample-then-match acceptance (`match`) otherwise."""
        model = self.drafter == "model"
        return Verification(self.num_draft_tokens, draft_probs=model and self.acceptance == "rejection",
                            match=self.acceptance != "rejection", fed_drafts=model)

    @classmethod
    def of(cls, *, draft_model: Any = None, use_ngram_draft: Any = False, num_draft_tokens: Any = 4,
           max_ngram: Any = 4, adaptive: Any = False, draft_token_cost: Any = None, acceptance: Any = "rejection",
           ngram_corpus: Any = None) -> SpeculationConfig | None:
        """The config of the generator's speculation arguments, or None when it has no drafter (then the
        drafter-only arguments must be left at their defaults)."""
        if not isinstance(use_ngram_draft, bool):
            raise InvalidConfigError(f"use_ngram_draft must be a bool, got {use_ngram_draft!r}")
        if draft_model is not None and use_ngram_draft:
            raise InvalidConfigError("speculative decoding takes one drafter: pass draft_model= or "
                                     "use_ngram_draft=True, not both")
        if draft_model is None and not use_ngram_draft:
            check_num_draft_tokens(num_draft_tokens)  # (checked even unused: a typo should not pass silently)
            if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 1:
                raise InvalidConfigError(f"max_ngram must be an int >= 1, got {max_ngram!r}")
            if not isinstance(adaptive, bool):
                raise InvalidConfigError(f"adaptive_draft must be a bool, got {adaptive!r}")
            if adaptive or draft_token_cost is not None:
                raise InvalidConfigError("adaptive_draft / draft_token_cost need a drafter (draft_model= or "
                                         "use_ngram_draft=True)")
            if acceptance != "rejection":
                if acceptance not in ACCEPTANCE_RULES:
                    raise InvalidConfigError(f"draft_acceptance must be one of {ACCEPTANCE_RULES}, got "
                                             f"{acceptance!r}")
                raise InvalidConfigError("draft_acceptance needs a drafter (draft_model= or use_ngram_draft=True)")
            if ngram_corpus is not None:
                raise InvalidConfigError("ngram_corpus is the n-gram drafter's table: pass it with "
                                         "use_ngram_draft=True")
            return None
        return cls(drafter="model" if draft_model is not None else "ngram", num_draft_tokens=num_draft_tokens,
                   max_ngram=max_ngram, adaptive=adaptive, draft_token_cost=draft_token_cost, acceptance=acceptance,
                   ngram_corpus=ngram_corpus)


__all__ = ["DRAFTERS", "SpeculationConfig"]
