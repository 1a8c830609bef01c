"""experiments/build_ngram_corpus.py end to end on a tiny random chat model (subprocess: its absl flags would clash
with generate.py's), and the table it writes used by generate.py's --ngram_corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from absl import app

from paged.speculation.ngram_corpus import NgramCorpus
from tests.experiments.helpers import run_expecting_usage_error
from tests.experiments.test_generate import engine_args, flags_set, generate, model_dir, read_jsonl, run_main  # noqa: F401

pytest.importorskip("torch")


@pytest.mark.slow
def test_build_then_draft_with_the_table(model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "tables" / "corpus.npz"  # a folder that does not exist yet: made before the model answers
    text = tmp_path / "extra.txt"
    text.write_text("hello hello hello world. " * 20)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n\n{"prompt": "Count to three.", "max_new_tokens": 5}\n')
    p = subprocess.run([sys.executable, "-m", "experiments.build_ngram_corpus", f"--model={model_dir}",
                        "--quant=none", f"--out={out}", "--num_prompts=4", "--gen_tokens=8", "--gen_batch=2",
                        f"--text_files={text}", f"--prompts_file={prompts}", "--min_count=1"],
                       capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    log = json.loads((tmp_path / "tables" / "corpus.npz.json").read_text())
    corpus = NgramCorpus.load(out)
    assert log["answers"] == 4 + 2 and log["contexts"] == len(corpus) > 0
    assert corpus.vocab_size == json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert corpus.min_count == 1 and corpus.max_ngram == 6 and corpus.corpus_tokens == log["corpus_tokens"]
    assert corpus.corpus_tokens > 4 * 6 + 100  # the answers with their prompts' tails, and the text file
    # generate.py drafts from it; greedy output unchanged
    res = tmp_path / "o.jsonl"
    greedy = ("--temperature=0", "--prompt=hello hello hello world.", f"--output={res}", "--max_new_tokens=10")
    run_main(*engine_args(model_dir, *greedy))
    [plain] = read_jsonl(res)
    run_main(*engine_args(model_dir, *greedy, "--ngram_draft", f"--ngram_corpus={out}"))
    [drafted] = read_jsonl(res)
    assert drafted["completion"] == plain["completion"]
    with flags_set(*engine_args(model_dir, "--ngram_draft", f"--ngram_corpus={out}")):
        kw = generate.speculation_kwargs(generate.load_model_from_flags())
    assert kw["ngram_corpus"].entries(3) == corpus.entries(3) and kw["use_ngram_draft"] is True
    cut = tmp_path / "cut.npz"  # a table copied short: a usage error, not zipfile's traceback
    cut.write_bytes(out.read_bytes()[:100])
    for bad, message in (((f"--ngram_corpus={out}",), "add --ngram_draft"),
                         (("--ngram_draft", f"--ngram_corpus={tmp_path / 'none.npz'}"), "cannot read"),
                         (("--ngram_draft", f"--ngram_corpus={cut}"), "cannot read")):
        with flags_set(*engine_args(model_dir, "--prompt=x", *bad)):
            with pytest.raises(app.UsageError, match=message):
                generate.main(["generate"])
    prompts.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\nnot json\n')
    for args, message in (((), "--out is required"),
                          ((f"--out={out}", f"--prompts_file={prompts}"),
                           f'2 bad line(s) in --prompts_file (line 1 is the first line):\n  {prompts}:2: needs a '
                           f'non-empty "prompt" string\n  {prompts}:3: invalid JSON'),
                          ((f"--out={out}", f"--text_files={tmp_path / 'none.txt'}"), "cannot read it as UTF-8"),
                          ((f"--out={out}", "--max_ngram=0"), "need 1 <= --min_ngram <= --max_ngram <= 64"),
                          ((f"--out={out}", "--max_ngram=65"), "need 1 <= --min_ngram <= --max_ngram <= 64"),
                          ((f"--out={tmp_path}",), "is a folder")):
        bad = subprocess.run([sys.executable, "-m", "experiments.build_ngram_corpus", f"--model={model_dir}", *args],
                             capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert bad.returncode != 0 and message in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("bad, message", [
    ("--gen_minutes=-1", "--gen_minutes must be > 0"),  # (had written an empty table)
    ("--gen_tokens=0", "--gen_tokens must be >= 1, got 0"),
    ("--quant=foo", "--quant=foo is not one of: none, keep, int8, int4"),
])
def test_a_bad_flag_is_a_usage_error_before_the_model_loads(tmp_path, bad, message):
    """A bad value is absl's usage message naming the flag, not a traceback or an empty table after the model
    answered (the model does not exist: a check that let a bad value through fails there with another message)."""
    p = run_expecting_usage_error("experiments.build_ngram_corpus", f"--model={tmp_path / 'no-model'}",
                                  f"--out={tmp_path / 'c.npz'}", bad)
    assert message in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "c.npz").exists()
