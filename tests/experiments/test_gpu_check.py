"""experiments/gpu_check.sh, the GPU campaign, checked without a GPU: its syntax, its default stages' time limits
against its budget, and every python command line it would run (DRY_RUN=1 prints them) parsed with that script's
own flags on the CPU; bench_e2e's are also checked as the script checks them (batch sizes, engine settings, the
preset and its positions), and each preset's weights and KV cache must fit in an H100 with room to spare."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.compile_settings import ROOT, script_env

SCRIPT = os.path.join(ROOT, "experiments", "gpu_check.sh")
ALL_STAGES = ["facts", "build", "gpu_tier", "e2e", "bench", "bench_large", "gemv", "fast_tier", "speculative",
              "price", "split_decode"]

# Run in a process of its own per script (absl keeps one flag registry per process): parse each argv with the
# script's flags; bench_e2e's also through its own checks.
CHECK = """
import importlib, json, sys
from absl import flags
name = sys.argv[1]
mod = importlib.import_module(name)
for argv in json.loads(sys.stdin.read()):
    flags.FLAGS.unparse_flags()
    flags.FLAGS([name, *argv])
    if name == "experiments.bench_e2e":
        from experiments.lib import engine_flags
        from models.presets import is_preset_source, parse_source, preset_config, weight_bytes
        engine_flags.validate()
        s = mod.settings(True)
        if is_preset_source(s.model):  # its weights and KV cache fit in an H100's 78 GiB, with room to spare
            name, fmt = parse_source(s.model)
            cfg = preset_config(name)
            c = mod.engine_config(s, cfg.max_position_embeddings).resolve(cfg.max_position_embeddings)
            item = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1}[c.cache_dtype]
            kv = c.num_pages * c.page_size * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item
            assert weight_bytes(cfg, fmt) + kv < 60 * 2**30, (s.model, weight_bytes(cfg, fmt), kv)
        else:
            mod.engine_config(s, 8192)
    print("parsed", name, " ".join(argv))
"""


def dry_run(tmp_path, *stages: str) -> list[list[str]]:
    """The commands the campaign would run, each as its argv (`timeout LIMIT` first)."""
    p = subprocess.run(["bash", SCRIPT, *stages], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "DRY_RUN": "1", "DEVICE": "testgpu", "OUT": str(tmp_path)})
    assert p.returncode == 0, p.stdout + p.stderr
    return [shlex.split(line[2:]) for line in p.stderr.splitlines() if line.startswith("+ ")]


def test_the_script_parses():
    p = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_the_default_campaign_runs_every_stage_within_twelve_minutes(tmp_path):
    cmds = dry_run(tmp_path)
    assert all(c[0] == "timeout" for c in cmds)
    assert sum(int(c[1]) for c in cmds) <= 690  # BUDGET_S's default: 11.5 minutes, the machine's start aside
    lines = [" ".join(c[2:]) for c in cmds]
    e2e = [c for c in cmds if "experiments.bench_e2e" in c]
    models = [c[c.index("--model") + 1] for c in e2e]
    assert models == ["preset:llama3-8b@bf16", "preset:llama3-8b@q4_0", "preset:llama3.2-1b@bf16", "smollm2-135m"]
    assert [c[c.index("--batch_sizes") + 1] for c in e2e] == ["1,16,64,256", "1,16,64,256", "1,16,64", "1"]
    assert all(c[c.index("--json_out") + 1].startswith(f"{tmp_path}/e2e_testgpu_") for c in e2e)
    assert any("-m gpu" in line for line in lines)  # the gpu tier
    assert sum("experiments.bench_kernels" in line for line in lines) == 2  # the kernel sweeps
    assert any("build_ext" in line for line in lines)


def test_every_python_command_line_parses_its_flags(tmp_path):
    by_module = defaultdict(list)
    for c in dry_run(tmp_path, *ALL_STAGES):
        if "-m" in c and c[c.index("-m") + 1].startswith("experiments."):
            i = c.index("-m")
            by_module[c[i + 1]].append(c[i + 2:])
    assert set(by_module) == {"experiments.bench_e2e", "experiments.bench_kernels", "experiments.bench_speculative",
                              "experiments.ngram_bound"}
    for module, argvs in by_module.items():
        p = subprocess.run([sys.executable, "-c", CHECK, module], input=json.dumps(argvs), capture_output=True,
                           text=True, cwd=ROOT, env=script_env(JAX_PLATFORMS="cpu"))
        assert p.returncode == 0, f"{module}: {p.stderr[-3000:]}"
        assert p.stdout.count("parsed ") == len(argvs)


def test_split_decode_times_the_mixed_step_with_and_without_split_decode_rows(tmp_path):
    """The split_decode stage sweeps the mixed shapes at the default blocking only (block_q 16, 4 pages per block),
    so its grid is the unsplit tuning and the decode rows split over 2, 4 and 8 programs (split_max_q=1)."""
    (cmd,) = dry_run(tmp_path, "split_decode")
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert "--sweep" in cmd and flag("--sweep_fix") == "block_q=16,pages_per_block=4"
    assert flag("--attn_impls") == "pallas" and flag("--ops") == "attention"
    assert all(s.startswith("mixed") for s in flag("--attn_shapes").split(","))
    assert flag("--json_out") == f"{tmp_path}/split_decode_testgpu.json"


@pytest.mark.parametrize("stage", ["bogus", "e2e_bogus"])
def test_an_unknown_stage_stops_the_campaign(tmp_path, stage):
    p = subprocess.run(["bash", SCRIPT, stage], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path)})
    assert p.returncode == 2 and f"unknown stage {stage}" in p.stdout
