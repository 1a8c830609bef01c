"""Bad input gets a named error before it touches the generator, and never hurts the jobs already running.

Every case runs beside healthy jobs: the bad one is rejected (at construction or `enqueue()`), the healthy ones
finish with exactly the tokens they produce alone, and no page leaks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.device.config import Drafting, EngineConfig, Verification, config_fields
from paged.errors import (
    GeneratorError,
    InvalidConfigError,
    InvalidConfigTypeError,
    InvalidJobError,
    InvalidJobTypeError,
    InvalidSettingsError,
    InvalidSettingsTypeError,
    JobTooLargeError,
)
from paged.filters import ChoiceFilter
from paged.testing import ByteTokenizer, FakeEngine, drain

TOK = ByteTokenizer()
V = TOK.vocab_size
GREEDY = SamplingSettings.greedy()


def make(**kw):
    return DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=64, **kw))


def healthy_jobs():
    return [Job(TOK.encode(p), 6, gen_settings=GREEDY, identifier=p, stop_conditions=["zz"])
            for p in ("hello", "abc", "a longer prompt that spans pages")]


def solo_tokens() -> dict:
    out = {}
    for j in healthy_jobs():
        g = make()
        g.enqueue(j)
        out[j.identifier] = drain(g).finals[j.identifier]["full_completion"]
    return out


SOLO = None


def assert_healthy_unharmed(bad_action, error: type[Exception], match: str | None = None):
    """Start healthy jobs, run a step, try `bad_action(gen)` (it must raise `error`), then finish: every healthy
    job gives its solo output and every page is released."""
    global SOLO
    SOLO = SOLO or solo_tokens()
    gen = make()
    jobs = healthy_jobs()
    gen.enqueue(jobs)
    first = gen.iterate()
    with pytest.raises(error, match=match) as info:
        bad_action(gen)
    assert isinstance(info.value, GeneratorError)
    c = drain(gen)
    got = {k: v["full_completion"] for k, v in c.finals.items()}
    assert got == SOLO
    assert {r["identifier"] for r in first if r["stage"] == "started"} == set(SOLO)
    assert gen.pool.num_referenced == 0 and not gen.active and not gen.pending
    gen.pool.check(expected_refs={})
    return info.value


# ---------------------------------------------------------------------------------------------- Job(...)
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(input_ids=[[1, 2], [3], [4, 5, 6]]), InvalidJobTypeError, "ragged"),
    (dict(input_ids="hello"), InvalidJobTypeError, "encode text first"),
    (dict(input_ids=[]), InvalidJobError, "empty"),
    (dict(input_ids=[1, -2]), InvalidJobError, "negative"),
    (dict(input_ids=[1, 2**63]), InvalidJobError, r"ids no vocabulary has \(>= 2\*\*63\): \[9223372036854775808\]"),
    (dict(input_ids=[2**64, -1]), InvalidJobError, r"negative ids: \[-1\]"),
    (dict(input_ids=[1.5, 2]), InvalidJobTypeError, "integer token ids"),
    (dict(input_ids=[True, False]), InvalidJobTypeError, "integer token ids"),
    (dict(input_ids=[5, True]), InvalidJobTypeError, r"integer token ids, not bools, got True \(bool\)"),
    (dict(input_ids=[[5, False]]), InvalidJobTypeError, r"not bools, got False \(bool\)"),
    (dict(input_ids=[[1, 2], [3, 4]]), InvalidJobError, "one sequence"),
    (dict(input_ids=None), InvalidJobTypeError, "input_ids"),
    (dict(max_new_tokens=0), InvalidJobError, "max_new_tokens must be an int >= 1, got 0"),
    (dict(max_new_tokens=2.5), InvalidJobTypeError, "max_new_tokens"),
    (dict(max_new_tokens=True), InvalidJobTypeError, r"max_new_tokens .*True \(bool\)"),
    (dict(max_new_tokens="10"), InvalidJobTypeError, "max_new_tokens"),
    (dict(min_new_tokens=9), InvalidJobError, r"min_new_tokens must be an int in \[0, max_new_tokens=5\]"),
    (dict(min_new_tokens=-1), InvalidJobError, "min_new_tokens"),
    (dict(gen_settings={"temperature": 1.0}), InvalidJobTypeError, "gen_settings"),
    (dict(stop_conditions=[None]), InvalidJobTypeError, "stop_conditions entry"),
    (dict(stop_conditions=[1.5]), InvalidJobTypeError, "stop_conditions entry"),
    (dict(stop_conditions=[True]), InvalidJobTypeError, "stop_conditions entry"),
    (dict(stop_conditions=[""]), InvalidJobError, "empty string"),
    (dict(stop_conditions=["ok\ud800"]), InvalidJobError, r"stop string 'ok\\ud800' holds a lone surrogate"),
    (dict(stop_conditions=[-3]), InvalidJobError, "token id"),
    (dict(stop_conditions=b"x"), InvalidJobTypeError, "stop_conditions"),
    (dict(banned_strings=[None, 5]), InvalidJobTypeError, "banned_strings entry"),
    (dict(banned_strings=[""]), InvalidJobError, "empty string"),
    (dict(banned_strings=["x", "\ud800"]), InvalidJobError, "lone surrogate '\\\\ud800' at index 0"),
    (dict(banned_strings=7), InvalidJobTypeError, "banned_strings"),
    (dict(seed="42"), InvalidJobTypeError, "seed"),
    (dict(seed=1.0), InvalidJobTypeError, "seed"),
    (dict(max_skips=-1), InvalidJobError, "max_skips"),
    (dict(max_skips=None), InvalidJobTypeError, "max_skips"),
    (dict(return_top_tokens=-1), InvalidJobError, "return_top_tokens"),
    (dict(return_top_tokens=2.0), InvalidJobTypeError, "return_top_tokens"),
    (dict(return_probs="yes"), InvalidJobTypeError, "return_probs"),
    (dict(return_logits=1), InvalidJobTypeError, "return_logits"),
    (dict(decode_special_tokens=None), InvalidJobTypeError, "decode_special_tokens"),
    (dict(token_healing="no"), InvalidJobTypeError, "token_healing"),
])
def test_job_rejects_bad_arguments_with_named_errors(kwargs, error, match):
    args = dict(input_ids=[1, 2, 3], max_new_tokens=5)
    args.update(kwargs)
    with pytest.raises(error, match=match) as info:
        Job(args.pop("input_ids"), args.pop("max_new_tokens"), **args)
    assert isinstance(info.value, ValueError)  # existing `except ValueError` code keeps working
    assert isinstance(info.value, InvalidJobError)
    assert str(info.value).startswith("Job: ")


def test_type_errors_are_also_type_errors():
    with pytest.raises(TypeError):
        Job([1], 2.5)
    with pytest.raises(TypeError):
        SamplingSettings(top_k="3")
    with pytest.raises(TypeError):
        EngineConfig(max_batch_size=2.5)


def test_bare_strings_and_ints_are_one_condition():
    j = Job([1, 2], 5, stop_conditions="END", banned_strings="bad")
    assert j.stop_strings == ["END"] and j.stop_tokens == set()
    assert j.banned_strings == ["bad"]
    j = Job([1, 2], 5, stop_conditions=7)
    assert j.stop_tokens == {7} and j.stop_strings == []
    j = Job(np.array([[4, 5, 6]]), 5, stop_conditions=(np.int64(3), "x"))
    assert j.input_ids == [4, 5, 6] and j.stop_tokens == {3} and j.stop_strings == ["x"]
    # 0-d arrays are one value too (they had passed for iterables, then raised a bare TypeError)
    j = Job([1, 2], 5, stop_conditions=np.array(7), banned_strings=np.array("bad"))
    assert j.stop_tokens == {7} and j.banned_strings == ["bad"]
    s = SamplingSettings(banned_tokens=np.array(5), xtc_ignore_tokens=np.array(6), dry_sequence_breakers=np.array(7))
    assert (s.banned_tokens, s.xtc_ignore_tokens, s.dry_sequence_breakers) == ((5,), (6,), (7,))
    with pytest.raises(InvalidSettingsTypeError, match="token_bias must be a dict"):
        SamplingSettings(token_bias=np.array(5))


def test_bare_stop_string_stops_on_the_whole_string_not_a_character():
    # The fake continues "ab" with c, d, e, ...: a bare "E" would stop... never, "cde" stops at "cde".
    gen = make()
    gen.enqueue(Job(TOK.encode("ab"), 10, gen_settings=GREEDY, stop_conditions="def", identifier="j"))
    final = drain(gen).finals["j"]
    assert final["eos_reason"] == "stop_string" and final["full_completion"] == "c"
    gen.enqueue(Job(TOK.encode("ab"), 10, gen_settings=GREEDY, banned_strings="dz", identifier="k"))
    final = drain(gen).finals["k"]
    assert final["eos_reason"] == "max_new_tokens" and "d" in final["full_completion"]  # "d" alone is not banned


# ---------------------------------------------------------------------------------------------- SamplingSettings
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(penalty_range=1.5), InvalidSettingsTypeError, "penalty_range"),
    (dict(penalty_range=-1), InvalidSettingsError, "penalty_range"),
    (dict(temperature=math.nan), InvalidSettingsError, "temperature"),
    (dict(temperature=math.inf), InvalidSettingsError, "temperature"),
    (dict(temperature=-0.5), InvalidSettingsError, "temperature"),
    (dict(temperature="hot"), InvalidSettingsTypeError, "temperature"),
    (dict(top_k=True), InvalidSettingsTypeError, "top_k"),
    (dict(top_k=2.0), InvalidSettingsTypeError, "top_k"),
    (dict(top_k=-1), InvalidSettingsError, "top_k"),
    (dict(top_p=0.0), InvalidSettingsError, "top_p"),
    (dict(top_p=1.5), InvalidSettingsError, "top_p"),
    (dict(top_p=math.nan), InvalidSettingsError, "top_p"),
    (dict(min_p=1.0), InvalidSettingsError, "min_p"),
    (dict(min_p=math.nan), InvalidSettingsError, "min_p"),
    (dict(typical=-0.1), InvalidSettingsError, "typical"),
    (dict(repetition_penalty=0.0), InvalidSettingsError, "repetition_penalty"),
    (dict(repetition_penalty=math.nan), InvalidSettingsError, "repetition_penalty"),
    (dict(frequency_penalty=math.inf), InvalidSettingsError, "frequency_penalty"),
    (dict(presence_penalty=None), InvalidSettingsTypeError, "presence_penalty"),
    (dict(token_bias={1: math.inf}), InvalidSettingsError, r"token_bias\[1\].*-inf"),
    (dict(token_bias={1: math.nan}), InvalidSettingsError, r"token_bias\[1\]"),
    (dict(token_bias={-1: 1.0}), InvalidSettingsError, "token_bias id"),
    (dict(token_bias={"a": 1.0}), InvalidSettingsTypeError, "token_bias id"),
    (dict(token_bias={1: "x"}), InvalidSettingsTypeError, r"token_bias\[1\]"),
    (dict(token_bias=[(1, 2.0, 3)]), InvalidSettingsTypeError, "token_bias entry"),
    (dict(token_bias=5), InvalidSettingsTypeError, "token_bias"),
    (dict(banned_tokens="ab"), InvalidSettingsTypeError, "banned_tokens"),
    (dict(banned_tokens=[1, None]), InvalidSettingsTypeError, "banned_tokens entry"),
    (dict(banned_tokens=[-4]), InvalidSettingsError, "banned_tokens entry"),
    # finite in Python, infinite (or 0) in the device's float32
    (dict(frequency_penalty=1e39), InvalidSettingsError, "frequency_penalty must be at most 1e.30 in size"),
    (dict(presence_penalty=-2e30), InvalidSettingsError, "presence_penalty must be at most 1e.30 in size"),
    (dict(smoothing_factor=1e39), InvalidSettingsError, "smoothing_factor must be at most"),
    (dict(cfg_scale=1e39), InvalidSettingsError, "cfg_scale must be at most"),
    (dict(temperature=1e31), InvalidSettingsError, "temperature must be at most"),
    (dict(repetition_penalty=1e-46), InvalidSettingsError, r"repetition_penalty must be a number >= 1e-30"),
    (dict(token_bias={5: 3e38}), InvalidSettingsError, r"token_bias\[5\] must be a number in \[-1e\+30, 1e\+30\]"),
])
def test_sampling_settings_reject_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        SamplingSettings(**kwargs)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("SamplingSettings: ")


def test_sampling_settings_normalise_accepted_forms():
    s = SamplingSettings(token_bias={3: -math.inf, 1: 2}, banned_tokens=np.int64(5), top_k=np.int32(4))
    assert s.token_bias == ((1, 2.0), (3, -math.inf)) and s.banned_tokens == (5,) and type(s.top_k) is int
    assert hash(s) == hash(SamplingSettings(token_bias=[(1, 2.0), (3, -math.inf)], banned_tokens=[5], top_k=4))


# ---------------------------------------------------------------------------------------------- enqueue()
BAD_AT_ENQUEUE = [
    ("return_top_tokens above the vocabulary",
     lambda: Job([1, 2], 3, return_top_tokens=1000), InvalidJobError, "return_top_tokens"),
    ("input id above the vocabulary", lambda: Job([1, V], 3), InvalidJobError, "vocabulary size"),
    ("stop token above the vocabulary", lambda: Job([1, 2], 3, stop_conditions=[V + 5]), InvalidJobError,
     "stop token"),
    ("bias id above the vocabulary",
     lambda: Job([1, 2], 3, gen_settings=SamplingSettings(token_bias={V: 1.0})), InvalidSettingsError,
     "token_bias id"),
    ("banned id above the vocabulary",
     lambda: Job([1, 2], 3, gen_settings=SamplingSettings(banned_tokens=[V])), InvalidSettingsError, "banned_tokens"),
    ("every token banned",
     lambda: Job([1, 2], 3, gen_settings=SamplingSettings(banned_tokens=range(V))), InvalidJobError,
     "every token"),
    ("every token banned by -inf bias",
     lambda: Job([1, 2], 3, gen_settings=SamplingSettings(token_bias={t: -math.inf for t in range(V)})),
     InvalidJobError, "every token"),
    ("all but the stop tokens banned before min_new_tokens",
     lambda: Job([1, 2], 3, min_new_tokens=2, stop_conditions=[256, 257],
                 gen_settings=SamplingSettings(banned_tokens=range(256))), InvalidJobError, "min_new_tokens"),
    ("too long for max_seq_len", lambda: Job([1] * 100, 100), JobTooLargeError, "max_seq_len"),
    # (no text token starts with a special token's text: the token had been dropped, the first sample unconstrained)
    ("token healing after a special token", lambda: Job([97, TOK.eos_token_id], 3, token_healing=True),
     InvalidJobError, f"token healing needs a text token last in the prompt, .* special token {TOK.eos_token_id}"),
    ("not a job", lambda: "hello", InvalidJobTypeError, "paged.Job"),
]


@pytest.mark.parametrize("name, build, error, match", BAD_AT_ENQUEUE, ids=[c[0] for c in BAD_AT_ENQUEUE])
def test_enqueue_rejects_bad_jobs_without_hurting_others(name, build, error, match):
    bad = build()
    assert_healthy_unharmed(lambda gen: gen.enqueue(bad), error, match)


def test_stop_strings_need_a_tokenizer():
    gen = DynamicGenerator(engine=FakeEngine())
    with pytest.raises(InvalidJobError, match="need a tokenizer"):
        gen.enqueue(Job([1, 2], 3, stop_conditions="x"))
    assert not gen.pending


def test_enqueue_of_a_list_is_atomic():
    def twice(gen):
        j = Job([1, 2], 3)
        gen.enqueue([j, j])

    assert_healthy_unharmed(twice, InvalidJobError, "twice")

    def one_bad(gen):
        good = Job([1, 2], 3, identifier="good")
        try:
            gen.enqueue([good, Job([1, 2], 3, return_top_tokens=V + 1)])
        finally:
            assert good.serial is None and good not in gen.pending  # nothing was queued
    assert_healthy_unharmed(one_bad, InvalidJobError, "return_top_tokens")

    def requeue(gen):
        gen.enqueue(gen.active[0])
    assert_healthy_unharmed(requeue, InvalidJobError, "already enqueued")


def test_a_job_can_be_enqueued_after_a_rejected_list():
    gen = make()
    good = Job(TOK.encode("ab"), 3, gen_settings=GREEDY, identifier="good")
    with pytest.raises(InvalidJobError):
        gen.enqueue([good, Job([1], 3, return_top_tokens=V + 1)])
    gen.enqueue(good)
    assert drain(gen).finals["good"]["full_completion"] == "cde"


# ---------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_prefill_rows=0), InvalidConfigError, "max_prefill_rows"),
    (dict(max_prefill_rows=5, max_batch_size=4), InvalidConfigError, "max_prefill_rows"),
    (dict(max_batch_size=2.5), InvalidConfigTypeError, "max_batch_size"),
    (dict(max_batch_size=True), InvalidConfigTypeError, "max_batch_size"),
    (dict(max_batch_size=0), InvalidConfigError, "max_batch_size"),
    (dict(max_batch_size=2**31), InvalidConfigError, r"max_batch_size must be an int in \[1, 2147483647\]"),
    (dict(num_pages=2**40), InvalidConfigError, r"num_pages must be None or an int in \[2, 2147483647\]"),
    (dict(page_size=12), InvalidConfigError, "power of two"),
    (dict(num_pages=1), InvalidConfigError, "num_pages"),
    (dict(max_chunk_size=0), InvalidConfigError, "max_chunk_size"),
    (dict(max_seq_len=-5), InvalidConfigError, "max_seq_len"),
    (dict(max_penalty_range=-1), InvalidConfigError, "max_penalty_range"),
    (dict(decode_steps=0), InvalidConfigError, "decode_steps"),
    (dict(cache_dtype="float8"), InvalidConfigError, "cache_dtype"),
    (dict(attn_impl="cuda"), InvalidConfigError, "attn_impl"),
    (dict(matmul_impl=3), InvalidConfigTypeError, "matmul_impl"),
    (dict(verification=4), InvalidConfigTypeError, "verification must be a paged.device.config.Verification"),
    (dict(verification=Verification(0)), InvalidConfigError, "verification.num_draft_tokens"),
    (dict(drafting=Verification(2)), InvalidConfigTypeError, "drafting must be a paged.device.config.Drafting"),
])
def test_engine_config_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**kwargs)


def test_the_engine_roles_survive_to_dict_and_are_no_flags():
    config = EngineConfig(verification=Verification(3, match=True), drafting=Drafting(2, pad_rows=4))
    assert EngineConfig.from_kwargs(**config.to_dict()) == config  # (the nested dicts become roles again)
    assert {f.name for f in config_fields()}.isdisjoint({"verification", "drafting"})


def test_generator_construction_errors():
    with pytest.raises(InvalidConfigTypeError, match=r"load it first: models.load_model\('smollm2-135m'\)"):
        DynamicGenerator("smollm2-135m")
    with pytest.raises(InvalidConfigError, match="needs a model"):
        DynamicGenerator()
    with pytest.raises(InvalidConfigTypeError, match="models.Model"):
        DynamicGenerator(object())
    with pytest.raises(InvalidConfigTypeError, match="EngineProtocol"):
        DynamicGenerator(engine=object())
    with pytest.raises(InvalidConfigError, match="page_size"):
        DynamicGenerator(engine=FakeEngine(), page_size=16)
    with pytest.raises(InvalidConfigError, match="unknown policy"):
        DynamicGenerator(engine=FakeEngine(), policy="lifo")
    with pytest.raises(InvalidConfigTypeError, match="policy"):
        DynamicGenerator(engine=FakeEngine(), policy=3)
    with pytest.raises(InvalidConfigTypeError, match="tokenizer"):
        DynamicGenerator(engine=FakeEngine(), tokenizer="gpt2")
    with pytest.raises(InvalidConfigError, match="unknown engine setting"):
        EngineConfig.from_kwargs(pages=3)
    with pytest.raises(InvalidConfigError, match="max_prefill_rows"):
        DynamicGenerator(engine=FakeEngine(max_prefill_rows=0))
    # decode_steps is the host loop's: it may be set beside an engine
    assert DynamicGenerator(engine=FakeEngine(), decode_steps=3).decode_steps == 3


def test_generator_settings_flow_from_one_config():
    engine = FakeEngine(num_pages=20, page_size=8, max_batch_size=3, max_chunk_size=8, max_seq_len=40,
                        max_prefill_rows=2)
    gen = DynamicGenerator(engine=engine, tokenizer=TOK)
    assert gen.config == engine.config
    assert (gen.page_size, gen.max_seq_len, gen.max_batch_size) == (8, 40, 3)
    assert gen.scheduler.config.max_prefill_rows == 2 and gen.scheduler.config.max_chunk_size == 8
    assert engine.spec.max_prefill_rows == 2 and engine.spec.max_pages_per_row == 5
    assert gen.pool.num_pages == 19


# ---------------------------------------------------------------------------------------------- generate()
def test_generate_rejects_bad_prompts():
    gen = make()
    with pytest.raises(InvalidJobError, match="prompt 1 cannot be encoded"):
        gen.generate(["ok", "bad \ud800 surrogate"], 3)
    with pytest.raises(InvalidJobError, match="CFG pair .* no cfg_scale"):
        gen.generate(("positive", "negative"), 3)
    with pytest.raises(InvalidJobTypeError, match="prompt 1 is a tuple; a CFG pair is two strings"):
        gen.generate(["a", ("b", "c", "d")], 3)
    with pytest.raises(InvalidJobTypeError, match="prompt 0 must be a string"):
        gen.generate([5], 3)
    with pytest.raises(InvalidJobError, match="2 gen_settings for 1 prompts"):
        gen.generate(["a"], 3, gen_settings=[GREEDY, GREEDY])
    with pytest.raises(InvalidJobError, match="no tokens"):
        gen.generate("", 3)
    # the other arguments: they had raised bare TypeErrors and AttributeErrors (seed=True had run as seed 1)
    with pytest.raises(InvalidJobTypeError, match=r"generate\(\): seed must be None or an int, got '5'"):
        gen.generate("ab", 3, seed="5")
    with pytest.raises(InvalidJobTypeError, match="seed must be None or an int, got True"):
        gen.generate("ab", 3, seed=True)
    with pytest.raises(InvalidJobTypeError, match="abort_event must be a threading.Event"):
        gen.generate("ab", 3, abort_event=True)
    with pytest.raises(InvalidJobTypeError, match="filters must be one list of filters per prompt when"):
        gen.generate(["a", "b"], 3, filters=ChoiceFilter(["x"]))
    with pytest.raises(InvalidJobTypeError, match="embeddings must be a list of paged.embeddings.MMEmbedding"):
        gen.generate("ab", 3, embeddings=5)
    assert not gen.pending and not gen.active and gen.pool.num_referenced == 0
    assert gen.generate("ab", 3, gen_settings=GREEDY) == "cde"


def test_enqueue_is_atomic_when_preparing_a_later_job_fails():
    class NoDecode(ByteTokenizer):
        def token_bytes(self, t):
            if t == 7:
                raise RuntimeError("no bytes for 7")
            return super().token_bytes(t)

    gen = DynamicGenerator(tokenizer=NoDecode(), engine=FakeEngine())
    good = Job([1, 2], 3, identifier="good")
    healing = Job([1, 7], 3, token_healing=True)  # token healing reads the last prompt token's bytes
    with pytest.raises(InvalidJobError, match="no bytes for 7"):
        gen.enqueue([good, healing])
    assert not gen.pending and good.serial is None and healing.input_ids == [1, 7]
