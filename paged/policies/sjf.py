"""`sjf`: shortest job first: the shortest expected output when the job gives one (`Job(expected_new_tokens=)`,
e.g. from a length predictor or a trace), else the shortest prompt; jobs that do not fit are skipped. Reserve
allocation, no preemption. Minimises mean latency when the lengths are right, and can starve long jobs: a
comparison point, not a default. `shortest_prompt_first` ignores `expected_new_tokens`. The order is kept as jobs
come and go (`SchedulerView.sorted_waiting`): set `expected_new_tokens` before enqueueing the job.

Sources: SJF/SRPT scheduling for LLM serving, e.g. Qiu et al., "Efficient Interactive LLM Serving with Proxy
Model-based Sequence Length Prediction" (2024); Fu et al., "Efficient LLM Scheduling by Learning to Rank" (2024)."""

from __future__ import annotations

from paged.job import Job
from paged.policies.base import Policy, SchedulerView


class ShortestJobFirst(Policy):
    name = "sjf"

    @staticmethod
    def length(job: Job) -> int:
        return job.expected_new_tokens if job.expected_new_tokens is not None else job.prompt_len

    def key(self, job: Job) -> tuple[int, int]:
        return self.length(job), job.serial

    def order(self, waiting: list[Job], s: SchedulerView) -> list[Job]:
        return s.sorted_waiting(waiting, self.key)

    def admit(self, waiting: list[Job], s: SchedulerView) -> None:
        for job in self.order(waiting, s):
            if len(s.running) >= s.config.max_batch_size:
                return  # every batch row is taken: no later job fits
            if s.fits(job):
                s.start(job)


class ShortestPromptFirst(ShortestJobFirst):
    name = "shortest_prompt_first"

    @staticmethod
    def length(job: Job) -> int:
        return job.prompt_len
