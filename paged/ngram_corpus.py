"""A corpus n-gram table for the n-gram drafter: the continuations the model itself tends to write, for the steps
where prompt lookup has nothing to offer.

Prompt lookup (`paged.ngram.NgramIndex`) drafts only what the job's own prompt + output already holds. Where the
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
evidence class the adaptive gate learns per (`paged.draft_gate`) is the prompt-lookup match length (1..max_ngram) as
before, or for a corpus draft `-1 - b` with b the bucket of its first draft's confidence (`CONFIDENCE_BUCKETS`): -1
below 0.3, -2 below 0.6, -3 below 0.9, -4 from 0.9.

Drafts are token ids, one-hot as prompt lookup's: verification and every acceptance rule treat them alike, and the
output is the model's whatever the corpus holds (a corpus only changes how many drafts are accepted).

The table is saved as a `.npz` (`save`, `load`): per order n, the contexts `[M, n]`, their top token, its count and
the context's total, with the vocabulary size it was built for (the generator checks it against the model's).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from paged.errors import InvalidConfigError, InvalidConfigTypeError

CORPUS_BELOW = 2  # prompt lookup matches shorter than this give way to the corpus
CONFIDENCE_BUCKETS = (0.3, 0.6, 0.9)  # bucket edges of a corpus draft's evidence class
FORMAT = "paged.ngram_corpus/1"


class NgramCorpusError(InvalidConfigError):
    """A corpus file or table that cannot be used (bad format, token ids outside its vocabulary)."""


class NgramCorpus:
    """The most frequent continuation of every context of `min_ngram`..`max_ngram` tokens of a corpus (see the
    module docstring). Build with `NgramCorpus.build`, or `load` a saved one.

    `table[n]` maps a context (a tuple of n token ids) to `(token, count, total)`. Contexts whose top token was seen
    fewer than `min_count` times are left out (most contexts are seen once, and a single sighting predicts poorly).
    `min_confidence`: a proposal's chain stops where the product of its drafts' count / total falls under it."""

    def __init__(self, table: dict[int, dict[tuple[int, ...], tuple[int, int, int]]], vocab_size: int,
                 min_ngram: int, max_ngram: int, min_count: int, corpus_tokens: int, min_confidence: float = 0.3):
        if not 1 <= min_ngram <= max_ngram:
            raise NgramCorpusError(f"NgramCorpus: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 0.0 <= min_confidence <= 1.0:
            raise NgramCorpusError(f"NgramCorpus: min_confidence must be in [0, 1], got {min_confidence}")
        self.table = table
        self.vocab_size = int(vocab_size)
        self.min_ngram = int(min_ngram)
        self.max_ngram = int(max_ngram)
        self.min_count = int(min_count)
        self.corpus_tokens = int(corpus_tokens)
        self.min_confidence = float(min_confidence)

    def __len__(self) -> int:
        return sum(len(t) for t in self.table.values())

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
        if not 1 <= min_ngram <= max_ngram:
            raise NgramCorpusError(f"NgramCorpus.build: need 1 <= min_ngram <= max_ngram, got {min_ngram}, "
                                   f"{max_ngram}")
        counts: dict[int, dict[tuple[int, ...], dict[int, int]]] = {
            n: defaultdict(lambda: defaultdict(int)) for n in range(min_ngram, max_ngram + 1)}
        total_tokens = 0
        for seq in sequences:
            seq = [int(t) for t in seq]
            bad = [t for t in seq if not 0 <= t < vocab_size]
            if bad:
                raise NgramCorpusError(f"NgramCorpus.build: token id {bad[0]} is outside the vocabulary of "
                                       f"{vocab_size}")
            total_tokens += len(seq)
            for i in range(min_ngram, len(seq)):
                nxt = seq[i]
                for n in range(min_ngram, min(max_ngram, i) + 1):
                    counts[n][tuple(seq[i - n : i])][nxt] += 1
        table: dict[int, dict[tuple[int, ...], tuple[int, int, int]]] = {}
        for n, ctxs in counts.items():
            kept = {}
            for ctx, nexts in ctxs.items():
                tok, c = min(nexts.items(), key=lambda kv: (-kv[1], kv[0]))
                if c >= min_count:
                    kept[ctx] = (tok, c, sum(nexts.values()))
            table[n] = kept
        return cls(table, vocab_size, min_ngram, max_ngram, min_count, total_tokens, min_confidence)

    # ------------------------------------------------------------------ drafting
    def lookup(self, context: Sequence[int]) -> tuple[int, float, int] | None:
        """(token, confidence, n) for the longest suffix of `context` in the table, or None."""
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            hit = self.table[n].get(tuple(context[len(context) - n :]))
            if hit is not None:
                return hit[0], hit[1] / hit[2], n
        return None

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
        for n, t in self.table.items():
            arrays[f"contexts_{n}"] = np.asarray(list(t.keys()), np.int32).reshape(len(t), n)
            arrays[f"values_{n}"] = np.asarray(list(t.values()), np.int64).reshape(len(t), 3)
        with open(path, "wb") as fh:  # a file object: numpy would add ".npz" to a name without it
            np.savez_compressed(fh, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, min_confidence: float | None = None) -> NgramCorpus:
        """A table `save` wrote; `min_confidence` overrides the saved one."""
        try:
            z = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise NgramCorpusError(f"NgramCorpus.load: cannot read {os.fspath(path)!r} as a saved corpus: {e}") from e
        with z:
            if "format" not in z.files or str(z["format"]) != FORMAT:
                raise NgramCorpusError(f"NgramCorpus.load: {os.fspath(path)!r} is not a corpus that "
                                       f"NgramCorpus.save wrote (format {FORMAT})")
            vocab, lo, hi, min_count, tokens = (int(v) for v in z["meta"])
            table = {}
            for n in range(lo, hi + 1):
                ctx, val = z[f"contexts_{n}"], z[f"values_{n}"]
                if ctx.size and (ctx.min() < 0 or ctx.max() >= vocab or val[:, 0].min() < 0
                                 or val[:, 0].max() >= vocab):
                    raise NgramCorpusError(f"NgramCorpus.load: {os.fspath(path)!r} holds token ids outside its "
                                           f"vocabulary of {vocab}")
                table[n] = dict(zip(map(tuple, ctx.tolist()), map(tuple, val.tolist())))
            conf = float(z["min_confidence"]) if min_confidence is None else min_confidence
        return cls(table, vocab, lo, hi, min_count, tokens, conf)


def load_corpus(corpus: Any, vocab_size: int) -> NgramCorpus:
    """The generator's `ngram_corpus=`: an `NgramCorpus`, or the path of one `NgramCorpus.save` wrote; its
    vocabulary must be the model's."""
    if isinstance(corpus, (str, os.PathLike)):
        corpus = NgramCorpus.load(corpus)
    if not isinstance(corpus, NgramCorpus):
        raise InvalidConfigTypeError(f"DynamicGenerator: ngram_corpus must be a paged.ngram_corpus.NgramCorpus or "
                                     f"the path of a saved one, got {type(corpus).__name__}")
    if corpus.vocab_size != vocab_size:
        raise InvalidConfigError(f"DynamicGenerator: ngram_corpus was built for a vocabulary of {corpus.vocab_size} "
                                 f"tokens, the model has {vocab_size}: build it with this model's tokenizer "
                                 "(experiments/build_ngram_corpus.py)")
    return corpus


def corpus_class(confidence: float) -> int:
    """The adaptive gate's evidence class of a corpus draft whose first token has this confidence: -1 .. -4."""
    return -1 - sum(confidence >= edge for edge in CONFIDENCE_BUCKETS)


def propose_lookup(index: Any, corpus: NgramCorpus | None, k: int) -> tuple[list[int], int]:
    """The n-gram drafter's proposal for the sequence `index` (a synced `paged.ngram.NgramIndex`) holds: up to `k`
    drafts and their evidence class. Prompt lookup's, unless its match is shorter than `CORPUS_BELOW` tokens and
    the corpus has a chain, whose class is then `corpus_class` of its first draft."""
    drafts, n = index.propose_match(k)
    if corpus is None or n >= CORPUS_BELOW or k < 1:
        return drafts, n
    chain, conf = corpus.propose(index.tokens, k)
    if chain:
        return chain, corpus_class(conf)
    return drafts, n
