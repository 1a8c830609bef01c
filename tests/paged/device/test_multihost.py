"""Several processes (`paged.device.sharding.initialize_distributed`, JAX's multi-controller model): two processes on
localhost, 2 virtual CPU devices each, run the same generator over one `dp=2,tp=2` mesh spanning both
(`tests/paged/device/multihost_check.py`). They must produce the same results as each other (the unseeded job too:
its seed comes from process 0) and as one device, with the cache split across both processes' devices."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from paged.device.sharding import initialize_distributed, is_main_process, shared_seed
from paged.errors import InvalidConfigError
from tests.compile_settings import script_env
from tests.paged.device import multihost_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def processes():
    env = script_env()
    env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.paged.device.multihost_check", str(i), "2", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for i in range(2)]
    # No fixed time limit (a loaded machine only makes them slower); a process that fails makes the other one, which
    # would wait for it forever, stop too.
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:  # (reading both pipes as they run)
        reads = [pool.submit(p.communicate) for p in procs]
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                for q in procs:
                    q.kill()
                break
            time.sleep(0.5)
        texts = [r.result() for r in reads]
    outs = []
    for out, err in texts:
        line = next((ln for ln in out.splitlines() if ln.startswith("MULTIHOST ")), None)
        assert line is not None, err[-3000:]
        outs.append(json.loads(line.removeprefix("MULTIHOST ")))
    return outs


@pytest.mark.slow
def test_two_processes_run_one_mesh_over_all_their_devices(processes):
    for i, got in enumerate(processes):
        assert got["process"] == i and got["processes"] == 2 and got["main"] == (i == 0)
        assert got["devices"] == 4 and got["local_devices"] == 2
        assert got["mesh"] == {"dp": 2, "tp": 2} and got["mesh_processes"] == [0, 1]
        assert got["k_spec"] == "P(None, 'tp')" and got["k_local_shards"] == 2  # each drives its own two shards


@pytest.mark.slow
def test_every_process_sees_the_same_results_as_one_device(processes):
    a, b = (p["finals"] for p in processes)
    assert a == b and len(a) == 4  # job 2 is unseeded: the same seed in both processes
    _, ref = multihost_check.run("")  # this process, one device
    assert {k: v for k, v in a.items() if k != "2"} == {k: v for k, v in ref.items() if k != "2"}


@pytest.mark.slow
def test_a_mesh_must_span_every_process(processes):
    for got in processes:
        assert "the mesh must span all of them" in got["narrow_mesh_error"]


def test_single_process_helpers_and_argument_checks():
    assert is_main_process()
    assert shared_seed() != shared_seed() or shared_seed() != shared_seed()  # fresh seeds (one process)
    for args, what in ((("localhost:1", 0, 0), "num_processes"), (("localhost:1", 2, 2), "process_id"),
                       (("localhost", 2, 0), "coordinator_address")):
        with pytest.raises(InvalidConfigError, match=what):
            initialize_distributed(*args)
