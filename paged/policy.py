"""Scheduling policies: which waiting jobs start, in what order. The mechanism (page and row budgets) lives in the
generator; a policy only decides, through two hooks:

- `order(pending)`: the order in which waiting jobs are considered;
- `admit(pending, fits, start)`: call `start(job)` for the jobs to admit now; `fits(job)` says whether a job's pages
  and a batch row are available right now.
"""

from __future__ import annotations

from collections.abc import Callable

from paged.errors import InvalidConfigError, InvalidConfigTypeError
from paged.job import Job


class Policy:
    name = "fcfs"

    def order(self, pending: list[Job]) -> list[Job]:
        return list(pending)

    def admit(self, pending: list[Job], fits: Callable[[Job], bool], start: Callable[[Job], None]) -> None:
        """Strict first-come-first-served: stop at the first job that does not fit."""
        for job in self.order(pending):
            if not fits(job):
                return
            start(job)


class ExLlamaV2Policy(Policy):
    """FIFO with skip-ahead: a job that does not fit may be passed over by later jobs that do, at most
    `job.max_skips` times; after that the queue waits for it. Pages for prompt + max_new_tokens are reserved at
    admission and never preempted."""

    name = "exllamav2"

    def admit(self, pending, fits, start):
        skipped: list[Job] = []
        for job in self.order(pending):
            if not fits(job):
                skipped.append(job)
                continue
            if any(s.skips >= s.max_skips for s in skipped):
                return  # a starved job is waiting: nothing may pass it any more
            for s in skipped:
                s.skips += 1
            start(job)


class ShortestPromptFirst(Policy):
    """Shortest prompt first, skipping jobs that do not fit (can starve long prompts: for comparisons)."""

    name = "shortest_prompt_first"

    def order(self, pending):
        return sorted(pending, key=lambda j: (j.prompt_len, j.serial))

    def admit(self, pending, fits, start):
        for job in self.order(pending):
            if fits(job):
                start(job)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Policy, ExLlamaV2Policy, ShortestPromptFirst)}


def make_policy(policy: str | Policy) -> Policy:
    """A policy instance from its name (or the instance itself)."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise InvalidConfigTypeError(f"policy must be a name ({', '.join(sorted(POLICIES))}) or a "
                                     f"paged.policy.Policy instance, got {type(policy).__name__}")
    if policy not in POLICIES:
        raise InvalidConfigError(f"unknown policy {policy!r}; available: {', '.join(sorted(POLICIES))}")
    return POLICIES[policy]()
