"""Running the app under uvicorn with a graceful stop.

On SIGTERM (or SIGINT) the server stops accepting connections at once, answers 503 to requests that still arrive on
open connections, lets the running requests finish for up to `grace_s` seconds, then ends the ones left (each stream
gets an error event of type `server_shutdown` and `[DONE]`; their jobs are cancelled), closes the generator's loop
and returns; `python -m experiments.serve` then exits with status 0. A second SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from fastapi import FastAPI

log = logging.getLogger("paged.server")


class Server(uvicorn.Server):
    """uvicorn's server, draining the generator (`ServingGenerator.drain`) when asked to stop."""

    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s
        self._drain: asyncio.Task | None = None

    async def shutdown(self, sockets=None) -> None:
        service = self.config.app.state.paged.service
        log.info("shutting down: no new requests; running ones get %.3g s to finish", self.grace_s)
        self._drain = asyncio.get_running_loop().create_task(service.drain(self.grace_s))
        await super().shutdown(sockets)
        aborted = await self._drain
        if aborted:
            log.info("ended %d request(s) that had not finished within the grace period", aborted)
        # uvicorn re-raises the signal it caught once it has stopped, so that the process dies of it (status -15);
        # the server has stopped as asked, so it returns normally instead and the program exits with status 0
        self._captured_signals.clear()


def make_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0,
                log_level: str = "info") -> Server:
    """A `Server` for `app` (call `.run()`, or `.serve()` in a loop; `should_exit = True` stops it). Uvicorn's own
    limit on the shutdown is the grace period plus 5 s, a backstop for connections that do not close."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s + 5,
                            lifespan="on", access_log=False)
    return Server(config, grace_s)


def serve(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0,
          log_level: str = "info") -> None:
    """Serve until SIGTERM / SIGINT, then stop gracefully (module docstring)."""
    make_server(app, host=host, port=port, grace_s=grace_s, log_level=log_level).run()
