"""`python -m experiments.serve`'s flags are checked before the model loads (`check_flags`): a bad port, host or chat
template file is an app.UsageError naming the flag, not a traceback (or a server on another port) after loading."""

from __future__ import annotations

import re

import pytest
from absl import app, flags
from absl.testing import flagsaver

from experiments import serve
from paged.server.translate import SIMPLE_CHAT_TEMPLATE

FLAGS = flags.FLAGS


def check(*args: str):
    with flagsaver.flagsaver():
        FLAGS.unparse_flags()
        FLAGS(["serve", "--model=tiny", *args])
        return serve.check_flags()


@pytest.mark.parametrize("flag, message", [
    ("--port=70000", "--port must be in [1, 65535], got 70000"),  # (had listened on 70000 mod 65536)
    ("--port=-5", "--port must be in [1, 65535], got -5"),  # (had failed once the model had loaded)
    ("--host=999.1.1.1", "--host 999.1.1.1: not an IPv4 address"),  # (refused without a lookup)
    ("--chat_template=/nonexistent.jinja", "--chat_template /nonexistent.jinja: cannot read it"),
    ("--max_queue=0", "--max_queue must be >= 1, got 0"),
])
def test_bad_flags_are_usage_errors_before_loading(flag, message):
    with pytest.raises(app.UsageError, match=re.escape(message)):
        check(flag)


def test_a_directory_or_non_utf8_file_as_chat_template(tmp_path):
    with pytest.raises(app.UsageError, match=re.escape(f"--chat_template {tmp_path}: cannot read it")):
        check(f"--chat_template={tmp_path}")
    latin1 = tmp_path / "t.jinja"
    latin1.write_bytes(b"caf\xe9 {{ messages }}")
    with pytest.raises(app.UsageError, match="cannot read it"):
        check(f"--chat_template={latin1}")
    good = tmp_path / "good.jinja"
    good.write_text("{{ messages }}")
    assert check(f"--chat_template={good}") == "{{ messages }}"
    assert check("--port=8000", "--host=localhost") == SIMPLE_CHAT_TEMPLATE  # the tiny model's default


def test_lora_adapters_are_checked_before_loading(tmp_path):
    """--lora_adapter had been read only after the model loaded (minutes, for a large one)."""
    d = tmp_path / "a"
    d.mkdir()
    cases = [
        (("--lora_adapter=foo",), "--lora_adapter 'foo': expected NAME=PATH"),
        ((f"--lora_adapter=a={tmp_path}/missing", "--max_loras=1"), "is not a directory"),
        ((f"--lora_adapter=a={d}",), "1 adapter(s) need --max_loras >= 1, got 0"),
        ((f"--lora_adapter=a={d}", f"--lora_adapter=a={d}", "--max_loras=2"), "the name 'a' is given twice"),
        ((f"--lora_adapter=tiny={d}", "--max_loras=1"), "'tiny' is the served model's name"),
    ]
    for args, message in cases:
        with pytest.raises(app.UsageError, match=re.escape(message)):
            check(*args)
    check(f"--lora_adapter=a={d}", "--max_loras=1")
    check(f"--lora_adapter=tiny={d}", "--max_loras=1", "--served_model_name=base")
