"""experiments/bench_speculative.py end to end on a tiny random Llama (subprocess: its absl flags would clash with
the other experiment scripts'): every configuration runs every prompt at the batch sizes' concurrency, the adaptive
drafter reports its gated steps, interleaved rounds pair each ratio with its own round, and an unknown drafter is a
usage error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.experiments.helpers import run_expecting_usage_error
from tests.experiments.test_generate import model_dir  # noqa: F401 (the fixture)

pytest.importorskip("torch")


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "experiments.bench_speculative", *args], capture_output=True,
                          text=True, env=env)


@pytest.mark.slow
def test_bench_runs_every_prompt_at_each_concurrency(model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "spec.json"
    # the corpus drafter's table: the model's own greedy outputs on the run's prompts, so that its drafts are right
    import numpy as np

    from experiments.lib.common import chat_prompt, workload
    from models import load_model
    from paged import DynamicGenerator, Job, SamplingSettings
    from paged.speculation.ngram_corpus import NgramCorpus

    model = load_model(str(model_dir), quant="int8")
    gen = DynamicGenerator(model, max_batch_size=2, max_seq_len=256)
    jobs = [Job(model.tokenizer.encode(chat_prompt(model.tokenizer, p), encode_special_tokens=True), 6,
                gen_settings=SamplingSettings.greedy()) for p in workload("copy", 3, 0)]
    gen.enqueue(jobs)
    while gen.num_remaining_jobs():
        list(gen.iterate())
    seqs = [np.asarray(j.sequence).ravel().tolist()[-12:] for j in jobs]  # prompt tails and outputs
    NgramCorpus.build(seqs, model.config.vocab_size, min_count=1).save(tmp_path / "corpus.npz")
    # int8 weights: the CPU's default kind of path (native kernels), whose rows are bitwise independent of the rows
    # beside them, so greedy speculation must reproduce plain decoding exactly (XLA's float dot does not promise it)
    p = run_bench(f"--model={model_dir}", "--quant=int8", "--drafters=none,ngram,ngram_adaptive,corpus",
                  "--batch_sizes=1,2", "--num_prompts=3", "--workloads=copy", "--max_new_tokens=6", "--nowarmup",
                  "--draft_token_cost=0.2", f"--ngram_corpus={tmp_path / 'corpus.npz'}", f"--json_out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["flags"]["num_prompts"] == 3 and rec["flags"]["draft_token_cost"] == 0.2
    assert rec["flags"]["quant"] == "int8" and rec["flags"]["warmup"] is False
    assert "--nowarmup: each configuration's first runs include compiling" in p.stdout
    runs = {(r["drafter"], r["batch_size"]): r for r in rec["runs"]}
    assert set(runs) == {(d, b) for d in ("none", "ngram", "ngram_adaptive", "corpus") for b in (1, 2)}
    assert runs[("corpus", 1)]["corpus_accepted_draft_tokens"] > 0 and runs[("ngram", 1)]["corpus_drafted_tokens"] == 0
    assert rec["flags"]["ngram_corpus"] == str(tmp_path / "corpus.npz")
    for r in runs.values():
        assert r["jobs"] == 3 and r["new_tokens"] > 0 and r["speedup_vs_none"] > 0
    assert runs[("none", 1)]["gated_steps"] == runs[("ngram", 1)]["gated_steps"] == 0
    assert runs[("none", 1)]["verification_rows"] == 0
    for r in runs.values():  # greedy: speculation emits plain decoding's tokens, job for job
        assert len(r["output_hashes"]) == 3 and r["identical_to_none"] == 3, r
    assert runs[("ngram", 1)]["output_hashes"] == runs[("none", 2)]["output_hashes"]
    assert len(set(runs[("none", 1)]["output_hashes"])) == 3  # the jobs' outputs, not one value for all
    assert "ngram  copy bs=1   outputs identical to none: 3/3" in p.stdout
    assert {c["drafter"]: c["identical_to_none"] for c in rec["summary"] if c["batch_size"] == 1} == {
        "none": 3, "ngram": 3, "ngram_adaptive": 3, "corpus": 3}
    assert runs[("none", 2)]["steps"] < runs[("none", 1)]["steps"]  # two jobs at a time share steps
    assert runs[("ngram", 1)]["draft_acceptance"] == "rejection" and runs[("none", 1)]["draft_acceptance"] is None
    for r in (runs[("corpus", 1)], runs[("corpus", 2)]):  # each run's own counts, not the generator's totals
        assert r["metrics"]["drafted_tokens"] == r["accepted_draft_tokens"] + r["rejected_draft_tokens"], r
        assert r["metrics"]["steps"] == r["steps"]
        assert r["metrics"]["pages_total"] > 0 and r["metrics"]["jobs_active"] == 0  # gauges as the run left them
        assert r["metrics"]["time_engine_s"] > 0 and "acceptance_rate" not in r["metrics"]
    assert runs[("corpus", 1)]["metrics"]["drafted_tokens"] > 0
    assert rec["device"]["cpu_dispatch"] == "async"  # JAX's default (paged.device.cpu_runtime)
    assert rec["flags"]["fuse_sampler"] is False and not any(r["fuse_sampler"] for r in rec["runs"])
    p = run_bench(f"--model={model_dir}", "--quant=none", "--drafters=ngram", "--batch_sizes=1", "--num_prompts=1",
                  "--workloads=copy", "--max_new_tokens=4", "--nowarmup", "--temperature=1",
                  "--draft_acceptance=match", "--cpu_dispatch=sync", "--fuse_sampler", f"--json_out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["flags"]["draft_acceptance"] == "match" and rec["runs"][0]["draft_acceptance"] == "match"
    assert rec["flags"]["cpu_dispatch"] == rec["device"]["cpu_dispatch"] == "sync"
    assert rec["flags"]["fuse_sampler"] is True and rec["runs"][0]["fuse_sampler"] is True  # the generator's config
    assert rec["runs"][0]["identical_to_none"] is None  # no plain run to compare with
    bad = run_bench(f"--model={model_dir}", "--drafters=none,bogus")
    assert bad.returncode != 0 and "unknown ['bogus']" in bad.stderr
    bad = run_bench(f"--model={model_dir}", "--drafters=none", "--workloads=copy", "--max_new_tokens=5000")
    assert bad.returncode != 0 and "exceed the generator's max_seq_len of 256" in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
    # The kernel flags reach the generator's config together: a tuning is checked against the kernel named with it
    bad = run_bench(f"--model={model_dir}", "--drafters=none", "--workloads=copy", "--max_new_tokens=2",
                    "--attn_impl=xla", "--attn_tuning=block_q=8")
    assert bad.returncode != 0 and "attn_impl='xla'" in bad.stderr and "takes no tuning" in bad.stderr
    assert "Traceback" not in bad.stderr  # a usage error
    p = run_bench(f"--model={model_dir}", "--quant=none", "--drafters=none", "--batch_sizes=1", "--num_prompts=1",
                  "--workloads=copy", "--max_new_tokens=2", "--nowarmup", "--attn_impl=pallas",
                  "--attn_tuning=block_q=8,k_splits=2", "--matmul_impl=xla", f"--json_out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    engine = json.loads(out.read_text())["runs"][0]["engine"]  # the generator's own config, per run
    assert engine["attn_impl"] == "pallas" and engine["matmul_impl"] == "xla"
    assert engine["attn_tuning"]["block_q"] == 8 and engine["attn_tuning"]["k_splits"] == 2
    assert engine["matmul_tuning"] is None


@pytest.mark.slow
def test_a_late_draft_model_waits_for_the_results(model_dir, tmp_path):  # noqa: F811
    """`_late`: the draft model's bursts wait for each verification's results on the host (none dispatched ahead);
    without it most steps of a single stream use a burst dispatched ahead; both emit plain decoding's tokens."""
    out = tmp_path / "spec.json"
    p = run_bench(f"--model={model_dir}", "--quant=int8", "--drafters=none,self,self_late", "--self_draft_layers=1",
                  "--batch_sizes=1", "--num_prompts=2", "--workloads=copy", "--max_new_tokens=10",
                  "--num_draft_tokens=2", "--nowarmup", f"--json_out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    runs = {r["drafter"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["self_late"]["draft_bursts_ahead_used"] == 0 and runs["none"]["draft_bursts_ahead_used"] == 0
    assert runs["self"]["draft_bursts_ahead_used"] >= runs["self"]["verification_rows"] - 2 * 2
    assert runs["self"]["verification_rows"] > 4
    assert runs["self"]["identical_to_none"] == runs["self_late"]["identical_to_none"] == 2
    bad = run_bench(f"--model={model_dir}", "--drafters=none,ngram_late")
    assert bad.returncode != 0 and "unknown ['ngram_late']" in bad.stderr


@pytest.mark.slow
def test_rounds_interleave_the_configurations_and_pair_each_ratio_with_its_round(model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "spec.json"
    p = run_bench(f"--model={model_dir}", "--quant=none", "--drafters=none,ngram", "--batch_sizes=1",
                  "--num_prompts=2", "--workloads=copy", "--max_new_tokens=5", "--nowarmup", "--rounds=3",
                  f"--json_out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["flags"]["rounds"] == 3
    assert [(r["round"], r["drafter"]) for r in rec["runs"]] == [(0, "none"), (0, "ngram"), (1, "ngram"),
                                                                  (1, "none"), (2, "none"), (2, "ngram")]
    none = {r["round"]: r["tokens_per_s"] for r in rec["runs"] if r["drafter"] == "none"}
    for r in rec["runs"]:
        assert r["speedup_vs_none"] == pytest.approx(r["tokens_per_s"] / none[r["round"]])
    summary = {c["drafter"]: c for c in rec["summary"]}
    ratios = sorted(r["speedup_vs_none"] for r in rec["runs"] if r["drafter"] == "ngram")
    assert summary["ngram"]["rounds"] == 3
    assert summary["ngram"]["speedup_vs_none"] == pytest.approx({"median": ratios[1], "min": ratios[0],
                                                                 "max": ratios[2]})
    assert summary["none"]["speedup_vs_none"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert summary["ngram"]["tokens_per_s"] == pytest.approx(
        sorted(r["tokens_per_s"] for r in rec["runs"] if r["drafter"] == "ngram")[1])
    assert "x none: median" in p.stdout


@pytest.mark.parametrize("bad, message", [
    ("--workloads=copy,bogus", "--workloads: unknown ['bogus']; give some of copy, chat"),  # (had run as chat)
    ("--batch_sizes=1,abc", "--batch_sizes=1,abc: give integers >= 1"),
    ("--draft_dir=/nonexistent/draft", "--draft_dir /nonexistent/draft: no such folder"),
    ("--drafters=none,none_adaptive", "unknown ['none_adaptive']"),  # (had run as plain decoding)
    ("--num_draft_tokens=100", "--num_draft_tokens must be <= 64, got 100"),
])
def test_a_bad_flag_is_a_usage_error_before_any_model_loads(tmp_path, bad, message):
    """absl's usage message naming the flag, not a traceback after the target loaded (the model does not exist: a
    check that let a bad value through fails there with another message)."""
    p = run_expecting_usage_error("experiments.bench_speculative", f"--model={tmp_path / 'no-model'}", bad)
    assert message in p.stderr, p.stderr[-2000:]


def test_a_draft_of_another_vocabulary_without_a_tokenizer_is_a_usage_error(model_dir, tmp_path):  # noqa: F811
    """--draft_dir holds a checkpoint (no tokenizer files, as distill_draft writes) of another vocabulary size: the
    generator's own check (`paged.speculation.draft.check_draft_model`) refuses it, as a usage error naming the
    flag (it had compared the sizes alone, refusing the padded-differently drafts the generator takes)."""
    from models.draft import save_hf_llama
    from paged.testing import tiny_config, tiny_model

    draft = tiny_model(tiny_config(96, num_layers=1))
    save_hf_llama(draft.params, draft.config, str(tmp_path / "draft"))
    p = run_expecting_usage_error("experiments.bench_speculative", f"--model={model_dir}", "--drafters=distilled",
                                  f"--draft_dir={tmp_path / 'draft'}", "--draft_quant=none", "--nowarmup")
    assert f"--draft_dir {tmp_path / 'draft'}: draft_model has a vocabulary of 96 ids" in p.stderr, p.stderr[-2000:]
    assert "needs both models' tokenizers" in p.stderr
