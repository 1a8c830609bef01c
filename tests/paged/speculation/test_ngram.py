"""The n-gram (prompt lookup) drafter: longest suffix match, most recent occurrence, incremental updates and
rewinds agree with a from-scratch rebuild."""

from __future__ import annotations

import numpy as np
import pytest

from paged.speculation.ngram import NgramIndex


def brute(tokens: list[int], max_ngram: int, k: int) -> list[int]:
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence, not the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_longest_suffix_wins_and_the_most_recent_occurrence():
    idx = NgramIndex(max_ngram=3)
    idx.append([1, 2, 3, 9, 2, 3, 7, 5, 1, 2, 3])
    assert idx.propose(2) == [9, 2]  # (1, 2, 3) matched at the start beats the more recent (2, 3) -> 7
    idx.append([4])
    assert idx.propose(3) == []  # 4 never occurred before
    idx.append([2, 3])
    assert idx.propose(2) == [4, 2]  # (4, 2, 3) is new; (2, 3) last occurred at 9..10, followed by 4, 2
    assert NgramIndex(2).propose(4) == []


@pytest.mark.parametrize("max_ngram", [1, 2, 4])
def test_incremental_updates_and_rewinds_match_a_rebuild(max_ngram):
    rng = np.random.default_rng(max_ngram)
    idx = NgramIndex(max_ngram)
    seq: list[int] = []
    for _ in range(300):
        if seq and rng.random() < 0.15:
            seq = seq[: int(rng.integers(0, len(seq) + 1))]  # rewind / truncation
        else:
            seq = seq + rng.integers(0, 5, size=int(rng.integers(1, 4))).tolist()
        idx.sync(seq)
        assert idx.tokens == seq
        k = int(rng.integers(1, 5))
        assert idx.propose(k) == brute(seq, max_ngram, k)
        fresh = NgramIndex(max_ngram)
        fresh.append(seq)
        assert fresh._next == idx._next


def test_sync_detects_a_same_length_change_at_the_end():
    idx = NgramIndex(2)
    idx.sync([1, 2, 3, 1, 2])
    idx.sync([1, 2, 3, 1, 4])
    assert idx.tokens == [1, 2, 3, 1, 4] and idx.propose(1) == []
