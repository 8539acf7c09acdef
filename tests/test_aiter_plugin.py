"""The aiter plugin's marshalling, on the CPU: dtype names, MLA head padding and decode plans,
page table → token indices (against a Python loop, and without host syncs), work-metadata
sizes, routing, call builders, capabilities and registration off ROCm."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import aiter_attn.kernels.aiter as A
from aiter_attn.kernels import aiter_marshal as M
from aiter_attn.kernels.registry import KernelRequest

E4M3FN, E4M3FNUZ, E5M2 = torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2


@pytest.mark.parametrize("dtype,name", [
    pytest.param(torch.bfloat16, "auto", id="bf16"),
    pytest.param(torch.float16, "auto", id="fp16"),
    pytest.param(E4M3FN, "fp8_e4m3", id="e4m3fn"),
    pytest.param(E4M3FNUZ, "fp8_e4m3", id="e4m3fnuz"),
])
def test_kv_cache_dtype_name(dtype, name):
    assert M.kv_cache_dtype_name(dtype) == name


@pytest.mark.parametrize("dtype,match", [
    pytest.param(E5M2, "no e5m2 mode", id="e5m2"),
    pytest.param(torch.float32, "allowed: float16, bfloat16", id="fp32"),
])
def test_kv_cache_dtype_name_rejects(dtype, match):
    with pytest.raises(ValueError, match=match):
        M.kv_cache_dtype_name(dtype)


@pytest.mark.parametrize("heads,expect", [
    pytest.param(4, (16, 4), id="h4"), pytest.param(8, (16, 2), id="h8"),
    pytest.param(16, (16, 1), id="h16"), pytest.param(48, (48, 1), id="h48"),
    pytest.param(128, (128, 1), id="h128"),
])
def test_mla_head_padding(heads, expect):
    assert M.mla_head_padding(heads) == expect


@pytest.mark.parametrize("heads", [1, 2, 12, 24, 144, 256])
def test_mla_head_padding_rejects(heads):
    with pytest.raises(ValueError, match=f"num_heads={heads}.*4, 8 or a multiple of 16"):
        M.mla_head_padding(heads)


def test_pad_unpad_round_trip():
    q = torch.randn(5, 4, 24)
    wide = M.pad_heads(q, 4)
    assert wide.shape == (5, 16, 24)
    for h in range(4):  # head h occupies padded heads 4h … 4h+3
        for r in range(4):
            assert torch.equal(wide[:, 4 * h + r], q[:, h])
    assert torch.equal(M.unpad_heads(wide, 4), q)
    assert M.pad_heads(q, 1) is q and M.unpad_heads(q, 1) is q


@pytest.mark.parametrize("heads,kv,qlen,persistent,fast,split", [
    pytest.param(16, torch.bfloat16, 1, False, False, None, id="h16-bf16-nonpersistent"),
    pytest.param(16, E4M3FNUZ, 1, True, False, 64, id="h16-fp8-persistent"),
    pytest.param(4, E4M3FNUZ, 2, True, False, 32, id="h4-fp8-verify-padded"),
    pytest.param(128, torch.bfloat16, 1, False, True, None, id="h128-bf16-nonpersistent"),
    pytest.param(128, E4M3FNUZ, 2, True, True, 32, id="h128-fp8-verify"),
    pytest.param(32, torch.bfloat16, 1, True, True, 64, id="h32-decode-simulated"),
    pytest.param(32, torch.bfloat16, 2, False, True, None, id="h32-verify-nonpersistent"),
])
def test_mla_decode_plan(heads, kv, qlen, persistent, fast, split):
    plan = M.mla_decode_plan(heads, kv, qlen)
    assert (plan.persistent, plan.fast_mode, plan.max_split_per_batch) == (persistent, fast, split)
    assert plan.padded_heads % 16 == 0 and plan.padded_heads == heads * plan.repeat
    assert plan.intra_batch_mode == (persistent and not fast)


def _loop_indices(block_table, lens, ps):
    out = []
    for b, L in enumerate(lens.tolist()):
        out += [int(block_table[b, j // ps]) * ps + j % ps for j in range(L)]
    return out


@pytest.mark.parametrize("ps", [1, 16, 48])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_kv_indices_matches_a_loop(ps, seed):
    g = torch.Generator().manual_seed(seed)
    bs, width = 4, 5
    bt = (torch.randperm(bs * width + 3, generator=g)[: bs * width] + 1).view(bs, width)
    lens = torch.randint(0, width * ps + 1, (bs,), generator=g)
    lens[0] = 0  # an empty request
    indptr, idx = M.token_kv_indices(bt.int(), lens.int(), ps)
    total = int(lens.sum())
    assert indptr.tolist() == [0] + lens.cumsum(0).tolist()
    assert idx.dtype == torch.int32 and idx.shape[0] == bs * width * ps
    assert idx[:total].tolist() == _loop_indices(bt, lens, ps)


def test_token_kv_indices_into_buffers_keeps_the_tail():
    bt = torch.tensor([[2, 3], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([5, 2], dtype=torch.int32)
    indptr_buf = torch.full((9,), -7, dtype=torch.int32)
    idx_buf = torch.full((20,), -1, dtype=torch.int32)
    indptr, idx = M.token_kv_indices(bt, lens, 4, kv_indptr=indptr_buf, kv_indices=idx_buf)
    assert indptr.tolist() == [0, 5, 7] and indptr.data_ptr() == indptr_buf.data_ptr()
    assert idx.data_ptr() == idx_buf.data_ptr()
    assert idx[:7].tolist() == [8, 9, 10, 11, 12, 4, 5]
    assert idx[7:].tolist() == [-1] * 13  # entries past the total are left alone


def test_token_kv_indices_buffer_too_small():
    bt = torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_indices has 10 entries; it needs .* = 48"):
        M.token_kv_indices(bt, torch.ones(3, dtype=torch.int32), 4,
                           kv_indices=torch.zeros(10, dtype=torch.int32))


def test_token_kv_indices_makes_no_host_sync():
    """On meta tensors any .item()/.tolist()/data-dependent size would raise."""
    bt = torch.empty(8, 6, dtype=torch.int32, device="meta")
    lens = torch.empty(8, dtype=torch.int32, device="meta")
    indptr, idx = M.token_kv_indices(bt, lens, 16)
    assert indptr.shape == (9,) and idx.shape == (8 * 6 * 16,)
    assert M.kv_last_page_lens(lens, 16).shape == (8,)


def test_kv_last_page_lens():
    lens = torch.tensor([0, 1, 15, 16, 17, 33], dtype=torch.int32)
    assert M.kv_last_page_lens(lens, 16).tolist() == [0, 1, 15, 16, 1, 1]
    assert M.kv_last_page_lens(lens, 1).tolist() == [0, 1, 1, 1, 1, 1]
    buf = torch.zeros(8, dtype=torch.int32)
    assert M.kv_last_page_lens(lens, 16, out=buf).data_ptr() == buf.data_ptr()


def test_partitions_and_workspace():
    assert [M.max_num_partitions(n) for n in (1, 256, 257, 8192)] == [1, 1, 2, 32]
    # 2 requests × 4 heads × 2 partitions of (64 floats + 2 floats) each
    assert M.ragged_workspace_bytes(2, 4, 64, 300) == 16 * 64 * 4 + 2 * 16 * 4


def test_mla_work_buffer_spec_formula():
    specs = M.mla_work_buffer_spec(3, 2, 32, torch.bfloat16, cu_num=10, fast_mode=False)
    got = {s.name: (s.shape, s.dtype) for s in specs}
    tiles = 3 * 4  # ceil(2·32 / 16) tiles of 16 rows per request
    assert got == {"work_metadata": ((2,), torch.uint64), "work_indptr": ((11,), torch.int32),
                   "work_info_set": ((tiles * 10, 8), torch.int32),
                   "reduce_indptr": ((tiles + 1,), torch.int32),
                   "reduce_final_map": ((tiles, 2), torch.int32),
                   "reduce_partial_map": ((tiles * 10,), torch.int32)}
    fast = {s.name: s.shape for s in M.mla_work_buffer_spec(
        3, 1, 16, E4M3FNUZ, cu_num=10, fast_mode=True)}
    assert fast["work_info_set"] == (3 + 9, 8)  # 1 tile of 128 rows per request
    assert fast["reduce_partial_map"] == (min(3 + 9, 18),)
    bufs = M.allocate_buffers(specs, "cpu")
    assert bufs["work_info_set"].shape == (120, 8) and bufs["work_metadata"].dtype == torch.uint64


def test_mla_work_buffer_spec_from_aiter_info_and_errors():
    info = (((2,), torch.uint64), (5, torch.int32), ((7, 8), torch.int32), (3, torch.int32),
            ((2, 2), torch.int32), (9, torch.int32))
    specs = M.mla_work_buffer_spec(1, 1, 16, torch.bfloat16, cu_num=4, info=info)
    assert [s.shape for s in specs] == [(2,), (5,), (7, 8), (3,), (2, 2), (9,)]
    with pytest.raises(ValueError, match="num_heads=8; pad MLA heads"):
        M.mla_work_buffer_spec(1, 1, 8, torch.bfloat16, cu_num=4)
    with pytest.raises(ValueError, match="returned 2 entries; expected 6"):
        M.mla_work_buffer_spec(1, 1, 16, torch.bfloat16, cu_num=4, info=info[:2])


def test_vec5d_x():
    assert M.vec5d_x(torch.bfloat16) == 8 and M.vec5d_x(E4M3FNUZ) == 16
    assert M.vec5d_x(torch.float32) == 4


@pytest.mark.parametrize("max_q,kw,params,route", [
    pytest.param(1, {}, None, "paged_attention_ragged", id="decode"),
    pytest.param(1, dict(causal=False), None, "paged_attention_ragged", id="decode-cross"),
    pytest.param(9, {}, None, "mha_batch_prefill_func", id="extend"),
    pytest.param(1, dict(has_sinks=True), None, "unified_attention", id="sinks"),
    pytest.param(3, dict(window=(7, 0)), None, "unified_attention", id="window-verify"),
    pytest.param(9, dict(is_fp8=True), frozenset({"q"}), "unified_attention",
                 id="fp8-extend-old-release"),
    pytest.param(9, dict(is_fp8=True), frozenset({"k_descale"}), "mha_batch_prefill_func",
                 id="fp8-extend-new-release"),
    pytest.param(1, dict(is_fp8=True), None, "paged_attention_ragged", id="fp8-decode"),
])
def test_route_paged_attention(max_q, kw, params, route):
    assert M.route_paged_attention(max_q, prefill_params=params, **kw) == route


def test_route_rejects_noncausal_sinks():
    with pytest.raises(ValueError, match="only with causal=True"):
        M.route_paged_attention(4, causal=False, has_sinks=True)


def test_unified_call_uses_our_window_convention_and_static_bound():
    q = torch.zeros(3, 4, 16)
    k = torch.zeros(10, 16, 2, 16)
    bt = torch.zeros(2, 5, dtype=torch.int32)
    call = M.build_unified_attention_call(
        q, k, k, q, cu_seqlens_q=torch.tensor([0, 1, 3]), seqused_k=torch.tensor([4, 9]),
        block_table=bt, max_seqlen_q=2, softmax_scale=0.25, window_size=(7, 0), softcap=20.0)
    assert call.fn == "unified_attention"
    # HF sliding_window=8 is (7, 0) in and out (no (w, -1) variant); logit cap kept
    assert call.kwargs["window_size"] == (7, 0) and call.kwargs["softcap"] == 20.0
    assert call.kwargs["max_seqlen_k"] == 5 * 16 and call.kwargs["block_table"] is bt


def test_mla_metadata_call_follows_the_release():
    plan = M.mla_decode_plan(16, E4M3FNUZ, 1)
    bufs = M.allocate_buffers(M.mla_work_buffer_spec(2, 1, 16, E4M3FNUZ, cu_num=4), "cpu")
    args = (torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32), bufs, plan)
    old = M.build_mla_metadata_call(*args, max_seqlen_qo=1, q_dtype=torch.bfloat16,
                                    kv_dtype=E4M3FNUZ, params=frozenset({"work_info"}))
    # the pybind name, whatever the 0.1.7 Python stub says
    assert "work_info_set" in old.kwargs and "work_info" not in old.kwargs
    assert "kv_last_page_lens" not in old.kwargs
    new = M.build_mla_metadata_call(
        *args, max_seqlen_qo=1, q_dtype=torch.bfloat16, kv_dtype=E4M3FNUZ,
        params=frozenset({"work_info_set", "kv_last_page_lens", "page_size", "dtype_kv"}))
    assert new.kwargs["work_info_set"] is bufs["work_info_set"] and "work_info" not in new.kwargs
    assert new.kwargs["page_size"] == 1 and new.kwargs["dtype_kv"] == E4M3FNUZ
    assert "intra_batch_mode" not in new.kwargs  # not in params


def test_mla_decode_call_needs_buffers_when_persistent():
    plan = M.mla_decode_plan(16, E4M3FNUZ, 1)
    z = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs work-metadata buffers"):
        M.build_mla_decode_call(torch.zeros(2, 16, 576), torch.zeros(4, 1, 1, 576),
                                torch.zeros(2, 16, 512), qo_indptr=z, kv_indptr=z,
                                kv_indices=z, last_page_lens=z, max_seqlen_q=1,
                                softmax_scale=0.1, plan=plan)


def _req(op="paged_attention", **kw):
    base = dict(op=op, device="cuda", dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                head_dim=128, v_head_dim=128, page_size=16)
    base.update(kw)
    return KernelRequest(**base)


@pytest.mark.parametrize("op,kw,reason", [
    pytest.param("paged_attention", dict(device="cpu"), "device 'cpu'", id="cpu"),
    pytest.param("paged_attention", dict(features={"custom_mask"}), "custom_mask", id="tree"),
    pytest.param("paged_attention", dict(features={"non_causal", "sinks"}), "only causally",
                 id="noncausal-sinks"),
    pytest.param("paged_attention", dict(kv_dtype=E5M2, features={"fp8"}), "kv dtype",
                 id="e5m2"),
    pytest.param("paged_attention", dict(head_dim=84, v_head_dim=84), "not a multiple of 8",
                 id="d84"),
    pytest.param("mla_paged_attention", dict(head_dim=576, v_head_dim=512,
                                             extra=(("heads", 12),)), "num_heads=12", id="mla-h12"),
    pytest.param("mla_paged_attention", dict(head_dim=192, v_head_dim=128), "576 (kv_lora_rank 512",
                 id="mla-dim"),
])
def test_capabilities_reject_with_reasons(op, kw, reason):
    caps = A.capabilities()[op]
    assert reason in (caps.reject_reason(_req(op, **kw)) or "")


def test_capabilities_accept(monkeypatch):
    from .test_aiter_contract import stub_gfx

    stub_gfx(monkeypatch, "gfx942")  # MI300: fp8 caches are e4m3fnuz (test_aiter_fp8_format)
    caps = A.capabilities()
    assert caps["paged_attention"].reject_reason(
        _req(features={"sinks", "window", "softcap"})) is None
    assert caps["paged_attention"].reject_reason(
        _req(kv_dtype=E4M3FNUZ, features={"fp8"})) is None
    assert caps["mla_paged_attention"].reject_reason(
        _req("mla_paged_attention", head_dim=576, v_head_dim=512, extra=(("heads", 4),))) is None


def test_not_registered_off_rocm():
    ok, why = A.availability()
    assert not ok and ("hip" in why or "ROCm" in why or "aiter" in why)
    seen = []
    A.aiter_attn_register_kernels(lambda *a, **k: seen.append(a))
    assert seen == []


def test_custom_mask_is_refused_before_any_kernel():
    with pytest.raises(ValueError, match="no custom_mask"):
        A.aiter_paged_attention(torch.zeros(1, 1, 8), torch.zeros(1, 1, 1, 8),
                                torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 8),
                                cu_seqlens_q=torch.tensor([0, 1]), seqused_k=torch.tensor([1]),
                                block_table=torch.zeros(1, 1, dtype=torch.int32),
                                softmax_scale=1.0, custom_mask=torch.ones(1, dtype=torch.bool),
                                mask_indptr=torch.tensor([0, 1]))


def test_5d_kernel_hands_long_queries_to_the_next_kernel(monkeypatch):
    """pa_decode_gluon takes ≤ 4 uniform query tokens; an extend over the 5-D layout goes to
    the next registered paged_attention_5d implementation (the reference here)."""
    from aiter_attn import plugins
    from aiter_attn.kernels.reference_5d import paged_attention_5d_reference

    def never(*a, **k):
        raise AssertionError("pa_decode_gluon must not be called for an extend")

    monkeypatch.setattr(A.AiterPagedAttention5D, "_call", never)
    plugins.reset_plugins()
    try:
        x = M.vec5d_x(torch.float32)
        g = torch.Generator().manual_seed(0)
        k5 = torch.randn(6, 2, 16 // x, 16, x, generator=g)
        v5 = torch.randn(6, 2, 16 // x, 16, x, generator=g)
        q = torch.randn(7, 4, 16, generator=g)
        kw = dict(cu_seqlens_q=torch.tensor([0, 2, 7], dtype=torch.int32),
                  seqused_k=torch.tensor([5, 30], dtype=torch.int32),
                  block_table=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
                  softmax_scale=0.25, max_seqlen_q=5)
        got = A.aiter_paged_attention_5d(q, k5, v5, torch.empty(7, 4, 16), **kw)
        want = paged_attention_5d_reference(q, k5, v5, torch.empty(7, 4, 16), **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        plugins.reset_plugins()


def test_mla_buffer_spec_for_the_graph_manager():
    """The persistent-MLA work metadata as a BufferSpec (no aiter needed with cu_num)."""
    spec = A.mla_buffer_spec(32, 1, 8, torch.bfloat16, E4M3FNUZ, cu_num=80, prefix="w.")
    names = sorted(spec.buffers)
    assert names == sorted("w." + n for n in (
        "work_metadata", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map"))
    assert spec.buffers["w.work_indptr"] == ((81,), torch.int32)
    # 16 heads with a bf16 cache use the non-persistent kernel: nothing to reserve
    assert A.mla_buffer_spec(32, 1, 16, torch.bfloat16, torch.bfloat16, cu_num=80).buffers == {}


def test_the_plugin_keeps_no_module_state():
    """No module-level workspaces or caches of per-batch data: bound kernel objects own what
    they plan (issue 13)."""
    for name in ("_workspaces", "_retired", "_api", "reset_api", "use_mla_workspace",
                 "reserve_mla_workspace"):
        assert not hasattr(A, name), name


@st.composite
def _tables(draw):
    ps = draw(st.sampled_from([1, 3, 16, 48]))
    bs = draw(st.integers(1, 5))
    width = draw(st.integers(1, 4))
    pages = draw(st.permutations(range(1, bs * width + 2)))[: bs * width]
    lens = draw(st.lists(st.integers(0, width * ps), min_size=bs, max_size=bs))
    return ps, torch.tensor(pages, dtype=torch.int32).view(bs, width), torch.tensor(
        lens, dtype=torch.int32)


@given(_tables())
def test_token_kv_indices_properties(table):
    """indptr is monotone and ends at the total; request b's indices are exactly the slots of
    its first seqused_k[b] tokens, in order, inside its own pages (never the null page 0)."""
    ps, bt, lens = table
    indptr, idx = M.token_kv_indices(bt, lens, ps)
    assert (indptr[1:] >= indptr[:-1]).all() and int(indptr[-1]) == int(lens.sum())
    for b in range(bt.shape[0]):
        got = idx[int(indptr[b]):int(indptr[b + 1])]
        assert torch.equal(got // ps, bt[b].repeat_interleave(ps)[: int(lens[b])])
        assert torch.equal(got % ps, torch.arange(int(lens[b]), dtype=torch.int32) % ps)
        assert not (got // ps == 0).any()
