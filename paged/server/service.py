"""`ServingGenerator`: the generator behind the server. It extends `AsyncDynamicGenerator` (one host loop driving
`iterate()` off the event loop, each job's results routed to its own queue) with what serving needs:

- a request's jobs (its `n` choices) go into the generator in one atomic `enqueue`, so they are admitted together
  and share their prompt's pages, and their results arrive in one queue (`RequestStream`);
- `enqueue` and `cancel` run in a thread of their own (they wait for the generator's lock, held for a whole step),
  and steps in another, so the event loop never blocks on the device and HTTP work never delays a step;
- `max_queue` bounds the jobs waiting for admission (`APIError` 429 past it);
- `abort()` ends a request now (its client went away, or the server is stopping): its jobs are cancelled and their
  pages released at the end of the step under way;
- `drain(grace_s)` stops accepting requests, lets the running ones finish for up to `grace_s` seconds, then aborts
  the rest with an error their streams report.

A request's life: the app validates the body and builds its jobs (`paged.server.translate`) -> `open(jobs)` enqueues
them (the generator's own checks raise here, before any response starts) -> the host loop admits, prefills and
decodes them with every other job in the same batch -> each step's results land in the request's queue ->
`RequestStream.batches()` hands the app what arrived together (one SSE chunk per choice and step) -> the final
results end the stream; or the client disconnects and `abort()` cancels what is left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from paged.errors import StepError
from paged.host.async_generator import AsyncDynamicGenerator, AsyncJob
from paged.host.generator import DynamicGenerator
from paged.job import Job
from paged.server.errors import bad_request, queue_full, shutting_down

log = logging.getLogger("paged.server")


class ServerShutdown(RuntimeError):
    """The server stopped before this request finished (its grace period ran out)."""


class RequestStream:
    """One request's jobs and the one queue their results arrive in (in step order)."""

    def __init__(self, service: ServingGenerator, jobs: list[Job]):
        self.service = service
        self.jobs = jobs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ajobs = [AsyncJob(service, j) for j in jobs]
        for a in self.ajobs:
            a.queue = self.queue
            a.stream = self
        self.open = set(jobs)  # jobs whose final result has not reached the consumer
        self.running = len(jobs)  # jobs whose final result has not been dispatched

    async def batches(self) -> AsyncIterator[list]:
        """Lists of what arrived together: result dicts, or last an exception that ends the request (a failed step,
        the server stopping)."""
        while self.open:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            out = []
            for item in items:
                if isinstance(item, dict):
                    out.append(item)
                    if item["eos"]:
                        self.open.discard(item["job"])
                else:  # an exception, or the base class's end-of-iteration marker (its close())
                    self.open.clear()
                    out.append(item if isinstance(item, BaseException) else ServerShutdown("the job was cancelled"))
                    break
            yield out


class ServingGenerator(AsyncDynamicGenerator):
    def __init__(self, generator: DynamicGenerator, *, max_queue: int | None = None, max_step_retries: int = 2,
                 admission_wait_s: float = 0.0, on_step: Callable[[list[dict]], None] | None = None):
        super().__init__(generator, max_step_retries=max_step_retries)
        self.max_queue = max_queue
        self.admission_wait_s = admission_wait_s
        self.overlap_steps = True  # launch the next step before handing out a step's results (see `_run`)
        self._opened = 0  # requests enqueued so far
        self._opened_event = asyncio.Event()
        self.on_step = on_step  # called on the event loop with each step's results
        self.accepting = True
        self._submitting = 0  # jobs being enqueued (not yet in generator.pending)
        self._admin = ThreadPoolExecutor(1, thread_name_prefix="paged-enqueue")
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="paged-step")
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ requests
    def waiting(self) -> int:
        """Jobs waiting for admission (queued, or being queued)."""
        return len(self.generator.pending) + self._submitting

    def open_streams(self) -> int:
        return len({id(a.queue) for a in self._jobs.values()})

    def check_room(self, count: int, param: str = "n") -> None:
        """Whether a request of `count` jobs may be queued now: `APIError` 503 while draining; 400 naming `param`
        when `count` is past `max_queue` itself (such a request could never be queued: retrying would not help),
        429 when the queue has no room for it now. Checked before the request's jobs are built, and again by
        `open`."""
        if not self.accepting:
            raise shutting_down()
        if self.max_queue is not None and count > self.max_queue:
            raise bad_request(f"this request asks for {count} jobs (its prompts x n) and the server queues at most "
                              f"{self.max_queue} (--max_queue); ask for fewer choices or prompts", param=param)
        if self.max_queue is not None and self.waiting() + count > self.max_queue:
            raise queue_full(self.waiting(), self.max_queue)

    async def open(self, jobs: list[Job], param: str = "n") -> RequestStream:
        """Enqueue a request's jobs (atomically) and return their stream. Raises `APIError` 503 while draining,
        400 or 429 when the queue cannot take them (`check_room`), and the generator's named errors for jobs it
        rejects."""
        self.check_room(len(jobs), param)
        self._bind(asyncio.get_running_loop())
        stream = RequestStream(self, jobs)
        for a in stream.ajobs:  # registered first: results may come back before this coroutine resumes
            self._jobs[a.job] = a
        self._idle.clear()
        self._submitting += len(jobs)
        fut = asyncio.get_running_loop().run_in_executor(self._admin, self.generator.enqueue, jobs)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:  # the client went away while its jobs were being queued
            fut.add_done_callback(lambda f: self._after_enqueue(f, stream))
            raise
        except BaseException:
            for a in stream.ajobs:
                self._jobs.pop(a.job, None)
            self._check_idle()
            raise
        finally:
            self._submitting -= len(jobs)
        self._opened += 1
        self._opened_event.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()
        return stream

    def _after_enqueue(self, fut: asyncio.Future, stream: RequestStream) -> None:
        """The end of an `enqueue` whose request was cancelled meanwhile: queued, its jobs are cancelled; rejected (or
        never run), they are forgotten, so that the server can become idle."""
        if fut.cancelled() or fut.exception() is not None:
            for a in stream.ajobs:
                self._jobs.pop(a.job, None)
            stream.open.clear()
            self._check_idle()
        else:
            self.abort(stream)

    def abort(self, stream: RequestStream, error: BaseException | None = None) -> int:
        """End the request's unfinished jobs (idempotent; call from the event loop). They are cancelled in the
        generator (pages released as soon as the step under way ends); with `error`, the stream reports it.
        Returns how many jobs were still running or waiting."""
        live = [a.job for a in stream.ajobs if self._jobs.pop(a.job, None) is not None]
        stream.open.clear()
        if live:
            self._admin.submit(self._cancel, live)
        if error is not None:
            stream.queue.put_nowait(error)
        self._check_idle()
        return len(live)

    def _cancel(self, jobs: list[Job]) -> None:
        for job in jobs:
            try:
                self.generator.cancel(job)
            except Exception:  # noqa: BLE001 (logged: a cancel must not kill the admin thread)
                log.exception("cancelling %r failed", job)

    def _check_idle(self) -> None:
        if not self._jobs:
            self._idle.set()

    # ------------------------------------------------------------------ the host loop
    async def _run(self) -> None:
        """The base class's loop, stepping in a thread of its own; each step's results go to their requests' queues
        and to `on_step`. The next step is launched before a step's results are handed out, so the device computes
        while the event loop streams them (except after a step in which requests ended, when the admission wait
        comes first). A failure outside the step (a bug) ends the open requests with it, not the loop."""
        loop = asyncio.get_running_loop()
        failures = 0
        gen = self.generator
        step = lambda: loop.run_in_executor(self._stepper, gen.iterate)  # noqa: E731
        while True:
            await self._wake.wait()
            self._wake.clear()
            ahead = None  # a step launched before the previous step's results were handed out
            while ahead is not None or gen.num_remaining_jobs():
                try:
                    results = await (ahead if ahead is not None else step())
                    failures = 0
                except StepError as e:
                    ahead = None
                    failures += 1
                    log.warning("step failed (%d in a row): %s", failures, e)
                    if failures > self.max_step_retries:  # persistent: end the jobs that were running
                        failures = 0
                        for job in list(gen.active) or list(gen.pending):  # (pending: the step failed admitting)
                            ajob = self._jobs.pop(job, None)
                            await loop.run_in_executor(self._admin, gen.cancel, job)
                            if ajob is not None:
                                ajob.queue.put_nowait(e)
                        self._check_idle()
                    continue
                except Exception as e:  # noqa: BLE001 (not a StepError: the generator's own bug)
                    ahead = None
                    log.exception("the host loop failed")
                    for ajob in list(self._jobs.values()):
                        self.abort_job(ajob, e)
                    continue
                ahead = None
                ended = self._ending(results)
                wait = bool(ended and self.admission_wait_s > 0 and gen.active and not gen.pending and self.accepting)
                if self.overlap_steps and not wait and gen.num_remaining_jobs():
                    ahead = step()
                try:
                    self._dispatch(results)
                    if self.on_step is not None:
                        self.on_step(results)
                except Exception as e:  # noqa: BLE001
                    log.exception("dispatching a step's results failed")
                    for ajob in list(self._jobs.values()):
                        self.abort_job(ajob, e)
                    continue
                if wait:
                    await self._await_followups(ended)

    def _ending(self, results: list[dict]) -> int:
        """How many requests end with these results (every job of theirs still running ends)."""
        finals: dict[int, list] = {}
        for r in results:
            if r["eos"]:
                stream = getattr(self._jobs.get(r["job"]), "stream", None)
                if stream is not None:
                    finals.setdefault(id(stream), [stream, 0])[1] += 1
        return sum(1 for stream, k in finals.values() if stream.running == k)

    async def _await_followups(self, ended: int) -> None:
        """Requests just ended and rows are free: wait up to `admission_wait_s` for `ended` new requests (a client
        that sends its next request when one ends, as closed-loop clients and chat users do) so that they join the
        next step instead of waiting a whole step (or a decode burst) for the one after."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.admission_wait_s
        target = self._opened + ended
        while self._opened < target:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._opened_event.clear()
            try:
                await asyncio.wait_for(self._opened_event.wait(), left)
            except TimeoutError:
                return

    def abort_job(self, ajob: AsyncJob, error: BaseException) -> None:
        if self._jobs.pop(ajob.job, None) is not None:
            self._admin.submit(self._cancel, [ajob.job])
            ajob.queue.put_nowait(error)
        self._check_idle()

    def _dispatch(self, results: list[dict]) -> None:
        """Route a step's results to their requests' queues."""
        jobs = self._jobs
        for r in results:
            ajob = jobs.get(r["job"])
            if ajob is None:
                continue  # cancelled meanwhile
            ajob.queue.put_nowait(r)
            if r["eos"]:
                del jobs[r["job"]]
                stream = getattr(ajob, "stream", None)
                if stream is not None:
                    stream.running -= 1
        self._check_idle()

    # ------------------------------------------------------------------ shutdown
    async def drain(self, grace_s: float) -> int:
        """Stop accepting requests; wait up to `grace_s` seconds for the open ones to finish, then abort the rest
        (their streams report `ServerShutdown`). Returns how many requests were aborted."""
        self.accepting = False
        if self._jobs:
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
            except TimeoutError:
                pass
        queues: dict[int, Any] = {}
        for ajob in list(self._jobs.values()):
            queues.setdefault(id(ajob.queue), ajob)
        error = ServerShutdown(f"the server is shutting down and its grace period ({grace_s:g} s) ended before this "
                               "request finished")
        for ajob in list(self._jobs.values()):
            self._jobs.pop(ajob.job, None)
            self._admin.submit(self._cancel, [ajob.job])
        for ajob in queues.values():
            ajob.queue.put_nowait(error)
        self._check_idle()
        return len(queues)

    async def close(self) -> None:
        self.accepting = False
        await super().close()
        self._admin.shutdown(wait=False)
        self._stepper.shutdown(wait=False)
