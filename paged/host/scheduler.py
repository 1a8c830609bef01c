"""`Scheduler`: the mechanism under the policy. Each step it admits waiting jobs (in the order, with the skips and
the preemptions the `Policy` decides) whose pages fit, then plans one ragged step: a decode row for every running job
with one token to feed, prefill chunks within the token budget the policy grants and the prefill-row limit, and how
many decode steps may run blind (`decode_steps` bursts).

Pages are given out as the policy's `allocation` says. `reserve`: prompt + max_new_tokens at admission, so a running
job never runs out. `on_demand`: the prompt (the whole sequence, for a preempted job) at admission, then a page at a
time as decoding reaches it; when the pool is empty the policy names a victim, which is preempted by recompute:
its pages are released (complete, hashed ones stay in the prompt cache), it goes back to the front of the waiting
queue with its generated tokens and text stream kept, and on re-admission its whole sequence is prefilled again,
mostly skipped as cached pages. Greedy and seeded sampling depend only on the context and the position, so its
output is the one an unpreempted run gives, and nothing is streamed twice.

It reads and updates jobs' page lists and KV positions, the waiting and running lists and the `PagePool`; it never
touches the engine or the result stream (that is `paged.host.job_output`).
"""

from __future__ import annotations

import bisect
import collections
import math
import operator
import weakref
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from paged.device.batch import RowInput
from paged.device.config import EngineConfig
from paged.embeddings import device_ids
from paged.errors import JobFailure, PolicyError
from paged.host.page_pool import PagePool, chain_hashes
from paged.job import Job
from paged.policies import Policy
from paged.policies.waiting import QueueSnapshot, ReadOnlyJobs
from paged.token_sets import pack


def members(job: Job) -> tuple[Job, ...]:
    """The job and, for a CFG job, its negative-prompt companion: what holds pages and rows for it."""
    return (job,) if job.cfg_partner is None else (job, job.cfg_partner)


def _queue_position(job: Job) -> int:
    return job.queue_position


def _all_banned(bias: dict[int, float], vocab_size: int) -> bool:
    """Whether `bias` bans every token of the vocabulary (it has at least as many entries as tokens, first)."""
    return len(bias) >= vocab_size and sum(1 for v in bias.values() if v == -math.inf) >= vocab_size


class SortedWaiting:
    """The waiting jobs in the order `sorted(waiting, key=key)` gives, kept in that order as jobs start and stop
    waiting (a binary search and a list insert or delete each) instead of sorted again at every step: what
    `SchedulerView.sorted_waiting` hands out. `key(job)` must not change while the job waits."""

    def __init__(self, key: Callable[[Job], Any], waiting: list[Job]):
        self.key = key
        self.jobs = sorted(waiting, key=key)
        self.keys = [key(j) for j in self.jobs]

    def add(self, job: Job, front: bool) -> None:
        """A job starts waiting: at the front of the queue (a preempted job: before the jobs of an equal key, as a
        stable sort puts it) or at its end (after them)."""
        k = self.key(job)
        i = (bisect.bisect_left if front else bisect.bisect_right)(self.keys, k)
        self.keys.insert(i, k)
        self.jobs.insert(i, job)

    def remove(self, job: Job) -> None:
        i = bisect.bisect_left(self.keys, self.key(job))
        while i < len(self.jobs) and self.jobs[i] is not job:  # (past jobs of an equal key)
            i += 1
        if i == len(self.jobs):  # its key changed while it waited: find it by identity
            i = next(n for n, j in enumerate(self.jobs) if j is job)
        del self.keys[i]
        del self.jobs[i]

    def __len__(self) -> int:
        return len(self.jobs)


class FirstPages:
    """The waiting jobs by the hash of their first cacheable page (`Scheduler.prefix`): only a job whose first page
    is registered in the pool can have a cached prefix (`Scheduler.cached_prefixes`)."""

    def __init__(self, sched: Scheduler, waiting: list[Job]):
        self.sched = sched
        self.jobs: dict[bytes, list[Job]] = {}
        self.first: dict[Job, bytes | None] = {}
        for job in waiting:
            self.add(job, False)

    def add(self, job: Job, front: bool) -> None:
        hashes, _ = self.sched.prefix(job)
        self.first[job] = hashes[0] if hashes else None
        if hashes:
            self.jobs.setdefault(hashes[0], []).append(job)

    def remove(self, job: Job) -> None:
        h = self.first.pop(job)
        if h is not None:
            same = self.jobs[h]
            same.remove(job)
            if not same:
                del self.jobs[h]

    def __len__(self) -> int:
        return len(self.first)


MAX_INDEXES = 8  # indexes of the waiting queue a scheduler keeps (a sorted order per key a policy sorts by, ...)
WATERMARK = 0.01  # on_demand: fraction of the pages admission leaves free for running jobs' growth (vLLM's default)


class SchedulerView:
    """What a policy sees and may do (`paged.policies.base.SchedulerView` documents each member). What a policy asks
    for is checked before anything changes: no policy, however wrong, can corrupt the page pool or the queues."""

    def __init__(self, sched: Scheduler):
        self._s = sched
        self.config = sched.config
        self._running = ReadOnlyJobs(sched.active)  # (the live list, read-only: preempt() changes it)

    @property
    def running(self) -> ReadOnlyJobs:
        return self._running

    def _in_admit(self, call: str) -> None:
        s = self._s
        if s.hook != "admit()":
            raise s.policy_error(f"{call} may be called only from admit() (where the step's rows are not planned "
                                 "yet); victim() names its victim by returning it")

    @property
    def now(self) -> float:
        return self._s.clock()

    @property
    def pages_available(self) -> int:
        return self._s.pool.available

    def fits(self, job: Job) -> bool:
        return self._s.fits(job)

    def start(self, job: Job) -> None:
        s = self._s
        self._in_admit("start()")
        if not isinstance(job, Job):
            raise s.policy_error(f"start() takes one of the waiting jobs, got {type(job).__name__}")
        if job not in s.waiting:
            state = ("running (started already: is it in order()'s list twice?)" if any(j is job for j in s.active)
                     else "not waiting in this generator (finished, cancelled or never enqueued)")
            raise s.policy_error(f"start({job!r}): the job is {state}; start each waiting job at most once")
        if not s.fits(job):
            raise s.policy_error(f"start({job!r}): the job does not fit now (batch rows or pages); start only jobs "
                                 "for which fits(job) is True")
        s.start(job)

    def preempt(self, job: Job) -> None:
        self._in_admit("preempt()")
        self._s.preempt(job)

    def would_fit_without(self, job: Job, victims: list[Job]) -> bool:
        return self._s.would_fit_without(job, victims)

    def cached_prefix_tokens(self, job: Job) -> int:
        return self._s.cached_prefix_tokens(job)

    def sorted_waiting(self, waiting: list[Job], key: Callable[[Job], Any]) -> list[Job]:
        return self._s.sorted_waiting(waiting, key)

    def cached_prefixes(self, waiting: list[Job]) -> dict[Job, int]:
        return self._s.cached_prefixes(waiting)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool, policy: Policy, vocab_size: int, pending: list[Job],
                 active: list[Job], clock: Callable[[], float]):
        self.config = config
        self.pool = pool
        self.policy = policy
        self.vocab_size = vocab_size
        self.page_size = config.page_size
        self.max_penalty_range = config.max_penalty_range
        self.pending = pending  # the generator's lists, updated in place
        self.active = active
        # The waiting jobs (`pending`, as a set). `pending` is in queue order: each job's `queue_position` grows
        # along it (a job added at the front takes one below every other), so a job is found by binary search.
        self.waiting: set[Job] = set(pending)
        self._front = self._back = 0
        for i, job in enumerate(pending):
            job.queue_position = i
        self.clock = clock
        self.on_demand = policy.allocation == "on_demand"
        self.watermark = int(WATERMARK * pool.num_pages) if self.on_demand else 0
        self.view = SchedulerView(self)
        self.preemptions = 0
        self._started: Callable[[Job], None] = lambda job: None
        self.on_release: Callable[[Job], None] = lambda job: None  # a job lost its pages (speculative state reset)
        self._budget = 0
        self._prefill_rows = 0
        self.hook = ""  # the policy hook being asked (named in PolicyError)
        # indexes of the waiting queue kept as jobs come and go: SortedWaiting by key, FirstPages
        self._indexes: dict[Any, SortedWaiting | FirstPages] = {}
        self._version = 0  # counts the changes of the waiting queue
        # While admit() runs, the waiting lists (`pending` and the indexes) stay as they were and the changes wait
        # here, applied when the hook returns: the snapshots handed to the policy read those lists meanwhile.
        self._deferred: list[tuple[bool, Job, bool]] | None = None  # (added, job, front)
        self._snapshots: list[weakref.ref] = []  # the snapshots sharing the waiting lists during admit()

    def policy_error(self, msg: str, hook: str = "") -> PolicyError:
        return PolicyError(f"policy {self.policy.name!r} ({type(self.policy).__name__}), "
                           f"{hook or self.hook or 'a hook'}: {msg}")

    def ask(self, hook: str, fn: Callable, *args):
        """Call policy hook `hook` (`fn(*args)`); anything it raises comes out as a `PolicyError` naming it."""
        self.hook = hook
        try:
            return fn(*args)
        except PolicyError:
            raise
        except Exception as e:  # noqa: BLE001 (a user policy's bug: named, with the cause chained)
            raise self.policy_error(f"raised {type(e).__name__}: {e}") from e
        finally:
            self.hook = ""

    def pages_for(self, job: Job) -> int:
        """Pages a job needs at most: its prompt plus max_new_tokens (all reserved at admission with `reserve`)."""
        return -(-job.total_len // self.page_size)

    def admission_pages(self, job: Job) -> int:
        """Pages allocated when the job is admitted: `pages_for` (reserve) or its sequence so far (on_demand)."""
        return -(-len(job.sequence) // self.page_size) if self.on_demand else self.pages_for(job)

    # ------------------------------------------------------------------ the waiting queue
    def add_waiting(self, job: Job, front: bool = False) -> None:
        """Queue a job at the end of the waiting list, or with `front` at its start (a preempted job)."""
        self.waiting.add(job)
        if self._deferred is not None:
            self._deferred.append((True, job, front))
            return
        if front:
            self._front -= 1
            job.queue_position = self._front
            self.pending.insert(0, job)
        else:
            self._back += 1
            job.queue_position = self._back
            self.pending.append(job)
        self._changed(lambda order: order.add(job, front))

    def remove_waiting(self, job: Job) -> None:
        """Take a job off the waiting list."""
        self.waiting.discard(job)
        if self._deferred is not None:
            self._deferred.append((False, job, False))
            return
        pending = self.pending
        at = bisect.bisect_left(pending, job.queue_position, key=_queue_position)
        if at < len(pending) and pending[at] is job:
            del pending[at]
        else:  # (the list was changed behind the scheduler's back)
            pending.remove(job)
        self._changed(lambda order: order.remove(job))

    def _end_admission(self) -> None:
        """After admit(): the snapshots still referenced take their copies, then the waiting lists change as the
        policy's starts and preemptions asked, in their order."""
        for ref in self._snapshots:
            snapshot = ref()
            if snapshot is not None:
                snapshot.detach()
        self._snapshots = []
        deferred, self._deferred = self._deferred, None
        for added, job, front in deferred or ():
            if added:
                self.add_waiting(job, front)
            else:
                self.remove_waiting(job)

    def _changed(self, update: Callable[[SortedWaiting | FirstPages], None]) -> None:
        self._version += 1
        for name, index in list(self._indexes.items()):
            try:
                update(index)
            except Exception:  # noqa: BLE001 (a policy's key failed: the next query rebuilds it, in the policy's hook)
                del self._indexes[name]

    def _whole_queue(self, waiting: list[Job] | QueueSnapshot) -> bool:
        """Whether `waiting` is the snapshot `admit()` is running with (or a copy of it), unchanged."""
        return (self._deferred is not None and isinstance(waiting, QueueSnapshot) and waiting.shared
                and waiting._items is self.pending)

    def _index(self, name: Any, build: Callable[[], SortedWaiting | FirstPages]) -> SortedWaiting | FirstPages:
        index = self._indexes.get(name)
        if index is None or len(index) != len(self.pending):  # (new, or the queue changed behind our back)
            if len(self._indexes) >= MAX_INDEXES:
                del self._indexes[next(iter(self._indexes))]
            index = self._indexes[name] = build()
        return index

    def sorted_waiting(self, waiting: list[Job], key: Callable[[Job], Any]) -> list[Job] | QueueSnapshot:
        """`sorted(waiting, key=key)` (see `paged.policies.base.SchedulerView.sorted_waiting`). For the snapshot
        admit() handed out, a snapshot of the order kept for `key` instead of sorting the queue again."""
        if not self._whole_queue(waiting):
            return sorted(waiting, key=key)
        index = self._indexes.get(key)
        if index is None or len(index) != len(self.pending):
            index = self._index(key, lambda: SortedWaiting(key, self.pending))
        return QueueSnapshot(index.jobs, self._snapshots)

    def cached_prefixes(self, waiting: list[Job]) -> dict[Job, int]:
        """The jobs of `waiting` with a cached prefix, and its tokens (`cached_prefix_tokens`, when > 0). For the
        whole queue only the jobs whose first page is registered in the pool are looked at."""
        if not self._whole_queue(waiting):
            candidates = waiting
        else:
            index = self._index(FirstPages, lambda: FirstPages(self, self.pending)).jobs
            candidates = [j for h in index.keys() & self.pool.by_hash.keys() for j in index[h]]
        out = {}
        for job in candidates:
            n = self.cached_prefix_tokens(job)
            if n:
                out[job] = n
        return out

    # ------------------------------------------------------------------ admission
    def prefix(self, job: Job) -> tuple[list[bytes], list[tuple[int, ...]]]:
        """Chained hashes and tokens of the job's full pages that may come from the cache: its sequence (prompt, and
        for a preempted job the tokens generated so far) except the last token, which always runs since it samples,
        and except text its stream still holds (a banned string may rewind it). Memoised while the job waits."""
        seq = job.sequence
        memo = job.prefix_memo
        if memo is not None and memo[0] == len(seq):
            return memo[1], memo[2]
        held = len(job.stream.held) if job.stream is not None else 0
        ps = self.page_size
        n = min(len(seq) - 1, len(seq) - held) // ps
        toks = [tuple(seq[i * ps : (i + 1) * ps]) for i in range(n)]
        hashes = chain_hashes(seq, ps, n, root=job.hash_root)
        job.prefix_memo = (len(seq), hashes, toks)
        return hashes, toks

    def rows_used(self) -> int:
        """Batch rows the running jobs take (a CFG job takes two)."""
        return len(self.active) + len([j for j in self.active if j.cfg_partner is not None])

    def _requests(self, job: Job) -> list:
        return [(*self.prefix(m), self.admission_pages(m)) for m in members(job)]

    def fits(self, job: Job) -> bool:
        if self.rows_used() + len(members(job)) > self.config.max_batch_size:
            return False
        need = self.pool.pages_needed_many(self._requests(job))
        return need + self.watermark <= self.pool.available

    def start(self, job: Job) -> None:
        """Admit a waiting job: its pages are allocated."""
        requests = self._requests(job)
        allocated = self.pool.allocate_many(requests, count=not job.preemptions)
        for m, (hashes, _, _), (pages, complete) in zip(members(job), requests, allocated):
            m.pages, m.page_hashes, m.kv_position = pages, list(hashes), complete * self.page_size
        self.remove_waiting(job)
        self.active.append(job)
        if not job.preemptions:
            job.cached_tokens = job.kv_position
            self._started(job)

    def preempt(self, job: Job) -> None:
        """Preempt a running job by recompute (see the module docstring)."""
        if not any(j is job for j in self.active):
            raise self.policy_error(f"preempt({job!r}): the job is not running; preempt only running jobs")
        self.active.remove(job)
        for m in members(job):
            self.pool.release(m.pages)
            m.kv_at_preemption = max(m.kv_position, m.kv_at_preemption)  # (the generator counts recomputation)
            m.pages = []
            m.page_hashes = []
            m.kv_position = 0
            m.prefix_memo = None
            m.preemptions += 1
        self.preemptions += 1
        self.add_waiting(job, front=True)
        for m in members(job):
            self.on_release(m)

    def would_fit_without(self, job: Job, victims: list[Job]) -> bool:
        rows = self.rows_used() - sum(len(members(v)) for v in victims)
        if rows + len(members(job)) > self.config.max_batch_size:
            return False
        need = self.pool.pages_needed_many(self._requests(job)) + self.watermark
        if need <= self.pool.available:  # (it fits already, whatever the victims would free)
            return True
        refs = collections.Counter(p for v in victims for m in members(v) for p in m.pages)
        freed = sum(1 for p, n in refs.items() if self.pool.pages[p].ref_count == n)
        return need <= self.pool.available + freed

    def cached_prefix_tokens(self, job: Job) -> int:
        hashes, toks = self.prefix(job)
        n = 0
        for idx in self.pool.match(hashes, toks):
            if self.pool.pages[idx].filled < self.page_size:
                break
            n += 1
        return n * self.page_size

    def admit(self, started: Callable[[Job], None]) -> None:
        """Let the policy move waiting jobs to running (pages allocated); `started(job)` for each first admission."""
        if self.pending and (self.policy.preemptive or self.rows_used() < self.config.max_batch_size):
            self._started = started
            waiting = QueueSnapshot(self.pending, self._snapshots)
            self._deferred = []
            try:
                self.ask("admit()", self.policy.admit, waiting, self.view)
            finally:
                del waiting
                self._end_admission()

    # ------------------------------------------------------------------ planning
    def skip_complete_pages(self, job: Job) -> None:
        """Advance over pages another job has finished writing since (shared prefix pages)."""
        ps = self.page_size
        while job.kv_position % ps == 0 and job.kv_position + ps <= len(job.sequence) - 1:
            page = self.pool.pages[job.pages[job.kv_position // ps]]
            if page.filled < ps:
                break
            job.kv_position += ps
            if not job.preemptions:  # a recompute is not a prompt-cache hit of the request
                job.cached_tokens = max(job.cached_tokens, job.kv_position)
                self.pool.prefix_hits += 1  # shared with the live job that wrote it: a miss when it was looked up

    def row(self, job: Job, tokens: list[int], sample: bool) -> RowInput:
        """The job's row for this step: `tokens` from its KV position, with its sampling settings (and mirostat mu),
        penalty/DRY history, DRY/XTC token sets and logit bias (settings' bias and bans, stop tokens before
        min_new_tokens, token healing, tokens banned at this position by earlier banned-string rewinds)."""
        s = job.gen_settings
        end = job.kv_position + len(tokens)  # index in job.sequence of the token this row samples
        out_index = job.new_tokens
        if out_index >= job.min_new_tokens and not job.explored:
            bias = s.bias_view  # (the usual row: the settings' own bias, read-only, shared by every row of theirs)
        else:
            bias = self._bias(job, end, out_index)
        if sample and len(bias) >= self.vocab_size and _all_banned(bias, self.vocab_size):
            raise JobFailure(f"every token of the vocabulary is banned at output position {job.new_tokens} (banned "
                             "tokens, stop tokens before min_new_tokens and banned-string rewinds together)")
        max_range = self.max_penalty_range
        window = s.history_window(max_range) if max_range else 0  # (no history kept: none needed)
        history = job.sequence[max(0, end - window) : end] if window else ()
        src = job.cfg_owner or job  # (a CFG negative prompt uses its job's embedding rows)
        if src.embedding_rows:  # injected embeddings: the engine embeds id vocab_size + r as row r of its table
            tokens = device_ids(src, tokens, self.vocab_size)
        # RowInput's fields in their order, given by position (a row per job and step: keywords cost twice as much):
        # tokens, start_pos, pages, sample, sampling, history, bias, mask, dry_breakers, xtc_exempt, verify, lora_slot
        sampling = job.sampling_row
        if sampling is None or job.mirostat_mu is not None:  # (mirostat: mu changes at every token)
            sampling = s.device_row(job.seed, job.mirostat_mu)
            if job.mirostat_mu is None:  # built once per job, read-only: every row of the job shares it
                sampling = job.sampling_row = MappingProxyType(sampling)
        # token healing: the first token is one of the tokens that start with the dropped prompt text, a mask (every
        # other token -inf, the candidates' logits untouched: their odds are the model's); a filtered job's mask is
        # set with its filters' (`DynamicGenerator._mask_rows`)
        mask = pack(job.healing_allowed, self.vocab_size) if sample and out_index == 0 and job.healing_allowed else None
        return RowInput(tokens, job.kv_position, job.pages, sample, sampling, history, bias, mask, job.dry_breakers,
                        job.xtc_exempt, False, job.lora_slot)

    def _bias(self, job: Job, sample_index: int, out_index: int) -> dict[int, float]:
        """The logit bias of the token at `job.sequence[sample_index]`, the job's output token number `out_index`."""
        bias = job.gen_settings.bias()
        if out_index < job.min_new_tokens:
            bias.update({t: -math.inf for t in job.stop_tokens})
        explored = job.explored and job.explored.get(sample_index)
        if explored:
            bias.update({t: -math.inf for t in explored})
        return bias

    def sample_bias(self, job: Job, sample_index: int) -> dict[int, float] | None:
        """The bias a row sampling `job.sequence[sample_index]` would get (`sample_index >= len(job.sequence)`: a
        speculative draft position), or None where every token is banned."""
        bias = self._bias(job, sample_index, job.new_tokens + sample_index - len(job.sequence))
        return None if _all_banned(bias, self.vocab_size) else bias

    def plan(self) -> tuple[list[RowInput], list[Job], list[tuple[Job, Exception]]]:
        """Rows of the next step and the job of each row; jobs whose row could not be built come back as failures
        (the caller ends them) instead of stopping the step. With `on_demand` pages, decode rows get their next page
        here, preempting the policy's victims when none is left."""
        active = self.active
        rows, owners, failed = [], [], []
        ps = self.page_size
        decode_rows = 0
        for job in active:
            if job.cfg_partner is None:
                if job.kv_position % ps == 0:  # (only then can a page have been completed by another job)
                    self.skip_complete_pages(job)
                decode_rows += len(job.sequence) - job.kv_position == 1
                continue
            for m in members(job):
                if m.kv_position % ps == 0:
                    self.skip_complete_pages(m)
                decode_rows += len(m.sequence) - m.kv_position == 1
        budget = self.ask("prefill_budget()", self.policy.prefill_budget, decode_rows, self.view)
        try:
            value = None if isinstance(budget, bool) else operator.index(budget)  # (a NumPy integer is an int too)
        except TypeError:
            value = None
        if value is None or value < 0:
            raise self.policy_error(f"must return an int >= 0, got {budget!r}", "prefill_budget()")
        budget = value
        if budget == 0 and decode_rows == 0 and active:  # (every step would then be empty: the host loop had spun)
            raise self.policy_error("returned 0 with no job decoding: no job could advance; return at least 1 "
                                    "when decode_rows is 0", "prefill_budget()")
        self._budget = min(budget, self.config.max_chunk_size)
        self._prefill_rows = 0
        preempted: set[int] = set()
        decode_row = self.row
        for job in (list(active) if self.on_demand else active):
            if preempted and id(job) in preempted:
                continue
            try:
                if job.cfg_partner is not None:
                    self._plan_cfg(job, rows, owners, preempted)
                    continue
                seq = job.sequence
                if len(seq) - job.kv_position == 1:  # a decode row
                    if len(job.pages) * ps < len(seq) and not self.grow(job, rows, owners, preempted):
                        continue  # the job itself was preempted
                    rows.append(decode_row(job, [seq[-1]], True))
                else:
                    row = self._chunk(job, len(job.sequence))
                    if row is None:
                        continue  # waits for a later step
                    rows.append(row)
            except PolicyError:
                raise  # the policy's fault, not the job's
            except Exception as e:  # noqa: BLE001 (one job's failure must not stop the others)
                while owners and owners[-1] in members(job):  # (a CFG job's rows planned before the failure)
                    self._take_back(rows, owners, len(owners) - 1)
                failed.append((job, e))
                continue
            owners.append(job)
        return rows, owners, failed

    def _chunk(self, job: Job, end_cap: int) -> RowInput | None:
        """The job's next prefill chunk, up to sequence index `end_cap`, within the step's token budget and prefill
        rows (None: none left this step)."""
        if self._prefill_rows >= self.config.max_prefill_rows or self._budget <= 0:
            return None
        ps = self.page_size
        end = job.kv_position + min(end_cap - job.kv_position, self._budget)
        # stop before a page that is complete already (being shared): it is skipped next step
        for p in range(-(-job.kv_position // ps), -(-end // ps)):
            if p * ps > job.kv_position and self.pool.pages[job.pages[p]].filled == ps and p * ps < end:
                end = p * ps
                break
        n = end - job.kv_position  # a 1-token chunk rides in a decode slot, without sampling
        row = self.row(job, job.sequence[job.kv_position : end], end == len(job.sequence))
        self._prefill_rows += n > 1
        self._budget -= n
        return row

    def _plan_cfg(self, job: Job, rows: list[RowInput], owners: list[Job], preempted: set[int]) -> None:
        """A CFG job's rows: each prompt is prefilled up to its last token, which both feed in the same step, the
        job's row guided by its negative row (`RowInput.cfg_negative`); the two sample together from then on."""
        pair = members(job)
        if all(len(m.sequence) - m.kv_position == 1 for m in pair):
            for m in pair:
                if len(m.pages) * self.page_size < len(m.sequence) and not self.grow(job, rows, owners, preempted, m):
                    return  # the job itself was preempted
            pos, neg = (self.row(m, [m.sequence[-1]], True) for m in pair)
            pos.cfg_negative = neg
            rows += [pos, neg]
            owners += list(pair)
            return
        for m in pair:  # the other one waits (one token left) or prefills too
            if len(m.sequence) - m.kv_position > 1:
                row = self._chunk(m, len(m.sequence) - 1)
                if row is not None:
                    rows.append(row)
                    owners.append(m)

    def grow(self, job: Job, rows: list[RowInput], owners: list[Job], preempted: set[int],
             member: Job | None = None) -> bool:
        """Give a decoding job (or `member`, its CFG negative prompt) the page its next token is written to
        (`on_demand`), preempting the policy's victims while the pool is empty. Returns False when the job itself
        was preempted."""
        m = job if member is None else member
        while len(m.pages) * self.page_size < len(m.sequence):
            if self.pool.available:
                m.pages.extend(self.pool.take(1))
                continue
            v = self.ask("victim()", self.policy.victim, list(self.active), job, self.view)
            v = job if v is None else v  # None: the needy job itself
            if not any(r is v for r in self.active):
                raise self.policy_error(f"returned {v!r}, which is not a running job; return one of `running` (or "
                                        "None for the needy job)", "victim()")
            for x in members(v):  # already planned this step: take its rows back
                while x in owners:
                    self._take_back(rows, owners, owners.index(x))
            self.preempt(v)
            preempted.add(id(v))
            if v is job:
                return False
        return True

    def _take_back(self, rows: list[RowInput], owners: list[Job], i: int) -> None:
        """Remove planned row `i`, returning its prefill tokens and prefill row to the step's budget."""
        row = rows.pop(i)
        owners.pop(i)
        if len(row.tokens) > 1 or not row.sample:
            self._budget += len(row.tokens)
            self._prefill_rows -= len(row.tokens) > 1

    def burst(self, rows: list[RowInput], owners: list[Job], want_logits: bool, admission_waiting: bool) -> int:
        """Decode steps for this engine call: `decode_steps` when it is safe to run them blind, else 1.

        A burst may run past a job's `max_new_tokens` (the extra tokens are discarded), so short remainders do not
        need the single-step variant; it must stay inside the job's own pages, whose slots past its last consumed
        position are never hashed or shared, so the extra KV writes touch nothing else."""
        k = self.config.decode_steps
        if k == 1 or want_logits or admission_waiting:
            return 1
        for row, job in zip(rows, owners):
            if (len(row.tokens) != 1 or not row.sample or job.banned_strings or job.explored or job.filters
                    or job.new_tokens < job.min_new_tokens or job.kv_position + k > len(job.pages) * self.page_size
                    or (job.healing_allowed and job.new_tokens == 0)):
                return 1
            if job.mirostat_mu is not None:  # mirostat's mu changes after every token, on the host
                return 1
            if job.cfg_partner is not None or job.cfg_owner is not None:  # both rows must take the same token
                return 1
            # The history slides on the device; penalties and DRY weigh it by distance from the end (per row), so
            # a shorter window than the bucket's stays exact.
        return k
