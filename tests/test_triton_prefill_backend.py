"""``BackendConfig(dense_extend=True)``: MHA extend steps go through ``extend_attention``
(dense new tokens + paged prefix) where the registry serves the layer, the paged kernel where
it declines (sliding window), and decode is unchanged; end to end against the float64 oracle
over block-permuted pools (prefix 0 / one page / crossing pages, chunked prefill)."""

from __future__ import annotations

import pytest
import torch

from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import DEVICE, requires_triton

pytestmark = requires_triton

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _run_step(sc, be, mode, new_lens, dtype):
    batch = sc.next_batch(mode, new_lens)
    be.init_forward_metadata(batch)
    for layer in sc.layers:
        q, k, v = sc.step_inputs(layer)
        out = be.forward(q, k, v, layer, batch)
        assert_close_rel(out, sc.expected(layer, q), RTOL[dtype],
                         f"{mode} layer {layer.layer_id}")
    sc.commit_step()


def _extend_executor(be):
    return be.strategies_for(ForwardMode.EXTEND)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("page,hq,hkv,d", [(16, 10, 2, 80), (7, 4, 4, 16)],
                         ids=["page16-GQA5:1-D80", "page7-MHA-D16"])
def test_dense_extend_end_to_end(dtype, page, hq, hkv, d):
    cfg = BackendConfig(page_size=page, max_batch_size=8, max_context_len=512, dtype=dtype,
                        kernel_backend="triton", dense_extend=True, device=DEVICE)
    layers = [LayerSpec(layer_id=0, num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
              LayerSpec(layer_id=1, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                        logit_cap=4.0)]
    sc = PagedScenario.make(cfg, layers, [0, page, page + 3, 2 * page + 5], seed=page + hq)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    _run_step(sc, be, ForwardMode.EXTEND, [5, 1, 9, 3], dtype)
    ex = _extend_executor(be)
    assert all(entry[1] is not None for entry in ex._extend.values()), ex._extend
    assert {type(g.kernel).op for g in ex.groups.values()} == {"extend_attention"}
    _run_step(sc, be, ForwardMode.DECODE, [1, 1, 1, 1], dtype)
    _run_step(sc, be, ForwardMode.EXTEND, [page + 2, 2, 1, 7], dtype)  # chunked prefill


def test_dense_extend_declined_layers_keep_paged_kernel():
    """A sliding-window layer is declined by ``extend_attention`` (reason kept) and runs
    the paged kernel; the plain layer next to it runs the dense path."""
    cfg = BackendConfig(page_size=16, max_batch_size=4, max_context_len=256,
                        dtype=torch.float32, kernel_backend="triton", dense_extend=True,
                        device=DEVICE)
    layers = [LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=32),
              LayerSpec(layer_id=1, num_q_heads=4, num_kv_heads=2, head_dim=32,
                        sliding_window=8)]
    sc = PagedScenario.make(cfg, layers, [20, 3], seed=1)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    _run_step(sc, be, ForwardMode.EXTEND, [11, 4], torch.float32)
    ex = _extend_executor(be)
    by_layer = {entry[0].layer_id: entry for entry in ex._extend.values()}
    assert by_layer[0][1] is not None
    assert by_layer[1][1] is None and "window" in by_layer[1][2]


def _executor_after(cfg_kw, new_lens, prefix=(20, 3)):
    cfg = BackendConfig(page_size=16, max_batch_size=4, max_context_len=256,
                        dtype=torch.float32, kernel_backend="triton", device=DEVICE, **cfg_kw)
    layers = [LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=32)]
    sc = PagedScenario.make(cfg, layers, list(prefix), seed=1)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    _run_step(sc, be, ForwardMode.EXTEND, new_lens, torch.float32)
    return _extend_executor(be)


def _ops(ex):
    return {type(g.kernel).op for g in ex.groups.values()}


def test_dense_extend_auto_by_default():
    """The default (``dense_extend=None``) takes the two-pass path only on steps whose every
    request brings ``dense_extend_min_tokens`` new tokens or more (2048 by default: the H200
    break-even), the paged kernel otherwise; ``False`` never, ``True`` on every step."""
    assert BackendConfig().dense_extend is None
    assert BackendConfig().dense_extend_min_tokens == 2048
    ex = _executor_after({}, [11, 4])  # short chunks: paged
    assert not ex._extend and _ops(ex) == {"paged_attention"}
    ex = _executor_after({"dense_extend_min_tokens": 5}, [11, 4])  # one request below: paged
    assert not ex._extend and _ops(ex) == {"paged_attention"}
    ex = _executor_after({"dense_extend_min_tokens": 4}, [11, 4])  # every request at/above
    assert _ops(ex) == {"extend_attention"}
    ex = _executor_after({"dense_extend": False, "dense_extend_min_tokens": 1}, [11, 4])
    assert not ex._extend and _ops(ex) == {"paged_attention"}
    ex = _executor_after({"dense_extend": True}, [2, 1])
    assert _ops(ex) == {"extend_attention"}
    with pytest.raises(ValueError):
        BackendConfig(dense_extend_min_tokens=0)


def test_dense_extend_auto_plans_only_what_the_step_launches():
    """After a step that took the two-pass path, a short step keeps the paged kernel and does
    not plan the ``extend_attention`` group (its prefix workspace included); the next long
    step plans it again. Outputs match the oracle throughout (``_run_step``)."""
    cfg = BackendConfig(page_size=16, max_batch_size=4, max_context_len=256,
                        dtype=torch.float32, kernel_backend="triton", device=DEVICE,
                        dense_extend_min_tokens=4)
    layers = [LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=32)]
    sc = PagedScenario.make(cfg, layers, [20, 3], seed=2)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    ex = _extend_executor(be)

    def planned_ops():
        return {ex.groups[key].kernel.op for key in ex.groups
                if be.forward_metadata.kernel_plans.get(key) is not None}

    _run_step(sc, be, ForwardMode.EXTEND, [11, 4], torch.float32)  # dense
    assert "extend_attention" in planned_ops()
    _run_step(sc, be, ForwardMode.EXTEND, [2, 5], torch.float32)  # one request below: paged
    assert "extend_attention" in _ops(ex) and planned_ops() == {"paged_attention"}
    _run_step(sc, be, ForwardMode.EXTEND, [6, 9], torch.float32)  # dense again
    assert "extend_attention" in planned_ops()
