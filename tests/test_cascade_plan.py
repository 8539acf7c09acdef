"""The device grouping of cascade attention (``plan_cascade_index``) against the host oracle
(``cascade_groups_reference``), its invariants on random batches, and no host sync."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiter_attn.kernels.cascade_plan import num_tiles_bound, plan_cascade_index
from aiter_attn.kernels.reference_cascade import cascade_groups_reference

from ._triton_util import DEVICE, requires_triton


@st.composite
def batches(draw):
    """Random page tables where consecutive requests often share leading page ids (and
    sometimes share them with a gap, hold the null page, or are padding rows)."""
    page = draw(st.sampled_from([1, 2, 4, 16]))
    bs = draw(st.integers(1, 9))
    width = draw(st.integers(1, 8))
    next_page = [1]

    def fresh():
        next_page[0] += 1
        return next_page[0]

    rows, lens, q_lens = [], [], []
    for b in range(bs):
        if b and draw(st.booleans()):
            k = draw(st.integers(0, width))
            row = rows[-1][:k] + [fresh() for _ in range(width - k)]
        else:
            row = [fresh() for _ in range(width)]
        if draw(st.integers(0, 9)) == 0:
            row = [0] * width  # a padding row: the null page everywhere
        if draw(st.integers(0, 9)) == 0 and b:
            row[draw(st.integers(0, width - 1))] = 0  # a null entry inside a prefix
        kv = draw(st.integers(1, width * page))
        q = draw(st.integers(0 if draw(st.booleans()) else 1, min(kv, 3 * page)))
        rows.append(row)
        lens.append(kv)
        q_lens.append(q)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    need = draw(st.integers(1, 4))
    block_t = draw(st.sampled_from([1, 2, 3, 8]))
    return (torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
            torch.tensor(cu, dtype=torch.int32), page, need, block_t)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_device_grouping_matches_host(case):
    """Invariant: the device plan's per-request shared pages, own tables, tiles and token
    positions are exactly those of the host groups."""
    bt, lens, cu, page, need, block_t = case
    bs, width = bt.shape
    T = int(cu[-1])
    ix = plan_cascade_index(bt, lens, cu, page_size=page, min_shared_pages=need,
                            num_tokens=T, block_t=block_t)
    groups = cascade_groups_reference(bt, lens, cu, page, need)
    sp = [0] * bs
    for g in groups:
        assert g.last > g.first and g.shared_pages >= need
        for b in range(g.first, g.last + 1):
            sp[b] = g.shared_pages
            # shared pages are identical, non-null and wholly before every query of b
            assert bt[b, :g.shared_pages].tolist() == bt[g.first, :g.shared_pages].tolist()
            assert (bt[b, :g.shared_pages] != 0).all()
            assert g.shared_pages * page <= int(lens[b]) - int(cu[b + 1] - cu[b])
    assert ix.shared_pages.tolist() == sp
    for b in range(bs):
        own = bt[b, sp[b]:].tolist() + [0] * sp[b]
        assert ix.own_block_table[b].tolist() == own
        assert int(ix.own_seqused_k[b]) == int(lens[b]) - sp[b] * page
    # tiles: every token of every group exactly once, with its group's leader and length
    covered = {}
    tiles = ix.tiles.tolist()
    assert len(tiles) == num_tiles_bound(T, bs, block_t)
    for tok0, tok1, leader, shared in tiles:
        if tok0 >= tok1:
            assert (tok0, tok1, leader, shared) == (0, 0, 0, 0)
            continue
        for t in range(tok0, min(tok0 + block_t, tok1)):
            assert t not in covered
            covered[t] = (leader, shared, tok1)
    expect = {}
    for g in groups:
        for t in range(int(cu[g.first]), int(cu[g.last + 1])):
            expect[t] = (g.first, g.shared_pages * page, int(cu[g.last + 1]))
    assert covered == expect
    for b in range(bs):
        for i, t in enumerate(range(int(cu[b]), int(cu[b + 1]))):
            n = int(cu[b + 1] - cu[b])
            assert int(ix.q_pos[t]) == int(lens[b]) - n + i
            assert int(ix.tok_shared[t]) == sp[b] * page


def test_no_host_sync():
    """Planning on the ``meta`` device: any host read of a device value would raise."""
    bt = torch.empty(6, 10, dtype=torch.int32, device="meta")
    lens = torch.empty(6, dtype=torch.int32, device="meta")
    cu = torch.empty(7, dtype=torch.int32, device="meta")
    ix = plan_cascade_index(bt, lens, cu, page_size=16, min_shared_pages=2, num_tokens=6,
                            block_t=4)
    assert ix.tiles.shape == (num_tiles_bound(6, 6, 4), 4)
    assert ix.own_block_table.shape == (6, 10)


def test_writes_into_given_buffers():
    """With ``out`` (static buffers sized for bigger batches) the plan writes views of them."""
    from aiter_attn.kernels.cascade_plan import cascade_index_buffers

    bufs = cascade_index_buffers(8, 12, 8, num_tiles_bound(8, 8, 2), "cpu")
    bt = torch.tensor([[3, 4, 5], [3, 4, 6], [7, 8, 9]], dtype=torch.int32)
    lens = torch.tensor([40, 40, 40], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    ix = plan_cascade_index(bt, lens, cu, page_size=16, min_shared_pages=1, num_tokens=3,
                            block_t=2, out=bufs)
    assert ix.own_block_table.data_ptr() == bufs["own_block_table"].data_ptr()
    assert ix.shared_pages.tolist() == [2, 2, 0]
    assert ix.tiles[0].tolist() == [0, 2, 0, 32]


def test_cascade_kernel_plan_is_sync_free():
    """``CascadeKernel.plan`` (grouping, the wrapped Triton plan over the own pages, the
    workspaces) on a decode step's metadata planned on ``meta``: no host read anywhere."""
    from aiter_attn.kernels.cascade import CascadeKernel
    from aiter_attn.kernels.registry import KernelRequest
    from aiter_attn.kernels.triton.attention import TritonPagedAttention
    from aiter_attn.metadata import AttnMetadata, PageTable, QueryLayout
    from aiter_attn.types import ForwardMode

    meta = dict(device="meta", dtype=torch.int32)
    bs, width = 5, 9
    md = AttnMetadata(
        mode=ForwardMode.DECODE, batch_size=bs,
        query=QueryLayout(cu_seqlens_q=torch.empty(bs + 1, **meta), max_seqlen_q=1,
                          num_tokens=bs),
        pages=PageTable(block_table=torch.empty(bs, width, **meta),
                        seqused_k=torch.empty(bs, **meta), max_seqlen_k=width * 16,
                        page_size=16))
    req = KernelRequest(op="paged_attention", device="meta", dtype=torch.float16,
                        kv_dtype=torch.float16, head_dim=64, v_head_dim=64, page_size=16,
                        features=frozenset(), extra=(("q_heads", 8), ("kv_heads", 2)))
    inner = TritonPagedAttention(req)
    inner.name = "triton"
    kernel = CascadeKernel(inner, min_shared_tokens=32, impl="triton")
    plan = kernel.plan(md)
    assert plan.cascade and plan.index.tiles.device.type == "meta"
    assert plan.part_acc.shape[1:] == (bs, 8, 64)


@requires_triton
@settings(max_examples=60, deadline=None)
@given(batches())
def test_triton_planner_matches_torch(case):
    """Invariant: the Triton planner (three launches) writes exactly the torch planner's
    grouping, tiles (empty ones zero), own tables and per-token values."""
    from aiter_attn.kernels.cascade_plan import cascade_index_buffers
    from aiter_attn.kernels.triton.cascade_index import plan_cascade_index_triton

    bt, lens, cu, page, need, block_t = (x.to(DEVICE) if isinstance(x, torch.Tensor) else x
                                         for x in case)
    bs, width = bt.shape
    T = int(cu[-1])
    kw = dict(page_size=page, min_shared_pages=need, num_tokens=T, block_t=block_t)
    a = plan_cascade_index(bt, lens, cu, **kw)
    bufs = cascade_index_buffers(bs, width, T, num_tiles_bound(T, bs, block_t), DEVICE)
    for t in bufs.values():
        t.fill_(-7)  # stale values must be overwritten
    b = plan_cascade_index_triton(bt, lens, cu, out=bufs, **kw)
    for name in ("shared_pages", "own_block_table", "own_seqused_k", "tiles", "q_pos",
                 "tok_shared"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name


@pytest.mark.gpu
def test_gpu_triton_planner_matches_torch():
    """Compiled on the GPU: random shared-prefix batches (and a 256-request one) planned by
    the Triton and the torch planner agree."""
    from aiter_attn.kernels.cascade_plan import cascade_index_buffers
    from aiter_attn.kernels.triton.cascade_index import plan_cascade_index_triton

    g = torch.Generator().manual_seed(0)
    for trial in range(25):
        bs = 256 if trial == 0 else int(torch.randint(2, 70, (1,), generator=g))
        width = int(torch.randint(1, 300, (1,), generator=g))
        page = [1, 16, 48][trial % 3]
        bt = torch.randint(1, 50, (bs, width), generator=g, dtype=torch.int32)
        for b in range(1, bs):  # share a random number of leading pages with the previous row
            k = int(torch.randint(0, width + 1, (1,), generator=g))
            bt[b, :k] = bt[b - 1, :k]
        lens = torch.randint(1, width * page + 1, (bs,), generator=g, dtype=torch.int32)
        q = torch.minimum(torch.randint(1, 9, (bs,), generator=g, dtype=torch.int32), lens)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), q.cumsum(0).to(torch.int32)])
        T, block_t = int(cu[-1]), [16, 8, 2][trial % 3]
        bt, lens, cu = bt.cuda(), lens.cuda(), cu.cuda()
        kw = dict(page_size=page, min_shared_pages=1 + trial % 4, num_tokens=T, block_t=block_t)
        a = plan_cascade_index(bt, lens, cu, **kw)
        bufs = cascade_index_buffers(bs, width, T, num_tiles_bound(T, bs, block_t), "cuda")
        b_ = plan_cascade_index_triton(bt, lens, cu, out=bufs, **kw)
        for name in ("shared_pages", "own_block_table", "own_seqused_k", "tiles", "q_pos",
                     "tok_shared"):
            assert torch.equal(getattr(a, name), getattr(b_, name)), (trial, name)
