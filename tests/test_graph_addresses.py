"""Buffers a captured plan reads keep their addresses for the life of the graph manager,
whatever eager batches run in between; the replay check compares addresses on the CPU too.

The case of issue 11 item 4: multi-step draft decode on the SWA architecture, captured for
batch size 2, run eagerly on a batch of 6 (its step SWA tables outgrow the captured ones), then
replayed: the replay must plan into the captured addresses and match eager.
"""

import pytest
import torch

from aiter_attn import SpecDecodeConfig
from aiter_attn.graph import CudaGraphManager, describe_signature, metadata_signature
from aiter_attn.metadata import AttnMetadata, PageTable, QueryLayout
from aiter_attn.types import ForwardMode

from ._graph_helpers import Rig


def _md(block_table):
    return AttnMetadata(
        mode=ForwardMode.DECODE, batch_size=2,
        query=QueryLayout(cu_seqlens_q=torch.arange(3, dtype=torch.int32), max_seqlen_q=1,
                          num_tokens=2),
        pages=PageTable(block_table=block_table, seqused_k=torch.ones(2, dtype=torch.int32),
                        max_seqlen_k=4, page_size=1))


def test_cpu_signature_compares_addresses():
    """Two plans equal in everything but one tensor's storage differ on the CPU; host mirrors
    (``*_cpu`` fields) and tensors off the backend's device are compared by shape only."""
    a = _md(torch.zeros(2, 4, dtype=torch.int32))
    b = _md(torch.zeros(2, 4, dtype=torch.int32))
    cpu = torch.device("cpu")
    assert metadata_signature(a, cpu) != metadata_signature(b, cpu)
    diff = {k for k, v in describe_signature(a, cpu).items()
            if describe_signature(b, cpu)[k] != v}
    assert "metadata.pages.block_table" in diff
    # the same tensors → the same signature
    assert metadata_signature(a, cpu) == metadata_signature(a, cpu)
    # a tensor on another device than the backend's is a host tensor: shape only
    meta = torch.device("meta")
    assert metadata_signature(a, meta) == metadata_signature(b, meta)


def test_cpu_signature_ignores_host_mirrors():
    from aiter_attn import ForwardBatch

    def batch():
        return ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=[1],
                                         seq_lens=[3], out_cache_loc=torch.zeros(1))

    a, b = batch(), batch()
    b.seq_lens, b.req_pool_indices, b.out_cache_loc = a.seq_lens, a.req_pool_indices, \
        a.out_cache_loc
    b.positions, b.extend_seq_lens = a.positions, a.extend_seq_lens
    cpu = torch.device("cpu")
    assert metadata_signature(a, cpu) == metadata_signature(b, cpu)  # only *_cpu differ


def _pointers(mgr, ms) -> dict:
    """Address of every device tensor the captured plan of the step backends reads."""
    out = {}
    for i, md in enumerate(ms.step_metadata):
        sig = describe_signature(md, mgr.source.device)
        out.update({f"step{i}{k}": v[1] for k, v in sig.items()
                    if isinstance(v, tuple) and v[0] == "tensor"})
    return out


@pytest.mark.parametrize("arch,page", [
    pytest.param("swa", 7, id="swa-page7"),
    pytest.param("swa", 1, id="swa-page1"),
    pytest.param("mha", 16, id="mha-page16"),
    pytest.param("mla", 16, id="mla-page16"),
])
def test_multistep_tables_stay_put_across_larger_eager_batches(arch, page):
    from aiter_attn import multistep

    topk, steps = 2, 3
    spec = SpecDecodeConfig(num_steps=steps, topk=topk, num_draft_tokens=steps * topk + 1)
    rig = Rig.make(arch, page_size=page, hq=4, hkv=2, head_dim=16, spec=spec, seed=3)
    ms = multistep.MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool)
    mgr = CudaGraphManager(ms, capture_sizes=[2], use_cuda_graph=False,
                           token_inputs=rig.token_inputs())
    fn = rig.multistep_step_fn(ms)
    mgr.capture(fn)
    captured = _pointers(mgr, ms)
    assert any("swa_pages" in k for k in captured) == (arch == "swa")

    rows6, batch6 = rig.join_drafting(6, 30)  # eager, larger than anything captured
    ms.init_forward_metadata(batch6)
    fn(batch6, rig.random_inputs(batch6, num_tokens=6 * topk))
    for r in rows6:
        rig.leave(r)

    rows, batch = rig.join_drafting(2, 30)
    inputs = rig.random_inputs(batch, num_tokens=2 * topk)
    out = [o.clone() for o in mgr.replay(batch, **inputs)]  # raises if anything moved
    assert _pointers(mgr, ms) == captured
    ms.init_forward_metadata(batch)
    for i, (g, e) in enumerate(zip(out, fn(batch, inputs))):
        assert torch.equal(g, e), f"layer {i}: replay ≠ eager"


@pytest.mark.gpu
def test_multistep_swa_tables_stay_put_under_real_capture():
    """The same on a GPU with a real CUDA graph: replay after a larger eager batch reads the
    captured tables and matches eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from aiter_attn import multistep
    from aiter_attn.testing.compare import assert_close_rel

    topk, steps = 2, 4
    spec = SpecDecodeConfig(num_steps=steps, topk=topk, num_draft_tokens=9)
    rig = Rig.make("swa", page_size=16, hq=8, hkv=2, head_dim=128, num_layers=2,
                   max_context_len=512, max_bs=16, spec=spec, dtype=torch.bfloat16,
                   device="cuda", seed=5)
    ms = multistep.MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool)
    mgr = CudaGraphManager(ms, capture_sizes=[2], token_inputs=rig.token_inputs())
    fn = rig.multistep_step_fn(ms)
    mgr.capture(fn)
    captured = _pointers(mgr, ms)
    for bs in (6, 12):
        rows_big, big = rig.join_drafting(bs, 300)
        ms.init_forward_metadata(big)
        fn(big, rig.random_inputs(big, num_tokens=bs * topk))
        for r in rows_big:
            rig.leave(r)
        rows, batch = rig.join_drafting(2, 300)
        inputs = rig.random_inputs(batch, num_tokens=2 * topk)
        out = [o.clone() for o in mgr.replay(batch, **inputs)]
        torch.cuda.synchronize()
        assert _pointers(mgr, ms) == captured
        ms.init_forward_metadata(batch)
        for i, (g, e) in enumerate(zip(out, fn(batch, inputs))):
            assert_close_rel(g, e, 8e-3, f"replay after eager bs={bs}, layer {i}")
        for r in rows:
            rig.leave(r)


def test_aiter_plans_keep_static_addresses(monkeypatch):
    """The aiter kernels keep no module workspaces: under ``out=`` every tensor a plan holds
    (token indices, last-page lens, the ragged workspace) is a static buffer, at the same
    address on every re-plan and for a smaller batch; eager plans get their own."""
    from aiter_attn import ops
    from aiter_attn.graph.buffers import GraphLimits
    from aiter_attn.kernels import aiter as A
    from aiter_attn.kernels.base import _adhoc_metadata

    from .test_plan_run_mla_aiter import _fake_aiter

    _fake_aiter(monkeypatch)
    q = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(17, 4, 2, 64, dtype=torch.bfloat16)
    kernel = A.AiterPagedAttention(ops.paged_attention_request(q, k, k))
    limits = GraphLimits(mode=ForwardMode.DECODE, max_bs=4, q_len=1, max_num_tokens=4,
                         max_seq_len=16)
    static = kernel.buffer_spec(limits).allocate("cpu")
    cu = torch.arange(5, dtype=torch.int32)
    lens = torch.tensor([3, 16, 9, 1], dtype=torch.int32)
    bt = torch.arange(1, 17, dtype=torch.int32).view(4, 4)

    def md(bs):
        return _adhoc_metadata(q[:bs], k, cu[: bs + 1], lens[:bs], bt[:bs], None, None, 1, 16,
                               "paged_attention")

    def ptrs(plan):
        return [t.data_ptr() for t in (*plan.kv, plan.workspace)]

    big, small = kernel.plan(md(4), out=static), kernel.plan(md(2), out=static)
    assert big.route == "paged_attention_ragged"
    assert ptrs(big) == ptrs(small)
    statics = {t.data_ptr() for t in static.values()}
    assert set(ptrs(big)) <= statics
    assert not set(ptrs(kernel.plan(md(4)))) & statics  # eager: fresh tensors


# -- kernel plans: their tensors are part of what a captured graph reads ---------------------

import attrs  # noqa: E402

from aiter_attn import AttentionBackend  # noqa: E402
from aiter_attn.graph import GraphMetadataMismatch  # noqa: E402
from aiter_attn.kernels import reference  # noqa: E402
from aiter_attn.kernels.base import FunctionKernel, FunctionPlan  # noqa: E402
from aiter_attn.kernels.registry import Capabilities, KernelRegistry  # noqa: E402
from aiter_attn.types import CGSupport  # noqa: E402

_WS = "spy.workspace"


@attrs.frozen(kw_only=True)
class WorkspacePlan(FunctionPlan):
    """The reference kernel's plan plus a workspace, as the Triton split path keeps one."""

    workspace: torch.Tensor = attrs.field(eq=False, repr=False)


class WorkspaceKernel(FunctionKernel):
    """The reference attention with a workspace in its plan: allocated when planned eagerly,
    taken from the static buffers (``out.setdefault``) under CUDA graphs, the Triton
    kernel's ``_partials`` convention. ``moving=True``: a broken kernel that allocates even
    under ``out=``."""

    fn = staticmethod(reference.paged_attention_reference)
    moving = False

    def plan(self, md, out=None):
        base = super().plan(md, out)
        fields = {f.name: getattr(base, f.name) for f in attrs.fields(FunctionPlan)}
        if out is None or type(self).moving:
            ws = torch.empty(max(md.query.num_tokens, 1), 4, device=md.query.cu_seqlens_q.device)
        else:
            ws = out.setdefault(_WS, torch.empty(256, 4, device=md.query.cu_seqlens_q.device))
        return WorkspacePlan(workspace=ws, **fields)


def _spy_registry(kernel_cls):
    from aiter_attn.kernels import reference_extra

    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)
    reference_extra.aiter_attn_register_kernels(reg.register)
    feats = {"sinks", "softcap", "window", "fp8", "custom_mask", "v_head_dim_differs",
             "non_causal", "lse"}
    reg.register("paged_attention", "spy", kernel_cls,
                 Capabilities(features=feats, cg_support=CGSupport.ALWAYS), priority=1000)
    return reg


def _workspaces(md) -> list:
    return [p.workspace.data_ptr() for p in md.kernel_plans.plans.values()]


def _kernel(moving):
    return type("Spy", (WorkspaceKernel,), {"moving": moving})


@pytest.mark.parametrize("arch,page", [pytest.param("mha", 16, id="mha-page16"),
                                       pytest.param("swa", 7, id="swa-page7"),
                                       pytest.param("mha", 1, id="mha-page1")])
def test_multistep_kernel_plans_live_in_static_buffers(arch, page):
    """Each draft step's kernel plan puts its workspace in the manager's buffers (under its
    ``step{i}.`` prefix) at capture and finds the same one at every replay, whatever eager
    batches run in between; replays match eager."""
    from aiter_attn import multistep

    topk, steps = 2, 3
    spec = SpecDecodeConfig(num_steps=steps, topk=topk, num_draft_tokens=steps * topk + 1)
    rig = Rig.make(arch, page_size=page, hq=4, hkv=2, head_dim=16, spec=spec, seed=4)
    ms = multistep.MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool,
                                         kernels=_spy_registry(_kernel(False)))
    mgr = CudaGraphManager(ms, capture_sizes=[2, 4], use_cuda_graph=False,
                           token_inputs=rig.token_inputs())
    fn = rig.multistep_step_fn(ms)
    mgr.capture(fn)
    bufs = mgr.strategy_buffers("decode")
    for i in range(steps - 1):
        assert f"step{i}.{_WS}" in bufs, sorted(bufs)
    want = {i: bufs[f"step{i}.{_WS}"].data_ptr() for i in range(steps - 1)}
    for bs in (6, 2, 3):
        rows, batch = rig.join_drafting(bs, 30)
        inputs = rig.random_inputs(batch, num_tokens=bs * topk)
        if bs > 4:  # eager only: larger than anything captured
            ms.init_forward_metadata(batch)
            fn(batch, inputs)
        else:
            out = [o.clone() for o in mgr.replay(batch, **inputs)]
            for i, md in enumerate(ms.step_metadata):
                assert _workspaces(md) == [want[i]] * len(md.kernel_plans), f"step {i}"
            ms.init_forward_metadata(batch)
            for j, (g, e) in enumerate(zip(out, fn(batch, inputs))):
                assert torch.equal(g, e), f"layer {j}: replay ≠ eager"
        for r in rows:
            rig.leave(r)


def test_multistep_kernel_plan_that_moves_is_reported():
    """A kernel whose plan allocates under ``out=`` makes the first replay raise, naming the
    kernel plan's field (the signature walks every step's kernel plans)."""
    from aiter_attn import multistep

    spec = SpecDecodeConfig(num_steps=3, topk=2, num_draft_tokens=7)
    rig = Rig.make("mha", page_size=16, hq=4, hkv=2, head_dim=16, spec=spec, seed=4)
    ms = multistep.MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool,
                                         kernels=_spy_registry(_kernel(True)))
    mgr = CudaGraphManager(ms, capture_sizes=[2], use_cuda_graph=False,
                           token_inputs=rig.token_inputs())
    mgr.capture(rig.multistep_step_fn(ms))
    rows, batch = rig.join_drafting(2, 30)
    with pytest.raises(GraphMetadataMismatch, match=r"kernel_plans\[0:WorkspacePlan\]"
                                                    r"\.workspace"):
        mgr.replay(batch, **rig.random_inputs(batch, num_tokens=4))


@pytest.mark.parametrize("moving", [False, True], ids=["static", "moving"])
def test_backend_kernel_plans_are_part_of_the_signature(moving):
    """The plain backend path: a kernel plan's workspace is planned into the static buffers
    (capture and replay agree, eager batches in between leave it alone); one that moves is
    reported at the first replay."""
    rig = Rig.make("mha", page_size=16, hq=4, hkv=2, head_dim=16, seed=2)
    rig.backend = be = AttentionBackend(rig.config, rig.req_pool, rig.kv_pool,
                                        kernels=_spy_registry(_kernel(moving)))
    mgr = rig.manager(capture_sizes=[2, 4])
    mgr.capture(rig.step_fn())
    for p in (3, 17):
        rig.join(p)
    batch = rig.batch("decode")
    inputs = rig.random_inputs(batch)
    if moving:
        with pytest.raises(GraphMetadataMismatch, match=r"kernel_plans\[0:WorkspacePlan\]"):
            mgr.replay(batch, **inputs)
        return
    ws = mgr.strategy_buffers("decode")[_WS].data_ptr()
    for _ in range(2):
        out = [o.clone() for o in mgr.replay(batch, **inputs)]
        assert _workspaces(be.forward_metadata) == [ws]
        for p in (5, 9, 11):  # an eager batch larger than any capture in between
            rig.join(p)
        big = rig.batch("decode")
        rig.eager(big, rig.random_inputs(big), save_kv_cache=False)
        for r in rig.rows[2:]:
            rig.leave(r)
    eager = rig.eager(batch, inputs, save_kv_cache=False)
    for g, e in zip(out, eager):
        assert torch.equal(g, e)


def test_signature_walks_kernel_plans_and_skips_memos():
    """``describe_signature`` names each kernel plan's tensors (by address) and leaves out
    fields marked as memos (``MEMO``: a run's lazily filled constexpr cache)."""
    from aiter_attn.kernels.triton.attention import TritonPlan

    md = _md(torch.zeros(2, 4, dtype=torch.int32))
    ws = torch.zeros(8)
    plan = TritonPlan(num_tokens=2, grid=(1, 1, 1), args=(), ints=(), bt_stride=4,
                      part_acc=ws, kw_cache={"filled": "later"})
    md.kernel_plans["group"] = plan
    cpu = torch.device("cpu")
    sig = describe_signature(md, cpu)
    key = "metadata.kernel_plans[0:TritonPlan].part_acc"
    assert sig[key][:2] == ("tensor", ws.data_ptr())
    assert not any("kw_cache" in k for k in sig)
    before = metadata_signature(md, cpu)
    plan.kw_cache["more"] = 1  # a memo growing does not change the signature
    assert metadata_signature(md, cpu) == before
    md.kernel_plans["group"] = attrs.evolve(plan, part_acc=torch.zeros(8))
    assert metadata_signature(md, cpu) != before


@pytest.mark.parametrize("arch", ["mha", "swa"])
def test_multistep_triton_split_workspaces_stay_put(arch, monkeypatch):
    """The case the H200 crashed on (illegal memory access in the Triton launch): the Triton
    kernel with a forced split (interpreter). Every step's split partials live in the
    manager's buffers, keep their addresses from capture through replays, and replays match
    eager."""
    from aiter_attn import multistep
    from aiter_attn.kernels.triton import _launch_config

    monkeypatch.setitem(_launch_config.TUNING_OVERRIDES, "num_splits", 3)
    topk, steps = 2, 3
    spec = SpecDecodeConfig(num_steps=steps, topk=topk, num_draft_tokens=steps * topk + 1)
    rig = Rig.make(arch, page_size=16, hq=4, hkv=2, head_dim=16, spec=spec, seed=6,
                   max_context_len=64, dtype=torch.float16)
    cfg = attrs.evolve(rig.config, kernel_backend="triton")
    ms = multistep.MultiStepDraftBackend(cfg, rig.req_pool, rig.kv_pool)
    mgr = CudaGraphManager(ms, capture_sizes=[2], use_cuda_graph=False,
                           token_inputs=rig.token_inputs())
    fn = rig.multistep_step_fn(ms)
    mgr.capture(fn)
    bufs = {v.data_ptr() for v in mgr.strategy_buffers("decode").values()}
    captured = None
    for bs in (3, 2, 1):
        rows, batch = rig.join_drafting(bs, 30)
        inputs = rig.random_inputs(batch, num_tokens=bs * topk)
        if bs > 2:
            ms.init_forward_metadata(batch)
            fn(batch, inputs)
        else:
            out = [o.clone() for o in mgr.replay(batch, **inputs)]
            ptrs = []
            for md in ms.step_metadata:
                for p in md.kernel_plans.plans.values():
                    assert p.split and p.part_acc.data_ptr() in bufs
                    ptrs.append((p.part_acc.data_ptr(), p.part_ml.data_ptr()))
            assert captured is None or ptrs == captured
            captured = ptrs
            ms.init_forward_metadata(batch)
            for j, (g, e) in enumerate(zip(out, fn(batch, inputs))):
                torch.testing.assert_close(g, e, rtol=2e-3, atol=2e-3, msg=f"layer {j}")
        for r in rows:
            rig.leave(r)
