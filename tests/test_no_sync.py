"""Decode planning makes no device→host sync: it runs with all device tensors on ``meta``
(any read of device data raises there), while extend (allowed to sync) is shown to be caught."""

import pytest
import torch

from aiter_attn import ForwardMode
from aiter_attn.strategies.mha import DecodeMetadata
from aiter_attn.testing.nosync import meta_context, to_meta_batch
from aiter_attn.testing.strategies import paged_batches
from aiter_attn.strategies.base import StrategyContext
from aiter_attn.plugins import kernel_registry
from hypothesis import given


@given(pb=paged_batches(mode=ForwardMode.DECODE))
def test_decode_plan_is_sync_free(pb):
    """DecodeMetadata.plan on meta tensors completes: it never reads device data on the host."""
    ctx = StrategyContext(config=pb.config, req_to_token=pb.req_pool.req_to_token, kv_pool=None,
                          kernels=kernel_registry())
    md = DecodeMetadata(meta_context(ctx)).plan(to_meta_batch(pb.batch))
    assert md.pages.block_table.device.type == "meta"
    assert md.query.cu_seqlens_q.shape == (pb.batch.batch_size + 1,)


def test_meta_guard_catches_a_sync():
    """The guard is not vacuous: reading a value back from a meta tensor raises."""
    t = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        t.max().item()
    with pytest.raises((RuntimeError, NotImplementedError)):
        t.tolist()
