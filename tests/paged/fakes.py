"""A hand-checkable fake engine and a byte tokenizer, so the scheduler, page pool and streaming are tested without
a JAX forward pass (JetStream-style)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from paged.buckets import BucketSpec
from paged.config import EngineConfig
from paged.engine_api import StepOutput


class ByteTokenizer:
    """Token i < 256 is the byte i; 256 = <eos> (special), 257 = <bos> (special)."""

    vocab_size = 258
    eos_token_id = 256
    bos_token_id = 257
    special_token_ids = frozenset({256, 257})
    chat_template = None

    def encode(self, text, *, add_bos=False, encode_special_tokens=False):
        return ([257] if add_bos else []) + list(text.encode())

    def decode(self, ids, *, decode_special_tokens=False):
        return b"".join(self.token_bytes(i) for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, t):
        return bytes([t]) if t < 256 else (b"<eos>" if t == 256 else b"<bos>")


def fake_logprob(token: int, pos: int) -> float:
    """The fake's log-probability of `token` sampled at sequence position `pos` (the index it takes in the job's
    sequence): -(token % 7 + 1) / 10 - pos / 1000, so every (token, position) pair reports its own value."""
    return -(token % 7 + 1) / 10 - pos / 1000


def fake_top_k(token: int, pos: int, k: int, vocab_size: int = 258) -> tuple[list[int], list[float]]:
    """The fake's top-k at that step: the sampled token and the k - 1 ids after it, each half a nat less likely."""
    return [(token + j) % vocab_size for j in range(k)], [fake_logprob(token, pos) - j / 2 for j in range(k)]


class FakeEngine:
    """next token = (last input token + 1) % vocab, or a scripted continuation: `script[first prompt token] =
    (prompt_len, tokens)` makes a job whose prompt starts with that token emit `tokens` in order. Tokens with a
    -inf bias are skipped (the next id is taken). Log-probabilities and top-k come from `fake_logprob` and
    `fake_top_k` of the sampled token and its position; logits are one-hot at the sampled token."""

    def __init__(self, num_pages=32, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=128,
                 max_prefill_rows=1, vocab_size=258, script=None):
        # implements paged.engine_api.EngineProtocol
        self.config = EngineConfig(num_pages=num_pages, page_size=page_size, max_batch_size=max_batch_size,
                                   max_chunk_size=max_chunk_size, max_seq_len=max_seq_len,
                                   max_prefill_rows=max_prefill_rows)
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.spec = BucketSpec.from_config(self.config)
        self.timings = {}
        self.script = script or {}
        self.calls = []  # rows of every step
        self.bursts = []  # num_steps of every multi-step call
        self.written = {}  # (page, offset) -> token, to check what the cache would hold

    def run(self, rows, *, return_top_k=0, return_logits=False, num_steps=1):
        if num_steps > 1:  # like paged.step.decode_steps: each sampled token is fed back as the next input
            self.bursts.append(num_steps)
            outs = []
            for _ in range(num_steps):
                outs.append(self.run(rows, return_top_k=return_top_k))
                rows = [dataclasses.replace(r, tokens=[int(t)], start_pos=r.start_pos + 1)
                        for r, t in zip(rows, outs[-1].token)]
            stack = lambda name: np.stack([getattr(o, name) for o in outs])
            return StepOutput(token=stack("token"), logprob=stack("logprob"), top_ids=stack("top_ids"),
                              top_logprobs=stack("top_logprobs"), logits=None, shape=None, seconds=0.0)
        self.calls.append(rows)
        tokens, logprobs, top_ids, top_logprobs = [], [], [], []
        for r in rows:
            for i, t in enumerate(r.tokens):
                pos = r.start_pos + i
                self.written[(r.pages[pos // self.page_size], pos % self.page_size)] = t
            t = self.next_token(r)
            bias = r.bias or {}
            while bias.get(t, 0.0) == -math.inf:
                t = (t + 1) % self.vocab_size
            pos = r.start_pos + len(r.tokens)  # where the sampled token goes in the sequence
            tokens.append(t)
            logprobs.append(fake_logprob(t, pos))
            ids, lps = fake_top_k(t, pos, return_top_k, self.vocab_size)
            top_ids.append(ids)
            top_logprobs.append(lps)
        n, k = len(rows), return_top_k
        logits = None
        if return_logits:
            logits = np.zeros((n, self.vocab_size), np.float32)
            logits[np.arange(n), tokens] = 1.0
        return StepOutput(
            token=np.asarray(tokens, np.int32), logprob=np.asarray(logprobs, np.float32),
            top_ids=np.asarray(top_ids, np.int32).reshape(n, k),
            top_logprobs=np.asarray(top_logprobs, np.float32).reshape(n, k),
            logits=logits, shape=None, seconds=0.0,
        )

    def next_token(self, r):
        end = r.start_pos + len(r.tokens)  # tokens in context after this row
        ctx_first = self.written.get((r.pages[0], 0))
        if ctx_first in self.script:
            prompt_len, tokens = self.script[ctx_first]
            n_generated = end - prompt_len
            if 0 <= n_generated < len(tokens):
                return tokens[n_generated]
        return (r.tokens[-1] + 1) % self.vocab_size

    def warmup(self, progress=False, decode_steps=1):
        return 0


@dataclasses.dataclass
class Collected:
    results: list
    texts: dict
    finals: dict


def drain(gen, limit=10_000):
    """Run the generator until empty; collect results, streamed text per identifier, final dicts."""
    results, texts, finals = [], {}, {}
    for _ in range(limit):
        if not gen.num_remaining_jobs():
            break
        for r in gen.iterate():
            results.append(r)
            if r["stage"] == "streaming":
                texts[r["identifier"]] = texts.get(r["identifier"], "") + r["text"]
            if r["eos"]:
                finals[r["identifier"]] = r
    else:
        raise AssertionError("generator did not finish")
    return Collected(results, texts, finals)
