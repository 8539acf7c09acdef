"""MLA and the aiter plugin through plan/run: the MLA kernel is bound once per layer group,
planned once per step and only launched per layer (spy kernel: no selection, no validation,
no allocation besides the output); a cell's graph support is the minimum of its pair's and
its kernel's; the Triton MLA split workspace lives in static buffers; plain MLA functions are
adapted. The aiter half (fake ``aiter`` on the CPU) is at the end of the file."""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ForwardMode, SpecInfo
from aiter_attn.kernels import reference
from aiter_attn.kernels.base import (KernelPlan, MLAFunctionKernel, MLAKernel, mla_request,
                                     _adhoc_metadata, mla_layer_params)
from aiter_attn.kernels.registry import Capabilities, KernelRegistry
from aiter_attn.types import CGSupport

from ._triton_util import DEVICE, requires_triton
from .test_mla import MLAScenario, _check
from .test_plan_run import _Allocations as _AllocSpy


class _Allocations(_AllocSpy):
    """test_plan_run's allocation spy; in-place ops (``copy_.default``: the overload name
    follows the op's) write into existing storage and are not allocations."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        base = func.__name__.split(".")[0]
        if base.endswith("_"):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

_MLA_FEATURES = {"fp8", "custom_mask", "lse", "batch_invariant"}


class SpyMLA(MLAKernel):
    """Records plan/run; run writes zeros into ``out`` (no allocation)."""

    events: list = []

    def plan(self, md, out=None):
        type(self).events.append(("plan", md.query.num_tokens))
        return KernelPlan(num_tokens=md.query.num_tokens)

    def run(self, q, cache, plan, params, out, lse=None):
        type(self).events.append(("run", plan, params, q.shape[1]))
        out.zero_()
        return out


def _noop_write(k_cache, v_cache, slots, k, v, *, k_scale=None, v_scale=None):
    pass


def _spy_registry(cg=CGSupport.ALWAYS):
    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)
    reg.register("mla_paged_attention", "spy", SpyMLA,
                 Capabilities(features=_MLA_FEATURES, cg_support=cg), priority=1000)
    reg.register("write_kv", "spy", _noop_write,
                 Capabilities(features={"fp8"}, cg_support=CGSupport.ALWAYS), priority=1000)
    return reg


def test_mla_layer_call_only_launches(monkeypatch):
    """After the first step binds the absorbed layer's group, a step plans the group once
    (init_forward_metadata) and every layer call selects nothing, validates nothing and
    allocates only its output."""
    from aiter_attn import backend as backend_mod
    from aiter_attn import validation

    reg = _spy_registry()
    sc = MLAScenario(page_size=16, heads=16, prefix_lens=[5, 9], seed=2, kernels=reg)
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    sc.run_absorbed()  # binds the group
    sc.commit()
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    SpyMLA.events.clear()
    sc.backend.init_forward_metadata(sc.batch)
    assert [e[0] for e in SpyMLA.events] == ["plan"]

    def no_select(*a, **k):
        raise AssertionError("a layer call selected a kernel")

    def no_validation(*a, **k):
        raise AssertionError("a layer call ran check_tensor")

    monkeypatch.setattr(reg, "select", no_select)
    monkeypatch.setattr(reg, "bound", no_select)
    monkeypatch.setattr(validation, "check_tensor", no_validation)
    monkeypatch.setattr(backend_mod, "check_tensor", no_validation)
    SpyMLA.events.clear()
    q, k = sc.absorbed_inputs()
    for _ in range(3):  # three layer calls of the step
        with _Allocations() as spy:
            out = sc.backend.forward(q, k, None, sc.absorbed, sc.batch)
        assert spy.allocs in (["empty.memory_format"], ["new_empty.default"]), spy.allocs
        assert out.shape == (2, 16 * sc.lora)
    assert [e[0] for e in SpyMLA.events] == ["run"] * 3
    assert len({id(e[1]) for e in SpyMLA.events}) == 1  # the step's one plan
    params = SpyMLA.events[0][2]
    assert params.scale == sc.absorbed.scaling and params.v_head_dim == sc.lora
    with pytest.raises(AttributeError):
        params.scale = 1.0  # frozen


def test_mla_graph_support_is_min_of_pair_and_kernel():
    from aiter_attn.graph.sources import _StrategyPlanner

    sc = MLAScenario(page_size=16, heads=16, prefix_lens=[5, 9], seed=3,
                     kernels=_spy_registry(CGSupport.NEVER))
    be = sc.backend
    assert be.graph_support(ForwardMode.DECODE) == CGSupport.ALWAYS  # nothing bound yet
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    sc.run_absorbed()
    assert be.graph_support(ForwardMode.DECODE) == CGSupport.NEVER
    with pytest.raises(ValueError, match=r"kernel 'spy' \(op mla_paged_attention\).*"
                                         r"kernel_backend"):
        _StrategyPlanner(be, ForwardMode.DECODE).check_capturable()


def test_mla_reference_cell_is_not_capturable():
    """The reference MLA kernel (cg_support NEVER, adapted from a function) bound on a decode
    cell makes the cell uncapturable, with the kernel named."""
    from aiter_attn.graph.sources import _StrategyPlanner

    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)
    sc = MLAScenario(page_size=16, heads=4, prefix_lens=[3, 7], seed=4, kernels=reg)
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    _check(sc, sc.run_absorbed(), "reference through plan/run")
    assert sc.backend.graph_support(ForwardMode.DECODE) == CGSupport.NEVER
    with pytest.raises(ValueError, match="kernel 'reference'"):
        _StrategyPlanner(sc.backend, ForwardMode.DECODE).check_capturable()


def test_mla_padding_group_binds_padded_request():
    """Head padding is decided once per group: the kernel is bound for the padded head count
    and sees it on every run."""
    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)

    def needs_16(req):
        heads = dict(req.extra).get("heads")
        return None if heads % 16 == 0 else f"heads={heads}"

    reg.register("mla_paged_attention", "spy", SpyMLA,
                 Capabilities(features=_MLA_FEATURES, cg_support=CGSupport.ALWAYS,
                              predicate=needs_16), priority=1000)
    sc = MLAScenario(page_size=16, heads=4, prefix_lens=[5, 9], seed=5, kernels=reg)
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    SpyMLA.events.clear()
    sc.run_absorbed()
    runs = [e for e in SpyMLA.events if e[0] == "run"]
    assert runs and all(e[3] == 16 for e in runs)
    (group,) = sc.backend.strategies_for(ForwardMode.DECODE)[1].groups.values()
    assert dict(group.kernel.request.extra)["heads"] == 16


def test_registered_mla_function_is_adapted():
    """A plugin's plain MLA function becomes an MLAFunctionKernel whose run makes the MLA
    keyword call (kv_lora_rank from out, kv_scale only for fp8 caches, the plan's tensors)."""
    seen = {}

    def fn(q, kv_cache, out, **kw):
        seen.update(kw)
        return out

    reg = KernelRegistry()
    reg.register("mla_paged_attention", "fn", fn, Capabilities(cg_support=CGSupport.NEVER))
    impl = reg.implementations("mla_paged_attention")[0]
    assert impl.fn is fn  # the functional convenience stays the function
    kernel = impl.bind(None)
    assert isinstance(kernel, MLAFunctionKernel) and kernel.op == "mla_paged_attention"
    q, kv = torch.randn(3, 4, 24), torch.randn(5, 4, 1, 24)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    lens = torch.tensor([2, 6], dtype=torch.int32)
    bt = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)
    md = _adhoc_metadata(q, kv, cu, lens, bt, None, None, 2, 6, "mla_paged_attention")
    plan = kernel.plan(md)
    params = mla_layer_params(scale=0.3, device=q.device, kv_lora_rank=16, kv_scale=0.5,
                              fp8=False)
    out = torch.empty(3, 4, 16)
    assert kernel.run(q, (kv,), plan, params, out) is out
    assert seen["kv_lora_rank"] == 16 and seen["softmax_scale"] == 0.3
    assert seen["kv_scale"] is None  # not an fp8 cache: scales do not apply
    assert seen["block_table"] is bt and seen["max_seqlen_q"] == 2 and seen["causal"] is True


# ----------------------------------------------------------------------------- Triton MLA
def _triton_case(q_lens=(1, 1, 1), kv_lens=(70, 5, 33), seed=0, heads=16):
    from .test_triton_mla import MLACase

    case = MLACase(list(q_lens), list(kv_lens), heads=heads, rank=32, rope=16, page=16,
                   seed=seed, device=DEVICE)
    for name in ("q", "kv_cache", "cu", "seqused", "block_table"):
        setattr(case, name, getattr(case, name).to(DEVICE))
    return case


def _triton_run(kernel, case, static):
    md = _adhoc_metadata(case.q, case.kv_cache, case.cu, case.seqused, case.block_table, None,
                         None, max(case.q_lens), 80, "mla_paged_attention")
    plan = kernel.plan(md, out=static)
    params = mla_layer_params(scale=case.softmax_scale, device=case.q.device,
                              kv_lora_rank=case.rank, num_q_heads=case.heads,
                              head_dim=case.q.shape[2])
    return plan, params


@requires_triton
def test_triton_mla_plans_its_split_workspace_into_static_buffers():
    """Under CUDA graphs the split partials are views of the static buffers (declared by
    buffer_spec, or added once with setdefault); a re-plan into the same dict keeps the
    addresses, and the first plan run on the refilled index tensors gives the new result."""
    from aiter_attn.graph.buffers import GraphLimits
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    case = _triton_case()
    req = mla_request(case.q, case.kv_cache, case.rank)
    kernel = TritonMLA(req, {"num_kv_splits": 3})
    limits = GraphLimits(mode=ForwardMode.DECODE, max_bs=4, q_len=1, max_num_tokens=4,
                         max_seq_len=80)
    spec = kernel.buffer_spec(limits)
    # the partials, and the fused merge's counters (int32, zero-filled, left zero by it)
    assert sorted(spec.buffers) == ["triton.mla.partials.16h32.cnt",
                                    "triton.mla.partials.16h32.lse", "triton.mla.partials.16h32.o"]
    assert spec.buffers["triton.mla.partials.16h32.cnt"] == ((4 * 1 * 16,), torch.int32)
    static = spec.allocate(DEVICE)
    plan, params = _triton_run(kernel, case, static)
    assert plan.part_o.data_ptr() == static["triton.mla.partials.16h32.o"].data_ptr()
    out = torch.empty(3, 16, case.rank, device=DEVICE)
    kernel.run(case.q, (case.kv_cache,), plan, params, out)
    want = reference.mla_paged_attention_reference(case.q, case.kv_cache, torch.empty_like(out),
                                                   **case.kwargs())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # new lengths in the same index tensors; the re-plan lands on the same addresses
    other = _triton_case(kv_lens=(33, 70, 5), seed=1)  # same shapes, other values
    case.seqused.copy_(other.seqused)
    case.block_table.copy_(other.block_table)
    case.kv_cache.copy_(other.kv_cache)
    case.q.copy_(other.q)
    again, _ = _triton_run(kernel, case, static)
    assert again.part_o.data_ptr() == plan.part_o.data_ptr()
    kernel.run(case.q, (case.kv_cache,), plan, params, out)  # the FIRST plan (a replay)
    want = reference.mla_paged_attention_reference(other.q, other.kv_cache,
                                                   torch.empty_like(out), **other.kwargs())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # bound after the manager was built: added once with setdefault, then reused
    late: dict = {"cu_seqlens_q": torch.zeros(5, dtype=torch.int32, device=DEVICE)}
    p1, _ = _triton_run(kernel, case, late)
    p2, _ = _triton_run(kernel, case, late)
    assert p1.part_o.data_ptr() == p2.part_o.data_ptr() == late[
        "triton.mla.partials.16h32.o"].data_ptr()


@requires_triton
def test_triton_mla_backend_decode_and_verify():
    """The Triton MLA kernel object through the backend (plan once per step, run per layer)
    against the dense reference, decode and chain verify."""
    from aiter_attn.kernels import triton as triton_kernels

    if DEVICE != "cpu":
        pytest.skip("MLAScenario builds its pools on the CPU")
    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)
    triton_kernels.aiter_attn_register_kernels(  # above the reference on the CPU too
        lambda op, name, fn, caps, priority=0: reg.register(op, name, fn, caps, priority=500))
    sc = MLAScenario(page_size=16, heads=8, prefix_lens=[5, 40], seed=6, kernels=reg)
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    _check(sc, sc.run_absorbed(), "triton MLA decode")
    sc.commit()
    sc.next_batch(ForwardMode.TARGET_VERIFY, [3, 3], SpecInfo(num_draft_tokens=3))
    _check(sc, sc.run_absorbed(), "triton MLA verify")
    groups = sc.backend.strategies_for(ForwardMode.TARGET_VERIFY)[1].groups.values()
    assert [g.kernel.name for g in groups] == ["triton"]


# ----------------------------------------------------------------------------- aiter
def _fake_aiter(monkeypatch) -> list:
    """A permissive fake ``aiter`` package on the CPU (the contract test binds the same calls
    against the wheel's signatures): records ``(name, kwargs)``; the info call returns the
    0.1.7 sizes, the MLA decode copies each padded head's query into its output."""
    import sys
    import types

    import aiter_attn.kernels.aiter as A
    from aiter_attn.kernels import aiter_marshal as M

    calls: list = []
    for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
        monkeypatch.delitem(sys.modules, name)
    modules: dict = {}

    def module(path):
        if path not in modules:
            mod = modules[path] = types.ModuleType(path)
            mod.__path__ = []
            monkeypatch.setitem(sys.modules, path, mod)
            parent, _, leaf = path.rpartition(".")
            if parent:
                setattr(module(parent), leaf, mod)
        return modules[path]

    def make(fn):
        def call(**kw):
            calls.append((fn, kw))
            if fn == "get_mla_metadata_info_v1":
                specs = M.mla_work_buffer_spec(kw["batch_size"], kw["max_seqlen_qo"],
                                               kw["num_head_qo"], kw["kv_dtype"], cu_num=4,
                                               fast_mode=kw["fast_mode"])
                return tuple((s.shape, s.dtype) for s in specs)
            if fn == "mla_decode_fwd":
                kw["o"].copy_(kw["q"][..., : kw["o"].shape[-1]])
            return None
        return call

    for fn, mods in A.AITER_FUNCTIONS.items():
        setattr(module(mods[0]), fn, make(fn))
    return calls


def _count_marshalling(monkeypatch) -> dict:
    """Counts of the per-step marshalling (routing, index and work-metadata builders)."""
    from aiter_attn.kernels import aiter_marshal as M

    counts: dict = {}
    for name in ("route_paged_attention", "token_kv_indices", "mla_decode_plan",
                 "build_mla_metadata_call", "ragged_workspace_bytes", "mla_work_buffer_spec"):
        real = getattr(M, name)

        def counting(*a, _real=real, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*a, **k)

        monkeypatch.setattr(M, name, counting)
    return counts


def _aiter_registry(op, cls, **caps):
    import attrs

    import aiter_attn.kernels.aiter as A

    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)
    # the aiter capabilities, opened to the CPU (the fake computes nothing)
    c = attrs.evolve(A.capabilities()[op], devices=None, dtypes=None, **caps)
    reg.register(op, "aiter", cls, c, priority=1000)
    reg.register("write_kv", "spy", _noop_write,
                 Capabilities(features={"fp8"}, cg_support=CGSupport.ALWAYS), priority=1000)
    return reg


def _no_layer_selection(monkeypatch, reg):
    from aiter_attn import backend as backend_mod
    from aiter_attn import validation

    def no_select(*a, **k):
        raise AssertionError("a layer call selected a kernel")

    def no_validation(*a, **k):
        raise AssertionError("a layer call ran check_tensor")

    monkeypatch.setattr(reg, "select", no_select)
    monkeypatch.setattr(reg, "bound", no_select)
    monkeypatch.setattr(validation, "check_tensor", no_validation)
    monkeypatch.setattr(backend_mod, "check_tensor", no_validation)


def test_aiter_paged_layer_call_only_launches(monkeypatch):
    """On the aiter path a step routes and builds the token indices once per layer group
    (in init_forward_metadata); each layer call allocates only its output, makes no routing
    decision and calls paged_attention_ragged with the plan's buffers."""
    import aiter_attn.kernels.aiter as A
    from aiter_attn import AttentionBackend, BackendConfig, LayerSpec
    from aiter_attn.testing import PagedScenario

    calls = _fake_aiter(monkeypatch)
    counts = _count_marshalling(monkeypatch)
    cfg = BackendConfig(page_size=4, max_batch_size=4, max_context_len=64, dtype=torch.bfloat16)
    # head_dim 64: a size paged_attention_ragged launches (M.RAGGED_HEAD_SIZES)
    layers = [LayerSpec(layer_id=i, num_q_heads=4, num_kv_heads=2, head_dim=64)
              for i in range(3)]
    sc = PagedScenario.make(cfg, layers, [5, 9], seed=1)
    reg = _aiter_registry("paged_attention", A.AiterPagedAttention)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool, kernels=reg)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    for layer in layers:  # binds the layers' one group
        be.forward(*sc.step_inputs(layer), layer, batch)
    sc.commit_step()

    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    counts.clear()
    be.init_forward_metadata(batch)
    assert counts == {"route_paged_attention": 1, "token_kv_indices": 1,
                      "ragged_workspace_bytes": 1}
    inputs = [sc.step_inputs(layer) for layer in layers]
    _no_layer_selection(monkeypatch, reg)
    counts.clear()
    calls.clear()
    for layer, (q, k, v) in zip(layers, inputs):
        with _Allocations() as spy:
            be.forward(q, k, v, layer, batch)
        assert spy.allocs in (["empty.memory_format"], ["new_empty.default"]), spy.allocs
    assert counts == {}  # no routing, no index building per layer
    assert [n for n, _ in calls] == ["paged_attention_ragged"] * 3
    first = calls[0][1]
    for _, kw in calls[1:]:  # every layer reads the step's one set of planned tensors
        for name in ("kv_indptr", "kv_page_indices", "kv_last_page_lens", "workspace_buffer",
                     "k_scale"):
            assert kw[name] is first[name], name


def test_aiter_mla_layer_call_only_launches(monkeypatch):
    """aiter MLA, 4 heads on an fp8 latent cache (persistent kernel, heads padded to 16):
    the step plans the token indices and calls get_mla_metadata_v1 once; each layer call
    allocates only its output and only calls mla_decode_fwd, padding through the plan's
    buffers."""
    import aiter_attn.kernels.aiter as A

    fp8 = torch.float8_e4m3fn
    calls = _fake_aiter(monkeypatch)
    counts = _count_marshalling(monkeypatch)
    reg = _aiter_registry("mla_paged_attention", A.AiterMLA, predicate=None)
    sc = MLAScenario(page_size=16, heads=4, prefix_lens=[5, 9], seed=7, kernels=reg,
                     kv_dtype=fp8, kv_scale=0.5)
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    sc.run_absorbed()  # binds
    sc.commit()
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    counts.clear()
    calls.clear()
    sc.backend.init_forward_metadata(sc.batch)
    assert counts.get("token_kv_indices") == 1 and counts.get("build_mla_metadata_call") == 1
    assert [n for n, _ in calls] == ["get_mla_metadata_v1"]
    q, k = sc.absorbed_inputs()
    _no_layer_selection(monkeypatch, reg)
    counts.clear()
    calls.clear()
    for _ in range(3):
        with _Allocations() as spy:
            out = sc.backend.forward(q, k, None, sc.absorbed, sc.batch)
        assert spy.allocs in (["empty.memory_format"], ["new_empty.default"]), spy.allocs
        # the fake decode copies each padded head's query: unpadded, each head's own
        torch.testing.assert_close(out.view(2, 4, sc.lora), q.view(2, 4, -1)[..., : sc.lora],
                                   rtol=0, atol=0)
    assert counts == {}
    assert [n for n, _ in calls] == ["mla_decode_fwd"] * 3
    assert all(kw["q"].shape[1] == 16 and kw["work_meta_data"] is not None for _, kw in calls)
    assert calls[0][1]["q"].data_ptr() == calls[2][1]["q"].data_ptr()  # the plan's q_pad


@requires_triton
@pytest.mark.parametrize("mode", ["decode", "target_verify"])
def test_triton_mla_through_the_graph_manager(monkeypatch, mode):
    """MLA cells with the Triton kernel object forced (AITER_ATTN_BACKEND=triton) through the
    graph manager on the CPU (the planning into static buffers and the replay-signature check
    a capture relies on): the split workspace lives in the static buffers and the replays
    equal eager steps bit for bit."""
    from aiter_attn import SpecDecodeConfig

    from .test_graph_manager import _steps
    from ._graph_helpers import Rig

    if DEVICE != "cpu":
        pytest.skip("CPU variant (tests/test_graph_gpu.py -k mla runs it captured)")
    monkeypatch.setenv("AITER_ATTN_BACKEND", "triton")
    # both plans split the keys in two: by default the split count follows each plan's own
    # key bound (the eager step's hint, the graph's capture bound), and a different count
    # sums in a different order (equal only to rounding, not bit for bit)
    from aiter_attn.kernels.triton import mla as triton_mla

    launch_config = triton_mla.mla_launch_config

    def two_splits(*args, num_kv_splits=None, **kw):
        return launch_config(*args, num_kv_splits=num_kv_splits or 2, **kw)

    monkeypatch.setattr(triton_mla, "mla_launch_config", two_splits)
    spec = None if mode == "decode" else SpecDecodeConfig(num_draft_tokens=2)
    # a long context bound: small batches split the keys (8 "SMs" on the CPU)
    rig = Rig.make("mla", page_size=16, hq=16, head_dim=32, seed=11, spec=spec,
                   max_context_len=1024)
    mgr = rig.manager()
    mgr.capture(rig.step_fn())
    m = ForwardMode.parse(mode)
    _, executor = rig.backend.strategies_for(m)
    assert [g.kernel.name for g in executor.groups.values()] == ["triton"]
    _steps(rig, mgr, mode, [3, 5, 1])
    while len(rig.rows) > 1:
        rig.leave(rig.rows[0])
    batch = rig.batch(mode)
    mgr.replay(batch, **rig.random_inputs(batch))
    (plan,) = rig.backend.forward_metadata.kernel_plans.plans.values()
    assert plan.splits > 1 and plan.part_o is not None  # the split path ran
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for t in mgr._modes[m].buffers.values()]
    for t in (plan.part_o, plan.part_lse):  # the split workspace is a static buffer view
        assert any(lo <= t.data_ptr() < hi for lo, hi in spans)


def test_mla_checked_mode_wraps_the_bound_kernel(monkeypatch):
    """AITER_ATTN_DEBUG=1: the MLA group's kernel is bound wrapped in CheckedKernel, whose run
    (cache = (kv_cache,)) checks the step's index values before the launch: a page id
    outside the pool is refused with a ValueError instead of being read."""
    from aiter_attn.validation import CheckedKernel

    monkeypatch.setenv("AITER_ATTN_DEBUG", "1")
    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)
    sc = MLAScenario(page_size=16, heads=4, prefix_lens=[5, 20], seed=8, kernels=reg)
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    _check(sc, sc.run_absorbed(), "checked decode")
    (group,) = sc.backend.strategies_for(ForwardMode.DECODE)[1].groups.values()
    assert isinstance(group.kernel, CheckedKernel) and group.kernel.name == "reference"
    sc.commit()
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    md = sc.backend.init_forward_metadata(sc.batch)
    md.pages.block_table[1, 0] = sc.pool.kv_buffer(0).shape[0] + 5  # past the pool
    q, k = sc.absorbed_inputs()
    with pytest.raises(ValueError, match="block_table"):
        sc.backend.forward(q, k, None, sc.absorbed, sc.batch)


def test_aiter_mla_fp8_extend_runs_on_the_next_kernel(monkeypatch):
    """mla_prefill_fwd's kernels read a bf16 latent cache only (``mla_pfl_bf16_a16w16_*``;
    the wheel binding is tests/test_aiter_mla_routing.py): an extend step over an fp8 cache is
    planned and run by the next registered MLA kernel (the reference on the CPU), on every
    layer call, and equals the reference with the cache's scale exactly; aiter's prefill is
    never called. A bf16 cache's extend stays on mla_prefill_fwd."""
    import aiter_attn.kernels.aiter as A

    calls = _fake_aiter(monkeypatch)
    fp8 = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(9)
    q = (torch.randn(9, 16, 576, generator=g) * 0.5).bfloat16()
    kv = (torch.randn(4, 64, 1, 576, generator=g) * 0.5).to(fp8)
    kernel = A.AiterMLA(mla_request(q, kv, 512))
    scale = torch.tensor(0.5)
    params = mla_layer_params(scale=0.25, device=q.device, kv_lora_rank=512, num_q_heads=16,
                              head_dim=576, kv_scale=scale, fp8=True)
    index = dict(cu_seqlens_q=torch.tensor([0, 9], dtype=torch.int32),
                 seqused_k=torch.tensor([40], dtype=torch.int32),
                 block_table=torch.tensor([[2, 0]], dtype=torch.int32))
    md = _adhoc_metadata(q, kv, *index.values(), None, None, 9, 128, "mla_paged_attention")
    plan = kernel.plan(md)
    assert plan.route == "fallback" and plan.fallback is not None
    assert "kv cache dtype torch.float8_e4m3fn" in kernel.step_reason(9)
    want = reference.mla_paged_attention_reference(
        q, kv, torch.empty(9, 16, 512, dtype=torch.bfloat16), kv_lora_rank=512,
        softmax_scale=0.25, kv_scale=scale, **index)
    for _ in range(2):  # two layer calls of the step
        out = torch.full((9, 16, 512), float("nan"), dtype=torch.bfloat16)
        kernel.run(q, (kv,), plan, params, out)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert "mla_prefill_fwd" not in {name for name, _ in calls}

    kv16 = kv.to(torch.bfloat16)
    bf16_kernel = A.AiterMLA(mla_request(q, kv16, 512))
    assert bf16_kernel.plan(md).route == "mla_prefill_fwd"
