"""Which MLA steps aiter's kernels serve, bound to the ``amd-aiter`` wheel's own dispatch.

``mla_decode_fwd`` (``aiter/mla.py``) serves, non-persistent, only the head counts of
``get_meta_param``'s ``get_mgc`` table (16, 128; it asserts otherwise) and, persistent, 16
heads, 128 heads on an fp8 cache, or 32…512 heads simulated as 16 for single-token decode
(``assert False`` otherwise). What reaches ``asm_mla.cu`` must then have a kernel: with
16-bit queries (the plugin passes the layer's queries unquantised) over an fp8 cache only the
persistent 16-head ``mla_a16w8_qh16_*_ps`` exists, so 128 heads on an fp8 cache would hit
``TORCH_CHECK(impl_ptr != nullptr)``. ``mla_prefill_fwd``'s kernel (``mla_prefill_asm_fwd``)
takes 16 or 128 query heads per latent head and bf16 queries and cache only
(``mla_pfl_bf16_a16w16_*``; it never checks the cache's dtype, so fp8 bytes would be read as
bf16). A step outside those is planned and run by the next registered
``mla_paged_attention`` kernel instead of reaching an aiter assertion (or garbage) on the GPU.
"""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest
import torch

import aiter_attn.kernels.aiter as A
from aiter_attn.kernels import aiter_marshal as M
from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params, mla_request
from aiter_attn.kernels.reference import mla_paged_attention_reference

from .test_aiter_contract import install_fake_aiter, read_signatures, wheel  # noqa: F401

FP8 = torch.float8_e4m3fnuz
_ASM_MLA = "aiter_meta/csrc/py_itfs_cu/asm_mla.cu"


def _asm_body(wheel, fn: str) -> str:
    """The source of the C++ function ``fn`` of ``asm_mla.cu`` (up to the next one)."""
    src = wheel.read(_ASM_MLA)
    assert src, f"{_ASM_MLA} is missing from the wheel"
    start = src.index(f"void {fn}(")
    end = src.find("\nvoid ", start + 1)
    return src[start:] if end == -1 else src[start:end]


def _kernels(text: str) -> set:
    """The code objects (``/mla/<name>.co``) an ``asm_mla.cu`` excerpt loads."""
    return set(re.findall(r'"/mla/(\w+)\.co"', text))


def _heads(kernels) -> set:
    """Query heads per latent head in kernel names (``qh16``, ``mqa128``)."""
    return {int(n) for k in kernels for n in re.findall(r"(?:qh|mqa)(\d+)", k)}


def _shipped(wheel, prefix: str) -> set:
    """Names of the MLA code objects the wheel ships (every arch) starting with ``prefix``."""
    if wheel._zip is not None:
        paths = wheel._zip.namelist()
    else:
        paths = [str(f.relative_to(wheel.path)) for f in wheel.path.rglob("*.co")]
    return {Path(n).stem for n in paths
            if "/hsa/" in n and "/mla/" in n and n.endswith(".co")
            and Path(n).name.startswith(prefix)}


def _decode_branches(wheel) -> dict:
    """``mla_decode_stage1_asm_fwd``'s kernels by ``(q, kv)`` dtype branch:
    ``{("bf16", "bf16"): names, ("bf16", "fp8"): names, ("fp8", "fp8"): names}``."""
    body = _asm_body(wheel, "mla_decode_stage1_asm_fwd")
    q_bf16 = body.index("if(Q.dtype() == at::ScalarType::BFloat16)")
    kv_bf16 = body.index("if(KV.dtype() == at::ScalarType::BFloat16)", q_bf16)
    kv_fp8 = body.index("if(KV.dtype() == at::ScalarType::Float8_e4m3fnuz", kv_bf16)
    q_fp8 = body.index("if(Q.dtype() == at::ScalarType::Float8_e4m3fnuz", kv_fp8)
    return {("bf16", "bf16"): _kernels(body[kv_bf16:kv_fp8]),
            ("bf16", "fp8"): _kernels(body[kv_fp8:q_fp8]),
            ("fp8", "fp8"): _kernels(body[q_fp8:])}


def wheel_asm_decode_serves(wheel, q: str, kv: str, gqa: int, persistent: bool) -> bool:
    """Whether ``asm_mla.cu``'s decode dispatch has a kernel for queries of dtype ``q`` over
    a ``kv`` cache with ``gqa`` heads per latent head (persistent or not): one of the branch's
    kernels names that head count, and a branch whose kernels are all ``_ps`` takes only the
    persistent mode."""
    names = _decode_branches(wheel)[(q, kv)]
    with_heads = {k for k in names if gqa in _heads({k})}
    if not persistent:
        with_heads = {k for k in with_heads if not k.endswith("_ps")}
    return bool(with_heads)


def _mla_decode_def(wheel):
    src = wheel.module_source("aiter.mla")
    tree = ast.parse(src)
    fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    return fns["mla_decode_fwd"], fns["get_meta_param"]


def wheel_mla_decode_accepts(wheel, heads, kv_dtype, max_q, persistent) -> tuple:
    """Evaluate the wheel's own head/query-length dispatch of ``mla_decode_fwd``:
    ``(accepted, heads the asm kernel is launched with)`` (16 where ``mla.py`` simulates
    32…512 heads as 16)."""
    decode, meta = _mla_decode_def(wheel)
    if not persistent:
        mgc = next(n.value for n in ast.walk(meta) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None) == "get_mgc")
        return heads in {k.value for k in mgc.keys}, heads
    ifs = [n for n in ast.walk(decode) if isinstance(n, ast.If)
           and "nhead == 16 or" in ast.unparse(n.test)]
    assert ifs, "mla_decode_fwd's persistent head dispatch was not found"
    ns = dict(nhead=heads, max_seqlen_q=max_q, persistent_mode=True,
              kv_buffer=types.SimpleNamespace(dtype=kv_dtype),
              dtypes=types.SimpleNamespace(fp8=FP8))
    node = ifs[0]
    while isinstance(node, ast.If):
        if eval(compile(ast.Expression(node.test), "mla.py", "eval"), ns):
            body = ast.unparse(ast.Module(body=node.body, type_ignores=[]))
            simulated = "nhead = 16" in body
            return (not any(isinstance(s, ast.Assert) for s in node.body),
                    16 if simulated else heads)
        node = node.orelse[0] if node.orelse else None
    return False, heads


def wheel_mla_prefill_heads(wheel) -> set:
    src = wheel.read("aiter_meta/csrc/py_itfs_cu/asm_mla.cu")
    assert src, "asm_mla.cu is missing from the wheel"
    body = src[src.index("void mla_prefill_asm_fwd("):]
    m = re.search(r"TORCH_CHECK\(\s*(gqa_ratio\s*==.*?),\s*__func__", body, re.S)
    assert m, "mla_prefill_asm_fwd's gqa_ratio check was not found"
    return {int(n) for n in re.findall(r"gqa_ratio\s*==\s*(\d+)", m.group(1))}


def test_prefill_heads_are_the_wheels(wheel):  # noqa: F811
    assert M.MLA_PREFILL_HEADS == wheel_mla_prefill_heads(wheel)


def test_prefill_kernels_read_a_bf16_cache_only(wheel):  # noqa: F811
    """mla_prefill_asm_fwd has bf16 kernels only (``mla_pfl_bf16_a16w16_*``: 16-bit queries
    and cache), branches on the query's dtype alone and never checks the cache's: an fp8
    cache would be read as bf16. Our prefill dtypes are those."""
    body = _asm_body(wheel, "mla_prefill_asm_fwd")
    kernels = _kernels(body)
    assert kernels and all("_bf16_a16w16_" in k for k in kernels), kernels
    assert set(re.findall(r"Q\.dtype\(\)\s*==\s*at::ScalarType::(\w+)", body)) == {"BFloat16"}
    assert "KV.dtype()" not in body and "KV.scalar_type()" not in body
    shipped = _shipped(wheel, "mla_pfl_")
    assert shipped and all("_bf16_a16w16_" in k for k in shipped), shipped
    assert not any("fp8" in k or "a8" in k or "w8" in k for k in shipped | kernels)
    assert M.MLA_PREFILL_DTYPES == frozenset({torch.bfloat16})


def test_decode_kernels_for_16bit_queries_over_fp8_are_the_wheels(wheel):  # noqa: F811
    """With bf16 queries over an fp8 cache asm_mla.cu has only persistent kernels of
    :data:`M.MLA_DECODE_A16W8_HEADS` heads (``mla_a16w8_qh16_*_ps``; every arch ships the
    same); 128 heads need fp8 queries (``mla_a8w8_qh128_*``), which the plugin does not pass."""
    branches = _decode_branches(wheel)
    a16w8 = branches[("bf16", "fp8")]
    assert a16w8 and all(k.endswith("_ps") for k in a16w8), a16w8
    assert _heads(a16w8) == M.MLA_DECODE_A16W8_HEADS
    assert _heads(_shipped(wheel, "mla_a16w8_")) == M.MLA_DECODE_A16W8_HEADS
    assert 128 in _heads(branches[("fp8", "fp8")])  # served, but only for fp8 queries


def test_mla_kernels_take_bf16_or_fp8_only(wheel):  # noqa: F811
    """asm_mla.cu's decode and prefill branch on bf16 and fp8 queries and caches only (no
    fp16 kernel: impl_ptr stays null, or prefill reads the cache as bf16); the plugin passes
    the layer's queries, so it declares bf16 queries and bf16 or fp8 caches."""
    found = {}
    for fn in ("mla_decode_stage1_asm_fwd", "mla_prefill_asm_fwd"):
        body = _asm_body(wheel, fn)
        for t in ("Q", "KV"):
            found[fn, t] = set(re.findall(r"\b%s\.dtype\(\)\s*==\s*at::ScalarType::(\w+)" % t,
                                          body))
            assert "Half" not in found[fn, t], (fn, t, found[fn, t])
    assert "BFloat16" in found["mla_decode_stage1_asm_fwd", "Q"]
    assert found["mla_decode_stage1_asm_fwd", "KV"] == {"BFloat16", "Float8_e4m3fnuz",
                                                        "Float8_e4m3fn"}
    caps = A.capabilities()["mla_paged_attention"]
    assert caps.dtypes == frozenset({torch.bfloat16})
    assert torch.float16 not in caps.kv_dtypes and torch.bfloat16 in caps.kv_dtypes


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("max_q", [1, 2, 3, 4])
def test_decode_reason_agrees_with_the_wheel(wheel, kv_dtype, max_q):  # noqa: F811
    """For every head count we take, our verdict on mla_decode_fwd with bf16 queries equals
    the wheel's: its mla.py dispatch accepts the step and asm_mla.cu has a kernel for what
    mla.py launches."""
    kv = "fp8" if kv_dtype == FP8 else "bf16"
    for heads in (4, 8, 16, 32, 48, 64, 96, 112, 128):
        plan = M.mla_decode_plan(heads, kv_dtype, max_q)
        accepted, gqa = wheel_mla_decode_accepts(wheel, plan.padded_heads, kv_dtype, max_q,
                                                 plan.persistent)
        theirs = accepted and wheel_asm_decode_serves(wheel, "bf16", kv, gqa, plan.persistent)
        why = M.mla_decode_reason(plan, kv_dtype, max_q, q_dtype=torch.bfloat16)
        assert (why is None) == theirs, (heads, kv_dtype, max_q, plan, why)
        if why is not None:
            assert f"{plan.padded_heads} heads" in why


def test_decode_reason_names_the_fp8_query_limit():
    plan = M.mla_decode_plan(128, FP8, 1)
    why = M.mla_decode_reason(plan, FP8, 1, q_dtype=torch.bfloat16)
    assert "128 heads" in why and "torch.bfloat16 queries" in why and "fp8 cache" in why
    assert "[16]" in why


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


@pytest.mark.parametrize("heads,q_len,kv_dtype,aiter_fn", [
    pytest.param(32, 2, torch.bfloat16, "mla_decode_fwd", id="h32-verify"),
    pytest.param(64, 4, torch.bfloat16, "mla_decode_fwd", id="h64-verify"),
    pytest.param(4, 9, torch.bfloat16, "mla_prefill_fwd", id="h4-extend"),
    pytest.param(32, 9, torch.bfloat16, "mla_prefill_fwd", id="h32-extend"),
    pytest.param(128, 1, FP8, "mla_decode_fwd", id="h128-fp8-decode"),
    pytest.param(128, 2, FP8, "mla_decode_fwd", id="h128-fp8-verify"),
    pytest.param(16, 9, FP8, "mla_prefill_fwd", id="h16-fp8-extend"),
    pytest.param(128, 9, FP8, "mla_prefill_fwd", id="h128-fp8-extend"),
])
def test_unserved_steps_go_to_the_next_kernel(wheel, monkeypatch, heads, q_len,  # noqa: F811
                                              kv_dtype, aiter_fn):
    """The step is planned and run by the next registered kernel: aiter's function is never
    called, and the output is the reference's."""
    calls = install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    q, kv, md, kw = _case(heads, q_len, kv_dtype=kv_dtype)
    fp8 = kv_dtype == FP8
    if fp8:
        kw["kv_scale"] = torch.tensor(0.5)
    kernel = A.AiterMLA(mla_request(q, kv, 512))
    plan = kernel.plan(md)
    assert plan.fallback is not None and plan.route == "fallback"
    params = mla_layer_params(scale=kw["softmax_scale"], device=q.device, kv_lora_rank=512,
                              num_q_heads=heads, head_dim=576, kv_scale=kw.get("kv_scale"),
                              fp8=fp8)
    out = torch.empty(q.shape[0], heads, 512, dtype=torch.bfloat16)
    kernel.run(q, (kv,), plan, params, out)
    assert aiter_fn not in {name for name, _ in calls}
    want = mla_paged_attention_reference(q, kv, torch.empty_like(out), **kw)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("heads,q_len,kv_dtype,route", [
    pytest.param(16, 2, torch.bfloat16, "mla_decode_fwd", id="h16-verify"),
    pytest.param(32, 1, torch.bfloat16, "mla_decode_fwd", id="h32-decode-simulated"),
    pytest.param(8, 4, torch.bfloat16, "mla_decode_fwd", id="h8-verify-padded"),
    pytest.param(16, 9, torch.bfloat16, "mla_prefill_fwd", id="h16-extend"),
    pytest.param(128, 9, torch.bfloat16, "mla_prefill_fwd", id="h128-extend"),
    pytest.param(16, 4, FP8, "mla_decode_fwd", id="h16-fp8-verify"),
    pytest.param(4, 1, FP8, "mla_decode_fwd", id="h4-fp8-decode-padded"),
    pytest.param(64, 1, FP8, "mla_decode_fwd", id="h64-fp8-decode-simulated"),
])
def test_served_steps_stay_on_aiter(wheel, monkeypatch, heads, q_len, kv_dtype,  # noqa: F811
                                    route):
    install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    q, kv, md, _ = _case(heads, q_len, kv_dtype=kv_dtype)
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
