"""A request body -> its jobs (`paged.server.translate`), without a server: every sampling field reaches its
`SamplingSettings` attribute with OpenAI's defaults, seeds stay in the sampler's 32 bits, and a server that keeps no
token history refuses the penalties instead of ignoring them."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from pydantic import ValidationError

from paged import DynamicGenerator, SamplingSettings
from paged.device.config import EngineConfig
from paged.server.app import _config_eos
from paged.server.errors import APIError
from paged.server.protocol import MAX_SEED, SAMPLING_EXTRAS, ChatCompletionRequest, CompletionRequest
from paged.server.translate import HISTORY_FIELDS, Context, chat_plan, completion_plan, settings_of
from paged.testing import ByteTokenizer, FakeEngine, tiny_config, tiny_model
from tests.server.helpers import DEADLINE_S, LiveServer

TOK = ByteTokenizer()
CTX = Context(tokenizer=TOK, max_seq_len=64, max_penalty_range=1024)
DEFAULTS = SamplingSettings()

# every extra sampling field -> a valid value other than SamplingSettings' default
EXTRAS = dict(min_p=0.05, typical=0.9, repetition_penalty=1.2, penalty_range=64, penalty_decay=8, top_a=0.2, tfs=0.95,
              smoothing_factor=0.3, min_temp=0.5, max_temp=1.5, temp_exponent=2.0, temperature_last=True, skew=0.5,
              xtc_probability=0.5, xtc_threshold=0.2, xtc_ignore_tokens=[10, 5], mirostat=True, mirostat_tau=2.0,
              mirostat_eta=0.2, mirostat_mu=3.0, dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3, dry_range=64,
              dry_max_ngram=10, dry_sequence_breakers=[46, 44], banned_tokens=[7, 3])
# OpenAI's fields -> (the SamplingSettings attribute, a value sent, what the attribute holds)
OPENAI = {"temperature": ("temperature", 0.7, 0.7), "top_p": ("top_p", 0.9, 0.9),
          "presence_penalty": ("presence_penalty", 0.5, 0.5), "frequency_penalty": ("frequency_penalty", -0.5, -0.5),
          "logit_bias": ("token_bias", {"65": 5.0, "7": -100.0}, ((7, -100.0), (65, 5.0))),
          "top_k": ("top_k", 40, 40), "cfg_scale": ("cfg_scale", 1.5, 1.5)}


def request(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="Hello", **fields)


def test_unset_fields_give_openais_defaults():
    s = settings_of(request())
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (1.0, 1.0, 0, 1.0)  # ExLlamaV2's differ
    assert (s.presence_penalty, s.frequency_penalty, s.token_bias, s.banned_tokens, s.cfg_scale) == (0, 0, (), (), None)
    for name in SAMPLING_EXTRAS:
        if name != "repetition_penalty":
            assert getattr(s, name) == getattr(DEFAULTS, name), name


@pytest.mark.parametrize("name", sorted(OPENAI))
def test_openai_fields_reach_the_sampler(name):
    attr, sent, held = OPENAI[name]
    assert getattr(settings_of(request(**{name: sent})), attr) == held


@pytest.mark.parametrize("top_k, held", [(-1, 0), (0, 0), (1, 1)])
def test_top_k_minus_one_is_off(top_k, held):
    assert settings_of(request(top_k=top_k)).top_k == held


def test_every_extra_reaches_its_sampler_setting():
    assert set(EXTRAS) == set(SAMPLING_EXTRAS), "a sampling extra without a case here"
    for name, value in EXTRAS.items():
        held = tuple(sorted(value)) if isinstance(value, list) else value
        assert held != getattr(DEFAULTS, name), f"{name}: pick a value other than the default"
        assert getattr(settings_of(request(**{name: value})), name) == held, name


def test_seeds_are_32_bit_and_choice_j_adds_j():
    jobs = completion_plan(request(seed=MAX_SEED, n=3), CTX).jobs
    assert [j.seed for j in jobs] == [MAX_SEED, 0, 1]
    for seed in (MAX_SEED + 1, 2**63, 2**70, -1):
        with pytest.raises(ValidationError) as e:
            request(seed=seed)
        assert e.value.errors()[0]["loc"] == ("seed",)


@pytest.mark.parametrize("name", sorted(HISTORY_FIELDS))
def test_penalties_without_a_token_history_are_refused(name):
    ctx = dataclasses.replace(CTX, max_penalty_range=0)
    value = HISTORY_FIELDS[name] + 0.5
    with pytest.raises(APIError) as e:
        completion_plan(request(**{name: value}), ctx)
    err = e.value
    assert (err.status, err.param, err.code) == (400, name, "unsupported")
    assert "--max_penalty_range > 0" in err.message
    completion_plan(request(**{name: HISTORY_FIELDS[name]}), ctx)  # neutral: asks for nothing
    completion_plan(request(**{name: value}), CTX)  # a server with a history takes it
    with pytest.raises(APIError):
        chat_plan(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **{name: value}),
                  dataclasses.replace(ctx, chat_template="{{ messages[0]['content'] }}"))


def test_a_reply_ends_at_the_models_config_eos_ids_too():
    """config.json's eos_token_id list (Llama 3.1's <|eom_id|> is only there) stops a reply as the tokenizer's EOS
    does, unless ignore_eos; the app takes it from the generator's model."""
    ctx = dataclasses.replace(CTX, eos_token_ids=(7, 9))
    assert completion_plan(request(), ctx).jobs[0].stop_tokens == {TOK.eos_token_id, 7, 9}
    assert completion_plan(request(ignore_eos=True), ctx).jobs[0].stop_tokens == set()
    model = tiny_model(dataclasses.replace(tiny_config(258), eos_token_ids=(5, 6)), seed=0, tokenizer=TOK)
    gen = DynamicGenerator(model, num_pages=8, page_size=8, max_batch_size=1, max_seq_len=16)
    assert _config_eos(gen) == (5, 6, TOK.eos_token_id)  # (Model.stop_token_ids: the config's and the EOS)


def test_the_server_passes_its_history_window_on():
    engine = FakeEngine(config=EngineConfig(num_pages=16, page_size=8, max_batch_size=2, max_chunk_size=16,
                                            max_seq_len=64, max_penalty_range=0), record=False)
    server = LiveServer(DynamicGenerator(tokenizer=TOK, engine=engine), model_name="fake")
    try:
        body = {"model": "fake", "prompt": "x", "max_tokens": 2, "presence_penalty": 0.5}
        r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=DEADLINE_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty", r.text
        assert r.json()["error"]["code"] == "unsupported"
    finally:
        server.stop()
