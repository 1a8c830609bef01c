"""Earliest deadline first: the example user policy of docs/scheduling.md.

    python -m experiments.compare_policies --policies=vllm,experiments.policies.edf:EarliestDeadlineFirst \\
        --engine=sim --deadline=20

Jobs with a `deadline` (seconds after arrival) are admitted in order of `arrival + deadline`; jobs without one go
last, in arrival order. Pages on demand; when they run out, the job with the latest deadline is preempted. A job's
due time is fixed once it is enqueued, so the scheduler keeps the queue in that order (`sorted_waiting`) instead of
sorting it at every step.
"""

import math

from paged.policies import Policy


class EarliestDeadlineFirst(Policy):
    name = "edf"
    allocation = "on_demand"

    @staticmethod
    def due(job):
        return job.deadline_at if job.deadline is not None else math.inf

    def key(self, job):
        return self.due(job), job.serial

    def order(self, waiting, s):
        return s.sorted_waiting(waiting, self.key)

    def victim(self, running, needy, s):
        return max(running, key=self.key)
