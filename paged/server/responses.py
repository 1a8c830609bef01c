"""The generator's result dicts -> OpenAI response objects: completions and chat completions, whole or as stream
chunks, with logprobs, `finish_reason` and `usage`.

`finish_reason`: a stop token, a stop string or a completed grammar is "stop"; `max_tokens` is "length"; a job ended
because its constraints (banned strings, banned tokens, a grammar) left no token to sample is "content_filter" (the
text so far is kept); any other failure of the job is an error (`Choice.error`).
"""

from __future__ import annotations

import codecs
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from paged.server.translate import Plan

FINISH = {"stop_token": "stop", "stop_string": "stop", "end_filter": "stop", "max_new_tokens": "length"}
# failures of a job that mean its constraints allowed nothing: its scheduler's and its filter's messages
_CONSTRAINED = ("is banned at output position", "the filter rejected token", "its filters allow no token",
                "its filters allow only tokens its settings ban", "no token was allowed at this position")
MIN_LOGPROB = -9999.0  # a probability of 0 (JSON has no -inf); vLLM reports the same


def _logprob(p: float) -> float:
    return math.log(p) if p > 0 else MIN_LOGPROB


class Choice:
    """What one choice (one job) has produced, and what it has not reported yet."""

    def __init__(self, index: int, prompt_index: int, echo: str = "",
                 token_bytes: Callable[[int], bytes] | None = None):
        self.index = index
        self.prompt_index = prompt_index
        self.text = echo
        self.delta = echo
        # (token, p, top ids, top ps, text offset): the offset is the character of the text where the token's
        # bytes start (the character it is part of, for a token that is part of one)
        self.logprobs: list[tuple[int, float, list[int], list[float], int]] = []
        self.delta_logprobs: list[tuple[int, float, list[int], list[float], int]] = []
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = len(echo)  # characters the tokens' bytes decoded to so far (after the echoed prompt)
        self.sampled = 0  # tokens sampled so far (kept ones: a banned-string rewind takes some back)
        self.final: dict | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def absorb(self, r: dict, now: float) -> None:
        if r["stage"] != "streaming":
            return
        self.sampled += 1 - len(r.get("suppressed_tokens", ()))
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        text = r.get("text", "")
        self.text += text
        self.delta += text
        if "token_probs" in r:
            ids = r["token_ids"]
            top_ids = r.get("top_k_tokens") or [[] for _ in ids]
            top_ps = r.get("top_k_probs") or [[] for _ in ids]
            items = [(t, p, ti, tp, self._offset(t)) for t, p, ti, tp in zip(ids, r["token_probs"], top_ids, top_ps)]
            self.logprobs += items
            self.delta_logprobs += items
        if r["eos"]:
            self.final = r

    def _offset(self, token: int) -> int:
        at = self._chars
        if self._token_bytes is not None:
            self._chars += len(self._decoder.decode(self._token_bytes(token)))
        return at

    def take_delta(self) -> tuple[str, list]:
        d, lp = self.delta, self.delta_logprobs
        self.delta, self.delta_logprobs = "", []
        return d, lp

    @property
    def completion_tokens(self) -> int:
        return int(self.final["new_tokens"]) if self.final is not None else self.sampled

    @property
    def finish_reason(self) -> str | None:
        if self.final is None:
            return None
        reason = self.final["eos_reason"]
        if reason == "error":
            return "content_filter" if any(s in self.final.get("error", "") for s in _CONSTRAINED) else None
        return FINISH.get(reason, "stop")

    @property
    def error(self) -> str | None:
        """The job's own failure, when it is not a content filter."""
        if self.final is not None and self.final["eos_reason"] == "error" and self.finish_reason is None:
            return self.final.get("error", "the job failed")
        return None


class Formatter:
    """Builds one request's response objects (ids, timestamps, model name, logprob layout)."""

    def __init__(self, kind: str, model: str, plan: Plan, tokenizer: Any):
        self.kind = kind  # "chat" or "completion"
        self.model = model
        self.plan = plan
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes. A token that is not whole characters (part of one, as byte-level tokenizers
        split emoji) is written `bytes:\\xNN...`, as OpenAI writes it, so that no two tokens share a text."""
        got = self._pieces.get(token)
        if got is None:
            b = self.tokenizer.token_bytes(token)
            try:
                text = b.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            got = self._pieces[token] = (text, list(b))
        return got

    def token_bytes(self, token: int) -> bytes:
        return bytes(self.piece(token)[1])

    # ------------------------------------------------------------------ logprobs
    def logprobs(self, items: list) -> dict | None:
        """`items`: a choice's (token, p, top ids, top ps, text offset). The sampled token's own logprob, where
        it is among the top ones too, is the same number in both places."""
        if self.plan.logprobs is None:
            return None
        if self.kind == "chat":
            content = []
            for t, p, top_ids, top_ps, _ in items:
                s, b = self.piece(t)
                content.append({"token": s, "logprob": _logprob(p), "bytes": b, "top_logprobs": [
                    {"token": self.piece(i)[0], "logprob": _logprob(p if i == t else q), "bytes": self.piece(i)[1]}
                    for i, q in zip(top_ids, top_ps)]})
            return {"content": content}
        tokens, lps, tops, offsets = [], [], [], []
        for t, p, top_ids, top_ps, offset in items:
            tokens.append(self.piece(t)[0])
            lps.append(_logprob(p))
            tops.append({self.piece(i)[0]: _logprob(p if i == t else q) for i, q in zip(top_ids, top_ps)})
            offsets.append(offset)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if self.plan.logprobs else None,
                "text_offset": offsets}

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(self.plan.prompt_lens)
        completion = sum(c.completion_tokens for c in choices)
        firsts = {}
        for c in choices:
            firsts.setdefault(c.prompt_index, c)
        cached = sum(int(c.final.get("cached_tokens", 0)) for c in firsts.values() if c.final is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ------------------------------------------------------------------ whole responses
    def response(self, choices: list[Choice]) -> dict:
        if self.kind == "chat":
            out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason} for c in choices]
            obj = "chat.completion"
        else:
            out = [{"index": c.index, "text": c.text, "logprobs": self.logprobs(c.logprobs),
                    "finish_reason": c.finish_reason} for c in choices]
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": out,
                "usage": self.usage(choices)}

    # ------------------------------------------------------------------ stream chunks
    def chunk(self, choice_objs: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "choices": choice_objs}
        if with_usage:
            out["usage"] = usage
        return out

    def role_chunk(self, c: Choice) -> dict:
        return {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta_choice(self, c: Choice) -> dict | None:
        """The choice's news since the last chunk, or None when there is none."""
        finish = c.finish_reason
        text, items = c.take_delta()
        if not text and not items and finish is None:
            return None
        if self.kind == "chat":
            delta = {"content": text} if (text or items) else {}
            return {"index": c.index, "delta": delta, "logprobs": self.logprobs(items) if items else None,
                    "finish_reason": finish}
        return {"index": c.index, "text": text, "logprobs": self.logprobs(items) if items else None,
                "finish_reason": finish}
