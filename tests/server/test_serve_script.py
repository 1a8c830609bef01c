"""`python -m experiments.serve` as a process of its own (slow tier): it serves the tiny model until SIGTERM, then
stops accepting, lets the running stream finish (or ends it with an error event), and exits with status 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

from tests.compile_settings import ROOT, script_env
from tests.server.helpers import DEADLINE_S, free_port, wait_for

pytestmark = pytest.mark.slow


def refused(base: str) -> bool:
    try:
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 1},
                       timeout=DEADLINE_S)
    except httpx.TransportError:  # the listening socket is closed
        return True
    return r.status_code == 503


def test_sigterm_mid_stream_exits_cleanly(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 (read after the process ends)
    p = subprocess.Popen([sys.executable, "-m", "experiments.serve", "--model=tiny", f"--port={port}",
                          "--max_seq_len=512", "--page_size=16", "--nocompile_buckets", "--shutdown_grace_s=60",
                          "--log_level=warning"], stdout=log, stderr=subprocess.STDOUT, env=script_env(), cwd=ROOT)
    try:
        def up():
            assert p.poll() is None, f"the server exited with {p.returncode}"
            try:
                return httpx.get(f"{base}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, "the server to answer /health", every_s=0.2)
        body = {"model": "tiny", "prompt": "Tell a long story", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=DEADLINE_S) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    p.send_signal(signal.SIGTERM)
                    wait_for(lambda: refused(base), "new requests to be refused")
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
