"""The drafters behind one protocol: `Drafter` is what `paged.speculation.speculator.Speculator` asks for each step's
drafts, `NgramDrafter` proposes by prompt lookup over the job's own tokens (with an optional corpus table:
`paged.speculation.ngram_corpus`), `paged.speculation.draft.DraftModel` by running a draft model, and
`make_drafter` builds the one a `SpeculationConfig` names. A new drafter implements `Drafter` and is handed to the
`Speculator`."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from paged.errors import InvalidConfigError
from paged.speculation.config import SpeculationConfig
from paged.speculation.draft import DraftModel
from paged.speculation.ngram import NgramIndex
from paged.speculation.ngram_corpus import NgramCorpus, load_corpus, propose_lookup
from paged.speculation.rows import Accepted, Proposal, SpecRow, check_num_draft_tokens


@runtime_checkable
class Drafter(Protocol):
    """What the speculator needs of a drafter. `gate_first`: the adaptive gate decides before drafting (a draft costs
    a forward: a draft model) rather than after (drafts are free and their evidence informs the gate: prompt
    lookup). `propose(target, specs, want, host)` drafts up to `want[i]` tokens for row i (`host`: the drafts are
    needed on the host before the step); a drafter that keeps a cache sees every row, `want` 0 or not.
    `accepted(spec, item, num_drafted)` is told each row's outcome; `release(key)` forgets a job; `warmup` compiles
    what it runs; `stats()` adds its counters to the speculator's; `step_cost(target)` is what one drafting step
    costs in target steps (the adaptive gate's price of drafting)."""

    gate_first: bool

    def propose(self, target: Any, specs: Sequence[SpecRow], want: list[int], host: bool) -> Proposal: ...

    def accepted(self, spec: SpecRow, item: Accepted, num_drafted: int) -> None: ...

    def release(self, key: Hashable) -> None: ...

    def warmup(self, progress: bool = False) -> int: ...

    def stats(self) -> dict: ...

    def step_cost(self, target: Any) -> float: ...


class NgramDrafter:
    """Prompt lookup: the continuation of the longest suffix (up to `max_ngram` tokens) of the job's sequence that
    occurred before in it (`paged.speculation.ngram.NgramIndex`, one per job); with `corpus`, the table's most
    frequent continuation where the job's own match is shorter (`propose_lookup`)."""

    gate_first = False

    def __init__(self, max_ngram: int, corpus: NgramCorpus | None = None):
        self.max_ngram = max_ngram
        self.corpus = corpus
        self._index: dict[Hashable, NgramIndex] = {}

    def propose(self, target: Any, specs: Sequence[SpecRow], want: list[int], host: bool = True) -> Proposal:
        found = [self._lookup(s, n) if n else ([], 0) for s, n in zip(specs, want)]
        drafts = [d for d, _ in found]
        return Proposal(want=[len(d) for d in drafts], drafts=drafts, classes=[c for _, c in found])

    def _lookup(self, spec: SpecRow, n: int) -> tuple[list[int], int]:
        index = self._index.get(spec.key)
        if index is None:
            index = self._index[spec.key] = NgramIndex(self.max_ngram)
        index.sync(spec.sequence)
        return propose_lookup(index, self.corpus, n)

    def accepted(self, spec: SpecRow, item: Accepted, num_drafted: int) -> None:
        pass  # the index follows the job's sequence itself

    def release(self, key: Hashable) -> None:
        self._index.pop(key, None)

    def warmup(self, progress: bool = False) -> int:
        return 0

    def stats(self) -> dict:
        return {}

    def step_cost(self, target: Any) -> float:
        return 0.0  # a lookup on the host


def check_verification(target: Any, config: SpeculationConfig) -> None:
    """`InvalidConfigError` unless the target engine was built for this speculation's verification
    (`EngineConfig(verification=config.verification())`): an engine's roles are fixed when it is built."""
    want = config.verification()
    have = getattr(getattr(target, "config", None), "verification", None)
    if have != want:
        built = "without verification" if have is None else f"with verification={have}"
        raise InvalidConfigError(f"the engine ({type(target).__name__}) was built {built}; this speculation needs "
                                 f"one built with EngineConfig(verification={want}) (SpeculationConfig.verification())")


def check_target(target: Any, config: SpeculationConfig) -> None:
    """`InvalidConfigError` unless `target` can verify what `config` drafts: `num_draft_tokens` below its
    `max_seq_len`, and built for this verification (`check_verification`)."""
    check_num_draft_tokens(config.num_draft_tokens, getattr(getattr(target, "config", None), "max_seq_len", None))
    check_verification(target, config)


def make_drafter(config: SpeculationConfig, target: Any, *, draft_model: Any = None,
                 tokenizer: Any = None) -> Drafter:
    """The drafter `config` names for `target` (the engine it drafts for): a `DraftModel` of `draft_model` (drafting
    greedily under the ExLlamaV2 rule, with the target's keys under sample-then-match), or an `NgramDrafter` with
    the config's corpus loaded. `target` is checked first (`check_target`)."""
    check_target(target, config)
    if (config.drafter == "model") != (draft_model is not None):
        raise InvalidConfigError(f"Speculator: drafter={config.drafter!r} "
                                 + ("needs the draft model (draft_model=)" if draft_model is None else
                                    "takes no draft model (its drafter is prompt lookup)"))
    if config.drafter == "model":
        return DraftModel(target, draft_model, config.num_draft_tokens, tokenizer=tokenizer,
                          coupled=config.acceptance == "match", greedy=config.acceptance == "exllamav2")
    corpus = None if config.ngram_corpus is None else load_corpus(config.ngram_corpus, target.vocab_size)
    return NgramDrafter(config.max_ngram, corpus)


__all__ = ["Drafter", "NgramDrafter", "Proposal", "check_target", "check_verification", "make_drafter"]
