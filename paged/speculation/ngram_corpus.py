"""A corpus n-gram table for the n-gram drafter: the continuations the model itself tends to write, for the steps
where prompt lookup has nothing to offer.

Prompt lookup (`paged.speculation.ngram.NgramIndex`) drafts only what the job's own prompt + output already holds.
Where the
model writes new text (open chat, a paraphrase) it finds no match, or only a 1-token one, which is rarely right. An
`NgramCorpus` is a static table built beforehand from a body of token sequences, best the model's own answers to
other prompts (`experiments/build_ngram_corpus.py`): for every context of `min_ngram`..`max_ngram` tokens seen in
it, the token that most often followed, with that token's count and the context's total. A proposal chains it: the
longest context of the job's suffix found in the table gives the next draft, which extends the suffix for the one
after, and the chain stops where the product of the drafts' confidences (count / total) falls under
`min_confidence`, or where no context matches. (llama.cpp's lookup decoding keeps such a static cache next to its
context lookup; REST retrieves continuations from a datastore the same way.)

`propose_lookup` is the drafter of a generator given `ngram_corpus=`: prompt lookup first; where its match is
shorter than `CORPUS_BELOW` tokens (none, or a single token), the corpus's chain instead, if it has one. The
evidence class the adaptive gate learns per (`paged.speculation.draft_gate`) is the prompt-lookup match length
(1..max_ngram) as
before, or for a corpus draft `-1 - b` with b the bucket of its first draft's confidence (`CONFIDENCE_BUCKETS`): -1
below 0.3, -2 below 0.6, -3 below 0.9, -4 from 0.9.

Drafts are token ids, one-hot as prompt lookup's: verification and every acceptance rule treat them alike. Greedy
output is the model's whatever the corpus holds, token for token; sampled output keeps its distribution, and with
`draft_acceptance="match"` a seeded job's tokens (under rejection sampling which random draws a token takes
depends on what was drafted).

The table is saved as a `.npz` (`save`, `load`): per order n, the contexts `[M, n]`, their top token, its count and
the context's total, with the vocabulary size it was built for (the generator checks it against the model's; a
table from another tokenizer of the same size would only draft badly).
"""

from __future__ import annotations

import operator
import os
import zipfile
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from paged.errors import InvalidConfigError, InvalidConfigTypeError

CORPUS_BELOW = 2  # prompt lookup matches shorter than this give way to the corpus
CONFIDENCE_BUCKETS = (0.3, 0.6, 0.9)  # bucket edges of a corpus draft's evidence class
FORMAT = "paged.speculation.ngram_corpus/1"


class NgramCorpusError(InvalidConfigError):
    """A corpus file or table that cannot be used (bad format, token ids outside its vocabulary)."""


# In memory a context is a 64-bit hash (its tokens in a polynomial, the order mixed in), mapped to one packed int
# (token | count << 20 | total << 42): 45 MB for the 330k contexts of the default table with their arrays, where
# tuples of token ids took ~125 MB. The hash is linear modulo 2**64, so two contexts can share a key (rarely for
# real text; more easily with vocabularies past ~189k tokens): that only costs a wrong draft, which verification
# rejects.
_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3
_MIX = 0x9E3779B97F4A7C15
_POW = [pow(_PRIME, i, 1 << 64) for i in range(64)]
MAX_NGRAM = len(_POW)  # the longest context a table holds
_TOKEN_BITS, _COUNT_BITS = 20, 22
MAX_VOCAB = 1 << _TOKEN_BITS


def _context_keys(contexts: np.ndarray) -> np.ndarray:
    """The hash of each row of `contexts` `[M, n]` (uint64 arithmetic wraps, as `_suffix_keys`'s masking)."""
    m, n = contexts.shape
    h = np.zeros(m, np.uint64)
    for i in range(n):  # the last token gets power 0
        h += (contexts[:, n - 1 - i].astype(np.uint64) + np.uint64(1)) * np.uint64(_POW[i])
    return h + np.uint64((n * _MIX) & _MASK)


def _pack(values: np.ndarray) -> np.ndarray:
    """(token, count, total) rows as one int each; counts past 22 bits are scaled down together (the confidence
    keeps 6 significant digits)."""
    tok, count, total = (values[:, i].astype(np.int64) for i in range(3))
    big = total >= (1 << _COUNT_BITS)
    if big.any():
        scale = ((1 << _COUNT_BITS) - 1) / total[big]
        count[big] = np.maximum(1, np.round(count[big] * scale)).astype(np.int64)
        total[big] = (1 << _COUNT_BITS) - 1
    tok, count, total = (x.astype(np.uint64) for x in (tok, count, total))  # 20 + 22 + 22 bits: all of a uint64
    return tok | (count << np.uint64(_TOKEN_BITS)) | (total << np.uint64(_TOKEN_BITS + _COUNT_BITS))


class NgramCorpus:
    """The most frequent continuation of every context of `min_ngram`..`max_ngram` tokens of a corpus (see the
    module docstring). Build with `NgramCorpus.build`, or `load` a saved one.

    `arrays[n]` holds the contexts of n tokens (i32 `[M, n]`) and, per context, its top token, that token's count
    and the context's total (i64 `[M, 3]`); `lookup` reads them through a hashed index. Contexts whose top token was
    seen fewer than `min_count` times are left out (most contexts are seen once, and a single sighting predicts
    poorly). `min_confidence`: a proposal's chain stops where the product of its drafts' count / total falls under
    it."""

    def __init__(self, arrays: dict[int, tuple[np.ndarray, np.ndarray]], vocab_size: int, min_ngram: int,
                 max_ngram: int, min_count: int, corpus_tokens: int, min_confidence: float = 0.3):
        if not 1 <= min_ngram <= max_ngram <= MAX_NGRAM:
            raise NgramCorpusError(f"NgramCorpus: need 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}, got {min_ngram}, "
                                   f"{max_ngram}")
        if not 0.0 <= min_confidence <= 1.0:
            raise NgramCorpusError(f"NgramCorpus: min_confidence must be in [0, 1], got {min_confidence}")
        if not 0 < vocab_size <= MAX_VOCAB:
            raise NgramCorpusError(f"NgramCorpus: vocab_size must be in 1..{MAX_VOCAB}, got {vocab_size}")
        if sorted(arrays) != list(range(min_ngram, max_ngram + 1)):
            raise NgramCorpusError(f"NgramCorpus: arrays for orders {min_ngram}..{max_ngram} expected, got "
                                   f"{sorted(arrays)}")
        self.arrays = {}
        for n, (c, v) in arrays.items():
            c, v = np.asarray(c), np.asarray(v)
            if any(x.size and not np.issubdtype(x.dtype, np.integer) for x in (c, v)):
                raise NgramCorpusError(f"NgramCorpus: contexts of {n} tokens: integer arrays expected, got "
                                       f"{c.dtype} and {v.dtype}")
            if c.size % n or v.size % 3:
                raise NgramCorpusError(f"NgramCorpus: contexts of {n} tokens: {c.size} context entries (a multiple of "
                                       f"{n} expected) and {v.size} value entries (a multiple of 3)")
            c, v = c.astype(np.int64).reshape(-1, n), v.astype(np.int64).reshape(-1, 3)
            if len(c) != len(v):
                raise NgramCorpusError(f"NgramCorpus: {len(c)} contexts of {n} tokens but {len(v)} value rows")
            self.arrays[n] = (c, v)
        self.vocab_size = int(vocab_size)
        self.min_ngram = int(min_ngram)
        self.max_ngram = int(max_ngram)
        self.min_count = int(min_count)
        self.corpus_tokens = int(corpus_tokens)
        self.min_confidence = float(min_confidence)
        for n, (c, v) in list(self.arrays.items()):
            if c.size and (c.min() < 0 or c.max() >= vocab_size or v[:, 0].min() < 0 or v[:, 0].max() >= vocab_size):
                raise NgramCorpusError(f"NgramCorpus: contexts of {n} tokens hold token ids outside the vocabulary "
                                       f"of {vocab_size}")
            if v.size and ((v[:, 1] < 1).any() or (v[:, 2] < v[:, 1]).any()):
                raise NgramCorpusError(f"NgramCorpus: contexts of {n} tokens need 1 <= count <= total")
            self.arrays[n] = (c.astype(np.int32), v)
        self._index: dict[int, int] = {}
        for c, v in self.arrays.values():
            self._index.update(zip(_context_keys(c).tolist(), _pack(v).tolist()))

    def __len__(self) -> int:
        return sum(len(c) for c, _ in self.arrays.values())

    def entries(self, n: int) -> dict[tuple[int, ...], tuple[int, int, int]]:
        """The contexts of `n` tokens as a dict, context -> (top token, its count, the context's total): to inspect
        a table (built on each call)."""
        c, v = self.arrays.get(n, (np.zeros((0, n), np.int32), np.zeros((0, 3), np.int64)))
        return dict(zip(map(tuple, c.tolist()), map(tuple, v.tolist())))

    def __repr__(self) -> str:
        return (f"NgramCorpus({len(self)} contexts of {self.min_ngram}-{self.max_ngram} tokens from "
                f"{self.corpus_tokens} tokens, vocab {self.vocab_size}, min_count {self.min_count})")

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], vocab_size: int, *, min_ngram: int = 2, max_ngram: int = 6,
              min_count: int = 2, min_confidence: float = 0.3) -> NgramCorpus:
        """Count every context of `min_ngram`..`max_ngram` tokens of each sequence (no context crosses from one
        sequence into the next) and keep its most frequent continuation (ties: the smaller token id)."""
        if min_count < 1:
            raise NgramCorpusError(f"NgramCorpus.build: min_count must be >= 1, got {min_count}")
        if not 1 <= min_ngram <= max_ngram <= MAX_NGRAM:
            raise NgramCorpusError(f"NgramCorpus.build: need 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}, got "
                                   f"{min_ngram}, {max_ngram}")
        counts: dict[int, dict[tuple[int, ...], dict[int, int]]] = {
            n: defaultdict(lambda: defaultdict(int)) for n in range(min_ngram, max_ngram + 1)}
        total_tokens = 0
        for seq in sequences:
            seq = list(seq)
            bad = next((t for t in seq if isinstance(t, (bool, np.bool_)) or not hasattr(t, "__index__")), None)
            if bad is not None:
                raise NgramCorpusError(f"NgramCorpus.build: token ids must be integers, got {bad!r}")
            seq = [operator.index(t) for t in seq]
            bad = [t for t in seq if not 0 <= t < vocab_size]
            if bad:
                raise NgramCorpusError(f"NgramCorpus.build: token id {bad[0]} is outside the vocabulary of "
                                       f"{vocab_size}")
            total_tokens += len(seq)
            for i in range(min_ngram, len(seq)):
                nxt = seq[i]
                for n in range(min_ngram, min(max_ngram, i) + 1):
                    counts[n][tuple(seq[i - n : i])][nxt] += 1
        arrays = {}
        for n, ctxs in counts.items():
            kept_ctx, kept_val = [], []
            for ctx, nexts in ctxs.items():
                tok, c = min(nexts.items(), key=lambda kv: (-kv[1], kv[0]))
                if c >= min_count:
                    kept_ctx.append(ctx)
                    kept_val.append((tok, c, sum(nexts.values())))
            arrays[n] = (np.asarray(kept_ctx, np.int32).reshape(-1, n), np.asarray(kept_val, np.int64).reshape(-1, 3))
        return cls(arrays, vocab_size, min_ngram, max_ngram, min_count, total_tokens, min_confidence)

    # ------------------------------------------------------------------ drafting
    def lookup(self, context: Sequence[int]) -> tuple[int, float, int] | None:
        """(token, confidence, n) for the longest suffix of `context` in the table, or None."""
        found, h, last = None, 0, len(context) - 1
        for i in range(min(self.max_ngram, len(context))):  # suffixes of i + 1 tokens, shortest first
            h = (h + (int(context[last - i]) + 1) * _POW[i]) & _MASK
            if i + 1 >= self.min_ngram:
                v = self._index.get((h + (i + 1) * _MIX) & _MASK)
                if v is not None:
                    found = (v, i + 1)
        if found is None:
            return None
        v, n = found
        count = (v >> _TOKEN_BITS) & ((1 << _COUNT_BITS) - 1)
        return v & (MAX_VOCAB - 1), count / (v >> (_TOKEN_BITS + _COUNT_BITS)), n

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], float]:
        """Up to `k` chained drafts after `context`, and the first draft's confidence (0.0 when there is none)."""
        suffix = list(context[max(0, len(context) - self.max_ngram) :])
        drafts: list[int] = []
        first, chain = 0.0, 1.0
        while len(drafts) < k:
            hit = self.lookup(suffix)
            if hit is None:
                break
            chain *= hit[1]
            if chain < self.min_confidence:
                break
            if not drafts:
                first = hit[1]
            drafts.append(hit[0])
            suffix = suffix[1:] + [hit[0]] if len(suffix) >= self.max_ngram else suffix + [hit[0]]
        return drafts, first

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        arrays: dict[str, Any] = {
            "format": np.asarray(FORMAT),
            "meta": np.asarray([self.vocab_size, self.min_ngram, self.max_ngram, self.min_count, self.corpus_tokens],
                               np.int64),
            "min_confidence": np.asarray(self.min_confidence, np.float64)}
        for n, (c, v) in self.arrays.items():
            arrays[f"contexts_{n}"] = c
            arrays[f"values_{n}"] = v
        with open(path, "wb") as fh:  # a file object: numpy would add ".npz" to a name without it
            np.savez_compressed(fh, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, min_confidence: float | None = None) -> NgramCorpus:
        """A table `save` wrote; `min_confidence` overrides the saved one."""
        name = os.fspath(path)
        # what numpy raises for a file that is not a whole .npz: cut short or altered (a bad zip, a failed CRC or
        # inflate), a member that is not an array or needs pickle, a missing member
        damaged = (OSError, ValueError, TypeError, KeyError, EOFError, zipfile.BadZipFile, zlib.error)
        try:
            with open(path, "rb") as fh:
                head = fh.read(4)
        except OSError as e:
            raise NgramCorpusError(f"NgramCorpus.load: cannot read {name!r} as a saved corpus: {e}") from e
        if head[:2] != b"PK":  # (numpy had called any other file "pickled data")
            raise NgramCorpusError(f"NgramCorpus.load: {name!r} is not a corpus that NgramCorpus.save wrote (an "
                                   f".npz, a zip archive; this file starts with {head!r})")
        try:
            z = np.load(path, allow_pickle=False)
        except damaged as e:
            raise NgramCorpusError(f"NgramCorpus.load: cannot read {name!r} as a saved corpus: {e}") from e
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise NgramCorpusError(f"NgramCorpus.load: {name!r} is not a corpus that NgramCorpus.save wrote (an .npz)")
        with z:
            try:
                if "format" not in z.files or str(z["format"]) != FORMAT:
                    raise NgramCorpusError(f"NgramCorpus.load: {name!r} is not a corpus that NgramCorpus.save wrote "
                                           f"(format {FORMAT})")
                meta = z["meta"]
                if meta.shape != (5,) or not np.issubdtype(meta.dtype, np.integer):
                    raise ValueError(f"its meta is {meta.dtype} {meta.shape}, 5 integers expected")
                vocab, lo, hi, min_count, tokens = (int(v) for v in meta)
                if not 1 <= lo <= hi <= MAX_NGRAM:
                    raise ValueError(f"its orders {lo}..{hi} are outside 1..{MAX_NGRAM}")
                arrays = {n: (z[f"contexts_{n}"], z[f"values_{n}"]) for n in range(lo, hi + 1)}
                conf = float(z["min_confidence"]) if min_confidence is None else min_confidence
            except damaged as e:
                raise NgramCorpusError(f"NgramCorpus.load: {name!r} is damaged: {e}") from None
        try:
            return cls(arrays, vocab, lo, hi, min_count, tokens, conf)
        except NgramCorpusError as e:
            raise NgramCorpusError(f"NgramCorpus.load: {name!r}: {e}") from None


def check_corpus_type(corpus: Any) -> None:
    """The generator's `ngram_corpus=` is an `NgramCorpus` or a path (`InvalidConfigTypeError` otherwise)."""
    if not isinstance(corpus, (NgramCorpus, str, os.PathLike)):
        raise InvalidConfigTypeError(f"DynamicGenerator: ngram_corpus must be a "
                                     f"paged.speculation.ngram_corpus.NgramCorpus or the path of a saved one, got "
                                     f"{type(corpus).__name__}")


def load_corpus(corpus: Any, vocab_size: int) -> NgramCorpus:
    """The generator's `ngram_corpus=`: an `NgramCorpus`, or the path of one `NgramCorpus.save` wrote; its
    vocabulary must be the model's."""
    check_corpus_type(corpus)
    if not isinstance(corpus, NgramCorpus):
        corpus = NgramCorpus.load(corpus)
    if corpus.vocab_size != vocab_size:
        raise InvalidConfigError(f"DynamicGenerator: ngram_corpus was built for a vocabulary of {corpus.vocab_size} "
                                 f"tokens, the model has {vocab_size}: build it with this model's tokenizer "
                                 "(experiments/build_ngram_corpus.py)")
    return corpus


def corpus_class(confidence: float) -> int:
    """The adaptive gate's evidence class of a corpus draft whose first token has this confidence: -1 .. -4."""
    return -1 - sum(confidence >= edge for edge in CONFIDENCE_BUCKETS)


def propose_lookup(index: Any, corpus: NgramCorpus | None, k: int) -> tuple[list[int], int]:
    """The n-gram drafter's proposal for the sequence `index` (a synced `paged.speculation.ngram.NgramIndex`) holds: up
    to `k` drafts and their evidence class. Prompt lookup's, unless its match is shorter than `CORPUS_BELOW` tokens and
    the corpus has a chain, whose class is then `corpus_class` of its first draft."""
    drafts, n = index.propose_match(k)
    if corpus is None or n >= CORPUS_BELOW or k < 1:
        return drafts, n
    chain, conf = corpus.propose(index.tokens, k)
    if chain:
        return chain, corpus_class(conf)
    return drafts, n
