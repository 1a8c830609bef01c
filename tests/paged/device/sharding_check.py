"""Run by tests/paged/device/test_sharding.py in a fresh process (the virtual CPU devices must exist before JAX starts):
the generator on one device and with `mesh="tp=2"` / `"tp=4"` over 4 virtual CPU devices (`chex.set_n_cpu_devices`),
on a tiny random Llama (8 query heads, 4 KV heads). Prints one JSON object of findings; the test asserts on it."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import re

import chex

chex.set_n_cpu_devices(4)

import jax  # noqa: E402

from models import ModelConfig, quant  # noqa: E402
from models.loader import Model  # noqa: E402
from paged import DynamicGenerator, Job, SamplingSettings  # noqa: E402
from paged.device.batch import RowInput, build_batch  # noqa: E402
from paged.device.engine import forward_shape  # noqa: E402
from paged.device.step import forward_inputs, step_forward  # noqa: E402
from paged.errors import InvalidConfigError  # noqa: E402
from paged.testing import ByteTokenizer, drain, tiny_model  # noqa: E402
from pallas_kernels import native  # noqa: E402
from tests.paged.device.test_sharding import QUANT_MESHES  # noqa: E402

TOK = ByteTokenizer()
CFG = ModelConfig(model_type="llama", vocab_size=258, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
                  num_kv_heads=4, head_dim=16)
MODEL = tiny_model(CFG, seed=0, tokenizer=TOK, scale=0.08)
SETTINGS = dict(num_pages=40, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=96, max_penalty_range=0)
SHARED = "the cat sat on the mat and then it sat again on the "  # 52 tokens: prefix pages shared between jobs


def jobs(settings, seed=None):
    prompts = [SHARED + "hat", SHARED + "dog", "hello world hello world", SHARED + "hat", "zq"]
    return [Job(TOK.encode(p), 14 + i, gen_settings=settings, identifier=i, seed=None if seed is None else seed + i)
            for i, p in enumerate(prompts)]


def run(mesh: str, settings, seed=None, model=None, **extra):
    g = DynamicGenerator(model or MODEL, mesh=mesh, **{**SETTINGS, **extra})
    js = jobs(settings, seed)
    g.enqueue(js)
    results = g.iterate() + g.iterate()  # a few steps in, cancel one job (its pages go back)
    g.cancel(js[2])
    c = drain(g)
    g.pool.check({})
    finals = {str(i): f["full_completion"] for i, f in c.finals.items() if f.get("eos_reason") != "cancelled"}
    ids = {str(i): [t for r in results + c.results if r["identifier"] == i and r["stage"] == "streaming"
                    for t in r["token_ids"]] for i in range(5)}
    return g, finals, ids, sum(f.get("cached_tokens", 0) for f in c.finals.values())


def hlo_of(engine) -> tuple[str, float]:
    """The compiled step's HLO text (per device, after partitioning) and its FLOPs per device."""
    rows = [RowInput(tokens=[5, 6, 7], start_pos=0, pages=[1], sample=True),
            RowInput(tokens=[9], start_pos=3, pages=[2], sample=True)]
    shape = engine.shape_for(rows)
    batch, _ = build_batch(rows, shape, engine.page_size, engine.vocab_size, sample_rows=shape.sample_rows_for(2))
    kw = dict(statics=engine.statics, shape=forward_shape(shape))
    ctx = jax.set_mesh(engine.mesh) if engine.mesh is not None else contextlib.nullcontext()
    with ctx:
        compiled = step_forward.lower(engine.model.params, engine.state, forward_inputs(batch), **kw).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return compiled.as_text(), float(cost["flops"])


def token_rows(engine) -> dict[str, list[int]]:
    """Which rows of an [8, H] hidden-state array each device holds after the step's token constraint
    (`constrain_tokens`), keyed by the device's mesh coordinates "dp,tp": the split over `dp` made visible (outputs
    alone stay equal whatever axis the tokens are split over)."""
    import jax.numpy as jnp
    import numpy as np

    from paged.device.sharding import constrain_tokens

    with jax.set_mesh(engine.mesh):
        out = jax.jit(constrain_tokens)(jnp.zeros((8, CFG.hidden_size), jnp.float32))
    coords = {int(d.id): ",".join(map(str, ix)) for ix, d in np.ndenumerate(engine.mesh.devices)}
    return {coords[int(s.device.id)]: [s.index[0].start or 0, s.index[0].stop or 8] for s in out.addressable_shards}


def release() -> None:
    """Drop the compiled programs of the mesh just checked: this one process runs ~30 engine configurations, and
    their programs' memory maps (hundreds each) reached ~57,000 of Linux's 65,530 per process (`vm.max_map_count`)
    when they were kept to the end. The configurations of one mesh run one after another and keep theirs until the
    next mesh: their samplers are the same programs whatever the model, cache or kernels (compiled once per mesh
    instead of once per configuration)."""
    jax.clear_caches()
    gc.collect()


@contextlib.contextmanager
def shard_maps():
    """The `in_specs` of every `jax.shard_map` call inside the block (the per-device kernels and matmuls traced)."""
    real, traced = jax.shard_map, []
    jax.shard_map = lambda f, **kw: traced.append(kw["in_specs"]) or real(f, **kw)
    try:
        yield traced
    finally:
        jax.shard_map = real


def mesh_check(mesh: str, greedy, sampled, ref, ref_ids, ref_s, ref_flops) -> dict:
    """The float model under `mesh`: greedy and seeded sampled outputs, the state's and weights' shardings, the
    collectives of the compiled step and its FLOPs against one device, and how the tokens are split."""
    g, fin, ids, cached = run(mesh, greedy)
    _, fin_s, _, _ = run(mesh, sampled, seed=3)
    hlo, flops = hlo_of(g.engine)
    st = g.engine.state
    layers = g.engine.model.params.layers
    cache_shape = ",".join(map(str, st.k.shape))
    gathered = re.compile(rf"=\s*\S+\[{cache_shape}\]\S*\s+all-gather(-start)?\(")  # an all-gather *of* the cache
    gathers = [line for line in hlo.splitlines() if gathered.search(line)]
    return {
        "greedy_equal": fin == ref and ids == ref_ids, "sampled_equal": fin_s == ref_s, "cached_tokens": cached,
        "k_spec": str(st.k.sharding.spec), "v_spec": str(st.v.sharding.spec),
        "k_shard_shape": list(st.k.addressable_shards[0].data.shape), "k_shape": list(st.k.shape),
        "wo_spec": str(layers.wo.sharding.spec), "w_down_spec": str(layers.w_down.sharding.spec),
        "wqkv_spec": str(layers.wqkv.sharding.spec), "w_gate_up_spec": str(layers.w_gate_up.sharding.spec),
        "fused_groups": layers.fused_groups,
        "cache_gathers": [line.strip()[:160] for line in gathers],
        "all_gathers": sum(" all-gather" in line for line in hlo.splitlines()),
        "all_reduces": sum("all-reduce" in line for line in hlo.splitlines()),
        "flops_per_device_vs_one": flops / ref_flops,
        "mesh_shape": dict(g.engine.mesh.shape),
        "token_rows": token_rows(g.engine),
    }


def pallas_check(mesh: str, greedy, ref_p, ref) -> tuple[list, dict]:
    """The Pallas kernel (interpreted on the CPU) per device through shard_map under `mesh`, against the kernel on
    one device: (the first kernel's in_spec of the cache and the kernels traced, findings)."""
    with shard_maps() as traced:
        g, fin, _, _ = run(mesh, greedy, attn_impl="pallas")
    hlo, _ = hlo_of(g.engine)
    cache_shape = ",".join(map(str, g.engine.state.k.shape))
    gathered = re.compile(rf"=\s*\S+\[{cache_shape}\]\S*\s+all-gather(-start)?\(")
    return [str(s[1]) for s in traced[:1]] + [len(traced)], {
        "greedy_equal": fin == ref_p, "equal_to_xla": fin == ref,
        "cache_gathers": sum(bool(gathered.search(line)) for line in hlo.splitlines())}


def main():
    out = {"devices": len(jax.devices())}
    greedy = SamplingSettings.greedy()
    sampled = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    # one device: every reference
    g, ref, ref_ids, ref_cached = run("", greedy)
    _, ref_s, _, _ = run("", sampled, seed=3)
    out["reference"] = ref
    out["reference_cached_tokens"] = ref_cached
    ref_flops = hlo_of(g.engine)[1]
    _, ref8, _, _ = run("", greedy, cache_dtype="int8")
    _, ref_p, _, _ = run("", greedy, attn_impl="pallas")
    impls = ["xla"] + (["native"] if native.available() else [])
    models = {"q4_1": quantized("q4_1", 32), "int8pc": quantized("int8", None)}
    quant_refs = {(name, impl): run("", greedy, model=model, matmul_impl=impl)[1] for name, model in models.items()
                  for impl in impls}
    release()
    # first after a release: the draft's variants (and the target's) are new here
    out["draft_model"] = draft_model_check(greedy, ref)
    out["dp_warmup"] = dp_warmup_check(greedy)
    release()
    quant = {}
    for mesh in ("tp=2", "tp=4", "dp=2", "dp=2,tp=2", "dp=4"):
        out[mesh] = mesh_check(mesh, greedy, sampled, ref, ref_ids, ref_s, ref_flops)
        if mesh == "tp=2":
            g, fin, _, _ = run("tp=2", greedy, cache_dtype="int8")
            out["int8"] = {"greedy_equal": fin == ref8, "k_scale_spec": str(g.engine.state.k_scale.sharding.spec)}
            g, fin, _, _ = run("tp=2", greedy, use_ngram_draft=True, num_draft_tokens=3)
            out["ngram"] = {"greedy_equal": fin == ref, "verification_rows": g.metrics()["verification_rows"]}
        if mesh in ("tp=2", "dp=2,tp=2"):
            out[f"shard_maps {mesh}"], out[f"pallas {mesh}"] = pallas_check(mesh, greedy, ref_p, ref)
        for name, model in models.items():
            if mesh in QUANT_MESHES[name]:
                for impl in impls:
                    quant[f"{name} {impl} {mesh}"] = quantized_check(mesh, model, impl, greedy,
                                                                    quant_refs[name, impl])
        release()
    errors = {}
    for mesh in ("tp=8", "dp=4,tp=2", "tp=3", "pp=2", "tp=two"):
        try:
            DynamicGenerator(MODEL, mesh=mesh, **SETTINGS)
            errors[mesh] = None
        except InvalidConfigError as e:
            errors[mesh] = str(e)
    one_kv_head = tiny_model(dataclasses.replace(CFG, num_kv_heads=1), seed=1, tokenizer=TOK)
    try:  # a draft model the target's mesh cannot split
        DynamicGenerator(MODEL, mesh="tp=2", draft_model=one_kv_head, num_draft_tokens=2, **SETTINGS)
        errors["draft tp=2"] = None
    except InvalidConfigError as e:
        errors["draft tp=2"] = str(e)
    out["errors"] = errors
    out["quantized"] = {**quant, "impls": impls}
    print("SHARDING_CHECK " + json.dumps(out))


def draft_model_check(greedy, ref) -> dict:
    """A draft model (the target's first layer and head) on `tp=2`: its cache and its drafts (kept on the device, fed
    to the target's forward) follow the target's mesh, and after warmup nothing compiles: the state a step returns is
    the same argument as the state `shard_state` placed."""
    from models.draft import truncated_model
    from paged.device.engine import count_compiles

    spec = dict(draft_model=truncated_model(MODEL, 1), num_draft_tokens=3)
    g = DynamicGenerator(MODEL, mesh="tp=2", **spec, **SETTINGS)  # first: the draft's variants are new here
    g.warmup()
    warm = count_compiles()
    g.enqueue(jobs(greedy))
    drain(g)
    compiled = {k: v - warm[k] for k, v in count_compiles().items()}
    _, fin, _, _ = run("tp=2", greedy, **spec)
    return {"greedy_equal": fin == ref, "verification_rows": g.metrics()["verification_rows"],
            "compiled_after_warmup": compiled}


def dp_warmup_check(greedy) -> dict:
    """On `dp=2`, after warmup() the jobs compile nothing: XLA backend compilations counted while a job runs alone,
    then four of them with prompts of other lengths (the samplers of 2 and 4 rows had compiled: under dp the hidden
    states' placement depends on the bucket, and warmup had compiled one sampler per row count)."""
    seen = []

    def listen(event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    g = DynamicGenerator(MODEL, mesh="dp=2", **SETTINGS)
    g.warmup()
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        g.enqueue(Job(TOK.encode(SHARED), 6, gen_settings=greedy))
        drain(g)
        g.enqueue([Job(TOK.encode(SHARED[i:]), 6, gen_settings=greedy) for i in (0, 5, 11, 17)])
        drain(g)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    g.pool.check({})
    return {"backend_compiles": len(seen)}


def quantized(kind: str, group: int | None) -> Model:
    """MODEL with its four projections quantized (`kind`, groups of `group` rows; None: per channel)."""
    layers = MODEL.params.layers

    def q(w):
        return quant.stack([quant.quantize(w[i], kind, group) for i in range(w.shape[0])])

    layers = layers.replace(wqkv=q(layers.wqkv), wo=q(layers.wo), w_gate_up=q(layers.w_gate_up),
                            w_down=q(layers.w_down))
    return Model(config=CFG, params=MODEL.params.replace(layers=layers), tokenizer=TOK, source=f"tiny {kind}")


def quantized_check(mesh: str, model: Model, impl: str, greedy, ref) -> dict:
    """Quantized weights under tp (`quantized`): q4_1 in groups of 32 (wo's 4 groups split over tp=2, w_down's 3 do
    not) and per-channel int8 (every projection splits; the row-split ones keep their one row of scales whole), with
    the XLA matmul and the native kernel (a custom call, run per device through shard_map); `ref` the same model and
    matmul on one device."""
    with shard_maps() as traced:  # (the run's steps and `hlo_of`'s)
        g, fin, _, _ = run(mesh, greedy, model=model, matmul_impl=impl)
        hlo, _ = hlo_of(g.engine)
    layers = g.engine.model.params.layers
    full = {",".join(map(str, leaf.shape)) for w in (layers.wqkv, layers.wo, layers.w_gate_up, layers.w_down)
            for leaf in jax.tree.leaves(w)}
    gathers = [ln for ln in hlo.splitlines() if "all-gather" in ln
               and any(re.search(rf"=\s*\S+\[{s}\]\S*\s+all-gather", ln) for s in full)]
    return {
        "greedy_equal": fin == ref,
        "specs": {f: [str(x.sharding.spec) for x in (w.values, w.scales)] for f in
                  ("wqkv", "wo", "w_gate_up", "w_down") for w in [getattr(layers, f)]},
        "matmul_shard_maps": sum(not isinstance(s[1], jax.sharding.PartitionSpec) for s in traced),
        "token_split": sum(not isinstance(s[1], jax.sharding.PartitionSpec) and s[0][0] == "dp" for s in traced),
        "weight_gathers": len(gathers),
    }


if __name__ == "__main__":
    main()
