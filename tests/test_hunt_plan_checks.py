"""Planning and binding checks that turn caller mistakes into errors that say how to fix them:

* static ``out=`` buffers (CUDA-graph style planning) whose page table is too narrow for the
  batch's longest request, or has too few rows, are refused at plan time (host ints only, no
  device→host sync) on MHA decode/verify, MLA decode/verify and SWA;
* a LayerSpec whose ``num_kv_heads`` / ``head_dim`` / ``v_head_dim`` does not match the KV
  pool's buffers is refused when the layer is first bound (NHD, 5-D and SWA pools), never a
  raw torch shape error or a silently wrong result.
"""

import pytest
import torch

from aiter_attn import (AttentionBackend, BackendConfig, ForwardMode, LayerSpec,
                        SpecDecodeConfig, SpecInfo)
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.nosync import meta_context, to_meta_batch

from .test_mla import MLAScenario
from .test_swa import make_swa_scenario
from .test_vec5d import make_5d_scenario

PAGE = 4


def _mha(prefixes, *, spec=None, layers=None):
    cfg = BackendConfig(page_size=PAGE, max_batch_size=8, max_context_len=128,
                        dtype=torch.float32, spec=spec)
    layers = layers or [LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)]
    sc = PagedScenario.make(cfg, layers, prefixes, seed=0)
    return sc, AttentionBackend(cfg, sc.req_pool, sc.kv_pool)


def _static(backend, batch, max_bs, max_seq_len):
    planner, _ = backend.strategies_for(batch.forward_mode)
    spec = planner.buffer_spec(max_bs, max_bs * 8, max_seq_len)
    return planner, spec.allocate(batch.device)


def _too_narrow(width, need):
    return (rf"block_table.*{width} pages.*{need} pages.*"
            r"buffer_spec\(max_bs, max_tokens, max_seq_len\)")


# -------------------------------------------------------------------------- static page table
def test_mha_decode_narrow_block_table_is_refused_at_plan():
    sc, be = _mha([10, 30])
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])  # longest request: 31 tokens = 8 pages
    _, out = _static(be, batch, 2, 8)  # 2 pages wide
    with pytest.raises(ValueError, match=_too_narrow(2, 8)):
        be.init_forward_metadata(batch, out=out)
    _, out = _static(be, batch, 2, batch.max_seq_len)  # sized for the longest: fine
    md = be.init_forward_metadata(batch, out=out)
    assert md.pages.block_table.shape == (2, 8)


def test_mha_decode_too_few_rows_is_refused_at_plan():
    sc, be = _mha([10, 30, 3])
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1, 1])
    planner, out = _static(be, batch, 2, 64)
    with pytest.raises(ValueError, match=r"3 requests.*block_table.*2 rows.*buffer_spec"):
        planner.plan(batch, out=out)


def test_mha_verify_narrow_block_table_is_refused_at_plan():
    n = 2
    sc, be = _mha([5, 21], spec=SpecDecodeConfig(topk=1, num_draft_tokens=n))
    batch = sc.next_batch(ForwardMode.TARGET_VERIFY, [n, n],
                          spec_info=SpecInfo(num_draft_tokens=n, topk=1))
    planner, out = _static(be, batch, 2, 12)  # 3 pages; the batch needs ceil(23 / 4) = 6
    with pytest.raises(ValueError, match=_too_narrow(3, 6)):
        planner.plan(batch, out=out)


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_mla_narrow_block_table_is_refused_at_plan(mode):
    sc = MLAScenario(page_size=PAGE, heads=4, prefix_lens=[3, 17], seed=1)
    if mode == "decode":
        batch = sc.next_batch(ForwardMode.DECODE, [1, 1])  # 18 tokens: 5 pages
        need = 5
    else:
        batch = sc.next_batch(ForwardMode.TARGET_VERIFY, [2, 2],
                              SpecInfo(num_draft_tokens=2, topk=1))  # 19 tokens: 5 pages
        need = 5
    _, out = _static(sc.backend, batch, 2, 8)
    with pytest.raises(ValueError, match=_too_narrow(2, need)):
        sc.backend.init_forward_metadata(batch, out=out)


def test_swa_narrow_block_table_is_refused_at_plan():
    cfg = BackendConfig(page_size=PAGE, max_batch_size=8, max_context_len=128,
                        dtype=torch.float32, arch="swa")
    layers = [LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16,
                        sliding_window=5),
              LayerSpec(layer_id=1, num_q_heads=4, num_kv_heads=2, head_dim=16)]
    sc = make_swa_scenario(cfg, layers, [9, 14])
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])  # 15 tokens: 4 pages
    _, out = _static(be, batch, 2, 4)
    with pytest.raises(ValueError, match=_too_narrow(1, 4)):
        be.init_forward_metadata(batch, out=out)


def test_static_check_makes_no_device_sync():
    """The check reads host mirrors and buffer shapes only: on ``meta`` tensors (where any
    device→host read fails) it still raises its own error, and a fitting plan still plans."""
    sc, be = _mha([10, 30])
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    planner, _ = be.strategies_for(batch.forward_mode)
    meta = type(planner)(meta_context(be.ctx))
    mbatch = to_meta_batch(batch)
    narrow = planner.buffer_spec(2, 2, 8).allocate("meta")
    with pytest.raises(ValueError, match=_too_narrow(2, 8)):
        meta.plan(mbatch, out=narrow)
    meta.plan(mbatch, out=planner.buffer_spec(2, 2, 64).allocate("meta"))


# ------------------------------------------------------------------------ layer vs pool geometry
BAD_LAYERS = [
    pytest.param(dict(num_q_heads=8, num_kv_heads=4), "num_kv_heads=4", "2", id="kv_heads"),
    pytest.param(dict(head_dim=32), "head_dim=32", "16", id="head_dim"),
    pytest.param(dict(v_head_dim=8), "v_head_dim=8", "16", id="v_head_dim"),
]


def _call(be, batch, layer, save_kv_cache):
    n = batch.num_tokens
    q = torch.randn(n, layer.num_q_heads * layer.head_dim)
    k = torch.randn(n, layer.num_kv_heads * layer.head_dim) if save_kv_cache else None
    v = torch.randn(n, layer.num_kv_heads * layer.v_head_dim) if save_kv_cache else None
    return be.forward(q, k, v, layer, batch, save_kv_cache=save_kv_cache)


def _bad(fields, **kw):
    base = dict(layer_id=kw.pop("layer_id", 0), num_q_heads=4, num_kv_heads=2, head_dim=16)
    return LayerSpec(**{**base, **kw, **fields})


@pytest.mark.parametrize("save_kv_cache", [True, False], ids=["write", "no-write"])
@pytest.mark.parametrize("fields,what,pool_value", BAD_LAYERS)
def test_mha_layer_that_does_not_match_the_pool_is_refused(fields, what, pool_value,
                                                           save_kv_cache):
    sc, be = _mha([6, 9])
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    before = [t.clone() for t in sc.kv_pool.kv_buffers(0)]
    with pytest.raises(ValueError, match=rf"layer 0.*{what}.*pool.*{pool_value}.*LayerSpec"):
        _call(be, batch, _bad(fields), save_kv_cache)
    for t, b in zip(sc.kv_pool.kv_buffers(0), before):  # refused before any write
        assert torch.equal(t, b)
    # the matching layer still runs
    _call(be, batch, sc.layers[0], save_kv_cache)


@pytest.mark.parametrize("save_kv_cache", [True, False], ids=["write", "no-write"])
@pytest.mark.parametrize("fields,what,pool_value", BAD_LAYERS)
def test_vec5d_layer_that_does_not_match_the_pool_is_refused(fields, what, pool_value,
                                                             save_kv_cache):
    cfg = BackendConfig(page_size=8, max_batch_size=8, max_context_len=128,
                        dtype=torch.float16, arch="vec5d")
    layers = [LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)]
    sc = make_5d_scenario(cfg, layers, [6, 9])
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    n = batch.num_tokens
    bad = _bad(fields)
    q = torch.randn(n, bad.num_q_heads * bad.head_dim, dtype=torch.float16)
    k = v = None
    if save_kv_cache:
        k = torch.randn(n, bad.num_kv_heads * bad.head_dim, dtype=torch.float16)
        v = torch.randn(n, bad.num_kv_heads * bad.v_head_dim, dtype=torch.float16)
    before = [t.clone() for t in sc.kv_pool.kv_buffers(0)]
    with pytest.raises(ValueError, match=rf"layer 0.*{what}.*pool.*{pool_value}.*LayerSpec"):
        be.forward(q, k, v, bad, batch, save_kv_cache=save_kv_cache)
    for t, b in zip(sc.kv_pool.kv_buffers(0), before):  # refused before any write
        assert torch.equal(t, b)


@pytest.mark.parametrize("save_kv_cache", [True, False], ids=["write", "no-write"])
@pytest.mark.parametrize("layer_id", [0, 1], ids=["swa-layer", "full-layer"])
@pytest.mark.parametrize("fields,what,pool_value", BAD_LAYERS)
def test_swa_layer_that_does_not_match_the_pool_is_refused(fields, what, pool_value, layer_id,
                                                           save_kv_cache):
    cfg = BackendConfig(page_size=PAGE, max_batch_size=8, max_context_len=128,
                        dtype=torch.float32, arch="swa")
    layers = [LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16,
                        sliding_window=5),
              LayerSpec(layer_id=1, num_q_heads=4, num_kv_heads=2, head_dim=16)]
    sc = make_swa_scenario(cfg, layers, [6, 9])
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    window = 5 if layer_id == 0 else None
    bad = _bad(fields, layer_id=layer_id, sliding_window=window)
    with pytest.raises(ValueError,
                       match=rf"layer {layer_id}.*{what}.*pool.*{pool_value}.*LayerSpec"):
        _call(be, batch, bad, save_kv_cache)
