"""The server's host loop (`paged.server.service.ServingGenerator._run`), driven without HTTP: the next step is
launched before a step's results are handed out (so the device computes while the event loop streams them), and
every result still reaches its request in step order; a request cancelled while its jobs are being queued leaves
nothing open, whether the queueing then succeeds or fails."""

from __future__ import annotations

import asyncio
import threading

import pytest

from paged import DynamicGenerator, Job
from paged.errors import InvalidJobError
from paged.server.service import ServingGenerator
from paged.testing import ByteTokenizer, FakeEngine

STEP_WAIT_S = 30.0  # generous: the second step starts at once (it is only waiting for a thread)


def _counting(gen: DynamicGenerator) -> threading.Event:
    """Wrap `gen.iterate` so that the returned event is set when a step after the first one starts."""
    started = threading.Event()
    calls = [0]
    iterate = gen.iterate

    def counted():
        calls[0] += 1
        if calls[0] >= 2:
            started.set()
        return iterate()

    gen.iterate = counted
    return started


def test_the_next_step_starts_before_a_steps_results_are_handed_out():
    gen = DynamicGenerator(tokenizer=ByteTokenizer(), engine=FakeEngine(num_pages=16, max_batch_size=2, record=False))
    second_started = _counting(gen)
    seen: list[bool] = []

    def on_step(results):  # runs on the event loop before the step's results are streamed
        if not seen:  # the first step: the second one must be under way already (a blocking wait, on purpose)
            seen.append(second_started.wait(STEP_WAIT_S))

    async def main():
        service = ServingGenerator(gen, on_step=on_step)
        stream = await service.open([Job([65, 66, 67], max_new_tokens=6)])
        tokens = []
        async for batch in stream.batches():
            for r in batch:
                assert isinstance(r, dict), r
                tokens.extend(int(t) for t in r.get("token_ids", []))
        await service.close()
        return tokens

    tokens = asyncio.run(main())
    assert seen == [True]
    assert tokens == [68, 69, 70, 71, 72, 73]  # FakeEngine: each token is the last one + 1, all in order


@pytest.mark.parametrize("fails", [True, False], ids=["enqueue_fails", "enqueue_succeeds"])
def test_a_request_cancelled_while_its_jobs_are_queued_leaves_nothing_open(fails):
    """The client goes away while `enqueue` runs (in its thread); then `enqueue` raises, or queues the jobs. Either
    way the request's jobs leave the service's books (queued ones cancelled), so it is idle again and a drain does
    not wait out its grace period."""
    gen = DynamicGenerator(tokenizer=ByteTokenizer(), engine=FakeEngine(num_pages=16, max_batch_size=2, record=False))
    entered, release = threading.Event(), threading.Event()
    enqueue = gen.enqueue

    def held_enqueue(jobs):
        entered.set()
        release.wait(STEP_WAIT_S)
        if fails:
            raise InvalidJobError("Job: rejected once its client had gone")
        return enqueue(jobs)

    gen.enqueue = held_enqueue

    async def main():
        service = ServingGenerator(gen)
        opening = asyncio.ensure_future(service.open([Job([65, 66], max_new_tokens=100)]))
        await asyncio.to_thread(entered.wait, STEP_WAIT_S)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        assert service.open_streams() == 1  # still being queued
        release.set()
        await asyncio.wait_for(service._idle.wait(), STEP_WAIT_S)  # never set when the jobs stay on the books
        assert service.open_streams() == 0
        assert await service.drain(STEP_WAIT_S) == 0
        await asyncio.get_running_loop().run_in_executor(service._admin, lambda: None)  # the cancels queued before
        await service.close()

    asyncio.run(main())
    assert not gen.active and not gen.pending
