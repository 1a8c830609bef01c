"""The native CPU paged attention (`pallas_kernels.native_attention`, `cpu/paged_attention.cc`): the whole conformance
case space against the reference; every window in the kernel by default, and with `MAX_QUERY_LEN` set, longer
windows going to XLA while the decode rows stay native; "auto" choosing it on the CPU (and "xla" where it cannot
run); the engine generating the same tokens with it as with the XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.testing import tiny_model
from pallas_kernels import native_attention, testing
from pallas_kernels import paged_attention as pa
from pallas_kernels.testing import AttentionCase
from tests.pallas_kernels.helpers import names_of, spy

# Skipped only where the library cannot be called at all: a built kernel that fails its smoke test fails these tests
pytestmark = pytest.mark.skipif(native_attention.library_reason() is not None,
                                reason=f"native attention: {native_attention.library_reason()}")


# head dimensions with their own register-held P . V accumulation (64: SmolLM2's, in the case space; 128) and one
# through the general loop (24); a sliding window across two blocks of 16 query tokens (no layout: all native)
EXTRA_CASES = [
    AttentionCase("hd128-mixed", "Pdd0d", 12, 80, 16, 2, 2, 128, layout=True),
    AttentionCase("hd128-int8-window", "dpd", 9, 60, 8, 1, 3, 128, cache="int8", window=17),
    AttentionCase("hd24-ragged-bf16", "pdd-", 7, 50, 8, 2, 2, 24, cache="bfloat16"),
    AttentionCase("ragged-long-chunks-window", "pdPd", 40, 120, 8, 2, 2, 16, window=20),
]


@pytest.fixture(autouse=True)
def _fresh_traces():
    """`MAX_QUERY_LEN` is read at trace time: traces made while a test patches it must not outlive the test."""
    yield
    jax.clear_caches()


@pytest.mark.parametrize("case", testing.attention_cases("full") + EXTRA_CASES, ids=lambda c: c.name)
def test_native_matches_the_reference(case):
    testing.check_attention("native", case)


# with MAX_QUERY_LEN = 32 (the split of 2026-11-27; None by default): XLA takes the longer windows, the decode rows (if
# any) stay native
LONG_WINDOWS = [
    AttentionCase("long-windows-and-decode", "Ppdd0d", 40, 120, 16, 2, 3, 16, layout=True),
    AttentionCase("long-windows-int8-window", "Pp", 48, 100, 8, 1, 2, 32, layout=True, cache="int8", window=30),
    AttentionCase("long-windows-bf16-cap-decode", "pPd", 36, 90, 16, 2, 2, 8, layout=True, cache="bfloat16",
                  soft_cap=2.5),
    AttentionCase("long-windows-stacked-decode", "Pdd", 33, 70, 8, 2, 2, 16, layout=True, stacked=True),
]


@pytest.mark.parametrize("case", LONG_WINDOWS, ids=lambda c: c.name)
def test_long_prefill_windows_go_to_xla_and_decode_rows_stay_native(monkeypatch, case):
    monkeypatch.setattr(native_attention, "MAX_QUERY_LEN", 32)
    jax.clear_caches()  # traced afresh, so the spies see the calls
    xla_calls = spy(monkeypatch, pa, ["ragged_paged_attention_xla"])
    native_calls = spy(monkeypatch, native_attention, ["_call"])
    testing.check_attention("native", case)
    assert names_of(xla_calls) == ["ragged_paged_attention_xla"]
    decode_rows = case.prefill_layout.num_decode_rows
    # (the reference check above also shows that the decode rows' tokens, written over the windows' output, and the
    # windows' own tokens are each right)
    assert len(native_calls) == (1 if decode_rows else 0)


@pytest.mark.parametrize("split", [32, None])
def test_long_windows_with_decode_rows_past_the_layout(monkeypatch, split):
    """The engine's prefill buckets: more rows than the layout's (`tail_decode_rows`), a decode row's token sitting in
    a window's padding. Every row's tokens are right, with the windows split off to XLA (`MAX_QUERY_LEN` 32) and
    without (the default)."""
    monkeypatch.setattr(native_attention, "MAX_QUERY_LEN", split)
    jax.clear_caches()
    xla_calls = spy(monkeypatch, pa, ["ragged_paged_attention_xla"])
    case = AttentionCase("tail-rows", "Pd", 40, 90, 8, 2, 2, 16, layout=True)
    i = testing.build_attention_inputs(case)
    qs, ql, kv, table = (np.asarray(i[k]).copy() for k in ("query_start", "query_lens", "kv_lens", "page_table"))
    ql[0] = kv[0] = 30  # the window's tokens 30..39 are padding
    tail_slot = 35
    i.update(query_start=jnp.asarray(np.append(qs, tail_slot), jnp.int32),
             query_lens=jnp.asarray(np.append(ql, 1), jnp.int32), kv_lens=jnp.asarray(np.append(kv, kv[1])),
             page_table=jnp.asarray(np.vstack([table, table[1:2]])))
    assert i["page_table"].shape[0] > case.prefill_layout.num_rows
    got = np.asarray(testing.run_attention("native", i))
    want = testing.reference_attention(i)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert np.abs(got[tail_slot]).max() > 0
    assert names_of(xla_calls) == (["ragged_paged_attention_xla"] if split else [])


def test_float16_cache():
    case = AttentionCase("f16", "pdd0P", 12, 60, 16, 2, 2, 16, window=9)
    i = testing.build_attention_inputs(case)
    i.update(k_pages=i["k_pages"].astype(jnp.float16), v_pages=i["v_pages"].astype(jnp.float16))
    got = np.asarray(testing.run_attention("native", i))
    want = testing.reference_attention(dict(i, k_pages=i["k_pages"].astype(jnp.float32),
                                            v_pages=i["v_pages"].astype(jnp.float32)))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_short_windows_stay_native(monkeypatch):
    monkeypatch.setattr(native_attention, "MAX_QUERY_LEN", 32)
    case = AttentionCase("short-windows", "Ppd", 32, 80, 16, 2, 2, 16, layout=True)
    jax.clear_caches()
    xla_calls = spy(monkeypatch, pa, ["ragged_paged_attention_xla"])
    testing.check_attention("native", case)
    assert xla_calls == []


@pytest.mark.parametrize("case", LONG_WINDOWS[:2], ids=lambda c: c.name)
def test_by_default_every_window_stays_native(monkeypatch, case):
    """`MAX_QUERY_LEN` None (the default): windows of any length run here, in one call with the decode rows."""
    jax.clear_caches()
    xla_calls = spy(monkeypatch, pa, ["ragged_paged_attention_xla"])
    native_calls = spy(monkeypatch, native_attention, ["_call"])
    testing.check_attention("native", case)
    assert xla_calls == [] and len(native_calls) == 1


def test_auto_picks_native_on_the_cpu_and_xla_where_it_cannot_run(monkeypatch):
    assert pa.auto_impl(64, 16) == "native"
    assert pa.auto_impl(12, 16) == "xla"  # head_dim not a multiple of 8
    monkeypatch.setattr(native_attention, "unavailable_reason", lambda head_dim=None: "not built")
    assert pa.auto_impl(64, 16) == "xla"


def test_it_says_why_when_it_cannot_run(monkeypatch):
    monkeypatch.setattr(native_attention.native, "unavailable_reason", lambda: "the native kernel is not built")
    case = testing.attention_cases("quick")[0]
    with pytest.raises(RuntimeError, match="attn_impl 'native' cannot run here: the native kernel is not built"):
        testing.run_attention("native", testing.build_attention_inputs(case))


@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_the_engine_generates_the_same_tokens_as_with_xla_attention(cache_dtype):
    """A tiny random model, greedy, prefill chunks and decode rows in one batch, and a sliding window: the native
    kernel's tokens and log-probabilities against the XLA path's."""
    from models import ModelConfig
    from paged.device.config import EngineConfig
    from paged.host.generator import DynamicGenerator
    from paged.job import Job
    from paged.settings import SamplingSettings

    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=16, sliding_window=12)
    model = tiny_model(cfg, seed=5)

    def run(attn_impl: str):
        config = EngineConfig(num_pages=40, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=96,
                              attn_impl=attn_impl, cache_dtype=cache_dtype)
        gen = DynamicGenerator(model, config=config)
        jobs = [Job(list(range(1 + n, 1 + 2 * n)), 12, gen_settings=SamplingSettings.greedy(), return_probs=True)
                for n in (5, 21, 40)]
        gen.enqueue(jobs)
        probs = {j.serial: [] for j in jobs}
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                probs[r["serial"]] += r.get("token_probs", [])
        return [j.sequence[j.prompt_len:] for j in jobs], [probs[j.serial] for j in jobs]

    tokens, probs = run("native")
    want_tokens, want_probs = run("xla")
    assert tokens == want_tokens and all(len(t) == 12 for t in tokens)
    for got, want in zip(probs, want_probs):
        assert len(got) == 12
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_kv_lens_past_the_page_table():
    """A row whose kv_lens runs past its page table (a blind burst or a draft past a row's last page): its query's
    position still comes from kv_lens, the keys stop at the table's end, as in the reference (here with a sliding
    window, where the two differ from clamping kv_lens)."""
    case = AttentionCase("past-the-table", "dd", 1, 40, 8, 1, 2, 16, window=10)
    i = testing.build_attention_inputs(case)
    kv, table = np.asarray(i["kv_lens"]).copy(), np.asarray(i["page_table"]).copy()
    kv[0] = table.shape[1] * case.page_size + 5
    table[0] = np.arange(1, table.shape[1] + 1)  # real (distinct) pages to the table's end
    i.update(kv_lens=jnp.asarray(kv), page_table=jnp.asarray(table))
    got = np.asarray(testing.run_attention("native", i))
    np.testing.assert_allclose(got, testing.reference_attention(i), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 13])
def test_a_query_gets_the_same_bits_in_any_block(window):
    """The last token of a 7-token row and the same query as a decode row over the same context: bitwise the same
    output (each key's dot product has one reduction order whatever the block's length, the page's keys start at the
    page's start even where the window starts later), so a token's attention does not depend on the batch's shape."""
    case = AttentionCase("blocks", "pd", 7, 45, 8, 1, 3, 16, window=window)
    i = testing.build_attention_inputs(case)
    qs, ql, kv = (np.asarray(i[k]).copy() for k in ("query_start", "query_lens", "kv_lens"))
    ql[0] = 7
    kv[0] = 43  # row 0's block ends mid-page, keys 40..42 (of page 5) a group of 3
    last = qs[0] + 6
    i.update(query_lens=jnp.asarray(ql), kv_lens=jnp.asarray(kv))
    as_block = np.asarray(testing.run_attention("native", i))[last]
    ql[0], qs[0] = 1, last  # the same query alone
    j = dict(i, query_start=jnp.asarray(qs, jnp.int32), query_lens=jnp.asarray(ql))
    alone = np.asarray(testing.run_attention("native", j))[last]
    np.testing.assert_array_equal(as_block, alone)


@pytest.mark.parametrize("case", [c for c in testing.attention_cases("full") if c.cache in ("float32", None)][:6]
                         + EXTRA_CASES[3:], ids=lambda c: c.name)
def test_a_query_gets_the_same_bits_whatever_the_task_split(monkeypatch, case):
    """A float32 cache's tasks are cut finer when there are few of them for the threads (down to one query vector per
    task, a task's vectors then starting mid-token): every output, bitwise, as with one thread (no split)."""
    from pallas_kernels import native

    i = testing.build_attention_inputs(case)
    outs = []
    for n in ("1", "64"):  # 64 threads: about 4 tasks each wanted, so tasks of one or two query vectors
        monkeypatch.setenv("JPG_NATIVE_THREADS", n)
        jax.clear_caches()  # the thread count is an attribute of the traced call
        assert native.threads() == int(n)
        outs.append(np.asarray(testing.run_attention("native", i)))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[1], testing.reference_attention(i), atol=2e-5, rtol=2e-5)
