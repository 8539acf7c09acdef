"""Property tests (hypothesis) of the MLA metadata strategies, latent writes and head padding."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn import AttentionBackend, ForwardBatch, ForwardMode, MLAKVPool, SpecInfo
from aiter_attn.kernels.registry import KernelRequest
from aiter_attn.strategies.base import StrategyContext
from aiter_attn.strategies.mla import (HeadPadding, MLADecodeMetadata, MLADraftExtendV2Metadata,
                                       MLAExtendMetadata, MLAVerifyMetadata, mla_layer_specs,
                                       select_mla_kernel)
from aiter_attn.testing.invariants import check_indptr, check_invariants
from aiter_attn.testing.nosync import meta_context, to_meta_batch
from aiter_attn.testing.strategies import paged_batches

from .test_mla import MLAScenario, _registry_with_wide_kernel

LORA, ROPE = 16, 8

PLANNERS = {
    ForwardMode.DECODE: MLADecodeMetadata,
    ForwardMode.TARGET_VERIFY: MLAVerifyMetadata,
    ForwardMode.DRAFT_EXTEND_V2: MLADraftExtendV2Metadata,
    ForwardMode.EXTEND: MLAExtendMetadata,
    ForwardMode.DRAFT_EXTEND: MLAExtendMetadata,
}


def _ctx(pb, tree: bool = False):
    """An MLA context over ``pb``; ``tree``: a config that verifies trees (the config, not the
    batch, chooses chain vs tree)."""
    pool = MLAKVPool(pb.allocator.num_pages, pb.config.page_size, LORA, ROPE, 1,
                     dtype=torch.float32)
    from aiter_attn import SpecDecodeConfig
    from aiter_attn.plugins import kernel_registry

    spec = pb.config.spec or SpecDecodeConfig(num_draft_tokens=16)
    spec = attrs.evolve(spec, topk=2 if tree else 1)
    return StrategyContext(config=attrs.evolve(pb.config, arch="mla", spec=spec),
                           req_to_token=pb.req_pool.req_to_token, kv_pool=pool,
                           kernels=kernel_registry())


def _with_spec(batch: ForwardBatch, n: int, tree: bool, generator=None) -> ForwardBatch:
    """Attach SpecInfo (and for trees a random flat mask of the right size)."""
    mask = None
    if tree:
        total = n * int(batch.seq_lens_cpu.sum())
        mask = torch.rand(total, generator=generator) < 0.5
    return attrs.evolve(batch, spec_info=SpecInfo(num_draft_tokens=n, topk=2 if tree else 1,
                                                  custom_mask=mask))


@st.composite
def uniform_batches(draw):
    """``(mode, PagedBatch with spec_info, q_len, tree)`` for the decode-like MLA modes."""
    mode = draw(st.sampled_from([ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                                 ForwardMode.DRAFT_EXTEND_V2]))
    n = 1 if mode == ForwardMode.DECODE else draw(st.integers(1, 5))
    tree = mode == ForwardMode.TARGET_VERIFY and draw(st.booleans())
    pb = draw(paged_batches(mode=mode, draft_tokens=n, max_prefix=100))
    if mode != ForwardMode.DECODE:
        g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
        pb.batch = _with_spec(pb.batch, n, tree, g)
    return mode, pb, n, tree


@given(case=uniform_batches())
def test_uniform_plans_invariants(case):
    """Decode / verify / draft-extend-v2 plans: cu_seqlens_q = b·q_len, page table equals
    req_to_token's pages (inside the pool, null page past the end), seqused_k = seq_lens, and a
    tree's mask_indptr = [0, cumsum(q_len · seq_len)]."""
    mode, pb, n, tree = case
    ctx = _ctx(pb, tree)
    md = PLANNERS[mode](ctx).plan(pb.batch)
    check_invariants(md, pb.batch, ctx)
    bs = pb.batch.batch_size
    assert torch.equal(md.query.cu_seqlens_q.long(), torch.arange(bs + 1) * n)
    assert md.query.max_seqlen_q == n
    if tree:
        check_indptr("mask_indptr", md.mask.mask_indptr, pb.batch.seq_lens_cpu * n)
    else:
        assert md.mask is None


@given(case=uniform_batches(), extra_bs=st.integers(0, 3))
def test_static_buffers_plan_equals_eager(case, extra_bs):
    """Planning into graph-sized static buffers gives the eager metadata and returns views of
    those buffers (no reallocation)."""
    mode, pb, n, tree = case
    planner = PLANNERS[mode](_ctx(pb, tree))
    eager = planner.plan(pb.batch)
    bs = pb.batch.batch_size
    spec = planner.buffer_spec(bs + extra_bs, (bs + extra_bs) * n, pb.config.max_context_len)
    bufs = spec.allocate("cpu")
    static = planner.plan(pb.batch, out=bufs)
    assert static.pages.block_table.data_ptr() == bufs["block_table"].data_ptr()
    assert static.query.cu_seqlens_q.data_ptr() == bufs["cu_seqlens_q"].data_ptr()
    assert torch.equal(static.query.cu_seqlens_q, eager.query.cu_seqlens_q)
    assert torch.equal(static.pages.seqused_k, eager.pages.seqused_k)
    width = eager.pages.block_table.shape[1]
    assert torch.equal(static.pages.block_table[:, :width], eager.pages.block_table)
    assert not static.pages.block_table[:, width:].any()
    assert static.pages.max_seqlen_k >= eager.pages.max_seqlen_k
    if tree:
        assert static.mask.mask_indptr.data_ptr() == bufs["mask_indptr"].data_ptr()
        assert torch.equal(static.mask.mask_indptr, eager.mask.mask_indptr)
        total = n * pb.batch.seq_lens_sum
        assert static.mask.custom_mask.data_ptr() == bufs["custom_mask"].data_ptr()
        assert torch.equal(static.mask.custom_mask[:total], eager.mask.custom_mask[:total])


@given(case=uniform_batches())
def test_uniform_plans_are_sync_free(case):
    """Decode-like MLA planning completes with every device tensor on ``meta``: it never reads
    device data back on the host."""
    mode, pb, n, tree = case
    ctx = meta_context(_ctx(pb, tree))
    md = PLANNERS[mode](ctx).plan(to_meta_batch(pb.batch))
    assert md.pages.block_table.device.type == "meta"
    assert md.query.num_tokens == pb.batch.batch_size * n


@given(pb=st.sampled_from([ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND]).flatmap(
    lambda m: paged_batches(mode=m, max_prefix=100)))
def test_extend_plan_maps_every_key_to_its_slot(pb):
    """Expanded-form extend plan: prefix_indptr counts each request's prefix; key j of request b
    sits in dense row ``dense_block_table[b, j]`` of ``[prefix K/V ; new K/V]`` and that row's
    latent slot is ``req_to_token[row_b, j]``."""
    ctx = _ctx(pb)
    md = MLAExtendMetadata(ctx).plan(pb.batch)
    check_invariants(md, pb.batch, ctx)
    plan = md.extras["mla_prefix"]
    check_indptr("prefix_indptr", plan.prefix_indptr, torch.as_tensor(pb.prefix_lens))
    assert plan.num_prefix_tokens == sum(pb.prefix_lens)
    slot_of_row = torch.cat([plan.prefix_slots.long(), pb.batch.out_cache_loc.long()])
    r2t = ctx.req_to_token.long()
    for b, (row, length) in enumerate(zip(pb.batch.req_pool_indices.tolist(),
                                          pb.batch.seq_lens_cpu.tolist())):
        rows = plan.dense_block_table[b, :length].long()
        assert torch.equal(slot_of_row[rows], r2t[row, :length])
        assert not plan.dense_block_table[b, length:].any()


@given(slots=st.lists(st.integers(0, 4 * 5 - 1), min_size=0, max_size=12, unique=True),
       fp8=st.booleans(), seed=st.integers(0, 100))
def test_latent_write_touches_only_its_slots(slots, fp8, seed):
    """``MLAKVPool.write_latent`` changes exactly the given slots; every other byte is kept."""
    dtype = getattr(torch, "float8_e4m3fn", torch.float16) if fp8 else torch.float16
    pool = MLAKVPool(4, 5, LORA, ROPE, 2, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for layer in range(2):
        buf = pool.kv_buffer(layer)
        buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    before = [pool.kv_buffer(i).clone() for i in range(2)]
    idx = torch.as_tensor(slots, dtype=torch.int64)
    pool.write_latent(1, idx, torch.randn(len(slots), LORA + ROPE, generator=g), kv_scale=0.5)
    assert torch.equal(pool.kv_buffer(0).view(torch.uint8), before[0].view(torch.uint8))
    after = pool.kv_buffer(1).view(-1, LORA + ROPE).view(torch.uint8)
    old = before[1].view(-1, LORA + ROPE).view(torch.uint8)
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(after[untouched], old[untouched])


@given(pad_to=st.sampled_from([16, 32]), heads=st.integers(1, 40),
       policy=st.sampled_from(["auto", "always", "never"]))
def test_head_padding_factor(pad_to, heads, policy):
    """A padded head count is exactly ``pad_to``; heads outside ``pad_from`` are never padded."""
    hp = HeadPadding(pad_to=pad_to, pad_from={4, 8}, policy=policy)
    f = hp.factor(heads)
    if policy != "never" and heads in (4, 8):
        assert f * heads == pad_to
    else:
        assert f == 1


@pytest.mark.parametrize("heads,want_kernel,want_factor", [
    pytest.param(4, "wide16", 4, id="H4-padded"),
    pytest.param(8, "wide16", 2, id="H8-padded"),
    pytest.param(16, "wide16", 1, id="H16-native"),
    pytest.param(5, "reference", 1, id="H5-fallback"),
])
def test_auto_padding_selection(heads, want_kernel, want_factor):
    """Auto policy: 4/8 heads pad to reach the ≥16-heads kernel; other counts fall back."""
    reg = _registry_with_wide_kernel([])

    def request(h):
        return KernelRequest(op="mla_paged_attention", dtype=torch.float32,
                             kv_dtype=torch.float32, head_dim=LORA + ROPE, v_head_dim=LORA,
                             page_size=16, extra=(("heads", h),))

    sel, factor = select_mla_kernel(reg, request, heads, HeadPadding())
    assert (sel.impl.name, factor) == (want_kernel, want_factor)
    sel, factor = select_mla_kernel(reg, request, heads, HeadPadding(policy="never"))
    assert factor == 1


@given(heads=st.sampled_from([4, 8]), page_size=st.sampled_from([1, 7, 64]),
       prefixes=st.lists(st.integers(0, 20), min_size=1, max_size=3),
       n=st.integers(1, 3), seed=st.integers(0, 1000))
def test_padding_is_invisible(heads, page_size, prefixes, n, seed):
    """Padded (4/8 → 16 heads) and unpadded absorbed verify outputs are bit-identical."""
    outs = []
    for policy in ("always", "never"):
        sc = MLAScenario(page_size=page_size, heads=heads, lora=LORA, rope=ROPE, nope=8, dv=8,
                         prefix_lens=prefixes, seed=seed, padding=HeadPadding(policy=policy))
        sc.next_batch(ForwardMode.TARGET_VERIFY, [n] * len(prefixes),
                      SpecInfo(num_draft_tokens=n))
        sc.backend.init_forward_metadata(sc.batch)
        q, k = sc.absorbed_inputs()
        outs.append(sc.backend.forward(q, k, None, sc.absorbed, sc.batch))
    assert torch.equal(outs[0], outs[1])


@given(pb=paged_batches(mode=ForwardMode.DECODE, max_prefix=60), pad_rows=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_graph_padding_rows_are_harmless(pb, pad_rows, seed):
    """Rows added the way graph replay pads a batch (req row 0, seq_len 1, dummy slot 0) give
    finite output and leave the real rows' output unchanged."""
    g = torch.Generator().manual_seed(seed)
    pool = MLAKVPool(pb.allocator.num_pages, pb.config.page_size, LORA, ROPE, 1,
                     dtype=torch.float32)
    pool.kv_buffer(0).copy_(torch.randn(pool.kv_buffer(0).shape, generator=g))
    cfg = attrs.evolve(pb.config, arch="mla")
    layer, _ = mla_layer_specs(0, num_heads=4, kv_lora_rank=LORA, qk_nope_head_dim=8,
                               qk_rope_head_dim=ROPE, v_head_dim=8, scaling=(8 + ROPE) ** -0.5)
    b = pb.batch
    padded = ForwardBatch.from_lengths(
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=b.req_pool_indices.tolist() + [0] * pad_rows,
        seq_lens=b.seq_lens_cpu.tolist() + [1] * pad_rows,
        out_cache_loc=torch.cat([b.out_cache_loc, torch.zeros(pad_rows, dtype=torch.int64)]))
    bs = b.batch_size
    q = torch.randn(bs + pad_rows, 4 * (LORA + ROPE), generator=g)
    outs = []
    for batch, qq in ((b, q[:bs]), (padded, q)):
        be = AttentionBackend(cfg, pb.req_pool, pool)
        be.init_forward_metadata(batch)
        outs.append(be.forward(qq, None, None, layer, batch, save_kv_cache=False))
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[1][:bs], outs[0])
