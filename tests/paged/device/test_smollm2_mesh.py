"""The embedded SmolLM2-135M under a mesh (slow tier): with tp=3 (its 3 KV heads, one per device; the Q4_1 weights
split with their scales, the native kernel per device) and dp=3, greedy outputs equal one device's."""

from __future__ import annotations

import pytest

from tests.compile_settings import run_check_script

pytestmark = pytest.mark.real_weights
def test_smollm2_greedy_is_the_same_on_one_device_tp3_and_dp3():
    got = run_check_script("tests.paged.device.smollm2_mesh_check", "SMOLLM2_MESH")
    assert len(got["one"]) == 2 and all(got["one"])
    assert got["tp=3"] == got["one"] and got["dp=3"] == got["one"]
    assert got["tp=3 wo"] == ["P(None, 'tp', None)", "P(None, 'tp', None)"]  # 18 groups of 32 rows: 6 per device
