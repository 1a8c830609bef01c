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
from collections.abc import Sequence


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


@dataclasses.dataclass
class Replay:
    tokens: int = 0  # output tokens
    steps: int = 0  # engine steps for them (the prefill step that emits the first one included)
    verifications: int = 0  # steps that verified at least one draft
    drafted: int = 0
    accepted: int = 0

    def add(self, other: Replay) -> Replay:
        return Replay(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def speedup(self, verify_cost: float) -> float:
        """Plain decoding's steps (one per token) over this drafter's, a verification step costing `verify_cost`."""
        cost = self.steps - self.verifications + verify_cost * self.verifications
        return self.tokens / cost if cost else 1.0


def replay(prompt: Sequence[int], output: Sequence[int], k: int, max_ngram: int, max_new_tokens: int) -> Replay:
    """The steps a fixed n-gram drafter (k drafts, suffixes up to `max_ngram`) takes to emit a known greedy `output`
    after `prompt`, with no model: the prefill step emits the first token; every later step drafts up to
    min(k, max_new_tokens - new_tokens - 1) tokens (as `paged.spec_step` allows), greedy verification accepts the
    longest prefix the output continues with, and the step emits it plus one token. A step without a match is a
    plain decode step (page room never limits drafts here: right for the default `reserve` page allocation, an upper
    bound under `on_demand`). `experiments/ngram_bound.py` uses it to bound what prompt lookup can gain on a
    workload."""
    r = Replay(tokens=len(output))
    if not output:
        return r
    index = NgramIndex(max_ngram)
    index.append(list(prompt) + [output[0]])
    r.steps, i = 1, 1  # the prefill step samples the first token
    while i < len(output):
        drafts = index.propose(max(0, min(k, max_new_tokens - i - 1)))
        a = 0
        while a < len(drafts) and i + a < len(output) and drafts[a] == output[i + a]:
            a += 1
        emitted = min(a + 1, len(output) - i)
        r.steps += 1
        r.verifications += bool(drafts)
        r.drafted += len(drafts)
        r.accepted += a
        index.append(output[i : i + emitted])
        i += emitted
    return r
