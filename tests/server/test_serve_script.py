"""`python -m experiments.serve` as a process of its own (slow tier): it serves the tiny model until SIGTERM, then
stops accepting, lets the running stream finish (or ends it with an error event), and exits with status 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from typing import Any

import httpx
import pytest

from tests.compile_settings import ROOT, script_env
from tests.server.helpers import DEADLINE_S, free_port, wait_for

pytestmark = pytest.mark.slow


def refused(base: str, name: str) -> bool:
    try:
        r = httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": "late", "max_tokens": 1},
                       timeout=DEADLINE_S)
    except httpx.TransportError:  # the listening socket is closed
        return True
    return r.status_code == 503


def start_server(tmp_path) -> tuple[subprocess.Popen, Any, str, str]:
    """`experiments.serve` on a port found free, under a model name of its own: (process, log file, base URL, name).
    The port may be taken before the server binds it (by the other worker's test server, say): the name tells this
    server's answers from another's, and a server that could not bind is started again on another port."""
    for attempt in range(5):
        port, name = free_port(), f"tiny-{uuid.uuid4().hex[:8]}"
        base = f"http://127.0.0.1:{port}"
        log = open(tmp_path / f"serve{attempt}.log", "w+")  # noqa: SIM115 (read after the process ends)
        p = subprocess.Popen([sys.executable, "-m", "experiments.serve", "--model=tiny", f"--port={port}",
                              f"--served_model_name={name}", "--max_seq_len=512", "--page_size=16",
                              "--nocompile_buckets", "--shutdown_grace_s=60", "--log_level=warning"],
                             stdout=log, stderr=subprocess.STDOUT, env=script_env(), cwd=ROOT)

        def up(p=p, base=base, name=name):
            if p.poll() is not None:
                return "exited"
            try:
                models = httpx.get(f"{base}/v1/models", timeout=5)
                return models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [name]
            except (httpx.TransportError, ValueError, KeyError):
                return False

        if wait_for(up, "the server to answer /v1/models", every_s=0.2) is True:
            return p, log, base, name
        log.seek(0)
        output = log.read()
        log.close()
        assert "address already in use" in output.lower(), f"the server exited with {p.returncode}: {output[-3000:]}"
    raise AssertionError("five ports in a row were taken before the server bound them")


def test_sigterm_mid_stream_exits_cleanly(tmp_path):
    p, log, base, name = start_server(tmp_path)
    try:
        body = {"model": name, "prompt": "Tell a long story", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=DEADLINE_S) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    p.send_signal(signal.SIGTERM)
                    wait_for(lambda: refused(base, name), "new requests to be refused")
        assert p.wait(DEADLINE_S) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    log.seek(0)
    output = log.read()
    assert events[-1] == "[DONE]", output[-3000:]
    last = json.loads(events[-2])
    # within the grace period the stream either finishes or is ended by the server with an error event
    if "error" in last:
        assert last["error"]["type"] == "server_shutdown", last
    else:
        assert last["choices"][0]["finish_reason"] == "length"
    assert "server stopped" in output, output[-3000:]
