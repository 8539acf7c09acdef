"""Cascade attention through ``AttentionBackend`` (``BackendConfig.cascade_min_shared_tokens``):
MHA and SWA decode/extend steps over requests that share prefix pages (``share_prefix``, as
the engine's prefix caching does) equal the same steps without cascade; graph replay (the
static plan) equals eager; ineligible groups keep the ordinary kernel with a reason."""

from __future__ import annotations

import attrs
import pytest
import torch

from aiter_attn import AttentionBackend, ForwardBatch, ForwardMode
from aiter_attn.kernels.cascade import CascadeKernel, CascadePlan
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.types import BackendConfig, CGSupport

from ._graph_helpers import Rig
from ._triton_util import DEVICE, requires_triton

KERNELS = [pytest.param("reference", id="reference"),
           pytest.param("triton", id="triton", marks=requires_triton)]


def _device(kernel) -> str:
    """Triton cases run where Triton does (the interpreter on the CPU, else the GPU: there
    the graph test captures and replays real CUDA graphs)."""
    return DEVICE if kernel == "triton" else "cpu"


def _rig(arch, kernel, *, page=16, min_tokens=16, window=20, hq=10, hkv=2, d=16, max_bs=8):
    rig = Rig.make(arch, page_size=page, hq=hq, hkv=hkv, head_dim=d, num_layers=2,
                   max_context_len=256, max_bs=max_bs, window=window, seed=page,
                   device=_device(kernel))
    rig.config = attrs.evolve(rig.config, kernel_backend=kernel)
    plain = AttentionBackend(rig.config, rig.req_pool, rig.kv_pool)
    rig.config = attrs.evolve(rig.config, cascade_min_shared_tokens=min_tokens)
    rig.backend = AttentionBackend(rig.config, rig.req_pool, rig.kv_pool)
    return rig, plain


def _share(rig, leader: int, shared: int, own: int) -> int:
    """A new request reusing ``leader``'s first ``shared`` tokens (whole pages) plus ``own``."""
    row = rig.req_pool.alloc()
    n = rig.alloc.share_prefix(rig.req_pool, leader, row, shared)
    assert n == shared
    rig.alloc.extend(rig.req_pool, row, own)
    rig.rows.append(row)
    return row


def _populate(rig, page):
    """Rows: a leader with 3 sharers, an unrelated request, a second run of two."""
    a = rig.join(3 * page + 5)
    for own in (1, 7, 2 * page):
        _share(rig, a, 3 * page, own)
    rig.join(40)
    b = rig.join(2 * page + 3)
    _share(rig, b, 2 * page, 9)


def _extend_batch(rig, new):
    locs = [rig.alloc.extend(rig.req_pool, r, n) for r, n in zip(rig.rows, new)]
    seq = [rig.alloc.tokens_held(r) for r in rig.rows]
    return ForwardBatch.from_lengths(forward_mode="extend", req_pool_indices=rig.rows,
                                     seq_lens=seq, out_cache_loc=torch.cat(locs),
                                     extend_seq_lens=new, device=rig.config.device)


def _both(rig, plain, batch):
    inputs = rig.random_inputs(batch)
    got = rig.eager(batch, inputs)
    plain.init_forward_metadata(batch)
    exp = tuple(plain.forward(inputs[f"q{l.layer_id}"], None, None, l, batch,
                              save_kv_cache=False) for l in rig.layers)
    return got, exp


def _cascade_plans(backend, mode):
    _, ex = backend.strategies_for(mode)
    md = backend.forward_metadata
    return [md.kernel_plans.get(g.key) for g in ex.groups.values()
            if isinstance(g.kernel, CascadeKernel)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["mha", "swa"])
def test_decode_and_extend_equal_plain(arch, kernel):
    page = 16
    rig, plain = _rig(arch, kernel, page=page)
    _populate(rig, page)
    for step, mode in enumerate(["decode", "extend", "decode"]):
        if mode == "decode":
            batch = rig.batch("decode")
        else:
            batch = _extend_batch(rig, [3, 1, 5, 2, 4, 1, 6])
        got, exp = _both(rig, plain, batch)
        for l, g, e in zip(rig.layers, got, exp):
            assert_close_rel(g, e, 1e-5, f"{arch} {kernel} {mode} layer {l.layer_id}")
        plans = _cascade_plans(rig.backend, ForwardMode.parse(mode))
        assert plans and all(isinstance(p, CascadePlan) and p.cascade for p in plans)
        shared = plans[0].index.shared_pages.tolist()
        assert shared == [3, 3, 3, 3, 0, 2, 2], shared


@pytest.mark.parametrize("kernel", KERNELS)
def test_threshold_above_sharing_runs_no_group(kernel):
    rig, plain = _rig("mha", kernel, min_tokens=3 * 16 + 1)
    _populate(rig, 16)
    got, exp = _both(rig, plain, rig.batch("decode"))
    for g, e in zip(got, exp):
        assert_close_rel(g, e, 1e-5, "threshold")
    plan = _cascade_plans(rig.backend, ForwardMode.DECODE)[0]
    assert plan.index.shared_pages.tolist() == [0] * 7


def test_off_by_default_and_declined_with_reason():
    rig, _ = _rig("mha", "reference")
    rig.config = attrs.evolve(rig.config, cascade_min_shared_tokens=None)
    rig.backend = AttentionBackend(rig.config, rig.req_pool, rig.kv_pool)
    _populate(rig, 16)
    batch = rig.batch("decode")
    rig.eager(batch, rig.random_inputs(batch))
    _, ex = rig.backend.strategies_for(ForwardMode.DECODE)
    assert not any(isinstance(g.kernel, CascadeKernel) for g in ex.groups.values())
    # batch-invariant mode declines cascade (a row's reduction would depend on its batch)
    cfg = attrs.evolve(rig.config, cascade_min_shared_tokens=16, batch_invariant=True)
    be = AttentionBackend(cfg, rig.req_pool, rig.kv_pool)
    batch = rig.batch("decode")
    be.init_forward_metadata(batch)
    inputs = rig.random_inputs(batch)
    be.forward(inputs["q0"], None, None, rig.layers[0], batch, save_kv_cache=False)
    _, ex = be.strategies_for(ForwardMode.DECODE)
    assert list(ex.cascade_declined.values()) == ["BackendConfig.batch_invariant"]


def test_config_threshold_checked():
    for bad in (-1, 2.5, True, "1k"):
        with pytest.raises(ValueError, match="cascade_min_shared_tokens"):
            BackendConfig(cascade_min_shared_tokens=bad)
    assert BackendConfig(cascade_min_shared_tokens=0).cascade_min_shared_tokens == 0


@requires_triton
@pytest.mark.parametrize("arch", ["mha", "swa"])
def test_graph_plan_replay_equals_eager(arch):
    """The static (graph) plan: every replay regroups into the capture's buffers; padded
    batches (padding rows on the null page) included; the cell stays capturable."""
    page = 16
    rig, plain = _rig(arch, "triton", page=page)
    mgr = rig.manager(capture_sizes=[2, 4, 8])
    a = rig.join(3 * page + 5)
    _share(rig, a, 3 * page, 2)
    mgr.capture(rig.step_fn())
    assert rig.backend.graph_support(ForwardMode.DECODE) == CGSupport.ALWAYS
    _, ex = rig.backend.strategies_for(ForwardMode.DECODE)
    assert any(isinstance(g.kernel, CascadeKernel) for g in ex.groups.values())
    for step in range(3):
        _share(rig, a, 3 * page, 1 + step)
        batch = rig.batch("decode")
        inputs = rig.random_inputs(batch)
        out = mgr.replay(batch, **inputs)
        plain.init_forward_metadata(batch)
        n = batch.batch_size
        for l, o in zip(rig.layers, out):
            e = plain.forward(inputs[f"q{l.layer_id}"], None, None, l, batch,
                              save_kv_cache=False)
            assert_close_rel(o[:n], e, 1e-5, f"{arch} replay step {step} layer {l.layer_id}")
        plans = [p for p in _cascade_plans(rig.backend, ForwardMode.DECODE)]
        assert plans and plans[0].cascade, "the replay planned no cascade"
        sp = plans[0].index.shared_pages.tolist()
        assert sp[:n] == [3] * n and sp[n:] == [0] * (mgr.last_entry.bs - n), sp



@pytest.mark.parametrize("kernel", KERNELS)
def test_multi_step_draft_static_plan_equals_eager(kernel):
    """Multi-step draft decode (the branches of a request share its prefix pages) through
    the graph manager's static plans: replays equal eager, the cascade groups wrapped."""
    from aiter_attn import SpecDecodeConfig, multistep
    from aiter_attn.graph import CudaGraphManager

    from .test_graph_manager import _assert_same

    spec = SpecDecodeConfig(num_steps=3, topk=2, num_draft_tokens=7)
    rig = Rig.make("mha", page_size=16, hq=4, hkv=2, head_dim=16, spec=spec, seed=3,
                   device=_device(kernel))
    rig.config = attrs.evolve(rig.config, cascade_min_shared_tokens=1, kernel_backend=kernel)
    ms = multistep.MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool)
    mgr = CudaGraphManager(ms, capture_sizes=[1, 2, 4],
                           use_cuda_graph=rig.config.device != "cpu",
                           token_inputs=rig.token_inputs())
    fn = rig.multistep_step_fn(ms)
    mgr.capture(fn)
    for bs in (3, 4):
        rows, batch = rig.join_drafting(bs, 40)
        inputs = rig.random_inputs(batch, num_tokens=bs * 2)
        out = mgr.replay(batch, **inputs)
        ms.init_forward_metadata(batch)
        _assert_same(out, fn(batch, inputs), f"multi-step cascade bs={bs}")
        for r in rows:
            rig.leave(r)
    assert any(isinstance(g.kernel, CascadeKernel) for g in ms.executor.groups.values())


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mha", "swa"])
def test_gpu_real_graph_capture_replay(arch):
    """The graph test above with real CUDA-graph capture and replay (compiled kernels)."""
    if DEVICE != "cuda":
        pytest.skip("compiled kernels only (TRITON_INTERPRET is set)")
    test_graph_plan_replay_equals_eager(arch)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mha", "swa"])
def test_gpu_decode_and_extend_equal_plain(arch):
    if DEVICE != "cuda":
        pytest.skip("compiled kernels only (TRITON_INTERPRET is set)")
    test_decode_and_extend_equal_plain(arch, "triton")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_verify_chain_cascades_tree_declines(kernel, topk):
    """TARGET_VERIFY: a chain (causal, 3 draft tokens per request) runs the cascade and equals
    the plain backend; a tree (custom mask, applied literally) keeps the ordinary kernel."""
    from aiter_attn import SpecDecodeConfig

    page = 16
    spec = SpecDecodeConfig(num_steps=2, topk=topk, num_draft_tokens=3)
    rig = Rig.make("mha", page_size=page, hq=10, hkv=2, head_dim=16, num_layers=2,
                   max_context_len=256, max_bs=8, spec=spec, seed=4, device=_device(kernel))
    rig.config = attrs.evolve(rig.config, kernel_backend=kernel)
    plain = AttentionBackend(rig.config, rig.req_pool, rig.kv_pool)
    rig.config = attrs.evolve(rig.config, cascade_min_shared_tokens=16)
    rig.backend = AttentionBackend(rig.config, rig.req_pool, rig.kv_pool)
    _populate(rig, page)
    batch = rig.batch("target_verify")
    got, exp = _both(rig, plain, batch)
    for l, g, e in zip(rig.layers, got, exp):
        assert_close_rel(g, e, 1e-5, f"verify topk={topk} layer {l.layer_id}")
    _, ex = rig.backend.strategies_for(ForwardMode.TARGET_VERIFY)
    wrapped = [isinstance(g.kernel, CascadeKernel) for g in ex.groups.values()]
    if topk == 1:
        assert all(wrapped)
        plan = _cascade_plans(rig.backend, ForwardMode.TARGET_VERIFY)[0]
        assert plan.cascade and plan.index.shared_pages.tolist() == [3, 3, 3, 3, 0, 2, 2]
    else:
        assert not any(wrapped)
        assert set(ex.cascade_declined.values()) == {"a custom mask is applied literally"}
