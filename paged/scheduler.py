"""`Scheduler`: the mechanism under the policy. Each step it admits waiting jobs whose pages fit (in the order and
with the skips the `Policy` decides), then plans one ragged step: a decode row for every job with one token to feed,
prefill chunks within the token budget and the prefill-row limit, and how many decode steps may run blind
(`decode_steps` bursts).

It reads and updates jobs' page lists and KV positions and the `PagePool`; it never touches the engine or the
result stream (that is `paged.job_output`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from paged.batch import RowInput
from paged.config import EngineConfig
from paged.errors import JobFailure
from paged.job import Job
from paged.page_pool import PagePool, chain_hashes
from paged.policy import Policy

HEALING_BOOST = 1e4  # token healing: added to the allowed tokens' logits, so nothing else can be drawn


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool, policy: Policy, vocab_size: int):
        self.config = config
        self.pool = pool
        self.policy = policy
        self.vocab_size = vocab_size
        self.page_size = config.page_size

    def pages_for(self, job: Job) -> int:
        """Pages reserved for a job: its prompt plus max_new_tokens."""
        return -(-job.total_len // self.page_size)

    # ------------------------------------------------------------------ admission
    def prefix(self, job: Job) -> tuple[list[bytes], list[tuple[int, ...]]]:
        """Chained hashes and tokens of the job's full prompt pages that may come from the cache (the last prompt
        token always runs, since it samples)."""
        n = (job.prompt_len - 1) // self.page_size
        ps = self.page_size
        toks = [tuple(job.input_ids[i * ps : (i + 1) * ps]) for i in range(n)]
        return chain_hashes(job.input_ids, ps, n), toks

    def admit(self, pending: list[Job], active: list[Job], started: Callable[[Job], None]) -> None:
        """Move the jobs the policy admits from `pending` to `active` (pages allocated); `started(job)` for each."""

        def fits(job: Job) -> bool:
            if len(active) >= self.config.max_batch_size:
                return False
            hashes, toks = self.prefix(job)
            return self.pool.pages_needed(hashes, toks, self.pages_for(job)) <= self.pool.available

        def start(job: Job) -> None:
            hashes, toks = self.prefix(job)
            job.pages, complete = self.pool.allocate(hashes, toks, self.pages_for(job))
            job.page_hashes = hashes
            job.kv_position = job.cached_tokens = complete * self.page_size
            pending.remove(job)
            active.append(job)
            started(job)

        if pending and len(active) < self.config.max_batch_size:
            self.policy.admit(list(pending), fits, start)

    # ------------------------------------------------------------------ planning
    def skip_complete_pages(self, job: Job) -> None:
        """Advance over pages another job has finished writing since (shared prefix pages)."""
        ps = self.page_size
        while job.kv_position % ps == 0 and job.kv_position + ps <= len(job.sequence) - 1:
            page = self.pool.pages[job.pages[job.kv_position // ps]]
            if page.filled < ps:
                break
            job.kv_position += ps
            job.cached_tokens = max(job.cached_tokens, job.kv_position)

    def row(self, job: Job, tokens: list[int], sample: bool) -> RowInput:
        """The job's row for this step: `tokens` from its KV position, with its sampling settings, penalty history
        and logit bias (settings' bias and bans, stop tokens before min_new_tokens, token healing, tokens banned at
        this position by earlier banned-string rewinds)."""
        s = job.gen_settings
        bias = s.bias()
        if job.new_tokens < job.min_new_tokens:
            bias.update({t: -math.inf for t in job.stop_tokens})
        sample_index = job.kv_position + len(tokens)  # index in job.sequence of the token this row samples
        if job.new_tokens == 0 and job.healing_allowed:
            # a large equal boost keeps the allowed tokens' relative odds and makes every other token impossible
            bias.update({t: bias.get(t, 0.0) + HEALING_BOOST for t in job.healing_allowed})
        bias.update({t: -math.inf for t in job.explored.get(sample_index, ())})
        if sample and sum(1 for v in bias.values() if v == -math.inf) >= self.vocab_size:
            raise JobFailure(f"every token of the vocabulary is banned at output position {job.new_tokens} (banned "
                             "tokens, stop tokens before min_new_tokens and banned-string rewinds together)")
        end = job.kv_position + len(tokens)
        window = min(s.penalty_range, self.config.max_penalty_range)
        history = job.sequence[max(0, end - window) : end] if s.uses_penalties and window else ()
        return RowInput(tokens=tokens, start_pos=job.kv_position, pages=job.pages, sample=sample,
                        sampling=s.device_row(job.seed), history=history, bias=bias)

    def plan(self, active: list[Job]) -> tuple[list[RowInput], list[Job], list[tuple[Job, Exception]]]:
        """Rows of the next step and the job of each row; jobs whose row could not be built come back as failures
        (the caller ends them) instead of stopping the step."""
        rows, owners, failed = [], [], []
        prefill_rows = 0
        budget = self.config.max_chunk_size
        ps = self.page_size
        for job in active:
            try:
                self.skip_complete_pages(job)
                remaining = len(job.sequence) - job.kv_position
                if remaining == 1:
                    rows.append(self.row(job, [job.sequence[-1]], True))
                else:
                    if prefill_rows >= self.config.max_prefill_rows or budget <= 0:
                        continue  # waits for a later step
                    n = min(remaining, budget)
                    # stop before a page that is complete already (being shared): it is skipped next step
                    end = job.kv_position + n
                    for p in range(-(-job.kv_position // ps), -(-end // ps)):
                        if p * ps > job.kv_position and self.pool.pages[job.pages[p]].filled == ps and p * ps < end:
                            end = p * ps
                            break
                    n = end - job.kv_position  # a 1-token chunk rides in a decode slot, without sampling
                    rows.append(self.row(job, job.sequence[job.kv_position : end], end == len(job.sequence)))
                    prefill_rows += n > 1
                    budget -= n
            except Exception as e:  # noqa: BLE001 (one job's failure must not stop the others)
                failed.append((job, e))
                continue
            owners.append(job)
        return rows, owners, failed

    def burst(self, rows: list[RowInput], owners: list[Job], want_logits: bool, admission_waiting: bool) -> int:
        """Decode steps for this engine call: `decode_steps` when it is safe to run them blind, else 1.

        A burst may run past a job's `max_new_tokens` (the extra tokens are discarded), so short remainders do not
        need the single-step variant; it must stay inside the job's own pages, whose slots past its last consumed
        position are never hashed or shared, so the extra KV writes touch nothing else."""
        k = self.config.decode_steps
        if k == 1 or want_logits or admission_waiting:
            return 1
        for row, job in zip(rows, owners):
            if (len(row.tokens) != 1 or not row.sample or job.banned_strings or job.explored
                    or job.new_tokens < job.min_new_tokens or job.kv_position + k > len(job.pages) * self.page_size
                    or (job.healing_allowed and job.new_tokens == 0)):
                return 1
            s = job.gen_settings
            if s.uses_penalties:  # decode bursts slide the history bucket; exact when that is the job's window
                window = min(s.penalty_range, self.config.max_penalty_range)
                if window < self.config.max_penalty_range and job.kv_position + k > window:
                    return 1
        return k
