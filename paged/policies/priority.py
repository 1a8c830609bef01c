"""`priority`: highest `Job(priority=)` first (ties: earliest arrival), preemptive, pages on demand.

A waiting job that does not fit may preempt running jobs of strictly lower priority (the lowest first, then the
latest arrival), but only when preempting them all would let it fit; the preempted jobs wait again and recompute.
When pages run out during decoding the lowest-priority, latest-arriving job is the victim. Admission is strict in
priority order: a job that cannot fit even by preemption blocks the lower-priority ones behind it. The order is
kept as jobs come and go (`SchedulerView.sorted_waiting`): set a job's `priority` before enqueueing it.

Source: vLLM's `--scheduling-policy priority` (vllm/core/scheduler.py `_schedule_priority_preemption`, v1
`Scheduler` with `SchedulingPolicy.PRIORITY`), which orders by (priority, arrival) and preempts by recompute."""

from __future__ import annotations

from paged.job import Job
from paged.policies.base import Policy, SchedulerView


def _urgency(job: Job) -> tuple:
    return (-job.priority, job.arrival, job.serial)


class PriorityPolicy(Policy):
    name = "priority"
    allocation = "on_demand"
    preemptive = True

    def order(self, waiting: list[Job], s: SchedulerView) -> list[Job]:
        return s.sorted_waiting(waiting, _urgency)

    def admit(self, waiting: list[Job], s: SchedulerView) -> None:
        for job in self.order(waiting, s):
            if not s.fits(job):
                lower = sorted((r for r in s.running if r.priority < job.priority), key=_urgency, reverse=True)
                if not lower or not s.would_fit_without(job, lower):
                    return
                for v in lower:
                    s.preempt(v)
                    if s.fits(job):
                        break
                if not s.fits(job):
                    return
            s.start(job)

    def victim(self, running: list[Job], needy: Job, s: SchedulerView) -> Job | None:
        return max(running, key=_urgency)
