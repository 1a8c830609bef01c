"""`fuse_sampler=True`: a decode-only step's forward and sampler (plain, or a speculative verification's) run as one
program (`paged.device.step.fused_step_jit`, `paged.device.verify.verify_step_jit`). The results are those of the two
programs, greedy and sampled rows, per-token extras and drafts alike; each setting takes its own path; `warmup()`
compiles exactly the variants serving then uses."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

import paged.device.engine as engine_mod
from models.draft import truncated_model
from paged import DynamicGenerator, Job, SamplingSettings
from paged.device.engine import count_compiles
from paged.errors import InvalidConfigError
from paged.testing import drain
from tests.paged.device.test_warmup import count_jax_compiles
from tests.paged.speculation.test_speculative_generator import MODEL, PENALISED, SETTINGS, TOK

pytestmark = pytest.mark.fresh_programs  # (counts compiled variants)

MOTIF = {int(t): 6.0 for t in TOK.encode("abc")}  # a bias that makes the outputs repeat it: prompt lookup drafts
GREEDY = SamplingSettings.greedy(token_bias=MOTIF)
# penalties see the earlier drafts of a verification row (and bring a draft model's drafts to the host for the
# steps where this job drafts; the other jobs' steps take them from the device); top-k truncates before the draw
SAMPLED = SamplingSettings(temperature=0.8, top_k=20, repetition_penalty=1.2, frequency_penalty=0.3,
                           token_bias=MOTIF)
T1 = SamplingSettings(temperature=1.0, repetition_penalty=1.0, token_bias=MOTIF)
SPECS = {"none": {}, "ngram": dict(use_ngram_draft=True, max_ngram=3, num_draft_tokens=3),
         "model": dict(draft_model=MODEL, num_draft_tokens=2)}  # the self-draft: every draft accepted


def jobs() -> list[Job]:
    return [
        Job(TOK.encode("the cat sat on the mat. the cat sat"), 24, gen_settings=GREEDY, identifier="greedy",
            return_probs=True, return_top_tokens=3),
        Job(TOK.encode("abcabcabcabcab"), 10, gen_settings=SAMPLED, seed=4, identifier="sampled", return_probs=True,
            return_logits=True),
        Job(TOK.encode("hello world, hello"), 28, gen_settings=T1, seed=7, identifier="t1", return_probs=True),
    ]


def spy_paths(monkeypatch) -> collections.Counter:
    """Count the calls of each jitted entry point the engine may take for a step."""
    calls: collections.Counter = collections.Counter()

    def counted(name, fn):
        def f(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return f

    for mod, name in ((engine_mod, "fused_step_jit"), (engine_mod, "step_forward"), (engine_mod, "step_sample"),
                      (engine_mod, "verify_step_jit"), (engine_mod, "verify_sample")):
        monkeypatch.setattr(mod, name, counted(name, getattr(mod, name)))
    return calls


def streams(c) -> dict:
    out = collections.defaultdict(list)
    for r in c.results:
        if r["stage"] == "streaming":
            out[r["identifier"]].append(r)
    return dict(out)


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
@pytest.mark.slow
def test_one_program_gives_the_two_programs_results(drafter, monkeypatch):
    calls = spy_paths(monkeypatch)
    runs = {}
    for fuse in (False, True):
        calls.clear()
        gen = DynamicGenerator(MODEL, **PENALISED, fuse_sampler=fuse, **SPECS[drafter])
        gen.enqueue(jobs())
        c = drain(gen)
        gen.pool.check({})
        runs[fuse] = (streams(c), dict(calls), gen.metrics())
    (two, calls_two, m_two), (one, calls_one, m_one) = runs[False], runs[True]
    # each setting takes its own path: the decode steps (and verifications) in one program only when fused
    assert calls_two.get("fused_step_jit", 0) == calls_two.get("verify_step_jit", 0) == 0
    if drafter == "none":  # (with the self-draft every decode step verifies)
        assert calls_one["fused_step_jit"] > 0
        assert calls_one["step_sample"] < calls_two["step_sample"]  # what remains: prefill steps
    else:
        assert calls_two["verify_sample"] > 0 and calls_one["verify_step_jit"] > 0
        assert calls_one.get("verify_sample", 0) < calls_two["verify_sample"]
        assert m_one["drafted_tokens"] == m_two["drafted_tokens"] > 0
        assert m_one["accepted_draft_tokens"] == m_two["accepted_draft_tokens"]
    assert one.keys() == two.keys() == {"greedy", "sampled", "t1"}
    for i in one:
        assert [r["token_ids"] for r in one[i]] == [r["token_ids"] for r in two[i]], i
        assert [r["text"] for r in one[i]] == [r["text"] for r in two[i]], i
        for key in ("token_probs", "top_k_tokens", "top_k_probs", "logits"):
            a = [np.asarray(r[key]) for r in one[i] if key in r]
            b = [np.asarray(r[key]) for r in two[i] if key in r]
            assert len(a) == len(b), (i, key)
            for x, y in zip(a, b):
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f"{i} {key}")
    assert any("logits" in r for r in one["sampled"]) and any("top_k_tokens" in r for r in one["greedy"])


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
@pytest.mark.slow
def test_warmup_compiles_the_fused_variants_and_serving_compiles_nothing(drafter):
    """warmup() compiles exactly `variants()` (a draft model's engine never fuses: its rows do not sample through
    `run`), and serving then compiles nothing: the fused programs see the same arguments from `run` as from warmup,
    drafts fed from the device and the draft's distributions included."""
    jax.clear_caches()  # count this test's compilations alone
    spec = SPECS[drafter] if drafter != "model" else dict(SPECS["model"], draft_model=truncated_model(MODEL, 1))
    # (a draft of another config than the target's: the two engines compile apart, every variant counted once)
    gen = DynamicGenerator(MODEL, **{**SETTINGS, "max_batch_size": 2}, fuse_sampler=True, **spec)
    target = [v[0] for v in gen.engine.variants()]
    decode = [s for s in gen.engine.spec.all_shapes()  # decode-only: plain, and verification rows alone
              if (s.step_rows_in_windows if s.verify_len else not s.layout.num_prefill_rows)]
    assert target.count("fused") == sum(not s.verify_len for s in decode) > 0
    assert target.count("fused_verify") == sum(bool(s.verify_len) for s in decode) == (drafter != "none") * 2
    assert target.count("step") == len(gen.engine.spec.all_shapes()) - len(decode)
    engines = [gen.engine] + ([gen.speculation.speculator.draft.engine] if drafter == "model" else [])
    kinds = [v[0] for e in engines for v in e.variants()]
    assert ("fused" in kinds[len(target):]) is False  # the draft engine's variants
    before = count_compiles()
    gen.warmup()
    compiled = {k: count_compiles()[k] - before[k] for k in before}
    assert compiled == {k: kinds.count(k) for k in before}
    warm = count_compiles()
    with count_jax_compiles() as seen:
        gen.enqueue(jobs())
        c = drain(gen)
    assert all(f["eos_reason"] != "error" for f in c.finals.values())
    assert count_compiles() == warm
    assert seen == {"/jax/core/compile/jaxpr_trace_duration": 0, "/jax/core/compile/backend_compile_duration": 0}
    if drafter != "none":
        assert gen.metrics()["drafted_tokens"] > 0


def test_fuse_sampler_is_validated():
    with pytest.raises(InvalidConfigError, match="fuse_sampler must be True or False"):
        DynamicGenerator(MODEL, **SETTINGS, fuse_sampler="yes")
