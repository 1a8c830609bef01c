"""`lpm`: longest prefix match first (cache-aware), with aging so that no job starves.

Waiting jobs are ordered by score = (prompt tokens already complete in the cache) + `aging` x (seconds waited),
highest first; admission is strict in that order (a job that does not fit blocks those behind it). Without aging
(`aging=0`) a job that matches nothing can wait forever behind a stream of cache-hitting jobs.

Starvation bound: a job's cache bonus is at most `max_seq_len` tokens, so a job J is ordered before every job that
arrived more than `max_seq_len / aging` seconds after it. J is therefore admitted before any of those: it can be
passed only by jobs that arrived before `J.arrival + max_seq_len / aging` (tested in tests/paged/test_policies.py).

Source: SGLang's `lpm` schedule policy (Zheng et al., "SGLang: Efficient Execution of Structured Language Model
Programs", 2024, section 3: cache-aware scheduling, longest-shared-prefix-first); SGLang adds no aging, the bound is
ours."""

from __future__ import annotations

import bisect

from paged.errors import InvalidConfigError
from paged.job import Job
from paged.policies.base import Policy, SchedulerView


class LongestPrefixMatch(Policy):
    name = "lpm"

    def __init__(self, aging: float = 100.0):
        """`aging`: score (in cached-token units) a job gains per second of waiting; 0 disables aging."""
        if isinstance(aging, bool) or not isinstance(aging, (int, float)) or not aging >= 0 or aging == float("inf"):
            raise InvalidConfigError(f"LongestPrefixMatch: aging must be a finite number >= 0 (tokens per second "
                                     f"waited), got {aging!r}")
        self.aging = float(aging)

    def starvation_bound(self, max_seq_len: int) -> float:
        """Seconds after a job's arrival beyond which no later arrival is admitted before it (inf without aging)."""
        return max_seq_len / self.aging if self.aging else float("inf")

    def order(self, waiting: list[Job], s: SchedulerView) -> list[Job]:
        now = s.now
        cached = s.cached_prefixes(waiting)  # (every other job's cached prefix is 0)

        def key(job: Job) -> tuple[float, int]:
            return -(cached.get(job, 0) + self.aging * (now - job.arrival)), job.serial

        # Without a cached prefix a job's score only falls as its arrival grows, so those jobs are in serial order
        # when arrivals are (the generator's clock never goes back): then only the jobs with a cached prefix need
        # placing, by binary search, instead of sorting the whole queue.
        out = s.sorted_waiting(waiting, _serial)
        if self.aging and out != s.sorted_waiting(waiting, _arrival):
            return sorted(waiting, key=key)
        for job in cached:
            del out[bisect.bisect_left(out, job.serial, key=_serial)]
        for job in cached:
            out.insert(bisect.bisect_left(out, key(job), key=key), job)
        return out


def _serial(job: Job) -> int:
    return job.serial


def _arrival(job: Job) -> tuple[float, int]:
    return job.arrival, job.serial
