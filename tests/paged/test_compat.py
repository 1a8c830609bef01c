"""`paged.compat`: ExLlamaV2's names over the native classes. The seed documents' usage loops run with only the
imports and the model-loading lines changed, settings map onto `SamplingSettings` exactly, and what is not
implemented raises `UnsupportedFeatureError` naming the setting."""

from __future__ import annotations

import asyncio
import math
import warnings

import numpy as np
import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.compat import (
    WHOLE_CONTEXT,
    ExLlamaV2Cache,
    ExLlamaV2DynamicGenerator,
    ExLlamaV2DynamicGeneratorAsync,
    ExLlamaV2DynamicJob,
    ExLlamaV2DynamicJobAsync,
    ExLlamaV2MMEmbedding,
    ExLlamaV2Sampler,
)
from paged.errors import (
    InvalidConfigError,
    InvalidConfigTypeError,
    InvalidJobError,
    InvalidSettingsError,
    UnsupportedFeatureError,
)
from paged.filters import ChoiceFilter, RegexFilter
from paged.testing import ByteTokenizer, tiny_config, tiny_model

TOK = ByteTokenizer()
CFG = tiny_config(TOK.vocab_size, max_position_embeddings=256)
MODEL = tiny_model(CFG, seed=3, tokenizer=TOK)
SMALL = dict(max_batch_size=4, max_chunk_size=16, page_size=8)


@pytest.fixture(scope="module")
def generator():
    # --- the model-loading lines (ExLlamaV2: config, model, cache, load_autosplit, tokenizer) ---
    model = MODEL
    tokenizer = model.tokenizer
    cache = ExLlamaV2Cache(model, max_seq_len=1024, lazy=True)
    # --- ExLlamaV2 code from here on, unchanged (small batch limits to keep the test's compilations few) ---
    return ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, **SMALL)


def enqueue_prompts(generator, tokenizer):
    # ExLlamaV2-style job creation (a (1, n) array prompt, as ExLlamaV2's tokenizer returns)
    prompts = ["Once upon a time", "The quick brown fox", "Hello"]
    for idx, prompt in enumerate(prompts):
        input_ids = np.asarray([tokenizer.encode(prompt)])
        job = ExLlamaV2DynamicJob(
            input_ids=input_ids,
            max_new_tokens=12,
            stop_conditions=[tokenizer.eos_token_id],
            gen_settings=ExLlamaV2Sampler.Settings(),
            identifier=idx,
            seed=idx,
        )
        generator.enqueue(job)
    return prompts


def test_cache_budget_becomes_the_page_pool(generator):
    assert generator.pool.num_pages == 1024 // 8 and generator.max_seq_len == 256


def test_seed_basic_iterate_loop(generator, capsys):
    enqueue_prompts(generator, TOK)
    # --- 001: Basic Iterate Loop, verbatim ---
    completions = {}

    while generator.num_remaining_jobs() > 0:
        results = generator.iterate()
        for result in results:
            if result["eos"]:
                identifier = result["identifier"]
                completions[identifier] = result["full_completion"]
                print(f"Job {identifier} completed: {result['full_completion'][:100]}...")
    # ---
    assert sorted(completions) == [0, 1, 2]
    assert capsys.readouterr().out.count("completed:") == 3
    check_clean(generator)


def test_seed_streaming_output_loop(generator, capsys):
    enqueue_prompts(generator, TOK)
    # --- 001: Streaming Output, verbatim ---
    while generator.num_remaining_jobs() > 0:
        results = generator.iterate()
        for result in results:
            if result["stage"] == "streaming":
                # Print incremental text as it is generated
                print(result["text"], end="", flush=True)
            elif result["eos"]:
                print(f"\n--- Job {result['identifier']} done ---")
                print(f"  Tokens: {result['new_tokens']}")
                print(f"  Prefill: {result['time_prefill']:.2f}s")
                print(f"  Generate: {result['time_generate']:.2f}s")
    # ---
    out = capsys.readouterr().out
    # as in ExLlamaV2, the final result is a "streaming" one too, so (as written) the elif branch never prints
    assert out.count("Tokens:") == 0 and len(out) > 0
    check_clean(generator)


def test_seed_bulk_processing_with_timing(generator, capsys):
    enqueue_prompts(generator, TOK)
    # --- 001: Bulk Processing with Timing, verbatim ---
    results_list = []

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
                })

    # Compute aggregate statistics
    total_tokens = sum(r["tokens"] for r in results_list)
    total_time = sum(r["time_generate"] for r in results_list)
    print(f"Processed {len(results_list)} jobs, {total_tokens} tokens")
    # ---
    assert len(results_list) == 3 and total_tokens > 3 and total_time >= 0
    assert "Processed 3 jobs" in capsys.readouterr().out
    check_clean(generator)


def test_seed_warmup_then_generate(generator):
    # 003: warm up (ExLlamaV2 generates 32 tokens and resets the page table), then generate()
    generator.warmup()
    generator.reset_page_table()
    out = generator.generate(prompt="Once upon a time,", max_new_tokens=8,
                             gen_settings=ExLlamaV2Sampler.Settings.greedy())
    assert out.startswith("Once upon a time,")  # completion_only=False by default, as in ExLlamaV2
    only = generator.generate(prompt="Once upon a time,", max_new_tokens=8, completion_only=True,
                              gen_settings=ExLlamaV2Sampler.Settings.greedy())
    assert out == "Once upon a time," + only
    check_clean(generator)


def check_clean(gen):
    assert not gen.active and not gen.pending and gen.pool.num_referenced == 0
    gen.pool.check(expected_refs={})


# ---------------------------------------------------------------------------------------------- settings mapping
def test_settings_defaults_and_mapping():
    s = ExLlamaV2Sampler.Settings()
    assert (s.temperature, s.top_k, s.top_p, s.token_repetition_penalty, s.token_repetition_range) == (
        0.8, 50, 0.8, 1.025, -1)
    n = s.to_native()
    assert n == SamplingSettings(temperature=0.8, top_k=50, top_p=0.8, repetition_penalty=1.025,
                                 penalty_range=WHOLE_CONTEXT)
    s.top_p = 0  # ExLlamaV2: 0 disables top-p
    s.token_repetition_range = 64
    s.token_frequency_penalty = 0.2
    s.token_presence_penalty = 0.1
    n = s.to_native()
    assert (n.top_p, n.penalty_range, n.frequency_penalty, n.presence_penalty) == (1.0, 64, 0.2, 0.1)
    g = ExLlamaV2Sampler.Settings.greedy()
    assert (g.temperature, g.top_k, g.top_p, g.token_repetition_penalty) == (1.0, 1, 0.0, 1.0)
    assert ExLlamaV2Sampler.Settings(temperature=0.005).to_native().is_greedy  # < 0.01 is greedy


def test_settings_clone_and_token_sets():
    s = ExLlamaV2Sampler.Settings()
    s.disallow_tokens(TOK, [5, 6])
    c = s.clone()
    c.disallow_tokens(TOK, [7])
    c.temperature = 0.3
    assert s.to_native().banned_tokens == (5, 6) and c.to_native().banned_tokens == (5, 6, 7)
    assert s.temperature == 0.8
    a = ExLlamaV2Sampler.Settings()
    a.allow_tokens(TOK, [65, 66])
    banned = set(a.to_native().banned_tokens)
    assert banned == set(range(TOK.vocab_size)) - {65, 66}
    dense = np.zeros(TOK.vocab_size + 6, np.float32)  # ExLlamaV2's bias is a padded-vocab vector
    dense[3], dense[9] = 2.0, -math.inf
    assert dict(ExLlamaV2Sampler.Settings(token_bias=dense).to_native().token_bias) == {3: 2.0, 9: -math.inf}
    # the vector ExLlamaV2's allow_tokens builds: -inf in the padding too, which the vocabulary size drops (it had
    # been refused: "token_bias id ... got 258"); one (1, vocab) row is the same vector
    padded = np.full((1, TOK.vocab_size + 6), -math.inf, np.float32)
    padded[0, [65, 66]] = 0.0
    native = ExLlamaV2Sampler.Settings(token_bias=padded).to_native(TOK.vocab_size)
    assert set(dict(native.token_bias)) == set(range(TOK.vocab_size)) - {65, 66}


def test_bad_settings_are_named_errors_and_nothing_set_is_ignored():
    """(They had been a bare ValueError, a silently flattened matrix, a top_p of NumPy's 0 taken for a value, and
    attributes that are no setting kept and ignored.)"""
    for bias, message in (("abc", "token_bias must be a dict"), (np.ones((2, 3)), r"got shape \(2, 3\)")):
        with pytest.raises(InvalidSettingsError, match=message):
            ExLlamaV2Sampler.Settings(token_bias=bias).to_native()
    n = ExLlamaV2Sampler.Settings(top_p=np.float32(0), tfs=np.float64(1), mirostat_mu=np.asarray([4.5])).to_native()
    assert (n.top_p, n.tfs, n.mirostat_mu) == (1.0, 0.0, 4.5)  # ExLlamaV2's "off" for NumPy numbers too
    s = ExLlamaV2Sampler.Settings()
    with pytest.raises(InvalidSettingsError, match="has no setting 'temprature'; known: cfg_scale"):
        s.temprature = 0.1
    for name, value in (("filters", [RegexFilter("a")]), ("filter_prefer_eos", True)):
        with pytest.raises(UnsupportedFeatureError, match=rf"Settings.{name}=.*pass it to the job"):
            setattr(s, name, value)


@pytest.mark.parametrize("name", sorted(ExLlamaV2Sampler.Settings.UNSUPPORTED))
def test_unsupported_settings_raise_naming_the_setting(name):
    neutral = ExLlamaV2Sampler.Settings.UNSUPPORTED[name]
    value = {bool: True, float: 0.5, int: 3, type(None): 1.0, list: [1]}[type(neutral)]
    if name == "post_sampling_hooks":
        value = [lambda *a: None]
    with pytest.raises(UnsupportedFeatureError, match=name) as info:
        ExLlamaV2Sampler.Settings(**{name: value})
    assert isinstance(info.value, NotImplementedError)
    s = ExLlamaV2Sampler.Settings()
    setattr(s, name, value)  # set after construction, as ExLlamaV2 code does: caught when the job is made
    with pytest.raises(UnsupportedFeatureError, match=name):
        ExLlamaV2DynamicJob(input_ids=[[1, 2]], max_new_tokens=3, gen_settings=s)


def test_full_sampler_settings_map_to_native():
    s = ExLlamaV2Sampler.Settings(
        smoothing_factor=0.3, min_temp=0.5, max_temp=1.5, temp_exponent=2.0, top_a=0.2, tfs=0.9, skew=0.5,
        temperature_last=True, mirostat=True, mirostat_tau=3.0, mirostat_eta=0.2, mirostat_mu=[4.5],
        token_repetition_decay=64, dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3, dry_range=128,
        dry_max_ngram=10, dry_sequence_breakers={7, 3}, xtc_probability=0.5, xtc_threshold=0.2,
        xtc_ignore_tokens=frozenset({9}))
    n = s.to_native()
    assert (n.smoothing_factor, n.min_temp, n.max_temp, n.temp_exponent, n.top_a, n.tfs, n.skew) == (
        0.3, 0.5, 1.5, 2.0, 0.2, 0.9, 0.5)
    assert n.temperature_last and n.mirostat and (n.mirostat_tau, n.mirostat_eta, n.mirostat_mu) == (3.0, 0.2, 4.5)
    assert n.penalty_decay == 64
    assert (n.dry_multiplier, n.dry_base, n.dry_allowed_length, n.dry_range, n.dry_max_ngram) == (0.8, 2.0, 3, 128, 10)
    assert n.dry_sequence_breakers == (3, 7) and n.xtc_ignore_tokens == (9,)
    assert (n.xtc_probability, n.xtc_threshold) == (0.5, 0.2)
    d = ExLlamaV2Sampler.Settings().to_native()  # ExLlamaV2's neutral defaults stay off
    assert d.tfs == 0 and d.mirostat_mu is None and d.dry_sequence_breakers is None and not d.uses_dry
    assert ExLlamaV2Sampler.Settings(tfs=1.0, mirostat_mu=0).to_native().tfs == 0  # 1 = off, as ExLlamaV2
    with pytest.raises(InvalidSettingsError, match="dry_range"):
        ExLlamaV2Sampler.Settings(dry_range=10, dry_max_ngram=20).to_native()
    with pytest.raises(InvalidSettingsError, match="mirostat_mu"):
        ExLlamaV2Sampler.Settings(mirostat_mu=[1.0, 2.0]).to_native()
    with pytest.raises(InvalidSettingsError, match="unknown"):
        ExLlamaV2Sampler.Settings(temprature=0.5)


def test_job_and_generator_arguments():
    with pytest.raises(InvalidJobError, match="cfg_scale is None"):  # a CFG pair needs cfg_scale, as ExLlamaV2
        ExLlamaV2DynamicJob(input_ids=[np.asarray([[1, 2]]), np.asarray([[3]])], max_new_tokens=3)
    j = ExLlamaV2DynamicJob(input_ids=[np.asarray([[1, 2]]), np.asarray([[3]])], max_new_tokens=3,
                            gen_settings=ExLlamaV2Sampler.Settings(cfg_scale=1.5))
    assert (j.input_ids, j.negative_ids, j.gen_settings.cfg_scale) == ([1, 2], [3], 1.5)
    assert ExLlamaV2DynamicJob(input_ids=[[1, 2]], max_new_tokens=3, lora="style").lora == "style"
    with pytest.raises(InvalidJobError, match="shape"):
        ExLlamaV2DynamicJob(input_ids=[np.ones((2, 2), int), np.asarray([[3]])], max_new_tokens=3,
                            gen_settings=ExLlamaV2Sampler.Settings(cfg_scale=1.5))
    with pytest.raises(InvalidJobError, match="filters must be a paged.filters.Filter"):
        ExLlamaV2DynamicJob(input_ids=[[1, 2]], max_new_tokens=3, filters=[object()])  # ExLlamaV2's filter objects
    assert ExLlamaV2DynamicJob(input_ids=[[1, 2]], max_new_tokens=3, filters=[RegexFilter("a+")],
                               filter_prefer_eos=True).filter_prefer_eos
    with pytest.raises(InvalidJobError, match="MMEmbedding"):
        ExLlamaV2DynamicJob(input_ids=[[1, 2]], max_new_tokens=3, embeddings=[object()])
    emb = ExLlamaV2MMEmbedding(MODEL, embeddings=np.ones((2, CFG.hidden_size)), text_alias="<img>")
    j = ExLlamaV2DynamicJob(input_ids=[[1, *emb.token_ids]], max_new_tokens=3, embeddings=[emb])
    assert j.embeddings == [emb] and emb.text_alias == "<img>"
    with pytest.raises(InvalidJobError, match="unknown"):
        ExLlamaV2DynamicJob(input_ids=[[1, 2]], max_new_tokens=3, max_tokens=5)
    j = ExLlamaV2DynamicJob(input_ids=[np.asarray([[1, 2]])], max_new_tokens=3, stop_conditions={2, "x", 1})
    assert j.input_ids == [1, 2] and j.stop_tokens == {1, 2} and j.stop_strings == ["x"]
    assert isinstance(j, Job)
    # speculative decoding is supported (tests/paged/speculation/test_speculative_generator.py); bad combinations are
    # errors
    with pytest.raises(InvalidConfigError, match="not both"):
        ExLlamaV2DynamicGenerator(MODEL, None, TOK, draft_model=MODEL, use_ngram_draft=True)
    with pytest.raises(InvalidConfigError, match="draft_cache"):
        ExLlamaV2DynamicGenerator(MODEL, None, TOK, draft_cache=object())
    with pytest.raises(InvalidConfigError, match="unknown"):
        ExLlamaV2DynamicGenerator(MODEL, None, TOK, max_pages=3)
    with pytest.raises(InvalidConfigError, match="batch_size"):
        ExLlamaV2Cache(MODEL, max_seq_len=1024, batch_size=2)
    for bad in ("1024", 100.5):  # (a bare TypeError; an error about num_pages, never given)
        with pytest.raises(InvalidConfigTypeError, match="ExLlamaV2Cache: max_seq_len must be an int"):
            ExLlamaV2Cache(MODEL, max_seq_len=bad)
    for bad in (None, "smollm2-135m"):  # (an AttributeError with a cache)
        with pytest.raises(InvalidConfigTypeError, match="model must be a loaded models.Model"):
            ExLlamaV2DynamicGenerator(bad, ExLlamaV2Cache(None, max_seq_len=256), TOK)
    tuned = ExLlamaV2DynamicGenerator(MODEL, None, TOK, attn_impl="pallas", attn_tuning="block_q=8", **SMALL)
    assert tuned.config.attn_tuning.block_q == 8  # (the tunings had been unknown arguments, here and natively)
    with pytest.warns(UserWarning, match="max_q_size"):
        ExLlamaV2DynamicGenerator(MODEL, None, TOK, max_q_size=16, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = ExLlamaV2DynamicGenerator(MODEL, None, TOK, **SMALL)
    assert isinstance(g, DynamicGenerator)


def test_generate_rejects_what_is_not_implemented(generator):
    with pytest.raises(InvalidJobError, match="no cfg_scale"):
        generator.generate(prompt=("positive", "negative"), max_new_tokens=4)
    with pytest.raises(InvalidJobError, match="filters must be a paged.filters.Filter"):
        generator.generate(prompt="a", max_new_tokens=4, filters=[[object()]])
    with pytest.raises(InvalidJobError, match="one list of filters per prompt"):
        generator.generate(prompt=["a", "b"], max_new_tokens=4, filters=[[ChoiceFilter(["x"])]])
    with pytest.raises(InvalidJobError, match=r"filters\[0\] is not a list; .*\(e\.g\. \[\[f\], \[f\]\]"):
        generator.generate(prompt=["a", "b"], max_new_tokens=4, filters=[ChoiceFilter(["x"]), ChoiceFilter(["y"])])
    check_clean(generator)


def test_generate_with_filters(generator):
    greedy = ExLlamaV2Sampler.Settings.greedy()
    out = generator.generate(prompt=["a", "b"], max_new_tokens=8, completion_only=True,
                             filters=[[ChoiceFilter(["yes", "no"])], []], gen_settings=greedy)
    assert out[0] in ("yes", "no")
    single = generator.generate(prompt="a", max_new_tokens=8, completion_only=True, filters=[RegexFilter("[0-9]{3}")],
                                gen_settings=greedy)
    assert single.isdigit() and len(single) == 3
    check_clean(generator)


def test_compat_sampling_equals_native_sampling(generator):
    """The same seeds and equivalent settings give the same tokens through both front ends."""
    ex = ExLlamaV2Sampler.Settings(temperature=1.1, top_k=20, top_p=0.9, token_repetition_penalty=1.1,
                                   token_repetition_range=32)
    native = SamplingSettings(temperature=1.1, top_k=20, top_p=0.9, repetition_penalty=1.1, penalty_range=32)
    ids = TOK.encode("Sampling check")
    a = ExLlamaV2DynamicJob(input_ids=np.asarray([ids]), max_new_tokens=10, gen_settings=ex, seed=11, identifier="a")
    b = Job(ids, 10, gen_settings=native, seed=11, identifier="b")
    generator.enqueue([a, b])
    while generator.num_remaining_jobs():
        generator.iterate()
    assert a.sequence == b.sequence and len(a.sequence) == len(ids) + 10
    greedy = Job(ids, 10, gen_settings=SamplingSettings.greedy(), identifier="g")
    generator.enqueue(greedy)
    while generator.num_remaining_jobs():
        generator.iterate()
    assert greedy.sequence != a.sequence  # the settings really sampled


def test_async_compat_loop(generator):
    async def main():
        agen = ExLlamaV2DynamicGeneratorAsync(generator)
        job = ExLlamaV2DynamicJobAsync(agen, input_ids=np.asarray([TOK.encode("Hi")]), max_new_tokens=6,
                                       gen_settings=ExLlamaV2Sampler.Settings.greedy(), identifier="async")
        text = ""
        async for result in job:
            text += result.get("text", "")
            if result["eos"]:
                final = result
        await agen.close()
        return text, final

    text, final = asyncio.run(main())
    assert final["identifier"] == "async" and final["full_completion"] == text
    check_clean(generator)


def test_generate_takes_lora_and_exllamav2s_batched_embeddings(generator):
    """`generate(lora=)` reaches the jobs (it had been an unknown argument), and `embeddings` may be one list per
    prompt, ExLlamaV2's batched form, equal to the flat list whose aliases each prompt picks."""
    with pytest.raises(InvalidJobError, match="lora='tuned'.*not loaded|not loaded.*tuned"):
        generator.generate(prompt="a", max_new_tokens=2, lora="tuned")
    rng = np.random.default_rng(0)
    e1 = ExLlamaV2MMEmbedding(MODEL, embeddings=rng.normal(size=(3, CFG.hidden_size)).astype(np.float32),
                              text_alias="<i1>")
    e2 = ExLlamaV2MMEmbedding(MODEL, embeddings=rng.normal(size=(2, CFG.hidden_size)).astype(np.float32),
                              text_alias="<i2>")
    greedy = ExLlamaV2Sampler.Settings.greedy()
    kw = dict(prompt=["A <i1> B", "C <i2> D"], max_new_tokens=3, gen_settings=greedy, completion_only=True)
    flat = generator.generate(**kw, embeddings=[e1, e2])
    assert generator.generate(**kw, embeddings=[[e1], [e2]]) == flat
    assert generator.generate(**{**kw, "prompt": ["A <i1> B", "C D"]}, embeddings=[[e1], None])[0] == flat[0]
    with pytest.raises(InvalidJobError, match="1 embedding lists for 2 prompts"):
        generator.generate(**kw, embeddings=[[e1]])
    check_clean(generator)
