"""The policy interface: what a scheduling policy decides, and the view of the scheduler it decides with.

The mechanism (`paged.host.scheduler.Scheduler`, driven by `DynamicGenerator`) owns the page pool, the batch rows and
the token budgets; it asks the policy four questions and enforces the answers:

- `order(waiting, s)`: in which order waiting jobs are considered;
- `admit(waiting, s)`: which of them start now (`s.start(job)` after `s.fits(job)`), and, for a preemptive policy,
  which running jobs to preempt first (`s.preempt(job)`) so that a more urgent one fits;
- `victim(running, needy, s)`: with `on_demand` pages, which running job to preempt when `needy` (a running job)
  needs a page and none is left. Returning `needy` itself (or None) preempts the needy job;
- `prefill_budget(decode_rows, s)`: how many prefill tokens this step may carry, given its decode rows.

`preemptive = True` makes the scheduler call `admit` even when every batch row is taken. `allocation` says how
pages are given out: `"reserve"` (prompt + max_new_tokens at admission, as ExLlamaV2) or `"on_demand"` (the
prompt at admission, one page at a time as tokens are written, as vLLM). A preempted job's pages are released; it
waits again with its generated tokens kept and recomputes their KV on re-admission, mostly from the prefix cache
(its complete pages stay cached when released).

A policy only decides: it never touches pages or lists itself. What it hands back is checked before anything changes
(a job started twice, one that is not waiting or does not fit, a victim that is not running, a bad budget) and what
its hooks raise is caught: either is a `paged.errors.PolicyError` naming the policy and the hook, raised by
`iterate()` with the generator left as it was. A user policy is a subclass that overrides any of
the hooks; name it `"module:Class"` wherever a policy name is accepted, or `register_policy` it.

The `waiting` that `admit()` receives is a `QueueSnapshot` (`paged.policies.waiting`): the waiting jobs as they were
when it was called, read from the scheduler's own list rather than copied, and changed only as a private copy (a
`MutableSequence`, not a `list`; `list(waiting)` makes one).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from paged.device.config import EngineConfig
from paged.job import Job
from paged.policies.waiting import QueueSnapshot

ALLOCATIONS = ("reserve", "on_demand")


class SchedulerView(Protocol):
    """What a policy sees of the scheduler (implemented by `paged.host.scheduler.SchedulerView`)."""

    config: EngineConfig  # page_size, max_batch_size, max_chunk_size (the default token budget), num_pages, ...
    running: Sequence[Job]  # the running jobs, in admission order: read-only (len, index, iterate; use preempt())

    @property
    def now(self) -> float:
        """The generator's clock (virtual seconds under simulation)."""

    @property
    def pages_available(self) -> int:
        """Free plus evictable (prompt-cache) pages."""

    def fits(self, job: Job) -> bool:
        """A batch row and the pages `job` needs at admission are available now (nothing is changed)."""

    def start(self, job: Job) -> None:
        """Admit a waiting job now (its pages are allocated). It must be waiting and fit (`fits`), else
        `PolicyError`; only from `admit()` (elsewhere a `PolicyError`)."""

    def preempt(self, job: Job) -> None:
        """Preempt a running job: pages released, back to the front of the waiting queue, tokens kept. A job that
        is not running is a `PolicyError`; only from `admit()` (elsewhere a `PolicyError`: `victim()` returns its
        victim instead, and the scheduler preempts it)."""

    def would_fit_without(self, job: Job, victims: list[Job]) -> bool:
        """Whether `job` would fit once `victims` (running jobs) were preempted (nothing is changed)."""

    def cached_prefix_tokens(self, job: Job) -> int:
        """Leading tokens of `job` whose KV is complete in the cache now (live jobs' pages or the prompt cache)."""

    def sorted_waiting(self, waiting: list[Job], key: Callable[[Job], Any]) -> list[Job]:
        """`sorted(waiting, key=key)`, for a `key` that does not change while a job waits (a function of fields set
        before it is enqueued, such as `priority`, `arrival`, `serial`). For the list `admit()` was handed, the
        scheduler keeps the waiting jobs in that order as they come and go, so a long queue is not sorted again at
        every step (the result is then a `QueueSnapshot` of that order); pass the same `key` object each time (a
        method or a module-level function)."""

    def cached_prefixes(self, waiting: list[Job]) -> dict[Job, int]:
        """The jobs of `waiting` with a cached prefix now, and its tokens (`cached_prefix_tokens(job)` where it is
        > 0; every other job's is 0). For the list `admit()` was handed, only the jobs whose first page is in the
        cache are looked at, not the whole queue."""


class Policy:
    """Base class: first come, first served, reserve allocation, preempt the latest arrival, the whole chunk budget
    for prefill. Subclasses override what they decide differently."""

    name = "base"
    allocation = "reserve"
    preemptive = False  # True: admit() is consulted even with every batch row taken (it may preempt to make room)

    def order(self, waiting: list[Job], s: SchedulerView) -> list[Job]:
        """Waiting jobs in the order they are considered for admission (`waiting` is in arrival order, preempted
        jobs first): a copy of `waiting` (of a `QueueSnapshot`, another snapshot: nothing is copied until changed)."""
        return copy.copy(waiting) if isinstance(waiting, QueueSnapshot) else list(waiting)

    def admit(self, waiting: list[Job], s: SchedulerView) -> None:
        """Start jobs in `order`, stopping at the first that does not fit (no job passes another)."""
        for job in self.order(waiting, s):
            if not s.fits(job):
                return
            s.start(job)

    def victim(self, running: list[Job], needy: Job, s: SchedulerView) -> Job | None:
        """The running job to preempt when `needy` needs a page and none is left (`on_demand` only): the latest
        arrival, as vLLM. `running` includes `needy`; returning `needy` or None preempts the needy job itself, and
        anything that is not in `running` is a `PolicyError`."""
        return max(running, key=lambda j: (j.arrival, j.serial))

    def prefill_budget(self, decode_rows: int, s: SchedulerView) -> int:
        """Prefill tokens this step may carry, shared by its prefill chunks; decode rows always run. Default: a
        whole chunk (`max_chunk_size`) whatever the decode rows (ExLlamaV2)."""
        return s.config.max_chunk_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, allocation={self.allocation!r})"
