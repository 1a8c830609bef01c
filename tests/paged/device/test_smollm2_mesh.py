"""The embedded SmolLM2-135M under a mesh (slow tier): with tp=3 (its 3 KV heads, one per device; the Q4_1 weights
split with their scales, the native kernel per device) and dp=3, greedy outputs equal one device's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.compile_settings import script_env

pytestmark = pytest.mark.real_weights
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_smollm2_greedy_is_the_same_on_one_device_tp3_and_dp3():
    env = script_env()
    p = subprocess.run([sys.executable, "-m", "tests.paged.device.smollm2_mesh_check"], capture_output=True, text=True,
                       env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("SMOLLM2_MESH ")), None)
    assert line is not None, p.stderr[-3000:]
    got = json.loads(line.removeprefix("SMOLLM2_MESH "))
    assert len(got["one"]) == 2 and all(got["one"])
    assert got["tp=3"] == got["one"] and got["dp=3"] == got["one"]
    assert got["tp=3 wo"] == ["P(None, 'tp', None)", "P(None, 'tp', None)"]  # 18 groups of 32 rows: 6 per device
