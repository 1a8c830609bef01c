"""TextStream invariants: released text == decoded tokens (minus a stop string and what follows), no U+FFFD that
the full decode lacks, stop strings split across any number of tokens are caught, banned strings rewind."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.streaming import StreamEvent, TextStream

TEXT = st.text(alphabet=st.sampled_from(list("abc xyz.,\n") + list("éüñçÅ") + list("你好世界") + ["😀", "🚀", "👍"]),
               max_size=40)


def byte_tokens(data: bytes, cuts: list[int]) -> list[bytes]:
    """Split bytes at the given cut points (anywhere, also inside UTF-8 characters)."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:]) if b > a]


def run(pieces: list[bytes], stop=(), banned=()):
    vocab = {i: p for i, p in enumerate(pieces)}
    s = TextStream(vocab.__getitem__, stop, banned)
    chunks, events = [], []
    for i in range(len(pieces)):
        ev = s.feed(i)
        events.append(ev)
        chunks.append(ev.text)
        if ev.stopped is not None or ev.rewind:
            break
    else:
        text, toks = s.flush()
        chunks.append(text)
        events.append(StreamEvent(text=text, tokens=toks))
    return s, chunks, events


@settings(max_examples=200, deadline=None)
@given(text=TEXT, cuts=st.lists(st.integers(0, 200), max_size=30))
def test_released_text_is_the_decoded_text_and_never_garbage(text, cuts):
    pieces = byte_tokens(text.encode(), cuts)
    s, chunks, events = run(pieces)
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    released = [t for ev in events for t in ev.tokens]
    assert released == list(range(len(pieces)))  # every token comes out once, in order, with its text


@settings(max_examples=200, deadline=None)
@given(before=TEXT, after=TEXT, stop=st.sampled_from(["END", "\n\n", "世界", "é!", "😀x"]),
       cuts=st.lists(st.integers(0, 300), max_size=40))
def test_stop_string_split_across_tokens_is_caught(before, after, stop, cuts):
    text = before + stop + after
    pieces = byte_tokens(text.encode(), cuts)
    s, chunks, events = run(pieces, stop=[stop])
    first = text.find(stop)
    assert s.stopped == stop
    assert "".join(chunks) == text[:first]
    assert s.held_text.startswith(stop)
    assert all(stop not in c for c in chunks)
    # a token lying wholly in the stop string is never released before the stop, also one holding only the first
    # bytes of its first character (no text of its own yet); every held token comes out with the final event
    start = len(text[:first].encode())
    starts = [sum(map(len, pieces[:t])) for t in range(len(events))]
    assert all(starts[t] < start for ev in events[:-1] for t in ev.tokens)
    assert [t for ev in events for t in ev.tokens] == list(range(len(events)))


def test_output_cut_inside_a_character_drops_the_partial_bytes():
    s, chunks, events = run([b"a", b"\xf0\x9f", b"\x98"])
    assert "".join(chunks) == "a" and all("\ufffd" not in c for c in chunks)


def test_incomplete_utf8_released_with_the_completing_token():
    s, chunks, _ = run([b"a", b"\xf0\x9f", b"\x98", b"\x80", b"b"])
    assert chunks[:4] == ["a", "", "", "😀"]


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from([b"a", b"bc", b" ", b"\xc3", b"\xa9", b"\xf0\x9f", b"\x98\x80", b"\xe2", b""]),
                       max_size=12),
       stop=st.sampled_from([(), ("bc a",)]), strip=st.sampled_from(["", "a", "ab"]))
def test_release_now_answers_only_what_feed_would_release(pieces, stop, strip):
    """`release_now` (the generator's shortcut for the usual token) gives the text `feed` would, released with its
    token alone, or None and changes nothing: over valid and invalid UTF-8 (a cut character then ASCII), stop strings
    and a healing prefix to strip."""
    vocab = dict(enumerate(pieces))
    fast, slow = TextStream(vocab.__getitem__, stop), TextStream(vocab.__getitem__, stop)
    fast.strip_prefix = slow.strip_prefix = strip
    for i in range(len(pieces)):
        want = slow.feed(i)
        text = fast.release_now(i)
        got = fast.feed(i) if text is None else StreamEvent(text, [i])
        assert (got.text, got.tokens, got.stopped) == (want.text, want.tokens, want.stopped)
        if want.stopped is not None:
            break


@settings(max_examples=100, deadline=None)
@given(before=st.text(alphabet="abcd xyz", max_size=20), cuts=st.lists(st.integers(0, 100), max_size=20))
def test_banned_string_asks_for_a_rewind_from_the_token_where_it_began(before, cuts):
    text = before + "ForBidden rest"
    pieces = byte_tokens(text.encode(), cuts)
    s, chunks, events = run(pieces, banned=["forbidden"])
    ev = events[-1]
    assert ev.rewind > 0 and ev.banned == "forbidden"
    released = "".join(chunks)
    assert "forbidden" in ev.suppressed_text.lower()  # the whole match lies in the taken-back tokens
    assert "ForBidden" not in released  # never shown
    assert released + ev.suppressed_text == text[: len(released) + len(ev.suppressed_text)]
    assert ev.suppressed_tokens == list(range(len(events) - ev.rewind, len(events)))


@settings(max_examples=200, deadline=None)
@given(before=TEXT, banned=st.sampled_from(["世界", "é!", "😀x"]), cuts=st.lists(st.integers(0, 200), max_size=30))
def test_a_rewind_takes_back_every_byte_of_the_banned_string(before, banned, cuts):
    """Every token lying wholly in the banned string is taken back, also one holding only the first bytes of its
    first character (no text of its own): left in the sequence, the model would go on after half a character. (A
    token whose bytes begin before the banned string and end inside it has text before the match: it is released
    with that text and stays.)"""
    text = before + banned + " rest"
    pieces = byte_tokens(text.encode(), cuts)
    s, chunks, events = run(pieces, banned=[banned])
    ev = events[-1]
    assert ev.banned == banned and banned in ev.suppressed_text
    start = len(text[: text.find(banned)].encode())
    starts = [sum(map(len, pieces[:t])) for t in range(len(events))]
    ends = [a + len(p) for a, p in zip(starts, pieces)]
    assert {t for t in range(len(events)) if starts[t] >= start} <= set(ev.suppressed_tokens)
    assert all(ends[t] > start for t in ev.suppressed_tokens)


@pytest.mark.parametrize("held, banned, stop", [("İ", ["İq", "ab"], ()), ("İİ", ["İİq", "ab"], ()),
                                                ("İ", ["ab"], ["İ!"]), ("xİ", ["ab", "xİz"], ())])
def test_a_character_whose_lowercase_is_longer_does_not_shift_the_banned_match(held, banned, stop):
    """"İ".lower() is two characters: matched in the lowercased text, a ban's position had been read one character
    off in the text (each held İ shifted it), and "ab" after a held İ was released unseen."""
    pieces = [c.encode() for c in held + "ab!"]
    s, chunks, events = run(pieces, stop=stop, banned=banned)
    ev = events[-1]
    assert ev.banned == "ab" and ev.suppressed_text == "ab" and "".join(chunks) == held


def test_a_rewind_to_the_first_token_restores_the_healing_prefix():
    """Token healing drops the prompt's last token ("l") and strips its text from the first output token; when a
    banned string takes that first token back, the next first token is stripped too (it had shown "lx": the "l"
    twice)."""
    vocab = {0: b"lo", 1: b"lx", 2: b"y"}
    s = TextStream(vocab.__getitem__, (), ["o"])
    s.strip_prefix = "l"
    ev = s.feed(0)
    assert ev.rewind == 1 and ev.banned == "o"
    out = [s.feed(1).text, s.feed(2).text, s.flush()[0]]
    assert "".join(out) == "xy"


def tokenizer_cases():
    from models.tokenizer import Tokenizer, load_tokenizer_from_dir

    yield "byte-level BPE", load_tokenizer_from_dir("tests/models/data/tiny_bpe")
    yield "sentencepiece", Tokenizer.from_sentencepiece("tests/models/data/tiny_sp.model")


MULTILINGUAL = ["Hello, world!", "café naïve résumé", "日本語のテキスト", "emoji 😀🚀 mix", "Ünïcödé ☃ and 你好"]


@pytest.mark.parametrize("name, tok", list(tokenizer_cases()))
@pytest.mark.parametrize("text", MULTILINGUAL)
def test_real_tokenizers_stream_exactly_their_decode(name, tok, text):
    ids = tok.encode(text)
    s = TextStream(tok.token_bytes)
    chunks = [s.feed(t).text for t in ids]
    chunks.append(s.flush()[0])
    full = "".join(chunks)
    assert full.lstrip(" ") == tok.decode(ids).lstrip(" ")  # sentencepiece may add a dummy-prefix space
    assert "\ufffd" not in full


@pytest.mark.real_weights
@pytest.mark.parametrize("text", MULTILINGUAL)
def test_smollm2_tokenizer_streams_exactly_its_decode(text):
    from models.embedded import embedded_gguf_path
    from models.gguf_reader import read_gguf_metadata
    from models.tokenizer import Tokenizer

    tok = _smollm2_tokenizer(Tokenizer, read_gguf_metadata, embedded_gguf_path)
    ids = tok.encode(text)
    s = TextStream(tok.token_bytes, stop_strings=["\n\n"])
    chunks = [s.feed(t).text for t in ids]
    chunks.append(s.flush()[0])
    assert "".join(chunks) == tok.decode(ids) == text
    assert all("\ufffd" not in c for c in chunks)


_CACHE = {}


def _smollm2_tokenizer(cls, read_meta, path):
    if "tok" not in _CACHE:
        _CACHE["tok"] = cls.from_gguf_metadata(read_meta(path()))
    return _CACHE["tok"]
