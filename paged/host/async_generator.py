"""asyncio front end: `AsyncDynamicGenerator` runs `iterate()` in a worker thread whenever jobs exist and routes
each result to its job's queue; `AsyncJob` is an async iterator over one job's results, with `cancel()`.

    agen = AsyncDynamicGenerator(DynamicGenerator(model))
    job = agen.submit(Job(ids, 64))
    async for r in job:
        print(r.get("text", ""), end="")
    await agen.close()

Steps run in a thread (`asyncio.to_thread`), so the event loop stays responsive while the device works. The
generator's lock serialises `iterate()` with `enqueue()`/`cancel()`, so a job submitted or cancelled mid-step takes
effect at the next step: `submit()` (synchronous: a bad job raises in it) waits for the lock, up to the rest of a
running step, on the loop's thread; `await asubmit()` and `await cancel()` wait in a thread, so the loop goes on.
A consumer that stops iterating early should `await job.cancel()` (or iterate inside `async with job:`, which
cancels the job on leaving the block unless it finished): the job runs on otherwise, to its end.

Errors reach only the stream they belong to. A job that fails on its own ends with its final result
(`eos_reason="error"`, `error`), like any other final result. If a whole step fails (`StepError`: nothing was lost
and no job advanced), it is retried; after `max_step_retries` consecutive failures the jobs that were running raise
the error from their iterators and are cancelled, and the other jobs (pending, or submitted later) go on; when none
was running (the step failed admitting them), the pending jobs are the ones that raise it. Any other
exception out of a step (a bug) ends every open stream with it, and the next `submit()` starts serving afresh: no
stream waits for a loop that has died.
"""

from __future__ import annotations

import asyncio
import logging

from paged.errors import InvalidConfigError, InvalidConfigTypeError, StepError
from paged.host.generator import DynamicGenerator
from paged.job import Job
from paged.validate import Checker

_DONE = object()


class AsyncJob:
    def __init__(self, agen: AsyncDynamicGenerator, job: Job):
        self.agen = agen
        self.job = job
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _DONE:
            self._finish()
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item["eos"]:
            self._finish()
        return item

    def _finish(self) -> None:
        """The iteration is over: another task waiting on the same job's queue is woken to end too."""
        self.finished = True
        self.queue.put_nowait(_DONE)

    async def cancel(self) -> None:
        """Stop the job (pending or running) and end its iteration; its pages are released. The iteration ends even
        when the task calling this is cancelled meanwhile (the generator's cancel goes on in its thread)."""
        try:
            await asyncio.to_thread(self.agen.generator.cancel, self.job)
        finally:
            self.agen._jobs.pop(self.job, None)
            while not self.queue.empty():  # results not yet consumed are dropped: the job is gone
                self.queue.get_nowait()
            self.queue.put_nowait(_DONE)

    async def aclose(self) -> None:
        """Cancel the job unless its iteration has ended (what a consumer that stops early calls)."""
        if not self.finished:
            await self.cancel()

    async def __aenter__(self) -> AsyncJob:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncDynamicGenerator:
    def __init__(self, generator: DynamicGenerator, max_step_retries: int = 2):
        if not isinstance(generator, DynamicGenerator):
            raise InvalidConfigTypeError(f"AsyncDynamicGenerator: generator must be a paged.DynamicGenerator, got "
                                         f"{type(generator).__name__}")
        self.generator = generator
        self.max_step_retries = Checker("AsyncDynamicGenerator", InvalidConfigError).int_(
            "max_step_retries", max_step_retries, 0)
        self._jobs: dict[Job, AsyncJob] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop `_wake` and `_task` belong to
        self._task: asyncio.Task | None = None

    def submit(self, job: Job) -> AsyncJob:
        """Enqueue `job` (validation errors raise here) and return its async result iterator. Call it from a
        running event loop's thread; it waits for the generator's lock (up to the rest of a running step)."""
        return self.register(AsyncJob(self, job))

    async def asubmit(self, job: Job) -> AsyncJob:
        """`submit` that waits for the generator's lock in a thread: the event loop goes on meanwhile."""
        self._bind(asyncio.get_running_loop())
        await asyncio.to_thread(self.generator.enqueue, job)
        return self._serve_job(AsyncJob(self, job))

    def register(self, ajob: AsyncJob) -> AsyncJob:
        """Enqueue `ajob.job` and route its results to `ajob` (from the running event loop's thread: without one,
        `RuntimeError` and nothing is enqueued)."""
        self._bind(asyncio.get_running_loop())
        self.generator.enqueue(ajob.job)
        return self._serve_job(ajob)

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve from `loop`: a generator used again under another loop (a second `asyncio.run`) gets a new wake-up
        event and serving task there (an Event belongs to the loop it was first awaited on)."""
        if self._loop is not loop:
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = None

    def _serve_job(self, ajob: AsyncJob) -> AsyncJob:
        self._jobs[ajob.job] = ajob
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()
        return ajob

    async def _run(self) -> None:
        try:
            await self._serve()
        except Exception as e:  # noqa: BLE001 (not a StepError: a bug. End the streams rather than leave them waiting)
            logging.getLogger(__name__).exception("AsyncDynamicGenerator: the serving loop failed")
            for job, ajob in list(self._jobs.items()):
                self.generator.cancel(job)
                ajob.queue.put_nowait(e)
            self._jobs.clear()

    async def _serve(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.generator.num_remaining_jobs():
                try:
                    results = await asyncio.to_thread(self.generator.iterate)
                    failures = 0
                except StepError as e:
                    failures += 1
                    if failures > self.max_step_retries:  # persistent: end the jobs that were running, keep serving
                        failures = 0
                        for job in list(self.generator.active) or list(self.generator.pending):  # (none admitted)
                            self.generator.cancel(job)
                            ajob = self._jobs.pop(job, None)
                            if ajob is not None:
                                ajob.queue.put_nowait(e)
                    continue
                for r in results:
                    ajob = self._jobs.get(r["job"])
                    if ajob is None:
                        continue  # cancelled meanwhile, or enqueued on the generator directly
                    ajob.queue.put_nowait(r)
                    if r["eos"]:
                        del self._jobs[r["job"]]

    async def close(self) -> None:
        """Cancel all jobs (those submitted while it runs too) and stop the background task. The generator may be
        used again: a later `submit()` starts serving afresh."""
        while self._jobs:  # (a job submitted during an await below had been left with no loop to serve it)
            for ajob in list(self._jobs.values()):
                await ajob.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._jobs:  # submitted while the task stopped: served, as if submitted after close()
            self._task = asyncio.get_running_loop().create_task(self._run())
            self._wake.set()
