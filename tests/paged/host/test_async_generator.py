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
