"""Which MLA steps aiter's kernels serve, bound to the ``amd-aiter`` wheel's own dispatch.

``mla_decode_fwd`` (``aiter/mla.py``) serves, non-persistent, only the head counts of
``get_meta_param``'s ``get_mgc`` table (16, 128; it asserts otherwise) and, persistent, 16
heads, 128 heads on an fp8 cache, or 32…512 heads simulated as 16 for single-token decode
(``assert False`` otherwise). ``mla_prefill_fwd``'s kernel (``asm_mla.cu``,
``mla_prefill_asm_fwd``) takes 16 or 128 query heads per latent head only. A step outside
those is planned and run by the next registered ``mla_paged_attention`` kernel instead of
reaching an aiter assertion on the GPU.
"""

from __future__ import annotations

import ast
import re
import types

import pytest
import torch

import aiter_attn.kernels.aiter as A
from aiter_attn.kernels import aiter_marshal as M
from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params, mla_request
from aiter_attn.kernels.reference import mla_paged_attention_reference

from .test_aiter_contract import install_fake_aiter, read_signatures, wheel  # noqa: F401

FP8 = torch.float8_e4m3fnuz


def _mla_decode_def(wheel):
    src = wheel.module_source("aiter.mla")
    tree = ast.parse(src)
    fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    return fns["mla_decode_fwd"], fns["get_meta_param"]


def wheel_mla_decode_accepts(wheel, heads, kv_dtype, max_q, persistent) -> bool:
    """Evaluate the wheel's own head/query-length dispatch of ``mla_decode_fwd``."""
    decode, meta = _mla_decode_def(wheel)
    if not persistent:
        mgc = next(n.value for n in ast.walk(meta) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None) == "get_mgc")
        return heads in {k.value for k in mgc.keys}
    ifs = [n for n in ast.walk(decode) if isinstance(n, ast.If)
           and "nhead == 16 or" in ast.unparse(n.test)]
    assert ifs, "mla_decode_fwd's persistent head dispatch was not found"
    ns = dict(nhead=heads, max_seqlen_q=max_q, persistent_mode=True,
              kv_buffer=types.SimpleNamespace(dtype=kv_dtype),
              dtypes=types.SimpleNamespace(fp8=FP8))
    node = ifs[0]
    while isinstance(node, ast.If):
        if eval(compile(ast.Expression(node.test), "mla.py", "eval"), ns):
            return not any(isinstance(s, ast.Assert) for s in node.body)
        node = node.orelse[0] if node.orelse else None
    return False


def wheel_mla_prefill_heads(wheel) -> set:
    src = wheel.read("aiter_meta/csrc/py_itfs_cu/asm_mla.cu")
    assert src, "asm_mla.cu is missing from the wheel"
    body = src[src.index("void mla_prefill_asm_fwd("):]
    m = re.search(r"TORCH_CHECK\(\s*(gqa_ratio\s*==.*?),\s*__func__", body, re.S)
    assert m, "mla_prefill_asm_fwd's gqa_ratio check was not found"
    return {int(n) for n in re.findall(r"gqa_ratio\s*==\s*(\d+)", m.group(1))}


def test_prefill_heads_are_the_wheels(wheel):  # noqa: F811
    assert M.MLA_PREFILL_HEADS == wheel_mla_prefill_heads(wheel)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("max_q", [1, 2, 3, 4])
def test_decode_reason_agrees_with_the_wheel(wheel, kv_dtype, max_q):  # noqa: F811
    """For every head count we take, our verdict on mla_decode_fwd equals the wheel's."""
    for heads in (4, 8, 16, 32, 48, 64, 96, 112, 128):
        plan = M.mla_decode_plan(heads, kv_dtype, max_q)
        theirs = wheel_mla_decode_accepts(wheel, plan.padded_heads, kv_dtype, max_q,
                                          plan.persistent)
        why = M.mla_decode_reason(plan, kv_dtype, max_q)
        assert (why is None) == theirs, (heads, kv_dtype, max_q, plan, why)
        if why is not None:
            assert f"{plan.padded_heads} heads" in why


def _case(heads, q_len, kv_lens=(9, 30), kv_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(5)
    bs, ps = len(kv_lens), 16
    width = -(-max(kv_lens) // ps)
    kv = (torch.randn(bs * width + 1, ps, 1, 576, generator=g) * 0.5).to(kv_dtype)
    q = (torch.randn(bs * q_len, heads, 576, generator=g) * 0.5).bfloat16()
    bt = (torch.randperm(bs * width, generator=g) + 1).view(bs, width).to(torch.int32)
    cu = torch.arange(0, bs * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    md = _adhoc_metadata(q, kv, cu, lens, bt, None, None, q_len, width * ps,
                         "mla_paged_attention")
    kw = dict(kv_lora_rank=512, cu_seqlens_q=cu, seqused_k=lens, block_table=bt,
              softmax_scale=0.05)
    return q, kv, md, kw


@pytest.mark.parametrize("heads,q_len,aiter_fn", [
    pytest.param(32, 2, "mla_decode_fwd", id="h32-verify"),
    pytest.param(64, 4, "mla_decode_fwd", id="h64-verify"),
    pytest.param(4, 9, "mla_prefill_fwd", id="h4-extend"),
    pytest.param(32, 9, "mla_prefill_fwd", id="h32-extend"),
])
def test_unserved_steps_go_to_the_next_kernel(wheel, monkeypatch, heads, q_len,  # noqa: F811
                                              aiter_fn):
    """The step is planned and run by the next registered kernel: aiter's function is never
    called, and the output is the reference's."""
    calls = install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    q, kv, md, kw = _case(heads, q_len)
    kernel = A.AiterMLA(mla_request(q, kv, 512))
    plan = kernel.plan(md)
    assert plan.fallback is not None and plan.route == "fallback"
    params = mla_layer_params(scale=kw["softmax_scale"], device=q.device, kv_lora_rank=512,
                              num_q_heads=heads, head_dim=576)
    out = torch.empty(q.shape[0], heads, 512, dtype=torch.bfloat16)
    kernel.run(q, (kv,), plan, params, out)
    assert aiter_fn not in {name for name, _ in calls}
    want = mla_paged_attention_reference(q, kv, torch.empty_like(out), **kw)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("heads,q_len,route", [
    pytest.param(16, 2, "mla_decode_fwd", id="h16-verify"),
    pytest.param(32, 1, "mla_decode_fwd", id="h32-decode-simulated"),
    pytest.param(8, 4, "mla_decode_fwd", id="h8-verify-padded"),
    pytest.param(16, 9, "mla_prefill_fwd", id="h16-extend"),
])
def test_served_steps_stay_on_aiter(wheel, monkeypatch, heads, q_len, route):  # noqa: F811
    install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    q, kv, md, _ = _case(heads, q_len)
    plan = A.AiterMLA(mla_request(q, kv, 512)).plan(md)
    assert plan.route == route and plan.fallback is None


def test_graph_buffers_include_the_next_kernels(wheel, monkeypatch):  # noqa: F811
    """A captured verify cell that aiter cannot serve (32 heads, 2 tokens per request)
    reserves the next kernel's static buffers."""
    from aiter_attn.graph.buffers import GraphLimits
    from aiter_attn.types import ForwardMode

    install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    q, kv, md, _ = _case(32, 2)
    kernel = A.AiterMLA(mla_request(q, kv, 512))
    limits = GraphLimits(mode=ForwardMode.TARGET_VERIFY, max_bs=4, q_len=2, max_num_tokens=8,
                         max_seq_len=64)
    spec = kernel.buffer_spec(limits)
    nxt = kernel._fallback("test")
    assert set(nxt.buffer_spec(limits).buffers) <= set(spec.buffers)
