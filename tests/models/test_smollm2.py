"""The embedded SmolLM2-135M-Instruct GGUF against transformers loading the same file (slow tier)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.real_weights

N_NEW = 32
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Paris is the capital of",
]


@pytest.fixture(scope="module")
def ours():
    from models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from models.embedded import embedded_gguf_path

    path = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    return model


def hf_greedy(hf, ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


def engine_greedy(model, ids: list[int]) -> list[int]:
    from paged.device.batch import RowInput
    from paged.device.engine import Engine

    engine = Engine(model, num_pages=8, page_size=64, max_batch_size=1, max_chunk_size=64, max_seq_len=256)
    pages = list(range(1, 8))
    pos = 0
    while pos < len(ids) - 1:
        chunk = ids[pos : min(pos + 64, len(ids) - 1)]
        engine.run([RowInput(tokens=chunk, start_pos=pos, pages=pages, sample=False)])
        pos += len(chunk)
    out, last = [], ids[-1]
    for _ in range(N_NEW):
        last = int(engine.run([RowInput(tokens=[last], start_pos=pos, pages=pages)]).token[0])
        pos += 1
        out.append(last)
    return out


def test_config_and_tokenizer(ours):
    cfg = ours.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert ours.tokenizer.eos_token_id == 2 and ours.tokenizer.bos_token_id == 1


def test_logits_match_transformers(ours, hf):
    import jax.numpy as jnp
    import torch

    from models.llama import forward

    ids = ours.tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.float().numpy()[0]
    got = np.asarray(forward(ours.params, ours.config, jnp.asarray([ids], jnp.int32)))[0]
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("prompt", PROMPTS + ["<chat>"])
def test_greedy_tokens_identical(ours, hf, prompt):
    tok = ours.tokenizer
    if prompt == "<chat>":
        text = tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}])
        ids = tok.encode(text, encode_special_tokens=True)
        assert ids[0] == tok.bos_token_id  # <|im_start|> is one special token
    else:
        ids = tok.encode(prompt)
    assert engine_greedy(ours, ids) == hf_greedy(hf, ids)
