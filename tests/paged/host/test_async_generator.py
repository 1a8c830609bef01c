"""The asyncio wrapper: concurrent jobs stream to their own iterators; cancel mid-stream frees pages and does not
wedge the generator."""

from __future__ import annotations

import asyncio

import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.errors import InvalidConfigError, InvalidConfigTypeError
from paged.host.async_generator import AsyncDynamicGenerator
from paged.testing import ByteTokenizer, FakeEngine

TOK = ByteTokenizer()


def job(prompt, n, **kw):
    return Job(TOK.encode(prompt), n, gen_settings=SamplingSettings.greedy(), identifier=prompt, **kw)


def test_concurrent_async_jobs_and_cancel():
    async def main():
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32))
        agen = AsyncDynamicGenerator(gen)

        async def collect(aj):
            text = ""
            async for r in aj:
                text += r.get("text", "")
                last = r
            return text, last

        a = agen.submit(job("abc", 4))
        b = agen.submit(job("klm", 3))
        long = agen.submit(job("x", 60))
        first = await long.__anext__()
        assert first["stage"] == "started"
        await long.cancel()
        (ta, ra), (tb, rb) = await asyncio.gather(collect(a), collect(b))
        assert (ta, tb) == ("defg", "nop") and ra["eos"] and rb["eos"]
        assert [r async for r in long] == []  # cancelled: iteration simply ends
        # the generator still serves new work after the cancel
        c = agen.submit(job("uv", 2))
        tc, _ = await collect(c)
        assert tc == "wx"
        await agen.close()
        gen.pool.check({})
        assert gen.num_remaining_jobs() == 0

    asyncio.run(main())


def test_bad_construction_is_a_named_error():
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine())
    with pytest.raises(InvalidConfigTypeError, match="max_step_retries must be an int >= 0, got '2'"):
        AsyncDynamicGenerator(gen, max_step_retries="2")  # (had been accepted, then killed the loop at a failure)
    with pytest.raises(InvalidConfigError, match="max_step_retries must be an int >= 0, got -1"):
        AsyncDynamicGenerator(gen, max_step_retries=-1)
    with pytest.raises(InvalidConfigTypeError, match="generator must be a paged.DynamicGenerator, got str"):
        AsyncDynamicGenerator("not a generator")


def test_a_failure_that_is_no_step_error_ends_the_streams_and_a_later_job_is_served():
    """An exception out of iterate() other than StepError (a bug) had killed the serving task: every stream, and
    every job submitted later, waited forever."""
    async def main():
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32))
        agen = AsyncDynamicGenerator(gen)
        iterate = gen.iterate

        def broken():
            gen.iterate = iterate  # once
            raise RuntimeError("a bug in the step")

        gen.iterate = broken
        a = agen.submit(job("abc", 4))
        with pytest.raises(RuntimeError, match="a bug in the step"):
            await asyncio.wait_for(a.__anext__(), 30)
        assert gen.num_remaining_jobs() == 0  # its job was cancelled: no pages held
        b = agen.submit(job("klm", 3))
        text = "".join([r.get("text", "") async for r in b])
        assert text == "nop"
        await agen.close()
        gen.pool.check({})

    asyncio.run(main())


def test_a_job_submitted_while_close_runs_is_cancelled_not_stranded():
    """close() awaits each job's cancel(); a job submitted meanwhile had stayed running with no loop to serve it, its
    stream waiting forever."""
    async def main():
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32))
        agen = AsyncDynamicGenerator(gen)
        a = agen.submit(job("abc", 40))
        assert (await a.__anext__())["stage"] == "started"
        late = []
        cancel = a.cancel

        async def cancel_and_submit():
            late.append(agen.submit(job("xyz", 3)))
            await cancel()

        a.cancel = cancel_and_submit
        await agen.close()
        results = await asyncio.wait_for(_collect(late[0]), 30)
        assert results == [] or results[-1]["eos"]  # cancelled (its iteration ends) or served to its end
        assert gen.num_remaining_jobs() == 0
        gen.pool.check({})

    asyncio.run(main())


async def _collect(ajob):
    return [r async for r in ajob]


def test_an_early_exit_cancels_with_aclose_or_async_with():
    """A consumer that stops iterating leaves its job running (to its end) unless it cancels: `aclose()`, or
    `async with job:` around the loop, which cancels on leaving unless the job finished."""
    async def main():
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32))
        agen = AsyncDynamicGenerator(gen)
        async with agen.submit(job("abc", 50)) as aj:
            async for r in aj:
                if r["stage"] == "streaming":
                    break
        assert gen.num_remaining_jobs() == 0 and gen.pool.num_referenced == 0
        aj = agen.submit(job("def", 50))
        await aj.__anext__()
        await aj.aclose()
        assert gen.num_remaining_jobs() == 0 and [r async for r in aj] == []
        async with agen.submit(job("ghi", 2)) as done:  # finished: leaving the block cancels nothing
            assert [r for r in [x async for x in done]][-1]["eos"]
        await agen.close()

    asyncio.run(main())


def test_a_cancel_whose_task_is_cancelled_still_ends_the_iteration():
    """`cancel()` awaits the generator's cancel in a thread; a caller cancelled meanwhile (a timeout, a client gone)
    had left the job's iterator waiting for ever."""
    async def main():
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32))
        agen = AsyncDynamicGenerator(gen)
        aj = agen.submit(job("abc", 50))
        await aj.__anext__()
        task = asyncio.ensure_future(aj.cancel())
        await asyncio.sleep(0)  # (the cancel is in its thread)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        rest = await asyncio.wait_for(_drain(aj), 5)  # ends, whatever was left
        assert all(not r["eos"] for r in rest) and not agen._jobs
        await agen.close()

    asyncio.run(main())


async def _drain(aj) -> list:
    return [r async for r in aj]


def test_two_tasks_on_one_job_both_end():
    async def main():
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32))
        agen = AsyncDynamicGenerator(gen)
        aj = agen.submit(job("abc", 6))
        got = await asyncio.wait_for(asyncio.gather(_drain(aj), _drain(aj)), 5)
        assert sum(len(g) for g in got) >= 2 and sum(r["eos"] for g in got for r in g) == 1
        await agen.close()

    asyncio.run(main())


def test_submit_without_a_running_loop_queues_nothing():
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32))
    agen = AsyncDynamicGenerator(gen)
    with pytest.raises(RuntimeError, match="no running event loop"):
        agen.submit(job("abc", 3))
    assert gen.num_remaining_jobs() == 0 and not agen._jobs


def test_asubmit_waits_for_a_running_step_off_the_loop_and_reuse_under_another_loop():
    """`asubmit` waits for the generator's lock in a thread; a generator used again under a second asyncio.run gets
    an event of that loop (it had logged a failure of its serving task each time it went idle)."""
    async def main():
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32))
        agen = AsyncDynamicGenerator(gen)
        with gen.lock:  # (as a running step holds it)
            pending = asyncio.ensure_future(agen.asubmit(job("abc", 3)))
            await asyncio.sleep(0.05)
            assert not pending.done()  # waiting, and the loop runs meanwhile
        aj = await pending
        texts = [r.get("text", "") async for r in aj]
        await agen.close()
        return "".join(texts), agen

    first, agen = asyncio.run(main())

    async def again():
        aj = agen.submit(job("abc", 3))
        out = "".join([r.get("text", "") async for r in aj])
        await asyncio.sleep(0.05)  # (idle: the serving task waits on its event)
        assert agen._task is not None and not agen._task.done()
        await agen.close()
        return out

    assert asyncio.run(again()) == first


def test_a_step_that_fails_admitting_ends_the_waiting_jobs_not_a_busy_loop():
    """A policy whose admit() raises for one waiting job fails every step with nothing running: after the retries
    the waiting jobs' iterators raise (it had retried for ever, thousands of failed steps a second)."""
    from paged.errors import PolicyError
    from paged.policies import Policy

    class Picky(Policy):
        name = "picky"

        def admit(self, waiting, s):
            if any(j.identifier == "bad" for j in waiting):
                raise ValueError("cannot schedule this one")
            super().admit(waiting, s)

    async def main():
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32), policy=Picky())
        agen = AsyncDynamicGenerator(gen, max_step_retries=2)
        good = await _drain(agen.submit(job("abc", 3)))
        assert good[-1]["eos"]
        with pytest.raises(PolicyError, match="cannot schedule this one"):
            await asyncio.wait_for(_drain(agen.submit(job("bad", 3))), 5)
        assert gen.steps_failed == 3 and gen.num_remaining_jobs() == 0
        await agen.close()

    asyncio.run(main())
