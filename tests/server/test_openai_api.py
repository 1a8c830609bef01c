"""The server through the official `openai` client (and raw HTTP where the client hides what is tested), against one
live server on 127.0.0.1 for the module: a tiny random-weight Llama with the byte tokenizer.

Greedy requests on random weights give deterministic but meaningless text, so tests compare the server with itself
(streamed and not, the same seed twice, a stop string taken from the unstopped text) rather than with fixed text."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import jsonschema
import openai
import pytest

from paged import DynamicGenerator
from paged.server.protocol import MAX_CHOICES
from paged.server.translate import SIMPLE_CHAT_TEMPLATE
from paged.testing import ByteTokenizer, InjectedFault, tiny_config, tiny_model
from tests.server.helpers import DEADLINE_S, LiveServer, wait_for, wait_idle

TOK = ByteTokenizer()
MODEL = tiny_model(tiny_config(TOK.vocab_size), seed=0, tokenizer=TOK)
MAX_SEQ_LEN = 1024
NO_EOS = {"ignore_eos": True}  # random weights may sample the end token at once: lengths are exact with this


@pytest.fixture(scope="module")
def server():
    gen = DynamicGenerator(MODEL, num_pages=700, page_size=16, max_batch_size=16, max_chunk_size=64,
                           max_seq_len=MAX_SEQ_LEN)
    s = LiveServer(gen, model_name="tiny", chat_template=SIMPLE_CHAT_TEMPLATE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai(timeout=DEADLINE_S)


def complete(client, prompt="Hello", **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    extra = {**NO_EOS, **kw.pop("extra_body", {})}
    return client.completions.create(model="tiny", prompt=prompt, extra_body=extra, **kw)


def stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


# ------------------------------------------------------------------------------------------------ basics
def test_models_health_metrics_and_unknown_routes(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert httpx.get(f"{server.base}/v1/models").json()["data"][0]["max_model_len"] == MAX_SEQ_LEN
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    r = httpx.get(f"{server.base}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    m = server.metrics()
    for name in ("paged_jobs_running", "paged_jobs_waiting", "paged_pages_used", "paged_pages_free",
                 "paged_pages_cached", "paged_prefix_cache_hits_total", "paged_prefix_cache_queries_total",
                 "paged_preemptions_total", "paged_spec_acceptance_rate", "paged_spec_accepted_tokens_total",
                 "paged_tokens_generated_total", "paged_prompt_tokens_total", "paged_generation_tokens_total",
                 "paged_time_to_first_token_seconds_count", "paged_time_per_output_token_seconds_count",
                 "paged_e2e_request_latency_seconds_count", "paged_requests_open"):
        assert name in m, name
    assert m["paged_pages_free"] + m["paged_pages_cached"] + m["paged_pages_used"] == m["paged_pages_total"]
    assert m["paged_pages_total"] == server.app.state.paged.generator.pool.num_pages  # the null page is not counted
    page = httpx.get(f"{server.base}/metrics").text
    assert "# HELP paged_pages_total KV-cache pages jobs can use (the reserved null page excluded)" in page
    for phase in ("schedule", "engine", "results"):  # the host loop's cumulative seconds, as generator.metrics()
        assert f"paged_host_loop_seconds_total{{phase={phase}}}" in m, phase


def test_null_is_the_default_for_optional_fields(server, client):
    """OpenAI's optional fields are nullable: the official client sends null for an argument given as None."""
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       logprobs=None, n=None, stream=None, top_logprobs=None, temperature=None)
    assert r.choices[0].logprobs is None and len(r.choices) == 1 and r.usage.completion_tokens >= 1
    nulls = {name: None for name in ("n", "stream", "echo", "logprobs", "min_tokens", "ignore_eos", "priority",
                                     "token_healing", "stream_options", "seed", "stop", "max_tokens")}
    # greedy (temperature is not among the nulls): with the default seed, sampling may draw the end token early
    r = httpx.post(f"{server.base}/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 0, **nulls},
                   timeout=DEADLINE_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text  # max_tokens' default
    r = httpx.post(f"{server.base}/v1/completions", json={"model": None, "prompt": "x"}, timeout=DEADLINE_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"  # a required field stays required


def test_requests_and_choices_are_counted_apart_and_paths_are_not_labels(server, client):
    before = server.metrics()
    complete(client, max_tokens=3, n=3, extra_body=NO_EOS)
    for i in range(3):
        assert httpx.get(f"{server.base}/v1/models/no-such-model-{i}").status_code == 404
    m = server.metrics()
    delta = lambda key: m.get(key, 0) - before.get(key, 0)  # noqa: E731
    assert delta("paged_requests_total{endpoint=/v1/completions,outcome=length}") == 1  # one request of n=3
    assert delta("paged_choices_total{endpoint=/v1/completions,finish_reason=length}") == 3
    # a path a client makes up is no new series: the route's template is the label
    assert delta("paged_requests_total{endpoint=/v1/models/{name:path},outcome=rejected}") == 3
    assert not any("no-such-model" in key for key in m)


def test_completion_streamed_and_not_agree(client):
    r = complete(client, max_tokens=12)
    (c,) = r.choices
    assert c.finish_reason == "length" and c.index == 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 12, 17)
    text, chunks = stream_text(complete(client, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])
    # the same prompt as token ids, and a list of prompts (one choice each, in order)
    assert complete(client, prompt=TOK.encode("Hello"), max_tokens=12).choices[0].text == c.text
    both = complete(client, prompt=["Hello", "Hi"], max_tokens=12)
    assert [x.index for x in both.choices] == [0, 1] and both.choices[0].text == c.text
    assert both.usage.prompt_tokens == 7 and both.usage.completion_tokens == 24


def test_chat_streamed_and_not_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                       extra_body=NO_EOS)
    (c,) = r.choices
    assert c.message.role == "assistant" and c.finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(b"<|system|>Be brief.\n<|user|>Hi there\n<|assistant|>")
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # max_completion_tokens is the newer name of max_tokens
    r2 = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0,
                                        extra_body=NO_EOS)
    assert r2.choices[0].message.content == c.message.content


def test_json_schema_response_parses_and_validates(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["ok", "tag", "n"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A JSON object, please."}], max_tokens=400,
        temperature=1.0, seed=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    (c,) = r.choices
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.message.content), schema)
    # any JSON object: sampled, the tiny model closes one within a few dozen tokens for most seeds (greedy, it
    # writes whitespace forever, which JSON allows), so of 4 choices those that stop must each parse as an object
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON"}], max_tokens=200,
                                       temperature=1.0, seed=0, n=4, response_format={"type": "json_object"})
    done = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert done, [c.message.content for c in r.choices]
    assert all(isinstance(json.loads(text), dict) for text in done), done


def test_n_choices_share_the_prompt_pages(server, client):
    r = complete(client, prompt="Tell me", n=2, max_tokens=8, temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 16
    assert r.choices[0].text == complete(client, prompt="Tell me", max_tokens=8, temperature=1.0, seed=3).choices[
        0].text  # choice i samples with seed + i
    # while two choices of a 40-token prompt run, their two full prompt pages are the same pages
    gen = server.app.state.paged.generator
    body = {"model": "tiny", "prompt": "x" * 40, "n": 2, "max_tokens": 900, "stream": True, **NO_EOS}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=DEADLINE_S) as resp:
        lines = resp.iter_lines()
        next(ln for ln in lines if ln.startswith("data: {"))
        with gen.lock:
            jobs = [j for j in gen.active if j.prompt_len == 40]
            assert len(jobs) == 2
            assert jobs[0].pages[:2] == jobs[1].pages[:2]
    wait_idle(server)


def test_stop_string_ends_the_text_before_it(client):
    kw = dict(prompt="Once", max_tokens=60, temperature=1.0, seed=5)
    text = complete(client, **kw).choices[0].text
    starts = [i for i in range(4, len(text) - 2)
              if text[i:i + 2].isascii() and text[i:i + 2].isprintable() and text[i:i + 2] not in text[:i + 1]]
    assert starts, f"no printable two-character stop string in {text!r}"
    stop = text[starts[0]:starts[0] + 2]
    r = complete(client, stop=[stop, "never appears"], **kw)
    assert r.choices[0].text == text[:starts[0]] and r.choices[0].finish_reason == "stop"
    streamed, chunks = stream_text(complete(client, stop=stop, stream=True, **kw))
    assert streamed == text[:starts[0]] and chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        lps = [t.logprob for t in item.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert item.token == item.top_logprobs[0].token  # greedy: the most likely token
        assert item.logprob == item.top_logprobs[0].logprob  # the same number in both places
        b = bytes(item.bytes)
        try:  # a token that is part of a character is written as its bytes, OpenAI's way
            assert item.token == b.decode("utf-8")
        except UnicodeDecodeError:
            assert item.token == "bytes:" + "".join(f"\\x{x:02x}" for x in b)
    r = complete(client, max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    chunks = list(complete(client, max_tokens=5, logprobs=2, stream=True))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs) == 5


def test_logprobs_of_tokens_that_are_parts_of_characters(client):
    """The byte tokenizer splits "é" into two tokens: each is written as its bytes (two tokens never share a text,
    so the top alternatives keep their own keys), and its text offset is the character it is part of, the same
    streamed or not."""
    kw = dict(prompt="Accents", max_tokens=8, temperature=0, logprobs=3, extra_body={"choice": ["héé!"]})
    r = complete(client, **kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "héé!"
    assert lp.tokens == ["h", "bytes:\\xc3", "bytes:\\xa9", "bytes:\\xc3", "bytes:\\xa9", "!"]
    assert lp.text_offset == [0, 1, 1, 2, 2, 3]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob  # the chosen token among the top ones, with the same number
    chunks = list(complete(client, stream=True, **kw))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    echoed = complete(client, **{**kw, "logprobs": None}, echo=True)
    assert echoed.choices[0].text == "Accentshéé!"


def test_same_seed_same_text(client):
    kw = dict(prompt="Seeded", max_tokens=16, temperature=1.0, top_p=0.95)
    a = complete(client, seed=11, **kw).choices[0].text
    b = complete(client, seed=11, **kw).choices[0].text
    assert a == b
    assert stream_text(complete(client, seed=11, stream=True, **kw))[0] == a


def test_prompt_cache_hits_show_in_usage_and_metrics(server, client):
    before = server.metrics()["paged_prefix_cache_hits_total"]
    prompt = "A shared preamble that spans several pages of sixteen tokens each. " * 2
    complete(client, prompt=prompt, max_tokens=2)
    r = complete(client, prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16 * 8
    assert server.metrics()["paged_prefix_cache_hits_total"] >= before + 8


# ------------------------------------------------------------------------------------------------ batching
def test_32_concurrent_streams_complete_in_one_batch(server):
    aclient = server.async_openai(timeout=DEADLINE_S)
    before = server.metrics()

    async def one(i):
        stream = await aclient.completions.create(model="tiny", prompt=f"Request number {i}", max_tokens=24,
                                                  temperature=0, stream=True, stream_options={"include_usage": True},
                                                  extra_body=NO_EOS)
        text, finish, usage = "", None, None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            usage = ch.usage or usage
        return text, finish, usage.completion_tokens

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    assert [(f, n) for _, f, n in results] == [("length", 24)] * 32
    after = wait_idle(server)
    steps = after["paged_step_running_jobs_count"] - before["paged_step_running_jobs_count"]
    single = after['paged_step_running_jobs_bucket{le=1.0}'] - before['paged_step_running_jobs_bucket{le=1.0}']
    assert steps > single, "no step ran more than one job: the requests were not batched"
    assert after['paged_step_running_jobs_bucket{le=8.0}'] < after["paged_step_running_jobs_count"]  # > 8 at once


def test_a_client_that_disconnects_frees_its_pages(server):
    before = server.metrics()
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 1000, "stream": True, **NO_EOS}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=DEADLINE_S) as resp:
        got = 0
        for line in resp.iter_lines():
            got += line.startswith("data: {")
            if got == 3:
                break  # leaving the block closes the connection mid-stream
    after = wait_idle(server)
    generated = after["paged_tokens_generated_total"] - before["paged_tokens_generated_total"]
    assert generated < 1000, "the job ran to its end: the disconnect did not cancel it"
    key = "paged_requests_total{endpoint=/v1/completions,outcome=cancelled}"
    assert after[key] == before.get(key, 0) + 1


# ------------------------------------------------------------------------------------------------ errors
BAD = [  # (body changes, the field the 400 must name; None: no field)
    ({"stop": 5}, "stop"),  # a union-typed field: pydantic's member tags ("stop.str") are not named
    ({"prompt": 5}, "prompt"),
    ({"logit_bias": {"65": "a"}}, "logit_bias"),  # a dict's key is not a field
    ({"seed": 2**70}, "seed"),  # the sampler's seeds are 32-bit
    ({"seed": -1}, "seed"),
    ({"banned_tokens": list(range(TOK.vocab_size))}, "banned_tokens"),  # enqueue()'s errors name the field too
    ({"min_tokens": 2, "banned_tokens": [t for t in range(TOK.vocab_size) if t != TOK.eos_token_id]}, "min_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": 1.5}, "n"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x" * (MAX_SEQ_LEN + 10)}, "prompt"),
    ({"max_tokens": MAX_SEQ_LEN}, "max_tokens"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": "a\ud800"}, "regex"),  # (a lone surrogate: had been a 500)
    ({"grammar": 'start: "\ud800"'}, "grammar"),
    ({"logit_bias": {"65": 1e300}}, "logit_bias"),  # finite, but infinite in the sampler's float32: had been a 200
    ({"smoothing_factor": 1e39}, "smoothing_factor"),
    ({"stop": [""]}, "stop"),
    ({"min_tokens": 50}, "min_tokens"),
    ({"lora": "nobody"}, "lora"),
    ({"cfg_scale": 1.5}, "cfg_scale"),
    ({"cfg_scale": 1.5, "negative_prompt": ""}, "negative_prompt"),  # (had named the prompt)
    ({"cfg_scale": 1.5, "negative_prompt": "x" * (MAX_SEQ_LEN + 10)}, "negative_prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop": "\ud800"}, "stop"),  # a lone surrogate: no output can hold it (as in regex, choice, the prompt)
    ({"banned_strings": ["ok", "\ud800"]}, "banned_strings"),
    ({"regex": "(a{1000}){1000}"}, "regex"),  # too large for llguidance's lexer: found when the filter is built
    ({"prompt": ["a"] * 17, "n": 128}, "n"),  # 2176 choices, past MAX_CHOICES: refused before any job is built
    ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "prompt"),
]


def test_bad_requests_get_400_naming_the_field_while_another_stream_goes_on(server, client):
    chunks: list = []
    error: list = []

    def consume():
        try:
            chunks.extend(complete(client, prompt="Unharmed", max_tokens=300, stream=True))
        except Exception as e:  # noqa: BLE001 (reported by the assertion below)
            error.append(e)

    reader = threading.Thread(target=consume)
    reader.start()
    wait_for(lambda: chunks or error, "the good stream's first chunk")
    for change, param in BAD:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, **change}
        r = httpx.post(f"{server.base}/v1/completions", content=json.dumps(body), timeout=DEADLINE_S,
                       headers={"content-type": "application/json"})  # (ASCII escapes carry a lone surrogate)
        assert r.status_code == 400, (change, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], (change, err)
    r = httpx.post(f"{server.base}/v1/chat/completions", timeout=DEADLINE_S,
                   json={"model": "tiny", "messages": [{"role": "user", "content": 5}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
    r = httpx.post(f"{server.base}/v1/completions", content=b'{"model": "tiny", "prompt": }', timeout=DEADLINE_S,
                   headers={"content-type": "application/json"})
    err = r.json()["error"]  # the offset of the "}" where a value should be; no field
    assert r.status_code == 400 and err["param"] is None, err
    assert err["message"].startswith("invalid JSON at position 28"), err
    for content, headers, said in (  # bodies FastAPI does not parse: what is wrong with them, not a pydantic error
            (b'{"model": "tiny", "prompt": "\xff"}', {"content-type": "application/json"},
             "the body is not UTF-8 (byte 0xff at position 29)"),
            (b"[" * 5000 + b"]" * 5000, {"content-type": "application/json"}, "nested deeper"),
            (b'{"model": "tiny", "prompt": "x"}', {"content-type": "application/x-www-form-urlencoded"},
             "sent with Content-Type: application/json (this one came as 'application/x-www-form-urlencoded')")):
        r = httpx.post(f"{server.base}/v1/completions", content=content, headers=headers, timeout=DEADLINE_S)
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.base}/v1/chat/completions", timeout=DEADLINE_S, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 * MAX_SEQ_LEN})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert r.json()["error"]["message"].startswith("max_completion_tokens=10240 plus"), r.text
    schema = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "s", "schema": schema}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * MAX_SEQ_LEN}])
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model"
    reader.join(DEADLINE_S)
    assert not error, error
    text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    assert finish == "length" and text
    m = wait_idle(server)
    assert m["paged_pages_free"] + m["paged_pages_cached"] == m["paged_pages_total"]  # no page leaked


def test_a_job_failing_mid_stream_ends_its_own_stream_only(server, client):
    gen = server.app.state.paged.generator
    armed = threading.Event()
    raised = []

    def fault(point):  # the next masks of the filtered job fail (the batch's call, then its own retry): it ends
        if point == "masks" and armed.is_set():
            raised.append(point)
            if len(raised) == 2:
                armed.clear()
            raise InjectedFault("injected mask failure")

    plain: list = []
    reader = threading.Thread(target=lambda: plain.extend(complete(client, prompt="Bystander", max_tokens=200,
                                                                   stream=True)))
    gen.fault_hook = fault
    try:
        reader.start()
        wait_for(lambda: plain, "the bystander's first chunk")
        armed.set()
        with pytest.raises(openai.APIError, match="injected mask failure"):
            list(complete(client, prompt="Filtered", max_tokens=50, stream=True, extra_body={"regex": "[a-z]+"}))
        reader.join(DEADLINE_S)
    finally:
        gen.fault_hook = None
    assert plain[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text) > 0 for c in plain) > 0
    assert server.metrics()["paged_requests_total{endpoint=/v1/completions,outcome=error}"] >= 1
    wait_idle(server)


def test_a_job_failing_in_a_non_streamed_request_gets_500_job_failed(server, client):
    gen = server.app.state.paged.generator
    raised = []

    def fault(point):  # the job's masks fail twice (the batch's call, then its own retry): it ends with an error
        if point == "masks" and len(raised) < 2:
            raised.append(point)
            raise InjectedFault("injected mask failure")

    gen.fault_hook = fault
    try:
        with pytest.raises(openai.InternalServerError) as e:
            complete(client, prompt="Filtered", max_tokens=20, extra_body={"regex": "[a-z]+"})
    finally:
        gen.fault_hook = None
    assert e.value.status_code == 500 and e.value.body["code"] == "job_failed", e.value.body
    assert "injected mask failure" in e.value.body["message"] and e.value.body["type"] == "server_error"
    assert complete(client, prompt="Filtered", max_tokens=4, extra_body={"regex": "[a-z]+"}).choices[0].text
    wait_idle(server)


# ------------------------------------------------------------------------------------------------ extras
def test_extra_body_fields(client):
    choice = complete(client, max_tokens=20, extra_body={"choice": ["alpha", "beta"]}).choices[0]
    assert choice.text in ("alpha", "beta") and choice.finish_reason == "stop"
    r = complete(client, max_tokens=20, temperature=1.0, seed=1, extra_body={"regex": "[a-c]{3}-[0-9]"})
    assert re.fullmatch(r"[a-c]{3}-[0-9]", r.choices[0].text)
    r = complete(client, max_tokens=40, extra_body={"grammar": 'start: "x" ("y" | "z")'})
    assert r.choices[0].text in ("xy", "xz")
    r = complete(client, max_tokens=30, temperature=1.0, seed=2, extra_body={"banned_strings": ["e", "a"]})
    assert not {"e", "a", "E", "A"} & set(r.choices[0].text) and r.usage.completion_tokens == 30
    sampled = dict(top_k=40, min_p=0.05, repetition_penalty=1.1, dry_multiplier=0.8, xtc_probability=0.5,
                   mirostat=True, min_tokens=5, typical=0.9)
    r = complete(client, max_tokens=12, temperature=1.0, seed=4, extra_body=sampled)
    assert r.usage.completion_tokens == 12
    r = complete(client, max_tokens=6, temperature=0, extra_body={"negative_prompt": "Goodbye", "cfg_scale": 1.5})
    assert r.usage.completion_tokens == 6
    # logit_bias: +100 on one token makes greedy pick it every time (the byte tokenizer's 90 is "Z")
    r = complete(client, max_tokens=6, temperature=0, logit_bias={"90": 100})
    assert r.choices[0].text == "ZZZZZZ"
    # the penalties: greedy, the tiny model falls into a loop of two tokens, which each of them breaks
    plain = complete(client, max_tokens=24, temperature=0).choices[0].text
    for penalty in ({"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"extra_body": {"repetition_penalty": 1.5}}):
        assert complete(client, max_tokens=24, temperature=0, **penalty).choices[0].text != plain, penalty
    # banned tokens against a grammar that allows only them: the constraints leave nothing, a content filter
    r = complete(client, max_tokens=5, extra_body={"regex": "q+", "banned_tokens": [ord("q")]})
    assert r.choices[0].finish_reason == "content_filter"
    # ... and two filters that exclude each other (their allowed sets intersect: nothing is left)
    r = complete(client, max_tokens=5, extra_body={"regex": "a+", "choice": ["b"]})
    assert r.choices[0].finish_reason == "content_filter" and r.choices[0].text == ""
    # a choice of thousands of options (one lexeme: as parser rules llguidance stopped at 2000)
    options = [f"option {i}" for i in range(5000)]
    assert complete(client, max_tokens=12, extra_body={"choice": options}).choices[0].text in options
    # a constraint that outgrows llguidance's lexer only once decoding has begun: a 400 naming its field
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, max_tokens=5, extra_body={"regex": "(x|y)(a{1000}){1000}"})
    assert e.value.body["param"] == "regex" and e.value.body["code"] == "constraint_too_large", e.value.body
    with pytest.raises(openai.APIError, match="too large for llguidance"):
        list(complete(client, max_tokens=5, stream=True, extra_body={"regex": "(x|y)(a{1000}){1000}"}))
