"""The GPU side of the kernels, checked on a machine without one.

- Both Pallas kernels lower for CUDA (jax's cross-platform lowering): the Pallas -> Triton step runs in Python, so
  backend selection (Triton, not Mosaic GPU), unsupported primitives in the kernel bodies and block-shape rules are
  caught here, in CI, before a GPU ever sees the code. Compiling the Triton IR to PTX happens only on a GPU (the
  `gpu` tier).
- The GPU branches of "auto" and of the engine's construction checks, with `registry.on_gpu` patched: "auto" falls
  back to "xla" for shapes the kernels cannot run natively (tiny test models, found on the first GPU run), and an
  explicit "pallas" on such a model is an `InvalidConfigError` at construction, not a failed step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import init_random_weights
from models.loader import Model
from models.quant import quantize
from paged.device.engine import Engine
from paged.device.step import resolved_attn_impl
from paged.errors import InvalidConfigError
from paged.testing import tiny_config, tiny_model
from pallas_kernels import dequant_matmul as dm
from pallas_kernels import paged_attention as pa
from pallas_kernels import registry
from pallas_kernels.dequant_gemv import GemvTuning, dequant_gemv_pallas
from pallas_kernels.dequant_matmul import MatmulTuning, dequant_matmul, dequant_matmul_pallas
from pallas_kernels.paged_attention import (
    PrefillDecodeLayout,
    gpu_unsupported_reason,
    layout_query_start,
    paged_attention,
    ragged_paged_attention_pallas,
)
from pallas_kernels.quant_format import random_quantized
from pallas_kernels.tuning import AttentionTuning as T
from tests.pallas_kernels.helpers import names_of, spy


def lower_for_cuda(fn, *args) -> str:
    """The StableHLO text of `jit(fn)(*args)` lowered for CUDA."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_calls(text: str) -> int:
    return text.count("__gpu$xla.gpu.triton")


ATTENTION_CASES = [
    # (kv dtype, tokens, rows, tuning, sliding window, soft cap)
    ("float32", 8, 8, T(block_q=1, pages_per_block=4, k_splits=4), None, None),  # decode, split-K
    ("bfloat16", 64, 2, T(block_q=16, pages_per_block=2), 100, None),  # prefill, window
    ("int8", 32, 4, T(block_q=16, pages_per_block=4, k_splits=2), None, 30.0),  # int8 KV, soft cap
    ("bfloat16", 48, 3, T(block_q=16, pages_per_block=2, k_splits=4, split_max_q=1), None, None),  # split decode
    ("float32", 24, 3, None, None, None),  # the default tuning
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in ATTENTION_CASES])
def test_attention_lowers_to_triton(case):
    dtype, t, s, tuning, window, cap = case
    kh, g, d, ps, pages = 3, 3, 64, 16, 40
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(t, kh * g, d)), jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    if dtype == "int8":
        kp = jnp.asarray(rng.integers(-127, 128, size=(kh, pages, ps, d)), jnp.int8)
        scales = jnp.asarray(rng.random((kh, pages, ps)), jnp.float32)
    else:
        kp, scales = jnp.asarray(rng.normal(size=(kh, pages, ps, d)), dtype), None
    per = t // s
    qs = jnp.arange(s, dtype=jnp.int32) * per
    ql = jnp.full((s,), per, jnp.int32)
    kv = jnp.full((s,), 100, jnp.int32)
    pt = jnp.asarray(rng.integers(1, pages, size=(s, 8)), jnp.int32)

    def fn(q, kp, vp, ks, vs, qs, ql, kv, pt):
        return ragged_paged_attention_pallas(q, kp, vp, qs, ql, kv, pt, sm_scale=0.125, sliding_window=window,
                                             soft_cap=cap, k_scales=ks, v_scales=vs, config=tuning, interpret=False)

    text = lower_for_cuda(fn, q, kp, kp, scales, scales, qs, ql, kv, pt)
    assert triton_calls(text) == 1


@pytest.mark.parametrize("kind,group_size", [("q4_1", 32), ("q4_0", 32), ("int8", 32), ("int8", 576)])
@pytest.mark.parametrize("n,tuning", [(1, None), (16, MatmulTuning(block_n=16, block_out=64, block_in=64,
                                                                    split_in=3, num_warps=8, num_stages=3))])
def test_dequant_matmul_lowers_to_triton(kind, group_size, n, tuning):
    rng = np.random.default_rng(0)
    qa = random_quantized(rng, kind, group_size, 576, 1536)
    x = jnp.asarray(rng.normal(size=(n, 576)), jnp.bfloat16)
    if tuning is not None and group_size == 576:  # per-channel: block_in need not be a multiple of the group
        tuning = MatmulTuning(block_n=16, block_out=64, block_in=64, split_in=3, num_warps=8, num_stages=3)
    text = lower_for_cuda(lambda x, qa: dequant_matmul_pallas(x, qa, tuning, interpret=False), x, qa)
    assert triton_calls(text) == 1
    if tuning is not None:  # the launch parameters reach Triton
        assert "num_warps = 8" in text and "num_stages = 3" in text


GEMV_TUNING = GemvTuning(block_n=2, block_out=64, block_in=64, split_in=3, acc_rows=8, int_to_float="cast",
                         num_warps=8, num_stages=3)


@pytest.mark.parametrize("kind,group_size", [("q4_1", 32), ("q4_0", 32), ("int8", 32), ("int8", 576)])
@pytest.mark.parametrize("n,tuning", [(1, None), (3, GEMV_TUNING)], ids=["default", "split-rowblocks-cast"])
def test_dequant_gemv_lowers_to_triton(kind, group_size, n, tuning):
    """The GEMV (default tuning: "magic" conversion by bitcast, split-K; and a tuning with 2 row blocks, a split
    of 3, an accumulator of 8 rows and converts by cast) lowers to one Triton call with its launch parameters."""
    rng = np.random.default_rng(0)
    qa = random_quantized(rng, kind, group_size, 576, 1536)
    x = jnp.asarray(rng.normal(size=(n, 576)), jnp.bfloat16)
    text = lower_for_cuda(lambda x, qa: dequant_gemv_pallas(x, qa, tuning, interpret=False), x, qa)
    assert triton_calls(text) == 1
    if tuning is not None:
        assert "num_warps = 8" in text and "num_stages = 3" in text


def test_dequant_gemv_gpu_rules_are_checked_before_lowering(gpu):
    """A tuning Triton cannot run (a 48-column tile, not a power of two) is a ValueError naming the field, raised
    before Pallas lowers anything."""
    qa = random_quantized(np.random.default_rng(0), "q4_1", 32, 64, 96)
    with pytest.raises(ValueError, match=r"power-of-two block_out >= 16 .*'block_out': 48"):
        jax.jit(lambda x, qa: dequant_gemv_pallas(x, qa, GemvTuning(block_out=48, block_in=64), interpret=False)
                ).trace(jnp.ones((1, 64), jnp.float32), qa)


# ------------------------------------------------------------------------------------- "auto" and construction
@pytest.fixture
def gpu(monkeypatch):
    """Take the GPU branches (the kernels themselves are still run with interpret=True)."""
    monkeypatch.setattr(registry, "on_gpu", lambda: True)


def test_gpu_unsupported_reason_names_what_to_change():
    assert gpu_unsupported_reason(64, 16) is None and gpu_unsupported_reason(16, 8, 2) is None
    assert gpu_unsupported_reason(8, 16) == "head_dim=8 (needs a power of two >= 16)"
    assert "head_dim=96" in gpu_unsupported_reason(96, 16)
    assert "page_size=24" in gpu_unsupported_reason(64, 24)
    assert "pages_per_block * page_size = 1 * 8" in gpu_unsupported_reason(64, 8, 1)
    with pytest.raises(ValueError, match=r"head_dim=8 .*impl='xla'"):  # the kernel itself, natively
        ragged_paged_attention_pallas(*_attention_args(8)[:7], sm_scale=1.0, interpret=False)


def _attention_args(d: int, ps: int = 8):
    rng = np.random.default_rng(d)
    layout = PrefillDecodeLayout(0, 1, 2)
    q = jnp.asarray(rng.normal(size=(2, 4, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 5, ps, d)), jnp.float32)
    return (q, k, k, layout_query_start(layout), jnp.asarray([1, 1], jnp.int32), jnp.asarray([9, 3], jnp.int32),
            jnp.asarray([[1, 2], [3, 0]], jnp.int32), layout)


@pytest.mark.parametrize("head_dim,want", [(8, "xla"), (16, "pallas")])
def test_auto_attention_on_a_gpu_falls_back_to_xla_where_the_kernel_cannot_run(gpu, monkeypatch, head_dim, want):
    calls = spy(monkeypatch, pa, ["ragged_paged_attention_xla", "ragged_paged_attention_pallas"])
    *args, layout = _attention_args(head_dim)
    out = paged_attention(*args, sm_scale=head_dim**-0.5, layout=layout, interpret=True)
    assert out.shape == args[0].shape
    assert names_of(calls) == [f"ragged_paged_attention_{want}"]
    assert resolved_attn_impl("auto", head_dim=head_dim, page_size=8) == want


def test_auto_attention_off_the_gpu_is_native_where_it_runs_else_xla(monkeypatch):
    from pallas_kernels import native_attention

    monkeypatch.setattr(registry, "on_gpu", lambda: False)
    runs = native_attention.unavailable_reason(64) is None
    assert resolved_attn_impl("auto", head_dim=64, page_size=16) == ("native" if runs else "xla")
    monkeypatch.setattr(native_attention, "unavailable_reason", lambda head_dim=None: "not built")
    assert resolved_attn_impl("auto", head_dim=64, page_size=16) == "xla"


# 40 columns: no block_out >= 16 divides it; 2 rows take the GEMV, 9 the tensor-core kernel (with a GEMV limit of
# 8 rows; as shipped the limit is 0 until the GEMV is measured on a GPU)
@pytest.mark.parametrize("out,n,want", [(40, 2, "xla"), (40, 9, "xla"), (256, 2, "gemv"), (256, 9, "matmul")])
def test_auto_matmul_on_a_gpu_falls_back_to_xla_per_matrix(gpu, monkeypatch, out, n, want):
    from pallas_kernels import dequant_gemv, tuned_tables

    monkeypatch.setattr(tuned_tables, "DEFAULT_GEMV_MAX_ROWS", 8)
    calls = spy(monkeypatch, dm, ["dequant_matmul_xla", "dequant_matmul_pallas"])
    spy(monkeypatch, dequant_gemv, ["dequant_gemv_pallas"], calls)
    qa = random_quantized(np.random.default_rng(0), "q4_1", 32, 64, out)
    x = jnp.ones((n, 64), jnp.float32)
    assert dequant_matmul(x, qa, interpret=True).shape == (n, out)
    assert names_of(calls) == [{"xla": "dequant_matmul_xla", "gemv": "dequant_gemv_pallas",
                                "matmul": "dequant_matmul_pallas"}[want]]


TINY = tiny_config(96, num_layers=1)
SETTINGS = dict(num_pages=8, page_size=8, max_batch_size=2, max_chunk_size=8, max_seq_len=32)


def test_explicit_pallas_attention_on_a_gpu_is_refused_at_construction(gpu):
    model = tiny_model(TINY, seed=0)
    with pytest.raises(InvalidConfigError, match=r"attn_impl='pallas' .*head_dim=8.*attn_impl='auto'"):
        Engine(model, attn_impl="pallas", **SETTINGS)
    engine = Engine(model, **SETTINGS)  # "auto": the XLA path, with its page buckets
    assert engine.spec.page_switch


@pytest.mark.parametrize("impl", ["pallas", "pallas_gemv"])
def test_explicit_pallas_matmul_on_a_gpu_is_refused_at_construction(gpu, impl):
    cfg = dataclasses.replace(TINY, vocab_size=72)  # a 72-column LM head: no power-of-two tile >= 16 divides it
    params = init_random_weights(cfg, seed=0)
    params = dataclasses.replace(params, lm_head=quantize(jnp.ones((32, 72), jnp.float32), "q4_1"))
    model = Model(config=cfg, params=params, tokenizer=None, source="tiny")
    with pytest.raises(InvalidConfigError, match=rf"matmul_impl='{impl}' .*32x72 q4_1.*block_out.*matmul_impl='auto'"):
        Engine(model, matmul_impl=impl, attn_impl="xla", **SETTINGS)
