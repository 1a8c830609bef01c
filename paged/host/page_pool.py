"""`PagePool`: host-side bookkeeping of KV-cache pages with reference counts, chained prefix hashes and an LRU
prompt cache.

Every page except the null page 0 is in exactly one state:
- **referenced** (`ref_count > 0`): owned or shared by live jobs;
- **cached** (`ref_count == 0`, complete, hashed): a finished job's page kept for prefix reuse, evicted LRU;
- **free** (`ref_count == 0`, no hash).

A page's hash is chained: `blake2b(prev_hash || its tokens)`, so it names the whole prefix up to the page's end. A
hit is verified against the stored tokens and the stored previous hash, so a hash collision can never hand one
sequence another's KV. Prompt pages are hashed at admission, before they are written ("pending"), so jobs admitted
together with a shared prefix share physical pages while it is prefilled; a pending page counts as cached only
once it is complete.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np


class PagePoolError(RuntimeError):
    """The pool cannot satisfy a request (the scheduler checks availability first, so this signals a bug)."""


@dataclasses.dataclass
class Page:
    index: int
    ref_count: int = 0
    hash: bytes | None = None
    prev_hash: bytes = b""
    tokens: tuple[int, ...] = ()
    filled: int = 0  # token slots holding valid KV, from the start of the page


def chain_hashes(tokens: Sequence[int], page_size: int, num_pages: int, prev: bytes = b"",
                 root: bytes = b"") -> list[bytes]:
    """Chained hashes of the first `num_pages` full pages of `tokens`. `root` is hashed into every page: what
    besides the tokens decides the page's K/V (a LoRA adapter's digest), so pages of other roots never match."""
    out = []
    arr = np.asarray(tokens, dtype=np.int64)
    for i in range(num_pages):
        prev = hashlib.blake2b(prev + root + arr[i * page_size : (i + 1) * page_size].tobytes(),
                               digest_size=16).digest()
        out.append(prev)
    return out


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the reserved null page), got {num_pages}")
        self.page_size = page_size
        self.pages = [Page(i) for i in range(num_pages)]
        self.free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low indices first
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.by_hash: dict[bytes, int] = {}
        self.prefix_queries = 0  # full prompt pages looked up (at a request's first admission)
        self.prefix_hits = 0  # of which found complete, or shared with a live job that completes it (the scheduler)

    # ------------------------------------------------------------------ queries
    @property
    def num_pages(self) -> int:
        return len(self.pages) - 1  # usable pages

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_referenced(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    @property
    def available(self) -> int:
        """Pages that can be handed out now (free + cached, evicting the latter)."""
        return self.num_free + self.num_cached

    def _verified(self, h: bytes, prev: bytes, tokens: tuple[int, ...]) -> int | None:
        idx = self.by_hash.get(h)
        if idx is None:
            return None
        p = self.pages[idx]
        return idx if p.prev_hash == prev and p.tokens == tokens else None

    def match(self, hashes: Sequence[bytes], page_tokens: Sequence[tuple[int, ...]]) -> list[int]:
        """Leading pages already registered for this prefix (complete or pending), without taking references."""
        out, prev = [], b""
        for h, toks in zip(hashes, page_tokens):
            idx = self._verified(h, prev, toks)
            if idx is None:
                break
            out.append(idx)
            prev = h
        return out

    def pages_needed(self, hashes: Sequence[bytes], page_tokens: Sequence[tuple[int, ...]], total: int) -> int:
        """How many free-or-cached pages admitting a job of `total` pages would consume."""
        return self.pages_needed_many([(hashes, page_tokens, total)])

    def pages_needed_many(self, requests: Sequence[tuple[Sequence[bytes], Sequence[tuple[int, ...]], int]]) -> int:
        """`pages_needed` of several page lists admitted together (`allocate_many`): a cached page several of them
        hit is revived once."""
        hits = [self.match(h, t) for h, t, _ in requests]
        revived = len({i for hit in hits for i in hit if self.pages[i].ref_count == 0})
        return revived + sum(total - len(hit) for (_, _, total), hit in zip(requests, hits))

    # ------------------------------------------------------------------ mutations
    def _ref(self, idx: int) -> None:
        p = self.pages[idx]
        if p.ref_count == 0:
            del self.cached[idx]  # only cached pages are referenced from ref 0 through a hash
        p.ref_count += 1

    def _take(self) -> int:
        if self.free:
            idx = self.free.pop()
        elif self.cached:
            idx, _ = self.cached.popitem(last=False)  # evict least recently used
            p = self.pages[idx]
            del self.by_hash[p.hash]
        else:
            raise PagePoolError("no free or cached page left")
        p = self.pages[idx]
        p.hash, p.prev_hash, p.tokens, p.filled = None, b"", (), 0
        p.ref_count = 1
        return idx

    def allocate(
        self, hashes: Sequence[bytes], page_tokens: Sequence[tuple[int, ...]], total: int
    ) -> tuple[list[int], int]:
        """Pages for a job: shared/revived pages for the hashed prefix, fresh pages (registered pending) for the
        rest of it, fresh unhashed pages up to `total`. Returns (pages, number of leading pages already complete)."""
        return self.allocate_many([(hashes, page_tokens, total)])[0]

    def allocate_many(
        self, requests: Sequence[tuple[Sequence[bytes], Sequence[tuple[int, ...]], int]], count: bool = True
    ) -> list[tuple[list[int], int]]:
        """`allocate` for several page lists at once (a CFG job's two prompts): every prefix hit is referenced
        before any fresh page is taken, so taking pages for one list never evicts a cached page another hits.
        `count=False`: not a request's lookup (a preempted job's re-admission), left out of the prefix counts."""
        if self.pages_needed_many(requests) > self.available:
            raise PagePoolError("not enough pages; check pages_needed() before allocate()")
        hits = [self.match(h, t) for h, t, _ in requests]
        for hit in hits:
            for idx in hit:
                self._ref(idx)
        out = []
        for (hashes, page_tokens, total), hit in zip(requests, hits):
            complete = 0
            while complete < len(hit) and self.pages[hit[complete]].filled == self.page_size:
                complete += 1
            if count:
                self.prefix_queries += len(hashes)
                self.prefix_hits += complete
            pages = list(hit)
            prev = hashes[len(hit) - 1] if hit else b""
            for h, toks in zip(hashes[len(hit) :], page_tokens[len(hit) :]):
                idx = self._take()
                if h not in self.by_hash:  # register pending so concurrent jobs share it
                    p = self.pages[idx]
                    p.hash, p.prev_hash, p.tokens = h, prev, toks
                    self.by_hash[h] = idx
                pages.append(idx)
                prev = h
            while len(pages) < total:
                pages.append(self._take())
            out.append((pages, complete))
        return out

    def take(self, n: int) -> list[int]:
        """`n` fresh unhashed pages (evicting cached ones LRU), referenced once: a running job's next pages when they
        are allocated on demand."""
        if n > self.available:
            raise PagePoolError(f"{n} pages asked for, {self.available} available; check available first")
        return [self._take() for _ in range(n)]

    def mark_filled(self, idx: int, filled: int) -> None:
        p = self.pages[idx]
        p.filled = max(p.filled, min(filled, self.page_size))

    def mark_filled_range(self, pages: Sequence[int], start: int, end: int) -> None:
        """A job whose page list is `pages` has written positions `start .. end - 1`: `mark_filled` each page they
        fall in, up to `end`."""
        ps = self.page_size
        for p in range(start // ps, -(-end // ps)):
            page = self.pages[pages[p]]
            filled = min(end - p * ps, ps)
            if filled > page.filled:
                page.filled = filled

    def truncate(self, idx: int, filled: int) -> None:
        """The page's valid content now ends at `filled` (a job rewound into it; it must not be hashed)."""
        p = self.pages[idx]
        assert p.hash is None or p.filled <= filled, f"rewinding into hashed page {idx}"
        p.filled = min(p.filled, max(0, filled))

    def register(self, idx: int, h: bytes, prev: bytes, tokens: tuple[int, ...]) -> None:
        """Hash a page that has just become complete (e.g. generated text), so later jobs can reuse it."""
        p = self.pages[idx]
        if p.hash is not None or h in self.by_hash:
            return  # already hashed, or an identical page is registered (keep the first)
        p.hash, p.prev_hash, p.tokens = h, prev, tuple(tokens)
        self.by_hash[h] = idx

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; complete hashed pages become cached, others free."""
        for idx in pages:
            p = self.pages[idx]
            if p.ref_count <= 0:
                raise PagePoolError(f"page {idx} released more often than referenced")
            p.ref_count -= 1
            if p.ref_count:
                continue
            if p.hash is not None and p.filled == self.page_size:
                self.cached[idx] = None
                self.cached.move_to_end(idx)
            else:
                if p.hash is not None:
                    del self.by_hash[p.hash]
                p.hash, p.prev_hash, p.tokens, p.filled = None, b"", (), 0
                self.free.append(idx)

    def reset_cache(self) -> None:
        """Forget every cached page (live jobs keep theirs)."""
        for idx in list(self.cached):
            p = self.pages[idx]
            del self.by_hash[p.hash]
            p.hash, p.prev_hash, p.tokens, p.filled = None, b"", (), 0
            self.free.append(idx)
        self.cached.clear()

    def check(self, expected_refs: dict[int, int] | None = None) -> None:
        """Assert the pool's invariants; with `expected_refs` (page -> count over live jobs), the exact counts."""
        free, cached = set(self.free), set(self.cached)
        assert len(free) == len(self.free), "duplicate page in free list"
        assert not free & cached, "page both free and cached"
        assert 0 not in free and 0 not in cached and self.pages[0].ref_count == 0, "null page handed out"
        for p in self.pages[1:]:
            in_free, in_cached = p.index in free, p.index in cached
            if p.ref_count > 0:
                assert not in_free and not in_cached, f"referenced page {p.index} is free/cached"
            else:
                assert in_free != in_cached, f"unreferenced page {p.index} must be free xor cached"
            if in_cached:
                assert p.hash is not None and p.filled == self.page_size, f"cached page {p.index} incomplete"
            if in_free:
                assert p.hash is None, f"free page {p.index} still hashed"
            if p.hash is not None:
                assert self.by_hash.get(p.hash) == p.index, f"page {p.index} hash not indexed"
        assert all(self.pages[i].hash == h for h, i in self.by_hash.items()), "stale hash index"
        if expected_refs is not None:
            for p in self.pages[1:]:
                assert p.ref_count == expected_refs.get(p.index, 0), (
                    f"page {p.index}: ref_count {p.ref_count} != {expected_refs.get(p.index, 0)} held by jobs")
