"""Incremental text for one job: token bytes -> complete UTF-8 characters -> stop-string hold-back.

`TextStream.feed(token)` returns the text that can be shown now. Incomplete UTF-8 sequences (byte-level BPE or
byte-fallback tokens) are held until complete; text that could still be the start of a stop string is held until
it can no longer match. When a stop string appears, `stopped` holds it, the text before it is released, and the
stop string plus anything after it stays in `held_text` (never in the completion).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class TextStream:
    def __init__(self, token_bytes: Callable[[int], bytes], stop_strings: Sequence[str] = ()):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop_strings = [s for s in stop_strings if s]
        self.held_text = ""  # decoded text not yet released (possible stop-string prefix, or after a stop)
        self.held_tokens: list[int] = []  # tokens whose text is (partly) unreleased
        self.stopped: str | None = None

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def feed(self, token: int) -> tuple[str, list[int]]:
        """Add one token; return (released text, tokens released with it)."""
        if self.stopped is not None:
            raise RuntimeError("stream already stopped")
        self.held_tokens.append(token)
        self.held_text += self._utf8.decode(self._token_bytes(token))
        if self._utf8.getstate()[0]:  # incomplete UTF-8 sequence pending: hold everything
            return "", []
        for s in self.stop_strings:
            i = self.held_text.find(s)
            if i >= 0 and (self.stopped is None or i < self._stop_at):
                self.stopped, self._stop_at = s, i
        if self.stopped is not None:
            out, self.held_text = self.held_text[: self._stop_at], self.held_text[self._stop_at :]
            toks, self.held_tokens = self.held_tokens, []
            return out, toks
        keep = self._holdback(self.held_text)
        if keep:
            out, self.held_text = self.held_text[:-keep], self.held_text[-keep:]
            return out, []  # tokens stay held until their text is released
        out, self.held_text = self.held_text, ""
        toks, self.held_tokens = self.held_tokens, []
        return out, toks

    def flush(self) -> tuple[str, list[int]]:
        """Release everything held (end of generation without a stop string)."""
        out = self.held_text + self._utf8.decode(b"", final=True)
        toks = self.held_tokens
        self.held_text, self.held_tokens = "", []
        return out, toks
