"""Stopping gracefully (`ServingGenerator.drain`, what SIGTERM runs: tests/server/test_serve_script.py sends the
signal to a real process): no new requests (503), the running ones finish within the grace period or are ended
with a `server_shutdown` error event, and their pages are freed. A gated fake engine holds the jobs still, so the
outcome does not depend on the machine's speed; each test drains its own server (a fake engine: nothing compiles)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from paged import DynamicGenerator
from paged.testing import ByteTokenizer
from tests.server.helpers import DEADLINE_S, GatedEngine, LiveServer, wait_for, wait_idle

TOK = ByteTokenizer()


@pytest.fixture
def server():
    engine = GatedEngine(num_pages=64, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=256,
                         record=False)
    s = LiveServer(DynamicGenerator(tokenizer=TOK, engine=engine), model_name="fake")
    s.engine = engine
    yield s
    engine.gate.set()
    s.stop()


def stream_in_thread(server, events: list, **kw) -> threading.Thread:
    payload = {"model": "fake", "prompt": "abc", "max_tokens": 100, "temperature": 0, "stream": True,
               "ignore_eos": True, **kw}

    def run():
        with httpx.stream("POST", f"{server.base}/v1/completions", json=payload, timeout=DEADLINE_S) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=run)
    t.start()
    return t


def drain(server, grace_s: float):
    """Start `service.drain(grace_s)` on the server's event loop; returns its concurrent future."""
    loop = server.service._task.get_loop()
    return asyncio.run_coroutine_threadsafe(server.service.drain(grace_s), loop)


def refuses_new_requests(server) -> None:
    r = httpx.post(f"{server.base}/v1/completions", json={"model": "fake", "prompt": "late", "max_tokens": 2},
                   timeout=DEADLINE_S)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    assert httpx.get(f"{server.base}/health", timeout=DEADLINE_S).status_code == 503


def test_running_requests_finish_within_the_grace_period(server):
    events: list = []
    server.engine.gate.clear()
    t = stream_in_thread(server, events)
    wait_for(server.engine.blocked.is_set, "the request's step to start")
    done = drain(server, DEADLINE_S)
    wait_for(lambda: not server.service.accepting, "the server to stop accepting")
    refuses_new_requests(server)
    server.engine.gate.set()
    assert done.result(DEADLINE_S) == 0  # nothing had to be ended
    t.join(DEADLINE_S)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in c for c in chunks)
    wait_idle(server)


def test_requests_left_when_the_grace_period_ends_get_an_error_event(server):
    events: list = []
    server.engine.gate.clear()
    t = stream_in_thread(server, events)
    wait_for(server.engine.blocked.is_set, "the request's step to start")
    assert drain(server, 0.05).result(DEADLINE_S) == 1  # the gate holds the job: it cannot finish in time
    refuses_new_requests(server)
    t.join(DEADLINE_S)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_shutdown" and "grace period" in err["message"]
    server.engine.gate.set()
    m = wait_idle(server)
    assert m["paged_pages_free"] + m["paged_pages_cached"] == m["paged_pages_total"]
