"""Defects found hunting the graph parts (``aiter_attn/graph``: manager, buffers, padding,
signature, sources): each test failed before its fix."""

import pytest
import torch

from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, SpecDecodeConfig
from aiter_attn.graph import CudaGraphManager
from aiter_attn.kvcache import MHAKVPool, ReqToTokenPool

from ._graph_helpers import Rig


def _verify_rig(topk: int) -> tuple:
    """A MHA rig with verify graphs of size 2 captured and two requests joined."""
    spec = SpecDecodeConfig(num_steps=2, topk=topk, num_draft_tokens=3)
    rig = Rig.make("mha", page_size=16, hq=4, hkv=2, head_dim=16, spec=spec, seed=11)
    mgr = rig.manager(capture_sizes=[2])
    mgr.capture(rig.step_fn(), modes=["target_verify"])
    for p in (3, 9):
        rig.join(p)
    return rig, mgr


def test_chain_verify_mask_the_engine_sends_is_ignored_like_eager():
    """A chain (topk=1) plans no mask and eager ignores a ``custom_mask`` the engine sends
    anyway; the graph path refused it ("tree mask needs 54 elements > the static buffer of 0;
    raise max_context_len") although no setting could make it fit."""
    rig, mgr = _verify_rig(topk=1)
    batch = rig.batch("target_verify")
    batch.spec_info.custom_mask = torch.ones(3 * batch.seq_lens_sum, dtype=torch.bool)
    inputs = rig.random_inputs(batch)
    out = mgr.replay(batch, **inputs)
    eager = rig.eager(batch, inputs, save_kv_cache=False)
    for g, e in zip(out, eager):
        assert torch.equal(g, e)


def test_tree_verify_without_mask_is_refused_not_planned_with_a_stale_one():
    """A tree verify batch without ``custom_mask`` raises in eager planning; under the graph
    manager it was planned with the static mask left by the previous replay (another batch's
    tree, read at this batch's offsets)."""
    rig, mgr = _verify_rig(topk=2)
    first = rig.batch("target_verify")
    mgr.replay(first, **rig.random_inputs(first))
    batch = rig.batch("target_verify")
    batch.spec_info.custom_mask = None
    with pytest.raises(ValueError, match="needs spec_info.custom_mask"):
        rig.eager(batch, rig.random_inputs(batch), save_kv_cache=False)
    with pytest.raises(ValueError, match="needs spec_info.custom_mask"):
        mgr.replay(batch, **rig.random_inputs(batch))


def test_tree_mask_of_another_dtype_is_refused_like_eager():
    """Eager accepts bool/uint8 masks only; the graph path copied any dtype into its bool
    buffer, so an additive float mask (0 = visible, -inf = masked) was silently inverted."""
    rig, mgr = _verify_rig(topk=2)
    batch = rig.batch("target_verify")
    mask = batch.spec_info.custom_mask
    batch.spec_info.custom_mask = torch.where(mask, 0.0, float("-inf"))
    with pytest.raises(TypeError, match="custom_mask has dtype torch.float32"):
        rig.eager(batch, rig.random_inputs(batch), save_kv_cache=False)
    with pytest.raises(TypeError, match="custom_mask has dtype torch.float32"):
        mgr.replay(batch, **rig.random_inputs(batch))
    batch.spec_info.custom_mask = mask.to("meta")  # another device: named, not copied
    with pytest.raises(ValueError, match="custom_mask is on meta"):
        mgr.replay(batch, **rig.random_inputs(batch))


def test_default_modes_follow_the_backends_forced_strategy():
    """``AttentionBackend(strategy=...)`` plans every mode with that pair; the manager's
    default modes asked the registry instead, added TARGET_VERIFY / DRAFT_EXTEND_V2 that the
    forced decode pair cannot serve, and construction failed with StrategySelectionError."""
    cfg = BackendConfig(page_size=16, max_batch_size=4, max_context_len=64,
                        dtype=torch.float32, arch="mha", device="cpu",
                        spec=SpecDecodeConfig(num_draft_tokens=3))

    def backend(**kw):
        return AttentionBackend(cfg, ReqToTokenPool(6, 64, "cpu"),
                                MHAKVPool(20, 16, 2, 16, 2, dtype=torch.float32, device="cpu"),
                                **kw)

    forced = CudaGraphManager(backend(strategy="mha.decode"), use_cuda_graph=False)
    assert forced.modes == [ForwardMode.DECODE]
    free = CudaGraphManager(backend(), use_cuda_graph=False)
    assert free.modes == [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                          ForwardMode.DRAFT_EXTEND_V2]


def test_token_input_of_another_dtype_is_refused():
    """Token inputs were checked by shape only: ``copy_`` converted another dtype silently
    (q in float16 where eager refuses it, float ids truncated into int64)."""
    rig = Rig.make("mha")
    mgr = rig.manager(capture_sizes=[2])
    mgr.capture(rig.step_fn())
    rig.join(3)
    batch = rig.batch("decode")
    inputs = rig.random_inputs(batch)
    inputs["q0"] = inputs["q0"].half()
    with pytest.raises(ValueError, match=r"token input 'q0' is torch.float16 .* torch.float32"):
        mgr.replay(batch, **inputs)
