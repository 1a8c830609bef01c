"""One `Tokenizer` class over three backends: a Hugging Face `tokenizer.json`, a sentencepiece `.model`, or the
vocabulary stored in GGUF metadata (rebuilt with the `tokenizers` library).

The rest of the framework only sees the common API: `encode`, `decode`, `id_to_piece`, `token_bytes` and
`apply_chat_template`. Special-token handling follows ExLlamaV2: by default, text such as ``"<|im_start|>"`` is
encoded as ordinary text, and special tokens decode to ``""``; both are opt-in per call.

GGUF pre-tokenizers (`tokenizer.ggml.pre`) follow llama.cpp. A name not in `GGUF_PRE_TOKENIZERS` falls back to the
GPT-2 split with a warning: most byte-level vocabularies still tokenize plain prose the same way, but digits,
contractions and runs of whitespace may split differently from the model's reference tokenizer.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import numbers
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

from models.errors import (
    InvalidPromptError,
    InvalidPromptTypeError,
    ModelFileNotFoundError,
    TokenizerError,
    TokenizerLoadError,
    raise_with_source,
)

logger = logging.getLogger(__name__)

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Split regexes used by llama.cpp for the `tokenizer.ggml.pre` families supported here.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(*regexes: str) -> pre_tokenizers.PreTokenizer:
    """Apply each split regex in turn (as llama.cpp does), then map bytes to the GPT-2 alphabet."""
    steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


# `tokenizer.ggml.pre` -> (pre-tokenizer factory, ignore_merges). ignore_merges: a whole pre-token that is itself in
# the vocabulary is emitted as one token without running merges (llama.cpp does this for the llama3 family).
_GPT2_PRE = (lambda: _split_then_bytes(_GPT2_SPLIT), False)
_LLAMA3_PRE = (lambda: _split_then_bytes(_LLAMA3_SPLIT), True)
# SmolLM / StarCoder: every digit is its own pre-token, then the GPT-2 split (HF's Digits(individual_digits=True)).
_DIGITS_GPT2_PRE = (lambda: _split_then_bytes(r"\p{N}", _GPT2_SPLIT), False)
_QWEN2_PRE = (lambda: _split_then_bytes(_QWEN2_SPLIT), False)
GGUF_PRE_TOKENIZERS: dict[str, tuple[Callable[[], pre_tokenizers.PreTokenizer], bool]] = {
    "default": _GPT2_PRE,
    "gpt2": _GPT2_PRE,
    "gpt-2": _GPT2_PRE,
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "llama-bpe": _LLAMA3_PRE,
    "falcon3": _LLAMA3_PRE,
    "pixtral": _LLAMA3_PRE,
    "dbrx": _LLAMA3_PRE,
    "smaug-bpe": _LLAMA3_PRE,
    "smollm": _DIGITS_GPT2_PRE,
    "starcoder": _DIGITS_GPT2_PRE,
    "refact": _DIGITS_GPT2_PRE,
    "codeshell": _DIGITS_GPT2_PRE,
    "qwen2": _QWEN2_PRE,
    "deepseek-r1-qwen": _QWEN2_PRE,
}

_BYTE_TOKEN_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SP_SPACE = "\u2581"  # sentencepiece's visible space, '▁'


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2 byte-level alphabet, char -> byte: printable Latin-1 bytes stand for themselves, the other 68 bytes are
    shifted to code points 256.. so every byte has a visible, non-whitespace character."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[str, int] = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def _byte_level_bytes(token: str) -> bytes:
    """Raw bytes of a byte-level token; a token with characters outside the alphabet (an added token written as
    plain text) contributes its UTF-8, matching the `tokenizers` ByteLevel decoder."""
    alphabet = _byte_alphabet()
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _sentencepiece_bytes(piece: str) -> bytes:
    """Raw bytes of a sentencepiece-style piece: '▁' is a space and `<0xNN>` is the byte NN."""
    m = _BYTE_TOKEN_RE.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace(_SP_SPACE, " ").encode("utf-8")


# --------------------------------------------------------------------------------------------------------------------
# Backends: each implements encode/decode over plain text and a raw piece per id; `Tokenizer` adds everything else.


class _HFBackend:
    """A `tokenizers.Tokenizer`. `piece_kind` says how a vocabulary string maps to bytes: "byte_level",
    "sentencepiece" (▁ and <0xNN>), or "other" (fall back to decoding the single id)."""

    def __init__(self, tok: tokenizers.Tokenizer, piece_kind: str, vocab_size: int | None = None) -> None:
        self.tok = tok
        self.tok.encode_special_tokens = True  # `tokenizers` naming: True = special strings are NOT split out
        self._splitting: tokenizers.Tokenizer | None = None  # copy that splits specials, built on first use
        self.piece_kind = piece_kind
        if vocab_size is None:  # the highest id + 1: a vocabulary with gaps in its ids counts fewer entries than that
            ids = tok.get_vocab(with_added_tokens=True).values()
            vocab_size = max(max(ids, default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))
        self.vocab_size = vocab_size
        added = tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)

    def encode(self, text: str, split_special: bool) -> list[int]:
        tok = self.tok
        if split_special:
            # A second instance instead of toggling the flag per call, so concurrent encodes never race on it.
            if self._splitting is None:
                self._splitting = tokenizers.Tokenizer.from_str(self.tok.to_str())
                self._splitting.encode_special_tokens = False
            tok = self._splitting
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def piece(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id) or ""

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def raw_bytes(self, token_id: int) -> bytes:
        # Added (non-special) tokens go through the same mapping: `tokenizers` runs them through the decoder too.
        piece = self.piece(token_id)
        if self.piece_kind == "byte_level":
            return _byte_level_bytes(piece)
        if self.piece_kind == "sentencepiece":
            return _sentencepiece_bytes(piece)
        return self.tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


class _SPBackend:
    """A `sentencepiece.SentencePieceProcessor`; it never matches control symbols in text, so special strings are
    split out here when asked."""

    def __init__(self, sp: Any) -> None:
        self.sp = sp
        self.vocab_size = sp.get_piece_size()
        self.special_ids = frozenset(i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i))
        texts = sorted((sp.id_to_piece(i) for i in self.special_ids), key=len, reverse=True)
        self._special_by_text = {sp.id_to_piece(i): i for i in self.special_ids}
        self._special_re = re.compile("|".join(re.escape(t) for t in texts)) if texts else None

    def encode(self, text: str, split_special: bool) -> list[int]:
        if not split_special or self._special_re is None:
            return list(self.sp.encode(text))
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                ids.extend(self.sp.encode(text[pos : m.start()]))
            ids.append(self._special_by_text[m.group(0)])
            pos = m.end()
        if pos < len(text):
            ids.extend(self.sp.encode(text[pos:]))
        return ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        # sentencepiece renders control ids as "" and unk as " ⁇ "; decode runs of ordinary ids and splice specials.
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.special_ids:
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                if not skip_special:
                    out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)

    def piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        # piece_to_id answers unk_id for unknown strings; only trust it when the piece really is that string.
        return i if self.sp.id_to_piece(i) == token else None

    def raw_bytes(self, token_id: int) -> bytes:
        if self.sp.is_byte(token_id):
            return _sentencepiece_bytes(self.sp.id_to_piece(token_id))
        return self.sp.id_to_piece(token_id).replace(_SP_SPACE, " ").encode("utf-8")


# --------------------------------------------------------------------------------------------------------------------
# Chat templates


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (HF's marker for assistant spans) and render its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"Chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own `tojson` HTML-escapes '<', '>' and '&', which would corrupt prompts; templates expect plain JSON.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _parse_chat_template(source: str) -> jinja2.Template:
    """The compiled template; jinja2.TemplateSyntaxError when it does not parse."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTagExtension],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _compile_chat_template(source: str) -> jinja2.Template:
    try:
        return _parse_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"The chat template does not parse (line {e.lineno}: {e.message}); fix it or pass a "
                             "different one with `chat_template=`") from e


def _check_checkpoint_template(source: str | None, where: str) -> None:
    """Compile a checkpoint's chat template at load, so a broken one fails now, naming the file it came from."""
    if source is None:
        return
    try:
        _parse_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerLoadError(
            f"{where}: the chat template does not parse (line {e.lineno}: {e.message}); fix or delete it, or load "
            "the model with load_tokenizer=False"
        ) from e


# --------------------------------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model, whatever file the vocabulary came from.

    Build with `from_tokenizer_json`, `from_sentencepiece`, `from_gguf_metadata` or `load_tokenizer_from_dir`.
    `chat_template` is a plain attribute: assign to it to override the checkpoint's template.
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    special_token_ids: frozenset[int]
    chat_template: str | None
    add_bos_token: bool  # whether the checkpoint expects a BOS token on prompts (callers pass it as `add_bos`)

    def __init__(
        self,
        backend: _HFBackend | _SPBackend,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        special_token_ids: frozenset[int] | None = None,
    ) -> None:
        self._backend = backend
        self.vocab_size = backend.vocab_size
        for name, value in (("bos", bos_token_id), ("eos", eos_token_id), ("pad", pad_token_id)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise TokenizerLoadError(
                    f"{name}_token_id {value} is outside the vocabulary (size {self.vocab_size})")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.special_token_ids = special_token_ids if special_token_ids is not None else backend.special_ids
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._bytes_cache: dict[int, bytes] = {}

    def __repr__(self) -> str:
        kind = type(self._backend).__name__.strip("_").removesuffix("Backend")
        return (f"Tokenizer({kind}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")

    # ---- encode / decode ----------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool = False, encode_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in the text are ordinary text unless `encode_special_tokens`.

        A non-str `text` raises InvalidPromptTypeError (a TypeError); a lone surrogate code point (e.g. from
        decoding bytes with errors="surrogateescape") raises InvalidPromptError giving its character index."""
        _check_text(text)
        ids = self._backend.encode(text, encode_special_tokens)
        if add_bos:
            if self.bos_token_id is None:
                raise TokenizerError("add_bos=True but this tokenizer has no BOS token; pass add_bos=False")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, decode_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens render as "" unless `decode_special_tokens`."""
        ids = self._check_ids(ids)
        return self._backend.decode(ids, not decode_special_tokens)

    def id_to_piece(self, token_id: int, *, decode_special_tokens: bool = False) -> str:
        """Text of one token. Unlike `decode([token_id])`, a leading space is kept (a sentencepiece decoder drops it at
        the start of the text), so concatenating pieces reproduces the decoded sequence; an incomplete UTF-8
        sequence shows as U+FFFD."""
        token_id = self._check_ids([token_id])[0]
        if token_id in self.special_token_ids:
            return self._backend.piece(token_id) if decode_special_tokens else ""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes this token contributes to the decoded text; a special token gives its text as UTF-8."""
        token_id = self._check_ids([token_id])[0]
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            if token_id in self.special_token_ids:
                cached = self._backend.piece(token_id).encode("utf-8")
            else:
                cached = self._backend.raw_bytes(token_id)
            self._bytes_cache[token_id] = cached
        return cached

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled exactly `token` (e.g. "<|im_end|>"), or None."""
        return self._backend.token_to_id(token)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = []
        for i in ids:
            try:
                j = int(i)  # accepts numpy / jax integer scalars
            except (TypeError, ValueError) as e:
                raise TokenizerError(f"Token ids must be integers, got {i!r}") from e
            if not 0 <= j < self.vocab_size:
                raise TokenizerError(f"Token id {j} is out of range for a vocabulary of {self.vocab_size} tokens")
            out.append(j)
        return out

    # ---- chat template ------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render `messages` with the chat template (`chat_template=` overrides the checkpoint's for this call).

        Extra keyword arguments (e.g. `tools`, `enable_thinking`) become template variables.
        """
        source = chat_template if chat_template is not None else self.chat_template
        if not source:
            raise TokenizerError(
                "This checkpoint has no chat template; pass one with `chat_template=` (to apply_chat_template or "
                "by setting `tokenizer.chat_template`), or format the prompt yourself"
            )
        template = _compile_chat_template(source)
        variables: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
            "pad_token": self._token_text(self.pad_token_id),
        }
        variables.update(extra)
        try:
            return template.render(**variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"The chat template failed to render: {e}") from e

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._backend.piece(token_id)

    # ---- constructors -------------------------------------------------------------------------------------------

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike, *, tokenizer_config: dict | None = None) -> Tokenizer:
        """A Hugging Face `tokenizer.json`; `tokenizer_config` (the parsed tokenizer_config.json) supplies the
        bos/eos/pad token strings, `chat_template` and `add_bos_token`. A corrupt file raises TokenizerLoadError."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelFileNotFoundError(f"Tokenizer file {path} not found; pass the path of a tokenizer.json, or a "
                                         "model directory to load_tokenizer_from_dir")
        config = _check_config(tokenizer_config or {})
        try:
            tok = tokenizers.Tokenizer.from_file(path)
            backend = _HFBackend(tok, _hf_piece_kind(tok))
        except BaseException as e:
            if not _is_library_error(e):
                raise
            raise TokenizerLoadError(f"{path} is not a valid tokenizer.json ({e}); re-download or re-save it with "
                                     "`tokenizers`/`transformers`") from e
        bos = _config_token_id(config, "bos_token", backend, path)
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # Llama-3-style checkpoints omit the flag and let the post-processor prepend BOS.
            add_bos = bos is not None and _post_processor_adds(tok, backend.piece(bos))
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=_config_token_id(config, "eos_token", backend, path),
            pad_token_id=_config_token_id(config, "pad_token", backend, path, required=False),
            chat_template=_config_chat_template(config),
            add_bos_token=bool(add_bos),
        )

    @classmethod
    def from_sentencepiece(cls, path: str | os.PathLike, *, tokenizer_config: dict | None = None) -> Tokenizer:
        """A sentencepiece `tokenizer.model`. BOS/EOS/PAD come from the model unless `tokenizer_config` names them.
        A corrupt file raises TokenizerLoadError."""
        import sentencepiece

        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.model")
        if not os.path.isfile(path):
            raise ModelFileNotFoundError(f"Sentencepiece model {path} not found; pass the path of a tokenizer.model")
        config = _check_config(tokenizer_config or {})
        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.load(path)
            # Reading every piece also catches a model whose pieces are not valid UTF-8.
            backend = _SPBackend(sp)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with an internal message
            raise TokenizerLoadError(f"{path} is not a valid sentencepiece model ({e}); re-download it") from e

        def model_id(i: int) -> int | None:
            return i if i >= 0 else None

        bos = _config_token_id(config, "bos_token", backend, path)
        eos = _config_token_id(config, "eos_token", backend, path)
        pad = _config_token_id(config, "pad_token", backend, path, required=False)
        return cls(
            backend,
            bos_token_id=bos if "bos_token" in config else model_id(sp.bos_id()),
            eos_token_id=eos if "eos_token" in config else model_id(sp.eos_id()),
            pad_token_id=pad if "pad_token" in config else model_id(sp.pad_id()),
            chat_template=_config_chat_template(config),
            # sentencepiece checkpoints (Llama 2, Mistral) prepend BOS unless the config says otherwise.
            add_bos_token=bool(config.get("add_bos_token", True)),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], *, source: str | None = None) -> Tokenizer:
        """The tokenizer described by GGUF metadata (plain Python values keyed by llama.cpp names).

        `tokenizer.ggml.model` "gpt2" is byte-level BPE with the pre-tokenizer named by `tokenizer.ggml.pre`;
        "llama" is a sentencepiece-style vocabulary, tokenized like llama.cpp by merging the highest-scoring pair.
        Missing, mistyped or inconsistent tokenizer metadata raises TokenizerLoadError, its message prefixed by
        `source` (the GGUF file's path) when given.
        """
        try:
            return cls._from_gguf_metadata(metadata)
        except TokenizerLoadError as e:
            if source is None:
                raise
            raise_with_source(e, source)

    @classmethod
    def _from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerLoadError("The GGUF metadata has no tokenizer.ggml.tokens; load the tokenizer from a "
                                     "tokenizer.json or tokenizer.model instead")
        tokens = _gguf_list(metadata, "tokenizer.ggml.tokens", str, "strings")
        _check_utf8(tokens)
        types = [int(t) for t in _gguf_list(metadata, "tokenizer.ggml.token_type", numbers.Integral, "integers")
                 or [TOKEN_TYPE_NORMAL] * len(tokens)]
        if len(types) != len(tokens):
            raise TokenizerLoadError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} "
                                     "tokens; the file is corrupt, re-convert it")
        try:
            if model == "gpt2":
                tok = _gguf_byte_level(metadata, tokens, types)
                piece_kind = "byte_level"
                add_bos_default = False
            elif model == "llama":
                tok = _gguf_sentencepiece(metadata, tokens, types)
                piece_kind = "sentencepiece"
                add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
            else:
                raise TokenizerLoadError(f"GGUF tokenizer.ggml.model {model!r} is not supported (only 'gpt2' and "
                                         "'llama'); load the tokenizer from the original tokenizer.json instead")
            backend = _HFBackend(tok, piece_kind, vocab_size=len(tokens))
        except TokenizerLoadError:
            raise
        except BaseException as e:
            if not _is_library_error(e):
                raise
            raise TokenizerLoadError(f"the GGUF tokenizer metadata does not form a valid {model!r} tokenizer ({e}); "
                                     "the file is corrupt, re-convert it") from e
        special = frozenset(i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN))

        def opt_id(key: str) -> int | None:
            value = _gguf_token_id(metadata, key)
            return None if value is None or value >= len(tokens) else value

        chat_template = metadata.get("tokenizer.chat_template") or None
        if chat_template is not None and not isinstance(chat_template, str):
            raise TokenizerLoadError(f"GGUF tokenizer.chat_template must be a string, got {_short(chat_template)}")
        _check_checkpoint_template(chat_template, "tokenizer.chat_template")
        return cls(
            backend,
            bos_token_id=opt_id("tokenizer.ggml.bos_token_id"),
            eos_token_id=opt_id("tokenizer.ggml.eos_token_id"),
            pad_token_id=opt_id("tokenizer.ggml.padding_token_id"),
            chat_template=chat_template,
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            special_token_ids=special,
        )


# --------------------------------------------------------------------------------------------------------------------
# Helpers for the constructors


def _hf_piece_kind(tok: tokenizers.Tokenizer) -> str:
    """How this tokenizer.json's vocabulary strings map to bytes, read off its decoder."""
    if tok.decoder is None:
        return "other"
    spec = json.loads(tok.decoder.__getstate__())
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "Replace" and _SP_SPACE in json.dumps(node.get("pattern"), ensure_ascii=False):
                found.add("Metaspace")
            elif isinstance(kind, str):
                found.add(kind)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec)
    if "ByteLevel" in found:
        return "byte_level"
    if found & {"Metaspace", "ByteFallback"}:
        return "sentencepiece"
    return "other"


def _post_processor_adds(tok: tokenizers.Tokenizer, token: str) -> bool:
    """Whether the tokenizer.json post-processor puts `token` in front of a single sequence."""
    if tok.post_processor is None:
        return False
    spec = json.loads(tok.post_processor.__getstate__())
    processors = spec.get("processors", [spec]) if spec.get("type") == "Sequence" else [spec]
    for p in processors:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            first = p["single"][0]
            if "SpecialToken" in first and first["SpecialToken"].get("id") == token:
                return True
    return False


def _token_string(value: Any) -> str | None:
    """A tokenizer_config token entry: a string, or an AddedToken-style dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_token_id(config: dict, key: str, backend: _HFBackend | _SPBackend, path: str,
                     required: bool = True) -> int | None:
    text = _token_string(config.get(key))
    if text is None:
        return None
    token_id = backend.token_to_id(text)
    if token_id is None and required:
        raise TokenizerLoadError(f"tokenizer_config {key} {text!r} is not in the vocabulary of {path}; fix {key} in "
                                 "tokenizer_config.json")
    return token_id


def _config_chat_template(config: dict) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {"name", "template"} where "default" wins."""
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) and value else None


def _gguf_special_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    """Control and unknown tokens become special added tokens; user-defined ones become non-special added tokens,
    which llama.cpp always matches whole in text."""
    added = []
    for token, kind in zip(tokens, types, strict=True):
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_TYPE_USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _add_tokens(tok: tokenizers.Tokenizer, added: list[AddedToken]) -> None:
    # Every added string is already in the model vocabulary, so `tokenizers` reuses its id instead of appending one.
    special = [t for t in added if t.special]
    plain = [t for t in added if not t.special]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated string keeps its first id, as llama.cpp's text->id map does
    return vocab


def _gguf_byte_level(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    merges_raw = _gguf_list(metadata, "tokenizer.ggml.merges", str, "strings")
    if not merges_raw:
        raise TokenizerLoadError("GGUF tokenizer.ggml.model is 'gpt2' but tokenizer.ggml.merges is missing; the file "
                                 "is incomplete, re-convert it")
    _check_utf8(merges_raw, "merge")
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise TokenizerLoadError(f"GGUF merge {m!r} is not 'left right'; the file is corrupt, re-convert it")
        merges.append((left, right))
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        logger.warning("GGUF tokenizer.ggml.pre %r is not known; using the GPT-2 split, which may tokenize digits "
                       "and whitespace differently from the model's reference tokenizer", pre)
    make_pre, ignore_merges = GGUF_PRE_TOKENIZERS.get(pre, _GPT2_PRE)
    model = tokenizers.models.BPE(vocab=_vocab_dict(tokens), merges=merges, ignore_merges=ignore_merges)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok, _gguf_special_tokens(tokens, types))
    return tok


def _score_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to sentencepiece/llama.cpp's "merge the adjacent pair whose concatenation has the best
    score": every split of a normal token into two normal tokens, ranked by the score of the merged token."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == TOKEN_TYPE_NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, i in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                # Ties (same merged score) resolve by token id, then by the left piece's id: deterministic.
                ranked.append((-scores[i], i, normal[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _gguf_sentencepiece(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    scores = [float(s) for s in _gguf_list(metadata, "tokenizer.ggml.scores", numbers.Real, "numbers") or []]
    if len(scores) != len(tokens):
        raise TokenizerLoadError("GGUF tokenizer.ggml.model is 'llama' but tokenizer.ggml.scores is missing or has "
                                 "the wrong length; the file is incomplete, re-convert it")
    unk_id = _gguf_token_id(metadata, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    has_bytes = any(t == TOKEN_TYPE_BYTE for t in types)
    model = tokenizers.models.BPE(
        vocab=_vocab_dict(tokens),
        merges=_score_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=has_bytes,
    )
    tok = tokenizers.Tokenizer(model)
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer rather than Metaspace: like llama.cpp it prefixes a space even when the text already starts with
    # one, and (running after special tokens are split out) again after each special token.
    steps: list[normalizers.Normalizer] = [normalizers.Prepend(_SP_SPACE)] if add_space_prefix else []
    steps.append(normalizers.Replace(" ", _SP_SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    dec: list[decoders.Decoder] = [decoders.Replace(_SP_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    _add_tokens(tok, _gguf_special_tokens(tokens, types))
    return tok


# --------------------------------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: invalid JSON or UTF-8
        raise TokenizerLoadError(f"Could not read {path} ({e}); fix or delete the file") from e
    if not isinstance(value, dict):
        raise TokenizerLoadError(f"{path} should hold a JSON object; fix or delete the file")
    return value


def load_tokenizer_from_dir(path: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of a Hugging Face model directory: tokenizer.json if present, else tokenizer.model; None if
    neither exists. tokenizer_config.json, special_tokens_map.json and chat_template.jinja / chat_template.json are
    read when present (a standalone chat template file wins over tokenizer_config's).

    A file that is present but corrupt or inconsistent (invalid JSON, a token string of the wrong type, a chat
    template that does not parse, a garbled tokenizer.json or tokenizer.model) raises TokenizerLoadError naming it."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ModelFileNotFoundError(f"Model directory {path} not found; pass a directory holding tokenizer.json or "
                                     "tokenizer.model")
    config: dict[str, Any] = {}
    origin: dict[str, str] = {}  # config key -> the file it came from, for error messages
    config_path = os.path.join(path, "tokenizer_config.json")
    if _is_file(config_path):
        config = _read_json(config_path)
        origin = dict.fromkeys(config, config_path)
    special_map_path = os.path.join(path, "special_tokens_map.json")
    if _is_file(special_map_path):
        for key, value in _read_json(special_map_path).items():
            if key not in config:
                config[key] = value
                origin[key] = special_map_path
    jinja_path = os.path.join(path, "chat_template.jinja")
    json_template_path = os.path.join(path, "chat_template.json")
    if _is_file(jinja_path):
        try:
            with open(jinja_path, encoding="utf-8") as f:
                config["chat_template"] = f.read()
        except (OSError, ValueError) as e:  # ValueError: not UTF-8
            raise TokenizerLoadError(f"Could not read {jinja_path} ({e}); fix or delete the file") from e
        origin["chat_template"] = jinja_path
    elif _is_file(json_template_path):
        template = _read_json(json_template_path).get("chat_template")
        if template:
            config["chat_template"] = template
            origin["chat_template"] = json_template_path
    _check_config(config, origin)

    json_path = os.path.join(path, "tokenizer.json")
    sp_path = os.path.join(path, "tokenizer.model")
    if _is_file(json_path):
        return Tokenizer.from_tokenizer_json(json_path, tokenizer_config=config)
    if _is_file(sp_path):
        return Tokenizer.from_sentencepiece(sp_path, tokenizer_config=config)
    return None


def _is_file(path: str) -> bool:
    """Whether the tokenizer file `path` is there; something else at that name (a directory) is an error, not an
    absent file (it had been skipped: the model loaded without its tokenizer)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise TokenizerLoadError(f"{path} is not a file (a directory?); it must be the file itself")
    return os.path.isfile(path)


# --------------------------------------------------------------------------------------------------------------------
# Validation


def _short(value: Any) -> str:
    """repr of a value, cut short: a corrupt file can hold a huge one."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_library_error(e: BaseException) -> bool:
    """Whether `e` is a tokenizer library's failure on bad input: an ordinary Exception, or pyo3's PanicException
    (a Rust panic inside `tokenizers`), which derives from BaseException. KeyboardInterrupt and the like are not."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def _check_text(text: Any) -> None:
    """Text for `encode()` must be a str of valid Unicode: the backends reject lone surrogates with their own
    TypeError / RuntimeError, which would not say where the bad character is."""
    if not isinstance(text, str):
        hint = "; decode bytes first, e.g. data.decode('utf-8')" if isinstance(text, (bytes, bytearray)) else ""
        raise InvalidPromptTypeError(f"encode() takes a str, got {type(text).__name__}{hint}")
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidPromptError(
            f"the text holds a lone surrogate U+{ord(text[e.start]):04X} at character index {e.start}, which is not "
            "valid Unicode; remove it or pass valid Unicode (e.g. decode bytes with errors='replace', not "
            "'surrogateescape')"
        ) from e


def _check_utf8(strings: list[str], what: str = "token") -> None:
    """GGUF strings are decoded with surrogateescape; `tokenizers` refuses the surrogates that invalid UTF-8 leaves."""
    try:
        "".join(strings).encode("utf-8")
    except UnicodeEncodeError:
        for i, t in enumerate(strings):
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise TokenizerLoadError(f"GGUF {what} {i} ({_short(t)}) is not valid UTF-8; the file is corrupt, "
                                         "re-convert it") from None


def _gguf_list(metadata: dict[str, Any], key: str, kind: type, what: str) -> list | None:
    """A GGUF array of `kind` (bools are not numbers here), or None when absent."""
    value = metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise TokenizerLoadError(f"GGUF {key} must be an array of {what}, got {_short(value)}; the file is corrupt, "
                                 "re-convert it")
    return value


def _gguf_token_id(metadata: dict[str, Any], key: str) -> int | None:
    """A GGUF token id; None when absent or negative (some converters write -1 for "none")."""
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TokenizerLoadError(f"GGUF {key} must be a token id (an integer), got {_short(value)}; the file is "
                                 "corrupt, re-convert it")
    return int(value) if value >= 0 else None


def _check_config(config: dict[str, Any], origin: dict[str, str] | None = None) -> dict[str, Any]:
    """Type-check the tokenizer_config entries this module reads and compile its chat template, so a bad value fails
    at load naming its file (`origin`: config key -> file; "tokenizer_config" for a dict passed in directly)."""

    def where(key: str) -> str:
        return (origin or {}).get(key, "tokenizer_config")

    for key in ("bos_token", "eos_token", "pad_token"):
        value = config.get(key)
        if value is not None and _token_string(value) is None:
            raise TokenizerLoadError(f"{where(key)}: {key} must be a string or an object with a \"content\" string, "
                                     f"got {_short(value)}; fix {key}")
    add_bos = config.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise TokenizerLoadError(f"{where('add_bos_token')}: add_bos_token must be true or false, got "
                                 f"{_short(add_bos)}")
    template = config.get("chat_template")
    valid = template is None or isinstance(template, str) or (isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("template"), str) for t in template))
    if not valid:
        raise TokenizerLoadError(f"{where('chat_template')}: chat_template must be a string or a list of "
                                 f"{{\"name\", \"template\"}} objects, got {_short(template)}")
    _check_checkpoint_template(_config_chat_template(config), where("chat_template"))
    return config
