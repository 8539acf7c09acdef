"""``docs/plugins.md``'s minimal plugin runs as printed (issue 13, item 6): the page's code
block is executed as a module, loaded through the plugin machinery next to the core
built-ins, selected by name, and its kernel object serves an extend and a decode step of an
``AttentionBackend`` (window, soft-cap, sinks, GQA 5:1, head dim 80, page 48, block-permuted
pages with the null page 0) within float32 error of the oracle, and the functional
convention (plan + run in one call) too."""

import pathlib
import re
import types

import pytest
import torch

from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
from aiter_attn import plugins
from aiter_attn.kernels.registry import KernelRequest
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def _doc_plugin() -> types.ModuleType:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    source = [b for b in blocks if "class MyKernel" in b]
    assert len(source) == 1, "docs/plugins.md has no (or more than one) minimal plugin block"
    module = types.ModuleType("docs_minimal_plugin")
    exec(compile(source[0], f"{DOC}:minimal plugin", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def registries():
    pm = plugins.new_plugin_manager()
    plugins.load_plugins(pm, allow=set(), entry_points=False)  # core built-ins only
    plugins.register_plugin(pm, "mine", _doc_plugin())
    return plugins.build_registries(pm, requested={"mine"})


def test_docs_minimal_plugin_serves_a_backend(registries):
    kernels, strategies = registries
    cfg = BackendConfig(page_size=48, max_batch_size=4, max_context_len=512,
                        dtype=torch.float32, kernel_backend="mine")
    g = torch.Generator().manual_seed(3)
    layers = [LayerSpec(layer_id=0, num_q_heads=10, num_kv_heads=2, head_dim=80,
                        sliding_window=70, logit_cap=30.0,
                        sinks=torch.randn(10, generator=g)),
              LayerSpec(layer_id=1, num_q_heads=10, num_kv_heads=2, head_dim=80)]
    sc = PagedScenario.make(cfg, layers, [0, 61, 130], seed=5)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool, kernels=kernels,
                          strategies=strategies)
    for mode, new in ((ForwardMode.EXTEND, [7, 1, 50]), (ForwardMode.DECODE, [1, 1, 1])):
        batch = sc.next_batch(mode, new)
        be.init_forward_metadata(batch)
        for layer in layers:
            q, k, v = sc.step_inputs(layer)
            out = be.forward(q, k, v, layer, batch)
            assert_close_rel(out, sc.expected(layer, q), 2e-5, f"{mode.name} layer {layer.layer_id}")
        sc.commit_step()
        _, executor = be.strategies_for(mode)
        assert {g.kernel.name for g in executor.groups.values()} == {"mine"}


def test_docs_minimal_plugin_functional_call(registries):
    """``backend="mine"``'s functional convenience: plan and run in one keyword call."""
    kernels, _ = registries
    from aiter_attn.kernels.reference import paged_attention_reference

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 10, 80, generator=g)
    kc = torch.randn(5, 48, 2, 80, generator=g)
    vc = torch.randn(5, 48, 2, 80, generator=g)
    kw = dict(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
              seqused_k=torch.tensor([40, 90], dtype=torch.int32),
              block_table=torch.tensor([[3, 0], [4, 1]], dtype=torch.int32),
              softmax_scale=0.1, softcap=20.0, window_size=(30, 0))
    req = KernelRequest(op="paged_attention", device="cpu", dtype=q.dtype, kv_dtype=kc.dtype,
                        head_dim=80, v_head_dim=80, page_size=48, features={"softcap", "window"})
    impl = kernels.select(req, backend="mine").impl
    assert impl.name == "mine" and impl.source == "mine"
    got = impl.fn(q, kc, vc, torch.empty_like(q), **kw)
    want = paged_attention_reference(q, kc, vc, torch.empty_like(q), **kw)
    assert torch.equal(got, want)
