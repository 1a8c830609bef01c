"""Limits and disconnects held still by a gated fake engine (`helpers.GatedEngine`: its steps wait while the test
holds the gate), so what is running or waiting is decided by the test, not by the machine's speed: `max_queue` (429
past it, the other requests unharmed), and a non-streamed request whose client goes away."""

from __future__ import annotations

import threading

import httpx
import pytest

from paged import DynamicGenerator
from paged.testing import ByteTokenizer
from tests.server.helpers import DEADLINE_S, GatedEngine, LiveServer, wait_for, wait_idle

TOK = ByteTokenizer()
MAX_QUEUE = 2
LONG = 8000  # tokens: a job that outlives any HTTP round trip by far (the fake engine steps in microseconds)


@pytest.fixture(scope="module")
def server():
    engine = GatedEngine(num_pages=2100, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=LONG + 16,
                         record=False)
    s = LiveServer(DynamicGenerator(tokenizer=TOK, engine=engine), model_name="fake", max_queue=MAX_QUEUE)
    s.engine = engine
    yield s
    s.engine.gate.set()
    s.stop()


def body(prompt: str, **kw) -> dict:
    return {"model": "fake", "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, **kw}


def post_in_thread(server, payload: dict, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(httpx.post(f"{server.base}/v1/completions", json=payload,
                                                              timeout=DEADLINE_S)))
    t.start()
    return t


def test_requests_past_max_queue_get_429_and_the_others_finish(server):
    gate, service = server.engine.gate, server.service
    replies: list = []
    gate.clear()
    try:
        threads = [post_in_thread(server, body("running"), replies)]
        wait_for(server.engine.blocked.is_set, "the first request's step to start (and wait at the gate)")
        threads += [post_in_thread(server, body(f"waiting {i}"), replies) for i in range(MAX_QUEUE)]
        wait_for(lambda: service.waiting() == MAX_QUEUE, f"{MAX_QUEUE} jobs waiting")
        r = httpx.post(f"{server.base}/v1/completions", json=body("one too many"), timeout=DEADLINE_S)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "max_queue" in err["message"]
        # n choices count as n jobs
        r = httpx.post(f"{server.base}/v1/completions", json=body("two", n=2), timeout=DEADLINE_S)
        assert r.status_code == 429
        # more choices than the queue can ever hold: retrying would not help, so a 400 naming n
        r = httpx.post(f"{server.base}/v1/completions", json=body("three", n=MAX_QUEUE + 1), timeout=DEADLINE_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max_queue" in r.text, r.text
        r = httpx.post(f"{server.base}/v1/completions", json=body(["a", "b", "c"]), timeout=DEADLINE_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    finally:
        gate.set()
    for t in threads:
        t.join(DEADLINE_S)
    assert [x.status_code for x in replies] == [200] * (1 + MAX_QUEUE)
    assert all(x.json()["choices"][0]["finish_reason"] == "length" for x in replies)
    m = wait_idle(server)
    assert m["paged_requests_total{endpoint=/v1/completions,outcome=rejected}"] == 4
    assert httpx.post(f"{server.base}/v1/completions", json=body("after"), timeout=DEADLINE_S).status_code == 200


def test_a_non_streamed_request_whose_client_goes_away_is_cancelled(server):
    before = server.metrics()
    server.engine.gate.clear()
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while its job waits at the gate
            httpx.post(f"{server.base}/v1/completions", json=body("impatient", max_tokens=200),
                       timeout=httpx.Timeout(DEADLINE_S, read=0.3))
        key = "paged_requests_total{endpoint=/v1/completions,outcome=cancelled}"
        wait_for(lambda: server.metrics().get(key, 0) == before.get(key, 0) + 1, "the server to see the disconnect")
    finally:
        server.engine.gate.set()
    after = wait_idle(server)
    generated = after["paged_tokens_generated_total"] - before["paged_tokens_generated_total"]
    assert generated < 200, "the job ran to its end: the disconnect did not cancel it"


def test_a_request_sent_when_another_ends_joins_the_next_step(server):
    """With `admission_wait_ms`, after a step in which a request ended (and others run) the loop waits for a new
    request before the next step: a closed-loop client's next request runs in the very next step, instead of one
    (or a decode burst) later. Here the wait is longer than any test, so the count of steps is exact (without the
    wait, the long job would step on while the client sends its next request)."""
    service = server.service
    service.admission_wait_s = DEADLINE_S
    steps = lambda: server.metrics()["paged_steps_total"]  # noqa: E731
    try:
        payload = {**body("keeps running", max_tokens=LONG), "stream": True}
        with httpx.stream("POST", f"{server.base}/v1/completions", json=payload, timeout=DEADLINE_S) as running:
            lines = running.iter_lines()  # (kept: a dropped iterator closes the connection, and the job with it)
            next(ln for ln in lines if ln.startswith("data: {"))
            r = httpx.post(f"{server.base}/v1/completions", json=body("ends", max_tokens=3), timeout=DEADLINE_S)
            assert r.status_code == 200
            before = steps()  # the loop now waits for the next request (the running one cannot advance)
            assert steps() == before
            r = httpx.post(f"{server.base}/v1/completions", json=body("next", max_tokens=1), timeout=DEADLINE_S)
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert steps() == before + 1  # prefilled and sampled in the step right after the wait
    finally:
        service.admission_wait_s = 0.0
    wait_idle(server)
