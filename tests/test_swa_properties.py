"""Property tests of the SWA strategies (hypothesis): SWA page tables are the translation of
``req_to_token``, eager and static-buffer planning agree, KV writes touch only the batch's slots
in both pools, and padded or fully masked rows never produce NaN."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn import (
    AttentionBackend,
    BackendConfig,
    ForwardBatch,
    ForwardMode,
    SpecDecodeConfig,
    SpecInfo,
)

from .test_swa import hybrid_layers, make_swa_scenario

DRAFT_MODES = (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)


@st.composite
def swa_steps(draw, *, modes=tuple(ForwardMode)):
    """A hybrid-SWA scenario's shape and one step: page size, window, cached prefixes, the mode
    and its per-request new-token counts, and whether out-of-window pages were freed first."""
    mode = draw(st.sampled_from([m for m in modes if m != ForwardMode.IDLE]))
    page_size = draw(st.sampled_from([1, 3, 4]))
    window = draw(st.integers(1, 9))
    bs = draw(st.integers(1, 4))
    prefixes = draw(st.lists(st.integers(0, 24), min_size=bs, max_size=bs))
    if mode == ForwardMode.DECODE:
        new = [1] * bs
    elif mode in DRAFT_MODES:
        new = [draw(st.integers(1, 3))] * bs
    else:
        new = [draw(st.integers(0 if p else 1, 6)) for p in prefixes]
    free_first = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return dict(mode=mode, page_size=page_size, window=window, prefixes=prefixes, new=new,
                free_first=free_first, seed=seed)


def build(case, *, dtype=torch.float32, tree=False):
    spec_cfg = SpecDecodeConfig(topk=2, num_draft_tokens=case["new"][0]) if tree else None
    cfg = BackendConfig(page_size=case["page_size"], max_batch_size=8, max_context_len=64,
                        dtype=dtype, arch="swa", spec=spec_cfg)
    layers = hybrid_layers(4, 2, 8, [case["window"], None])
    sc = make_swa_scenario(cfg, layers, case["prefixes"], seed=case["seed"], extra_tokens=16)
    if case["free_first"]:
        for row in sc.rows:
            sc.allocator.free_swa_out_of_window(row, case["window"])
    spec = SpecInfo(num_draft_tokens=case["new"][0]) if case["mode"] in DRAFT_MODES else None
    batch = sc.next_batch(case["mode"], case["new"], spec_info=spec)
    return sc, AttentionBackend(cfg, sc.req_pool, sc.kv_pool), batch


@given(swa_steps())
def test_swa_page_table_is_the_translation_of_req_to_token(case):
    """For every request and page: the SWA page id is ``full_to_swa[first slot] // P``, each
    token's translated slot lies at its offset in that page (or the page is freed and maps to
    0), every key some query of this step can see is still mapped, unused entries are 0, and
    planning into larger static buffers gives the same table."""
    sc, be, batch = build(case)
    md = be.init_forward_metadata(batch)
    ps, w = case["page_size"], case["window"]
    mapping = sc.kv_pool.full_to_swa_index_mapping
    r2t = sc.req_pool.req_to_token.long()
    swa_bt = md.extras["swa_pages"].block_table
    for b, (row, L, q) in enumerate(zip(sc.rows, batch.seq_lens_cpu.tolist(),
                                        batch.q_lens_cpu.tolist())):
        used = -(-L // ps)
        slots = r2t[row, :L]
        swa_slots = mapping[slots]
        page_of = swa_bt[b, torch.arange(L) // ps].long()
        live = swa_slots != 0
        assert torch.equal(swa_slots[live], page_of[live] * ps + torch.arange(L)[live] % ps)
        assert not page_of[~live].any()
        first_seen = max(0, L - q - w + 1)  # the step's first query sees keys from here on
        assert bool(live[first_seen:].all()), "a visible key lost its SWA slot"
        assert bool((swa_bt[b, :used][swa_bt[b, :used] > 0] < sc.kv_pool.swa.num_pages).all())
        assert not swa_bt[b, used:].any()
    planner, _ = be.strategies_for(batch.forward_mode)
    static = planner.buffer_spec(8, 64, 64).allocate("cpu")
    md2 = planner.plan(batch, out=static)
    width = swa_bt.shape[1]
    assert torch.equal(md2.extras["swa_pages"].block_table[:, :width], swa_bt)
    assert not md2.extras["swa_pages"].block_table[:, width:].any()


@given(swa_steps(), st.sampled_from([torch.float32, torch.float16]))
def test_kv_writes_touch_only_the_batch_slots_in_both_pools(case, dtype):
    """After a forward of every layer, the full pool differs only at ``out_cache_loc`` (full
    layers) and the SWA pool only at the translated slots (SWA layers); those hold the new K/V."""
    sc, be, batch = build(case, dtype=dtype)
    pool = sc.kv_pool
    before = {name: [b.clone() for b in sub.k_buffers + sub.v_buffers]
              for name, sub in (("full", pool.full), ("swa", pool.swa))}
    be.init_forward_metadata(batch)
    written = {}
    for layer in sc.layers:
        q, k, v = sc.step_inputs(layer)
        be.forward(q, k, v, layer, batch)
        written[layer.layer_id] = k.view(-1, layer.num_kv_heads, layer.head_dim)
    full_slots = batch.out_cache_loc.long()
    for name, slots in (("full", full_slots), ("swa", pool.translate(full_slots))):
        sub = getattr(pool, name)
        touched = torch.zeros(sub.num_slots, dtype=torch.bool)
        touched[slots] = True
        for old, new in zip(before[name], sub.k_buffers + sub.v_buffers):
            o, n = old.view(sub.num_slots, -1), new.view(sub.num_slots, -1)
            assert torch.equal(o[~touched].view(torch.uint8), n[~touched].view(torch.uint8))
    for layer in sc.layers:
        kc, _ = pool.kv_buffers(layer.layer_id)
        slots = pool.translate(full_slots) if pool.is_swa_layer(layer.layer_id) else full_slots
        assert torch.equal(kc.view(-1, *kc.shape[2:])[slots], written[layer.layer_id].to(kc.dtype))


@given(swa_steps(modes=(ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)),
       st.integers(1, 3), st.data())
def test_padded_and_fully_masked_rows_are_finite(case, pad, data):
    """Graph-style padding rows (request row 0, KV length 1, the null slot) and, for verify, a
    random tree-shaped mask with fully masked rows: every output is finite and a row with no
    visible key is exactly zero."""
    tree = case["mode"] == ForwardMode.TARGET_VERIFY
    sc, be, real = build(case, tree=tree)
    bs, n = real.batch_size, real.q_lens_cpu[0].item()
    seq = real.seq_lens_cpu.tolist() + [n] * pad  # padding rows hold only their own tokens
    spec = None
    masks = None
    if real.forward_mode == ForwardMode.TARGET_VERIFY:
        masks = []
        for L in seq:
            m = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n * L, max_size=n * L)))
            masks.append(m.view(n, L))
        masks[0][0] = False  # at least one fully masked row
        spec = SpecInfo(num_draft_tokens=n, topk=2,
                        custom_mask=torch.cat([m.reshape(-1) for m in masks]))
    batch = ForwardBatch.from_lengths(
        forward_mode=real.forward_mode, req_pool_indices=list(sc.rows) + [0] * pad, seq_lens=seq,
        out_cache_loc=torch.cat([real.out_cache_loc, torch.zeros(pad * n, dtype=torch.int64)]),
        extend_seq_lens=[n] * (bs + pad), spec_info=spec)
    sc.batch = batch
    be.init_forward_metadata(batch)
    for layer in sc.layers:
        q, k, v = sc.step_inputs(layer)
        out = be.forward(q, k, v, layer, batch).view(-1, layer.num_q_heads, layer.head_dim)
        assert torch.isfinite(out).all()
        if masks is not None:
            assert not out[0].any(), "a fully masked row must be zero"


@given(swa_steps(modes=(ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                        ForwardMode.DRAFT_EXTEND_V2)), st.booleans())
def test_decode_like_planning_is_sync_free(case, tree):
    """SWA planning of DECODE / TARGET_VERIFY (chain and tree) / DRAFT_EXTEND_V2, eager and into
    static buffers, and the tree-mask windowing SWA execution does, complete with every device
    tensor on ``meta`` (any host read of device data raises there)."""
    import attrs

    from aiter_attn.strategies import swa as swa_strategies
    from aiter_attn.testing.nosync import meta_context, to_meta_batch

    tree = tree and case["mode"] == ForwardMode.TARGET_VERIFY
    sc, be, batch = build(case, tree=tree)
    if tree:
        n = batch.q_lens_cpu[0].item()
        total = n * batch.seq_lens_sum
        batch.spec_info = SpecInfo(num_draft_tokens=n, topk=2,
                                   custom_mask=torch.ones(total, dtype=torch.bool))
    meta_batch = to_meta_batch(batch)
    pool = sc.kv_pool
    meta_pool = attrs.evolve(pool, full_to_swa_index_mapping=torch.empty_like(
        pool.full_to_swa_index_mapping, device="meta"))
    ctx = meta_context(attrs.evolve(be.ctx, kv_pool=meta_pool))
    mode = batch.forward_mode
    planner = {
        ForwardMode.DECODE: swa_strategies.SWADecodeMetadata,
        ForwardMode.TARGET_VERIFY: (swa_strategies.SWAVerifyTreeMetadata if tree
                                    else swa_strategies.SWAVerifyChainMetadata),
        ForwardMode.DRAFT_EXTEND_V2: swa_strategies.SWADraftExtendV2Metadata,
    }[mode]
    # (VEC5D plans with the MHA/spec planners these wrap; their own tests run them on meta.)
    for static in (False, True):
        out = planner(ctx).buffer_spec(8, 64, 64).allocate("meta") if static else None
        md = planner(ctx).plan(meta_batch, out=out)
        assert md.extras["swa_pages"].block_table.device.type == "meta"
        assert md.pages.block_table.device.type == "meta"
        if md.mask is not None:
            wm = swa_strategies.window_tree_mask(md.mask, meta_batch, md.query, case["window"])
            assert wm.custom_mask.device.type == "meta"
    assert md.query.cu_seqlens_q.shape == (batch.batch_size + 1,)
