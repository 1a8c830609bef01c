"""The seed documents' loops, run as written (modulo imports) on the embedded SmolLM2-135M-Instruct (slow tier)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.real_weights


@pytest.fixture(scope="module")
def generator():
    from models import load_model
    from paged import DynamicGenerator

    model = load_model("smollm2-135m")
    return DynamicGenerator(model, num_pages=128, page_size=16, max_batch_size=4, max_chunk_size=128,
                            max_seq_len=512)


def enqueue_three(generator, max_new_tokens=24):
    from paged import Job, SamplingSettings

    tok = generator.tokenizer
    questions = ["What is 2+2?", "Name a colour.", "Say hello in French."]
    for i, q in enumerate(questions):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), encode_special_tokens=True)
        generator.enqueue(Job(ids, max_new_tokens, identifier=i, stop_conditions=[tok.eos_token_id],
                              gen_settings=SamplingSettings.greedy()))


def test_basic_iterate_loop(generator, capsys):
    enqueue_three(generator)
    completions = {}
    while generator.num_remaining_jobs() > 0:
        results = generator.iterate()
        for result in results:
            if result["eos"]:
                identifier = result["identifier"]
                completions[identifier] = result["full_completion"]
                print(f"Job {identifier} completed: {result['full_completion'][:100]}...")
    assert sorted(completions) == [0, 1, 2]
    assert "4" in completions[0] or "four" in completions[0].lower()
    assert "Job 2 completed" in capsys.readouterr().out


def test_streaming_output_loop(generator, capsys):
    enqueue_three(generator)
    while generator.num_remaining_jobs() > 0:
        results = generator.iterate()
        for result in results:
            if result["stage"] == "streaming":
                print(result["text"], end="", flush=True)
            if result["eos"]:
                print(f"\n--- Job {result['identifier']} done ---")
                print(f"  Tokens: {result['new_tokens']}")
                print(f"  Prefill: {result['time_prefill']:.2f}s")
                print(f"  Generate: {result['time_generate']:.2f}s")
    out = capsys.readouterr().out
    assert out.count("done ---") == 3 and "Tokens:" in out


def test_bulk_processing_with_timing_and_prompt_cache(generator):
    results_list = []
    enqueue_three(generator)
    while generator.num_remaining_jobs() > 0:
        results = generator.iterate()
        for result in results:
            if result["eos"]:
                results_list.append({
                    "id": result["identifier"],
                    "text": result["full_completion"],
                    "tokens": result["new_tokens"],
                    "time_enqueued": result["time_enqueued"],
                    "time_prefill": result["time_prefill"],
                    "time_generate": result["time_generate"],
                    "cached_tokens": result["cached_tokens"],
                })
    total_tokens = sum(r["tokens"] for r in results_list)
    assert len(results_list) == 3 and total_tokens > 3
    # the same chat prompts ran in the earlier tests: the system-prompt pages come from the prompt cache
    assert all(r["cached_tokens"] >= 32 for r in results_list)
    assert generator.metrics()["prefix_hits"] > 0


@pytest.fixture(scope="module")
def hf():
    """transformers' model loaded from the same embedded GGUF: the independent oracle."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from models.embedded import embedded_gguf_path

    path = embedded_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def test_generate_api_matches_transformers_greedy(generator, hf):
    import torch

    from paged import Job, SamplingSettings
    from paged.testing import drain

    tok = generator.tokenizer
    prompt = "The capital of France is"
    text = generator.generate(prompt, max_new_tokens=8, gen_settings=SamplingSettings.greedy())
    ids = tok.encode(prompt)  # what generate() encodes (no BOS by default)
    # the same job through the job API, for its token ids (generate()'s results reach it alone, whoever steps)
    generator.enqueue(Job(ids, 8, gen_settings=SamplingSettings.greedy(), identifier="ids"))
    streamed = [t for r in drain(generator).results if r["identifier"] == "ids" and r["stage"] == "streaming"
                for t in r["token_ids"]]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[0, len(ids) :].tolist()
    assert len(want) == 8 and streamed == want, (streamed, want)
    assert text == tok.decode(want)
    assert "Paris" in text, (ids, text)
