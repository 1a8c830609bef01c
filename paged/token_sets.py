"""Per-job token sets the sampler reads on the device (DRY's sequence breakers, XTC's exempt tokens), packed as
bits: token t is bit t % 32 of int32 word t // 32 (the layout of constrained decoding's token masks)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

# ExLlamaV2's defaults: DRY's sequence breakers are the tokens whose text holds any of these characters, XTC never
# excludes tokens holding a newline; special tokens are in both sets.
DRY_BREAKER_CHARS = b'.,!?<>[](){}\n\t"'
XTC_EXEMPT_CHARS = b"\n"


def pack(ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """i32 [ceil(V/32)]: the set `ids` (each in [0, V)) as bits."""
    bits = np.zeros(-(-vocab_size // 32) * 32, np.uint8)
    ids = np.fromiter((int(t) for t in ids), np.int64)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


def unpack(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids in a packed set, ascending."""
    bits = np.unpackbits(np.asarray(words, np.int32).view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def tokens_with_chars(tokenizer: Any, vocab_size: int, chars: bytes) -> list[int]:
    """Ids whose bytes contain any of `chars`, plus the tokenizer's special tokens (ids the tokenizer does not
    have, in a model vocabulary padded beyond it, are in neither)."""
    special = set(getattr(tokenizer, "special_token_ids", ()))
    wanted = set(chars)
    out = []
    for t in range(min(vocab_size, getattr(tokenizer, "vocab_size", vocab_size))):
        if t in special or not wanted.isdisjoint(tokenizer.token_bytes(t)):
            out.append(t)
    return out


class TokenSets:
    """The generator's packed sets, the tokenizer defaults computed once on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._defaults: dict[bytes, np.ndarray] = {}

    def get(self, ids: Iterable[int] | None, default_chars: bytes) -> np.ndarray:
        """`ids` packed, or (None) the tokenizer's tokens holding any of `default_chars` and its special tokens."""
        if ids is not None:
            return pack(ids, self.vocab_size)
        if default_chars not in self._defaults:
            self._defaults[default_chars] = pack(tokens_with_chars(self.tokenizer, self.vocab_size, default_chars),
                                                 self.vocab_size)
        return self._defaults[default_chars]
