"""Incremental text for one job: token bytes -> complete UTF-8 characters -> stop-string and banned-string logic.

`TextStream.feed(token)` returns a `StreamEvent` saying what can be shown now. Rules, in order:
1. Bytes of an incomplete UTF-8 character are held until the token that completes it (byte-level BPE and
   byte-fallback tokens split characters).
2. Stop strings (case-sensitive): on a full match the text before it is released and the stream stops; the stop
   string and anything after it stay in `held_text` and never reach the completion.
3. Banned strings (case-insensitive): on a full match the stream asks the generator to rewind every held token from
   the one where the match began (`rewind`), reporting the removed text as `suppressed_text`. A token with no text
   of its own (the first bytes of a character the next token completes) belongs to that character: it is held and
   rewound with it.
4. Text that could still become a stop or banned string is held, from the token where that possible match begins,
   and released with its tokens as soon as it cannot match.
Held text is always released at token boundaries, so each streamed chunk comes with exactly the tokens that made it.
"""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Callable, Sequence


@dataclasses.dataclass(slots=True)
class StreamEvent:
    text: str = ""  # text released now
    tokens: list[int] = dataclasses.field(default_factory=list)  # tokens released with it
    stopped: str | None = None  # the stop string that ended the stream
    rewind: int = 0  # number of most recent tokens the generator must take back (banned string)
    banned: str | None = None  # the banned string that caused the rewind
    suppressed_text: str = ""
    suppressed_tokens: list[int] = dataclasses.field(default_factory=list)

    def __init__(self, text: str = "", tokens: list[int] | None = None, stopped: str | None = None, rewind: int = 0,
                 banned: str | None = None, suppressed_text: str = "", suppressed_tokens: list[int] | None = None):
        # (written out: one event per token streamed; the generated one costs half as much again)
        self.text = text
        self.tokens = [] if tokens is None else tokens
        self.stopped = stopped
        self.rewind = rewind
        self.banned = banned
        self.suppressed_text = suppressed_text
        self.suppressed_tokens = [] if suppressed_tokens is None else suppressed_tokens


def fold_case(text: str) -> str:
    """`text` lowercased character by character, each character to one (a character whose lowercase is longer, as
    "İ" -> "i̇", stays as it is), so that an index into the result is an index into `text`: banned strings match
    case-insensitively at the positions of the text they are found in."""
    out = text.lower()
    if len(out) == len(text):
        return out
    return "".join(low if len(low := c.lower()) == 1 else c for c in text)


def _partial_start(text: str, patterns: Sequence[str]) -> int | None:
    """Smallest index i such that text[i:] is a proper prefix of some pattern (None if there is none)."""
    best = None
    for p in patterns:
        for n in range(min(len(p) - 1, len(text)), 0, -1):
            if text.endswith(p[:n]):
                i = len(text) - n
                best = i if best is None else min(best, i)
                break
    return best


class TextStream:
    def __init__(
        self,
        token_bytes: Callable[[int], bytes] | None,
        stop_strings: Sequence[str] = (),
        banned_strings: Sequence[str] = (),
    ):
        """`token_bytes`: a token's bytes; None: tokens have no text (a generator without a tokenizer)."""
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = False  # the decoder holds the first bytes of a character
        self.stop_strings = [s for s in stop_strings if s]
        self.banned = [fold_case(s) for s in banned_strings if s]
        self.held: list[tuple[int, str]] = []  # (token, text it completed), not yet released
        self.held_text = ""  # after a stop: the stop string and what followed it
        self.stopped: str | None = None
        self.strip_prefix = ""  # token healing: text to drop from the start of the output
        self._heal_prefix = ""  # ... as set, restored when a banned-string rewind takes the output back to its start
        self._fed = 0  # tokens fed and not rewound: the output position of the next token

    def release_now(self, token: int) -> str | None:
        """The text `feed(token)` would release, with this token alone and nothing held, where it is sure to: no
        stop or banned strings to match, no incomplete character pending, no healing prefix to strip, and the
        token's bytes ASCII. None otherwise, and nothing changed (call `feed`)."""
        if self.stop_strings or self.banned or self._partial or self.strip_prefix:
            return None
        if self._token_bytes is None:
            return ""
        raw = self._token_bytes(token)
        return raw.decode("ascii") if raw.isascii() else None

    @property
    def held_tokens(self) -> list[int]:
        return [t for t, _ in self.held]

    def _text(self) -> str:
        return "".join(p for _, p in self.held)

    def _release(self, n: int) -> tuple[str, list[int]]:
        out, self.held = self.held[:n], self.held[n:]
        return "".join(p for _, p in out), [t for t, _ in out]

    def _token_at(self, char_index: int) -> int:
        """Index into `held` of the first token at `char_index`: the one whose text contains it, or one before it
        with no text of its own (the first bytes of that character, which the next token completes)."""
        pos = 0
        for i, (_, piece) in enumerate(self.held):
            if pos >= char_index or pos + len(piece) > char_index:
                return i
            pos += len(piece)
        return len(self.held)

    def feed(self, token: int) -> StreamEvent:
        if self.stopped is not None:
            raise RuntimeError("stream already stopped")
        if self._token_bytes is None:
            piece = ""
        else:
            raw = self._token_bytes(token)
            if not self._partial and raw.isascii():  # (what the decoder would give, without its buffer)
                piece = raw.decode("ascii")
            else:
                piece = self._utf8.decode(raw)
                self._partial = bool(self._utf8.getstate()[0])
        if self._fed == 0 and self.strip_prefix:
            self._heal_prefix = self.strip_prefix
        self._fed += 1
        if self.strip_prefix:
            n = min(len(self.strip_prefix), len(piece))
            if piece[:n] == self.strip_prefix[:n]:
                piece, self.strip_prefix = piece[n:], self.strip_prefix[n:]
            else:
                self.strip_prefix = ""
        if not self._partial and not self.held and not self.stop_strings and not self.banned:
            return StreamEvent(piece, [token])  # (nothing held, nothing to match: released at once)
        self.held.append((token, piece))
        if self._partial:  # incomplete UTF-8 character pending
            return StreamEvent()
        if not self.stop_strings and not self.banned:  # nothing to match: everything held is released
            return StreamEvent(*self._release(len(self.held)))
        text = self._text()
        stop_at = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        lower = fold_case(text)
        ban_at = min((i for i in (lower.find(b) for b in self.banned) if i >= 0), default=-1)
        if ban_at >= 0 and (stop_at < 0 or ban_at < stop_at):
            j = self._token_at(ban_at)
            banned = next(b for b in self.banned if lower.find(b) == ban_at)
            released, toks = self._release(j)
            suppressed, sup_toks = self._release(len(self.held))
            self._reset()
            self._fed -= len(sup_toks)
            if self._fed == 0 and self._heal_prefix:  # back to the first token: its healing prefix applies again
                self.strip_prefix = self._heal_prefix
            return StreamEvent(text=released, tokens=toks, rewind=len(sup_toks), banned=banned,
                               suppressed_text=suppressed, suppressed_tokens=sup_toks)
        if stop_at >= 0:
            self.stopped = next(s for s in self.stop_strings if text.find(s) == stop_at)
            self.held_text = text[stop_at:]
            toks = self.held_tokens
            self.held = []
            return StreamEvent(text=text[:stop_at], tokens=toks, stopped=self.stopped)
        starts = [i for i in (_partial_start(text, self.stop_strings), _partial_start(lower, self.banned))
                  if i is not None]
        keep_from = self._token_at(min(starts)) if starts else len(self.held)
        text_out, toks = self._release(keep_from)
        return StreamEvent(text=text_out, tokens=toks)

    def flush(self) -> tuple[str, list[int]]:
        """Release everything held (the job ends without a stop string). Bytes of a character the output stopped
        in the middle of are dropped rather than shown as U+FFFD; their tokens are still released."""
        self._reset()
        return self._release(len(self.held))

    def _reset(self) -> None:
        self._utf8.reset()
        self._partial = False
