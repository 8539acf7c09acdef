"""Triton index builders and KV writes against their torch references.

Index kernels and KV writes move integers and bytes, so results must be *equal*, not close:
page tables and ragged indices element for element; KV writes byte for byte (fp16/fp32 copies
on the CPU interpreter; bf16 copies and fp8 quantisation, which must round exactly like the
reference's ``x / scale`` → saturate → round-to-nearest-even, on the GPU). Every write test
also checks that every slot outside the batch is byte-identical to before.

On CPU-only hosts the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``scripts/test.sh``); its fp8 casts are not faithful, so fp8 runs on the GPU only.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn.kernels import reference as R
from aiter_attn.kernels import reference_extra as RE
from aiter_attn.metadata import RaggedKV
from aiter_attn.testing.invariants import check_page_table, check_ragged_kv
from aiter_attn.testing.strategies import paged_batches
from aiter_attn.types import ForwardMode

from ._triton_util import DEVICE, requires_triton

pytestmark = requires_triton


def _triton():
    from aiter_attn.kernels.triton import index, kv_write

    return index, kv_write


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).cpu()


# ------------------------------------------------------------------------------ index kernels

@given(pb=paged_batches(mode=ForwardMode.DECODE, max_bs=5),
       spare=st.integers(0, 3), idx_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_page_table_equals_reference(pb, spare, idx_dtype):
    """The Triton page table equals the reference one and satisfies the page-table invariants
    (own pages in order, null page past each request's length)."""
    index, _ = _triton()
    b, ps = pb.batch, pb.config.page_size
    r2t = pb.req_pool.req_to_token.to(DEVICE)
    width = max(-(-int(n) // ps) for n in b.seq_lens_cpu) + spare
    want = torch.full((b.batch_size, width), 77, dtype=idx_dtype)
    R.build_page_table_reference(pb.req_pool.req_to_token, b.req_pool_indices, b.seq_lens, ps,
                                 want)
    got = torch.full((b.batch_size, width), -77, dtype=idx_dtype, device=DEVICE)
    index.build_page_table(r2t, b.req_pool_indices.to(DEVICE), b.seq_lens.to(DEVICE), ps, got)
    assert torch.equal(got.cpu(), want)
    check_page_table(got, b.seq_lens, b.req_pool_indices, pb.req_pool.req_to_token, ps)


@given(pb=paged_batches(mode=ForwardMode.DECODE, max_bs=5), spare=st.integers(0, 2),
       freed=st.floats(0.0, 0.5), seed=st.integers(0, 2**16))
def test_page_tables_swa_equal_reference(pb, spare, freed, seed):
    """Full and SWA tables from one Triton pass equal the reference (full table, then the
    translation ``full_to_swa[page · P] // P``), with some SWA pages freed (mapping 0) and
    the null page past each request's length in both."""
    index, _ = _triton()
    b, ps = pb.batch, pb.config.page_size
    g = torch.Generator().manual_seed(seed)
    r2t = pb.req_pool.req_to_token
    full_slots = int(r2t.max()) + ps + 1
    n_swa_pages = full_slots // ps + 2
    # page-granular mapping: every slot of full page p -> slot of SWA page perm[p] (or freed)
    swa_page = torch.randperm(n_swa_pages, generator=g)[: full_slots // ps + 1] + 1
    swa_page[torch.rand(swa_page.shape, generator=g) < freed] = 0
    slot = torch.arange(full_slots)
    f2s = swa_page[slot // ps] * ps + slot % ps
    f2s[:ps] = 0  # the null page maps to the null page
    width = max(-(-int(n) // ps) for n in b.seq_lens_cpu) + spare
    want, want_swa = (torch.full((b.batch_size, width), 77, dtype=torch.int32) for _ in "ab")
    R.build_page_tables_swa_reference(r2t, b.req_pool_indices, b.seq_lens, ps, f2s, want,
                                      want_swa)
    got, got_swa = (torch.full((b.batch_size, width), -77, dtype=torch.int32, device=DEVICE)
                    for _ in "ab")
    index.build_page_tables_swa(r2t.to(DEVICE), b.req_pool_indices.to(DEVICE),
                                b.seq_lens.to(DEVICE), ps, f2s.to(DEVICE), got, got_swa)
    assert torch.equal(got.cpu(), want) and torch.equal(got_swa.cpu(), want_swa)
    # hand check of the convention on the first request's first page
    if int(b.seq_lens_cpu[0]) > 0:
        page = int(want[0, 0])
        assert int(want_swa[0, 0]) == int(swa_page[page]) and page > 0


def test_page_tables_swa_rejects_mismatched_out_swa():
    index, _ = _triton()
    r2t = torch.arange(64, dtype=torch.int32).view(2, 32).to(DEVICE)
    args = (r2t, torch.tensor([0, 1], device=DEVICE), torch.tensor([5, 9], device=DEVICE), 4,
            torch.zeros(64, dtype=torch.int64, device=DEVICE),
            torch.zeros(2, 3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="out_swa has shape"):
        index.build_page_tables_swa(*args, torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))


@given(pb=paged_batches(mode=ForwardMode.EXTEND, max_bs=5), slack=st.integers(0, 5))
def test_ragged_indices_equal_reference(pb, slack):
    """kv_indptr/kv_indices equal the reference; entries past the total stay untouched."""
    index, _ = _triton()
    b = pb.batch
    total = int(b.seq_lens_cpu.sum())
    ip_ref = torch.full((b.batch_size + 1,), -3, dtype=torch.int32)
    ix_ref = torch.full((total + slack,), -9, dtype=torch.int32)
    R.build_ragged_kv_indices_reference(pb.req_pool.req_to_token, b.req_pool_indices,
                                        b.seq_lens, ip_ref, ix_ref, total)
    ip = torch.full_like(ip_ref, -3, device=DEVICE)
    ix = torch.full_like(ix_ref, -9, device=DEVICE)
    index.build_ragged_kv_indices(pb.req_pool.req_to_token.to(DEVICE),
                                  b.req_pool_indices.to(DEVICE), b.seq_lens.to(DEVICE),
                                  ip, ix, total)
    assert torch.equal(ip.cpu(), ip_ref)
    assert torch.equal(ix.cpu(), ix_ref)
    check_ragged_kv(RaggedKV(kv_indptr=ip, kv_indices=ix), b.seq_lens, b.req_pool_indices,
                    pb.req_pool.req_to_token)


def test_ragged_rejects_small_indices_buffer():
    index, _ = _triton()
    r2t = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="kv_indices holds 3"):
        index.build_ragged_kv_indices(
            r2t, torch.tensor([0, 1], device=DEVICE), torch.tensor([2, 3], device=DEVICE),
            torch.zeros(3, dtype=torch.int32, device=DEVICE),
            torch.zeros(3, dtype=torch.int32, device=DEVICE), 5)


def test_page_table_rejects_bad_page_size():
    index, _ = _triton()
    z = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="page_size=0"):
        index.build_page_table(z, z[0, :1].long(), z[0, :1], 0, z)


# ------------------------------------------------------------------------------ KV writes

def _pool(shape, dtype, g):
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def _slots(num_slots, n, g):
    return torch.randperm(num_slots, generator=g)[:n].to(DEVICE)


WRITE_CASES = [
    pytest.param(1, 2, 16, 16, id="page1-H2-D16"),
    pytest.param(16, 3, 80, 64, id="page16-H3-D80-Dv64"),
    pytest.param(48, 1, 128, 128, id="page48-MQA-D128"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("page,heads,d,dv", WRITE_CASES)
def test_write_kv_equals_reference_and_touches_only_slots(page, heads, d, dv, dtype):
    _, kvw = _triton()
    g = torch.Generator().manual_seed(page + heads)
    kc, vc = _pool((6, page, heads, d), dtype, g), _pool((6, page, heads, dv), dtype, g)
    n = min(9, 6 * page)
    slots = _slots(6 * page, n, g)
    k, v = _pool((n, heads, d), dtype, g), _pool((n, heads, dv), dtype, g)
    a, b = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    R.write_kv_reference(*a, slots, k, v)
    kvw.write_kv(*b, slots, k, v)
    assert torch.equal(_bytes(a[0]), _bytes(b[0])) and torch.equal(_bytes(a[1]), _bytes(b[1]))
    # every other slot byte-identical to before
    keep = torch.ones(6 * page, dtype=torch.bool)
    keep[slots.cpu()] = False
    for before, after in ((kc, b[0]), (vc, b[1])):
        flat_b = _bytes(before).view(6 * page, -1)
        flat_a = _bytes(after).view(6 * page, -1)
        assert torch.equal(flat_a[keep], flat_b[keep])


def test_write_kv_key_only_latent_cache():
    """MLA writes one latent cache: ``v_cache`` and ``v`` are ``None``."""
    _, kvw = _triton()
    g = torch.Generator().manual_seed(3)
    kc = _pool((4, 64, 1, 80), torch.float32, g)
    slots = _slots(256, 5, g)
    k = _pool((5, 1, 80), torch.float32, g)
    a, b = kc.clone(), kc.clone()
    R.write_kv_reference(a, None, slots, k, None)
    kvw.write_kv(b, None, slots, k, None)
    assert torch.equal(a, b)


@given(data=st.data())
def test_write_kv_swa_translated(data):
    """Slots translate through ``full_to_swa``; negative slots/entries are skipped; every
    other SWA slot is byte-identical."""
    _, kvw = _triton()
    page = data.draw(st.sampled_from([1, 4, 7]))
    swa_slots, full_slots = 5 * page, 40
    n = data.draw(st.integers(1, 6))
    seed = data.draw(st.integers(0, 1000))
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(swa_slots, generator=g)[: min(full_slots, swa_slots)]
    table = torch.cat([table, torch.full((full_slots - table.numel(),), -1)])
    table = table[torch.randperm(full_slots, generator=g)]
    slots = torch.randperm(full_slots, generator=g)[:n]
    slots[0] = -1 if data.draw(st.booleans()) else slots[0]
    # two tokens never share a SWA slot in a real batch; keep the drawn ones distinct
    dst = table[slots.clamp_min(0)]
    live = dst[(slots >= 0) & (dst >= 0)]
    if live.unique().numel() != live.numel():
        return
    kc, vc = _pool((5, page, 2, 16), torch.float32, g), _pool((5, page, 2, 32), torch.float32, g)
    k, v = _pool((n, 2, 16), torch.float32, g), _pool((n, 2, 32), torch.float32, g)
    a, b = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    RE.write_kv_translated_reference(*a, slots.to(DEVICE), k, v, full_to_swa=table.to(DEVICE))
    kvw.write_kv_translated(*b, slots.to(DEVICE), k, v, full_to_swa=table.to(DEVICE))
    assert torch.equal(_bytes(a[0]), _bytes(b[0])) and torch.equal(_bytes(a[1]), _bytes(b[1]))
    changed = (_bytes(b[0]).view(swa_slots, -1) != _bytes(kc).view(swa_slots, -1)).any(1)
    assert set(changed.nonzero().view(-1).tolist()) <= set(live.tolist())


@pytest.mark.parametrize("v_shuffled", [True, False], ids=["V-shuffled-5d", "V-hd-page-4d"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_write_kv_5d_layout(dtype, v_shuffled):
    """The 5-D write equals the reference, lands where the NHD view says, and touches nothing
    else."""
    _, kvw = _triton()
    x = 16 // torch.empty((), dtype=dtype).element_size()
    page, heads, d, dv, pages = 16, 2, 64, 32, 5
    g = torch.Generator().manual_seed(1)
    k_nhd = torch.randn(pages, page, heads, d, generator=g).to(dtype)
    v_nhd = torch.randn(pages, page, heads, dv, generator=g).to(dtype)
    k5, v5 = RE.kv_5d_from_nhd(k_nhd, v_nhd, x, v_shuffled=v_shuffled)
    k5, v5 = k5.to(DEVICE), v5.to(DEVICE)
    slots = _slots(pages * page, 11, g)
    k, v = _pool((11, heads, d), dtype, g), _pool((11, heads, dv), dtype, g)
    a, b = (k5.clone(), v5.clone()), (k5.clone(), v5.clone())
    RE.write_kv_5d_reference(*a, slots, k, v)
    kvw.write_kv_5d(*b, slots, k, v)
    assert torch.equal(_bytes(a[0]), _bytes(b[0])) and torch.equal(_bytes(a[1]), _bytes(b[1]))
    kn, vn = RE.kv_nhd_from_5d(b[0].cpu(), b[1].cpu())
    expect_k, expect_v = k_nhd.clone().view(-1, heads, d), v_nhd.clone().view(-1, heads, dv)
    expect_k[slots.cpu()], expect_v[slots.cpu()] = k.cpu(), v.cpu()
    assert torch.equal(kn.view(-1, heads, d), expect_k)
    assert torch.equal(vn.view(-1, heads, dv), expect_v)


def test_hand_computed_5d_position():
    """Slot 21 of page size 16, dim 9 with x = 8 (fp16): K at [1, h, 1, 5, 1]; shuffled V at
    [1, h, 0, 9, 5]."""
    _, kvw = _triton()
    k5 = torch.zeros(2, 1, 2, 16, 8, dtype=torch.float16, device=DEVICE)
    v5 = torch.zeros(2, 1, 2, 16, 8, dtype=torch.float16, device=DEVICE)
    k = torch.zeros(1, 1, 16, dtype=torch.float16, device=DEVICE)
    k[0, 0, 9] = 3.0
    kvw.write_kv_5d(k5, v5, torch.tensor([21], device=DEVICE), k, k.clone())
    assert k5.nonzero().tolist() == [[1, 0, 1, 5, 1]]
    assert v5.nonzero().tolist() == [[1, 0, 0, 9, 5]]


def test_write_errors_name_the_argument():
    _, kvw = _triton()
    kc = torch.zeros(2, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="k has shape"):
        kvw.write_kv(kc, kc, torch.tensor([1], device=DEVICE), torch.zeros(1, 3, 16,
                     device=DEVICE), torch.zeros(1, 2, 16, device=DEVICE))
    with pytest.raises(TypeError, match="full_to_swa"):
        kvw.write_kv_translated(kc, kc, torch.tensor([1], device=DEVICE),
                                torch.zeros(1, 2, 16, device=DEVICE),
                                torch.zeros(1, 2, 16, device=DEVICE),
                                full_to_swa=torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="v_cache has shape"):
        kvw.write_kv_5d(torch.zeros(2, 2, 2, 4, 8, device=DEVICE),
                        torch.zeros(2, 2, 16, 5, device=DEVICE), torch.tensor([1], device=DEVICE),
                        torch.zeros(1, 2, 16, device=DEVICE), torch.zeros(1, 2, 16, device=DEVICE))


def test_registry_lists_triton_for_every_op():
    from aiter_attn.plugins import kernel_registry

    reg = kernel_registry()
    for op in ("build_page_table", "build_page_tables_swa", "build_ragged_kv_indices",
               "write_kv", "write_kv_swa", "write_kv_5d", "mla_paged_attention",
               "paged_attention_5d"):
        names = [i.name for i in reg.implementations(op)]
        assert "triton" in names and "reference" in names, (op, names)


# ------------------------------------------------------------------------------ GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "e4m3fn", "e5m2"])
@pytest.mark.parametrize("layout", ["nhd", "swa", "5d"])
def test_gpu_writes_bytes_equal_reference(cache, layout):
    """bf16 copies and fp8 quantisation (÷ scale, saturate, RNE) byte-equal the reference,
    including values past the fp8 range (saturated) and a scale given as a tensor."""
    _, kvw = _triton()
    cdt = {"bf16": torch.bfloat16, "e4m3fn": torch.float8_e4m3fn,
           "e5m2": torch.float8_e5m2}[cache]
    g = torch.Generator().manual_seed(7)
    pages, page, heads, d = 64, 16, 8, 128
    n = 200
    x = 16 // torch.empty((), dtype=cdt).element_size()
    src = (torch.randn(n, heads, d, generator=g) * 400).to(torch.bfloat16).cuda()
    vsrc = torch.randn(n, heads, d, generator=g).to(torch.bfloat16).cuda()
    slots = torch.randperm(pages * page, generator=g)[:n].cuda()
    ks, vs = 0.5, torch.tensor(0.03, device="cuda")
    nbytes = pages * page * heads * d * torch.empty((), dtype=cdt).element_size()
    # random bytes with the sign/exponent bits bounded so no slot holds NaN/inf patterns
    raw = torch.randint(0, 60, (2 * nbytes,), generator=g, dtype=torch.uint8)
    if layout == "5d":
        kc = raw[:nbytes].view(cdt).view(pages, heads, d // x, page, x)
        vc = raw[nbytes:].view(cdt).view(pages, heads, page // x, d, x)
    else:
        kc = raw[:nbytes].view(cdt).view(pages, page, heads, d)
        vc = raw[nbytes:].view(cdt).view(pages, page, heads, d)
    kc, vc = kc.cuda(), vc.cuda()
    a, b = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    if layout == "nhd":
        R.write_kv_reference(*a, slots, src, vsrc, k_scale=ks, v_scale=vs)
        kvw.write_kv(*b, slots, src, vsrc, k_scale=ks, v_scale=vs)
    elif layout == "swa":
        table = torch.randperm(pages * page, generator=g).cuda()
        RE.write_kv_translated_reference(*a, slots, src, vsrc, full_to_swa=table, k_scale=ks,
                                         v_scale=vs)
        kvw.write_kv_translated(*b, slots, src, vsrc, full_to_swa=table, k_scale=ks,
                                v_scale=vs)
    else:
        RE.write_kv_5d_reference(*a, slots, src, vsrc, k_scale=ks, v_scale=vs)
        kvw.write_kv_5d(*b, slots, src, vsrc, k_scale=ks, v_scale=vs)
    assert torch.equal(_bytes(a[0]), _bytes(b[0]))
    assert torch.equal(_bytes(a[1]), _bytes(b[1]))


@pytest.mark.gpu
def test_gpu_registry_prefers_triton_for_index_and_writes():
    from aiter_attn.kernels.registry import KernelRequest
    from aiter_attn.plugins import kernel_registry

    reg = kernel_registry()
    for op in ("build_page_table", "build_page_tables_swa", "build_ragged_kv_indices",
               "write_kv", "write_kv_swa", "write_kv_5d"):
        sel = reg.select(KernelRequest(op=op, device="cuda", kv_dtype=torch.float8_e4m3fn,
                                       features={"fp8"}))
        assert sel.impl.name == "triton", (op, sel)
    sel = reg.select(KernelRequest(op="mla_paged_attention", device="cuda", dtype=torch.bfloat16,
                                   head_dim=576, v_head_dim=512, page_size=64))
    assert sel.impl.name == "triton"
