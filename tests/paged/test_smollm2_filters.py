"""Constrained decoding on the embedded SmolLM2-135M-Instruct (slow tier): JSON-schema, regex, Lark grammar and
choice filters, greedy and sampled over several seeds, inside a batch of unfiltered jobs whose outputs must not
change."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.real_weights

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "height_m", "role", "address", "tags"],
    "additionalProperties": False,
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
LIST_GRAMMAR = r"""
start: "[" item ("," " "? item)* "]"
item: NUMBER | WORD
NUMBER: /[0-9]{1,3}/
WORD: /[a-z]{1,8}/
"""
LIST_RE = r"\[([0-9]{1,3}|[a-z]{1,8})(, ?([0-9]{1,3}|[a-z]{1,8}))*\]"


@pytest.fixture(scope="module")
def model():
    from models import load_model

    return load_model("smollm2-135m")


def prompt_ids(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), encode_special_tokens=True)


def make_generator(model):
    from paged import DynamicGenerator

    return DynamicGenerator(model, num_pages=160, page_size=16, max_batch_size=6, max_chunk_size=128,
                            max_seq_len=512)


def plain_jobs(tok, seed):
    from paged import Job, SamplingSettings

    hot = SamplingSettings(temperature=0.9, top_k=0, top_p=0.95)
    return [Job(prompt_ids(tok, "Name a colour."), 12, gen_settings=SamplingSettings.greedy(), identifier="plain-g",
                stop_conditions=[tok.eos_token_id]),
            Job(prompt_ids(tok, "Say hello in French."), 12, gen_settings=hot, seed=seed, identifier="plain-s",
                stop_conditions=[tok.eos_token_id])]


@pytest.mark.parametrize("seed", [None, 1, 2, 3])  # None: greedy
def test_filtered_jobs_in_a_batch_of_plain_ones(model, seed):
    import jsonschema
    import lark

    from paged import Job, SamplingSettings
    from paged.filters import ChoiceFilter, GrammarFilter, JsonSchemaFilter, RegexFilter
    from paged.testing import drain

    tok = model.tokenizer
    settings = SamplingSettings.greedy() if seed is None else SamplingSettings(temperature=0.9, top_k=0, top_p=0.95)
    gen = make_generator(model)
    gen.enqueue(plain_jobs(tok, seed or 0))
    alone = {k: v["full_completion"] for k, v in drain(gen).finals.items()}

    def job(text, filters, n, ident):
        return Job(prompt_ids(tok, text), n, gen_settings=settings, seed=seed, filters=filters, identifier=ident,
                   stop_conditions=[tok.eos_token_id])

    filtered = [
        job("Describe a user of a website as JSON.", JsonSchemaFilter(SCHEMA), 160, "json"),
        job("When did the first moon landing happen? Give the date.", RegexFilter(DATE), 16, "date"),
        job("List a few things.", GrammarFilter(LIST_GRAMMAR), 40, "list"),
        job("Is the sky blue?", ChoiceFilter(["yes", "no", "it depends"]), 8, "choice"),
    ]
    gen.enqueue(plain_jobs(tok, seed or 0) + filtered)
    c = drain(gen)
    for k, text in alone.items():  # the unfiltered jobs are unchanged by their filtered neighbours
        assert c.finals[k]["full_completion"] == text
    for ident in ("json", "date", "list", "choice"):
        assert c.finals[ident]["eos_reason"] in ("end_filter", "stop_token"), c.finals[ident]
    jsonschema.validate(json.loads(c.finals["json"]["full_completion"]), SCHEMA)
    assert re.fullmatch(DATE, c.finals["date"]["full_completion"])
    assert re.fullmatch(LIST_RE, c.finals["list"]["full_completion"])
    lark.Lark(LIST_GRAMMAR).parse(c.finals["list"]["full_completion"])  # the same grammar, an independent parser
    assert c.finals["choice"]["full_completion"] in ("yes", "no", "it depends")
    assert not gen.active and gen.pool.num_referenced == 0
    gen.pool.check(expected_refs={})
