"""Defects found in the dense strategies (MHA, SWA, VEC5D): the extend planner's prefix hint,
the 5-D functional ops' argument checks, and layer calls given k without v. Each test runs the
public API on block-permuted pools (null page 0, noise everywhere) against the float64 oracle
or checks that bad caller input raises an error naming the argument."""

from __future__ import annotations

import attrs
import pytest
import torch

from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec, Vec5DKVPool
from aiter_attn.strategies.mha import ExtendMetadata
from aiter_attn.strategies.vec5d import paged_attention_5d, write_kv_5d
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import DEVICE, requires_triton
from .test_swa import make_swa_scenario
from .test_vec5d import make_5d_scenario


# ---------------------------------------------------------------------------------------------
# EXTEND: the longest cached prefix comes from seq_lens − extend_seq_lens, not a stale mirror
# ---------------------------------------------------------------------------------------------

def _extend_scenario(**cfg_kw):
    cfg = BackendConfig(page_size=4, max_context_len=128, dtype=torch.float32, device=DEVICE,
                        **cfg_kw)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    sc = PagedScenario.make(cfg, [layer], [5, 9, 0], seed=1)
    return cfg, layer, sc


def _stale_prefix_batch(sc):
    """An EXTEND batch whose ``extend_prefix_lens_cpu`` mirror says "no prefix" (an engine
    that does not track it, or a reused buffer) while requests 0 and 1 do have one."""
    batch = sc.next_batch(ForwardMode.EXTEND, [3, 2, 4])
    batch = attrs.evolve(batch, extend_prefix_lens_cpu=torch.zeros(3, dtype=torch.int64))
    sc.batch = batch
    return batch


def test_extend_prefix_hint_comes_from_seq_and_extend_lens():
    cfg, _, sc = _extend_scenario()
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = _stale_prefix_batch(sc)
    md = ExtendMetadata(be.ctx).plan(batch)
    assert md.extras["max_prefix_len"] == 9  # request 1: 9 cached + 2 new tokens
    assert md.extras["min_q_len"] == 2


@requires_triton
def test_dense_extend_with_stale_prefix_mirror_matches_oracle():
    """The two-pass extend skips its prefix pass when the plan's hint says no prefix: with the
    hint taken from a stale mirror it silently dropped every cached key."""
    cfg, layer, sc = _extend_scenario(kernel_backend="triton", dense_extend=True)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = _stale_prefix_batch(sc)
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layer)
    out = be.forward(q, k, v, layer, batch)
    assert_close_rel(out, sc.expected(layer, q), 1e-5, "dense extend, stale prefix mirror")


# ---------------------------------------------------------------------------------------------
# paged_attention_5d / write_kv_5d: the checks of ops.paged_attention / ops.write_kv
# ---------------------------------------------------------------------------------------------

def _pool_5d():
    g = torch.Generator().manual_seed(0)
    pool = Vec5DKVPool(5, 4, 2, 16, 1, dtype=torch.float32)
    kc, vc = pool.kv_buffers(0)
    kc.copy_(torch.randn(kc.shape, generator=g))
    vc.copy_(torch.randn(vc.shape, generator=g))
    q = torch.randn(3, 4, 16, generator=g)
    args = dict(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
                seqused_k=torch.tensor([5, 6], dtype=torch.int32),
                block_table=torch.tensor([[3, 1], [2, 4]], dtype=torch.int32),
                softmax_scale=0.25)
    return q, kc, vc, args


BAD_5D_CALLS = [
    pytest.param(dict(out=torch.empty(3, 4, 16, dtype=torch.float16)), "out", id="out-dtype"),
    pytest.param(dict(out=torch.empty(3, 4, 8)), "out", id="out-shape"),
    pytest.param(dict(sinks=torch.randn(4, 1)), "sinks", id="sinks-2d"),
    pytest.param(dict(sinks=torch.randn(3)), "sinks", id="sinks-length"),
    pytest.param(dict(window_size=(-3, 0)), "window_size", id="window-negative"),
    pytest.param(dict(window_size=(2.5, 0)), "window_size", id="window-float"),
    pytest.param(dict(window_size=(3,)), "window_size", id="window-one-value"),
    pytest.param(dict(custom_mask=torch.ones(33), mask_indptr=torch.tensor([0, 5, 17])),
                 "custom_mask", id="mask-float"),
    pytest.param(dict(custom_mask=torch.ones(17, dtype=torch.bool),
                      mask_indptr=torch.tensor([0, 5])), "mask_indptr", id="mask-indptr-short"),
    pytest.param(dict(cu_seqlens_q=torch.zeros(0, dtype=torch.int32),
                      seqused_k=torch.zeros(0, dtype=torch.int32),
                      block_table=torch.zeros(0, 2, dtype=torch.int32)),
                 "cu_seqlens_q", id="cu-seqlens-empty"),
]


@pytest.mark.parametrize("bad,name", BAD_5D_CALLS)
def test_paged_attention_5d_rejects_bad_arguments_by_name(bad, name):
    q, kc, vc, args = _pool_5d()
    if "cu_seqlens_q" in bad:
        q = q[:0]
    with pytest.raises((ValueError, TypeError), match=name):
        paged_attention_5d(q, kc, vc, **{**args, **bad})


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float64], ids=["int32", "float64"])
def test_write_kv_5d_rejects_non_activation_dtypes(which, dtype):
    _, kc, vc, _ = _pool_5d()
    before = (kc.clone(), vc.clone())
    kv = {"k": torch.randn(2, 2, 16), "v": torch.randn(2, 2, 16)}
    kv[which] = kv[which].to(dtype)
    with pytest.raises(TypeError, match=which):
        write_kv_5d(kc, vc, torch.tensor([5, 9]), kv["k"], kv["v"])
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])  # nothing written


# ---------------------------------------------------------------------------------------------
# a layer call with k but no v names the missing argument (every NHD-family arch)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["mha", "swa", "vec5d"])
def test_layer_call_with_k_but_no_v_is_a_clear_error(arch):
    cfg = BackendConfig(page_size=4, max_context_len=128, dtype=torch.float32, arch=arch)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16,
                      sliding_window=3 if arch == "swa" else None)
    make = {"mha": PagedScenario.make, "swa": make_swa_scenario,
            "vec5d": make_5d_scenario}[arch]
    sc = make(cfg, [layer], [5, 9], seed=2)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    q, k, _ = sc.step_inputs(layer)
    with pytest.raises(ValueError, match=r"\bv\b.*save_kv_cache"):
        be.forward(q, k, None, layer, batch)
