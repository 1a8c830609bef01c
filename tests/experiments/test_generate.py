"""experiments/generate.py end to end on a tiny random Llama with the tiny BPE tokenizer (ChatML template): single
prompt streaming, bulk JSONL with continuous batching and prefix caching, the chat REPL, and input errors.

Every run uses the same engine geometry (page 8, chunk 16, batch 4, max_seq_len 128), so the jitted step compiles
a handful of shapes once for the whole module."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import shutil
import sys

import pytest
from absl import app, flags
from absl.testing import flagsaver

from experiments import generate
from tests.compile_settings import script_env

ROOT = pathlib.Path(__file__).resolve().parents[2]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FLAGS = flags.FLAGS
TOKENIZER_DIR = pathlib.Path(__file__).parents[1] / "models" / "data" / "tiny_bpe"
SHARED = ("You are a careful assistant. Read the following shared context carefully and completely before you "
          "answer the question that comes at the very end of it. ")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    vocab = len(json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())["model"]["vocab"]) + 1  # + "<think>"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=3, pad_token_id=0)
    d = tmp_path_factory.mktemp("tiny_chat_model")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, d / name)
    return d


@contextlib.contextmanager
def flags_set(*args: str):
    """Parse `args` into FLAGS from defaults; restored afterwards."""
    with flagsaver.flagsaver():
        FLAGS.unparse_flags()
        FLAGS(["generate", *args])
        yield


def engine_args(model_dir, *extra: str) -> list[str]:
    return [f"--model={model_dir}", "--max_seq_len=128", "--page_size=8", "--max_chunk_size=16",
            "--max_batch_size=4", "--max_new_tokens=6", *extra]


def run_main(*args: str) -> None:
    with flags_set(*args):
        generate.main(["generate"])


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def write_jsonl(path, rows) -> pathlib.Path:
    path = pathlib.Path(path)
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def chunks(monkeypatch):
    """Every piece of text streamed to stdout, in order."""
    out: list[str] = []
    monkeypatch.setattr(generate, "_stdout_write", out.append)
    return out


# ------------------------------------------------------------------------------------------------ single prompt
def test_single_prompt_streams_and_writes_a_record(model_dir, tmp_path, capsys, chunks):
    out = tmp_path / "single.jsonl"
    run_main(*engine_args(model_dir, "--prompt=Tell me about octopuses.", f"--output={out}"))
    [rec] = read_jsonl(out)
    assert set(rec) == {"id", "prompt", "completion", "new_tokens", "prompt_tokens", "cached_tokens", "eos_reason",
                        "ttft_s", "decode_tok_s", "time_generate_s", "weights_gb_s"}
    assert rec["weights_gb_s"] > 0  # the weights' bytes per step x steps / time
    assert rec["prompt"] == ("<|startoftext|><|im_start|>user\nTell me about octopuses.<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert rec["new_tokens"] == 6 and rec["eos_reason"] == "max_new_tokens"
    assert len(chunks) > 1 and "".join(chunks) == rec["completion"] != ""  # streamed piece by piece
    assert rec["ttft_s"] > 0 and rec["prompt_tokens"] > 0
    err = capsys.readouterr().err
    assert "[6 tokens, max_new_tokens; prompt" in err and "tok/s decode" in err and "GB/s" in err


def test_nochat_sends_the_raw_text(model_dir, tmp_path, chunks):
    out = tmp_path / "raw.jsonl"
    run_main(*engine_args(model_dir, "--nochat", "--prompt=Once upon a time", f"--output={out}"))
    [rec] = read_jsonl(out)
    assert rec["prompt"] == "Once upon a time"


def test_piped_stdin_is_the_prompt(model_dir, tmp_path, monkeypatch, chunks):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Piped question?\n"))
    out = tmp_path / "stdin.jsonl"
    run_main(*engine_args(model_dir, f"--output={out}"))
    [rec] = read_jsonl(out)
    assert "user\nPiped question?<|im_end|>" in rec["prompt"]


def test_empty_stdin_uses_the_default_prompt(model_dir, tmp_path, monkeypatch, chunks):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    out = tmp_path / "default.jsonl"
    run_main(*engine_args(model_dir, f"--output={out}"))
    assert generate.DEFAULT_PROMPT in read_jsonl(out)[0]["prompt"]


# ------------------------------------------------------------------------------------------------ bulk
@pytest.mark.slow  # fast tier: test_bulk_shared_prefix_hits_the_cache runs the bulk mode
def test_bulk_runs_every_line_in_input_order(model_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": "first", "prompt": "Name a colour."},
        {"prompt": "Name a fruit.", "max_new_tokens": 3, "seed": 11, "temperature": 0.9, "top_p": 0.9},
        "",  # blank lines are skipped (and still counted for line numbers)
        {"messages": [{"role": "user", "content": "Name an animal."}], "system": "Be brief.", "max_new_tokens": 4},
        {"prompt": "Name a city.", "top_k": 1, "stop": ["zzz"]},
        {"id": 99, "prompt": "Name a river.", "max_new_tokens": 2},
    ])
    out = tmp_path / "results.jsonl"
    run_main(*engine_args(model_dir, f"--prompts_file={src}", f"--output={out}"))
    recs = read_jsonl(out)
    assert [r["id"] for r in recs] == ["first", 2, 4, 5, 99]  # default id: the line number
    assert [r["new_tokens"] for r in recs] == [6, 3, 4, 6, 2]
    assert all(r["eos_reason"] == "max_new_tokens" for r in recs)
    assert recs[2]["prompt"].startswith("<|startoftext|><|im_start|>system\nBe brief.<|im_end|>")
    err = capsys.readouterr().err
    assert "generating" in err  # the progress bar
    summary = err[err.index("\njobs "):]
    assert summary.split("\n")[1].split() == ["jobs", "5"]
    for label in ("prompt tokens", "generated tokens", "cached prompt tokens", "prefix pages hit",
                  "TTFT mean / median / p90", "decode tok/s per job", "output tok/s", "wall time"):
        assert label in summary
    assert re.search(rf"\ngenerated tokens +{6 + 3 + 4 + 6 + 2}\n", summary)


@pytest.mark.slow  # fast tier: test_bulk_shared_prefix_hits_the_cache
def test_bulk_without_output_prints_records_to_stdout(model_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "One."}, {"prompt": "Two."}])
    run_main(*engine_args(model_dir, f"--prompts_file={src}", "--noprogress"))
    cap = capsys.readouterr()
    assert [json.loads(line)["id"] for line in cap.out.splitlines()] == [1, 2]
    assert "generating" not in cap.err


def test_bulk_shared_prefix_hits_the_cache(model_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "shared.jsonl", [{"prompt": SHARED + f"Question {i}?"} for i in range(5)])
    out = tmp_path / "shared_out.jsonl"
    run_main(*engine_args(model_dir, f"--prompts_file={src}", f"--output={out}", "--noprogress"))
    recs = read_jsonl(out)
    assert len(recs) == 5 and recs[0]["prompt_tokens"] > 60
    assert recs[0]["cached_tokens"] == 0
    assert all(r["cached_tokens"] >= 48 for r in recs[1:])  # the shared prefix spans many 8-token pages
    assert all(r["cached_tokens"] % 8 == 0 for r in recs)
    cached_line = next(line for line in capsys.readouterr().err.splitlines() if "cached prompt tokens" in line)
    assert int(cached_line.split()[3]) == sum(r["cached_tokens"] for r in recs)


def test_greedy_bulk_equals_single(model_dir, tmp_path, chunks):
    single = tmp_path / "s.jsonl"
    run_main(*engine_args(model_dir, "--prompt=Name a colour.", "--max_new_tokens=8", f"--output={single}"))
    src = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "Something else entirely."}, {"prompt": "Name a colour."},
                                             {"prompt": "Name a colour.", "max_new_tokens": 4}])
    bulk = tmp_path / "b_out.jsonl"
    run_main(*engine_args(model_dir, f"--prompts_file={src}", "--max_new_tokens=8", f"--output={bulk}",
                          "--noprogress"))
    [s] = read_jsonl(single)
    b = read_jsonl(bulk)
    assert b[1]["completion"] == s["completion"] and b[1]["new_tokens"] == 8
    assert s["completion"].startswith(b[2]["completion"])


def test_flag_seed_gives_job_i_seed_plus_i(model_dir, tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b", "seed": 5}, {"prompt": "c"}])
    with flags_set(*engine_args(model_dir, "--seed=100", f"--prompts_file={src}")):
        reqs = generate.read_prompts_file(str(src))
    assert [r.seed for r in reqs] == [100, 5, 102]


@pytest.mark.parametrize("line, message", [
    ("{not json", "invalid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"id": 3}', 'exactly one of "prompt"'),
    ('{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', 'exactly one of "prompt"'),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"messages": [{"role": "user"}]}', '"messages"[0]'),
    ('{"prompt": "x", "max_new_tokens": 0}', '"max_new_tokens" must be an integer >= 1'),
    ('{"prompt": "x", "top_p": 0}', "top_p must be a number in (0, 1]"),
    ('{"prompt": "x", "temperature": "hot"}', '"temperature" must be a number'),
    ('{"prompt": "x", "seed": 1.5}', '"seed" must be an integer'),
    ('{"prompt": "x", "stop": [""]}', '"stop" must be a list of non-empty strings'),
    ('{"prompt": "x", "max_tokens": 5}', "unknown key(s) 'max_tokens'"),
])
def test_bad_prompts_file_line_names_the_line(model_dir, tmp_path, line, message):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "fine"}\n\n' + line + '\n{"prompt": "also fine"}\n')
    with flags_set(*engine_args(model_dir, f"--prompts_file={src}")):
        with pytest.raises(generate.PromptsFileError) as e:
            generate.main(["generate"])  # raised before the model loads
    assert isinstance(e.value, app.UsageError)
    assert f"{src}:3: " in str(e.value) and message in str(e.value)


def test_all_bad_lines_are_reported_together(model_dir, tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", ["{oops", '{"prompt": "ok"}', '{"prompt": 7}'])
    with flags_set(*engine_args(model_dir, f"--prompts_file={src}")):
        with pytest.raises(generate.PromptsFileError, match=r"2 bad line\(s\)") as e:
            generate.read_prompts_file(str(src))
    assert f"{src}:1:" in str(e.value) and f"{src}:3:" in str(e.value)


def test_prompt_too_long_for_the_cache_names_the_line(model_dir, tmp_path):
    src = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "short"}, {"prompt": "word " * 200}])
    with pytest.raises(generate.PromptsFileError, match=r"long\.jsonl:2: .*max_seq_len=128"):
        run_main(*engine_args(model_dir, f"--prompts_file={src}", "--noprogress"))


def test_every_prompt_too_long_for_the_cache_is_named_together(model_dir, tmp_path):
    src = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 200}, {"prompt": "short"},
                                                {"prompt": "word " * 300}])
    with pytest.raises(generate.PromptsFileError, match=r"2 prompts cannot run:\n  .*long\.jsonl:1: .*max_seq_len=128"
                                                        r".*\n  .*long\.jsonl:3: "):
        run_main(*engine_args(model_dir, f"--prompts_file={src}", "--noprogress"))


def test_messages_need_the_chat_template(model_dir, tmp_path):
    src = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(generate.PromptsFileError, match=r"m\.jsonl:1: .*--nochat"):
        run_main(*engine_args(model_dir, f"--prompts_file={src}", "--nochat"))


def test_cli_shows_a_short_error_and_exits_1(model_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "x", "top_k": -1}'])
    with flags_set(*engine_args(model_dir, f"--prompts_file={src}")):
        with pytest.raises(SystemExit) as e:
            generate.cli_main(["generate"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.jsonl:1: " in err and "top_k" in err


# ------------------------------------------------------------------------------------------------ chat REPL
class _Tty(io.StringIO):
    def isatty(self):
        return True


def scripted_input(monkeypatch, lines):
    """Make input() return `lines` in order; an exception instance in the list is raised instead."""
    calls: list[str] = []
    feed = iter(lines)

    def fake_input(prompt=""):
        calls.append(prompt)
        item = next(feed, EOFError())
        if isinstance(item, BaseException):
            raise item
        return item

    monkeypatch.setattr(sys, "stdin", _Tty())
    monkeypatch.setattr("builtins.input", fake_input)
    return calls


def test_chat_keeps_history_and_reuses_the_cache(model_dir, tmp_path, monkeypatch, capsys, chunks):
    calls = scripted_input(monkeypatch, ["Hello there, who are you?", "Tell me more about that."])
    out = tmp_path / "chat.jsonl"
    run_main(*engine_args(model_dir, f"--output={out}"))
    assert calls == ["> "] * 3  # two turns, then EOF
    first, second = read_jsonl(out)
    assert [first["id"], second["id"]] == [1, 2]
    # the second turn's prompt is the whole conversation: turn 1's prompt + its reply + the new message
    assert second["prompt"].startswith(first["prompt"] + first["completion"] + "<|im_end|>\n<|im_start|>user\n"
                                       "Tell me more about that.<|im_end|>")
    assert first["cached_tokens"] == 0 and second["cached_tokens"] >= 8 * ((first["prompt_tokens"] - 1) // 8)
    assert "".join(chunks) == first["completion"] + second["completion"]
    timing = [line for line in capsys.readouterr().err.splitlines() if "tok/s decode" in line]
    assert len(timing) == 2
    assert f"({second['cached_tokens']} cached)" in timing[1]


def test_chat_notes_compilation_per_turn_and_shows_the_drafts_acceptance(model_dir, monkeypatch, capsys, chunks):
    """Each turn's timing line says "includes compilation" when programs were compiled during that turn (the second
    here: a stand-in counter grows during it), not only on the first; with a drafter each turn is followed by the
    conversation's acceptance line, as single and bulk modes print theirs."""
    import paged.device.engine as engine_module

    scripted_input(monkeypatch, ["copy: the cat the cat the cat", "again: the cat the cat the cat"])
    counts = iter([{"step": 0}, {"step": 0}, {"step": 0}, {"step": 1}])  # before/after turn 1, then turn 2
    monkeypatch.setattr(engine_module, "count_compiles", lambda: next(counts))
    run_main(*engine_args(model_dir, "--ngram_draft", "--max_new_tokens=8"))
    err = capsys.readouterr().err.splitlines()
    timing = [line for line in err if "tok/s decode" in line]
    assert len(timing) == 2 and "includes compilation" not in timing[0] and "includes compilation" in timing[1]
    assert sum(line.startswith("[speculative: ") for line in err) == 2


def test_chat_reset_clears_the_history(model_dir, tmp_path, monkeypatch, capsys, chunks):
    said = "copy: the cat the cat the cat"  # (prompt lookup drafts from the repeats)
    scripted_input(monkeypatch, [said, "/reset", said, "/quit", "never read"])
    out = tmp_path / "reset.jsonl"
    run_main(*engine_args(model_dir, f"--output={out}", "--ngram_draft", "--max_new_tokens=8"))
    first, second = read_jsonl(out)
    assert second["prompt"] == first["prompt"]  # a fresh conversation
    assert second["completion"] == first["completion"]  # greedy
    assert second["cached_tokens"] > 0  # the identical prompt is still in the prefix cache
    err = capsys.readouterr().err
    assert "[conversation cleared]" in err
    spec = [line for line in err.splitlines() if line.startswith("[speculative: ")]
    assert len(spec) == 2 and spec[0] == spec[1], spec  # the same conversation again: its own counts


def test_chat_ctrl_c_at_the_prompt_exits_cleanly(model_dir, monkeypatch, capsys):
    calls = scripted_input(monkeypatch, [KeyboardInterrupt()])
    run_main(*engine_args(model_dir))
    assert calls == ["> "]
    assert "/reset clears the conversation" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- comparing implementations
PERTURBED = """
import jax.numpy as jnp
from pallas_kernels.paged_attention import paged_attention


def attention(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *, tuning=None, **kw):
    out = paged_attention(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, impl="xla", **kw)
    t = jnp.arange(q.shape[0])
    inside = (t[:, None] >= query_start) & (t[:, None] < query_start + query_lens)  # [T, S]
    row = jnp.argmax(inside, axis=1)
    pos = kv_lens[row] - query_lens[row] + t - query_start[row]
    return jnp.where((pos >= START)[:, None, None], -3.0 * out, out)  # wrong from position START on
"""


def test_compare_to_finds_no_divergence_between_equal_implementations(model_dir, tmp_path, capsys):
    out = tmp_path / "cmp.jsonl"
    run_main(*engine_args(model_dir, "--prompt=Tell me about caches.", "--attn_impl=xla", "--compare_to=reference",
                          f"--output={out}"))
    [rec] = read_jsonl(out)
    assert (rec["family"], rec["under_test"], rec["reference"]) == ("attention", "xla", "reference")
    assert rec["pinned"]["matmul"] in ("xla", "auto")  # xla wherever auto would quantize activations (native)
    captured = capsys.readouterr()
    if rec["identical"]:
        assert "1: no divergence: the same 6 tokens" in captured.out
        assert rec["completion_under_test"] == rec["completion_reference"] != ""
    else:  # a near-tie flipped by float rounding: reported with its margin
        assert rec["divergence"]["reference"]["margin"] < 1e-2, rec
    assert "in both runs" in captured.err


def test_compare_to_reports_where_a_perturbed_attention_diverges(model_dir, tmp_path, monkeypatch, capsys):
    prompt_tokens, start = 30, 32  # the prompt's tokens under the chat template; wrong from position 32 on
    (tmp_path / "perturbed_attention.py").write_text(f"START = {start}\n" + PERTURBED)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "cmp.jsonl"
    run_main(*engine_args(model_dir, "--prompt=Tell me about caches.", "--attn_impl=perturbed_attention:attention",
                          "--compare_to=xla", f"--output={out}"))
    [rec] = read_jsonl(out)
    d = rec["divergence"]
    assert rec["prompt_tokens"] == prompt_tokens and not rec["identical"]
    # the logits at position 32 are the first wrong ones: they choose the token at position 33, generated token 3
    assert (d["index"], d["position"]) == (start - prompt_tokens + 1, start + 1)
    assert d["under_test"]["id"] != d["reference"]["id"] and d["reference"]["margin"] > 0
    assert d["reference"]["logit_gap"] >= d["reference"]["margin"]
    text = capsys.readouterr().out
    assert f"first divergent token at generated token {d['index']} (sequence position {d['position']})" in text
    assert f"{d['reference']['id']} {d['reference']['text']!r}" in text


@pytest.mark.parametrize("flags_, message", [
    (["--compare_to=flash"], "--compare_to=flash: not an attention implementation"),
    (["--compare_to=xla"], "--compare_to=xla: 'xla' is both an attention and a matmul implementation"),
    (["--compare_to=xla", "--attn_impl=reference", "--temperature=0.7"], "--compare_to compares greedy decoding"),
])
def test_compare_to_usage_errors_name_the_flag(model_dir, flags_, message):
    with flags_set(*engine_args(model_dir, "--prompt=Hi", *flags_)):
        with pytest.raises(app.UsageError, match=message):
            generate.main(["generate"])


# ------------------------------------------------------------------------------------------------ flags
@pytest.mark.parametrize("flag, message", [
    ("--top_p=0", "top_p must be a number in (0, 1]"),
    ("--temperature=-1", "temperature must be >= 0"),
    ("--min_p=1.5", "min_p must be a number in [0, 1)"),
    ("--repetition_penalty=0", "repetition_penalty must be a number >= 1e-30"),
    ("--cache_dtype=int4", "--cache_dtype must be one of ('float32', 'bfloat16', 'float16', 'int8'), got 'int4'"),
    ("--policy=lifo", "--policy=lifo is not one of"),
    ("--quant=int2", "--quant=int2 is not one of: none, keep, int8, int4"),
    ("--page_size=12", "--page_size must be a power of two, got 12"),
    ("--min_new_tokens=10", "--min_new_tokens must be in [0, --max_new_tokens]"),
    ("--max_batch_size=0", "--max_batch_size must be an int in [1, 2147483647], got 0"),
    ("--prompt=", "--prompt is empty"),
    ("--regex=a[", "RegexFilter: invalid regex"),
    ("--json_schema=/nonexistent.json", "--json_schema /nonexistent.json does not exist"),
])
def test_invalid_flags_give_a_clear_usage_error(model_dir, flag, message):
    with flags_set(*engine_args(model_dir, flag)):
        with pytest.raises(app.UsageError) as e:
            generate.main(["generate"])
    assert message in str(e.value)


def test_unreadable_files_and_a_directory_for_output_are_usage_errors(model_dir, tmp_path):
    """(They had been tracebacks: a UnicodeDecodeError, and an IsADirectoryError once the model had loaded.)"""
    latin1 = tmp_path / "schema.json"
    latin1.write_bytes(b'{"const": "caf\xe9"}')
    for flag, message in ((f"--json_schema={latin1}", f"--json_schema {latin1}: cannot read it as UTF-8 text"),
                          (f"--grammar={latin1}", f"--grammar {latin1}: cannot read it as UTF-8 text"),
                          (f"--output={tmp_path}", f"--output {tmp_path} is a directory")):
        with flags_set(*engine_args(model_dir, "--prompt=x", flag)):
            with pytest.raises(app.UsageError, match=re.escape(message)):
                generate.main(["generate"])


def test_filter_flags_constrain_every_job(model_dir, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                  "additionalProperties": False}))
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "o.jsonl"
    run_main(*engine_args(model_dir, f"--prompts_file={src}", f"--output={out}", f"--json_schema={schema}",
                          "--max_new_tokens=24", "--temperature=1.0", "--seed=3"))
    for rec in read_jsonl(out):
        if rec["eos_reason"] == "end_filter":
            assert isinstance(json.loads(rec["completion"])["n"], int)
        else:  # cut by max_new_tokens: a prefix of such an object
            assert rec["eos_reason"] == "max_new_tokens" and rec["completion"].lstrip().startswith("{")
    run_main(*engine_args(model_dir, "--prompt=x", f"--output={out}", "--regex=[0-9]{2}", "--max_new_tokens=8"))
    [rec] = read_jsonl(out)
    assert rec["eos_reason"] == "end_filter" and rec["completion"].isdigit() and len(rec["completion"]) == 2


def test_a_directory_as_the_prompts_file_is_named_as_one(model_dir, tmp_path):
    with pytest.raises(app.UsageError, match=r"--prompts_file .* is a directory; give a JSONL file"):
        run_main(*engine_args(model_dir, f"--prompts_file={tmp_path}"))


def test_system_flag_and_a_line_whose_messages_start_with_a_system_message_conflict(model_dir, tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                             {"messages": [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hi"}]}])
    with pytest.raises(generate.PromptsFileError, match=r"s\.jsonl:2: --system given but \"messages\" already starts "
                                                        r"with a system message") as e:
        run_main(*engine_args(model_dir, f"--prompts_file={src}", "--system=flag"))
    assert "s.jsonl:1" not in str(e.value)


def test_warmup_shows_its_progress_bar_only_with_progress(model_dir, monkeypatch):
    from paged import DynamicGenerator

    asked = []
    monkeypatch.setattr(DynamicGenerator, "warmup", lambda self, progress=False: asked.append(progress) or 0)
    run_main(*engine_args(model_dir, "--prompt=x", "--max_new_tokens=1", "--warmup", "--noprogress"))
    run_main(*engine_args(model_dir, "--prompt=x", "--max_new_tokens=1", "--warmup"))
    assert asked == [False, True]


@pytest.mark.parametrize("bad, message", [
    (("--draft_model=self:abc",), r"'self:N' takes a layer count >= 1"),
    (("--draft_model=self:0",), r"'self:N' takes a layer count >= 1"),
    (("--ngram_corpus=table.npz",), "add --ngram_draft"),
    (("--ngram_draft", "--draft_model=self:1"), "choose one drafter"),
    (("--adaptive_draft",), "need --ngram_draft or --draft_model"),
    (("--mirostat", "--temperature=0.8", "--ngram_draft"), "mirostat with a drafter: .* never speculate"),
    (("--mirostat", "--temperature=0.8", "--draft_model=self:1"), "mirostat with a drafter"),
    (("--negative_prompt=no", "--cfg_scale=1.5", "--ngram_draft"), "negative_prompt with a drafter: .* never "
                                                                    "speculates"),
])
def test_drafter_flags_are_checked_before_the_model_loads(model_dir, monkeypatch, bad, message):
    monkeypatch.setattr(generate, "load_model_from_flags", lambda: pytest.fail("the model was loaded"))
    with pytest.raises(app.UsageError, match=message):
        run_main(*engine_args(model_dir, "--prompt=x", *bad))


def test_mirostat_with_a_drafter_is_refused_only_where_every_job_samples_with_it(model_dir, tmp_path, monkeypatch):
    """Greedy jobs ignore mirostat and speculate; a prompts-file line at temperature 0 is such a job."""
    class Loading(Exception):
        pass

    monkeypatch.setattr(generate, "load_model_from_flags", lambda: (_ for _ in ()).throw(Loading()))
    with pytest.raises(Loading):  # past the check: greedy
        run_main(*engine_args(model_dir, "--prompt=x", "--mirostat", "--temperature=0", "--ngram_draft"))
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"prompt": "b", "temperature": 0}])
    with pytest.raises(Loading):
        run_main(*engine_args(model_dir, f"--prompts_file={mixed}", "--mirostat", "--temperature=0.8",
                              "--ngram_draft"))
    sampled = write_jsonl(tmp_path / "sampled.jsonl", [{"prompt": "a"}, {"prompt": "b", "temperature": 0.5}])
    with pytest.raises(app.UsageError, match="mirostat with a drafter"):
        run_main(*engine_args(model_dir, f"--prompts_file={sampled}", "--mirostat", "--temperature=0.8",
                              "--ngram_draft"))


def test_prompt_and_prompts_file_conflict(model_dir, tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(app.UsageError, match="either --prompt or --prompts_file"):
        run_main(*engine_args(model_dir, "--prompt=hi", f"--prompts_file={src}"))


# ------------------------------------------------------------------------------------------------ summary
def test_summarise_figures():
    recs = [dict(ttft_s=t, decode_tok_s=d, prompt_tokens=p, new_tokens=n, cached_tokens=c)
            for t, d, p, n, c in [(1.0, 10.0, 40, 5, 0), (2.0, 20.0, 40, 5, 32), (3.0, None, 20, 1, 16),
                                  (10.0, 30.0, 100, 9, 0)]]
    s = generate.summarise(recs, {"prefix_hits": 6, "prefix_queries": 12, "prefix_hit_rate": 0.5, "steps": 8},
                           wall_s=4.0, weight_bytes=10**9)
    assert s["weights_gb_s"] == pytest.approx(2.0)  # 8 steps x 1 GB / 4 s
    assert s["jobs"] == 4 and s["prompt_tokens"] == 200 and s["generated_tokens"] == 20
    assert s["cached_tokens"] == 48 and s["cached_fraction"] == pytest.approx(0.24)
    assert s["ttft_mean_s"] == pytest.approx(4.0) and s["ttft_median_s"] == pytest.approx(2.5)
    assert s["ttft_p90_s"] == pytest.approx(7.9)
    assert s["decode_tok_s_mean"] == pytest.approx(20.0) and s["output_tok_s"] == pytest.approx(5.0)
    table = generate.format_summary(s)
    assert "48 (24.0% of prompt tokens)" in table and "6 / 12 (50.0%)" in table
    assert "4.000 / 2.500 / 7.900 s\n" in table and "compilation" not in table
    cold = generate.format_summary(s, compiled=False)  # without --warmup the times include compiling
    assert "4.000 / 2.500 / 7.900 s (includes compilation; --warmup compiles first)" in cold
    assert cold.count("(includes compilation") == 4 and "2 GB/s (includes compilation" in cold  # the weights row too
    assert "2 GB/s\n" in table
    assert "finished or not" not in table
    # interrupted: the records are the finished jobs, the generator's prefix and draft counts every admitted job's
    counts = {"prefix_hits": 6, "prefix_queries": 12, "prefix_hit_rate": 0.5, "drafted_tokens": 9,
              "acceptance_rate": 0.5}
    cut = generate.format_summary(generate.summarise(recs[:3], counts, wall_s=4.0, total=4))
    assert "3 of 4 (interrupted)" in cut and "6 / 12 (50.0%) (every admitted job, finished or not)" in cut
    assert "of 9 drafts (every admitted job, finished or not)" in cut


def test_full_sampler_flags_reach_the_settings(model_dir, tmp_path, chunks):
    import dataclasses

    from paged import SamplingSettings

    defaults = {f.name: f.default for f in dataclasses.fields(SamplingSettings)}
    assert {k: d for k, (d, _) in generate.FULL_SAMPLER_FLAGS.items()} == {
        k: defaults[k] for k in generate.FULL_SAMPLER_FLAGS}  # the flags' defaults are the settings' (all off)
    args = ["--dry_multiplier=0.8", "--dry_range=64", "--xtc_probability=0.5", "--mirostat", "--mirostat_tau=4",
            "--tfs=0.9", "--top_a=0.1", "--min_temp=0.5", "--max_temp=1.5", "--temperature_last", "--skew=0.2",
            "--smoothing_factor=0.3", "--penalty_decay=16", "--temperature=0.9"]
    with flags_set(*engine_args(model_dir, *args)):
        s = generate.build_settings()
    assert (s.dry_multiplier, s.dry_range, s.xtc_probability, s.mirostat, s.mirostat_tau, s.tfs, s.top_a) == (
        0.8, 64, 0.5, True, 4.0, 0.9, 0.1)
    assert (s.min_temp, s.max_temp, s.temperature_last, s.skew, s.smoothing_factor, s.penalty_decay) == (
        0.5, 1.5, True, 0.2, 0.3, 16)
    out = tmp_path / "o.jsonl"
    run_main(*engine_args(model_dir, *args, "--prompt=Say hello twice.", f"--output={out}"))
    [rec] = read_jsonl(out)
    assert rec["new_tokens"] > 0 and "".join(chunks) == rec["completion"]
    with flags_set(*engine_args(model_dir, "--dry_range=5")):
        with pytest.raises(app.UsageError, match="dry_range"):
            generate.main(["generate"])


def test_negative_prompt_flags_guide_every_job(model_dir, tmp_path, chunks):
    out = tmp_path / "o.jsonl"
    greedy = ("--temperature=0", "--prompt=Tell me about octopuses.", f"--output={out}")
    run_main(*engine_args(model_dir, *greedy))
    [plain] = read_jsonl(out)
    run_main(*engine_args(model_dir, *greedy, "--negative_prompt=Be rude.", "--cfg_scale=1"))
    [same] = read_jsonl(out)  # scale 1: the prompt alone
    assert same["completion"] == plain["completion"] and same["new_tokens"] == 6
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    run_main(*engine_args(model_dir, f"--prompts_file={src}", f"--output={out}", "--negative_prompt=Be rude.",
                          "--cfg_scale=3"))
    assert [r["new_tokens"] for r in read_jsonl(out)] == [6, 6]
    with flags_set(*engine_args(model_dir, "--temperature=0", "--negative_prompt=Be rude.", "--cfg_scale=3")):
        tok = generate.load_model_from_flags().tokenizer
        req = generate.encode_request(tok, generate.single_request("hi"))
        job = generate.make_job(tok, req)
    assert job.negative_ids == req.negative_ids and job.gen_settings.cfg_scale == 3.0
    assert "Be rude." in tok.decode(job.negative_ids) and "hi" in tok.decode(job.input_ids)
    for bad in (("--negative_prompt=x",), ("--cfg_scale=2",), ("--negative_prompt= ", "--cfg_scale=2")):
        with flags_set(*engine_args(model_dir, *bad)):
            with pytest.raises(app.UsageError, match="negative_prompt"):
                generate.main(["generate"])


@pytest.mark.slow
def test_lora_flag_applies_the_adapter_to_every_job(model_dir, tmp_path, chunks):
    import numpy as np

    from models.lora import projection_shapes, save_lora

    with flags_set(*engine_args(model_dir)):
        cfg = generate.load_model_from_flags().config
    rng = np.random.default_rng(0)
    shapes = projection_shapes(cfg)
    a = {(layer, p): rng.normal(0, 0.5, (24, shapes[p][0])) for layer in range(cfg.num_layers) for p in ("q", "down")}
    b = {k: rng.normal(0, 0.5, (shapes[k[1]][1], 24)) for k in a}
    save_lora(tmp_path / "adapter", cfg, a, b, r=24, lora_alpha=48)  # rank 24 > the default max_lora_rank 16
    out = tmp_path / "o.jsonl"
    greedy = ("--temperature=0", "--prompt=Tell me about octopuses.", f"--output={out}")
    run_main(*engine_args(model_dir, *greedy))
    [plain] = read_jsonl(out)
    run_main(*engine_args(model_dir, *greedy, f"--lora={tmp_path / 'adapter'}"))
    [adapted] = read_jsonl(out)
    assert adapted["new_tokens"] == 6 and adapted["completion"] != plain["completion"]
    with flags_set(*engine_args(model_dir, f"--lora={tmp_path / 'adapter'}")):
        model = generate.load_model_from_flags()
        gen = generate.build_generator(model)
        job = generate.make_job(model.tokenizer, generate.encode_request(model.tokenizer,
                                                                         generate.single_request("hi")))
    assert set(gen.loras) == {generate.LORA_NAME} and job.lora == generate.LORA_NAME
    with flags_set(*engine_args(model_dir, f"--lora={tmp_path / 'nope'}")):
        with pytest.raises(app.UsageError, match="is not a directory"):
            generate.main(["generate"])


@pytest.mark.slow
def test_speculation_flags_reach_the_generator(model_dir, tmp_path, capsys, chunks):
    """--ngram_draft / --draft_model self:N with --adaptive_draft and --draft_token_cost: the greedy output is the
    plain one, the summary reports the drafts, and misuse is a usage error."""
    out = tmp_path / "o.jsonl"
    greedy = ("--temperature=0", "--prompt=hello hello hello hello", f"--output={out}", "--max_new_tokens=12")
    run_main(*engine_args(model_dir, *greedy))
    [plain] = read_jsonl(out)
    for extra in (("--ngram_draft",), ("--ngram_draft", "--adaptive_draft", "--draft_token_cost=0"),
                  ("--draft_model=self:1", "--adaptive_draft")):
        run_main(*engine_args(model_dir, *greedy, *extra))
        [spec] = read_jsonl(out)
        assert spec["completion"] == plain["completion"], extra
    with flags_set(*engine_args(model_dir, "--ngram_draft", "--adaptive_draft", "--draft_token_cost=0.3")):
        kw = generate.speculation_kwargs(generate.load_model_from_flags())
    assert kw == dict(use_ngram_draft=True, max_ngram=4, num_draft_tokens=4, adaptive_draft=True,
                      draft_token_cost=0.3)
    # sampled and seeded: sample-then-match emits plain sampling's tokens (rejection sampling would draw others)
    sampled = ("--temperature=0.9", "--seed=3", "--prompt=hello hello hello hello", f"--output={out}",
               "--max_new_tokens=12")
    run_main(*engine_args(model_dir, *sampled))
    [plain_sampled] = read_jsonl(out)
    run_main(*engine_args(model_dir, *sampled, "--draft_model=self:1", "--draft_acceptance=match"))
    [matched] = read_jsonl(out)
    assert matched["completion"] == plain_sampled["completion"]
    with flags_set(*engine_args(model_dir, "--draft_model=self:1", "--draft_acceptance=match")):
        kw = generate.speculation_kwargs(generate.load_model_from_flags())
    assert kw["draft_acceptance"] == "match" and kw["num_draft_tokens"] == 4
    assert "steps not verified (adaptive)" in generate.speculation_line(
        dict(drafted_tokens=8, accepted_draft_tokens=2, acceptance_rate=0.25, mean_accepted_length=1.5,
             gated_steps=3))
    for bad, message in ((("--adaptive_draft",), "need --ngram_draft or --draft_model"),
                         (("--ngram_draft", "--draft_token_cost=0.2"), "applies to --adaptive_draft only"),
                         (("--draft_acceptance=match",), "need --ngram_draft or --draft_model")):
        with flags_set(*engine_args(model_dir, "--prompt=x", *bad)):
            with pytest.raises(app.UsageError, match=message):
                generate.main(["generate"])


@pytest.mark.slow
def test_several_processes_run_the_same_jobs_and_process_0_alone_writes(model_dir, tmp_path):
    """`--num_processes 2` on localhost (2 virtual CPU devices each, one `dp=2,tp=2` mesh over both): process 0 writes
    the records a single process writes; process 1 prints nothing."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Tell me about octopuses."}, {"prompt": "Hi there"}])
    single = tmp_path / "single.jsonl"
    run_main(*engine_args(model_dir, f"--prompts_file={prompts}", f"--output={single}", "--temperature=0"))
    out = tmp_path / "multi.jsonl"
    outs = _two_processes(model_dir, f"--prompts_file={prompts}", f"--output={out}")
    assert [rc for rc, _, _ in outs] == [0, 0], outs[0][2][-2000:] + outs[1][2][-2000:]
    assert [r["completion"] for r in read_jsonl(out)] == [r["completion"] for r in read_jsonl(single)]
    assert "[wrote" in outs[0][2] and "tok/s" in outs[0][2]
    assert outs[1][1] == "" and "[wrote" not in outs[1][2] and "tok/s" not in outs[1][2]  # process 1 is silent
    assert "[Gloo]" not in outs[0][1]  # the collectives' notices do not mix with what process 0 prints


def test_speculation_line_and_summary_show_gated_steps_and_count_since_a_reset():
    """The adaptive gate's skipped steps are shown even where it skipped every step (nothing drafted), in the line
    and the bulk summary; `since` (a chat /reset) leaves the earlier conversation's counts out."""
    line = generate.speculation_line
    assert line(dict(drafted_tokens=0, accepted_draft_tokens=0, gated_steps=0)) is None  # no drafter at work
    assert line(dict(drafted_tokens=0, accepted_draft_tokens=0, gated_steps=7)) == (
        "[speculative: nothing drafted, 7 steps not verified (adaptive)]")
    # the mean from the generator's own emitted counts (mean x rows: 2.25 x 4 = 9 before, 15 after; a job that
    # ended among its accepted drafts emitted fewer than 1 + accepted)
    before = dict(drafted_tokens=11, accepted_draft_tokens=5, verification_rows=4, gated_steps=0,
                  mean_accepted_length=2.25)
    after = dict(drafted_tokens=15, accepted_draft_tokens=8, verification_rows=6, gated_steps=2,
                 acceptance_rate=8 / 15, mean_accepted_length=2.5)
    assert line(after, before) == ("[speculative: 3 / 4 drafts accepted (75.0%), mean accepted length 3.00 tokens "
                                   "per verification, 2 steps not verified (adaptive)]")
    assert line(after).startswith("[speculative: 8 / 15 drafts accepted (53.3%)")
    recs = [dict(ttft_s=1.0, decode_tok_s=10.0, prompt_tokens=4, new_tokens=5, cached_tokens=0)]
    gated_only = generate.format_summary(generate.summarise(recs, {"gated_steps": 9}, wall_s=1.0))
    assert re.search(r"steps not verified \(adaptive\) +9\n", gated_only) and "draft acceptance" not in gated_only
    both = generate.format_summary(generate.summarise(recs, {"drafted_tokens": 4, "accepted_draft_tokens": 2,
                                                             "acceptance_rate": 0.5, "mean_accepted_length": 1.5,
                                                             "gated_steps": 3}, wall_s=1.0))
    assert "50.0% of 4 drafts" in both and re.search(r"steps not verified \(adaptive\) +3\n", both)
    plain = generate.format_summary(generate.summarise(recs, {}, wall_s=1.0))
    assert "adaptive" not in plain and "draft" not in plain


def _two_processes(model_dir, *extra: str) -> list[tuple[int, str, str]]:
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = script_env()
    procs = [subprocess.Popen([sys.executable, "-m", "experiments.generate", *engine_args(
        model_dir, "--temperature=0", "--mesh=dp=2,tp=2", "--num_processes=2", f"--process_id={i}",
        f"--coordinator_address=localhost:{port}", "--cpu_devices_per_process=2", "--noprogress", *extra)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
        for i in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate()
        outs.append((p.returncode, out, err))
    return outs


def test_a_bad_flag_stops_every_process_and_each_says_why(model_dir, tmp_path):
    """Every process validates the flags (so none waits for the others in a collective), and a silenced process's
    error still reaches its own stderr."""
    outs = _two_processes(model_dir, "--prompt=Hi", f"--output={tmp_path}/missing/out.jsonl")
    for rc, _, err in outs:
        assert rc == 1 and "error: --output" in err and "does not exist" in err


def test_multi_process_flags_are_checked(model_dir):
    for extra, message in ((["--num_processes=2", "--process_id=2"], "--process_id must be in"),
                           (["--num_processes=2", "--mesh=tp=2"], "--coordinator_address"),
                           (["--num_processes=2", "--coordinator_address=localhost:1"], "needs --mesh"),
                           (["--num_processes=2", "--coordinator_address=localhost:1", "--mesh=tp=2"],
                            "give --prompt or --prompts_file"),
                           (["--num_processes=2", "--coordinator_address=localhost:1", "--mesh=tp=2", "--prompt=Hi",
                             "--policy=lpm"], "does not read the wall clock")):
        with flags_set(*engine_args(model_dir, *extra)), pytest.raises(app.UsageError, match=message):
            generate.validate_flags()


def test_jobs_stop_at_every_end_token_of_the_model(model_dir, tmp_path):
    """config.json's eos_token_id list (Llama 3.1's <|eom_id|> is only there) stops a job as the tokenizer's EOS
    does."""
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [3, 7]}))
    with flags_set(*engine_args(d)):
        model = generate.load_model_from_flags()
        assert model.tokenizer.eos_token_id == 3
        assert generate.stop_conditions(model.tokenizer, ["##"]) == [3, 7, "##"]
        job = generate.make_job(model.tokenizer, generate.encode_request(model.tokenizer,
                                                                        generate.single_request("hi")))
        assert job.stop_tokens == {3, 7}
