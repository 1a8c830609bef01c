"""Constrained decoding (`paged.filters`): filter construction and errors, the masks against llguidance's own, the
device-side mask against the library's unpacking, and jobs under filters on the fake engine and on a tiny real
model (grammar always satisfied across seeds, padded vocabulary rows never sampled, `end_filter`,
`filter_prefer_eos`, unfiltered neighbours unchanged, speculative verification, no extra compiled variant, exact
page accounting)."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import llguidance
import llguidance.numpy
import numpy as np
import pytest

from models import ModelConfig
from paged import DynamicGenerator, Job, SamplingSettings
from paged.device.batch import mask_words
from paged.device.sampling import apply_token_mask
from paged.errors import InvalidJobError, JobFailure
from paged.filters import (
    ChoiceFilter,
    FilterState,
    GrammarFilter,
    JsonSchemaFilter,
    PrefixFilter,
    RegexFilter,
    compute_masks,
    ll_tokenizer,
    mask_allows,
)
from paged.host import generator as generator_module
from paged.testing import ByteTokenizer, FakeEngine, drain, tiny_model, verification_for

pytestmark = pytest.mark.fresh_programs  # (counts compiled variants)

TOK = ByteTokenizer()  # token i < 256 is byte i; 256 = <eos>, 257 = <bos>
GREEDY = SamplingSettings.greedy()
HOT = SamplingSettings(temperature=1.5, top_k=0, top_p=1.0)


def allowed(mask: np.ndarray, limit: int) -> list[int]:
    return [t for t in range(limit) if mask_allows(mask, t)]


def check_clean(gen):
    assert not gen.active and not gen.pending and gen.pool.num_referenced == 0
    gen.pool.check(expected_refs={})


# ------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("make, match", [
    (lambda: RegexFilter("a["), r"RegexFilter: invalid regex: .*unclosed character class"),
    (lambda: GrammarFilter("start: foo"), r"GrammarFilter: invalid Lark grammar: .*unknown name"),
    (lambda: JsonSchemaFilter({"type": "nonsense"}), r"JsonSchemaFilter: invalid JSON schema: .*nonsense"),
    (lambda: JsonSchemaFilter("{not json"), r"JsonSchemaFilter: the schema is not valid JSON"),
    (lambda: JsonSchemaFilter(3), r"must be a dict, a JSON string or a pydantic model class"),
    (lambda: JsonSchemaFilter(False), r"the schema `false` matches no JSON value"),  # (true and false are schemas)
    (lambda: JsonSchemaFilter("false"), r"the schema `false` matches no JSON value"),
    (lambda: ChoiceFilter([]), r"ChoiceFilter: options must be a non-empty list"),
    (lambda: ChoiceFilter("yes"), r"ChoiceFilter: options must be a list of strings"),
    (lambda: PrefixFilter(["ok", ""]), r"PrefixFilter: options must be a non-empty list of non-empty strings"),
    (lambda: RegexFilter(""), r"RegexFilter: the pattern must be a non-empty str"),
    # a lone surrogate (a JSON "\\ud800" escape) has no UTF-8 form: it had raised a bare UnicodeEncodeError
    (lambda: RegexFilter("ab\ud800"), r"RegexFilter: the pattern holds a lone surrogate '\\ud800' at index 2"),
    (lambda: GrammarFilter('start: "\ud800"'), r"GrammarFilter: the grammar holds a lone surrogate"),
    (lambda: ChoiceFilter(["a", "\udc00"]), r"ChoiceFilter: the option 1 holds a lone surrogate"),
    (lambda: PrefixFilter(["\ud800"]), r"PrefixFilter: the option 0 holds a lone surrogate"),
    (lambda: JsonSchemaFilter({"const": "\ud800"}), r"JsonSchemaFilter: the schema holds a lone surrogate"),
])
def test_invalid_filters_raise_invalid_job_error_with_the_librarys_message(make, match):
    with pytest.raises(InvalidJobError, match=re.compile(match, re.S)):
        make()


@pytest.mark.parametrize("make", [
    lambda: RegexFilter("[a&&b]"),  # had ended its job at once with end_filter and an empty, non-matching text
    lambda: RegexFilter("(a|b)[c&&d]x"),
    lambda: RegexFilter("hello [a&&b]"),  # dead after a forced prefix
    lambda: GrammarFilter('start: "a" /[a&&b]/'),
])
def test_a_filter_that_matches_no_text_is_rejected_at_creation(make):
    with pytest.raises(InvalidJobError, match="matches no text at all"):
        make()


@pytest.mark.parametrize("pattern", ["[a&&b]*", "a|[a&&b]", "[0-9]{3}-[a-z]+", "x*"])
def test_satisfiable_regexes_with_dead_branches_are_accepted(pattern):
    assert RegexFilter(pattern).pattern == pattern


def test_job_checks_its_filters_and_the_combinations():
    f = RegexFilter("[a-z]+")
    assert Job([1], 4, filters=f).filters == [f]
    assert Job([1], 4, filters=[f, PrefixFilter(["a"])]).filters[1].prefixes == ["a"]
    with pytest.raises(InvalidJobError, match="filters must be a paged.filters.Filter"):
        Job([1], 4, filters="[a-z]+")
    with pytest.raises(InvalidJobError, match="filters must be a paged.filters.Filter"):
        Job([1], 4, filters=[f, 3])
    with pytest.raises(InvalidJobError, match="filters and banned_strings cannot be combined"):
        Job([1], 4, filters=f, banned_strings=["x"])
    with pytest.raises(InvalidJobError, match="filter_prefer_eos must be True or False"):
        Job([1], 4, filters=f, filter_prefer_eos="yes")
    gen = DynamicGenerator(engine=FakeEngine())  # no tokenizer
    with pytest.raises(InvalidJobError, match="filters need a tokenizer"):
        gen.enqueue(Job([1], 4, filters=f))


def test_pydantic_model_class_is_a_schema():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    assert JsonSchemaFilter(Point).schema["required"] == ["x", "y"]


def test_the_schema_true_is_any_json_value():
    assert JsonSchemaFilter(True).schema == JsonSchemaFilter("true").schema == {}


# ------------------------------------------------------------------------------------------------- masks
def _library_mask(grammar: str, tokens: list[int]) -> np.ndarray:
    m = llguidance.LLMatcher(ll_tokenizer(TOK), grammar, log_level=0)
    assert m.consume_tokens(tokens)
    return np.frombuffer(m.compute_bitmask(), np.int32)


@pytest.mark.parametrize("f, prefix", [
    (RegexFilter(r"\d{1,3}(\.\d+)?"), b"12"),
    (JsonSchemaFilter({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}), b'{"a'),
    (GrammarFilter('start: "(" start ")" | "x"'), b"(("),
    (ChoiceFilter(["yes", "no", "maybe"]), b"m"),
])
def test_masks_equal_the_librarys_and_padded_ids_are_off(f, prefix):
    words = mask_words(300)  # the model's vocabulary is larger than the tokenizer's 258 tokens
    st = FilterState([f], TOK, words)
    for t in prefix:
        st.consume(t)
    mask, = compute_masks([st])
    want = _library_mask(f.grammar, list(prefix))
    assert mask.shape == (words,) and mask.dtype == np.int32
    assert allowed(mask, 300) == allowed(want, 258)
    assert not any(mask_allows(mask, t) for t in range(258, 300))


def test_several_filters_intersect():
    st = FilterState([RegexFilter("[a-f]+"), PrefixFilter(["d", "ex"])], TOK, mask_words(258))
    assert [chr(t) for t in allowed(compute_masks([st])[0], 256)] == ["d", "e"]
    st.consume(ord("e"))  # "e" fits both; next the prefix filter wants "x", which [a-f] forbids: nothing is left
    mask, = compute_masks([st])
    assert not mask.any()
    st.rollback(1)
    st.consume(ord("d"))  # after "d" the prefix filter allows anything: [a-f] decides (and EOS: it accepts)
    assert [chr(t) for t in allowed(compute_masks([st])[0], 256)] == list("abcdef")


def test_one_filter_finished_is_no_end_while_another_does_not_accept():
    """After "ab" the choice filter is finished (only EOS) while a.*c does not accept "ab": the output is not
    complete (it had ended as `end_filter` with "ab"), and no token is left (the job then fails saying so)."""
    st = FilterState([ChoiceFilter(["ab"]), RegexFilter("a.*c")], TOK, mask_words(258))
    st.consume(ord("a"))
    st.consume(ord("b"))
    assert not st.done() and not compute_masks([st])[0].any()
    both = FilterState([ChoiceFilter(["abc"]), RegexFilter("a.*c")], TOK, mask_words(258))
    for ch in "abc":
        both.consume(ord(ch))
    assert both.done()  # every filter accepts and one is finished


def test_stop_tokens_are_allowed_where_the_grammar_may_end():
    st = FilterState([RegexFilter("[0-9]+")], TOK, mask_words(258), stop_tokens={ord(":"), 256})
    assert not mask_allows(compute_masks([st])[0], ord(":"))  # nothing yet: the grammar cannot end
    st.consume(ord("4"))
    mask, = compute_masks([st])
    assert mask_allows(mask, ord(":")) and mask_allows(mask, 256) and not mask_allows(mask, ord(";"))


class WideTokenizer(ByteTokenizer):
    """ByteTokenizer plus tokens 258-299 ("z0".."z9", ...): a tokenizer with more ids than the model."""

    vocab_size = 300

    def token_bytes(self, t):
        return b"z%d" % (t - 258) if t >= 258 else super().token_bytes(t)


def test_a_tokenizer_wider_than_the_model_masks_the_ids_the_model_lacks():
    tok = WideTokenizer()
    st = FilterState([RegexFilter("z[0-9]+")], tok, mask_words(263), vocab_size=263)
    mask, = compute_masks([st])
    assert allowed(mask, 288) == [ord("z"), 258, 259, 260, 261, 262]  # "z0".."z4"; 263.. are not the model's
    gen = DynamicGenerator(tokenizer=tok, engine=FakeEngine(vocab_size=263))
    gen.enqueue(Job([5], 6, filters=RegexFilter("z[0-9]+"), identifier="w"))
    final = drain(gen).finals["w"]
    assert final["eos_reason"] == "max_new_tokens" and re.fullmatch("z[0-9]+", final["full_completion"])
    check_clean(gen)
    with pytest.raises(InvalidJobError, match=r"EOS token \(256\) inside the model's vocabulary \(200 ids\)"):
        FilterState([RegexFilter("z")], tok, mask_words(200), vocab_size=200)


class PrefixingTokenizer(ByteTokenizer):
    """A SentencePiece-like encoder: a leading space ("▁") on every text it encodes."""

    def encode(self, text, *, add_bos=False, encode_special_tokens=False):
        return super().encode(" " + text, add_bos=add_bos)


def test_the_library_tokenizes_fragments_to_their_exact_bytes():
    lt = ll_tokenizer(PrefixingTokenizer())
    assert lt.tokenize_bytes(b"12") == [ord("1"), ord("2")]
    assert ll_tokenizer(TOK).tokenize_bytes(b"12") == [ord("1"), ord("2")]


def test_device_mask_equals_the_librarys_unpacking():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 300)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31 - 1, size=(5, mask_words(300)), dtype=np.int64).astype(np.int32)
    want = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(want, mask)
    got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------------- fake engine
def test_filtered_jobs_follow_their_grammar_and_neighbours_are_unchanged():
    def jobs():
        return [Job([5, 6], 20, filters=RegexFilter(r"[a-c]{3}x"), identifier="re"),
                Job([7, 8], 20, filters=ChoiceFilter(["hello", "help"]), identifier="choice"),
                Job([9], 5, identifier="plain")]

    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine())
    gen.enqueue(jobs())
    c = drain(gen)
    assert c.finals["re"]["full_completion"] == "abcx" and c.finals["re"]["eos_reason"] == "end_filter"
    assert c.finals["choice"]["full_completion"] in ("hello", "help")
    assert c.finals["choice"]["eos_reason"] == "end_filter"
    alone = DynamicGenerator(tokenizer=TOK, engine=FakeEngine())
    alone.enqueue(jobs()[2])
    assert drain(alone).finals["plain"]["full_completion"] == c.finals["plain"]["full_completion"]
    check_clean(gen)


def test_cancel_drops_a_filtered_job_and_its_pages():
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine())
    job = Job([5, 6], 50, filters=RegexFilter("[a-z]{40}"), identifier="c")
    other = Job([9], 5, identifier="plain")
    gen.enqueue([job, other])
    for _ in range(4):
        gen.iterate()
    assert job.filter_state.consumed > 0
    gen.cancel(job)
    c = drain(gen)
    assert "c" not in c.finals and c.finals["plain"]["eos_reason"] == "max_new_tokens"
    check_clean(gen)


def test_a_stop_token_ends_a_filtered_job_once_its_grammar_may_end():
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine())
    # the fake continues 0, 1, ... 9 then ':': the stop token, allowed because "0123456789" is a complete match
    gen.enqueue(Job([47], 20, filters=RegexFilter("[0-9]+"), stop_conditions=[ord(":")], identifier="s"))
    final = drain(gen).finals["s"]
    assert final["eos_reason"] == "stop_token" and final["full_completion"] == "0123456789"
    check_clean(gen)


def test_a_failing_filter_ends_its_job_alone(monkeypatch):
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine())
    bad = Job([5, 6], 20, filters=RegexFilter("[a-z]+"), identifier="bad")
    good = Job([7, 8], 6, filters=RegexFilter("[a-z]+"), identifier="good")
    plain = Job([9], 5, identifier="plain")
    gen.enqueue([bad, good, plain])
    gen.iterate()

    def broken(states):  # the grammar engine fails on the bad job's masks (and so on any batch holding it)
        if any(st is bad.filter_state for st in states):
            raise RuntimeError("grammar engine exploded")
        return compute_masks(states)

    monkeypatch.setattr(generator_module, "compute_masks", broken)
    c = drain(gen)
    assert c.finals["bad"]["eos_reason"] == "error" and "its filter failed" in c.finals["bad"]["error"]
    assert c.finals["good"]["eos_reason"] in ("max_new_tokens", "end_filter")
    assert c.finals["plain"]["eos_reason"] == "max_new_tokens"
    check_clean(gen)


def test_the_grammars_eos_ends_the_job_like_a_stop_token():
    """The EOS that completes a filter is not part of the output: its text (`<|im_end|>` with
    decode_special_tokens) had been appended to the completion (breaking the JSON or regex it completed) and its id
    to `token_ids`; now it is the final result's `eos_triggering_token_id` and `held`, as a stop token's is."""
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine())
    # the fake continues 0, 1, 2, ... then ':' which [0-9]+ cannot take: EOS is the only token left after "9"
    gen.enqueue(Job([47], 20, filters=RegexFilter("[0-9]+"), decode_special_tokens=True, identifier="d"))
    c = drain(gen)
    final = c.finals["d"]
    assert final["eos_reason"] == "end_filter" and final["full_completion"] == "0123456789"
    assert final["eos_triggering_token_id"] == TOK.eos_token_id and final["held"]["token_ids"] == [TOK.eos_token_id]
    streamed = [t for r in c.results if r["identifier"] == "d" for t in r.get("token_ids", [])]
    assert streamed == [ord(ch) for ch in "0123456789"]
    check_clean(gen)


def test_prefer_eos_ends_as_soon_as_the_filter_accepts():
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine())
    gen.enqueue([Job([47], 10, filters=RegexFilter("[0-9]+"), identifier="greedy-digits"),
                 Job([47], 10, filters=RegexFilter("[0-9]+"), filter_prefer_eos=True, identifier="first")])
    c = drain(gen)
    # the fake continues 0, 1, 2, ... 9 then ':' (not a digit): the filter allows only digits or EOS
    assert c.finals["first"]["full_completion"] == "0" and c.finals["first"]["eos_reason"] == "end_filter"
    assert c.finals["greedy-digits"]["full_completion"].startswith("0123456789")
    check_clean(gen)


class PieceTokenizer(ByteTokenizer):
    """ByteTokenizer plus three multi-byte tokens, so that token healing has choices: 258 "ab", 259 "a1", 260 "a12"."""

    vocab_size = 261
    PIECES = {258: b"ab", 259: b"a1", 260: b"a12"}

    def token_bytes(self, t):
        return self.PIECES.get(t) or super().token_bytes(t)


def test_token_healing_with_a_filter_heals_into_the_grammar():
    tok = PieceTokenizer()
    prompt = [ord("x"), ord("a")]  # healing drops "a": the first token is one of "a", "ab", "a1", "a12"
    script = {prompt[0]: (1, [258])}  # the fake wants "ab" first: its rest "b" is no digit, so it takes "a1"
    gen = DynamicGenerator(tokenizer=tok, engine=FakeEngine(vocab_size=261, script=script))
    gen.enqueue(Job(prompt, 8, filters=RegexFilter("[0-9]{3}"), token_healing=True, identifier="h"))
    c = drain(gen)
    first = [t for r in c.results if r["stage"] == "streaming" for t in r["token_ids"]][0]
    assert first == 259  # "a1": starts with the dropped "a", and "1" begins the grammar
    # then "a12" (the fake's next wish) is no digit string: the next allowed ids are "0" and "1"
    assert c.finals["h"]["full_completion"] == "101" and c.finals["h"]["eos_reason"] == "end_filter"
    check_clean(gen)


def test_speculative_verification_masks_every_position():
    prompt = list(b"ab1ab2ab3")
    # the fake would continue "ab1ab4" (the n-gram drafter proposes "1ab..." after "ab" from the prompt); the
    # grammar's mask differs from position to position ("a", then "b", then a digit from 2), so a verification row
    # needs each position's own mask: with the first position's everywhere, the output changes
    script = {prompt[0]: (len(prompt), list(b"ab1ab4ab"))}

    def run(**kw):
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(script=script, verification=verification_for(**kw)),
                               **kw)
        gen.enqueue(Job(prompt, 12, filters=RegexFilter(r"ab[2-9]ab[4-9]"), identifier="j"))
        return gen, drain(gen).finals["j"]

    plain = run()[1]
    gen, spec = run(use_ngram_draft=True, num_draft_tokens=3, max_ngram=2)
    assert plain["full_completion"] == "ab2ab4"  # "1" masked: the fake takes the next allowed id
    assert spec["full_completion"] == plain["full_completion"]
    assert spec["eos_reason"] == plain["eos_reason"] == "end_filter"
    assert gen.speculation.metrics()["drafted_tokens"] > 0
    check_clean(gen)


# ------------------------------------------------------------------------------------------- tiny real model
CFG = ModelConfig(model_type="llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
MODEL = tiny_model(CFG, seed=3, tokenizer=TOK)
SETTINGS = dict(num_pages=40, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=64)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["a", "b"]}},
          "required": ["n", "ok", "tag"], "additionalProperties": False}


@pytest.mark.slow
def test_real_model_sampled_outputs_always_follow_the_grammar_across_seeds():
    from paged.device.engine import count_compiles

    gen = DynamicGenerator(MODEL, **SETTINGS)
    plain = [Job([1, 2, 3], 8, gen_settings=HOT, seed=s, identifier=f"p{s}") for s in range(2)]
    gen.enqueue(plain)
    drain(gen)
    alone = {j.identifier: j.sequence[j.prompt_len:] for j in plain}
    gen.warmup()
    compiled = count_compiles()["step"]
    for seed in range(6):
        jobs = [Job([1, 2, 3], 8, gen_settings=HOT, seed=s, identifier=f"p{s}") for s in range(2)]
        filtered = [Job([4, 5], 40, gen_settings=HOT, seed=seed, filters=RegexFilter(r"[a-z]{2,5}-[0-9]{1,3}"),
                        identifier="regex"),
                    Job([6], 60, gen_settings=HOT, seed=seed, filters=JsonSchemaFilter(SCHEMA), identifier="json")]
        gen.enqueue(jobs + filtered)
        c = drain(gen)
        for j in jobs:  # unfiltered neighbours: the same tokens as without the filtered jobs
            assert j.sequence[j.prompt_len:] == alone[j.identifier]
        for j in filtered:
            out = j.sequence[j.prompt_len:]
            assert all(t < 258 for t in out), out  # never a padded vocabulary row
        assert c.finals["regex"]["eos_reason"] != "error" and c.finals["json"]["eos_reason"] != "error"
        text = c.finals["regex"]["full_completion"]
        if c.finals["regex"]["eos_reason"] != "max_new_tokens":
            assert re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", text), text
        else:
            assert re.fullmatch(r"[a-z]{2,5}-[0-9]{0,3}|[a-z]{0,5}", text), text
        final = c.finals["json"]
        if final["eos_reason"] in ("end_filter", "stop_token"):
            value = json.loads(final["full_completion"])
            assert set(value) == {"n", "ok", "tag"} and value["tag"] in ("a", "b")
            assert isinstance(value["n"], int) and isinstance(value["ok"], bool)
    assert count_compiles()["step"] == compiled  # the masked steps ran on the warmed-up variants
    check_clean(gen)


def test_a_token_outside_the_mask_is_never_sampled():
    gen = DynamicGenerator(MODEL, **SETTINGS)
    jobs = [Job([7, 8, 9], 24, gen_settings=HOT, seed=s, filters=RegexFilter(r"[xyz]+"), identifier=s)
            for s in range(4)]
    gen.enqueue(jobs)
    c = drain(gen)
    for j in jobs:
        assert set(j.sequence[j.prompt_len:]) <= set(b"xyz") | {256}, j.sequence
        assert c.finals[j.identifier]["eos_reason"] in ("max_new_tokens", "stop_token", "end_filter")
    check_clean(gen)


@pytest.mark.slow
def test_a_draft_model_verifies_filtered_jobs_under_each_positions_mask():
    """A draft model's drafts normally stay on the device (the target's forward reads them there); a filtered job's
    verification row needs each position's mask after the earlier drafts, so its drafts come to the host first:
    the rows the target runs carry the real drafts. Greedy with a position-dependent grammar: the self-draft gives
    the non-speculative output exactly."""
    pattern = r"[a-z]{2,4}-[0-9]{1,2}"
    seen = []

    def run(**kw):
        gen = DynamicGenerator(MODEL, **SETTINGS, **kw)
        run_engine = gen.engine.run

        def spy(rows, **k):
            if k.get("draft_tokens") is not None:
                slots = gen.engine.verify_plan(rows)[2]
                drafts = np.asarray(k["draft_tokens"])
                seen.extend((list(r.tokens[1:]), drafts[i]) for r, i in zip(rows, slots) if r.verify)
            return run_engine(rows, **k)

        gen.engine.run = spy
        gen.enqueue([Job([p, p + 1], 12, gen_settings=GREEDY, filters=RegexFilter(pattern), identifier=p)
                     for p in (4, 20, 40, 90)])
        return gen, drain(gen)

    _, plain = run()
    gen, spec = run(draft_model=MODEL, num_draft_tokens=3)
    for p, final in plain.finals.items():
        assert spec.finals[p]["full_completion"] == final["full_completion"], p
        assert re.fullmatch(pattern, final["full_completion"]), final["full_completion"]
    m = gen.speculation.metrics()
    assert m["drafted_tokens"] > 0 and seen
    # the first draft of a row is proposed under its position's mask (the filter's), so the self-draft's first
    # draft is the target's token (13 of 34 drafts accepted; proposed unmasked, 1 of 69 had been)
    assert m["accepted_draft_tokens"] >= len([1 for host, _ in seen if host]), m
    for host, device in seen:
        assert host == list(device[: len(host)])
    check_clean(gen)


def test_a_grammar_that_never_lets_the_text_end_is_refused_when_built(capfd):
    """`start: "a" start` forces "a" without end: llguidance's parser overflows (its item limit) on the forced
    text, so every job under it failed at its first token with a parser dump; now refused at build, and quietly
    (llguidance had printed a warning to the console)."""
    with pytest.raises(InvalidJobError, match=r"GrammarFilter: the Lark grammar overflows llguidance's parser .*"
                                              r"give it a way to end"):
        GrammarFilter('start: "a" start')
    assert "Too many items" not in capfd.readouterr().err
    GrammarFilter('start: "a" start | "b"')  # (recursion with a way out is fine)


def test_a_choice_of_thousands_of_options_and_prefixes():
    """ChoiceFilter and PrefixFilter are one lexeme of alternatives: as parser rules, llguidance stopped at 2000
    options ("Current row has 2001 items"), and a job under 2000 of them failed at its second token."""
    options = [str(i) for i in range(5000)]
    eos = TOK.eos_token_id
    for f, text, then in ((ChoiceFilter(options), "4999", {eos}), (ChoiceFilter(options), "1", {eos, *b"0123456789"}),
                          (PrefixFilter(options), "12", None)):
        st = FilterState([f], TOK, mask_words(258))
        for t in text.encode():
            assert mask_allows(compute_masks([st])[0], t)
            st.consume(t)
        got = set(allowed(compute_masks([st])[0], 258))
        assert got == then if then is not None else got >= {eos, *range(128)}  # after a prefix: any text, or end


def test_a_constraint_too_large_for_the_library_is_named_when_built_or_met():
    """A regex whose lexer outgrows llguidance's limits is refused when built, where the probe meets it (at the
    start or after forced text); one that meets them only after a choice fails its job with a message that says
    so, not as a token the filter rejected (a content filter, on the server)."""
    with pytest.raises(InvalidJobError, match=r"RegexFilter: the regex is too large for llguidance \(lexer error"):
        RegexFilter("(a{1000}){1000}")
    st = FilterState([RegexFilter("(x|y)(a{1000}){1000}")], TOK, mask_words(258))
    st.consume(ord("x"))
    assert allowed(compute_masks([st])[0], 258) == [ord("a")]
    with pytest.raises(JobFailure, match=r"^RegexFilter: the constraint is too large for llguidance after 1 new "
                                         r"tokens \(lexer error: too many expressions constructed\); make it smaller"):
        st.consume(ord("a"))


@pytest.mark.parametrize("engine", ["fake", "sim"])
def test_a_job_whose_filters_allow_nothing_fails_alone(engine):
    """Filters that exclude each other leave no token: that job fails with a message naming its filters, the
    other job finishes, no page leaks. On the fake and the simulated engine it had failed every step of every job
    (a ValueError out of the fake's sampler), where the real engine fails that job alone; a row whose bias bans
    every token its mask allows now comes back at -inf, as the real sampler reports it."""
    from paged.device.config import EngineConfig
    from paged.sim import SimulatedEngine, StepTimeModel

    eng = FakeEngine() if engine == "fake" else SimulatedEngine(
        EngineConfig(num_pages=33, page_size=8, max_batch_size=4, max_seq_len=128, max_chunk_size=16),
        StepTimeModel.constant(0.01))
    gen = DynamicGenerator(tokenizer=TOK, engine=eng)
    greedy = SamplingSettings.greedy()
    gen.enqueue([Job(TOK.encode("abc"), 8, identifier="conflict", gen_settings=greedy,
                     filters=[RegexFilter("a+"), RegexFilter("b+")]),
                 Job(TOK.encode("abc"), 8, identifier="banned", filters=[RegexFilter("a+")],
                     gen_settings=SamplingSettings(temperature=0.0, token_bias={97: float("-inf")})),
                 Job(TOK.encode("xyz"), 8, identifier="innocent", gen_settings=greedy)])
    c = drain(gen)
    f = c.finals
    assert f["conflict"]["eos_reason"] == "error" and "its filters allow no token after 0 new tokens" in \
        f["conflict"]["error"]
    # (named before the step: it had reached the sampler, whose -inf draw suggested non-finite logits)
    assert f["banned"]["eos_reason"] == "error" and "its filters allow only tokens its settings ban after 0 new " \
        "tokens" in f["banned"]["error"]
    assert f["innocent"]["eos_reason"] == "max_new_tokens" and f["innocent"]["new_tokens"] == 8
    gen.pool.check({})
