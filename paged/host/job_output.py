"""`JobOutput`: what happens to a job after its row ran. It advances the job's KV position, marks and hashes the
pages it completed, feeds sampled tokens through the job's text stream (UTF-8 hold-back, stop and banned strings),
rewinds on a banned string, and builds the result dicts, including the final one.

It updates the job and the `PagePool`; retiring a finished job (releasing its pages) is the generator's, which
owns the active list.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from paged.host.page_pool import PagePool, chain_hashes
from paged.job import Job

EXTRA_KEYS = ("token_probs", "top_k_tokens", "top_k_probs", "logits")


class JobOutput:
    def __init__(self, pool: PagePool, page_size: int, piece: Callable[[int], str]):
        self.pool = pool
        self.page_size = page_size
        self.piece = piece  # token id -> its text (for eos_triggering_token_str)

    @staticmethod
    def base(job: Job, stage: str) -> dict:
        return {"job": job, "stage": stage, "eos": False, "serial": job.serial, "identifier": job.identifier}

    # ------------------------------------------------------------------ KV and pages
    def advance(self, job: Job, n: int) -> None:
        """`n` more of the job's tokens have their K/V in the cache."""
        job.kv_position += n
        ps = self.page_size
        kv = job.kv_position
        if n == 1:  # (a decode row: `mark_filled_range` of its one page)
            p = (kv - 1) // ps
            page = self.pool.pages[job.pages[p]]
            if kv - p * ps > page.filled:
                page.filled = kv - p * ps
        else:
            self.pool.mark_filled_range(job.pages, kv - n, kv)
        limit = len(job.sequence) - len(job.stream.held)  # (text the stream holds may still be rewound)
        if kv < limit:
            limit = kv
        if (len(job.page_hashes) + 1) * ps <= limit:  # (a page was completed)
            self.hash_pages(job, limit)

    def hash_pages(self, job: Job, limit: int) -> None:
        """Hash and register the job's pages complete below `limit` (prompt tail, generated text) for reuse.
        Tokens still held by the stream may be rewound by a banned string, so their pages wait."""
        ps = self.page_size
        while (len(job.page_hashes) + 1) * ps <= limit:
            p = len(job.page_hashes)
            prev = job.page_hashes[-1] if job.page_hashes else b""
            toks = tuple(job.sequence[p * ps : (p + 1) * ps])
            h = chain_hashes(toks, ps, 1, prev, job.hash_root)[0]
            self.pool.register(job.pages[p], h, prev, toks)
            job.page_hashes.append(h)

    def rewind(self, job: Job, n: int, first: int) -> None:
        """Take back the job's last `n` tokens (a banned string began at the first of them) and forbid `first`
        at that position. Their pages were never hashed (hashing waits for released text), so they are the job's
        own and are simply overwritten."""
        c = len(job.sequence) - n  # index of the first token taken back
        del job.sequence[c:]
        job.new_tokens -= n
        del job.pending_extras[len(job.pending_extras) - n :]
        job.explored.setdefault(c, set()).add(first)
        job.kv_position = min(job.kv_position, c - 1)  # re-feed token c - 1 to sample position c again
        ps = self.page_size
        assert len(job.page_hashes) * ps <= c, "a page holding rewound tokens was hashed"
        for p in range(c // ps, len(job.pages)):  # position c - 1 is re-fed with the same token: keep it
            self.pool.truncate(job.pages[p], c - p * ps)

    def follow(self, job: Job, final: bool = False) -> None:
        """CFG: after the job received its token (and perhaps rewound), its negative prompt's job takes the same
        output tokens. Its row fed its last token this step (`advance` before the job's `receive`); tokens taken
        back by a rewind are taken back there too, and its pages truncated the same way."""
        neg = job.cfg_partner
        had = len(neg.sequence)
        c = neg.prompt_len + len(job.sequence) - job.prompt_len  # its length now (the kept tokens are a prefix)
        if c > had:
            neg.sequence.extend(job.sequence[job.prompt_len + had - neg.prompt_len :])
        neg.new_tokens = job.new_tokens
        if c <= had:  # a banned string took tokens back: re-feed token c - 1 to sample position c again
            del neg.sequence[c:]
            neg.kv_position = min(neg.kv_position, c - 1)
            ps = self.page_size
            for p in range(c // ps, len(neg.pages)):
                self.pool.truncate(neg.pages[p], c - p * ps)
        if final:  # its output is final too: its complete pages become reusable
            self.hash_pages(neg, neg.kv_position)

    # ------------------------------------------------------------------ results
    def feed(self, job: Job, tokens: list[int], kv_advance: int, extras: list[dict], now: float) -> list[dict]:
        """Several tokens of one row (speculative decoding: accepted drafts, then the target's token), fed one at a
        time as if each came from its own step. `kv_advance` of the row's tokens have valid K/V: the row's input and
        the accepted drafts. The K/V of a draft is counted only once the draft has been received, so the job's KV
        position never passes its sequence; feeding stops at the first token that ends the job or rewinds it (the
        later ones were conditioned on it). Returns the `streaming` results."""
        if len(tokens) == 1:  # a plain step's row
            self.advance(job, kv_advance)
            return [self.receive(job, tokens[0], extras[0], now)]
        self.advance(job, kv_advance - max(len(tokens) - 1, 0))
        out = []
        for i, (token, ex) in enumerate(zip(tokens, extras)):
            if i:
                self.advance(job, 1)  # the draft received just before has its K/V in the cache
            r = self.receive(job, token, ex, now)
            out.append(r)
            if r["eos"] or "suppressed_tokens" in r:
                break
        return out

    def receive(self, job: Job, token: int, extras: dict, now: float) -> dict:
        """Append a sampled token to the job and return its `streaming` result (final, with `eos=True`, when a stop
        condition or max_new_tokens ends the job)."""
        job.sequence.append(token)
        job.new_tokens += 1
        if job.time_first_token is None:
            job.time_first_token = now
        job.time_last_token = now
        if (not extras and job.new_tokens < job.max_new_tokens and job.filter_state is None
                and token not in job.stop_tokens and not job.pending_extras):
            text = job.stream.release_now(token)
            if text is not None:  # (the usual token: it ends nothing and its text is released at once)
                job.full_completion += text
                return {"job": job, "stage": "streaming", "eos": False, "serial": job.serial,
                        "identifier": job.identifier, "text": text, "token_ids": [token]}
        job.pending_extras.append(extras)
        r = self.base(job, "streaming")
        reason = None
        held_text, held_ids = "", None  # what the final result's `held` reports
        if token in job.stop_tokens:  # (banned by the sampler until min_new_tokens are out)
            reason = "stop_token"
            text, toks = job.stream.flush()  # the stop token's own text is not part of the completion
            job.pending_extras.pop()
            held_ids = [token]
            r.update(eos_triggering_token_id=token, eos_triggering_token_str=self.piece(token))
        elif self.ends_the_filters(job, token):  # the grammar's EOS: like a stop token, its text is not output
            reason = "end_filter"
            text, toks = job.stream.flush()
            job.pending_extras.pop()
            held_ids = [token]
            r.update(eos_triggering_token_id=token, eos_triggering_token_str=self.piece(token))
        else:
            ev = job.stream.feed(token)
            text, toks = ev.text, ev.tokens
            if ev.rewind:
                self.rewind(job, ev.rewind, ev.suppressed_tokens[0])
                r.update(suppressed_text=ev.suppressed_text, suppressed_tokens=ev.suppressed_tokens,
                         suppressed_by=ev.banned)
            elif ev.stopped is not None:
                reason = "stop_string"
                r["eos_triggering_string"] = ev.stopped
                held_text = job.stream.held_text
            elif job.filter_state is not None and job.filter_state.done():
                reason = "end_filter"
                more_text, more = job.stream.flush()
                text, toks = text + more_text, toks + more
            elif job.new_tokens >= job.max_new_tokens:
                reason = "max_new_tokens"
                more_text, more = job.stream.flush()
                text, toks = text + more_text, toks + more
        pending = job.pending_extras
        if len(toks) == len(pending):  # (the usual case: every token is released)
            released, job.pending_extras = pending, []
        else:
            released, job.pending_extras = pending[: len(toks)], pending[len(toks) :]
        job.full_completion += text
        r["text"] = text
        r["token_ids"] = toks
        if released and released[0]:  # the extras the job asked for (none: empty dicts)
            for key in EXTRA_KEYS:
                if key in released[0]:
                    vals = [e[key] for e in released]
                    r[key] = np.stack(vals) if key == "logits" else vals
        if reason is not None:
            self.hash_pages(job, job.kv_position)  # the output is final: its complete pages become reusable
            r.update(self.final_fields(job, reason, now), held={"text": held_text, "token_ids": held_ids or []})
        return r

    @staticmethod
    def ends_the_filters(job: Job, token: int) -> bool:
        """Advance the job's filters (if any) by `token`; whether it is the grammar's EOS that completes them (it
        then ends the job as a stop token does: its text, e.g. `<|im_end|>`, and its id are not part of the
        completion)."""
        fs = job.filter_state
        if fs is None:
            return False
        if job.healing_allowed and job.new_tokens == 1:
            fs.consume_healed(token, job.healing_prefix)
            return False
        fs.consume(token)
        return token == fs.eos and fs.done()

    def final_fields(self, job: Job, reason: str, now: float) -> dict:
        """The keys every final result carries."""
        first_token = job.time_first_token if job.time_first_token is not None else now
        last_token = job.time_last_token if job.time_last_token is not None else now
        return dict(
            eos=True, eos_reason=reason, full_completion=job.full_completion, new_tokens=job.new_tokens,
            prompt_tokens=job.prompt_len, cached_tokens=job.cached_tokens, preemptions=job.preemptions,
            accepted_draft_tokens=job.accepted_draft_tokens,
            rejected_draft_tokens=job.drafted_tokens - job.accepted_draft_tokens,
            cached_pages=job.cached_tokens // self.page_size,
            time_enqueued=(now if job.time_first_prefill is None else job.time_first_prefill) - job.time_enqueue,
            time_prefill=first_token - (first_token if job.time_first_prefill is None else job.time_first_prefill),
            time_generate=last_token - first_token,
        )

    def error(self, job: Job, exc: BaseException, now: float) -> dict:
        """The final result of a job that failed on its own: `eos_reason="error"`, `error` says what happened.
        Text still held by the stream is not released (it may be part of a stop or banned string): it is in `held`."""
        held = job.stream.held if job.stream is not None else []
        r = self.base(job, "streaming")
        r.update(text="", token_ids=[], **self.final_fields(job, "error", now),
                 held={"text": "".join(p for _, p in held), "token_ids": [t for t, _ in held]},
                 error=f"{type(exc).__name__}: {exc}")
        return r
