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
