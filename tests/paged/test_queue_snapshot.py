"""`paged.policies.waiting.QueueSnapshot`, the `waiting` a policy's `admit()` receives: the queue as it was when the
hook was called, read in place (not copied), unchanged by the policy's own starts and preemptions, changed only as a
private copy, and copied before the queue changes if the policy keeps it."""

from __future__ import annotations

import copy
import gc

from paged import DynamicGenerator, Job
from paged.policies import Policy, QueueSnapshot
from paged.testing import FakeEngine


def test_a_snapshot_reads_the_shared_list_until_it_or_the_list_changes():
    shared, registry = [1, 2, 3], []
    snap = QueueSnapshot(shared, registry)
    assert snap.shared and snap == [1, 2, 3] and [1, 2, 3] == snap and len(snap) == 3 and 2 in snap
    assert snap[0] == 1 and snap[-1] == 3 and snap[1:] == [2, 3] and list(reversed(snap)) == [3, 2, 1]
    assert snap + snap == [1, 2, 3, 1, 2, 3] and [0] + snap == [0, 1, 2, 3] and snap.index(3) == 2
    other = copy.copy(snap)  # (what the base policy's order() returns)
    assert other.shared and len(registry) == 2
    snap.sort(key=lambda x: -x)  # changing it: a private copy
    assert snap == [3, 2, 1] and not snap.shared and shared == [1, 2, 3] and other == [1, 2, 3]
    del other[0]
    assert other == [2, 3] and shared == [1, 2, 3]
    kept = QueueSnapshot(shared, registry)
    for ref in registry:  # what the scheduler does before it changes the list
        if ref() is not None:
            ref().detach()
    shared.append(4)
    assert kept == [1, 2, 3] and not kept.shared


class Recorder(Policy):
    """Starts the waiting jobs while iterating `waiting` (which must not change under it), keeps every `waiting`
    it was handed, and checks `sorted_waiting` hands out a snapshot of the kept order."""

    name = "recorder"

    def __init__(self):
        self.seen = []

    def admit(self, waiting, s):
        assert isinstance(waiting, QueueSnapshot) and waiting.shared
        before = list(waiting)
        ordered = s.sorted_waiting(waiting, _by_serial)
        assert isinstance(ordered, QueueSnapshot) and ordered == sorted(before, key=_by_serial)
        for job in waiting:
            if s.fits(job):
                s.start(job)
        assert list(waiting) == before and list(ordered) == sorted(before, key=_by_serial)
        self.seen.append((waiting, before))


def _by_serial(job: Job) -> int:
    return job.serial


def test_admit_hands_a_snapshot_that_the_policys_starts_leave_unchanged():
    policy = Recorder()
    gen = DynamicGenerator(engine=FakeEngine(num_pages=64, max_batch_size=3, max_seq_len=64), policy=policy)
    jobs = [Job([1, 2, 3], 4, identifier=i) for i in range(7)]
    gen.enqueue(jobs)
    gen.iterate()
    assert gen.active == jobs[:3] and gen.pending == jobs[3:]  # the starts applied when the hook returned
    assert {j.queue_position for j in gen.pending} == {4, 5, 6, 7}
    while gen.num_remaining_jobs():
        gen.iterate()
    gc.collect()
    assert len(policy.seen) >= 3
    for waiting, before in policy.seen:  # kept past the hook: each took its copy before the queue changed
        assert not waiting.shared and list(waiting) == before


class PreemptsAndRestarts(Policy):
    """Preempts every running job, then starts what it was handed: the preempted jobs wait again (at the front)
    but are not in this call's `waiting`."""

    name = "preempts_and_restarts"
    preemptive = True
    allocation = "on_demand"

    def admit(self, waiting, s):
        running = list(s.running)
        for job in running:
            s.preempt(job)
        assert all(job not in waiting for job in running)
        for job in waiting:
            if s.fits(job):
                s.start(job)


def test_preempted_jobs_go_back_to_the_front_after_the_hook():
    gen = DynamicGenerator(engine=FakeEngine(num_pages=64, max_batch_size=2, max_seq_len=64),
                           policy=PreemptsAndRestarts())
    jobs = [Job([1, 2, 3], 3, identifier=i) for i in range(4)]
    gen.enqueue(jobs)
    gen.iterate()
    assert gen.active == jobs[:2] and gen.pending == jobs[2:]
    gen.iterate()  # the first two preempted (back at the front, most recent preemption first), the next two start
    assert gen.active == jobs[2:] and gen.pending == [jobs[1], jobs[0]]
    assert [j.preemptions for j in jobs] == [1, 1, 0, 0]
