"""Which request field a 400 names (`param`): for the generator's own errors (`paged.server.errors.param_of` on the
messages `SamplingSettings`, `Job` and `enqueue()` really raise, triggered here), and for pydantic's validation
errors (`paged.server.protocol.error_param` on their `loc`, union-member tags and dict keys left out)."""

from __future__ import annotations

import math

import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.device.config import EngineConfig
from paged.errors import GeneratorError
from paged.filters import RegexFilter
from paged.server.errors import from_generator_error
from paged.server.protocol import ChatCompletionRequest, CompletionRequest, error_param
from paged.testing import ByteTokenizer, FakeEngine

TOK = ByteTokenizer()
V = TOK.vocab_size
EOS = TOK.eos_token_id
SIZES = dict(num_pages=16, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=64)


def enqueue(job: Job, tokenizer=TOK, **config) -> None:
    engine = FakeEngine(config=EngineConfig(**{**SIZES, **config}), record=False)
    DynamicGenerator(tokenizer=tokenizer, engine=engine).enqueue(job)


def settings(**kw) -> SamplingSettings:
    return SamplingSettings(**kw)


def in_vocab(**kw) -> None:
    SamplingSettings(**kw).check_vocab(V)


# (what raises, the field a completions request names, a chat request's where it differs)
BAN_ALL_BUT_EOS = [t for t in range(V) if t != EOS]
CASES = {
    # SamplingSettings: each field the request sets, out of range
    **{f"settings.{name}": (lambda name=name, bad=bad: settings(**{name: bad}), name) for name, bad in dict(
        temperature=-1.0, top_k=-1, top_p=0.0, min_p=1.0, typical=2.0, repetition_penalty=0.0, penalty_range=-1,
        penalty_decay=-1, top_a=-1.0, tfs=2.0, smoothing_factor=-1.0, min_temp=-1.0, max_temp=-1.0,
        temp_exponent=0.0, skew=30.0, xtc_probability=2.0, xtc_threshold=0.0, xtc_ignore_tokens=[-1],
        mirostat_tau=0.0, mirostat_eta=-1.0, mirostat_mu=-1.0, dry_multiplier=-1.0, dry_base=0.5,
        dry_allowed_length=0, dry_max_ngram=1, dry_range=5, dry_sequence_breakers=[-1], banned_tokens=[-1],
        cfg_scale=math.inf, frequency_penalty=math.inf, presence_penalty=math.nan).items()},
    "settings.token_bias id": (lambda: settings(token_bias={-1: 1.0}), "logit_bias"),
    "settings.token_bias value": (lambda: settings(token_bias={5: math.inf}), "logit_bias"),
    # SamplingSettings.check_vocab (at enqueue): ids past the vocabulary
    "vocab.token_bias": (lambda: in_vocab(token_bias={V: 1.0}), "logit_bias"),
    "vocab.banned_tokens": (lambda: in_vocab(banned_tokens=[V]), "banned_tokens"),
    "vocab.xtc_ignore_tokens": (lambda: in_vocab(xtc_ignore_tokens=[V]), "xtc_ignore_tokens"),
    "vocab.dry_sequence_breakers": (lambda: in_vocab(dry_sequence_breakers=[V]), "dry_sequence_breakers"),
    # Job()
    "job.max_new_tokens": (lambda: Job([65], 0), "max_tokens"),
    "job.min_new_tokens": (lambda: Job([65], 2, min_new_tokens=5), "min_tokens"),
    "job.empty stop string": (lambda: Job([65], 2, stop_conditions=[""]), "stop"),
    "job.stop string surrogate": (lambda: Job([65], 2, stop_conditions=["\ud800"]), "stop"),
    "job.banned_strings surrogate": (lambda: Job([65], 2, banned_strings=["\ud800"]), "banned_strings"),
    "job.stop token id": (lambda: Job([65], 2, stop_conditions=[-1]), "stop_token_ids"),
    "job.seed": (lambda: Job([65], 2, seed="x"), "seed"),
    "job.banned_strings": (lambda: Job([65], 2, banned_strings=[""]), "banned_strings"),
    "job.priority": (lambda: Job([65], 2, priority="high"), "priority"),
    "job.lora": (lambda: Job([65], 2, lora=5), "lora"),
    "job.return_top_tokens": (lambda: Job([65], 2, return_top_tokens=-1), "logprobs", "top_logprobs"),
    "job.empty prompt": (lambda: Job([], 2), "prompt", "messages"),
    "job.negative id": (lambda: Job([65, -1], 2), "prompt", "messages"),
    "job.cfg_scale without a negative prompt": (lambda: Job([65], 2, gen_settings=settings(cfg_scale=1.5)),
                                                "cfg_scale"),
    "job.token healing with CFG": (lambda: Job([[65], [66]], 2, gen_settings=settings(cfg_scale=1.5),
                                               token_healing=True), "token_healing"),
    "job.filters with banned strings": (lambda: Job([65], 2, filters=[RegexFilter("a+")], banned_strings=["b"]),
                                        "banned_strings"),
    # enqueue()
    "enqueue.lora not loaded": (lambda: enqueue(Job([65], 2, lora="nobody")), "lora"),
    "enqueue.prompt past the vocabulary": (lambda: enqueue(Job([65, V], 2)), "prompt", "messages"),
    "enqueue.stop token past the vocabulary": (lambda: enqueue(Job([65], 2, stop_conditions=[V])), "stop_token_ids"),
    "enqueue.return_top_tokens": (lambda: enqueue(Job([65], 2, return_top_tokens=V + 1)), "logprobs",
                                  "top_logprobs"),
    "enqueue.every token banned": (lambda: enqueue(Job([65], 2, gen_settings=settings(banned_tokens=range(V)))),
                                   "banned_tokens"),
    "enqueue.min_new_tokens with all else banned": (
        lambda: enqueue(Job([65], 2, min_new_tokens=1, stop_conditions=[EOS],
                            gen_settings=settings(banned_tokens=BAN_ALL_BUT_EOS))), "min_tokens"),
    "enqueue.DRY without history": (lambda: enqueue(Job([65], 2, gen_settings=settings(dry_multiplier=0.8)),
                                                    max_penalty_range=0), "dry_multiplier"),
    "enqueue.CFG with one row": (lambda: enqueue(Job([[65], [66]], 2, gen_settings=settings(cfg_scale=1.5)),
                                                 max_batch_size=1), "negative_prompt"),
    "enqueue.prompt too long": (lambda: enqueue(Job([65] * 60, 10)), "prompt", "messages"),
    "enqueue.stop strings without a tokenizer": (lambda: enqueue(Job([65], 2, stop_conditions=["x"]),
                                                                 tokenizer=None), None),
}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest], ids=["completions", "chat"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_generator_errors_name_the_request_field(case, model):
    raise_it, completions, *chat = CASES[case]
    with pytest.raises(GeneratorError) as e:
        raise_it()
    want = chat[0] if chat and model is ChatCompletionRequest else completions
    err = from_generator_error(e.value, model)
    assert err.status == 400 and err.param == want, (str(e.value), err.param)
    assert err.param is None or err.param in model.model_fields


def test_token_healing_on_a_prompt_that_ends_in_an_embedding_names_it():
    """The one message no request can raise here (the server sends no embeddings): its text, as the generator has
    it, still maps to the field."""
    from paged.errors import InvalidJobError

    message = ("Job: token healing needs a text token last in the prompt, and it ends with an embedding; pass "
               "token_healing=False")
    assert from_generator_error(InvalidJobError(message), CompletionRequest).param == "token_healing"


LOCS = [  # (endpoint model, pydantic's loc, the param)
    (CompletionRequest, ("body", "stop", "str"), "stop"),
    (CompletionRequest, ("body", "stop", "list[str]", 0), "stop.0"),
    (CompletionRequest, ("body", "prompt", "str"), "prompt"),
    (CompletionRequest, ("body", "prompt", "list[list[int]]", 0, 1), "prompt.0.1"),
    (CompletionRequest, ("body", "logit_bias", "65"), "logit_bias"),
    (CompletionRequest, ("body", "frobnicate"), "frobnicate"),
    (CompletionRequest, ("body", "stream_options", "foo"), "stream_options.foo"),
    (CompletionRequest, ("body",), None),
    (ChatCompletionRequest, ("body", "messages", 0, "content", "str"), "messages.0.content"),
    (ChatCompletionRequest, ("body", "messages", 1, "content", "list[TextPart]", 0, "text"),
     "messages.1.content.0.text"),
    (ChatCompletionRequest, ("body", "response_format", "json_schema", "schema"), "response_format.json_schema.schema"),
    (ChatCompletionRequest, ("body", "tool_choice", "dict[str,any]"), "tool_choice"),
]


@pytest.mark.parametrize("model, loc, param", LOCS)
def test_validation_errors_name_the_field_not_the_union_member(model, loc, param):
    assert error_param(loc, model) == param
