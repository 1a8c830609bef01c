"""Kernel prototyping without editing the project: the registries (built-ins registered like plugins, import paths,
the contract checked at registration), tuning parsing, the importable conformance suite (the built-ins pass it; a
kernel written outside the repository passes it through one pytest command; a wrong one fails it), and the kernel
benchmark on an external kernel."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from paged.testing import tiny_model
from pallas_kernels import native, testing
from pallas_kernels.registry import (
    KernelContractError,
    KernelError,
    KernelImpl,
    UnknownKernelError,
    attention_registry,
    matmul_registry,
    on_gpu,
)
from pallas_kernels.tuning import AttentionTuning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A paged attention written as a researcher outside the project would: straight from the contract in
# docs/kernels.md, one gather of each token's row context (no code of the project's implementations).
EXTERNAL = '''
import jax
import jax.numpy as jnp


def attention(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *, sm_scale, sliding_window=None,
              soft_cap=None, k_scales=None, v_scales=None, layout=None, tuning=None):
    t = jnp.arange(q.shape[0])
    inside = (t[:, None] >= query_start) & (t[:, None] < query_start + query_lens)      # [T, S]
    row = jnp.argmax(inside, axis=1)
    pos = kv_lens[row] - query_lens[row] + t - query_start[row]                           # [T]
    kh, _, ps, d = k_pages.shape
    keys = jnp.arange(page_table.shape[1] * ps)
    page, off = page_table[row][:, keys // ps], keys % ps                                  # [T, L]
    k = k_pages[:, page, off].astype(jnp.float32)                                          # [KH, T, L, D]
    v = v_pages[:, page, off].astype(jnp.float32)
    if k_scales is not None:
        k, v = k * k_scales[:, page, off][..., None], v * v_scales[:, page, off][..., None]
    qg = q.astype(jnp.float32).reshape(q.shape[0], kh, -1, d)                              # [T, KH, G, D]
    s = jnp.einsum("tkgd,ktld->tkgl", qg, k, precision="highest") * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    ok = (keys[None] <= pos[:, None]) & inside.any(1)[:, None]
    WINDOW
    s = jnp.where(ok[:, None, None], s, -jnp.inf)
    w = jnp.where(ok[:, None, None], jax.nn.softmax(s, axis=-1), 0.0)
    o = jnp.einsum("tkgl,ktld->tkgd", w, v, precision="highest")
    return jnp.where(inside.any(1)[:, None, None], o.reshape(q.shape), 0.0).astype(q.dtype)
'''
GOOD = EXTERNAL.replace(
    "WINDOW", "ok = ok if sliding_window is None else ok & (pos[:, None] - keys[None] < sliding_window)")
WRONG = EXTERNAL.replace("WINDOW", "pass  # forgets the sliding window")
NO_SOFT_CAP = GOOD.replace("soft_cap=None, k_scales", "k_scales")
NO_SCALE = GOOD.replace(' * sm_scale', '')


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    (tmp_path / "ext_good.py").write_text(GOOD)
    (tmp_path / "ext_wrong.py").write_text(WRONG)
    (tmp_path / "ext_nocap.py").write_text(NO_SOFT_CAP)
    (tmp_path / "ext_noscale.py").write_text(NO_SCALE)
    (tmp_path / "ext_args.py").write_text("def attention(*args, **kwargs):\n    return args[0]\n\n\n"
                                          "def both(a, b, c=0, d=0, e=0, f=0, g=0, *, tuning=None, **kw):\n"
                                          "    return a\n\n\ndef neither(x):\n    return x\n")
    first = "    t = jnp.arange(q.shape[0])"
    late = "    if q.shape[0] != 5:\n        raise IndexError('only 5 tokens')\n" + first
    (tmp_path / "ext_late.py").write_text(GOOD.replace(first, late))  # right on 5 tokens (registration's) only
    (tmp_path / "ext_wide.py").write_text(GOOD + "\n\ndef wide(q, *args, **kw):  # twice as wide, but on 5 tokens\n"
                                          "    out = attention(q, *args, **kw)\n"
                                          "    return out if q.shape[0] == 5 else jnp.concatenate([out, out], -1)\n")
    no_f16 = "    if k_pages.dtype == jnp.float16:\n        raise TypeError('no float16')\n" + first
    (tmp_path / "ext_no_f16.py").write_text(GOOD.replace(first, no_f16))
    (tmp_path / "ext_shape.py").write_text("def attention(q, k, v, qs, ql, kl, pt, *, sm_scale, sliding_window, "
                                           "soft_cap, k_scales, v_scales, layout, tuning):\n    return q[:1]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    reg = attention_registry()
    for name in list(reg.names()):
        if name.startswith("ext_"):
            reg.unregister(name)


def _env(path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(path), ROOT, env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return env


# ----------------------------------------------------------------------------------------------- registries
def test_builtins_are_registered_like_plugins():
    a, m = attention_registry(), matmul_registry()
    assert a.names()[:4] == ("auto", "reference", "xla", "pallas")
    assert m.names()[:4] == ("auto", "reference", "xla", "pallas")
    assert all(a.get(n).builtin for n in ("reference", "xla", "pallas"))
    assert a.get("xla").stacked_cache and not a.get("pallas").stacked_cache
    assert a.get("auto").name == ("pallas" if on_gpu() else "xla")
    assert a.get("pallas").tuning_type is AttentionTuning and a.get("xla").tuning_type is None


def test_import_path_registers_on_first_use_and_runs_in_the_dispatcher(kernel_dir):
    reg = attention_registry()
    impl = reg.get("ext_good:attention")
    assert impl.name == "ext_good:attention" and "ext_good:attention" in reg.names()
    case = testing.attention_cases("quick")[1]  # mixed batch with a sliding window
    testing.check_attention("ext_good:attention", case)


def test_wrong_kernels_are_rejected_at_registration_with_what_to_change(kernel_dir):
    reg = attention_registry()
    with pytest.raises(KernelContractError, match=r"does not accept the keyword\(s\) \['soft_cap'\]"):
        reg.get("ext_nocap:attention")
    with pytest.raises(KernelContractError, match=r"returned \(1, 2, 16\) float32; the contract is \(5, 2, 16\) "
                                                  r"float32 .*on the contract's small case at registration "
                                                  r"\(float32 cache\)"):
        reg.get("ext_shape:attention")
    with pytest.raises(UnknownKernelError, match="cannot import module 'no_such_module'"):
        reg.get("no_such_module:attention")
    with pytest.raises(UnknownKernelError, match="has no attribute 'missing'"):
        reg.get("ext_good:missing")
    with pytest.raises(UnknownKernelError, match="unknown implementation 'flash'.*module:function"):
        reg.get("flash")
    with pytest.raises(KernelError, match="already registered"):
        reg.register("xla", lambda *a, **k: None)
    with pytest.raises(KernelError, match="built-in"):
        reg.unregister("pallas")
    assert "ext_nocap:attention" not in reg.names()  # nothing half-registered


def test_a_deliberately_wrong_kernel_fails_the_check(kernel_dir):
    window_case = next(c for c in testing.attention_cases("quick") if c.window)
    testing.check_attention("reference", window_case)
    with pytest.raises(AssertionError, match=window_case.name):
        testing.check_attention("ext_wrong:attention", window_case)


def test_matmul_registry_checks_its_contract():
    reg = matmul_registry()
    with pytest.raises(KernelContractError, match="cannot be called as the contract calls it"):
        reg.register("mm_one_arg", lambda x: x)
    with pytest.raises(KernelContractError, match=r"returned \(3, 64\) float32; the contract is \(3, 32\) float32 "):
        reg.register("mm_wrong_shape", lambda x, qa, *, tuning=None: x)
    assert "mm_one_arg" not in reg.names() and "mm_wrong_shape" not in reg.names()


# ------------------------------------------------------------------------------------------------------ tuning
def test_tuning_from_flags_json_and_dicts(tmp_path):
    reg = attention_registry()
    assert reg.parse_tuning("pallas", "block_q=8, pages_per_block=2,k_splits=3") == AttentionTuning(8, 2, 3)
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"block_q": 4}))
    assert reg.parse_tuning("pallas", str(f)) == AttentionTuning(block_q=4)
    assert reg.parse_tuning("pallas", {"num_warps": 8}) == AttentionTuning(num_warps=8)
    assert reg.parse_tuning("pallas", None) is None and reg.parse_tuning("pallas", "") is None
    with pytest.raises(KernelError, match="has no field.*block_k"):
        reg.parse_tuning("pallas", "block_k=8")
    with pytest.raises(KernelError, match="block_q must be a power of two"):
        reg.parse_tuning("pallas", "block_q=3")
    with pytest.raises(KernelError, match="block_q='big' is not an int"):
        reg.parse_tuning("pallas", "block_q=big")
    with pytest.raises(KernelError, match="takes no tuning"):
        reg.parse_tuning("xla", "block_q=8")


def test_tuning_values_are_checked_by_type(tmp_path):
    """(A float or a bool had been taken for an int field, a string kept for an `int | None` one, a repeated name
    silently overwritten, and a missing file reported as bad JSON.)"""
    reg = attention_registry()
    for value, message in (({"block_q": 4.5}, "block_q must be an int, got 4.5"),
                           ({"k_splits": True}, "k_splits must be an int, got True"),
                           ("block_q=4,block_q=8", "sets block_q twice"),
                           (str(tmp_path / "missing.json"), "the tuning file .*missing.json' does not exist")):
        with pytest.raises(KernelError, match=message):
            reg.parse_tuning("pallas", value)

    @dataclasses.dataclass(frozen=True)
    class Opt:
        size: int | None = None
        scale: float = 1.0

    def attention(q, *args, tuning=None, **kw):
        return q

    impl = KernelImpl(name="opt", fn=attention, family="paged_attention", tuning_type=Opt)
    assert reg.parse_tuning(impl, "size=4,scale=2") == Opt(4, 2.0) and reg.parse_tuning(impl, "size=none") == Opt()
    assert reg.parse_tuning(impl, {"size": None, "scale": 3}) == Opt(None, 3.0)


def test_tuning_types_are_frozen_dataclass_classes():
    """(A mutable dataclass had been accepted: its tuning is unhashable, and every step failed.)"""
    reg = attention_registry()

    @dataclasses.dataclass
    class Mutable:
        block: int = 4

    for bad in (Mutable, Mutable(), AttentionTuning()):
        with pytest.raises(KernelContractError, match="tuning_type must be a frozen dataclass class"):
            reg.register("ext_bad_tuning", lambda *a, **k: a[0], tuning_type=bad, check=False)


def test_replacing_a_builtin_keeps_it_a_builtin():
    """(`register("xla", fn, replace=True)` had made it removable; unregistering it broke "auto" process-wide.)"""
    reg = attention_registry()
    xla = reg.get("xla")
    reg.register("xla", xla.fn, stacked_cache=True, replace=True, check=False)
    with pytest.raises(KernelError, match="'xla' is a built-in implementation and cannot be removed"):
        reg.unregister("xla")
    assert reg.get("xla").builtin and reg.get("auto") is not None


def test_the_tuning_reaches_the_kernel():
    """A tuning given to the dispatcher is the blocking the kernel runs (its pallas_call's grid)."""

    from tests.pallas_kernels.helpers import equations

    case = testing.attention_cases("quick")[2]
    inputs = testing.build_attention_inputs(case)
    t = AttentionTuning(block_q=4, pages_per_block=1, k_splits=2)
    arrays = {k: v for k, v in inputs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in inputs.items() if k not in arrays}
    jaxpr = jax.make_jaxpr(lambda a: testing.run_attention("pallas", {**a, **static}, tuning=t, interpret=True))(
        arrays)
    (call,) = [e for e in equations(jaxpr) if e.primitive.name == "pallas_call"]
    assert tuple(call.params["grid_mapping"].grid) == (-(-inputs["q"].shape[0] // 4), case.kv_heads, 2)


def test_default_tuning_prefers_a_measured_table_entry(monkeypatch):

    from pallas_kernels import tuned_tables
    from pallas_kernels.tuning import default_tuning

    shape = dict(max_query_len=1, num_kv_heads=2, page_size=16, pages_per_row=40)
    heuristic = default_tuning(**shape)
    measured = AttentionTuning(block_q=2, pages_per_block=8, k_splits=5)
    key = tuned_tables.attention_key(max_query_len=1, num_kv_heads=2, page_size=16, pages_per_row=40)
    monkeypatch.setitem(tuned_tables.ATTENTION, jax.devices()[0].device_kind, {key: measured})
    assert default_tuning(**shape) == measured != heuristic


def test_matmul_default_tuning_prefers_a_measured_table_entry(monkeypatch):
    from pallas_kernels import tuned_tables
    from pallas_kernels.dequant_matmul import MatmulTuning, default_tuning

    qa = testing.random_quantized(np.random.default_rng(0), "q4_1", 32, 576, 1536)
    monkeypatch.setattr(tuned_tables, "MATMUL", {})  # the heuristic (on an H100 the shipped table has this shape)
    heuristic = default_tuning(1, qa)
    entry = dict(block_n=16, block_out=256, block_in=32, split_in=2)
    key = tuned_tables.matmul_key(kind="q4_1", group_size=32, k=576, out=1536)  # one entry per matrix
    monkeypatch.setitem(tuned_tables.MATMUL, jax.devices()[0].device_kind, {key: entry})
    assert default_tuning(1, qa) == default_tuning(16, qa) == MatmulTuning(**entry) != heuristic
    # more rows: the entry's tiles and reduction (a row's bits the same beside any number of rows), larger row blocks
    assert default_tuning(32, qa) == MatmulTuning(**{**entry, "block_n": 32})
    assert default_tuning(2048, qa) == MatmulTuning(**{**entry, "block_n": 64})
    for tunings in tuned_tables.MATMUL.values():  # every recorded entry is a valid tuning
        for fields in tunings.values():
            MatmulTuning(**fields)


def test_table_entries_keep_a_rows_arithmetic_the_same_in_every_step():
    """A measured entry must not give a row other arithmetic in another kind of step (`tuned_tables.check_entries`):
    no attention key split, one key block per (KV heads, page size, pages) class for decode and prefill alike, one
    matmul entry per matrix. The shipped tables pass; tables that break each rule do not."""
    from pallas_kernels import tuned_tables

    tuned_tables.check_entries()
    cls = (2, 16, 64)
    with pytest.raises(ValueError, match="splits keys"):
        tuned_tables.check_entries(attention={"gpu": {("decode", *cls): AttentionTuning(block_q=1, k_splits=4)}})
    with pytest.raises(ValueError, match="pages_per_block 4 and 2"):
        tuned_tables.check_entries(attention={"gpu": {("decode", *cls): AttentionTuning(block_q=1),
                                                      (16, *cls): AttentionTuning(block_q=16, pages_per_block=2)}})
    tuned_tables.check_entries(attention={"gpu": {("decode", *cls): AttentionTuning(block_q=1),
                                                  (16, *cls): AttentionTuning(block_q=16)}})
    with pytest.raises(ValueError, match="not \\(kind, group_size, k, out\\)"):
        tuned_tables.check_entries(matmul={"gpu": {("q4_1", 32, 576, 1536, 16): {}}})


# ------------------------------------------------------------------------------------- the conformance suite
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", testing.attention_cases("quick"), ids=lambda c: c.name)
def test_builtin_attention_conforms(impl, case):
    reason = testing.native_gpu_skip_reason(impl, case)
    if reason:
        pytest.skip(reason)
    testing.check_attention(impl, case)


@pytest.mark.parametrize("impl", ["xla", "pallas", "pallas_gemv", "reference", "native"])
@pytest.mark.parametrize("case", testing.matmul_cases("quick"), ids=lambda c: c.name)
def test_builtin_matmul_conforms(impl, case):
    if impl == "native" and native.library_reason() is not None:
        pytest.skip(f"native kernel: {native.library_reason()}")
    testing.check_matmul(impl, case)


def _corrupt_one_token(row: int, shift: int, value: float = 1.0):
    """An attention that is right except at token `shift` of batch row `row`, where `value` is added (a deliberately
    wrong kernel)."""
    from pallas_kernels.paged_attention import paged_attention

    def attention(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, *, tuning=None, **kw):
        out = paged_attention(q, k_pages, v_pages, query_start, query_lens, kv_lens, page_table, impl="xla", **kw)
        return out.at[query_start[row] + shift].add(value)

    return KernelImpl(name="corrupt", fn=attention, family="paged_attention")


def test_a_mismatch_names_the_row_position_kv_len_and_page():
    case = next(c for c in testing.attention_cases("quick") if c.name == "mixed-gqa2-ps16-window")
    inputs = testing.build_attention_inputs(case, 0)
    qs, ql, kv, table = (np.asarray(inputs[k]) for k in ("query_start", "query_lens", "kv_lens", "page_table"))
    row, shift = 1, 1  # a prefill chunk starting mid-context: its second query token
    assert ql[row] > shift
    pos = int(kv[row] - ql[row] + shift)
    ps = case.page_size
    with pytest.raises(AssertionError) as e:
        testing.check_attention(_corrupt_one_token(row, shift), case)
    msg = str(e.value)
    assert (f"first at token {qs[row] + shift}, head 0 (KV head 0), row {row}, position {pos} (kv_len {kv[row]}; "
            f"page table column {pos // ps}: page {table[row, pos // ps]}, offset {pos % ps})") in msg, msg
    assert testing.token_place(inputs, int(qs[row] + shift)) == dict(
        row=row, position=pos, kv_len=int(kv[row]), page_index=pos // ps, page=int(table[row, pos // ps]),
        offset=pos % ps)


def test_a_matmul_mismatch_names_the_row_and_output_column():
    case = testing.matmul_cases("quick")[1]  # 7 rows

    def matmul(x, qa, *, tuning=None):
        from pallas_kernels.dequant_matmul import dequant_matmul

        return dequant_matmul(x, qa, impl="xla").at[5, 9].add(100.0)

    with pytest.raises(AssertionError, match="first at row 5 of x, output column 9:"):
        testing.check_matmul(KernelImpl(name="corrupt", fn=matmul, family="dequant_matmul"), case)


def test_nan_outputs_fail_the_checks():
    """NaN compares false with any tolerance: the checks had passed a kernel whose output held NaN."""
    case = next(c for c in testing.attention_cases("quick") if c.name == "mixed-gqa2-ps16-window")
    with pytest.raises(AssertionError, match=r"of them NaN or infinite .*first at token"):
        testing.check_attention(_corrupt_one_token(1, 1, np.nan), case)

    def matmul(x, qa, *, tuning=None):
        from pallas_kernels.dequant_matmul import dequant_matmul

        return dequant_matmul(x, qa, impl="xla").at[2].set(np.nan)

    nan = KernelImpl(name="nan", fn=matmul, family="dequant_matmul")
    with pytest.raises(AssertionError, match=r"of them NaN or infinite .*first at row 2 of x, output column 0:"):
        testing.check_matmul(nan, testing.matmul_cases("quick")[1])


def test_kernel_family_auto_tells_the_family_or_says_to_give_it(kernel_dir):
    from pallas_kernels.pytest_plugin import infer_families

    att, mm = attention_registry(), matmul_registry()
    assert infer_families("ext_good:attention", att, mm) == ("attention",)
    assert infer_families("ext_nocap:attention", att, mm) == ("attention",)  # registration says what it lacks
    assert infer_families("tests.pallas_kernels.test_kernel_registry:_matmul_for_family", att, mm) == ("matmul",)
    assert infer_families("native", att, mm) == ("attention", "matmul")  # registered in both: checked in both
    assert infer_families("ext_good:attention", att, mm) == ("attention",)  # now registered under its path
    for fn, what in (("attention", "both"), ("both", "both"), ("neither", "neither")):
        with pytest.raises(pytest.UsageError, match=f"--kernel=ext_args:{fn}: its signature takes {what} .*"
                                                    "--kernel-family=attention or --kernel-family=matmul"):
            infer_families(f"ext_args:{fn}", att, mm)
    with pytest.raises(pytest.UsageError, match="--kernel=nope:fn: cannot import"):
        infer_families("nope:fn", att, mm)
    with pytest.raises(pytest.UsageError, match="--kernel=flash: not a registered implementation"):
        infer_families("flash", att, mm)


def _matmul_for_family(x, qa, *, tuning=None):
    return x


def _pytest(path, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "--pyargs",
           "pallas_kernels.conformance", *args]
    return subprocess.run(cmd, cwd=path, env=_env(path), capture_output=True, text=True)


@pytest.mark.slow
def test_an_external_kernel_passes_the_suite_through_one_pytest_command(kernel_dir):
    done = _pytest(kernel_dir, "--kernel=ext_good:attention")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"{1 + len(testing.attention_cases('quick'))} passed" in done.stdout


@pytest.mark.slow
def test_a_wrong_external_kernel_fails_the_suite(kernel_dir):
    done = _pytest(kernel_dir, "--kernel=ext_wrong:attention", "-k", "window")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "mixed-gqa2-ps16-window" in done.stdout and "differ from the reference" in done.stdout
    done = _pytest(kernel_dir, "--kernel=ext_nocap:attention", "-k", "registers")
    assert done.returncode == 1 and "does not accept the keyword(s) ['soft_cap']" in done.stdout
    done = _pytest(kernel_dir, "--kernel=ext_args:attention")  # *args: a usage error, not taken for a matmul
    assert done.returncode == 4 and "--kernel-family=attention or --kernel-family=matmul" in done.stderr, done.stderr


@pytest.mark.slow
def test_the_benchmark_checks_then_times_an_external_kernel(kernel_dir):
    out = kernel_dir / "bench.json"
    cmd = [sys.executable, "-m", "experiments.bench_kernels", "--ops=attention",
           "--attn_impls=xla,ext_good:attention,ext_noscale:attention", "--attn_shapes=decode2x40,mixed8+1x64",
           "--heads=1x2x16", "--page_size=8", "--iters=1", "--repeats=2", f"--json_out={out}"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(kernel_dir), capture_output=True, text=True)
    assert done.returncode == 1, done.stderr[-2000:]  # the wrong kernel is reported, not timed
    rec = json.loads(out.read_text())
    by = {(r["impl"], r["shape"].split()[0]): r for r in rec["results"]}
    good = by[("ext_good:attention", "decode2x40")]
    assert good["correct"] and good["min_s"] <= good["median_s"] and good["gbps"] > 0
    assert rec["peaks"]["bandwidth_gbps"] > 0 and rec["git"]["sha"]
    wrong = by[("ext_noscale:attention", "decode2x40")]
    assert not wrong["correct"] and wrong["max_error"] > 1e-3 and "median_s" not in wrong
    assert np.isfinite(by[("xla", "mixed8+1x64")]["median_s"])


# ------------------------------------------------------------------------------------ in the engine config
def _greedy_tokens(config) -> list[int]:
    from models import ModelConfig
    from paged.host.generator import DynamicGenerator
    from paged.job import Job
    from paged.settings import SamplingSettings

    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16)

    model = tiny_model(cfg, seed=3)
    gen = DynamicGenerator(model, config=config)
    jobs = [Job(list(range(1, 1 + n)), 6, gen_settings=SamplingSettings.greedy()) for n in (5, 19)]
    gen.enqueue(jobs)
    while gen.num_remaining_jobs():
        gen.iterate()
    return [j.sequence[j.prompt_len:] for j in jobs]


@pytest.mark.slow  # fast tier: test_engine_flags_take_paths_and_tunings and the registry tests
def test_engine_config_takes_import_paths_and_tunings_and_generates_the_same(kernel_dir, monkeypatch):
    from paged.device.config import EngineConfig
    from pallas_kernels import paged_attention as pa
    from tests.pallas_kernels.helpers import spy

    base = dict(num_pages=24, page_size=8, max_batch_size=2, max_chunk_size=16, max_seq_len=64)
    want = _greedy_tokens(EngineConfig(**base, attn_impl="xla"))
    assert _greedy_tokens(EngineConfig(**base, attn_impl="ext_good:attention")) == want
    tuned = EngineConfig(**base, attn_impl="pallas", attn_tuning="block_q=4,pages_per_block=1")
    assert tuned.attn_tuning == AttentionTuning(block_q=4, pages_per_block=1)
    assert EngineConfig.from_kwargs(**tuned.to_dict()) == tuned
    jax.clear_caches()  # the kernel is traced afresh, so the spy sees its calls
    calls = spy(monkeypatch, pa, ["ragged_paged_attention_pallas"])
    assert _greedy_tokens(tuned) == want
    assert calls and all(kw["config"] == tuned.attn_tuning for _, _, kw in calls)  # the tuning reached the kernel


def test_engine_config_rejects_bad_kernels_and_tunings(kernel_dir):
    from paged.device.config import EngineConfig
    from paged.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="attn_impl='flash'.*unknown implementation"):
        EngineConfig(attn_impl="flash")
    with pytest.raises(InvalidConfigError, match=r"does not accept the keyword\(s\) \['soft_cap'\]"):
        EngineConfig(attn_impl="ext_nocap:attention")
    with pytest.raises(InvalidConfigError, match="'xla' takes no tuning"):
        EngineConfig(attn_impl="xla", attn_tuning="block_q=8")
    with pytest.raises(InvalidConfigError, match="has no field"):
        EngineConfig(attn_impl="pallas", attn_tuning="block_k=8")
    with pytest.raises(InvalidConfigError, match="matmul_impl='nope'"):
        EngineConfig(matmul_impl="nope")
    # every cache dtype the engine takes is traced at registration (float16 had failed only in the steps)
    with pytest.raises(InvalidConfigError, match=r"raised TypeError: no float16 .*on the contract's small case at "
                                                 r"registration \(float16 cache\)"):
        EngineConfig(attn_impl="ext_no_f16:attention")


@pytest.mark.parametrize("path, message", [
    ("ext_late:attention", r"'ext_late:attention' \(ext_late.attention\) raised IndexError: only 5 tokens "
                           r"\(called with q \(\d+, 4, 8\) float32"),
    ("ext_wide:wide", r"'ext_wide:wide' \(ext_wide.wide\) returned \(\d+, 4, 16\) float32; the contract is "
                      r"\(\d+, 4, 8\) float32"),
])
def test_a_kernel_failing_in_the_engine_is_named(kernel_dir, path, message):
    """A user kernel that passes registration and then raises, or returns another shape, at the engine's shapes: the
    step's StepError names it (it had been a bare IndexError or reshape error, naming no kernel)."""
    from paged import DynamicGenerator, Job
    from paged.errors import StepError
    from paged.testing import tiny_config, tiny_model

    gen = DynamicGenerator(tiny_model(tiny_config(64, num_layers=1)), attn_impl=path, num_pages=8, page_size=8,
                           max_batch_size=2, max_chunk_size=16, max_seq_len=32)
    gen.enqueue(Job([1, 2, 3], 2))
    with pytest.raises(StepError, match=message):
        gen.iterate()


# ------------------------------------------------------------------------------------------ the experiments
def test_engine_flags_take_paths_and_tunings(kernel_dir):
    from absl import flags
    from absl.testing import flagsaver

    from experiments.lib import engine_flags

    engine_flags.define()
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["x", "--attn_impl=pallas", "--attn_tuning=block_q=8,k_splits=2", "--matmul_impl=xla"])
        cfg = engine_flags.engine_config(2)
        assert cfg.attn_tuning == AttentionTuning(block_q=8, k_splits=2) and cfg.matmul_tuning is None
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["x", "--attn_impl=ext_good:attention"])
        assert engine_flags.engine_config(2).attn_impl == "ext_good:attention"
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["x", "--attn_impl=ext_nocap:attention"])
        with pytest.raises(Exception, match=r"--attn_impl='ext_nocap:attention'.*soft_cap"):
            engine_flags.engine_config(2)


@pytest.mark.slow
def test_generate_and_bench_serving_run_an_external_kernel(kernel_dir, tmp_path):
    import shutil

    import torch
    import transformers

    tok_dir = os.path.join(ROOT, "tests", "models", "data", "tiny_bpe")
    vocab = len(json.load(open(os.path.join(tok_dir, "tokenizer.json")))["model"]["vocab"]) + 1
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=3, pad_token_id=0)
    model_dir = tmp_path / "model"
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, name), model_dir / name)
    common = [f"--model={model_dir}", "--max_seq_len=128", "--page_size=8", "--max_chunk_size=16",
              "--max_batch_size=2", "--max_new_tokens=8", "--prompt=Tell me about caches.", "--noprogress"]
    texts = {}
    for impl in ("xla", "ext_good:attention"):
        out = tmp_path / f"{impl.replace(':', '_')}.jsonl"
        done = subprocess.run([sys.executable, "-m", "experiments.generate", *common, f"--attn_impl={impl}",
                               f"--output={out}"], cwd=ROOT, env=_env(kernel_dir), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        texts[impl] = json.loads(out.read_text().splitlines()[0])["completion"]
    assert texts["ext_good:attention"] == texts["xla"] != ""  # greedy: the same text
    done = subprocess.run(
        [sys.executable, "-m", "experiments.bench_serving", "--model=tiny", "--dataset=random", "--num_prompts=2",
         "--input_len=6", "--output_len=3", "--max_concurrency=1", "--page_size=8", "--max_seq_len=32",
         "--max_chunk_size=16", "--num_warmup=0", "--nocompile_all_buckets", "--noprogress", "--nomeasure_hardware",
         "--attn_impl=ext_good:attention", f"--output_dir={tmp_path}", "--run_name=k"],
        cwd=ROOT, env=_env(kernel_dir), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ext_good:attention" in (tmp_path / "k.jsonl").read_text()
