"""Classifier-free guidance: a job's negative prompt runs as a second row of the ordinary batched step, with its own
pages, and every token is sampled from `s * log_softmax(l_pos) + (1 - s) * log_softmax(l_neg)`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import forward
from paged import DynamicGenerator, Job, SamplingSettings
from paged.device.sampling import SamplingRows, adjusted_logits, apply_cfg
from paged.errors import InvalidJobError, InvalidSettingsError, JobTooLargeError
from paged.filters import RegexFilter, compute_masks
from paged.host import generator as generator_module
from paged.testing import ByteTokenizer, drain, tiny_config, tiny_model

TOK = ByteTokenizer()
CFG = tiny_config(TOK.vocab_size, max_position_embeddings=256)
MODEL = tiny_model(CFG, seed=5, tokenizer=TOK)
GEN = dict(num_pages=64, page_size=8, max_batch_size=6, max_chunk_size=16, max_seq_len=96)
RNG = np.random.default_rng(3)
POS = [int(t) for t in RNG.integers(0, 256, size=37)]  # 5 pages; prefilled in 3 chunks of <= 16
NEG = [int(t) for t in RNG.integers(0, 256, size=11)]
OTHER = [int(t) for t in RNG.integers(0, 256, size=29)]
LETTERS = SamplingSettings.greedy(banned_tokens=[t for t in range(TOK.vocab_size) if not 97 <= t <= 122])


def guided(pos: list[int], neg: list[int], out: list[int], scale: float) -> np.ndarray:
    """[len(out), V]: the guided log-probabilities each output token was drawn from, from two dense forwards."""
    n = len(out)
    lp = forward(MODEL.params, CFG, jnp.asarray([pos + out]))[0, len(pos) - 1 : len(pos) - 1 + n]
    ln = forward(MODEL.params, CFG, jnp.asarray([neg + out]))[0, len(neg) - 1 : len(neg) - 1 + n]
    return np.asarray(scale * jax.nn.log_softmax(lp, -1) + (1 - scale) * jax.nn.log_softmax(ln, -1))


def output(c, ident) -> list[int]:
    return [t for r in c.results if r["identifier"] == ident for t in r.get("token_ids", [])]


def final(c, ident) -> dict:
    return next(r for r in c.results if r["identifier"] == ident and r["eos"])


def test_apply_cfg_mixes_rows_with_their_partners_and_leaves_the_others():
    logits = RNG.normal(size=(4, 9)).astype(np.float32) * 3
    rows = SamplingRows.make([{"cfg_partner": 2, "cfg_scale": 1.5}, {}, {}, {"cfg_partner": 0, "cfg_scale": -0.5}])
    got = np.asarray(apply_cfg(jnp.asarray(logits), rows))
    ls = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(got[0], 1.5 * ls[0] - 0.5 * ls[2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[3], -0.5 * ls[3] + 1.5 * ls[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1:3], logits[1:3])  # untouched, bit for bit
    np.testing.assert_array_equal(np.asarray(apply_cfg(jnp.asarray(logits), SamplingRows.make(4))), logits)
    # the sampler applies it first, with or without a penalty history, with or without penalties
    for width, pen in ((0, 1.0), (3, 1.0), (3, 1.3)):
        params = SamplingRows.make([{"cfg_partner": 2, "cfg_scale": 1.5, "repetition_penalty": pen}, {}, {}, {}])
        x = adjusted_logits(jnp.asarray(logits), params, jnp.full((4, width), -1, jnp.int32),
                            jnp.full((4, 1), -1, jnp.int32), jnp.zeros((4, 1), jnp.float32))
        np.testing.assert_allclose(np.asarray(x)[0], 1.5 * ls[0] - 0.5 * ls[2], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(x)[1:], logits[1:])


@pytest.mark.slow
def test_guided_tokens_and_logits_match_the_hand_computed_mixture():
    """Two CFG jobs with other scales and prompts of other lengths (the prompts finish prefilling in different
    steps), a plain job, and a long prompt arriving mid-run (its prefill chunk shares steps with the CFG rows):
    every token is the argmax of the mixture of the two prompts' dense-forward log-probabilities, the reported
    top-k probabilities are the mixture's, and the returned logits are the positive prompt's raw ones."""
    g = DynamicGenerator(MODEL, **GEN)
    a = Job([POS, NEG], 10, gen_settings=SamplingSettings.greedy(cfg_scale=1.5), identifier="a", return_logits=True,
            return_top_tokens=5)
    b = Job([NEG + POS[:5], POS[3:20]], 10, gen_settings=SamplingSettings.greedy(cfg_scale=-0.5), identifier="b",
            return_logits=True, return_top_tokens=5)
    g.enqueue([a, Job(OTHER, 10, gen_settings=SamplingSettings.greedy(), identifier="plain"), b])
    results = []
    for _ in range(4):
        results += g.iterate()
    g.enqueue(Job(OTHER + POS, 4, gen_settings=SamplingSettings.greedy(), identifier="late"))
    for _ in range(200):
        if not g.num_remaining_jobs():
            break
        results += g.iterate()
    g.pool.check({})
    for job, pos, neg, scale in ((a, POS, NEG, 1.5), (b, NEG + POS[:5], POS[3:20], -0.5)):
        out = [t for r in results if r["job"] is job for t in r.get("token_ids", [])]
        logits = np.concatenate([r["logits"] for r in results if r["job"] is job and "logits" in r])
        top = np.concatenate([r["top_k_probs"] for r in results if r["job"] is job and "top_k_probs" in r])
        ref = guided(pos, neg, out, scale)
        assert len(out) == 10 and out == [int(t) for t in ref.argmax(-1)]
        probs = np.exp(ref - ref.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        np.testing.assert_allclose(top, -np.sort(-probs, axis=-1)[:, :5], atol=2e-5)
        raw = forward(MODEL.params, CFG, jnp.asarray([pos + out]))[0, len(pos) - 1 : len(pos) - 1 + 10]
        np.testing.assert_allclose(logits, np.asarray(raw), atol=2e-4)
        assert job.cfg_partner.sequence == neg + out  # the negative prompt took every token too
    plain = [t for r in results if r["identifier"] == "plain" for t in r.get("token_ids", [])]
    assert plain != out


def test_cfg_scale_1_gives_exactly_the_positive_prompts_output():
    """Greedy and seeded sampling, in one batch with the positive prompts as plain jobs: the same tokens and
    probabilities (the negative prompt's weight is 0)."""
    sampled = dict(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.0)
    g = DynamicGenerator(MODEL, **GEN)
    g.enqueue([
        Job([POS, NEG], 12, gen_settings=SamplingSettings.greedy(cfg_scale=1.0), identifier="cfg",
            return_probs=True),
        Job(POS, 12, gen_settings=SamplingSettings.greedy(), identifier="plain", return_probs=True),
        Job([OTHER, NEG], 12, gen_settings=SamplingSettings(cfg_scale=1.0, **sampled), seed=9, identifier="cfg-s"),
        Job(OTHER, 12, gen_settings=SamplingSettings(**sampled), seed=9, identifier="plain-s"),
    ])
    c = drain(g)
    g.pool.check({})
    assert output(c, "cfg") == output(c, "plain") and len(output(c, "plain")) == 12
    probs = lambda i: [p for r in c.results if r["identifier"] == i for p in r.get("token_probs", [])]  # noqa: E731
    np.testing.assert_allclose(probs("cfg"), probs("plain"), rtol=1e-4)
    assert output(c, "cfg-s") == output(c, "plain-s")


def test_pages_of_both_prompts_are_released_on_end_on_cancel_and_on_failure(monkeypatch):
    g = DynamicGenerator(MODEL, **GEN)
    j = Job([POS, NEG], 30, gen_settings=SamplingSettings.greedy(cfg_scale=2.0))
    g.enqueue(j)
    for _ in range(5):
        g.iterate()
    assert j in g.active and j.pages and j.cfg_partner.pages and j.cfg_partner.kv_position > len(NEG) - 1
    g.cancel(j)
    assert g.pool.num_referenced == 0 and not j.pages and not j.cfg_partner.pages
    g.pool.check({})
    waiting = Job([POS, NEG], 4, gen_settings=SamplingSettings.greedy(cfg_scale=2.0))
    g.enqueue(waiting)
    g.cancel(waiting)  # cancelled before it was admitted
    done = Job([POS, NEG], 4, gen_settings=SamplingSettings.greedy(cfg_scale=2.0), identifier="done")
    g.enqueue(done)
    c = drain(g)
    assert final(c, "done")["eos_reason"] == "max_new_tokens" and g.pool.num_referenced == 0
    g.pool.check({})
    # a job ended by a failure of its own (here: its filter) releases both prompts' pages too
    bad = Job([POS, NEG], 4, gen_settings=SamplingSettings.greedy(cfg_scale=2.0), identifier="bad",
              filters=[RegexFilter("[a-z]+")])
    other = Job([NEG, POS], 4, gen_settings=SamplingSettings.greedy(cfg_scale=2.0), identifier="other")

    def broken(states):  # the grammar engine fails on the bad job's masks
        if any(st is bad.filter_state for st in states):
            raise RuntimeError("grammar engine exploded")
        return compute_masks(states)

    monkeypatch.setattr(generator_module, "compute_masks", broken)
    g.enqueue([bad, other])
    c = drain(g)
    assert final(c, "bad")["eos_reason"] == "error" and final(c, "other")["eos_reason"] == "max_new_tokens"
    assert g.pool.num_referenced == 0
    g.pool.check({})


def test_each_prompt_shares_cached_prefix_pages():
    g = DynamicGenerator(MODEL, **GEN)
    first = Job([POS, NEG + OTHER], 6, gen_settings=SamplingSettings.greedy(cfg_scale=1.5), identifier="first")
    g.enqueue(first)
    c1 = drain(g)
    neg = first.cfg_partner  # both prompts' complete pages, output included, are in the prompt cache
    assert len(neg.page_hashes) == (len(neg.sequence) - 1) // 8 and all(h in g.pool.by_hash for h in neg.page_hashes)
    hits = g.pool.prefix_hits
    again = Job([POS, NEG + OTHER], 6, gen_settings=SamplingSettings.greedy(cfg_scale=1.5), identifier="again")
    g.enqueue(again)
    c2 = drain(g)
    # complete pages of both prompts (but each prompt's last token, which always runs): 4 + 4
    assert g.pool.prefix_hits - hits == (len(POS) - 1) // 8 + (len(NEG + OTHER) - 1) // 8
    assert final(c2, "again")["cached_tokens"] == (len(POS) - 1) // 8 * 8
    assert output(c2, "again") == output(c1, "first")
    g.pool.check({})


def test_stop_strings_banned_strings_probs_and_filters_work_with_cfg():
    s = LETTERS.__class__(**{**LETTERS.__dict__, "cfg_scale": 1.7})
    g = DynamicGenerator(MODEL, **GEN)
    g.enqueue(Job([POS, NEG], 16, gen_settings=s, identifier="free"))
    free = bytes(output(drain(g), "free")).decode()
    banned = free[4:6]
    job = Job([POS, NEG], 16, gen_settings=s, identifier="banned", banned_strings=[banned], return_probs=True)
    stopped = Job([POS, NEG], 16, gen_settings=s, identifier="stop", stop_conditions=[free[6:8]])
    filtered = Job([POS, NEG], 6, gen_settings=s, identifier="filter", filters=[RegexFilter("(ab|ba)+")])
    g.enqueue([job, stopped, filtered])
    c = drain(g)
    g.pool.check({})
    out = job.sequence[len(POS) :]
    assert banned not in bytes(out).decode() and job.explored  # the banned string was rewound at least once
    assert job.cfg_partner.sequence == NEG + out  # the rewind took the tokens back from the negative prompt too
    ref = guided(POS, NEG, out, 1.7)
    bias = np.full(TOK.vocab_size, -np.inf)
    bias[97:123] = 0
    for i, t in enumerate(out):  # each token: the argmax of the mixture, less what rewinds banned there
        x = ref[i] + bias
        x[list(job.explored.get(len(POS) + i, ()))] = -np.inf
        assert t == int(x.argmax())
    probs = [p for r in c.results if r["identifier"] == "banned" for p in r.get("token_probs", [])]
    assert len(probs) == len(output(c, "banned")) and all(0 < p <= 1 for p in probs)
    assert final(c, "stop")["eos_reason"] == "stop_string"
    assert final(c, "stop")["full_completion"] == free[: free.index(free[6:8])]
    text = bytes(output(c, "filter")).decode()
    assert text and set(text) <= {"a", "b"} and text.replace("ab", "").replace("ba", "") in ("", "a", "b")


def test_a_preempted_cfg_job_recomputes_to_the_same_output():
    """On-demand pages in a pool too small for everything: the policy preempts, and the CFG jobs (both prompts
    released and prefilled again) still give the output of a roomy run."""
    jobs = lambda: [Job([POS, NEG + OTHER[:i]], 24, gen_settings=SamplingSettings.greedy(cfg_scale=1.5),  # noqa: E731
                        identifier=i) for i in range(3)]
    roomy = DynamicGenerator(MODEL, **GEN, policy="vllm")
    roomy.enqueue(jobs())
    want = drain(roomy)
    tight = DynamicGenerator(MODEL, **{**GEN, "num_pages": 25}, policy="vllm")
    tight.enqueue(jobs())
    got = drain(tight)
    assert tight.scheduler.preemptions > 0
    for i in range(3):
        assert output(got, i) == output(want, i) and len(output(got, i)) == 24
    tight.pool.check({})


def test_cfg_jobs_are_not_drafted_for_and_keep_their_output_under_speculation():
    rep = (POS[:6] * 6)[:30]  # a repetitive plain job that the n-gram drafter drafts for
    make = lambda: [Job([POS, NEG], 12, gen_settings=SamplingSettings.greedy(cfg_scale=1.5), identifier="cfg"),  # noqa: E731
                    Job(rep, 12, gen_settings=SamplingSettings.greedy(), identifier="rep")]
    plain = DynamicGenerator(MODEL, **GEN)
    plain.enqueue(make())
    want = drain(plain)
    spec = DynamicGenerator(MODEL, **GEN, use_ngram_draft=True, num_draft_tokens=3)
    jobs = make()
    spec.enqueue(jobs)
    got = drain(spec)
    assert output(got, "cfg") == output(want, "cfg") and output(got, "rep") == output(want, "rep")
    assert jobs[0].drafted_tokens == 0 and jobs[1].drafted_tokens > 0
    spec.pool.check({})


def test_generate_takes_a_positive_negative_pair():
    g = DynamicGenerator(MODEL, **GEN)
    s = SamplingSettings.greedy(cfg_scale=1.5)
    pair = ("the positive prompt", "negative")
    text = g.generate(pair, 8, gen_settings=s)
    job = Job([TOK.encode(pair[0]), TOK.encode(pair[1])], 8, gen_settings=s)
    g.enqueue(job)
    drain(g)
    assert text == job.full_completion and len(text.encode("utf-8", "surrogateescape")) > 0
    both = g.generate(["plain", pair], 8, gen_settings=[SamplingSettings.greedy(), s], completion_only=False)
    assert both[1] == pair[0] + text
    g.pool.check({})


def test_cfg_arguments_are_checked():
    s = SamplingSettings.greedy(cfg_scale=1.5)
    with pytest.raises(InvalidJobError, match="cfg_scale is None"):
        Job([POS, NEG], 4)
    with pytest.raises(InvalidJobError, match="needs a negative prompt"):
        Job(POS, 4, gen_settings=s)
    with pytest.raises(InvalidJobError, match="token_healing cannot be combined with CFG"):
        Job([POS, NEG], 4, gen_settings=s, token_healing=True)
    with pytest.raises(InvalidJobError, match="input_ids is empty"):
        Job([POS, []], 4, gen_settings=s)
    with pytest.raises(InvalidSettingsError, match="cfg_scale"):
        SamplingSettings(cfg_scale=float("nan"))
    assert Job(np.asarray([POS[:5], NEG[:5]]), 4, gen_settings=s).negative_ids == NEG[:5]  # a (2, n) array
    with pytest.raises(InvalidJobError, match="max_batch_size=1"):
        DynamicGenerator(MODEL, **{**GEN, "max_batch_size": 1}).enqueue(Job([POS, NEG], 4, gen_settings=s))
    g = DynamicGenerator(MODEL, **GEN)
    with pytest.raises(JobTooLargeError, match="negative prompt"):
        g.enqueue(Job([POS, list(range(90))], 10, gen_settings=s))
    with pytest.raises(InvalidJobError, match="vocabulary"):
        g.enqueue(Job([POS, [TOK.vocab_size + 3]], 10, gen_settings=s))
    small = DynamicGenerator(MODEL, **{**GEN, "num_pages": 12})  # 11 pages: 6 + 6 do not fit
    with pytest.raises(JobTooLargeError, match="pages"):
        small.enqueue(Job([POS, POS], 10, gen_settings=s))
    assert not g.pending and not small.pending
