"""Shared by the server tests: a server on a free port of 127.0.0.1, run by uvicorn in a thread of the test process
(one per test module), its Prometheus page as a dict, and polling with a deadline (never a fixed sleep)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from paged.testing import FakeEngine

DEADLINE_S = 120.0  # generous: a slow or loaded machine must not fail a test, only a wrong behaviour


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`paged.server` on `generator`, served by uvicorn in a daemon thread until `stop()`."""

    def __init__(self, generator: Any, **app_kwargs: Any):
        from paged.server import create_app, make_server

        self.app = create_app(generator, **app_kwargs)
        sock = socket.socket()  # bound here and handed to uvicorn: no other process can take the port in between
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app, port=self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="uvicorn")
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")

    @property
    def service(self):
        return self.app.state.paged.service

    def openai(self, **kw: Any):
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0, **kw)

    def async_openai(self, **kw: Any):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics: name{label=value,...} (labels sorted) -> value."""
        text = httpx.get(f"{self.base}/metrics", timeout=DEADLINE_S).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(DEADLINE_S)


def wait_for(condition: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S, every_s: float = 0.02) -> Any:
    """Poll `condition` until it returns something truthy (returned); AssertionError naming `what` past the
    deadline."""
    end = time.monotonic() + deadline_s
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def wait_idle(server: LiveServer) -> dict[str, float]:
    """Wait until no job waits or runs and no page is referenced; returns the metrics then."""
    def idle():
        m = server.metrics()
        return m if (m["paged_jobs_running"] == 0 and m["paged_jobs_waiting"] == 0 and m["paged_pages_used"] == 0
                     and m["paged_requests_open"] == 0) else None

    return wait_for(idle, "the server to be idle (no job, no page used)")



class GatedEngine(FakeEngine):
    """`paged.testing.FakeEngine` whose steps wait while `gate` is cleared (`blocked` is set meanwhile), so a test can
    hold jobs running or waiting for as long as it needs, whatever the machine's speed."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()

    def run(self, rows, **kwargs: Any):
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait()
            self.blocked.clear()
        return super().run(rows, **kwargs)
