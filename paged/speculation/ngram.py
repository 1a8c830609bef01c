"""N-gram (prompt lookup) drafting: propose the tokens that followed the most recent earlier occurrence of the
longest suffix (up to `max_ngram` tokens) of a job's prompt + output.

`NgramIndex` is incremental: for every n <= max_ngram it maps each n-gram of the sequence to the positions right
after its occurrences (a stack, most recent last). Appending a token registers the n-grams that end just before
it (O(max_ngram)); a proposal looks the current suffix up, longest first (O(max_ngram + k)); truncating (a
banned-string rewind, or the generator taking tokens back) pops exactly what the removed tokens registered
(O(removed * max_ngram)). The suffix itself is never its own match: an n-gram is registered only once the token
after it exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from paged.speculation.ngram_corpus import propose_lookup


class NgramIndex:
    def __init__(self, max_ngram: int = 4):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of the token after it, ascending

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            i = len(self.tokens)  # the new token's position: n-grams ending at i - 1 now have a successor
            self.tokens.append(int(t))
            for n in range(1, min(self.max_ngram, i) + 1):
                self._next.setdefault(tuple(self.tokens[i - n : i]), []).append(i)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        while len(self.tokens) > max(length, 0):
            i = len(self.tokens) - 1
            for n in range(1, min(self.max_ngram, i) + 1):
                key = tuple(self.tokens[i - n : i])
                stack = self._next[key]
                stack.pop()  # i is its most recent entry
                if not stack:
                    del self._next[key]
            self.tokens.pop()

    def sync(self, sequence: Sequence[int]) -> None:
        """Make the index hold `sequence`: truncate to the longest common prefix (checked from the end, so O(1)
        when only appends happened), then append the rest."""
        n = min(len(self.tokens), len(sequence))
        while n and self.tokens[n - 1] != sequence[n - 1]:
            n -= 1
        if n < len(self.tokens):
            self.truncate(n)
        if len(sequence) > len(self.tokens):
            self.append(sequence[len(self.tokens) :])

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the longest matching suffix
        (empty if no suffix of length >= 1 occurred before)."""
        return self.propose_match(k)[0]

    def propose_match(self, k: int) -> tuple[list[int], int]:
        """`propose(k)` and the length of the suffix that matched (0: none)."""
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks)), 0, -1):
            stack = self._next.get(tuple(toks[len(toks) - n :]))
            if stack:
                start = stack[-1]
                return toks[start : start + k], n
        return [], 0


REPLAY_POLICIES = ("all", "grow", "gate", "oracle")


@dataclasses.dataclass
class Replay:
    tokens: int = 0  # output tokens
    steps: int = 0  # engine steps for them (the prefill step that emits the first one included)
    verifications: int = 0  # steps that verified at least one draft
    drafted: int = 0  # drafts verified
    accepted: int = 0
    verified: dict[int, int] = dataclasses.field(default_factory=dict)  # drafts in a verification -> such steps
    corpus_drafted: int = 0  # of `drafted`, those a corpus table proposed (`corpus=`)
    corpus_accepted: int = 0

    def add(self, other: Replay) -> Replay:
        counts = dict(self.verified)
        for m, n in other.verified.items():
            counts[m] = counts.get(m, 0) + n
        return Replay(self.tokens + other.tokens, self.steps + other.steps, self.verifications + other.verifications,
                      self.drafted + other.drafted, self.accepted + other.accepted, counts,
                      self.corpus_drafted + other.corpus_drafted, self.corpus_accepted + other.corpus_accepted)

    def speedup(self, verify_cost: float) -> float:
        """Plain decoding's steps (one per token) over this drafter's, a verification step costing `verify_cost`."""
        return self.speedup_by(lambda m: verify_cost)

    def speedup_by(self, cost: Callable[[int], float]) -> float:
        """The same, a verification step of m drafts costing `cost(m)` plain steps."""
        total = self.steps - self.verifications + sum(n * cost(m) for m, n in self.verified.items())
        return self.tokens / total if total else 1.0


def replay(prompt: Sequence[int], output: Sequence[int], k: int, max_ngram: int, max_new_tokens: int,
           policy: str = "all", min_match: int = 1, gate: Any = None, corpus: Any = None) -> Replay:
    """The steps an n-gram drafter (up to k drafts, suffixes up to `max_ngram`) takes to emit a known greedy `output`
    after `prompt`, with no model: the prefill step emits the first token; every later step proposes up to
    min(k, max_new_tokens - new_tokens - 1) tokens (as `paged.speculation.spec_step` allows), verifies some of them
    (`policy`),
    and greedy verification accepts the longest verified prefix the output continues with; the step emits it plus
    one token. A step that verifies nothing (no match, a match shorter than `min_match`, or the policy's choice) is a
    plain decode step. Policies, for the number of proposed drafts a step verifies:

    - "all": every one (the generator's fixed drafter);
    - "grow": at most g per job, g = 1 at first, doubled after a step accepts all it verified, else accepted + 1;
    - "gate": all of them or none, as `gate` (a `paged.speculation.draft_gate.DraftGate`, the generator's
    `adaptive_draft`
      rule; pass one gate for a workload's prompts, as one generator runs them) decides at batch 1 with the match
      length as the evidence class; it learns from each verification's outcome;
    - "oracle": exactly those the output continues with (a bound: no policy with this drafter verifies better).

    `corpus`: a `paged.speculation.ngram_corpus.NgramCorpus` that drafts where prompt lookup's match is short, as in a
    generator given `ngram_corpus=` (`paged.speculation.ngram_corpus.propose_lookup`); its drafts' evidence classes are
    negative, and `min_match` applies to prompt lookup's only.

    Page room never limits drafts here: right for the default `reserve` page allocation, an upper bound under
    `on_demand`. `experiments/ngram_bound.py` uses it to bound what prompt lookup can gain on a workload."""
    if policy not in REPLAY_POLICIES:
        raise ValueError(f"policy must be one of {REPLAY_POLICIES}, got {policy!r}")
    if (policy == "gate") != (gate is not None):
        raise ValueError("policy 'gate' takes a gate (paged.speculation.draft_gate.DraftGate), the other policies none")
    key = object()  # this output's job, for the gate
    r = Replay(tokens=len(output))
    if not output:
        return r
    index = NgramIndex(max_ngram)
    index.append(list(prompt) + [output[0]])
    r.steps, i = 1, 1  # the prefill step samples the first token
    grow = 1
    while i < len(output):
        drafts, n = propose_lookup(index, corpus, max(0, min(k, max_new_tokens - i - 1)))
        run = 0  # how many of the proposed drafts the output continues with
        while run < len(drafts) and i + run < len(output) and drafts[run] == output[i + run]:
            run += 1
        if 0 <= n < min_match:
            m = 0
        elif policy == "gate":
            m = len(drafts) if drafts and gate.decide([(key, n, len(drafts))], 1) else 0
        else:
            m = {"all": len(drafts), "grow": min(grow, len(drafts)), "oracle": run}[policy]
        a = min(run, m)
        if m:
            if gate is not None:
                gate.record(key, n, m, a)
            r.verifications += 1
            r.verified[m] = r.verified.get(m, 0) + 1
            grow = 2 * grow if a == m else a + 1
        r.steps += 1
        r.drafted += m
        r.accepted += a
        if n < 0:  # the corpus proposed them
            r.corpus_drafted += m
            r.corpus_accepted += a
        emitted = min(a + 1, len(output) - i)
        index.append(output[i : i + emitted])
        i += emitted
    if gate is not None:
        gate.release(key)
    return r
