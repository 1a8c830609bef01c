"""Constrained decoding: job filters on llguidance.

A filter says which continuations of a job's output are allowed: `JsonSchemaFilter`, `RegexFilter`,
`GrammarFilter` (Lark), `ChoiceFilter` (one of a few strings) and `PrefixFilter` (start with one of a few strings,
then anything). Each is a grammar for llguidance (https://github.com/guidance-ai/llguidance), which compiles it and,
at every step, computes the set of allowed next tokens for the model's real tokenizer: the grammar engine of
exllamav3, vLLM and SGLang, with JSON-schema, regex and Lark front ends, millisecond masks and no heavy
dependencies (xgrammar, the alternative, pulls in triton). The grammar is checked when the filter is built, so a
bad schema, regex or grammar is an `InvalidJobError` before any job exists.

Filter objects are descriptions and can be shared; the state (an `llguidance.LLMatcher` per filter) belongs to one
job (`FilterState`, made when the job is enqueued). Each step the generator asks every filtered job for its mask
(`compute_masks`, one parallel llguidance call for the whole batch): the intersection of its filters' allowed sets,
packed 32 tokens to an int32 word, with the ids past the tokenizer's vocabulary (padded embedding rows) always
off. The jitted step applies it before sampling (`paged.device.sampling.apply_token_mask`). Each sampled token is then
consumed by the job's matchers; when they are done (`is_stopped`, or accepting with `filter_prefer_eos`) the job
ends with `eos_reason="end_filter"`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from paged.errors import InvalidJobError, JobFailure
from paged.validate import Checker


def _llg():
    import llguidance
    import llguidance.numpy  # noqa: F401 (the bitmask helpers)

    return llguidance


def _check_utf8(text: str, who: str, what: str) -> None:
    """llguidance takes UTF-8: a lone surrogate is an `InvalidJobError` naming `who` and `what`."""
    Checker(who, InvalidJobError).text(f"the {what}", text)


class Filter:
    """A constraint on a job's output, as an llguidance grammar (`grammar`, checked at construction)."""

    kind = "filter"

    def __init__(self, grammar: str, what: str):
        llg = _llg()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            raise InvalidJobError(f"{type(self).__name__}: invalid {what}: {messages[0].strip()}")
        if not _satisfiable(grammar, what=f"{type(self).__name__}: the {what}"):
            raise InvalidJobError(f"{type(self).__name__}: the {what} matches no text at all (is a character class "
                                  "empty, such as [a&&b]?); a job under it could generate nothing")
        self.grammar = grammar

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    def describe(self) -> str:
        return ""


class JsonSchemaFilter(Filter):
    """Output is one JSON value valid under `schema`: a dict, a JSON string, or a pydantic model class."""

    def __init__(self, schema: Any):
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidJobError(f"JsonSchemaFilter: the schema is not valid JSON: {e}") from None
        if schema is True:  # JSON Schema's `true`: any JSON value, as the empty schema
            schema = {}
        elif schema is False:
            raise InvalidJobError("JsonSchemaFilter: the schema `false` matches no JSON value; a job under it could "
                                  "generate nothing")
        if not isinstance(schema, dict):
            raise InvalidJobError(f"JsonSchemaFilter: the schema must be a dict, a JSON string or a pydantic model "
                                  f"class, got {type(schema).__name__}")
        self.schema = schema
        _check_utf8(json.dumps(schema, ensure_ascii=False), "JsonSchemaFilter", "schema")
        try:
            grammar = _llg().LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise InvalidJobError(f"JsonSchemaFilter: invalid JSON schema: {e}") from None
        super().__init__(grammar, "JSON schema")

    def describe(self) -> str:
        return json.dumps(self.schema)[:60]


class RegexFilter(Filter):
    """Output matches `pattern` as a whole (Rust `regex` syntax: https://docs.rs/regex)."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str) or not pattern:
            raise InvalidJobError(f"RegexFilter: the pattern must be a non-empty str, got {pattern!r}")
        _check_utf8(pattern, "RegexFilter", "pattern")
        self.pattern = pattern
        super().__init__(_llg().LLMatcher.grammar_from_regex(pattern), "regex")

    def describe(self) -> str:
        return repr(self.pattern)


class GrammarFilter(Filter):
    """Output is a sentence of the Lark grammar `lark_text` (start rule `start`; llguidance's Lark dialect:
    https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)."""

    def __init__(self, lark_text: str):
        if not isinstance(lark_text, str) or not lark_text.strip():
            raise InvalidJobError("GrammarFilter: the grammar must be a non-empty str of Lark rules")
        _check_utf8(lark_text, "GrammarFilter", "grammar")
        self.lark = lark_text
        super().__init__(_llg().LLMatcher.grammar_from_lark(lark_text), "Lark grammar")

    def describe(self) -> str:
        return repr(self.lark[:60])


def _lark_literals(options: Sequence[str], who: str) -> str:
    if isinstance(options, str) or not isinstance(options, Iterable):
        raise InvalidJobError(f"{who}: options must be a list of strings, got {options!r}")
    options = list(options)
    if not options or not all(isinstance(o, str) and o for o in options):
        raise InvalidJobError(f"{who}: options must be a non-empty list of non-empty strings, got {options!r}")
    for i, o in enumerate(options):
        _check_utf8(o, who, f"option {i}")
    return " | ".join(json.dumps(o) for o in options)  # Lark string literals take JSON's escapes


class ChoiceFilter(Filter):
    """Output is exactly one of `options` (ExLlamaV2's select filter)."""

    def __init__(self, options: Sequence[str]):
        alternatives = _lark_literals(options, "ChoiceFilter")
        self.options = list(options)
        # one terminal (lexeme) of alternatives: llguidance's lexer takes tens of thousands of them, where as
        # parser rules it stops at 2000 (an Earley row per alternative)
        super().__init__(_llg().LLMatcher.grammar_from_lark(f"start: OPTION\nOPTION: {alternatives}"), "choice")

    def describe(self) -> str:
        return repr(self.options)


class PrefixFilter(Filter):
    """Output starts with one of `prefixes`; anything may follow (ExLlamaV2's prefix filter)."""

    def __init__(self, prefixes: Sequence[str]):
        alternatives = _lark_literals(prefixes, "PrefixFilter")
        self.prefixes = list(prefixes)
        super().__init__(_llg().LLMatcher.grammar_from_lark(f"start: PREFIXED\nPREFIXED: ({alternatives}) /(?s:.*)/"),
                         "prefix")  # one terminal, as ChoiceFilter's

    def describe(self) -> str:
        return repr(self.prefixes)


# ----------------------------------------------------------------------------------------------- tokenizers
class _TokenTable:
    """What llguidance's `TokenizerWrapper` reads from a tokenizer: every token's bytes, EOS/BOS, specials and
    an encoder."""

    def __init__(self, tokenizer: Any):
        n = tokenizer.vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(getattr(tokenizer, "special_token_ids", ()))
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        self._tokenizer = tokenizer
        self._ids: dict[bytes, int] | None = None  # bytes -> id, for `_greedy`
        self._longest = max(map(len, self.tokens), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        """Tokens whose bytes are exactly `text`: the tokenizer's encoding when it is (a SentencePiece encoder
        adds a leading "▁" to a fragment, which is not), else a longest-match over the vocabulary."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = list(self._tokenizer.encode(data.decode("utf-8", errors="replace")))
        if b"".join(self.tokens[i] for i in ids if 0 <= i < len(self.tokens)) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        if self._ids is None:
            self._ids = {}
            special = set(self.special_token_ids)
            for i, b in enumerate(self.tokens):
                if b and i not in special:
                    self._ids.setdefault(b, i)
        out, pos = [], 0
        while pos < len(data):
            for n in range(min(self._longest, len(data) - pos), 0, -1):
                t = self._ids.get(data[pos : pos + n])
                if t is not None:
                    out.append(t)
                    pos += n
                    break
            else:
                raise InvalidJobError(f"the tokenizer has no token for the byte {data[pos]:#04x}: filters need a "
                                      "tokenizer that can spell every byte")
        return out


class _Bytes:
    """A vocabulary of the 256 bytes and an EOS: enough to ask a grammar whether it matches any text."""

    vocab_size = 257
    eos_token_id = 256
    bos_token_id = None
    special_token_ids = (256,)

    def token_bytes(self, i: int) -> bytes:
        return bytes([i]) if i < 256 else b""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


_BYTES = _Bytes()


# llguidance's errors when a grammar outgrows its limits while decoding (not a token the grammar refuses)
_LIMITS = ("lexer error", "too many", "max is", "ParserTooComplex", "fuel")


def _satisfiable(grammar: str, max_forced: int = 256, what: str = "the grammar") -> bool:
    """False when the grammar provably matches no text: over single bytes, its matcher finds no way on at the
    start, or after the bytes it forces (an empty character class such as `[a&&b]`, at once or after a fixed
    prefix). Other grammars count as satisfiable (llguidance decides a full emptiness question only while
    decoding). One whose forced text overflows llguidance's parser (a rule that always recurses, `start: "a"
    start`, forces "a" without end) is an `InvalidJobError` naming `what`: every job under it would fail at its
    first token."""
    llg = _llg()
    probe = llg.LLMatcher(ll_tokenizer(_BYTES), grammar, log_level=0)
    mask = llg.numpy.allocate_token_bitmask(1, _Bytes.vocab_size)
    for _ in range(max_forced):
        llg.numpy.fill_next_token_bitmask(probe, mask, 0)
        if probe.is_error():
            error = probe.get_error()
            if "Too many items" in error or "ParserTooComplex" in error:
                raise InvalidJobError(f"{what} overflows llguidance's parser ({error.splitlines()[0]}): it forces "
                                      "text without end (a rule that always recurses, such as start: \"a\" start, "
                                      "never lets the text stop) or is too ambiguous; give it a way to end")
            if any(s in error for s in _LIMITS):
                raise InvalidJobError(f"{what} is too large for llguidance ({error.strip().splitlines()[0]}); make "
                                      "it smaller (fewer alternatives, smaller repetition counts)")
            return not error.startswith("NoExtensionBias")
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: _Bytes.vocab_size])
        if len(allowed) != 1 or allowed[0] == _Bytes.eos_token_id:
            return True
        probe.consume_token(int(allowed[0]))  # a forced byte: look past it
    return True


def ll_tokenizer(tokenizer: Any) -> Any:
    """The `llguidance.LLTokenizer` of a project tokenizer (anything with `vocab_size`, `eos_token_id`,
    `token_bytes(i)` and `encode(text)`), built once per tokenizer object (it walks the whole vocabulary)."""
    cached = getattr(tokenizer, "_llguidance_tokenizer", None)
    if cached is not None:
        return cached
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise InvalidJobError("filters need a tokenizer with an EOS token (the grammar ends on it)")
    llg = _llg()
    built = llg.LLTokenizer(llg.TokenizerWrapper(_TokenTable(tokenizer)), n_vocab=tokenizer.vocab_size)
    try:
        tokenizer._llguidance_tokenizer = built
    except AttributeError:  # a tokenizer that takes no attributes: rebuilt per job
        pass
    return built


# ---------------------------------------------------------------------------------------------- job state
class FilterState:
    """The matchers of one job's filters. `words` is the mask width of the model's vocabulary (`ceil(V / 32)`;
    ids the tokenizer has and the model has not are never allowed). `stop_tokens` (the job's stop tokens, which
    end it before the grammar sees them) are allowed wherever the grammar allows EOS."""

    def __init__(self, filters: Sequence[Filter], tokenizer: Any, words: int, prefer_eos: bool = False,
                 stop_tokens: Iterable[int] = (), vocab_size: int | None = None):
        llg = _llg()
        lt = ll_tokenizer(tokenizer)
        vocab_size = words * 32 if vocab_size is None else vocab_size
        if not 0 <= lt.eos_token < vocab_size:
            raise InvalidJobError(f"filters need the tokenizer's EOS token ({lt.eos_token}) inside the model's "
                                  f"vocabulary ({vocab_size} ids): the grammar ends on it; use a tokenizer that "
                                  "matches the model")
        self.matchers = []
        self.filters = list(filters)
        for f in filters:
            m = llg.LLMatcher(lt, f.grammar, log_level=0)
            if m.is_error():
                raise InvalidJobError(f"{type(f).__name__}: {m.get_error()}")
            self.matchers.append(m)
        self.words = words
        self.prefer_eos = prefer_eos
        self.vocab_size = vocab_size
        self.library_words = -(-lt.vocab_size // 32)  # llguidance's mask width
        self.tokenizer_words = min(self.library_words, words)
        self.eos = lt.eos_token
        self.stop_tokens = frozenset(int(t) for t in stop_tokens if 0 <= int(t) < vocab_size)
        self.consumed = 0
        self._lt = lt
        self._tokenizer = tokenizer
        self.first_mask: np.ndarray | None = None  # token healing: the first token's mask (`healing_mask`)

    # --- token healing: the first token must start with the dropped prompt text `prefix`, and the grammar sees
    # only what follows it (the output text has the prefix stripped too)
    def _rest_tokens(self, token: int, prefix: bytes) -> list[int]:
        return self._lt.tokenize_bytes(self._tokenizer.token_bytes(int(token))[len(prefix) :])

    def healing_mask(self, candidates: Sequence[int], prefix: bytes) -> np.ndarray:
        """The mask of a token-healing job's first token: the `candidates` (tokens starting with `prefix`) whose
        text after the prefix the grammar can begin with."""
        mask = np.zeros(self.words, np.int32)
        for t in candidates:
            rest = self._rest_tokens(t, prefix)
            if all(m.validate_tokens(rest) == len(rest) for m in self.matchers):
                mask[t >> 5] |= _bit(t)
        return mask

    def consume_healed(self, token: int, prefix: bytes) -> None:
        """`consume` for the first token of a token-healing job: the matchers take its text after the prefix."""
        for t in self._rest_tokens(token, prefix):
            self.consume(t)

    def consume(self, token: int) -> None:
        """Advance every matcher by a sampled token; `JobFailure` if one rejects it (the mask allowed only what
        the matchers accept, so this means a bug or a token that bypassed the mask)."""
        for m, f in zip(self.matchers, self.filters):
            if not m.consume_token(int(token)):
                error = m.get_error()
                if any(s in error for s in _LIMITS):
                    raise JobFailure(f"{type(f).__name__}: the constraint is too large for llguidance after "
                                     f"{self.consumed} new tokens ({error.strip().splitlines()[0]}); make it smaller "
                                     "(fewer alternatives, smaller repetition counts)")
                raise JobFailure(f"the filter rejected token {token}: {error}")
        self.consumed += 1

    def rollback(self, n: int) -> None:
        if n:
            for m in self.matchers:
                m.rollback(n)
            self.consumed -= n

    def done(self) -> bool:
        """The output is complete: every matcher accepts it, and one accepts nothing more (only EOS) or
        `prefer_eos` is set. (One matcher stopped while another does not accept yet is no end: the filters then
        allow no token, and the job fails saying so; it had ended as complete for the stopped one alone.)"""
        if not all(m.is_accepting() for m in self.matchers):
            return False
        return self.prefer_eos or any(m.is_stopped() for m in self.matchers)


def compute_masks(states: Sequence[FilterState]) -> list[np.ndarray]:
    """The packed allowed-token mask (int32 `[words]`) of each state's current position: the AND of its
    matchers' masks, computed for the whole batch in one parallel llguidance call."""
    if not states:
        return []
    llg = _llg()
    pairs, owner = [], []
    for i, st in enumerate(states):
        for m in st.matchers:
            pairs.append((m, len(pairs)))
            owner.append(i)
    scratch = np.full((len(pairs), max(st.library_words for st in states)), -1, np.int32)
    llg.numpy.fill_next_token_bitmask_par(_executor(), pairs, scratch)
    out = []
    for i, st in enumerate(states):
        rows = scratch[[k for k, o in enumerate(owner) if o == i], : st.tokenizer_words]
        mask = np.zeros(st.words, np.int32)  # ids past the tokenizer's (or the model's) vocabulary stay off
        mask[: st.tokenizer_words] = np.bitwise_and.reduce(rows, axis=0)
        cut = st.words * 32 - st.vocab_size  # the model's own vocabulary may end inside the last word
        if cut > 0:
            mask[-1] &= np.int32(np.uint32((1 << (32 - cut)) - 1).view(np.int32))
        if st.stop_tokens and mask_allows(mask, st.eos):  # the grammar may end here: so may a stop token
            for t in st.stop_tokens:
                mask[t >> 5] |= _bit(t)
        out.append(mask)
    return out


def _bit(t: int) -> np.int32:
    return np.uint32(1 << (t & 31)).view(np.int32)


_EXECUTOR = None


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = _llg().LLExecutor()
    return _EXECUTOR


def mask_allows(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def mask_without(mask: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """A copy of the packed `mask` with `tokens` off (ids past it ignored)."""
    out = mask.copy()
    for t in tokens:
        if 0 <= t < out.size * 32:
            out[t >> 5] &= ~_bit(t)
    return out


__all__ = [
    "ChoiceFilter",
    "Filter",
    "FilterState",
    "GrammarFilter",
    "JsonSchemaFilter",
    "PrefixFilter",
    "RegexFilter",
    "compute_masks",
    "ll_tokenizer",
    "mask_allows",
    "mask_without",
]
