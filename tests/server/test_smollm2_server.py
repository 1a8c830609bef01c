"""The server on the embedded SmolLM2-135M-Instruct and its ChatML template (slow tier): a chat completion through
the `openai` client is the generator's own greedy reply to the same templated prompt, streamed or not."""

from __future__ import annotations

import pytest

from tests.server.helpers import DEADLINE_S, LiveServer, wait_idle

pytestmark = pytest.mark.real_weights
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served():
    from models import load_model
    from paged import DynamicGenerator, Job, SamplingSettings
    from paged.testing import drain

    gen = DynamicGenerator(load_model("smollm2-135m"), num_pages=96, page_size=16, max_batch_size=4,
                           max_chunk_size=128, max_seq_len=512)
    tok = gen.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), encode_special_tokens=True)
    gen.enqueue(Job(ids, 40, gen_settings=SamplingSettings.greedy(), stop_conditions=[tok.eos_token_id],
                    identifier="direct"))
    direct = drain(gen).finals["direct"]
    s = LiveServer(gen, model_name="smollm2-135m")
    yield s, direct, len(ids)
    s.stop()


def test_chat_template_reply_is_the_generators_own(served):
    server, direct, prompt_len = served
    client = server.openai(timeout=DEADLINE_S)
    r = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=40, temperature=0)
    (c,) = r.choices
    assert c.message.content == direct["full_completion"] and "Paris" in c.message.content
    assert c.finish_reason == {"stop_token": "stop", "max_new_tokens": "length"}[direct["eos_reason"]]
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == direct["new_tokens"]
    assert "<|im_end|>" not in c.message.content  # the end token stops the reply and is not part of it
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=40,
                                                 temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    # the prompt's pages were cached by the first request: the second reports them
    assert client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=2,
                                          temperature=0).usage.prompt_tokens_details.cached_tokens >= 16
    # ExLlamaV2's sampler extras, their token sets taken from the real tokenizer
    r = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=12, temperature=0.8,
                                       seed=1, extra_body={"dry_multiplier": 0.8, "xtc_probability": 0.5,
                                                           "banned_strings": ["Paris"]})
    assert "paris" not in r.choices[0].message.content.lower()
    wait_idle(server)
