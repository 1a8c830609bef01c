"""Tensor parallelism (`EngineConfig.mesh="tp=N"`, `paged/device/sharding.py`). The multi-device checks run in a fresh
process with 4 virtual CPU devices (`tests/paged/device/sharding_check.py`): greedy and seeded sampled outputs with
tp=2 and tp=4 identical to one device (mixed prefill/decode steps, a shared prefix served from the cache, a cancelled
job, an int8 cache), the cache really split by KV head, and no all-gather of the cache in the compiled step. The
rest runs here, on this process's one device."""

from __future__ import annotations

import jax
import pytest

from paged import DynamicGenerator
from paged.device import sharding as sh
from paged.device.config import EngineConfig
from paged.errors import InvalidConfigError
from paged.testing import ByteTokenizer, tiny_config, tiny_model
from tests.compile_settings import run_check_script


@pytest.fixture(scope="module")
def check():
    return run_check_script("tests.paged.device.sharding_check", "SHARDING_CHECK")


@pytest.mark.parametrize("mesh", ["tp=2", "tp=4", "dp=2", "dp=2,tp=2", "dp=4"])
@pytest.mark.slow  # the 4-device process (`check`) runs every mesh end to end
def test_parallel_outputs_equal_one_device(check, mesh):
    assert check["devices"] == 4
    got = check[mesh]
    assert got["greedy_equal"] and got["sampled_equal"]
    assert got["cached_tokens"] == check["reference_cached_tokens"] > 0  # the shared prefix came from the cache
    assert len(check["reference"]) == 4  # the cancelled job is not among the finished ones


@pytest.mark.parametrize("mesh, dp, tp", [("tp=2", 1, 2), ("tp=4", 1, 4), ("dp=2", 2, 1), ("dp=2,tp=2", 2, 2),
                                          ("dp=4", 4, 1)])
@pytest.mark.slow  # the 4-device process (`check`) runs every mesh end to end
def test_the_cache_is_split_by_kv_head_and_never_gathered(check, mesh, dp, tp):
    got = check[mesh]
    assert got["mesh_shape"] == {"dp": dp, "tp": tp}
    # over dp the cache is replicated (every replica holds every page); with tp=1 the spec reads P()
    assert got["k_spec"] == got["v_spec"] == ("P(None, 'tp')" if tp > 1 else "P()")
    assert got["k_shard_shape"][1] * tp == got["k_shape"][1] and got["k_shard_shape"][2:] == got["k_shape"][2:]
    assert got["wo_spec"] == got["w_down_spec"] == "P(None, 'tp', None)"  # by rows
    assert got["wqkv_spec"] == got["w_gate_up_spec"] == "P(None, None, 'tp')"  # by columns, regrouped first
    assert got["fused_groups"] == tp
    assert got["cache_gathers"] == []
    if tp > 1:
        assert got["all_reduces"] > 0  # the row-split projections' partial sums: the step really is partitioned
    # each device computes its share: tp splits the attention and all four projections, dp the tokens (the LM head
    # stays whole on every device)
    assert got["flops_per_device_vs_one"] < 1.2 / (dp * tp)
    if dp > 1:
        assert got["all_gathers"] > 0  # the new tokens' K/V reach every replica's copy of the cache
    # the hidden states are split by token over dp, and only over dp: the devices of one dp replica hold the same
    # rows, the replicas one slice each (a split over the wrong axis had kept every output and count equal)
    rows = got["token_rows"]
    assert sorted(rows) == [f"{i},{j}" for i in range(dp) for j in range(tp)]
    for key, (start, stop) in rows.items():
        i = int(key.split(",")[0])
        assert [start, stop] == [i * 8 // dp, (i + 1) * 8 // dp], (key, rows)


# the meshes each quantized model runs under in sharding_check: dp alone (whole weights on each replica, the tokens
# split) with the int8 weights only; q4_1 under dp=2 took ~36 s of the suite for the same assertions
QUANT_MESHES = {"q4_1": ("tp=2", "dp=2,tp=2"), "int8pc": ("tp=2", "dp=2,tp=2", "dp=2")}
COL, ROW = "P(None, None, 'tp')", "P(None, 'tp', None)"
QUANT_SPECS = {  # [values, scales] of each projection
    # q4_1 in groups of 32: wo (128 rows, 4 groups) splits by whole groups, w_down (96 rows, 3 groups) stays whole
    "q4_1": {"wqkv": [COL, COL], "wo": [ROW, ROW], "w_gate_up": [COL, COL], "w_down": ["P()", "P()"]},
    # per-channel int8: the one row of scales stays whole; w_down's 48-row shards would re-block the activations
    "int8pc": {"wqkv": [COL, COL], "wo": [ROW, "P()"], "w_gate_up": [COL, COL], "w_down": ["P()", "P()"]},
}


@pytest.mark.parametrize("kind, mesh", [(kind, mesh) for kind, meshes in QUANT_MESHES.items() for mesh in meshes])
@pytest.mark.parametrize("impl", ["xla", "native"])
@pytest.mark.slow  # the 4-device process (`check`) runs every mesh end to end
def test_quantized_weights_shard_with_their_scales(check, kind, impl, mesh):
    """Quantized projections split like float ones, values and group scales together, and the matmul (the native
    kernel is a custom call XLA cannot partition) runs per device on its shard and its tokens: same tokens as one
    device, the weights never gathered, the tokens split over dp."""
    q = check["quantized"]
    if impl not in q["impls"]:
        pytest.skip("the native kernel is not built here")
    got = q[f"{kind} {impl} {mesh}"]
    assert got["greedy_equal"]
    # with dp alone the weights are whole on each replica (a tp axis of size 1 splits nothing)
    assert got["specs"] == (QUANT_SPECS[kind] if "tp" in mesh else {
        "wqkv": [COL, COL], "wo": ["P()", "P()"], "w_gate_up": [COL, COL], "w_down": ["P()", "P()"]})
    assert got["matmul_shard_maps"] > 0 and got["weight_gathers"] == 0
    assert (got["token_split"] > 0) == ("dp" in mesh)


@pytest.mark.slow  # the 4-device process (`check`) runs every mesh end to end
def test_int8_cache_and_its_scales_shard_too(check):
    assert check["int8"] == {"greedy_equal": True, "k_scale_spec": "P(None, 'tp')"}


@pytest.mark.slow  # the 4-device process (`check`) runs every mesh end to end
def test_speculative_verification_steps_run_under_the_mesh(check):
    assert check["ngram"]["greedy_equal"] and check["ngram"]["verification_rows"] > 0
    d = check["draft_model"]
    assert d["greedy_equal"] and d["verification_rows"] > 0
    assert not any(d["compiled_after_warmup"].values()), d["compiled_after_warmup"]  # nothing compiles after warmup


@pytest.mark.slow  # the 4-device process (`check`)
def test_nothing_compiles_after_warmup_on_a_dp_mesh(check):
    assert check["dp_warmup"] == {"backend_compiles": 0}


@pytest.mark.slow  # the 4-device process (`check`) runs every mesh end to end
def test_meshes_that_cannot_work_are_config_errors(check):
    e = check["errors"]
    assert "needs 8 devices; 4 available" in e["tp=8"] and "needs 8 devices" in e["dp=4,tp=2"]
    assert "tp=3 must divide the model's num_kv_heads=4" in e["tp=3"]
    assert "axis 'pp' is not supported" in e["pp=2"]
    assert "'tp=two' is not 'axis=size'" in e["tp=two"]
    assert e["draft tp=2"].startswith("draft_model: ") and "num_kv_heads=1" in e["draft tp=2"]  # which model


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2,tp=2"])
@pytest.mark.slow  # the 4-device process (`check`) runs every mesh end to end
def test_the_pallas_kernel_runs_per_device_on_its_kv_heads(check, mesh):
    got = check[f"pallas {mesh}"]
    assert got["greedy_equal"] and got["cache_gathers"] == 0
    spec, count = check[f"shard_maps {mesh}"]
    assert spec == "P(None, 'tp', None, None, None)" and count > 0  # the kernel went through shard_map, cache split


def test_mesh_settings_here():
    assert sh.parse_mesh("") == {} and sh.parse_mesh(" tp = 2 ") == {"tp": 2}
    for bad in ("tp", "tp=2,tp=2", "tp=0", "x=2", "tp=2,", "tp=２"):  # (a stray comma, a full-width digit)
        with pytest.raises(InvalidConfigError, match="mesh"):
            EngineConfig(mesh=bad)
    with pytest.raises(InvalidConfigError, match="mesh must be a string"):
        EngineConfig(mesh=2)
    assert sh.spec_of("cache.k") == sh.P(None, "tp", None, None, None) and sh.spec_of("layers.wqkv") == sh.P(
        None, None, "tp") and sh.spec_of("unknown") == sh.P()
    cfg = tiny_config(258, num_layers=1)
    assert sh.make_mesh("tp=1", cfg) is None and sh.make_mesh("", cfg) is None
    model = tiny_model(cfg, tokenizer=ByteTokenizer())
    settings = dict(num_pages=8, page_size=8, max_batch_size=1, max_chunk_size=8, max_seq_len=16)
    hint = r" \(on the CPU, set XLA_FLAGS" if jax.default_backend() == "cpu" else "$"
    with pytest.raises(InvalidConfigError, match=r"needs 2 devices; 1 available" + hint):
        DynamicGenerator(model, mesh="tp=2", **settings)
    assert DynamicGenerator(model, mesh="tp=1", **settings).engine.mesh is None
