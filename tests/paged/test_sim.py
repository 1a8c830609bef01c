"""The simulator: the virtual clock, the StepTimeModel, the simulated engine's virtual timings, determinism for a
seed, and one policy object driving both the real engine and the simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged import DynamicGenerator, Job, SamplingSettings
from paged.clock import VirtualClock
from paged.device.batch import RowInput
from paged.device.buckets import BucketSpec
from paged.device.config import EngineConfig
from paged.device.engine_api import EngineProtocol
from paged.errors import InvalidConfigError
from paged.policies import VLLMPolicy
from paged.sim import FEATURES, SimulatedEngine, StepShape, StepTimeModel
from paged.testing import ByteTokenizer, drain

TOK = ByteTokenizer()
GREEDY = SamplingSettings.greedy()
CFG = EngineConfig(num_pages=33, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=128)


def test_virtual_clock():
    c = VirtualClock(2.0)
    assert c() == 2.0
    c.advance(0.5)
    c.sleep(-1.0)  # like time.sleep: nothing
    c.sleep(1.5)
    assert c() == 4.0
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="cannot advance"):
            c.advance(bad)


def test_step_shape_from_rows_counts_prefill_decode_kv_and_padding():
    spec = BucketSpec.from_config(CFG, attn_impl="xla")
    rows = [RowInput(tokens=[1] * 10, start_pos=3, pages=[1, 2], sample=False),
            RowInput(tokens=[5], start_pos=20, pages=[3, 4, 5]), RowInput(tokens=[6], start_pos=7, pages=[6])]
    s = StepShape.from_rows(rows, spec)
    assert (s.prefill_tokens, s.decode_rows, s.kv_tokens) == (10, 2, 13 + 21 + 8)
    assert s.padded_tokens == 16  # one window of 16 holds the chunk of 10 and the two decode tokens
    assert StepShape.from_rows(rows[1:], spec).padded_tokens == 2
    assert StepShape.from_rows(rows).padded_tokens == 0
    # rows through the LM head and the sampler: the window and the decode slots of the bucket (3 rows -> 1 + 4)
    three = [RowInput(tokens=[5], start_pos=20 + i, pages=[3, 4, 5]) for i in range(3)]
    assert StepShape.from_rows(three, spec).padded_rows == 4 and StepShape.from_rows(three).padded_rows == 0


def test_fit_prices_the_mean_of_noisy_samples_not_the_fast_ones(monkeypatch):
    """Each shape timed ten times, two of them slowed (x1.5, x2: a busy host), as serving measures steps: the fit
    must price the mean (what a run's duration adds up), where weighting each sample by 1 / its own time would
    favour the fast ones and land ~8% under it."""
    from paged import sim

    noise = [1.0] * 8 + [1.5, 2.0]  # mean 1.15
    shapes = [StepShape(prefill_tokens=0, decode_rows=r, kv_tokens=100 * r, padded_tokens=r) for r in range(1, 9)]
    true = lambda s: 0.01 + 0.002 * s.decode_rows
    xs = [s for s in shapes for _ in noise]
    ys = [true(s) * k for s in shapes for k in noise]
    fit = StepTimeModel.fit(xs, ys)
    for s in shapes:
        assert fit.predict(s) == pytest.approx(1.15 * true(s), rel=0.01)
    monkeypatch.setattr(sim, "REWEIGHTS", 0)
    low = StepTimeModel.fit(xs, ys)
    assert all(low.predict(s) < 0.95 * 1.15 * true(s) for s in shapes)  # 1.054: sum(1/y) / sum(1/y^2)


def test_attn_pairs_counts_the_query_key_pairs_attention_scores():
    """A chunk of n tokens from position s scores n * s + n(n+1)/2 pairs (each query sees the context and the
    chunk up to itself), a decode row its whole context; a later chunk of the same prompt costs more than the first."""
    rows = [RowInput(tokens=[1] * 10, start_pos=3, pages=[1, 2], sample=False),
            RowInput(tokens=[5], start_pos=20, pages=[3, 4, 5]), RowInput(tokens=[6], start_pos=7, pages=[6])]
    assert StepShape.from_rows(rows).attn_pairs == (10 * 3 + 55) + 21 + 8
    first = RowInput(tokens=[1] * 4, start_pos=0, pages=[1])
    later = RowInput(tokens=[1] * 4, start_pos=8, pages=[1])
    assert (StepShape.from_rows([first]).attn_pairs, StepShape.from_rows([later]).attn_pairs) == (10, 42)
    assert StepTimeModel(0.0, {"attn_pairs": 1e-6}).predict(StepShape.from_rows([later])) == pytest.approx(42e-6)


def test_kv_read_counts_every_padded_slot_against_the_longest_rows_context_bucket():
    """Decode attention reads each padded row up to the context bucket of the batch's longest row: three rows of 1,
    1 and 20 pages read like four rows of the 20-page row's bucket, far more than the rows' own KV."""
    spec = BucketSpec.from_config(EngineConfig(page_size=16, max_batch_size=8, max_seq_len=1024), attn_impl="xla")
    assert spec.page_switch and 32 in spec.pages and 16 in spec.pages
    long = RowInput(tokens=[5], start_pos=310, pages=list(range(1, 21)))  # 311 tokens: 20 pages -> bucket 32
    short = [RowInput(tokens=[5], start_pos=4, pages=[30 + i]) for i in range(2)]
    mixed = StepShape.from_rows([long, *short], spec)
    assert mixed.padded_tokens == 4 and mixed.kv_read == 4 * 32 * 16 and mixed.kv_tokens == 311 + 5 + 5
    assert StepShape.from_rows(short, spec).kv_read == 2 * min(spec.pages) * 16
    nobucket = BucketSpec.from_config(EngineConfig(page_size=16, max_batch_size=8, max_seq_len=1024),
                                      attn_impl="pallas")  # the kernel visits real pages: no context buckets
    assert not nobucket.page_switch and StepShape.from_rows([long, *short], nobucket).kv_read == (20 + 1 + 1) * 16
    m = StepTimeModel(0.01, {"kv_read": 1e-6})
    assert m.predict(mixed) == pytest.approx(0.01 + 4 * 32 * 16 * 1e-6)


def test_step_time_model_predict_fit_save_load(tmp_path):
    m = StepTimeModel(0.01, {"prefill_tokens": 1e-3, "decode_rows": 2e-3, "kv_tokens": 1e-6})
    assert m.predict(StepShape(100, 4, 1000, 128)) == pytest.approx(0.01 + 0.1 + 0.008 + 0.001)
    rng = np.random.default_rng(0)
    shapes = [StepShape(*map(int, rng.integers(0, 256, 4))) for _ in range(40)]
    fit = StepTimeModel.fit(shapes, [m.predict(s) for s in shapes], device="cpu", model="m")
    assert fit.base_s == pytest.approx(0.01) and fit.fit_stats["mean_abs_rel_error"] < 1e-9
    assert all(fit.coef[f] == pytest.approx(m.coef.get(f, 0.0), abs=1e-12) for f in FEATURES)
    path = tmp_path / "stm.json"
    fit.save(path)
    assert json.loads(path.read_text())["device"] == "cpu"
    back = StepTimeModel.load(path)
    assert back == fit
    with pytest.raises(InvalidConfigError, match="unknown coefficient"):
        StepTimeModel(0.0, {"flops": 1.0})
    with pytest.raises(InvalidConfigError, match="narrow_tokens"):
        StepTimeModel(0.0, narrow_tokens=-1)

    with pytest.raises(InvalidConfigError, match=r"base_s must be a number of seconds in \[0, 3600\]"):
        StepTimeModel(-1.0)
    with pytest.raises(InvalidConfigError, match="profile_step"):
        StepTimeModel.load(tmp_path / "missing.json")
    path.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(InvalidConfigError, match="schema"):
        StepTimeModel.load(path)
    # malformed files: each an InvalidConfigError saying what is wrong (they had been AttributeError, TypeError,
    # UnicodeDecodeError; a coefficient of 1e308 had overflowed the virtual clock after two steps)
    base = {"schema": "step_time_model/1", "base_s": 0.01}
    for content, match in ((json.dumps([1, 2]), "a fit is a JSON object"),
                           (json.dumps({"schema": "step_time_model/1"}), "the fit has no base_s"),
                           (json.dumps({**base, "coef": ["decode_rows"]}), "coef must be a dict"),
                           (json.dumps({**base, "coef": None}), "coef must be a dict"),
                           (json.dumps({**base, "coef": {"decode_rows": 1e308}}), r"decode_rows must be .* 3600"),
                           (json.dumps({**base, "setup": {"isa": 5}}), r"setup\['isa'\] must be a list"),
                           (json.dumps({**base, "device": 3}), "device must be a string"),
                           (json.dumps({**base, "fit_stats": "x"}), "fit_stats must be a dict")):
        path.write_text(content)
        with pytest.raises(InvalidConfigError, match=match):
            StepTimeModel.load(path)
    path.write_bytes(b"\x7fELF\xd0\x00")
    with pytest.raises(InvalidConfigError, match="codec can't decode"):
        StepTimeModel.load(path)


def test_the_wide_step_term_is_paid_once_by_steps_wider_than_the_narrow_path():
    """The CPU engine decodes up to 16 token slots with its native kernel and wider steps through XLA: the fit
    finds the jump, which a model without the term spreads over the other coefficients."""
    m = StepTimeModel(0.01, {"decode_rows": 2e-3, "padded_tokens": 1e-5, "wide_step": 0.03}, narrow_tokens=16)
    assert m.predict(StepShape(0, 16, 100, 16)) == pytest.approx(0.01 + 0.032 + 16e-5)  # narrow: no jump
    assert m.predict(StepShape(1, 16, 100, 32)) == pytest.approx(0.01 + 0.032 + 32e-5 + 0.03)
    assert m.predict(StepShape(20, 0, 100, 0)) == pytest.approx(0.01 + 0.03)  # unpadded: its 20 real tokens
    assert StepTimeModel(0.01, {"wide_step": 0.03}).predict(StepShape(64, 0, 0, 64)) == 0.01  # narrow_tokens 0
    rng = np.random.default_rng(1)
    pre, dec, kv = rng.choice([0, 0, 16, 64, 256], 60), rng.integers(1, 16, 60), rng.integers(0, 4096, 60)
    shapes = [StepShape(int(p), int(d), int(k), int(p + d + (-(p + d)) % 16)) for p, d, k in zip(pre, dec, kv)]
    fit = StepTimeModel.fit(shapes, [m.predict(s) for s in shapes], narrow_tokens=16)
    assert fit.coef["wide_step"] == pytest.approx(0.03) and fit.fit_stats["mean_abs_rel_error"] < 1e-9
    assert fit.narrow_tokens == 16 and StepTimeModel.from_dict(fit.to_dict()) == fit
    plain = StepTimeModel.fit(shapes, [m.predict(s) for s in shapes])
    assert plain.coef["wide_step"] == 0.0 and plain.fit_stats["mean_abs_rel_error"] > 0.05

def test_simulated_engine_timings_are_virtual_and_exact():
    sim = SimulatedEngine(CFG, StepTimeModel.constant(0.5))
    assert isinstance(sim, EngineProtocol)
    gen = DynamicGenerator(tokenizer=TOK, engine=sim)
    assert gen.clock is sim.clock
    sim.clock.advance(10.0)
    gen.enqueue(Job(TOK.encode("a" * 20), 5, identifier="j"))  # 20-token prompt: chunks of 16 + 4
    f = drain(gen).finals["j"]
    assert gen.pending == [] and sim.clock() == 10.0 + 0.5 * 6  # 2 prefill steps (the 2nd samples) + 4 decodes
    assert f["time_enqueued"] == 0.0 and f["time_prefill"] == 1.0 and f["time_generate"] == 2.0
    assert f["job"].arrival == 10.0


def test_simulated_engine_uses_the_model_of_each_step_shape():
    m = StepTimeModel(0.001, {"prefill_tokens": 0.01, "decode_rows": 0.1})
    sim = SimulatedEngine(CFG, m, record_steps=True)
    gen = DynamicGenerator(tokenizer=TOK, engine=sim, decode_steps=2)
    gen.enqueue(Job(TOK.encode("abc"), 5))
    drain(gen)
    shapes = [s for s, _ in sim.records]
    assert shapes[0].prefill_tokens == 3 and all(s.decode_rows == 1 for s in shapes[1:])
    assert sim.clock() == pytest.approx(sum(m.predict(s) for s in shapes))
    assert sim.clock() == pytest.approx(0.001 + 0.03 + 4 * 0.101)


def run_workload(seed: int, policy="vllm"):
    rng = np.random.default_rng(seed)
    sim = SimulatedEngine(EngineConfig(num_pages=17, page_size=8, max_batch_size=4, max_chunk_size=16,
                                       max_seq_len=64), StepTimeModel(0.01, {"prefill_tokens": 1e-3}))
    gen = DynamicGenerator(engine=sim, policy=policy)
    arrivals = np.cumsum(rng.exponential(0.05, 40))
    out, i = [], 0
    while i < len(arrivals) or gen.num_remaining_jobs():
        while i < len(arrivals) and arrivals[i] <= sim.clock():
            gen.enqueue(Job(rng.integers(0, 250, int(rng.integers(4, 30))).tolist(), int(rng.integers(1, 30)),
                            identifier=i))
            i += 1
        if not gen.num_remaining_jobs():
            sim.clock.sleep(arrivals[i] - sim.clock())
            continue
        out += [(r["identifier"], sim.clock(), tuple(r.get("token_ids", ()))) for r in gen.iterate()]
    return out, gen.metrics()["preemptions"]


def test_simulation_is_deterministic_for_a_seed():
    a, pa = run_workload(3)
    b, pb = run_workload(3)
    c, _ = run_workload(4)
    assert a == b and pa == pb and pa > 0 and a != c


class CountingPolicy(VLLMPolicy):
    """The vLLM policy, counting how often each hook is consulted."""

    def __init__(self):
        self.calls = {"admit": 0, "prefill_budget": 0}

    def admit(self, waiting, s):
        self.calls["admit"] += 1
        super().admit(waiting, s)

    def prefill_budget(self, decode_rows, s):
        self.calls["prefill_budget"] += 1
        return super().prefill_budget(decode_rows, s)


@pytest.mark.slow  # fast tier: the same policy object drives two fake engines in test_policies / above
def test_one_policy_object_drives_the_real_engine_and_the_simulator():
    """The same CountingPolicy instance schedules a tiny real model and the simulator; on the real engine the
    preempted run's greedy output equals the unpreempted one (reserve pages, one job at a time, same engine)."""
    from experiments.lib.common import load_experiment_model

    model = load_experiment_model("tiny")
    policy = CountingPolicy()
    kw = dict(num_pages=9, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=64, max_penalty_range=0)
    real = DynamicGenerator(model, policy=policy, **kw)
    sim = SimulatedEngine(real.config, StepTimeModel.constant(0.01))
    simulated = DynamicGenerator(engine=sim, policy=policy)
    prompts = [list(range(1, 12)), list(range(20, 31))]  # 11 + 30 tokens: 6 pages each, 8 in the pool
    outs = {}
    for name, gen in (("real", real), ("sim", simulated)):
        before = dict(policy.calls)
        gen.enqueue([Job(p, 30, identifier=i, gen_settings=GREEDY) for i, p in enumerate(prompts)])
        c = drain(gen)
        assert all(policy.calls[k] > before[k] for k in before), name
        assert gen.metrics()["preemptions"] >= 1, name
        gen.pool.check({})
        outs[name] = {k: f["full_completion"] for k, f in c.finals.items()}
        assert {k: f["new_tokens"] for k, f in c.finals.items()} == {0: 30, 1: 30}
    ref = DynamicGenerator(engine=real.engine, policy="exllamav2")  # one job at a time: never preempted
    ref.enqueue([Job(p, 30, identifier=i, gen_settings=GREEDY) for i, p in enumerate(prompts)])
    tokens = lambda g, c: {i: [t for r in c.results if r["identifier"] == i and r["stage"] == "streaming"
                               for t in r["token_ids"]] for i in (0, 1)}
    c_ref = drain(ref)
    assert ref.metrics()["preemptions"] == 0
    real.enqueue([Job(p, 30, identifier=i, gen_settings=GREEDY) for i, p in enumerate(prompts)])
    c_real = drain(real)
    assert real.metrics()["preemptions"] >= 2
    assert tokens(real, c_real) == tokens(ref, c_ref)


def _fit(setup):
    return StepTimeModel(0.01, {"decode_rows": 1e-3}, device="d", model="m", setup=setup)


def test_a_fit_names_how_its_setup_differs_and_the_simulator_warns_it(tmp_path):
    from paged.sim import StepTimeMismatchWarning

    setup = {"name": "cpu_x_tiny_q4", "cpu": "AMD EPYC", "isa": ["avx2", "avx512f"], "gpu": None, "model": "tiny",
             "quantization": "keep", "attn_impl": "auto", "matmul_impl": "auto", "cache_dtype": "float32",
             "page_size": 8, "date": "2026-12-06", "commit": {"sha": "abc", "dirty": False}}
    fit = _fit(setup)
    path = tmp_path / "fit.json"
    fit.save(path)
    loaded = StepTimeModel.load(path)
    assert loaded.setup == setup  # survives the JSON round trip
    assert loaded.differences({"cpu": "AMD EPYC", "isa": ["avx2", "avx512f", "amx_tile"], "page_size": 8,
                               "cache_dtype": "float32", "attn_impl": "native", "model": "tiny"}) == [
        "attn_impl: fit 'auto', here 'native'"]
    diffs = loaded.differences({"cpu": "Intel Xeon", "isa": ["avx2"], "page_size": 16, "cache_dtype": "int8",
                                "matmul_impl": "auto", "quantization": "int4"})
    assert diffs == ["cpu: fit 'AMD EPYC', here 'Intel Xeon'", "isa: the fit used avx512f, which this host lacks",
                     "quantization: fit 'keep', here 'int4'", "cache_dtype: fit 'float32', here 'int8'",
                     "page_size: fit 8, here 16"]
    # the simulator compares the engine it simulates (its config, plus the model it is told) and warns
    with pytest.warns(StepTimeMismatchWarning, match=r"'cpu_x_tiny_q4'.*page_size: fit 8, here 16"):
        SimulatedEngine(EngineConfig(num_pages=9, page_size=16, max_batch_size=2, max_seq_len=64), loaded)
    with pytest.warns(StepTimeMismatchWarning, match="model: fit 'tiny', here 'llama3-8b'"):
        SimulatedEngine(CFG, loaded, setup={"model": "llama3-8b"})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SimulatedEngine(CFG, loaded, setup={"model": "tiny", "quantization": "keep"})  # the same setup: silent
        SimulatedEngine(CFG, StepTimeModel.constant(0.1))  # a synthetic model has no setup to differ from
        SimulatedEngine(CFG, _fit({}))  # built in code without a setup: nothing to compare
        # a caller that checked the fit once for many engines (compare_policies) builds them silent
        SimulatedEngine(CFG, loaded, setup={"model": "llama3-8b"}, warn_setup=False)


def test_a_fit_file_without_a_setup_is_warned_as_unrecorded(tmp_path):
    from paged.sim import StepTimeMismatchWarning

    path = tmp_path / "old.json"
    d = _fit({}).to_dict()
    del d["setup"]  # a fit written before fits recorded their setup
    path.write_text(json.dumps(d))
    old = StepTimeModel.load(path)
    assert old.differences({"page_size": 8})[0].startswith("the fit records no setup")
    with pytest.warns(StepTimeMismatchWarning, match="records no setup"):
        SimulatedEngine(CFG, old)
    with pytest.raises(InvalidConfigError, match="setup must be a dict"):
        StepTimeModel(0.01, setup=["cpu"])


def test_the_simulators_predictor_prices_every_shape_by_the_documented_sum():
    """`predictor()` (what `predict` and the simulator call) leaves zero terms out for speed and sums the others in
    `coef`'s order: the same bits as `base_s + sum(coef[f] * features[f])` over every term, the wide-step term
    included."""
    import random

    rng = random.Random(0)
    m = StepTimeModel(0.0031, {"prefill_tokens": 1.7e-4, "decode_rows": 0.0, "kv_tokens": 1.9e-6, "wide_step": 0.013,
                               "padded_tokens": 2.45e-4, "attn_pairs": 3.7e-7, "padded_rows": 9.5e-5},
                      narrow_tokens=64)
    price = m.predictor()
    for _ in range(500):
        s = StepShape(*(rng.randrange(0, 3000) for _ in range(4)), kv_read=rng.randrange(0, 10**5),
                      attn_pairs=rng.randrange(0, 10**6), padded_rows=rng.randrange(0, 17))
        feats = dict(zip(FEATURES, s.features(m.narrow_tokens)))
        assert price(s) == m.predict(s) == m.base_s + sum(c * feats[f] for f, c in m.coef.items())
    assert price(StepShape(0, 1, 10, 65)) - price(StepShape(0, 1, 10, 64)) == pytest.approx(0.013 + 2.45e-4)
