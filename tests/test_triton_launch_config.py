"""Launch heuristics of the Triton kernels (host integers only; no kernel runs): shared-memory
fitting never exceeds the device budget, split counts stay in range, and the regimes pick
the page lookup that the H200 measurements chose (docs/triton_tuning.md)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn.kernels.triton import mla
from aiter_attn.kernels.triton import _launch_config as pa


@given(block_m=st.sampled_from([16, 32, 64, 128]), block_n=st.sampled_from([32, 64, 128]),
       stages=st.integers(2, 4), head_dim=st.sampled_from([64, 128, 256]),
       elem=st.sampled_from([2, 4]), budget=st.integers(48 * 1024, 228 * 1024))
def test_fit_smem_fits_or_stops_at_the_floor(block_m, block_n, stages, head_dim, elem, budget):
    bn, st_ = pa._fit_smem(block_m, block_n, stages, head_dim, elem, budget)
    need = st_ * bn * 2 * head_dim * elem + block_m * head_dim * elem
    assert need <= budget or (bn == 16 and st_ == 2)
    assert bn <= block_n and st_ <= stages  # only ever shrinks


def _cfg(**kw):
    base = dict(group=4, head_dim_pad=128, num_kv_heads=8, sms=132, ov=(), interpreting=False,
                fp32=False, fp8_kv=False, smem=227 * 1024)
    base.update(kw)
    return pa._choose_config_cached(base["group"], base["max_q"], base["max_k"],
                                    base["head_dim_pad"], base["batch"], base["num_kv_heads"],
                                    base["sms"], base["ov"], base["interpreting"], base["fp32"],
                                    base["fp8_kv"], base["smem"])


def test_regimes_pick_the_measured_page_lookup():
    prefill = _cfg(max_q=8192, max_k=8192, batch=1)
    assert (prefill.page_chunk, prefill.num_stages, prefill.block_n) == (16, 3, 128)
    assert _cfg(max_q=2048, max_k=2048, batch=8).block_n == 64
    decode = _cfg(max_q=1, max_k=4096, batch=64)
    assert decode.page_chunk == 0 and decode.num_splits >= 1
    # splits of at most two key tiles take the chunked lookup in chunks of 4 (H200 1x4k:
    # 1.39 -> 1.55 TB/s); longer splits (16x4k, 1x32k) keep the per-tile lookup
    short = _cfg(max_q=1, max_k=4096, batch=1)
    assert (short.num_splits, short.page_chunk) == (16, 4)
    for batch, max_k in ((16, 4096), (1, 32768)):
        assert _cfg(max_q=1, max_k=max_k, batch=batch).page_chunk == 0, (batch, max_k)
    assert _cfg(max_q=1, max_k=4096, batch=1, ov=(("page_chunk", 0),)).page_chunk == 0
    fp8 = _cfg(max_q=1, max_k=65536, batch=8, fp8_kv=True)
    assert fp8.page_chunk == 16
    assert fp8.num_splits * 8 * 8 <= 4 * 132  # whole waves: 8 requests x 8 KV heads
    small_smem = _cfg(max_q=8192, max_k=8192, batch=1, smem=64 * 1024)
    assert small_smem.num_stages * small_smem.block_n * 2 * 128 * 2 + 128 * 128 * 2 <= 64 * 1024


def test_one_wave_bf16_decode_runs_unsplit_on_the_carried_lookup():
    """About one wave of (request, KV head) programs (16x4k: 128 on 132 SMs): no splits and
    the carried page lookup (H200: 3.64 -> 3.82 TB/s). Fewer programs split as before, more
    stay on the plain per-tile lookup; fp8, float32, small shared memory and overrides of
    the knobs it sets keep their own choices."""
    one_wave = _cfg(max_q=1, max_k=4096, batch=16)
    assert (one_wave.num_splits, one_wave.page_ahead, one_wave.page_chunk) == (1, True, 0)
    assert _cfg(max_q=1, max_k=4096, batch=13).page_ahead  # 104 programs: >= 3/4 of a wave
    for batch, max_k in ((12, 4096), (8, 65536), (1, 32768), (64, 4096), (17, 4096),
                         (16, 512)):
        cfg = _cfg(max_q=1, max_k=max_k, batch=batch)
        assert not cfg.page_ahead, (batch, max_k)
    assert _cfg(max_q=1, max_k=4096, batch=8).num_splits > 1
    for kw in (dict(fp8_kv=True), dict(fp32=True), dict(smem=100 * 1024),
               dict(ov=(("num_splits", 2),)), dict(ov=(("page_ahead", False),)),
               dict(ov=(("block_n", 64),)), dict(sms=0)):
        assert not _cfg(max_q=1, max_k=4096, batch=16, **kw).page_ahead, kw


def test_slot_addressing_where_two_programs_per_sm_suffice():
    """bf16 decode takes slot-index addressing (H200: 1x4k 1.54 -> 1.70 TB/s, 64x4k 4.13 ->
    4.24) unsplit and where a split launch has at most two programs per SM; not where the
    splits need three per SM (8x64k: 320 programs, 213 registers would cost 4.28 -> 3.28),
    nor for fp8, float32 or prefill tiles (not timed with it)."""
    for batch, max_k in ((1, 4096), (1, 32768), (16, 4096), (64, 4096), (256, 4096),
                         (64, 16384)):
        assert _cfg(max_q=1, max_k=max_k, batch=batch).flat_slots, (batch, max_k)
    for batch, max_k in ((8, 65536), (12, 4096), (4, 16384)):
        cfg = _cfg(max_q=1, max_k=max_k, batch=batch)
        assert cfg.num_splits * batch * 8 > 2 * 132 and not cfg.flat_slots, (batch, max_k)
    for kw in (dict(fp8_kv=True), dict(fp32=True), dict(max_q=2048, max_k=2048, batch=8)):
        args = dict(max_q=1, max_k=4096, batch=64)
        args.update(kw)
        assert not _cfg(**args).flat_slots, kw


@pytest.mark.parametrize("heads,tokens", [(16, 64), (16, 128), (128, 64), (16, 1)])
def test_mla_splits_fill_the_sms_once(monkeypatch, heads, tokens):
    monkeypatch.setattr(mla, "_smem_budget", lambda device: 227 * 1024 - 4096)
    monkeypatch.setattr(mla, "num_sms", lambda device: 132)
    bh, bn, splits, warps, stages = mla.mla_launch_config(heads, tokens, 8192,
                                                          torch.device("cpu"))
    programs = tokens * -(-heads // bh)
    ring = stages * bn * 576 * 2
    resident = 2 if 2 * ring <= 227 * 1024 - 4096 and warps <= 4 else 1
    assert 1 <= splits <= 64
    assert programs * splits <= max(resident * 132, programs)
    assert ring <= 227 * 1024 - 4096
    if (heads, tokens) == (16, 64):  # the H200's best measured: 32-key tiles, 4 splits
        assert (bh, bn, warps, stages, splits) == (16, 32, 4, 3, 4)


def test_mla_fp8_cache_counts_both_converted_tiles(monkeypatch):
    """H200, 16 heads, fp8 latent cache, bf16 q: Triton needs the ring plus one converted
    tile per dot (measured 253,952 B at block_n 64 × 3 stages, over the 232,448 B limit). The
    config must drop to a pipeline that fits with both tiles counted."""
    budget = 232448 - 4096
    monkeypatch.setattr(mla, "_smem_budget", lambda device: budget)
    monkeypatch.setattr(mla, "num_sms", lambda device: 132)
    bh, bn, splits, warps, stages = mla.mla_launch_config(
        16, 1, 4096, torch.device("cpu"), elem_size=2, kv_elem_size=1)
    assert stages * bn * 576 * 1 + 2 * bn * 576 * 2 <= budget
    assert (bn, stages) != (64, 3)  # the measured failing configuration
