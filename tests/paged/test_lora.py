"""Per-job LoRA: PEFT adapters loaded into slots of a device stack, several in one batched step, each token through
its own job's adapter; the reference is the model with the adapter merged into its weights (W + scale * B @ A)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from models import ModelConfig
from models.errors import (
    CorruptFileError,
    MissingWeightError,
    ModelConfigError,
    ModelFileNotFoundError,
    NonFiniteWeightError,
    WeightShapeError,
)
from models.loader import Model
from models.lora import PROJECTIONS, load_lora, projection_shapes, save_lora
from paged import DynamicGenerator, Job, SamplingSettings
from paged.device.engine import count_compiles
from paged.errors import (
    InvalidConfigError,
    InvalidConfigTypeError,
    InvalidJobError,
    InvalidJobTypeError,
    NonFiniteAdapterError,
)
from paged.testing import ByteTokenizer, drain, tiny_config, tiny_model

pytestmark = pytest.mark.fresh_programs  # (counts compiled variants)

TOK = ByteTokenizer()
CFG = tiny_config(TOK.vocab_size, max_position_embeddings=256)
MODEL = tiny_model(CFG, seed=5, tokenizer=TOK)
GEN = dict(num_pages=64, page_size=8, max_batch_size=6, max_chunk_size=16, max_seq_len=96, max_loras=3,
           max_lora_rank=8)
GREEDY = SamplingSettings.greedy()
RNG = np.random.default_rng(11)
PROMPTS = [[int(t) for t in RNG.integers(0, 256, size=n)] for n in (37, 12, 25, 20)]


ALL = tuple(PROJECTIONS.values())


def write_adapter(path, r=4, alpha=8.0, targets=ALL, seed=0, layers=None, **kw):
    rng = np.random.default_rng(seed)
    shapes = projection_shapes(CFG)
    a, b = {}, {}
    for layer in (range(CFG.num_layers) if layers is None else layers):
        for p in targets:
            fan_in, fan_out = shapes[p]
            a[(layer, p)] = rng.normal(0, 0.3, size=(r, fan_in))
            b[(layer, p)] = rng.normal(0, 0.3, size=(fan_out, r))
    save_lora(path, CFG, a, b, r=r, lora_alpha=alpha, **kw)
    return path


def peft_deltas(path) -> dict[tuple[int, str], np.ndarray]:
    """What a PEFT adapter directory adds to each weight, read straight from its files (not through `load_lora`):
    `lora_alpha / r * (B @ A)` (`/ sqrt(r)` with rsLoRA), transposed to this model's `[in, out]` layout."""
    from safetensors.numpy import load_file

    cfg = json.loads((path / "adapter_config.json").read_text())
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    raw = load_file(path / "adapter_model.safetensors")
    out = {}
    for name, a in raw.items():
        if ".lora_A." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            proj = PROJECTIONS[name.split(".lora_A.")[0].rsplit(".", 1)[1]]
            b = raw[name.replace(".lora_A.", ".lora_B.")]
            out[(layer, proj)] = (scale * (b.astype(np.float64) @ a.astype(np.float64))).T
    return out


def merged(adapter) -> Model:
    """The tiny model with the adapter merged into its weights: `adapter` is a PEFT directory (its raw files are
    merged, `peft_deltas`) or a `LoraAdapter` built in code (its own `merged_delta`)."""
    deltas = peft_deltas(adapter) if not hasattr(adapter, "merged_delta") else None
    lw = MODEL.params.layers
    f = CFG.intermediate_size
    qkv, wo, gu, down = (np.array(x) for x in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
    cols = {"q": (qkv, 0), "k": (qkv, CFG.num_heads * CFG.head_dim),
            "v": (qkv, (CFG.num_heads + CFG.num_kv_heads) * CFG.head_dim), "o": (wo, 0), "gate": (gu, 0),
            "up": (gu, f), "down": (down, 0)}
    for layer in range(CFG.num_layers):
        for p in PROJECTIONS.values():
            d = adapter.merged_delta(layer, p) if deltas is None else deltas.get((layer, p))
            if d is not None:
                w, c = cols[p]
                w[layer, :, c : c + d.shape[1]] += d
    layers = lw.replace(wqkv=qkv, wo=wo, w_gate_up=gu, w_down=down)
    return Model(config=CFG, params=MODEL.params.replace(layers=layers), tokenizer=TOK, source="merged")


def run(model, jobs, **kw):
    g = DynamicGenerator(model, **{**GEN, **kw})
    g.enqueue(jobs)
    return drain(g)


def logits_of(c, ident):
    return np.concatenate([r["logits"] for r in c.results if r["identifier"] == ident and "logits" in r])


def tokens_of(c, ident):
    return [t for r in c.results if r["identifier"] == ident for t in r.get("token_ids", [])]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    return {"a": write_adapter(d / "a", r=4, seed=1),
            "b": write_adapter(d / "b", r=8, alpha=4.0, targets=("q", "v", "down"), seed=2, use_rslora=True),
            "c": write_adapter(d / "c", r=2, targets=("o", "gate", "up"), seed=3, layers=[1])}


def test_loading_reads_peft_files_and_folds_the_scale(adapters):
    for name in "abc":  # the loaded deltas are the raw files' scale * B @ A (alpha / r; alpha / sqrt(r) for rsLoRA)
        loaded, raw = load_lora(adapters[name], CFG), peft_deltas(adapters[name])
        assert set(loaded.weights) == set(raw)
        for (layer, p), d in raw.items():
            np.testing.assert_allclose(loaded.merged_delta(layer, p), d, rtol=1e-5, atol=1e-6)
    a = load_lora(adapters["a"], CFG)
    assert a.rank == 4 and a.scale == 2.0 and a.targets == tuple(PROJECTIONS.values())
    b = load_lora(adapters["b"], CFG)
    assert b.scale == pytest.approx(4.0 / math.sqrt(8)) and b.targets == ("q", "v", "down")  # rslora
    c = load_lora(adapters["c"], CFG)
    assert set(c.weights) == {(1, "o"), (1, "gate"), (1, "up")} and c.merged_delta(0, "o") is None
    assert len({a.digest, b.digest, c.digest, load_lora(adapters["a"], CFG).digest}) == 3


def test_an_adapter_gives_the_logits_of_the_merged_weights(adapters):
    g = DynamicGenerator(MODEL, **GEN)
    g.load_lora("a", adapters["a"])
    g.enqueue(Job(PROMPTS[0], 8, gen_settings=GREEDY, identifier="a", lora="a", return_logits=True))
    got = drain(g)
    want = run(merged(adapters["a"]), [Job(PROMPTS[0], 8, gen_settings=GREEDY, identifier="a",
                                             return_logits=True)], max_loras=0)
    assert tokens_of(got, "a") == tokens_of(want, "a") and len(tokens_of(got, "a")) == 8
    np.testing.assert_allclose(logits_of(got, "a"), logits_of(want, "a"), atol=1e-4)
    base = run(MODEL, [Job(PROMPTS[0], 8, gen_settings=GREEDY, identifier="a", return_logits=True)], max_loras=0)
    assert np.max(np.abs(logits_of(base, "a")[0] - logits_of(got, "a")[0])) > 1e-2  # the adapter matters
    prompt = "Octopuses have three hearts"  # generate(lora=...): every prompt through the adapter
    want = DynamicGenerator(merged(adapters["a"]), **{**GEN, "max_loras": 0}).generate(prompt, 5,
                                                                                        gen_settings=GREEDY)
    assert g.generate(prompt, 5, gen_settings=GREEDY, lora="a") == want != g.generate(prompt, 5, gen_settings=GREEDY)


@pytest.mark.slow
def test_a_batch_mixing_adapters_gives_each_job_its_own_output(adapters):
    """Two adapters and none, prompts of other lengths (prefill chunks and decode rows in the same steps), a job
    arriving late, sampled as well as greedy: each job gives what its merged model gives alone."""
    g = DynamicGenerator(MODEL, **GEN)
    for name in "ab":
        g.load_lora(name, adapters[name])
    sampled = SamplingSettings(temperature=0.9, top_k=30, repetition_penalty=1.0)
    specs = [("a", PROMPTS[0], GREEDY), ("b", PROMPTS[1], GREEDY), (None, PROMPTS[2], GREEDY),
             ("a", PROMPTS[3], sampled), ("b", PROMPTS[0], sampled)]
    jobs = [Job(p, 10, gen_settings=s, seed=4, identifier=i, lora=name, return_logits=s is GREEDY)
            for i, (name, p, s) in enumerate(specs)]
    g.enqueue(jobs[:4])
    got = drain_with_late(g, jobs[4])
    for i, (name, p, s) in enumerate(specs):
        ref_model = MODEL if name is None else merged(adapters[name])
        want = run(ref_model, [Job(p, 10, gen_settings=s, seed=4, identifier=i, return_logits=s is GREEDY)],
                   max_loras=0)
        assert tokens_of(got, i) == tokens_of(want, i), i
        if s is GREEDY:
            np.testing.assert_allclose(logits_of(got, i), logits_of(want, i), atol=1e-4)
    g.pool.check({})


def drain_with_late(g, late):
    results = []
    for step in range(300):
        if step == 3:
            g.enqueue(late)
        if step > 3 and not g.num_remaining_jobs():
            break
        results += g.iterate()
    from paged.testing import Collected

    return Collected(results, {}, {r["identifier"]: r for r in results if r["eos"]})


def test_loading_into_a_free_slot_compiles_nothing(adapters):
    g = DynamicGenerator(MODEL, **GEN)
    g.load_lora("a", adapters["a"])
    g.warmup()
    g.enqueue(Job(PROMPTS[1], 4, gen_settings=GREEDY, lora="a"))
    drain(g)
    before = count_compiles()
    g.load_lora("b", adapters["b"])
    g.enqueue([Job(PROMPTS[1], 4, gen_settings=GREEDY, lora="b"), Job(PROMPTS[2], 4, gen_settings=GREEDY)])
    drain(g)
    assert count_compiles() == before


def test_pages_are_never_shared_across_adapters(adapters):
    g = DynamicGenerator(MODEL, **GEN)
    g.load_lora("a", adapters["a"])
    g.load_lora("b", adapters["b"])
    full_pages = (len(PROMPTS[0]) - 1) // 8
    seen = []
    for name in ("a", "b", None, "a", "b"):
        g.enqueue(Job(PROMPTS[0], 3, gen_settings=GREEDY, lora=name, identifier=name))
        seen.append(drain(g).finals[name]["cached_tokens"] // 8)
    assert seen == [0, 0, 0, full_pages, full_pages]
    g.pool.check({})


def test_unload_and_reuse_a_slot(adapters):
    g = DynamicGenerator(MODEL, **{**GEN, "max_loras": 1})
    g.load_lora("a", adapters["a"])
    with pytest.raises(InvalidConfigError, match="all 1 LoRA slots are taken"):
        g.load_lora("b", adapters["b"])
    job = Job(PROMPTS[1], 20, gen_settings=GREEDY, lora="a")
    g.enqueue(job)
    g.iterate()
    with pytest.raises(InvalidConfigError, match="used by 1 queued or running job"):
        g.unload_lora("a")
    drain(g)
    g.unload_lora("a")
    with pytest.raises(InvalidJobError, match="not loaded"):
        g.enqueue(Job(PROMPTS[1], 4, lora="a"))
    g.load_lora("c", adapters["c"])  # the same slot, every entry rewritten
    g.enqueue(Job(PROMPTS[1], 6, gen_settings=GREEDY, identifier="c", lora="c", return_logits=True))
    got = drain(g)
    want = run(merged(adapters["c"]), [Job(PROMPTS[1], 6, gen_settings=GREEDY, identifier="c",
                                             return_logits=True)], max_loras=0)
    np.testing.assert_allclose(logits_of(got, "c"), logits_of(want, "c"), atol=1e-4)
    with pytest.raises(InvalidConfigError, match="no adapter named 'zz'"):
        g.unload_lora("zz")


@pytest.mark.slow
def test_cfg_and_speculation_run_lora_jobs(adapters):
    """A CFG job with an adapter (both prompts through it), and n-gram speculation over a LoRA job, keep the
    output of the plain runs."""
    rep = (PROMPTS[1][:5] * 6)[:28]
    plain = DynamicGenerator(MODEL, **GEN)
    plain.load_lora("a", adapters["a"])
    mk = lambda: [Job(rep, 10, gen_settings=GREEDY, lora="a", identifier="rep"),  # noqa: E731
                  Job([PROMPTS[0], PROMPTS[1]], 6, gen_settings=SamplingSettings.greedy(cfg_scale=1.5), lora="a",
                      identifier="cfg")]
    plain.enqueue(mk())
    want = drain(plain)
    spec = DynamicGenerator(MODEL, **GEN, use_ngram_draft=True, num_draft_tokens=3)
    spec.load_lora("a", adapters["a"])
    jobs = mk()
    spec.enqueue(jobs)
    got = drain(spec)
    assert tokens_of(got, "rep") == tokens_of(want, "rep") and jobs[0].drafted_tokens > 0
    assert tokens_of(got, "cfg") == tokens_of(want, "cfg") and jobs[1].cfg_partner.lora_slot == jobs[1].lora_slot
    # the CFG job through the merged model: the same tokens
    ref = run(merged(adapters["a"]), [Job([PROMPTS[0], PROMPTS[1]], 6,
                                                gen_settings=SamplingSettings.greedy(cfg_scale=1.5),
                                                identifier="cfg")], max_loras=0)
    assert tokens_of(ref, "cfg") == tokens_of(want, "cfg")


def test_bad_adapters_and_arguments_raise_named_errors(adapters, tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="not a directory"):
        load_lora(tmp_path / "nope", CFG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileNotFoundError, match="adapter_config.json not found"):
        load_lora(tmp_path / "empty", CFG)

    def variant(name, config=None, tensors=None, **kw):
        d = write_adapter(tmp_path / name, **kw)
        if config is not None:
            cfg = json.loads((d / "adapter_config.json").read_text())
            cfg.update(config)
            (d / "adapter_config.json").write_text(json.dumps(cfg))
        if tensors is not None:
            from safetensors.numpy import load_file, save_file

            t = load_file(d / "adapter_model.safetensors")
            tensors(t)
            save_file(t, d / "adapter_model.safetensors")
        return d

    with pytest.raises(ModelConfigError, match="r must be an int >= 1"):
        load_lora(variant("r0", {"r": 0}), CFG)
    with pytest.raises(ModelConfigError, match="'lm_head' is not supported"):
        load_lora(variant("lm", {"target_modules": ["q_proj", "lm_head"]}), CFG)
    with pytest.raises(ModelConfigError, match="bias='all' is not supported"):
        load_lora(variant("bias", {"bias": "all"}), CFG)
    with pytest.raises(ModelConfigError, match="use_dora"):
        load_lora(variant("dora", {"use_dora": True}), CFG)
    assert load_lora(variant("regex", {"target_modules": r".*\.(q|v)_proj"}, targets=("q", "v")), CFG).targets == (
        "q", "v")
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    with pytest.raises(WeightShapeError, match=r"has shape \[4, 31\]; this model needs \[4, 32\]"):
        load_lora(variant("shape", tensors=lambda t: t.update({key: np.zeros((4, 31), np.float32)})), CFG)
    with pytest.raises(MissingWeightError, match="no lora_A tensor for layer 1 q"):
        load_lora(variant("missing", tensors=lambda t: t.pop(key)), CFG)
    with pytest.raises(WeightShapeError, match="unexpected tensor"):
        load_lora(variant("extra", tensors=lambda t: t.update({"lm_head.weight": np.zeros((2, 2), np.float32)})),
                  CFG)
    # one weight given twice (another spelling, or a second adapter's name in one file): the last read had won
    for label, twin in (("dup", "model.layers.1.self_attn.q_proj.lora_A.weight"),
                        ("named", "base_model.model.model.layers.1.self_attn.q_proj.lora_A.other.weight")):
        with pytest.raises(WeightShapeError, match=r"are both lora_A of layer 1 q; keep one"):
            load_lora(variant(label, tensors=lambda t, twin=twin: t.update({twin: np.zeros((4, 32), np.float32)})),
                      CFG)
    bad_json = variant("json")
    (bad_json / "adapter_config.json").write_text("{not json")
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        load_lora(bad_json, CFG)
    (tmp_path / "json" / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    (tmp_path / "json" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CorruptFileError, match="cannot read it"):
        load_lora(tmp_path / "json", CFG)
    other = ModelConfig(**{**CFG.__dict__, "hidden_size": 64, "head_dim": 16})
    with pytest.raises(WeightShapeError, match="this model needs"):
        load_lora(adapters["a"], other)

    g = DynamicGenerator(MODEL, **GEN)
    with pytest.raises(InvalidConfigError, match=r"load_lora\('big'\): LoRA adapter .*big: rank 12 .*max_lora_rank=8"):
        g.load_lora("big", write_adapter(tmp_path / "big", r=12))
    with pytest.raises(InvalidConfigError, match=r"load_lora\('mem'\): LoRA adapter \(in memory\): rank 12"):
        g.load_lora("mem", dataclasses.replace(load_lora(write_adapter(tmp_path / "big2", r=12), CFG), source=""))
    g.load_lora("a", adapters["a"])
    with pytest.raises(InvalidConfigError, match="loaded already"):
        g.load_lora("a", adapters["b"])
    for source in (None, 123, {"r": 4}):  # (had raised a bare TypeError)
        with pytest.raises(InvalidConfigTypeError, match=r"load_lora\('c'\): source must be a PEFT adapter directory"):
            g.load_lora("c", source)
    with pytest.raises(InvalidConfigError, match="max_loras=N"):
        DynamicGenerator(MODEL, **{**GEN, "max_loras": 0}).load_lora("a", adapters["a"])
    with pytest.raises(InvalidJobTypeError, match="lora"):
        Job(PROMPTS[0], 3, lora=3)
    with pytest.raises(InvalidJobError, match=r"lora='x' is not loaded \(loaded: \['a'\]\)"):
        g.enqueue(Job(PROMPTS[0], 3, lora="x"))
    assert not g.pending and g.pool.num_referenced == 0


def poison(path, key, value):
    """Write `value` into element [0, 0] of tensor `key` of the adapter at `path`."""
    from safetensors.numpy import load_file, save_file

    t = load_file(path / "adapter_model.safetensors")
    t[key][0, 0] = value
    save_file(t, path / "adapter_model.safetensors")
    return path


def test_non_finite_adapters_are_rejected_at_load(adapters, tmp_path):
    import dataclasses

    g = DynamicGenerator(MODEL, **GEN)
    key_b = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    key_a = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    for i, (key, value) in enumerate(((key_b, np.nan), (key_a, np.inf), (key_b, -np.inf))):
        d = poison(write_adapter(tmp_path / f"bad{i}", seed=1), key, value)
        with pytest.raises(NonFiniteWeightError, match="holds 1 non-finite value") as info:
            load_lora(d, CFG)
        assert info.value.tensor == key and str(d) in str(info.value) and key in str(info.value)
        with pytest.raises(NonFiniteAdapterError, match=key) as info:
            g.load_lora("n", d)
        assert isinstance(info.value, InvalidConfigError) and isinstance(info.value, NonFiniteWeightError)
        assert "n" not in g.loras
    # finite in the file, infinite once lora_alpha / r is folded in
    huge = poison(write_adapter(tmp_path / "huge", seed=1, alpha=1e38), key_b, 1e3)
    with pytest.raises(NonFiniteWeightError, match="times lora_alpha / r"):
        load_lora(huge, CFG)
    a = load_lora(adapters["a"], CFG)  # an adapter built in code
    weights = dict(a.weights)
    x, y = weights[(1, "o")]
    weights[(1, "o")] = (x, np.where(np.arange(y.size).reshape(y.shape) == 5, np.nan, y))
    with pytest.raises(NonFiniteAdapterError, match="'b of layer 1 o'"):
        g.load_lora("m", dataclasses.replace(a, weights=weights))
    g.load_lora("a", adapters["a"])  # the generator is as it was: the slot is free for a good adapter
    assert sorted(g.loras) == ["a"] and g.loras["a"][0] == 0


@pytest.mark.parametrize("attn_impl", ["auto", "xla"])
def test_a_non_finite_adapter_weight_reaches_only_its_own_tokens(adapters, attn_impl):
    """An adapter's delta is selected for its own tokens after the product, so even a NaN / inf that got past the
    load check (written straight into an engine slot here) cannot reach another job: a plain job decoding while a
    poisoned adapter's job joins keeps its solo tokens (a masked multiply had ended it with "log-probability nan").
    Under "xla" (the attention of a machine without the native build) the poisoned job's NaN keys and values sit in
    cache slots the plain job's rows do not see; the attention drops them rather than weighting them by 0."""
    import dataclasses

    bad = load_lora(adapters["a"], CFG)
    weights = {}
    for k, (x, y) in bad.weights.items():
        y = y.copy()
        y[0, 0] = np.nan if k[1] in ("q", "gate", "down") else np.inf
        weights[k] = (x, y)
    bad = dataclasses.replace(bad, weights=weights)
    solo = run(MODEL, [Job(PROMPTS[2], 8, gen_settings=GREEDY, identifier="plain")], attn_impl=attn_impl)
    g = DynamicGenerator(MODEL, **GEN, attn_impl=attn_impl)
    g.engine.load_lora(0, bad)  # past load_lora's check
    g.loras["n"] = (0, bad)
    g.enqueue(Job(PROMPTS[2], 8, gen_settings=GREEDY, identifier="plain"))
    for _ in range(3):
        g.iterate()
    got = drain_with_late(g, Job(PROMPTS[1], 6, gen_settings=GREEDY, identifier="n", lora="n"))
    assert got.finals["plain"]["eos_reason"] == "max_new_tokens"
    assert tokens_of(got, "plain")[-5:] == tokens_of(solo, "plain")[-5:]
    assert got.finals["plain"]["full_completion"] == solo.finals["plain"]["full_completion"]
    assert got.finals["n"]["eos_reason"] == "error"  # its own output is NaN: that job alone fails
    g.pool.check({})


def test_bf16_adapters_and_peft_regexes_load(adapters, tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    d = write_adapter(tmp_path / "bf16", r=4, seed=1)
    t = load_file(d / "adapter_model.safetensors")
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}, d / "adapter_model.safetensors")
    a, ref = load_lora(d, CFG), load_lora(adapters["a"], CFG)
    np.testing.assert_allclose(a.merged_delta(1, "q"), ref.merged_delta(1, "q"), rtol=0.05, atol=0.05)

    def regex(name, pattern, **kw):
        d = write_adapter(tmp_path / name, **kw)
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg["target_modules"] = pattern
        cfg.pop("layers_to_transform", None)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        return load_lora(d, CFG)

    assert regex("qv", r".*\.self_attn\.(q_proj|v_proj)", targets=("q", "v")).targets == ("q", "v")
    one = regex("l1", r"model\.layers\.1\.self_attn\.(q|v)_proj", targets=("q", "v"), layers=[1])
    assert set(one.weights) == {(1, "q"), (1, "v")}
    with pytest.raises(ModelConfigError, match="matches none"):
        regex("none", r"q_proj", targets=("q",))  # PEFT matches the whole module name
    # with a regex PEFT ignores layers_to_transform (it applies to listed modules): the regex alone decides
    d = write_adapter(tmp_path / "regex_layers", targets=("q",))
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": r".*\.q_proj",
                                                       "layers_to_transform": [0]}))
    assert {layer for layer, _ in load_lora(d, CFG).weights} == set(range(CFG.num_layers))
    # ... and exclude_modules drops modules of any layer from what the regex matched
    d = write_adapter(tmp_path / "regex_exclude", targets=("q",), layers=[0])
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": r".*\.q_proj",
                                                       "layers_to_transform": [1],
                                                       "exclude_modules": ["layers.1.self_attn.q_proj"]}))
    assert set(load_lora(d, CFG).weights) == {(0, "q")}


def test_adapters_given_as_objects_are_checked_and_keyed_by_their_content(adapters):
    import dataclasses

    g = DynamicGenerator(MODEL, **GEN)
    a = load_lora(adapters["a"], CFG)
    g.load_lora("a", a)
    tripled = dataclasses.replace(a, weights={k: (x, 3 * y) for k, (x, y) in a.weights.items()})  # a's digest
    g.load_lora("t", tripled)
    g.enqueue(Job(PROMPTS[0], 6, gen_settings=GREEDY, lora="a", identifier="a"))
    drain(g)
    g.enqueue(Job(PROMPTS[0], 6, gen_settings=GREEDY, lora="t", identifier="t"))
    c = drain(g)
    assert c.finals["t"]["cached_tokens"] == 0  # not a's pages
    want = run(merged(g.loras["t"][1]), [Job(PROMPTS[0], 6, gen_settings=GREEDY, identifier="t")], max_loras=0)
    assert tokens_of(c, "t") == tokens_of(want, "t")
    for bad, match in ((dataclasses.replace(a, weights={(0, "lm_head"): a.weights[(0, "q")]}), "weight key"),
                       (dataclasses.replace(a, weights={(-1, "q"): a.weights[(0, "q")]}), "weight key"),
                       (dataclasses.replace(a, rank=3), "rank 3 on this model needs")):
        with pytest.raises(WeightShapeError, match=match):
            g.load_lora("bad", bad)
    assert "bad" not in g.loras


def test_in_code_adapters_of_bad_rank_weights_or_dtype_raise_named_errors(adapters):
    """A `LoraAdapter` built in code: an `a` of object dtype holding None had passed the finiteness check (only
    numeric dtypes were checked) and become NaN in the slot (its jobs failed with "log-probability nan"); complex
    weights lost their imaginary part; a float64 beyond float32's range became inf in the slot; a rank of True, 4.0,
    0 or -1, weights not a dict or a pair not of two had raised bare TypeError / AttributeError / ValueError or
    loaded. Each is now a named error at load, and the generator is left as it was."""
    import dataclasses

    g = DynamicGenerator(MODEL, **GEN)
    a = load_lora(adapters["a"], CFG)
    x, y = a.weights[(0, "q")]

    def with_pair(pair):
        return dataclasses.replace(a, weights={**a.weights, (0, "q"): pair})

    holes = x.astype(object)
    holes[0, 0] = None
    for pair, dtype in (((holes, y), "object"), ((x.tolist(), [[None] * y.shape[1]] * y.shape[0]), "object"),
                        ((x + 1j, y), "complex"), ((x, y > 0), "bool"), ((x.astype(str), y), "<U")):
        with pytest.raises(WeightShapeError, match=r"tensor '[ab] of layer 0 q' has dtype " + dtype + ".*expected "
                                                   "real numbers") as info:
            g.load_lora("bad", with_pair(pair))
        assert info.value.tensor in ("a of layer 0 q", "b of layer 0 q")
    big = y.astype(np.float64)
    big[1, 2] = 1e300  # finite in float64, inf in the engine's float32
    with pytest.raises(NonFiniteAdapterError, match="'b of layer 0 q' holds 1 non-finite"):
        g.load_lora("bad", with_pair((x, big)))
    for rank in (True, 4.0, 0, -1, "4", None):
        with pytest.raises(WeightShapeError, match=rf"rank must be an int >= 1 .*got {re.escape(repr(rank))}"):
            g.load_lora("bad", dataclasses.replace(a, rank=rank))
    with pytest.raises(WeightShapeError, match="rank must be an int >= 1"):
        g.load_lora("bad", dataclasses.replace(a, rank=-1, weights={}))
    for weights in ([], None, list(a.weights.items())):
        with pytest.raises(WeightShapeError, match="weights must be a dict of \\(layer, projection\\) -> \\(a, b\\)"):
            g.load_lora("bad", dataclasses.replace(a, weights=weights))
    for pair, got in (((x, y, 1), "tuple of 3"), ((x,), "tuple of 1"), (x, "ndarray"), (None, "NoneType")):
        with pytest.raises(WeightShapeError, match=r"weights\[\(0, 'q'\)\] must be an \(a, b\) pair of arrays, "
                                                   "got " + got):
            g.load_lora("bad", with_pair(pair))
    assert not g.loras
    # real numbers of any float or int dtype and lists of them load (as float32), and give a's content
    g.load_lora("ok", dataclasses.replace(a, weights={k: (u.astype(np.float64).tolist(), v.astype(np.float16))
                                                      for k, (u, v) in a.weights.items()}))
    g.load_lora("ints", dataclasses.replace(a, rank=np.int64(4), weights={k: (np.ones_like(u, np.int32), v)
                                                                         for k, (u, v) in a.weights.items()}))
    assert sorted(g.loras) == ["ints", "ok"]


def patched(path, drop=(), **update):
    """`path` with its adapter_config.json updated by `update` (and the keys in `drop` removed)."""
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(update)
    for key in drop:
        cfg.pop(key, None)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def test_adapter_config_booleans_must_be_json_booleans(tmp_path):
    """`"use_rslora": "false"` (a string) or `1` had been taken as true: the scale alpha / sqrt(r) = 4 instead of
    alpha / r = 2. A boolean option is a JSON boolean or left out; anything else names the field."""
    ok = load_lora(patched(write_adapter(tmp_path / "f"), use_rslora=False), CFG)
    assert ok.scale == 2.0
    assert load_lora(patched(write_adapter(tmp_path / "t"), use_rslora=True), CFG).scale == 4.0
    assert load_lora(patched(write_adapter(tmp_path / "absent"), drop=("use_rslora",)), CFG).scale == 2.0
    # lora_alpha left out is PEFT's default, 8 (it had been r: a scale of 1 at r = 4)
    assert load_lora(patched(write_adapter(tmp_path / "no_alpha"), drop=("lora_alpha",)), CFG).scale == 8 / 4
    for i, (key, value) in enumerate((("use_rslora", "false"), ("use_rslora", "true"), ("use_rslora", 1),
                                      ("use_rslora", 0), ("use_rslora", None), ("fan_in_fan_out", "false"),
                                      ("use_dora", 0), ("lora_bias", "no"), ("use_qalora", []))):
        d = patched(write_adapter(tmp_path / f"b{i}"), **{key: value})
        with pytest.raises(ModelConfigError, match=rf"{key} must be true or false \(a JSON boolean\), got "
                                                   rf"{re.escape(repr(value))}"):
            load_lora(d, CFG)
    for i, (key, value, match) in enumerate((("r", True, "r must be an int >= 1, got True"),
                                             ("r", 4.0, "r must be an int >= 1, got 4.0"),
                                             ("r", "4", "r must be an int >= 1, got '4'"),
                                             ("lora_alpha", True, "lora_alpha must be a finite number, got True"),
                                             ("lora_alpha", "8", "lora_alpha must be a finite number"))):
        with pytest.raises(ModelConfigError, match=match):
            load_lora(patched(write_adapter(tmp_path / f"n{i}"), **{key: value}), CFG)


def test_unsupported_peft_options_are_refused_by_name(tmp_path):
    """Options this loader does not implement had been ignored (`peft_type` "IA3", `lora_bias`, `use_qalora`,
    `layer_replication`, `target_parameters`, `trainable_token_indices`): set to anything but PEFT's default, each
    is a load error naming it as unsupported; PEFT's defaults written out load."""
    defaults = dict(peft_type="LORA", lora_bias=False, use_qalora=False, layer_replication=None,
                    target_parameters=None, trainable_token_indices=None, exclude_modules=None, modules_to_save=None,
                    rank_pattern={}, alpha_pattern={}, use_dora=False, fan_in_fan_out=False, bias="none",
                    init_lora_weights=True, layers_pattern=None, lora_dropout=0.05, inference_mode=True)
    ref = load_lora(write_adapter(tmp_path / "ref", seed=1), CFG)
    full = load_lora(patched(write_adapter(tmp_path / "defaults", seed=1), **defaults), CFG)
    assert full.digest == ref.digest and full.scale == ref.scale
    # PEFT's empty values of the list / dict options are off too
    assert load_lora(patched(write_adapter(tmp_path / "empty", seed=1), target_parameters=[], layer_replication=[],
                             trainable_token_indices={}), CFG).digest == ref.digest
    for i, (key, value) in enumerate((("peft_type", "IA3"), ("peft_type", "LOHA"), ("peft_type", "lora"),
                                      ("lora_bias", True), ("use_qalora", True),
                                      ("layer_replication", [[0, 1], [0, 1]]), ("target_parameters", ["mlp.experts"]),
                                      ("trainable_token_indices", [1, 2]), ("alora_invocation_tokens", [5, 6]),
                                      ("bias", "lora_only"), ("modules_to_save", ["lm_head"]))):
        with pytest.raises(ModelConfigError, match=rf"{key}={re.escape(repr(value))} is not supported") as info:
            load_lora(patched(write_adapter(tmp_path / f"u{i}"), **{key: value}), CFG)
        assert str(tmp_path / f"u{i}") in str(info.value)
    with pytest.raises(ModelConfigError, match=r"target_modules entry \['q_proj'\] is not supported"):
        load_lora(patched(write_adapter(tmp_path / "nested"), target_modules=[["q_proj"]]), CFG)  # (a TypeError)


def test_all_linear_and_exclude_modules_select_modules_as_peft_does(tmp_path):
    """`target_modules: "all-linear"` (PEFT: every linear layer but the output head; here the seven projections) had
    been taken as a regex matching nothing; `exclude_modules` had been ignored (then a tensor it excludes was
    reported missing). Both now select what PEFT adapts; the loaded deltas are the files' own."""
    ref = write_adapter(tmp_path / "ref", seed=1)
    every = load_lora(patched(write_adapter(tmp_path / "all", seed=1), target_modules="all-linear"), CFG)
    assert every.targets == ALL and every.digest == load_lora(ref, CFG).digest
    one = load_lora(patched(write_adapter(tmp_path / "all1", seed=1, layers=[1]), target_modules="all-linear"), CFG)
    assert {layer for layer, _ in one.weights} == {1} and one.targets == ALL  # with layers_to_transform

    def excluded(name, exclude, targets, layers=None, **kw):
        d = write_adapter(tmp_path / name, seed=2, targets=targets, layers=layers)
        return load_lora(patched(d, exclude_modules=exclude, **kw), CFG), d

    # a list of names: a module's name after a dot, or its full name, as PEFT matches them
    got, d = excluded("names", ["q_proj"], ("k", "v"), target_modules=["q_proj", "k_proj", "v_proj"])
    assert got.targets == ("k", "v") and set(got.weights) == {(i, p) for i in range(CFG.num_layers) for p in "kv"}
    raw = peft_deltas(d)
    assert set(raw) == set(got.weights)
    for key, delta in raw.items():
        np.testing.assert_allclose(got.merged_delta(*key), delta, rtol=1e-5, atol=1e-6)
    names = ["layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(WeightShapeError, match="layer 0 q, which adapter_config.json does not adapt"):
        excluded("suffix", names, ALL, target_modules="all-linear")  # the files hold tensors it excludes
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "suffix" / "adapter_model.safetensors"
    t = load_file(d)
    save_file({k: v for k, v in t.items() if ".layers.0.self_attn.q_proj." not in k
               and ".layers.1.mlp.down_proj." not in k}, d)
    got = load_lora(tmp_path / "suffix", CFG)
    assert set(got.weights) == {(i, p) for i in range(CFG.num_layers) for p in ALL} - {(0, "q"), (1, "down")}
    assert got.targets == ALL
    # a regex, matched in full against the module's name
    got, _ = excluded("regex", r".*\.mlp\..*", ("q", "k", "v", "o"), target_modules="all-linear")
    assert got.targets == ("q", "k", "v", "o")
    for i, (exclude, match) in enumerate(((".*", "excludes every module target_modules 'all-linear' selects"),
                                          (["q_proj", "v_proj"], "nothing is left to adapt"),
                                          ("(", r"exclude_modules regex '\(' is invalid"),
                                          (3, "exclude_modules must be a list of module names or a regex, got 3"),
                                          ([1], "exclude_modules must be a list of module names or a regex"))):
        with pytest.raises(ModelConfigError, match=match):
            excluded(f"bad{i}", exclude, ("q", "v"), target_modules=["q_proj", "v_proj"] if i else "all-linear")


def test_adapters_on_weights_grouped_for_tensor_parallelism(adapters):
    """Under `mesh="tp=N"` the fused projections' columns are regrouped (`models.fused`); an adapter's q/k/v and
    gate/up deltas, computed in the plain order, must follow. Here on one device with the layout regrouped by hand:
    the logits equal the plain model's with the same adapter."""
    from models.fused import gate_up_parts, group_columns, qkv_parts

    lw = MODEL.params.layers
    grouped = lw.replace(wqkv=group_columns(lw.wqkv, qkv_parts(CFG), 2),
                         w_gate_up=group_columns(lw.w_gate_up, gate_up_parts(CFG), 2), fused_groups=2)
    model = Model(config=CFG, params=MODEL.params.replace(layers=grouped), tokenizer=TOK, source="grouped")
    out = []
    for m in (MODEL, model):
        g = DynamicGenerator(m, **GEN)
        g.load_lora("a", adapters["a"])
        g.enqueue(Job(PROMPTS[1], 6, gen_settings=GREEDY, identifier="a", lora="a", return_logits=True))
        out.append(drain(g))
    assert tokens_of(out[0], "a") == tokens_of(out[1], "a")
    np.testing.assert_allclose(logits_of(out[1], "a"), logits_of(out[0], "a"), atol=1e-4)
