"""The asyncio wrapper: concurrent jobs stream to their own iterators; cancel mid-stream frees pages and does not
wedge the generator."""

from __future__ import annotations

import asyncio

from paged import DynamicGenerator, Job, SamplingSettings
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
