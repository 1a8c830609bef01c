"""`paged.device.buckets.BucketSpec`: which padded shapes the step compiles for, and which one a batch of rows gets.
Pure shape arithmetic, no compilation (the compile counts themselves are checked in test_step.py and
test_warmup.py)."""

from __future__ import annotations

import dataclasses

import pytest

from paged.device.buckets import BIAS_WIDTH, BucketSpec, next_pow2
from paged.device.config import EngineConfig


def test_context_and_prefill_buckets_double():
    spec = BucketSpec(max_batch_size=4, max_chunk_size=256, max_pages_per_row=32, page_size=64, min_context=256)
    assert spec.pages == (4, 8, 16, 32)  # decode attention reads the whole bucket: at most 2x padding
    assert spec.q_lens == (16, 32, 64, 128, 256)
    assert dataclasses.replace(spec, growth=4).q_lens == (16, 64, 256)
    assert spec.shape_for([], 3, 5, 0).page_buckets == (4, 8, 16, 32)  # chosen at run time: 8 here
    assert dataclasses.replace(spec, page_growth=4).pages == (4, 16, 32)


def test_the_default_engine_has_the_documented_variants():
    """The module docstring's count: 5 decode + 6 prefill layouts = 11 forward variants, 5 sampler variants."""
    spec = BucketSpec.from_config(EngineConfig(max_batch_size=16, max_chunk_size=256).resolve(2048), attn_impl="xla")
    layouts = spec.layouts()
    assert sum(not lay.num_prefill_rows for lay in layouts) == 5
    assert sum(bool(lay.num_prefill_rows) for lay in layouts) == 6
    assert spec.sample_rows == spec.row_counts() == (1, 2, 4, 8, 16)
    assert spec.verify_shapes() == []  # without verification nothing is added
    assert len(dataclasses.replace(spec, verify_len=5).verify_shapes()) == len(layouts)  # one per plain bucket


@pytest.mark.parametrize("prefill, decode, pages", [([], 1, 1), ([], 3, 5), ([], 16, 32), ([7], 0, 2), ([7], 15, 2),
                                                     ([256], 15, 32), ([1], 0, 1)])
def test_a_batch_gets_the_smallest_bucket_that_holds_it(prefill, decode, pages):
    spec = BucketSpec(max_batch_size=16, max_chunk_size=256, max_pages_per_row=32, page_size=64)
    shape = spec.shape_for(prefill, decode, pages)
    assert shape in spec.all_shapes()
    lay = shape.layout
    assert shape.pages_per_row == 32 and shape.num_bias == BIAS_WIDTH
    if prefill:
        assert lay.num_prefill_rows == len(prefill) and lay.max_q_len >= max(prefill)
        assert lay.max_q_len >= min(prefill) + decode  # the decode rows ride in the last window's padding
        assert shape.tail_decode_rows == 16 - len(prefill) >= decode
        smaller = [q for q in spec.windows if q < lay.max_q_len]
        assert all(q < max(max(prefill), min(prefill) + decode) for q in smaller)
    else:
        assert lay.num_decode_rows == next_pow2(decode) and decode <= lay.num_decode_rows


@pytest.mark.parametrize("prefill, decode, pages, message", [
    ([], 0, 1, "at least one row"), ([], 17, 1, "exceed max_batch_size"), ([8, 8], 0, 1, "max_prefill_rows"),
    ([257], 0, 1, "max_chunk_size"), ([], 1, 33, "max_pages_per_row")])
def test_a_batch_no_bucket_holds_is_refused(prefill, decode, pages, message):
    spec = BucketSpec(max_batch_size=16, max_chunk_size=256, max_pages_per_row=32, max_prefill_rows=1)
    with pytest.raises(ValueError, match=message):
        spec.shape_for(prefill, decode, pages)


def test_verification_buckets_hold_their_step_rows_at_a_stride_of_w():
    spec = BucketSpec(max_batch_size=8, max_chunk_size=64, max_pages_per_row=8, page_size=16, verify_len=5)
    decode = spec.verify_shape_for([], 3, 2)
    assert decode.verify_len == 5 and decode.layout.num_prefill_rows == 4 and decode.layout.max_q_len == 5
    assert decode.sample_rows == (4,)
    mixed = spec.verify_shape_for([10], 3, 2)
    assert mixed.layout.num_prefill_rows == 1 and mixed.layout.max_q_len >= 10 + 3 * 5
    assert mixed in spec.verify_shapes()
    assert spec.verify_windows[-1] == 64 + 7 * 5  # a full chunk and W slots for every other row
    with pytest.raises(ValueError, match="at least one step row"):
        spec.verify_shape_for([10], 0, 2)
    with pytest.raises(ValueError, match="no verification buckets"):
        dataclasses.replace(spec, verify_len=0).verify_shape_for([], 1, 1)
    with pytest.raises(ValueError, match="verify_len 0"):
        dataclasses.replace(spec, verify_len=1)


def test_an_engine_built_to_verify_gets_its_verification_buckets_from_its_config():
    from paged.device.config import Verification

    config = EngineConfig(max_batch_size=4, max_chunk_size=16, verification=Verification(3)).resolve(256)
    spec = BucketSpec.from_config(config, attn_impl="xla")
    assert spec.verify_len == 4 and len(spec.verify_shapes()) == len(spec.layouts())
    assert BucketSpec.from_config(dataclasses.replace(config, verification=None), attn_impl="xla").verify_len == 0
