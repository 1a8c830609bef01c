"""`exllamav2`: ExLlamaV2's dynamic generator (the default): FIFO with skip-ahead, pages for prompt +
max_new_tokens reserved at admission, no preemption.

Source: turboderp/exllamav2, `exllamav2/generator/dynamic.py` (`max_skips`): a job that does not fit may be passed
by later jobs that do at most `job.max_skips` times; after that the queue waits for it."""

from __future__ import annotations

from paged.job import Job
from paged.policies.base import Policy, SchedulerView


class ExLlamaV2Policy(Policy):
    name = "exllamav2"

    def admit(self, waiting: list[Job], s: SchedulerView) -> None:
        skipped: list[Job] = []
        for job in self.order(waiting, s):
            if len(s.running) >= s.config.max_batch_size:
                return  # every batch row is taken: no later job fits, so none starts and no skip is counted
            if not s.fits(job):
                skipped.append(job)
                continue
            if any(k.skips >= k.max_skips for k in skipped):
                return  # a starved job is waiting: nothing may pass it any more
            for k in skipped:
                k.skips += 1
            s.start(job)
