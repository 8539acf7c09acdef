"""``ops.paged_attention``'s call memo: a repeated call (same shapes, dtypes, devices,
strides, index tensors and scalars) skips validation, selection and planning and only
allocates its output and launches; anything else is validated again, so bad input still
gets its error before a kernel runs; index *values* are read live by the kernel."""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops
from aiter_attn.kernels.reference import paged_attention_reference
from aiter_attn.plugins import kernel_registry

from ._triton_util import requires_triton

BACKENDS = ["reference", pytest.param("triton", marks=requires_triton)]


def _case(seed=0, bs=2, hq=4, hkv=2, d=16, page=4, keys=(5, 9)):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-k // page) for k in keys]
    width = max(pages)
    kc = torch.randn(sum(pages) + 1, page, hkv, d, generator=g)
    vc = torch.randn(sum(pages) + 1, page, hkv, d, generator=g)
    bt = torch.zeros(bs, width, dtype=torch.int32)
    perm = (torch.randperm(sum(pages), generator=g) + 1).to(torch.int32)
    start = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[start:start + n]
        start += n
    q = torch.randn(bs, hq, d, generator=g)
    kw = dict(cu_seqlens_q=torch.arange(bs + 1, dtype=torch.int32),
              seqused_k=torch.tensor(keys, dtype=torch.int32), block_table=bt,
              softmax_scale=d ** -0.5, max_seqlen_q=1, max_seqlen_k=max(keys))
    return q, kc, vc, kw


def _expected(q, kc, vc, kw):
    out = torch.empty_like(q)
    args = {k: v for k, v in kw.items() if k != "backend"}
    return paged_attention_reference(q, kc, vc, out, **args)


@pytest.fixture
def reg(monkeypatch):
    reg = kernel_registry()
    monkeypatch.setattr(reg, "calls", {})
    return reg


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_call_only_allocates_and_launches(backend, reg, monkeypatch):
    from aiter_attn import validation

    q, kc, vc, kw = _case()
    kw["backend"] = backend
    first = ops.paged_attention(q, kc, vc, **kw)
    assert len(reg.calls) == 1
    kernel = next(iter(reg.calls.values()))[0]

    def boom(*a, **k):
        raise AssertionError("a memoised call validated, selected or planned")

    monkeypatch.setattr(ops, "check_tensor", boom)
    monkeypatch.setattr(ops, "_validate_paged", boom)
    monkeypatch.setattr(validation, "check_tensor", boom)
    monkeypatch.setattr(reg, "select", boom)
    monkeypatch.setattr(reg, "bound", boom)
    monkeypatch.setattr(kernel, "plan", boom)
    again = ops.paged_attention(q.clone(), kc, vc, **kw)  # a new q of the same shape
    torch.testing.assert_close(again, first)
    torch.testing.assert_close(first, _expected(q, kc, vc, kw), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_changed_inputs_are_validated_again(backend, reg):
    q, kc, vc, kw = _case()
    kw["backend"] = backend
    ops.paged_attention(q, kc, vc, **kw)
    with pytest.raises(ValueError, match="num_q_heads"):  # 3 heads: not a GQA multiple of 2
        ops.paged_attention(q[:, :3].contiguous(), kc, vc, **kw)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        ops.paged_attention(q, kc, vc, **{**kw, "cu_seqlens_q": kw["cu_seqlens_q"].float()})
    with pytest.raises(ValueError, match="softmax_scale"):
        ops.paged_attention(q, kc, vc, **{**kw, "softmax_scale": float("nan")})
    with pytest.raises(ValueError, match="softcap"):
        ops.paged_attention(q, kc, vc, **{**kw, "softcap": -1.0})
    with pytest.raises(ValueError, match="window_size"):
        ops.paged_attention(q, kc, vc, **{**kw, "window_size": (7.0, 0)})
    with pytest.raises(ValueError, match="block_table"):
        ops.paged_attention(q, kc, vc, **{**kw, "block_table": kw["block_table"][:1]})
    with pytest.raises(ValueError, match="on meta"):
        ops.paged_attention(q, kc, vc.to("meta"), **kw)
    with pytest.raises(ValueError, match="out"):
        ops.paged_attention(q, kc, vc, out=torch.empty(2, 4, 8), **kw)
    assert len(reg.calls) == 1  # none of those was memoised


@pytest.mark.parametrize("backend", BACKENDS)
def test_memoised_call_reads_index_values_live(backend, reg):
    """The memo keeps the plan, which holds the index tensors, not their values: values
    changed in place are what the next call reads."""
    q, kc, vc, kw = _case()
    kw["backend"] = backend
    ops.paged_attention(q, kc, vc, **kw)
    kw["seqused_k"][1] = 6
    kw["block_table"][0, 0], kw["block_table"][0, 1] = (int(kw["block_table"][0, 1]),
                                                        int(kw["block_table"][0, 0]))
    got = ops.paged_attention(q, kc, vc, **kw)
    assert len(reg.calls) == 1
    torch.testing.assert_close(got, _expected(q, kc, vc, kw), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_index_input_is_not_memoised(backend, reg):
    """A strided block_table is copied by the Triton plan: such a call is never memoised (a
    memo would read the stale copy)."""
    q, kc, vc, kw = _case()
    wide = torch.zeros(2, kw["block_table"].shape[1] * 2, dtype=torch.int32)
    wide[:, ::2] = kw["block_table"]
    kw.update(backend=backend, block_table=wide[:, ::2])
    ops.paged_attention(q, kc, vc, **kw)
    assert not reg.calls
    wide[1, 0], wide[1, 2] = int(wide[1, 2]), int(wide[1, 0])  # through the view's base
    got = ops.paged_attention(q, kc, vc, **kw)
    torch.testing.assert_close(got, _expected(q, kc, vc, kw), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_memo_with_optional_tensors(backend, reg):
    """sinks, out, return_lse and a window take part in the key; the results stay right."""
    q, kc, vc, kw = _case()
    sinks = torch.randn(4)
    kw.update(backend=backend, sinks=sinks, window_size=(3, 0), softcap=5.0)
    out = torch.empty_like(q)
    a, lse_a = ops.paged_attention(q, kc, vc, out=out, return_lse=True, **kw)
    b, lse_b = ops.paged_attention(q, kc, vc, out=torch.empty_like(q), return_lse=True, **kw)
    assert a is out and len(reg.calls) == 1
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(lse_b, lse_a)
    c = ops.paged_attention(q, kc, vc, **kw)  # no lse: its own entry
    torch.testing.assert_close(c, a)
    sinks.add_(1.0)  # the layer constants hold the sinks tensor itself
    d = ops.paged_attention(q, kc, vc, **kw)
    torch.testing.assert_close(d, _expected(q, kc, vc, kw), rtol=1e-4, atol=1e-5)


@requires_triton
def test_tuning_override_change_replans(reg, monkeypatch):
    from aiter_attn.kernels.triton import _launch_config

    q, kc, vc, kw = _case(keys=(30, 41))
    kw["backend"] = "triton"
    ops.paged_attention(q, kc, vc, **kw)
    entry = next(iter(reg.calls.values()))
    monkeypatch.setitem(_launch_config.TUNING_OVERRIDES, "page_chunk", 2)
    planned = []
    kernel = entry[0]
    real = kernel.plan

    def spy(md, out=None):
        planned.append(1)
        return real(md, out)

    monkeypatch.setattr(kernel, "plan", spy)
    got = ops.paged_attention(q, kc, vc, **kw)
    assert planned == [1]
    torch.testing.assert_close(got, _expected(q, kc, vc, kw), rtol=1e-4, atol=1e-5)
    ops.paged_attention(q, kc, vc, **kw)
    assert planned == [1]  # the new plan was kept


@requires_triton
def test_split_plan_gets_a_fresh_workspace_per_call(reg, monkeypatch):
    """A plan with split partials is one call's scratch: a memoised call skips validation
    and selection but plans again, so two calls never share a workspace."""
    from aiter_attn import validation
    from aiter_attn.kernels.triton import _launch_config

    monkeypatch.setitem(_launch_config.TUNING_OVERRIDES, "num_splits", 3)
    q, kc, vc, kw = _case(keys=(30, 41))
    kw["backend"] = "triton"
    first = ops.paged_attention(q, kc, vc, **kw)
    entry = next(iter(reg.calls.values()))
    kernel = entry[0]
    assert entry[1] is None  # the memo keeps no workspace alive
    plans = []
    real = kernel.plan

    def spy(md, out=None):
        plans.append(real(md, out))
        return plans[-1]

    def boom(*a, **k):
        raise AssertionError("a memoised call validated")

    monkeypatch.setattr(kernel, "plan", spy)
    monkeypatch.setattr(ops, "_validate_paged", boom)
    monkeypatch.setattr(validation, "check_tensor", boom)
    again = ops.paged_attention(q, kc, vc, **kw)
    third = ops.paged_attention(q, kc, vc, **kw)
    assert len(plans) == 2 and plans[0].part_acc is not None
    assert plans[1].part_acc is not plans[0].part_acc
    torch.testing.assert_close(again, first)
    torch.testing.assert_close(third, first)
    torch.testing.assert_close(first, _expected(q, kc, vc, kw), rtol=1e-4, atol=1e-5)


@requires_triton
def test_checked_mode_bypasses_the_memo(reg, monkeypatch):
    """Under AITER_ATTN_DEBUG=1 even a call identical to a memoised one runs the value
    checks (a page id past the cache, written in place, is refused before the kernel)."""
    q, kc, vc, kw = _case()
    kw["backend"] = "triton"
    ops.paged_attention(q, kc, vc, **kw)
    assert len(reg.calls) == 1
    monkeypatch.setenv("AITER_ATTN_DEBUG", "1")
    kw["block_table"][0, 0] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        ops.paged_attention(q, kc, vc, **kw)


def test_registration_clears_the_memo():
    from aiter_attn.kernels.registry import Capabilities, KernelRegistry
    from aiter_attn.types import CGSupport

    r = KernelRegistry()
    r.calls["some call"] = "memo"
    r.register("merge_attention_states", "x", lambda *a: None,
               Capabilities(cg_support=CGSupport.NEVER))
    assert not r.calls  # a registration may change any selection


def test_memo_holds_few_calls(reg):
    q, kc, vc, kw = _case()
    for _ in range(ops._CALLS_KEEP + 5):
        fresh = dict(kw, seqused_k=kw["seqused_k"].clone())  # a new index tensor each time
        ops.paged_attention(q, kc, vc, **fresh)
    assert len(reg.calls) == ops._CALLS_KEEP


@pytest.mark.parametrize("backend", BACKENDS)
def test_memo_with_a_tree_mask_holds_it(backend, reg):
    """A custom mask is keyed by identity: the memo holds the mask tensor itself (the plan may
    keep only a view of it), and values written into it in place are read by the next call."""
    q, kc, vc, kw = _case()
    keys = kw["seqused_k"].tolist()
    mask = torch.ones(sum(keys), dtype=torch.bool)
    indptr = torch.tensor([0, keys[0], sum(keys)], dtype=torch.int64)
    kw.update(backend=backend, custom_mask=mask, mask_indptr=indptr, causal=False)
    ops.paged_attention(q, kc, vc, **kw)
    entry = next(iter(reg.calls.values()))
    assert any(t is mask for t in entry[-1]) and any(t is indptr for t in entry[-1])
    mask[: keys[0] // 2] = False  # request 0 now sees only its later keys
    got = ops.paged_attention(q, kc, vc, **kw)
    assert len(reg.calls) == 1
    torch.testing.assert_close(got, _expected(q, kc, vc, kw), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_no_memo_while_capturing_a_graph(reg):
    """A call first made under CUDA-graph capture is not memoised (its fp8 scale tensors
    would hold their values only after a replay); an eager call afterwards is right."""
    q, kc, vc, kw = _case()
    dev = torch.device("cuda")
    q, kc, vc = q.to(dev), kc.to(dev, torch.float8_e4m3fn), vc.to(dev, torch.float8_e4m3fn)
    q = q.half()
    kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    kw.update(backend="triton", k_scale=0.5, v_scale=0.25)
    ops.paged_attention(q, kc, vc, **dict(kw, seqused_k=kw["seqused_k"].clone()))  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_attention(q, kc, vc, **kw)
    assert not any(any(t is kw["seqused_k"] for t in e[-1]) for e in reg.calls.values())
    got = ops.paged_attention(q, kc, vc, **kw)
    ref = _expected(q.float().cpu(), (kc.float() * 0.5).cpu(), (vc.float() * 0.25).cpu(),
                    {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()
                     if k not in ("k_scale", "v_scale")})
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
