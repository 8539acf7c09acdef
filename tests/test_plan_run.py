"""Kernels as plan/run objects: chosen once per layer group, planned once per step, and a layer
call that only launches (no selection, no validation beyond O(1) shape checks, no allocation
besides its output), proven with a spy kernel; LayerParams; graph support of a cell; the
functional ops path (select once per cheap key, plan, run)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
from aiter_attn.kernels import reference
from aiter_attn.kernels.base import AttentionKernel, KernelPlan, LayerParams
from aiter_attn.kernels.registry import Capabilities, KernelRegistry
from aiter_attn.testing import PagedScenario
from aiter_attn.types import CGSupport

_ALL = {"sinks", "softcap", "window", "fp8", "custom_mask", "v_head_dim_differs", "non_causal",
        "lse"}


class SpyKernel(AttentionKernel):
    """Records plan/run calls; run writes zeros into ``out`` (no allocation)."""

    events: list = []

    def plan(self, md, out=None):
        type(self).events.append(("plan", md.query.num_tokens))
        return KernelPlan(num_tokens=md.query.num_tokens)

    def run(self, q, cache, plan, params, out, lse=None):
        type(self).events.append(("run", plan, params))
        out.zero_()
        return out


def _spy_write(k_cache, v_cache, slots, k, v, *, k_scale=None, v_scale=None):
    pass


def _registry(cg=CGSupport.ALWAYS):
    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)
    reg.register("paged_attention", "spy", SpyKernel, Capabilities(features=_ALL, cg_support=cg),
                 priority=1000)
    reg.register("write_kv", "spy", _spy_write,
                 Capabilities(features={"fp8"}, cg_support=CGSupport.ALWAYS), priority=1000)
    return reg


def _setup(n_layers=3, cg=CGSupport.ALWAYS):
    cfg = BackendConfig(page_size=4, max_batch_size=4, max_context_len=64, dtype=torch.float32)
    layers = [LayerSpec(layer_id=i, num_q_heads=4, num_kv_heads=2, head_dim=16)
              for i in range(n_layers)]
    sc = PagedScenario.make(cfg, layers, [5, 9], seed=1)
    reg = _registry(cg)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool, kernels=reg)
    return cfg, layers, sc, reg, be


class _Allocations(TorchDispatchMode):
    """Records every aten op that creates a new tensor's storage."""

    _ALLOC = ("empty", "zeros", "ones", "full", "new_", "clone", "arange", "cat", "stack",
              "_to_copy", "copy", "randn", "rand", "scalar_tensor", "tensor")

    def __init__(self):
        super().__init__()
        self.allocs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if name.split(".")[0].startswith(self._ALLOC) and not name.endswith("_"):
            self.allocs.append(name)
        return func(*args, **(kwargs or {}))


def test_layer_call_only_launches(monkeypatch):
    """After the first step binds the layers, a step plans each layer group once (in
    init_forward_metadata) and every layer call does no selection, no validation beyond O(1)
    checks and allocates only its output."""
    from aiter_attn import backend as backend_mod
    from aiter_attn import validation

    cfg, layers, sc, reg, be = _setup()
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    for layer in layers:  # first step: binds the layers' group (one selection)
        be.forward(*sc.step_inputs(layer), layer, batch)
    sc.commit_step()

    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    SpyKernel.events.clear()
    be.init_forward_metadata(batch)
    assert [e[0] for e in SpyKernel.events] == ["plan"]  # one group, planned once per step
    plan_events = list(SpyKernel.events)
    inputs = [sc.step_inputs(layer) for layer in layers]

    def no_select(*a, **k):
        raise AssertionError("a layer call selected a kernel")

    def no_validation(*a, **k):
        raise AssertionError("a layer call ran check_tensor")

    monkeypatch.setattr(reg, "select", no_select)
    monkeypatch.setattr(reg, "bound", no_select)
    monkeypatch.setattr(validation, "check_tensor", no_validation)
    monkeypatch.setattr(backend_mod, "check_tensor", no_validation)
    SpyKernel.events.clear()
    for layer, (q, k, v) in zip(layers, inputs):
        with _Allocations() as spy:
            out = be.forward(q, k, v, layer, batch)
        # the output, nothing else
        assert spy.allocs in (["empty.memory_format"], ["new_empty.default"]), spy.allocs
        assert out.shape == (batch.num_tokens, layer.num_q_heads * layer.head_dim)
    runs = SpyKernel.events
    assert [e[0] for e in runs] == ["run"] * len(layers)
    assert len({id(e[1]) for e in runs}) == 1  # every layer ran the step's one plan
    assert plan_events  # planned before the layers, not in them
    assert [e[2].scale for e in runs] == [layer.scaling for layer in layers]


def test_layer_params_frozen_and_normalised():
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16,
                      sliding_window=8, logit_cap=30, k_scale=0.5)
    p = LayerParams.from_spec(layer, torch.device("cpu"), fp8=True)  # scales: fp8 only
    assert p.window == (7, 0) and p.softcap == 30.0 and p.causal
    assert p.has_scales and p.k_scale_t.dtype == torch.float32 and float(p.k_scale_t) == 0.5
    with pytest.raises(AttributeError):
        p.scale = 2.0
    plain = LayerParams.from_spec(LayerSpec(layer_id=1, num_q_heads=4, num_kv_heads=2,
                                            head_dim=16), torch.device("cpu"))
    assert not plain.has_scales and plain.k_scale_t is None


def test_registered_function_is_adapted_to_plan_run():
    """A plugin's plain function in the keyword convention becomes a FunctionKernel."""
    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)
    impl = reg.implementations("paged_attention")[0]
    kernel = impl.bind(None)
    assert hasattr(kernel, "plan") and hasattr(kernel, "run")
    assert kernel.name == "reference" and kernel.cg_support == CGSupport.NEVER


def test_kernel_class_only_for_attention_ops():
    reg = KernelRegistry()
    with pytest.raises(TypeError, match="kernel object"):
        reg.register("write_kv", "spy", SpyKernel, Capabilities(cg_support=CGSupport.ALWAYS))


def test_graph_support_is_min_of_pair_and_kernel():
    _, layers, sc, _, be = _setup(n_layers=1, cg=CGSupport.NEVER)
    assert be.graph_support(ForwardMode.DECODE) == CGSupport.ALWAYS  # nothing bound yet
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    be.forward(*sc.step_inputs(layers[0]), layers[0], batch)
    assert be.graph_support(ForwardMode.DECODE) == CGSupport.NEVER


def test_capturing_an_uncapturable_kernel_names_it():
    """check_capturable (run by capture after the warm-up binds the layers) names the kernel
    and the setting to change."""
    from aiter_attn.graph.sources import _StrategyPlanner

    _, layers, sc, _, be = _setup(n_layers=1, cg=CGSupport.NEVER)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    be.forward(*sc.step_inputs(layers[0]), layers[0], batch)
    planner = _StrategyPlanner(be, ForwardMode.DECODE)
    with pytest.raises(ValueError, match=r"kernel 'spy'.*kernel_backend"):
        planner.check_capturable()


def test_ops_selects_once_per_cheap_key(monkeypatch):
    """ops.paged_attention selects on the first call of a shape and reuses the bound kernel."""
    from aiter_attn import ops
    from aiter_attn.plugins import kernel_registry

    reg = kernel_registry()
    calls = []
    real = reg.select

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(reg, "select", counting)
    monkeypatch.setattr(reg, "_bound", {})
    q = torch.randn(2, 4, 16)
    kc = torch.randn(3, 4, 2, 16)
    args = dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                seqused_k=torch.tensor([3, 5], dtype=torch.int32),
                block_table=torch.tensor([[1, 0], [2, 1]], dtype=torch.int32),
                softmax_scale=0.25)
    a = ops.paged_attention(q, kc, kc, **args)
    b = ops.paged_attention(q, kc, kc, **args)
    assert len(calls) == 1
    assert torch.equal(a, b)


def test_forward_step_memo_follows_the_metadata():
    """forward's per-step memo (token count, batch size, executor) is renewed with every
    planned metadata: a q sized for the previous step is refused."""
    _, layers, sc, _, be = _setup(n_layers=1)
    layer = layers[0]
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    q_old, k, v = sc.step_inputs(layer)
    be.forward(q_old, k, v, layer, batch)
    sc.commit_step()
    batch = sc.next_batch(ForwardMode.EXTEND, [3, 2])
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layer)
    assert be.forward(q, k, v, layer, batch).shape == (5, layer.num_q_heads * layer.head_dim)
    with pytest.raises(ValueError, match="expected 5 tokens"):
        be.forward(q_old, None, None, layer, batch, save_kv_cache=False)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        be.forward(q, k, v, layer, sc.next_batch(ForwardMode.EXTEND, [3, 2]))
