"""Embedding injection (multimodal input, ExLlamaV2's `MMEmbedding`): a block of `[n, hidden]` vectors that take the
place of n token embeddings in a prompt.

Each distinct block (by content) owns n reserved token ids at or above `RESERVED_ID_BASE`, far above any
vocabulary, given out once per process: the same vectors always get the same ids, different vectors never share
one. A prompt holds those ids where the vectors go (`MMEmbedding.token_ids`, or the block's `text_alias` in prompt
text, see `encode_with_embeddings`). Because the page hashes of the prompt cache are over token ids, two images
never share cached pages and the same image does, with nothing else to keep in step.

On the device the engine keeps a table of `max_embedding_tokens` rows (`EngineState.extra_embed`); a generator's
`EmbeddingSlots` gives each block in use a set of rows, writes its vectors there once, and the scheduler hands the
engine id `vocab_size + row` for each reserved id. Rows stay assigned while a job holds the block and are reused
least-recently-used afterwards (a block seen again while still resident is not written again).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from paged.errors import InvalidJobError

RESERVED_ID_BASE = 1 << 24  # above any vocabulary; reserved ids are < 2^31 (int32)
_ids_lock = threading.Lock()
_first_id: dict[bytes, int] = {}  # content digest -> first reserved id of that block
_next_id = RESERVED_ID_BASE


def _reserve(digest: bytes, n: int) -> int:
    global _next_id
    with _ids_lock:
        first = _first_id.get(digest)
        if first is None:
            if _next_id + n >= 1 << 31:
                raise InvalidJobError("MMEmbedding: the reserved token ids are exhausted in this process "
                                      f"({_next_id - RESERVED_ID_BASE} given out)")
            first = _first_id[digest] = _next_id
            _next_id += n
        return first


class MMEmbedding:
    """`embeddings` `[n, hidden]` (any float array; stored as float32) standing for n prompt positions, and the
    `text_alias` that marks where they go in prompt text (default `<$EMB_{first id}$>`)."""

    def __init__(self, embeddings: Any, text_alias: str | None = None):
        try:
            given = np.asarray(embeddings)
            if given.dtype.kind not in "fiu" and "float" not in given.dtype.name:  # (bfloat16 is kind 'V')
                raise TypeError(f"its dtype is {given.dtype}")  # bool, complex (whose imaginary part would go),
            arr = np.array(given, dtype=np.float32, copy=True)  # strings, objects
        except (TypeError, ValueError) as e:
            raise InvalidJobError(f"MMEmbedding: embeddings must be a float array [n, hidden]: {e}") from e
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise InvalidJobError(f"MMEmbedding: embeddings must have shape [n >= 1, hidden], got {arr.shape}")
        if not np.all(np.isfinite(arr)):
            raise InvalidJobError("MMEmbedding: embeddings contain NaN or infinite values")
        if text_alias is not None and (not isinstance(text_alias, str) or not text_alias):
            raise InvalidJobError(f"MMEmbedding: text_alias must be a non-empty string, got {text_alias!r}")
        arr.setflags(write=False)
        self.embeddings = arr
        self.digest = hashlib.sha256(np.asarray(arr.shape, np.int64).tobytes() + arr.tobytes()).digest()
        self.first_id = _reserve(self.digest, arr.shape[0])
        self.text_alias = text_alias or f"<$EMB_{self.first_id}$>"

    def used_in(self, ids: Iterable[int]) -> bool:
        """Whether any of the block's reserved ids is among `ids` (a prompt's)."""
        return any(self.first_id <= t < self.first_id + self.num_tokens for t in ids)

    @property
    def num_tokens(self) -> int:
        return self.embeddings.shape[0]

    @property
    def token_ids(self) -> list[int]:
        """The reserved ids standing for this block in `input_ids`, in order."""
        return list(range(self.first_id, self.first_id + self.num_tokens))

    def __repr__(self) -> str:
        return f"MMEmbedding({self.num_tokens} x {self.embeddings.shape[1]}, alias={self.text_alias!r})"


def encode_with_embeddings(tokenizer: Any, text: str, embeddings: Sequence[MMEmbedding], **encode_kw: Any) -> list[int]:
    """`tokenizer.encode(text)` with each embedding's `text_alias` replaced by its reserved ids (the text around the
    aliases is encoded piece by piece; `add_bos` applies to the first piece only)."""
    aliases: dict[str, MMEmbedding] = {}
    for e in embeddings:
        if aliases.setdefault(e.text_alias, e).first_id != e.first_id:
            raise InvalidJobError(f"embeddings: two different blocks share the text alias {e.text_alias!r}")
    add_bos = encode_kw.pop("add_bos", False)
    out: list[int] = []
    rest = text
    while rest:
        hits = [(rest.find(a), -len(a), a) for a in aliases if a in rest]
        if not hits:
            break
        at, _, alias = min(hits)  # the first alias in the text; of two starting there, the longer
        if at:
            out += tokenizer.encode(rest[:at], add_bos=add_bos and not out, **encode_kw)
        elif add_bos and not out:
            out += tokenizer.encode("", add_bos=True, **encode_kw)
        out += aliases[alias].token_ids
        rest = rest[at + len(alias):]
    if rest or not out:
        out += tokenizer.encode(rest, add_bos=add_bos and not out, **encode_kw)
    return out


class EmbeddingSlots:
    """The generator's assignment of embedding blocks to rows of the engine's embedding table."""

    def __init__(self, engine: Any, vocab_size: int):
        self.engine, self.vocab_size = engine, vocab_size
        self.capacity = int(getattr(engine, "embedding_rows", 0) or 0)
        self.free = list(range(self.capacity))
        self.rows: dict[int, np.ndarray] = {}  # first id -> table rows of the block
        self.users: collections.Counter[int] = collections.Counter()  # first id -> jobs holding it
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # unheld resident blocks, LRU first

    def check(self, jobs: Sequence[Any], hidden: int | None) -> None:
        """Everything `acquire` needs for all of `jobs`, checked without changing anything (InvalidJobError)."""
        blocks = {e.first_id: e for job in jobs for e in _blocks(job)}
        if not blocks:
            return
        if not self.capacity:
            raise InvalidJobError("Job: embeddings need an engine with an embedding table; this generator has none "
                                  "(max_embedding_tokens=0, or an engine without embedding injection)")
        for e in blocks.values():
            if e.embeddings.shape[1] != hidden:
                raise InvalidJobError(f"Job: {e!r} has width {e.embeddings.shape[1]}, the model's hidden size is "
                                      f"{hidden}")
        need = sum(e.num_tokens for e in blocks.values() if e.first_id not in self.rows)
        available = len(self.free) + sum(len(self.rows[f]) for f in self.idle if f not in blocks)
        if need > available:
            raise InvalidJobError(f"Job: its embeddings need {need} rows of the embedding table and {available} are "
                                  f"free (max_embedding_tokens={self.capacity}, the rest held by queued jobs); raise "
                                  "max_embedding_tokens or wait for jobs to finish")

    def acquire(self, job: Any) -> None:
        """Give the job's blocks table rows (writing vectors not resident yet) and set `job.embedding_rows`
        (reserved id -> table row). `check` must have passed."""
        mapping: dict[int, int] = {}
        blocks = _blocks(job)
        held: list[int] = []
        try:
            for e in blocks:  # hold the resident ones first, so that making room never evicts them
                if e.first_id in self.rows:
                    self._hold(e.first_id)
                    held.append(e.first_id)
            for e in blocks:
                rows = self.rows.get(e.first_id)
                if rows is None:
                    while len(self.free) < e.num_tokens:
                        first, _ = self.idle.popitem(last=False)
                        self.free += self.rows.pop(first).tolist()
                    rows = np.asarray(self.free[: e.num_tokens], np.int64)
                    self.engine.load_embeddings(rows, e.embeddings)
                    del self.free[: e.num_tokens]
                    self.rows[e.first_id] = rows
                    self._hold(e.first_id)
                    held.append(e.first_id)
                mapping.update(zip(e.token_ids, rows.tolist()))
        except BaseException:
            for first in held:  # undo: the job holds nothing
                self._let_go(first)
            raise
        job.embedding_rows = mapping

    def acquire_all(self, jobs: Sequence[Any]) -> None:
        """`acquire` for each of `jobs`, all or none: when one fails, those done already are released again."""
        done = []
        try:
            for job in jobs:
                self.acquire(job)
                done.append(job)
        except BaseException:
            for job in done:
                self.release(job)
            raise

    def _hold(self, first: int) -> None:
        self.idle.pop(first, None)
        self.users[first] += 1

    def _let_go(self, first: int) -> None:
        self.users[first] -= 1
        if not self.users[first]:
            del self.users[first]
            self.idle[first] = None

    def release(self, job: Any) -> None:
        """The job no longer needs its blocks (finished, cancelled, failed); they stay resident until reused. A job
        that holds none (never acquired, or already released) changes nothing."""
        if not job.embedding_rows:
            return
        for e in _blocks(job):
            if self.users[e.first_id] > 0:
                self._let_go(e.first_id)
        job.embedding_rows = {}



def device_ids(job: Any, tokens: Iterable[int], vocab_size: int) -> list[int]:
    """The ids the engine sees for `tokens` of `job`: its reserved ids become `vocab_size + table row`."""
    rows = job.embedding_rows
    return [vocab_size + rows[t] if t >= vocab_size else t for t in tokens] if rows else list(tokens)


def _blocks(job: Any) -> list[MMEmbedding]:
    seen, out = set(), []
    for e in job.embeddings or ():
        if e.first_id not in seen:
            seen.add(e.first_id)
            out.append(e)
    return out
