"""Strided index tensors on every Triton kernel (issue 11, item 5).

``block_table[:, ::2]``, ``seqused_k[::2]``, ``cu_seqlens_q[::2]`` … are legal views; the
Triton kernels index the last axis of their index inputs with stride 1, so their host
wrappers must materialise such views (outputs they write are refused when strided). Every
view here holds *garbage* (valid but wrong values) in the elements it skips: a kernel that
assumed unit stride would read them (the interpreter honours the pointer arithmetic) and
differ from the reference, which handles strides through torch indexing.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops
from aiter_attn.kernels import reference as R
from aiter_attn.kernels import reference_extra as RE
from aiter_attn.kernels.reference_5d import vec_width
from aiter_attn.strategies.vec5d import paged_attention_5d
from aiter_attn.testing.compare import assert_close_rel

from ._index_case import attn_kwargs, mla_case, paged_case, strided
from ._triton_util import DEVICE, requires_triton

pytestmark = requires_triton

RTOL = 1e-5  # float32 against the float32 reference


def _garbage(name, t, c):
    """Valid-but-wrong values for the skipped elements of index input ``name``."""
    if name == "cu_seqlens_q":
        return t  # [0, 0, 3, 3, 5, 5]: a unit-stride read sees other requests' offsets
    if name == "seqused_k":
        return torch.ones_like(t)
    if name == "block_table":
        return (t + 1) % c.num_pages  # other pages of the cache
    if name == "mask_indptr":
        return torch.zeros_like(t)
    if name == "custom_mask":
        return ~t
    if name == "sinks":
        return torch.full_like(t, 5.0)
    raise AssertionError(name)


def _tree_mask(c, device):
    """A random verify mask (each row sees at least its own key) and its int64 offsets."""
    g = torch.Generator().manual_seed(7)
    blocks, indptr = [], [0]
    for n, L in zip(c.q_lens, c.kv_lens):
        m = torch.rand(n, L, generator=g) < 0.6
        m[torch.arange(n), L - n + torch.arange(n)] = True
        blocks.append(m.reshape(-1))
        indptr.append(indptr[-1] + n * L)
    return torch.cat(blocks).to(device), torch.tensor(indptr, dtype=torch.int64, device=device)


PAGED_INPUTS = ["cu_seqlens_q", "seqused_k", "block_table", "sinks", "custom_mask",
                "mask_indptr", "all"]


def _paged_call(c, which, device):
    """(kwargs with contiguous inputs, kwargs with ``which`` strided) of one paged call."""
    kw = attn_kwargs(c)
    kw["sinks"] = torch.randn(c.q.shape[1], generator=torch.Generator().manual_seed(3)).to(device)
    if which in ("custom_mask", "mask_indptr", "all"):
        kw["custom_mask"], kw["mask_indptr"] = _tree_mask(c, device)
        kw["causal"] = False
    names = [n for n in PAGED_INPUTS[:-1] if n in kw] if which == "all" else [which]
    skw = dict(kw)
    for n in names:
        skw[n] = strided(kw[n], _garbage(n, kw[n], c))
    return kw, skw


@pytest.mark.parametrize("which", PAGED_INPUTS)
def test_paged_attention_strided_inputs(which):
    c = paged_case(device=DEVICE)
    kw, skw = _paged_call(c, which, DEVICE)
    want = ops.paged_attention(c.q.cpu(), c.k_cache.cpu(), c.v_cache.cpu(), backend="reference",
                               **{k: (v.cpu() if torch.is_tensor(v) else v)
                                  for k, v in kw.items()})
    got = ops.paged_attention(c.q, c.k_cache, c.v_cache, backend="triton", **skw)
    assert_close_rel(got.cpu(), want, RTOL, f"strided {which}")


@pytest.mark.parametrize("which", ["cu_seqlens_q", "seqused_k", "block_table", "all"])
def test_paged_attention_5d_strided_inputs(which):
    from aiter_attn.kernels.reference_extra import kv_5d_from_nhd

    c = paged_case(device=DEVICE)
    k5, v5 = kv_5d_from_nhd(c.k_cache, c.v_cache, vec_width(c.k_cache.dtype))
    kw, skw = attn_kwargs(c), attn_kwargs(c)
    for n in (["cu_seqlens_q", "seqused_k", "block_table"] if which == "all" else [which]):
        skw[n] = strided(kw[n], _garbage(n, kw[n], c))
    want = paged_attention_5d(c.q, k5, v5, backend="reference", **kw)
    got = paged_attention_5d(c.q, k5, v5, backend="triton", **skw)
    assert_close_rel(got.cpu(), want.cpu(), RTOL, f"5-D strided {which}")


@pytest.mark.parametrize("which", ["cu_seqlens_q", "seqused_k", "block_table", "custom_mask",
                                   "mask_indptr", "all"])
def test_mla_strided_inputs(which):
    c = mla_case(device=DEVICE)
    kw = attn_kwargs(c, kv_lora_rank=c.kv_lora_rank)
    if which in ("custom_mask", "mask_indptr", "all"):
        kw["custom_mask"], kw["mask_indptr"] = _tree_mask(c, DEVICE)
        kw["causal"] = False
    skw = dict(kw)
    names = ([n for n in ("cu_seqlens_q", "seqused_k", "block_table", "custom_mask",
                          "mask_indptr") if n in kw] if which == "all" else [which])
    for n in names:
        skw[n] = strided(kw[n], _garbage(n, kw[n], c))
    want = ops.mla_paged_attention(c.q, c.kv_cache, backend="reference", **kw)
    got = ops.mla_paged_attention(c.q, c.kv_cache, backend="triton", **skw)
    assert_close_rel(got.cpu(), want.cpu(), RTOL, f"MLA strided {which}")


# ---------------------------------------------------------------------- index builders


def _table_inputs(device, page_size=2):
    g = torch.Generator().manual_seed(11)
    r2t = torch.randint(0, 200, (4, 24), generator=g, dtype=torch.int32)
    rpi = torch.tensor([2, 0, 3], dtype=torch.int64)
    seq = torch.tensor([9, 4, 13], dtype=torch.int32)
    return r2t.to(device), rpi.to(device), seq.to(device), page_size


def _strided_table_inputs(r2t, rpi, seq, which):
    if which in ("req_to_token", "all"):
        r2t = strided(r2t, r2t.flip(-1))
    if which in ("req_pool_indices", "all"):
        rpi = strided(rpi, (rpi + 1) % 4)
    if which in ("seq_lens", "all"):
        seq = strided(seq, torch.full_like(seq, 3))
    return r2t, rpi, seq


TABLE_INPUTS = ["req_to_token", "req_pool_indices", "seq_lens", "all"]


@pytest.mark.parametrize("which", TABLE_INPUTS)
def test_build_page_table_strided_inputs(which):
    r2t, rpi, seq, ps = _table_inputs(DEVICE)
    want = torch.full((3, 8), -9, dtype=torch.int32)
    R.build_page_table_reference(r2t.cpu(), rpi.cpu(), seq.cpu(), ps, want)
    got = torch.full((3, 8), -9, dtype=torch.int32, device=DEVICE)
    ops.build_page_table(*_strided_table_inputs(r2t, rpi, seq, which), ps, got, backend="triton")
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("which", TABLE_INPUTS + ["full_to_swa"])
def test_build_page_tables_swa_strided_inputs(which):
    r2t, rpi, seq, ps = _table_inputs(DEVICE)
    f2s = torch.randperm(202, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want, want_swa = (torch.zeros(3, 8, dtype=torch.int32) for _ in range(2))
    R.build_page_tables_swa_reference(r2t.cpu(), rpi.cpu(), seq.cpu(), ps, f2s.cpu(), want,
                                      want_swa)
    got, got_swa = (torch.zeros(3, 8, dtype=torch.int32, device=DEVICE) for _ in range(2))
    s_f2s = strided(f2s, f2s.flip(0)) if which in ("full_to_swa", "all") else f2s
    ops.build_page_tables_swa(*_strided_table_inputs(r2t, rpi, seq, which), ps, s_f2s, got,
                              got_swa, backend="triton")
    assert torch.equal(got.cpu(), want) and torch.equal(got_swa.cpu(), want_swa)


@pytest.mark.parametrize("which", TABLE_INPUTS)
def test_build_ragged_kv_indices_strided_inputs(which):
    r2t, rpi, seq, _ = _table_inputs(DEVICE)
    total = int(seq.sum())
    want_ip, want_idx = torch.zeros(4, dtype=torch.int32), torch.zeros(total, dtype=torch.int32)
    R.build_ragged_kv_indices_reference(r2t.cpu(), rpi.cpu(), seq.cpu(), want_ip, want_idx,
                                        total)
    ip = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    idx = torch.zeros(total, dtype=torch.int32, device=DEVICE)
    ops.build_ragged_kv_indices(*_strided_table_inputs(r2t, rpi, seq, which), ip, idx, total,
                                backend="triton")
    assert torch.equal(ip.cpu(), want_ip) and torch.equal(idx.cpu(), want_idx)


def _draft_outputs(rows, steps, width, device):
    z = lambda *s: torch.zeros(*s, dtype=torch.int32, device=device)  # noqa: E731
    return [z(rows + 1), z(rows), z(steps, rows), z(steps, rows), z(steps, rows),
            z(steps, rows, width)]


@pytest.mark.parametrize("which", ["req_pool_indices", "seq_lens", "all"])
def test_build_draft_decode_indices_strided_inputs(which):
    r2t, rpi, seq, ps = _table_inputs(DEVICE)
    topk, steps, width = 2, 2, 12
    rows = seq.shape[0] * topk
    want = _draft_outputs(rows, steps, width, "cpu")
    RE.build_draft_decode_indices_reference(r2t.cpu(), rpi.cpu(), seq.cpu(), ps, topk, steps,
                                            *want)
    got = _draft_outputs(rows, steps, width, DEVICE)
    s_r2t, s_rpi, s_seq = _strided_table_inputs(r2t, rpi, seq, which)
    ops.build_draft_decode_indices(s_r2t, s_rpi, s_seq, ps, topk, steps, *got, backend="triton")
    for g_, w_ in zip(got, want):
        assert torch.equal(g_.cpu(), w_)


@pytest.mark.parametrize("which", ["seq_lens", "mask_indptr", "tree", "all"])
def test_build_tree_mask_strided_inputs(which):
    q_len = 3
    seq = torch.tensor([5, 3, 8], dtype=torch.int32, device=DEVICE)
    tree = (torch.rand(3, q_len, q_len, generator=torch.Generator().manual_seed(2)) < 0.5)
    tree = tree.to(DEVICE)
    ip = torch.tensor([0] + (seq.long() * q_len).cumsum(0).tolist(), dtype=torch.int64,
                      device=DEVICE)
    total = int(ip[-1])
    want = torch.zeros(total, dtype=torch.bool)
    RE.build_tree_mask_reference(seq.cpu(), tree.cpu(), q_len, ip.cpu(), want, total)
    s_seq = strided(seq, torch.full_like(seq, q_len)) if which in ("seq_lens", "all") else seq
    s_ip = strided(ip, torch.zeros_like(ip)) if which in ("mask_indptr", "all") else ip
    s_tree = strided(tree, ~tree) if which in ("tree", "all") else tree
    got = torch.zeros(total, dtype=torch.bool, device=DEVICE)
    ops.build_tree_mask(s_seq, s_tree, q_len, s_ip, got, total, backend="triton")
    assert torch.equal(got.cpu(), want)


# ---------------------------------------------------------------------- KV writes


def _write_inputs(device):
    g = torch.Generator().manual_seed(13)
    pages, ps, h, d = 6, 4, 2, 16
    k_cache = torch.randn(pages, ps, h, d, generator=g)
    v_cache = torch.randn(pages, ps, h, d, generator=g)
    slots = torch.tensor([5, 17, 9, 22], dtype=torch.int64)
    k = torch.randn(4, h, d, generator=g)
    v = torch.randn(4, h, d, generator=g)
    return [t.to(device) for t in (k_cache, v_cache, slots, k, v)]


def test_write_kv_strided_slots():
    k_cache, v_cache, slots, k, v = _write_inputs(DEVICE)
    want_k, want_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    R.write_kv_reference(want_k, want_v, slots.cpu(), k.cpu(), v.cpu())
    ops.write_kv(k_cache, v_cache, strided(slots, torch.full_like(slots, 1)), k, v,
                 backend="triton")
    assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)


@pytest.mark.parametrize("which", ["slots", "full_to_swa", "all"])
def test_write_kv_swa_strided_inputs(which):
    from aiter_attn.kernels.triton.kv_write import write_kv_translated

    k_cache, v_cache, slots, k, v = _write_inputs(DEVICE)
    f2s = torch.randperm(24, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    f2s = torch.cat([f2s, f2s])  # 48 full slots onto 24 SWA slots
    want_k, want_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    RE.write_kv_translated_reference(want_k, want_v, slots.cpu(), k.cpu(), v.cpu(),
                                     full_to_swa=f2s.cpu())
    s_slots = strided(slots, torch.full_like(slots, 1)) if which != "full_to_swa" else slots
    s_f2s = strided(f2s, f2s.flip(0)) if which != "slots" else f2s
    write_kv_translated(k_cache, v_cache, s_slots, k, v, full_to_swa=s_f2s)
    assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)


def test_write_kv_5d_strided_slots():
    from aiter_attn.kernels.reference_extra import kv_5d_from_nhd
    from aiter_attn.kernels.triton.kv_write import write_kv_5d

    k_cache, v_cache, slots, k, v = _write_inputs(DEVICE)
    k5, v5 = kv_5d_from_nhd(k_cache, v_cache, vec_width(k_cache.dtype))
    want_k, want_v = k5.cpu().clone(), v5.cpu().clone()
    RE.write_kv_5d_reference(want_k, want_v, slots.cpu(), k.cpu(), v.cpu())
    write_kv_5d(k5, v5, strided(slots, torch.full_like(slots, 1)), k, v)
    assert torch.equal(k5.cpu(), want_k) and torch.equal(v5.cpu(), want_v)


# ---------------------------------------------------------------------- strided outputs


def test_strided_outputs_are_refused_with_the_name():
    """A kernel cannot write through a strided view of an output: it says which and why."""
    r2t, rpi, seq, ps = _table_inputs(DEVICE)
    out = strided(torch.zeros(3, 8, dtype=torch.int32, device=DEVICE), 0)
    with pytest.raises(ValueError, match="out has strides"):
        ops.build_page_table(r2t, rpi, seq, ps, out, backend="triton")
    total = int(seq.sum())
    ip = strided(torch.zeros(4, dtype=torch.int32, device=DEVICE), 0)
    with pytest.raises(ValueError, match="kv_indptr has strides"):
        ops.build_ragged_kv_indices(r2t, rpi, seq, ip,
                                    torch.zeros(total, dtype=torch.int32, device=DEVICE), total,
                                    backend="triton")


def test_row_sliced_tables_are_not_copied():
    """A row slice of a wider static table (``buf[:bs, :w]``) keeps unit inner stride and is
    passed through as is (no per-call copy on the hot path)."""
    from aiter_attn.validation import unit_stride

    buf = torch.zeros(8, 32, dtype=torch.int32)
    view = buf[:3, :5]
    assert unit_stride(view) is view
    s = strided(torch.arange(4), 0)
    dense = unit_stride(s)
    assert dense.stride(-1) == 1 and torch.equal(dense, s)
