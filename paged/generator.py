"""`DynamicGenerator`: the thin host loop. Each `iterate()` admits jobs (policy), plans one ragged step of prefill
chunks and decode rows, runs it on the engine, and turns the sampled tokens into streamed result dicts.

The device work is one call to `engine.run`; everything here is bookkeeping on Python ints. Any object with the
`Engine` interface (`page_size`, `num_pages`, `max_seq_len`, `spec`, `run(rows, ...)`, `warmup()`) can stand in
for the engine, which is how the scheduler is tested with a hand-checkable fake model.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from paged.batch import RowInput
from paged.errors import InvalidJobError, JobTooLargeError
from paged.job import Job
from paged.page_pool import PagePool, chain_hashes
from paged.policy import Policy, make_policy
from paged.settings import SamplingSettings
from paged.streaming import TextStream

HEALING_BOOST = 1e4


def _pow2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


class _StepView:
    """Step `i` of a multi-step `StepOutput` (arrays `[steps, n]`), restricted to the input rows `cols`."""

    def __init__(self, out: Any, i: int, cols: list[int]):
        self.seconds = out.seconds
        self.token = out.token[i][cols]
        self.logprob = out.logprob[i][cols]
        self.top_ids = out.top_ids[i][cols]
        self.top_logprobs = out.top_logprobs[i][cols]
        self.logits = None


class DynamicGenerator:
    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        *,
        num_pages: int | None = None,
        page_size: int = 64,
        max_batch_size: int = 16,
        max_chunk_size: int = 256,
        max_seq_len: int | None = None,
        max_prefill_rows: int = 1,
        max_penalty_range: int = 1024,
        policy: str | Policy = "exllamav2",
        decode_steps: int = 1,
        cache_dtype: str = "float32",
        attn_impl: str = "auto",
        matmul_impl: str = "auto",
        compilation_cache_dir: str | os.PathLike | None = None,
        engine: Any = None,
    ):
        """model: a `models.Model`; tokenizer: None -> model.tokenizer. num_pages: KV-cache pages (page 0 is
        reserved), default enough for max_batch_size sequences of max_seq_len. engine: an Engine-like object to use
        instead of building one (tests). decode_steps: when every active job is decoding, no admission is waiting and
        no job needs token-by-token control (banned strings, min_new_tokens still pending, logits), run this many
        decode steps in one device call (`paged.step.decode_steps`): fewer dispatches and host round trips per token,
        results delivered in bursts of `decode_steps` tokens per `iterate()`. Tokens past a job's end are discarded.
        1 (default) = one token per iterate, as ExLlamaV2."""
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if engine is None:
            if model is None:
                raise ValueError("DynamicGenerator needs a model (or an engine)")
            from paged.engine import Engine

            if max_seq_len is None:
                max_seq_len = min(model.config.max_position_embeddings, 2048)
            if num_pages is None:
                num_pages = 1 + max_batch_size * -(-max_seq_len // page_size)
            engine = Engine(model, num_pages=num_pages, page_size=page_size, max_batch_size=max_batch_size,
                            max_chunk_size=max_chunk_size, max_seq_len=max_seq_len,
                            max_prefill_rows=max_prefill_rows, max_penalty_range=max_penalty_range,
                            cache_dtype=cache_dtype, attn_impl=attn_impl, matmul_impl=matmul_impl,
                            compilation_cache_dir=compilation_cache_dir)
        self.engine = engine
        self.vocab_size = engine.vocab_size
        self.page_size = engine.page_size
        self.max_seq_len = engine.max_seq_len
        self.max_batch_size = engine.spec.max_batch_size
        self.max_chunk_size = engine.spec.max_chunk_size
        self.max_prefill_rows = engine.spec.max_prefill_rows
        self.max_penalty_range = max(engine.spec.history_buckets)
        if not isinstance(decode_steps, int) or decode_steps < 1:
            raise ValueError(f"decode_steps must be an int >= 1, got {decode_steps!r}")
        self.decode_steps = decode_steps
        self.pool = PagePool(engine.num_pages, self.page_size)
        self.policy = make_policy(policy)
        self.pending: list[Job] = []
        self.active: list[Job] = []
        self._stash: list[dict] = []  # results of other callers' jobs seen inside generate()
        self._serial = 0
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._vocab_bytes: list[bytes] | None = None
        self.lock = threading.RLock()
        self.steps = 0
        self.tokens_prefilled = 0
        self.tokens_generated = 0
        self.jobs_completed = 0
        # host-loop profile (seconds, cumulative): admission + planning, the engine call, turning samples into results
        self.timings = {"schedule_s": 0.0, "engine_s": 0.0, "results_s": 0.0}

    # ------------------------------------------------------------------ queue
    def num_remaining_jobs(self) -> int:
        """Jobs pending or active, plus finished jobs whose final result `iterate()` has not handed out yet."""
        return len(self.pending) + len(self.active) + sum(1 for r in self._stash if r["eos"])

    def enqueue(self, job: Job | Sequence[Job]) -> int | list[int]:
        """Queue a job (or a list of jobs); returns its serial (or serials). Raises before changing anything if a
        job is invalid or can never fit."""
        if isinstance(job, (list, tuple)):
            for j in job:
                self._validate(j)
            return [self.enqueue(j) for j in job]
        with self.lock:
            self._validate(job)
            self._serial += 1
            job.mark_enqueued(self._serial)
            if job.seed is None:
                job.seed = self._rng.getrandbits(32)
            job.stream = TextStream(self._token_bytes(job), job.stop_strings, job.banned_strings)
            if job.token_healing and job.prompt_len > 1:
                self._setup_healing(job)
            self.pending.append(job)
            return job.serial

    def _validate(self, job: Job) -> None:
        if not isinstance(job, Job):
            raise InvalidJobError(f"enqueue() takes Job objects, got {type(job).__name__}")
        if job.serial is not None:
            raise InvalidJobError(f"{job!r} was already enqueued; create a new Job")
        bad = [t for t in job.input_ids if t >= self.vocab_size]
        if bad:
            raise InvalidJobError(f"input_ids contain ids >= vocab size {self.vocab_size}: {bad[:5]}")
        bad = [t for t in job.stop_tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidJobError(f"stop token ids outside the vocabulary (size {self.vocab_size}): {bad[:5]}")
        if (job.stop_strings or job.banned_strings or job.token_healing) and self.tokenizer is None:
            raise InvalidJobError("stop strings, banned strings and token healing need a tokenizer; pass tokenizer=")
        if job.total_len > self.max_seq_len:
            raise JobTooLargeError(
                f"prompt ({job.prompt_len}) + max_new_tokens ({job.max_new_tokens}) = {job.total_len} tokens exceeds "
                f"max_seq_len={self.max_seq_len}; shorten the prompt, lower max_new_tokens or raise max_seq_len")
        need = -(-job.total_len // self.page_size)
        if need > self.pool.num_pages:
            raise JobTooLargeError(
                f"job needs {need} pages of {self.page_size} tokens but the cache has only {self.pool.num_pages}; "
                "raise num_pages or lower max_new_tokens")

    def _setup_healing(self, job: Job) -> None:
        """Drop the last prompt token; the first sample must start with its text (and that text is not repeated
        in the output)."""
        last = job.input_ids[-1]
        prefix = self.tokenizer.token_bytes(last)
        if self._vocab_bytes is None:
            self._vocab_bytes = [self.tokenizer.token_bytes(i) for i in range(self.vocab_size)]
        special = getattr(self.tokenizer, "special_token_ids", frozenset())
        job.healing_allowed = [i for i, b in enumerate(self._vocab_bytes)
                               if b.startswith(prefix) and b and i not in special]
        job.input_ids = job.input_ids[:-1]
        job.sequence = list(job.input_ids)
        job.stream.strip_prefix = prefix.decode("utf-8", errors="replace")

    def _token_bytes(self, job: Job):
        tok = self.tokenizer
        if tok is None:
            return lambda t: b""
        special = getattr(tok, "special_token_ids", frozenset())
        keep = job.decode_special_tokens
        return lambda t: b"" if (t in special and not keep) else tok.token_bytes(t)

    def cancel(self, job: Job) -> None:
        """Remove a pending or active job; its pages are released. No result is emitted. No-op if finished."""
        with self.lock:
            if job in self.pending:
                self.pending.remove(job)
            elif job in self.active:
                self._retire(job)

    def clear_queue(self) -> None:
        with self.lock:
            for job in list(self.active):
                self._retire(job)
            self.pending.clear()
            self._stash.clear()

    def _retire(self, job: Job) -> None:
        self.active.remove(job)
        self.pool.release(job.pages)
        job.pages = []

    # ------------------------------------------------------------------ admission
    def _prefix(self, job: Job) -> tuple[list[bytes], list[tuple[int, ...]]]:
        n = (job.prompt_len - 1) // self.page_size  # the last prompt token always runs (it samples)
        ps = self.page_size
        toks = [tuple(job.input_ids[i * ps : (i + 1) * ps]) for i in range(n)]
        return chain_hashes(job.input_ids, ps, n), toks

    def _admit(self, results: list[dict]) -> None:
        def fits(job: Job) -> bool:
            if len(self.active) >= self.max_batch_size:
                return False
            hashes, toks = self._prefix(job)
            return self.pool.pages_needed(hashes, toks, -(-job.total_len // self.page_size)) <= self.pool.available

        def start(job: Job) -> None:
            hashes, toks = self._prefix(job)
            job.pages, complete = self.pool.allocate(hashes, toks, -(-job.total_len // self.page_size))
            job.page_hashes = hashes
            job.kv_position = job.cached_tokens = complete * self.page_size
            self.pending.remove(job)
            self.active.append(job)
            results.append(self._base(job, "started"))

        if self.pending and len(self.active) < self.max_batch_size:
            self.policy.admit(list(self.pending), fits, start)

    # ------------------------------------------------------------------ stepping
    def _skip_complete_pages(self, job: Job) -> None:
        """Advance over pages another job has finished writing since (shared prefix pages)."""
        ps = self.page_size
        while job.kv_position % ps == 0 and job.kv_position + ps <= len(job.sequence) - 1:
            page = self.pool.pages[job.pages[job.kv_position // ps]]
            if page.filled < ps:
                break
            job.kv_position += ps
            job.cached_tokens = max(job.cached_tokens, job.kv_position)

    def _row(self, job: Job, tokens: list[int], sample: bool) -> RowInput:
        s = job.gen_settings
        bias = s.bias()
        if job.new_tokens < job.min_new_tokens:
            bias.update({t: -math.inf for t in job.stop_tokens})
        sample_index = job.kv_position + len(tokens)  # index in job.sequence of the token this row samples
        if job.new_tokens == 0 and job.healing_allowed:
            # a large equal boost keeps the allowed tokens' relative odds and makes every other token impossible
            bias.update({t: bias.get(t, 0.0) + HEALING_BOOST for t in job.healing_allowed})
        bias.update({t: -math.inf for t in job.explored.get(sample_index, ())})
        end = job.kv_position + len(tokens)
        window = min(s.penalty_range, self.max_penalty_range)
        history = job.sequence[max(0, end - window) : end] if s.uses_penalties and window else ()
        return RowInput(tokens=tokens, start_pos=job.kv_position, pages=job.pages, sample=sample,
                        sampling=s.device_row(job.seed), history=history, bias=bias)

    def _plan(self) -> tuple[list[RowInput], list[Job]]:
        rows, owners = [], []
        prefill_rows = 0
        budget = self.max_chunk_size
        for job in self.active:
            self._skip_complete_pages(job)
            remaining = len(job.sequence) - job.kv_position
            if remaining == 1:
                rows.append(self._row(job, [job.sequence[-1]], True))
            else:
                if prefill_rows >= self.max_prefill_rows or budget <= 0:
                    continue  # waits for a later step
                n = min(remaining, budget)
                # stop before a page that is complete already (being shared): it is skipped next step
                ps = self.page_size
                end = job.kv_position + n
                for p in range(-(-job.kv_position // ps), -(-end // ps)):
                    if p * ps > job.kv_position and self.pool.pages[job.pages[p]].filled == ps and p * ps < end:
                        end = p * ps
                        break
                n = end - job.kv_position  # a 1-token chunk rides in a decode slot, without sampling
                prefill_rows += n > 1
                budget -= n
                rows.append(self._row(job, job.sequence[job.kv_position : end], end == len(job.sequence)))
            owners.append(job)
        return rows, owners

    def iterate(self) -> list[dict]:
        """Run one step; return the result dicts it produced (possibly none)."""
        with self.lock:
            t0 = time.perf_counter()
            results: list[dict] = self._stash
            self._stash = []
            self._admit(results)
            rows, owners = self._plan()
            if not rows:
                self.timings["schedule_s"] += time.perf_counter() - t0
                return results
            top_k = _pow2(max((j.return_top_tokens for j in owners), default=0))
            want_logits = any(j.return_logits for j in owners)
            k = self._burst(rows, owners, want_logits)
            t1 = time.perf_counter()
            out = self.engine.run(rows, return_top_k=top_k, return_logits=want_logits, num_steps=k)
            self.steps += k
            now = time.perf_counter()
            self.timings["schedule_s"] += t1 - t0
            self.timings["engine_s"] += now - t1
            try:
                if k == 1:
                    self._collect(rows, owners, out, now, results)
                else:  # step i's tokens are fed as if they came from single steps, skipping jobs that ended
                    live = [(r, j, i) for i, (r, j) in enumerate(zip(rows, owners))]
                    for i in range(k):
                        live = [(r, j, c) for r, j, c in live if j in self.active]
                        self._collect([r for r, _, _ in live], [j for _, j, _ in live], _StepView(out, i,
                                      [c for _, _, c in live]), now, results)
            finally:
                self.timings["results_s"] += time.perf_counter() - now
            return results

    def _burst(self, rows: list[RowInput], owners: list[Job], want_logits: bool) -> int:
        """Decode steps for this engine call: `decode_steps` when it is safe to run them blind, else 1.

        A burst may run past a job's `max_new_tokens` (the extra tokens are discarded), so short remainders do not
        need the single-step variant; it must stay inside the job's own pages, whose slots past its last consumed
        position are never hashed or shared, so the extra KV writes touch nothing else."""
        k = self.decode_steps
        if k == 1 or want_logits or (self.pending and len(self.active) < self.max_batch_size):
            return 1
        for row, job in zip(rows, owners):
            if (len(row.tokens) != 1 or not row.sample or job.banned_strings or job.explored
                    or job.new_tokens < job.min_new_tokens or job.kv_position + k > len(job.pages) * self.page_size
                    or (job.healing_allowed and job.new_tokens == 0)):
                return 1
            s = job.gen_settings
            if s.uses_penalties:  # decode_steps slides the history bucket; exact when that is the job's window
                window = min(s.penalty_range, self.max_penalty_range)
                if window < self.max_penalty_range and job.kv_position + k > window:
                    return 1
        return k

    def _collect(self, rows: list[RowInput], owners: list[Job], out: Any, now: float, results: list[dict]) -> None:
        """Advance each row's job by the step's output and append its result dicts."""
        for i, (row, job) in enumerate(zip(rows, owners)):
            n = len(row.tokens)
            if job.time_first_prefill is None:
                job.time_first_prefill = now - out.seconds
            job.kv_position += n
            self._mark_written(job, n)
            if not row.sample:
                self.tokens_prefilled += n
                results.append({**self._base(job, "prefill"), "curr_progress": job.kv_position,
                                "max_progress": job.prompt_len})
                continue
            if n > 1:
                self.tokens_prefilled += n
            extras = {}
            if job.return_probs:
                extras["token_probs"] = float(np.exp(out.logprob[i]))
            if job.return_top_tokens:
                k = job.return_top_tokens
                extras["top_k_tokens"] = out.top_ids[i, :k].tolist()
                extras["top_k_probs"] = np.exp(out.top_logprobs[i, :k]).tolist()
            if job.return_logits:
                extras["logits"] = out.logits[i]
            results.append(self._receive(job, int(out.token[i]), extras, now))

    def _mark_written(self, job: Job, n: int) -> None:
        ps = self.page_size
        kv = job.kv_position
        for p in range((kv - n) // ps, -(-kv // ps)):
            self.pool.mark_filled(job.pages[p], kv - p * ps)
        self._hash_pages(job, min(kv, len(job.sequence) - len(job.stream.held)))

    def _hash_pages(self, job: Job, limit: int) -> None:
        """Hash and register the job's pages complete below `limit` (prompt tail, generated text) for reuse.
        Tokens still held by the stream may be rewound by a banned string, so their pages wait."""
        ps = self.page_size
        while (len(job.page_hashes) + 1) * ps <= limit:
            p = len(job.page_hashes)
            prev = job.page_hashes[-1] if job.page_hashes else b""
            toks = tuple(job.sequence[p * ps : (p + 1) * ps])
            h = chain_hashes(toks, ps, 1, prev)[0]
            self.pool.register(job.pages[p], h, prev, toks)
            job.page_hashes.append(h)

    # ------------------------------------------------------------------ results
    def _base(self, job: Job, stage: str) -> dict:
        return {"job": job, "stage": stage, "eos": False, "serial": job.serial, "identifier": job.identifier}

    def _receive(self, job: Job, token: int, extras: dict, now: float) -> dict:
        job.sequence.append(token)
        job.new_tokens += 1
        self.tokens_generated += 1
        if job.time_first_token is None:
            job.time_first_token = now
        job.time_last_token = now
        job.pending_extras.append(extras)
        r = self._base(job, "streaming")
        reason = None
        held = {"text": "", "token_ids": []}
        if token in job.stop_tokens:  # (banned by the sampler until min_new_tokens are out)
            reason = "stop_token"
            text, toks = job.stream.flush()  # the stop token's own text is not part of the completion
            job.pending_extras.pop()
            held["token_ids"] = [token]
            r.update(eos_triggering_token_id=token, eos_triggering_token_str=self._piece(token))
        else:
            ev = job.stream.feed(token)
            text, toks = ev.text, ev.tokens
            if ev.rewind:
                self._rewind(job, ev.rewind, ev.suppressed_tokens[0])
                r.update(suppressed_text=ev.suppressed_text, suppressed_tokens=ev.suppressed_tokens,
                         suppressed_by=ev.banned)
            elif ev.stopped is not None:
                reason = "stop_string"
                r["eos_triggering_string"] = ev.stopped
                held["text"] = job.stream.held_text
            elif job.new_tokens >= job.max_new_tokens:
                reason = "max_new_tokens"
                more_text, more = job.stream.flush()
                text, toks = text + more_text, toks + more
        released = job.pending_extras[: len(toks)]
        job.pending_extras = job.pending_extras[len(toks):]
        job.full_completion += text
        r["text"] = text
        r["token_ids"] = toks
        for key in ("token_probs", "top_k_tokens", "top_k_probs", "logits"):
            if released and key in released[0]:
                vals = [e[key] for e in released]
                r[key] = np.stack(vals) if key == "logits" else vals
        if reason is not None:
            self._hash_pages(job, job.kv_position)  # the output is final: its complete pages become reusable
            r.update(
                eos=True, eos_reason=reason, full_completion=job.full_completion, new_tokens=job.new_tokens,
                prompt_tokens=job.prompt_len, cached_tokens=job.cached_tokens,
                cached_pages=job.cached_tokens // self.page_size,
                time_enqueued=(job.time_first_prefill or now) - job.time_enqueue,
                time_prefill=job.time_first_token - (job.time_first_prefill or job.time_first_token),
                time_generate=job.time_last_token - job.time_first_token, held=held,
            )
            self._retire(job)
            self.jobs_completed += 1
        return r

    def _rewind(self, job: Job, n: int, first: int) -> None:
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

    def _piece(self, token: int) -> str:
        tok = self.tokenizer
        return "" if tok is None else tok.token_bytes(token).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ conveniences
    def metrics(self) -> dict:
        pool = self.pool
        return {
            "pages_total": pool.num_pages, "pages_used": pool.num_referenced, "pages_cached": pool.num_cached,
            "pages_free": pool.num_free, "prefix_queries": pool.prefix_queries, "prefix_hits": pool.prefix_hits,
            "prefix_hit_rate": pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else 0.0,
            "steps": self.steps, "tokens_prefilled": self.tokens_prefilled,
            "tokens_generated": self.tokens_generated, "jobs_completed": self.jobs_completed,
            "jobs_pending": len(self.pending), "jobs_active": len(self.active),
            **{f"time_{k}": v for k, v in self.timings.items()},
            **{f"time_engine_{k}": v for k, v in getattr(self.engine, "timings", {}).items()},
        }

    def warmup(self, progress: bool = False) -> int:
        """Compile every step bucket (and the multi-step decode variants with decode_steps > 1), then forget the
        prompt cache. Returns the number of variants compiled."""
        with self.lock:
            n = self.engine.warmup(progress=progress, decode_steps=self.decode_steps)
            self.pool.reset_cache()
            return n

    def generate(
        self,
        prompt: str | Sequence[str],
        max_new_tokens: int,
        *,
        min_new_tokens: int = 0,
        gen_settings: SamplingSettings | Sequence[SamplingSettings] | None = None,
        stop_conditions: Sequence[int | str] | None = None,
        seed: int | None = None,
        completion_only: bool = True,
        add_bos: bool = False,
        encode_special_tokens: bool = False,
        decode_special_tokens: bool = False,
        abort_event: threading.Event | None = None,
        return_last_results: bool = False,
    ):
        """Generate completions for one prompt (-> str) or a list (-> list[str]) through the job API. Jobs enqueued
        by other callers keep running; their results are kept for the next `iterate()`. With `seed`, prompt i
        uses seed + i. With `abort_event` set, the jobs are cancelled and None is returned."""
        if self.tokenizer is None:
            raise InvalidJobError("generate() needs a tokenizer; pass tokenizer= to the generator")
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        settings = gen_settings if isinstance(gen_settings, (list, tuple)) else [gen_settings] * len(prompts)
        if len(settings) != len(prompts):
            raise InvalidJobError(f"{len(settings)} gen_settings for {len(prompts)} prompts")
        jobs = []
        for i, (p, s) in enumerate(zip(prompts, settings)):
            ids = self.tokenizer.encode(p, add_bos=add_bos, encode_special_tokens=encode_special_tokens)
            jobs.append(Job(ids, max_new_tokens, min_new_tokens=min_new_tokens, gen_settings=s,
                            stop_conditions=stop_conditions, seed=None if seed is None else seed + i,
                            decode_special_tokens=decode_special_tokens, identifier=("generate", i)))
        self.enqueue(jobs)
        index = {id(j): i for i, j in enumerate(jobs)}
        texts = [""] * len(jobs)
        last: list[dict | None] = [None] * len(jobs)
        remaining = len(jobs)
        while remaining:
            if abort_event is not None and abort_event.is_set():
                for j in jobs:
                    self.cancel(j)
                return None
            mine, others = [], []
            for r in self.iterate():
                (mine if id(r["job"]) in index else others).append(r)
            self._stash.extend(others)
            for r in mine:
                i = index[id(r["job"])]
                texts[i] += r.get("text", "")
                if r["eos"]:
                    last[i] = r
                    remaining -= 1
            if not mine and not self.active and not self.pending:
                break
        if not completion_only:
            texts = [p + t for p, t in zip(prompts, texts)]
        out = texts[0] if single else texts
        if return_last_results:
            return out, (last[0] if single else last)
        return out
