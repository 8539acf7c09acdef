"""A plan is for one step: running a plain function's kernel (``FunctionKernel`` /
``MLAFunctionKernel``, how a plugin's function is adapted) with a ``q`` of another step
raises the O(1) token-count error every kernel object raises, before the function is called
(a function does not check it: it would index past ``q`` or leave rows of ``out`` unwritten)."""

import pytest
import torch

from aiter_attn.kernels.base import LayerParams, _adhoc_metadata, mla_layer_params
from aiter_attn.kernels.registry import Capabilities, KernelRegistry, KernelRequest
from aiter_attn.types import CGSupport

CAPS = Capabilities(cg_support=CGSupport.NEVER)


def _spy(calls):
    def fn(q, *args, **kwargs):
        calls.append(q.shape[0])
        out = args[-1]
        return out.zero_()

    return fn


def _indices():
    return (torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([5, 7], dtype=torch.int32),
            torch.tensor([[4, 2], [1, 5]], dtype=torch.int32))


def test_function_kernel_refuses_a_plan_of_another_step():
    calls = []
    reg = KernelRegistry()
    reg.register("paged_attention", "fn", _spy(calls), CAPS)
    req = KernelRequest(op="paged_attention", device="cpu", dtype=torch.float32, head_dim=16,
                        v_head_dim=16, page_size=4)
    kernel = reg.select(req).bind(req)
    kc, vc = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
    cu, seqused_k, table = _indices()
    plan = kernel.plan(_adhoc_metadata(torch.randn(3, 4, 16), kc, cu, seqused_k, table, None,
                                       None, None, None, "paged_attention"))
    params = LayerParams.create(scale=0.25, device="cpu")
    kernel.run(torch.randn(3, 4, 16), (kc, vc), plan, params, torch.empty(3, 4, 16))
    assert calls == [3]
    with pytest.raises(ValueError, match="fn: q has 5 tokens but the plan was made for 3; plan "
                                         "this step's metadata first"):
        kernel.run(torch.randn(5, 4, 16), (kc, vc), plan, params, torch.empty(5, 4, 16))
    assert calls == [3]


def test_mla_function_kernel_refuses_a_plan_of_another_step():
    calls = []

    def mla(q, kv_cache, out, **kwargs):
        calls.append(q.shape[0])
        return out.zero_()

    reg = KernelRegistry()
    reg.register("mla_paged_attention", "fn", mla, CAPS)
    req = KernelRequest(op="mla_paged_attention", device="cpu", dtype=torch.float32,
                        head_dim=24, v_head_dim=16, page_size=4, extra=(("heads", 4),))
    kernel = reg.select(req).bind(req)
    kv = torch.randn(6, 4, 1, 24)
    cu, seqused_k, table = _indices()
    plan = kernel.plan(_adhoc_metadata(torch.randn(3, 4, 24), kv, cu, seqused_k, table, None,
                                       None, None, None, "mla_paged_attention"))
    params = mla_layer_params(scale=0.25, device="cpu", kv_lora_rank=16, num_q_heads=4,
                              head_dim=24)
    kernel.run(torch.randn(3, 4, 24), (kv,), plan, params, torch.empty(3, 4, 16))
    with pytest.raises(ValueError, match="q has 2 tokens but the plan was made for 3"):
        kernel.run(torch.randn(2, 4, 24), (kv,), plan, params, torch.empty(2, 4, 16))
    assert calls == [3]
