"""asyncio front end: `AsyncDynamicGenerator` runs `iterate()` in a worker thread whenever jobs exist and routes
each result to its job's queue; `AsyncJob` is an async iterator over one job's results, with `cancel()`.

    agen = AsyncDynamicGenerator(DynamicGenerator(model))
    job = agen.submit(Job(ids, 64))
    async for r in job:
        print(r.get("text", ""), end="")
    await agen.close()

Steps run in a thread (`asyncio.to_thread`), so the event loop stays responsive while the device works. The
generator's lock serialises `iterate()` with `enqueue()`/`cancel()` from the loop, so a job submitted or cancelled
mid-step takes effect at the next step. An exception inside a step is delivered to every waiting job.
"""

from __future__ import annotations

import asyncio

from paged.generator import DynamicGenerator
from paged.job import Job

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
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item["eos"]:
            self.finished = True
        return item

    async def cancel(self) -> None:
        """Stop the job (pending or running) and end its iteration; its pages are released."""
        await asyncio.to_thread(self.agen.generator.cancel, self.job)
        self.agen._jobs.pop(self.job, None)
        while not self.queue.empty():  # results not yet consumed are dropped: the job is gone
            self.queue.get_nowait()
        self.queue.put_nowait(_DONE)


class AsyncDynamicGenerator:
    def __init__(self, generator: DynamicGenerator):
        self.generator = generator
        self._jobs: dict[Job, AsyncJob] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def submit(self, job: Job) -> AsyncJob:
        """Enqueue `job` (validation errors raise here) and return its async result iterator."""
        ajob = AsyncJob(self, job)
        self.generator.enqueue(job)
        self._jobs[job] = ajob
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()
        return ajob

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.generator.num_remaining_jobs():
                try:
                    results = await asyncio.to_thread(self.generator.iterate)
                except Exception as e:  # deliver to everyone waiting, then stop serving those jobs
                    for ajob in self._jobs.values():
                        ajob.queue.put_nowait(e)
                    self._jobs.clear()
                    self.generator.clear_queue()
                    break
                for r in results:
                    ajob = self._jobs.get(r["job"])
                    if ajob is None:
                        continue  # cancelled meanwhile, or enqueued on the generator directly
                    ajob.queue.put_nowait(r)
                    if r["eos"]:
                        del self._jobs[r["job"]]

    async def close(self) -> None:
        """Cancel all jobs and stop the background task."""
        for ajob in list(self._jobs.values()):
            await ajob.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
