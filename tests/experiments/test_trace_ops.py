"""experiments/lib/trace_ops.py: the per-operation breakdown `profile_speculative --ops` prints (its end-to-end run on a
tiny model is in test_profile_speculative.py)."""

from __future__ import annotations

import gzip
import json

import pytest

from experiments.lib.trace_ops import hlo_labels, leaf_times, op_breakdown


def ev(name, ts, dur, module="jit_step_forward", run="1"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"hlo_module": module, "run_id": run}}


def test_leaf_times_counts_what_ran_inside_loops_and_conditionals():
    events = [ev("while.1", 0, 100), ev("ffi_call.2", 5, 30), ev("cond.3", 40, 50), ev("ffi_call.4", 41, 45),
              ev("ffi_call.2", 95, 4), ev("copy.5", 100, 7)]
    assert leaf_times(events) == {"ffi_call.2": 34, "ffi_call.4": 45, "copy.5": 7}


def test_hlo_labels_names_custom_calls_by_target_and_result():
    text = "\n".join([
        '  %ffi_call.17 = f32[5,3072]{1,0} custom-call(f32[5,576]{1,0} %a, u8[30,288,3072]{2,1,0} %b), '
        'custom_call_target="jpg_quant_matmul", api_version=API_VERSION_TYPED_FFI',
        '  %ffi_call.11 = (f32[5,49152]{1,0}, s32[5]{0}) custom-call(f32[5,49152]{1,0} %x), '
        'custom_call_target="jpg_greedy_final"',
        "  %add.3 = f32[5,576]{1,0} add(f32[5,576]{1,0} %p, f32[5,576]{1,0} %q)"])
    assert hlo_labels(text) == {"ffi_call.17": "jpg_quant_matmul -> f32[5,3072]{1,0}",
                                "ffi_call.11": "jpg_greedy_final -> (f32[5,49152]{1,0}, s32[5]{0})"}


class Lowerable:
    """Stands in for a jitted function: `lower(...).compile().as_text()` gives fixed HLO."""

    def lower(self, *a, **k):
        return self

    def compile(self):
        return self

    def as_text(self):
        return '%ffi_call.2 = f32[1,64]{1,0} custom-call(f32[1,8] %x), custom_call_target="jpg_quant_matmul"'


def test_op_breakdown_matches_each_part_with_its_modules_runs_in_order(tmp_path):
    # two forwards of different buckets and one sampler, interleaved: run "a" is the first forward (a decode
    # bucket), "c" the second (a verification bucket), "b" the sampler between them
    events = [ev("while.1", 0, 50, run="a"), ev("ffi_call.2", 1, 40, run="a"),
              ev("fusion", 60, 5, module="jit_step_sample", run="b"),
              ev("while.1", 100, 90, run="c"), ev("ffi_call.2", 101, 80, run="c"), ev("copy", 185, 4, run="c")]
    (tmp_path / "x").mkdir()
    with gzip.open(tmp_path / "x" / "h.trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    fn = Lowerable()
    calls = [("step_forward", "decode", fn, (), {}), ("step_sample", "", fn, (), {}),
             ("step_forward", "verify", fn, (), {})]
    out = op_breakdown(str(tmp_path), calls)
    assert set(out) == {"step_forward (decode)", "step_sample", "step_forward (verify)"}
    dec, ver = out["step_forward (decode)"], out["step_forward (verify)"]
    assert dec["calls"] == ver["calls"] == 1
    assert dec["ops"] == [{"op": "ffi_call.2", "label": "jpg_quant_matmul -> f32[1,64]{1,0}", "ms_per_call": 0.04}]
    assert [(o["op"], o["ms_per_call"]) for o in ver["ops"]] == [("ffi_call.2", 0.08), ("copy", 0.004)]
    assert out["step_sample"]["ops"][0]["op"] == "fusion"
    assert ver["ops"][1]["label"] == ""


def test_op_breakdown_averages_over_calls_and_labels_from_the_first(tmp_path):
    events = [ev("op", 0, 10, run="a"), ev("op", 20, 30, run="b")]
    (tmp_path / "x").mkdir()
    with gzip.open(tmp_path / "x" / "h.trace.json.gz", "wt") as fh:
        json.dump(events, fh)
    out = op_breakdown(str(tmp_path), [("step_forward", "", Lowerable(), (), {}),
                                       ("step_forward", "", None, None, None)])
    assert out["step_forward"]["calls"] == 2
    assert out["step_forward"]["ops"][0]["ms_per_call"] == pytest.approx(0.02)
