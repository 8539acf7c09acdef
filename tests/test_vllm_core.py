"""The vLLM integration's engine-independent half (aiter_attn/integrations/vllm/core.py) and its
entry point, without vLLM: cache views in vLLM's layout, metadata mapping, the K/V write and
attention against the reference on an equivalent plain cache. The served end-to-end test is
tests/test_vllm_e2e.py (in the vLLM virtualenv)."""

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from aiter_attn import ops
from aiter_attn.integrations.vllm import core
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.types import CGSupport


def _vllm_cache(num_blocks, num_kv_heads, block_size, d, dv, *, token_major=True,
                dtype=torch.float32):
    """A per-layer cache as vLLM 0.32 builds it: logical [B, H, N, D + Dv] over a flat
    buffer laid out LBNHC (token-major pages) or LBHNC (head-major)."""
    c = d + dv
    raw = torch.randn(num_blocks * block_size * num_kv_heads * c, dtype=dtype)
    if token_major:
        return raw.view(num_blocks, block_size, num_kv_heads, c).permute(0, 2, 1, 3)
    return raw.view(num_blocks, num_kv_heads, block_size, c)


def test_kv_cache_views_share_vllm_memory():
    """K and V views are [B, N, H, D] windows of vLLM's own buffer: a write through them is a
    write to vLLM's cache, with K in the first D and V in the last Dv of each cell."""
    kv = _vllm_cache(5, 3, 48, 80, 64)
    k, v = core.kv_cache_views(kv, 80, 64)
    assert k.shape == (5, 48, 3, 80) and v.shape == (5, 48, 3, 64)
    assert k.data_ptr() == kv.data_ptr()
    k[2, 7, 1].fill_(1.5)
    v[2, 7, 1].fill_(-2.5)
    assert torch.all(kv[2, 1, 7, :80] == 1.5) and torch.all(kv[2, 1, 7, 80:] == -2.5)


def test_kv_cache_views_reject_packed_content():
    kv = _vllm_cache(2, 1, 16, 32, 32)
    with pytest.raises(ValueError, match="head_size=32 \\+ head_size_v=16"):
        core.kv_cache_views(kv, 32, 16)
    with pytest.raises(ValueError, match="per-layer"):
        core.kv_cache_views(kv[0], 32)


@pytest.mark.parametrize("sliding_window,expected", [(None, (-1, -1)), (1, (0, 0)),
                                                     (16, (15, 0))])
def test_window_from_vllm(sliding_window, expected):
    assert core.window_from_vllm(sliding_window) == expected


def test_window_from_vllm_rejects_bad():
    with pytest.raises(ValueError, match="sliding_window=0"):
        core.window_from_vllm(0)


def _common(q_lens, kv_lens, *, block_table, slot_mapping, causal=True, pad_reqs=0):
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()) + [sum(q_lens)] * pad_reqs,
                      dtype=torch.int32)
    return SimpleNamespace(
        query_start_loc=cu, seq_lens=torch.tensor(list(kv_lens) + [0] * pad_reqs,
                                                  dtype=torch.int32),
        num_reqs=len(q_lens) + pad_reqs, num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens), max_seq_len=max(kv_lens), block_table_tensor=block_table,
        slot_mapping=slot_mapping, causal=causal)


def test_metadata_passes_vllm_tensors_through():
    bt = torch.zeros(3, 4, dtype=torch.int32)
    sm = torch.arange(9, dtype=torch.int64)
    common = _common([1, 5, 3], [7, 5, 30], block_table=bt, slot_mapping=sm)
    md = core.metadata_from_common(common)
    assert md.cu_seqlens_q is common.query_start_loc and md.seqused_k is common.seq_lens
    assert md.block_table is bt and md.slot_mapping is sm
    assert (md.num_actual_tokens, md.max_seqlen_q, md.max_seqlen_k, md.causal) == (9, 5, 30,
                                                                                True)
    bt2, sm2 = bt.clone(), sm.clone()
    md2 = md.with_block_table(bt2, sm2)
    assert md2.block_table is bt2 and md2.slot_mapping is sm2 and md.block_table is bt


def test_metadata_capture_hints_hold_for_every_replay():
    """Under capture the grid hints are kept only where replays share them: the query length
    of a uniform batch, never the KV length."""
    bt, sm = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)
    uniform = core.metadata_from_common(_common([2, 2, 2, 2], [5, 9, 3, 2], block_table=bt,
                                                slot_mapping=sm), capturing=True)
    assert (uniform.max_seqlen_q, uniform.max_seqlen_k) == (2, None)
    mixed = core.metadata_from_common(_common([5, 1, 1, 1], [5, 9, 3, 2], block_table=bt,
                                              slot_mapping=sm), capturing=True)
    assert (mixed.max_seqlen_q, mixed.max_seqlen_k) == (None, None)


def test_metadata_rejects_per_request_causal():
    common = _common([2], [2], block_table=torch.zeros(1, 1, dtype=torch.int32),
                     slot_mapping=torch.zeros(2, dtype=torch.int64),
                     causal=torch.tensor([True]))
    with pytest.raises(NotImplementedError, match="per-request causal"):
        core.metadata_from_common(common)


@pytest.mark.parametrize("token_major", [True, False], ids=["LBNHC", "LBHNC-strided"])
def test_write_kv_cache_writes_slots_and_skips_padding(token_major):
    """Exactly the batch's slots are written into vLLM's cache; -1 (padding) rows are not.
    Head-major pages (LBHNC: our [B, N, H, D] view strided, not the layout we declare) are
    written at their (page, row) as well: the writer never flattens the pages."""
    kv = _vllm_cache(4, 2, 16, 32, 32, token_major=token_major)
    before = kv.clone()
    params = core.AttnLayerParams(num_heads=4, num_kv_heads=2, head_size=32, head_size_v=32,
                                  scale=1.0)
    key, value = torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    slots = torch.tensor([17, 3, -1, 63, -1])
    core.write_kv_cache(params, kv, key, value, slots)
    written = torch.zeros(4, 16, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, 16)
        written[b, o] = True
        assert torch.equal(kv[b, :, o, :32], key[t]) and torch.equal(kv[b, :, o, 32:], value[t])
    untouched = ~written
    assert torch.equal(kv.permute(0, 2, 1, 3)[untouched], before.permute(0, 2, 1, 3)[untouched])


@pytest.mark.parametrize("window,softcap,with_sinks", [((-1, -1), 0.0, False),
                                                       ((15, 0), 0.0, True),
                                                       ((-1, -1), 5.0, False)],
                         ids=["plain", "window-sinks", "softcap"])
def test_run_attention_matches_reference_on_plain_cache(window, softcap, with_sinks):
    """Attention read in place from vLLM's layout equals ops.paged_attention on the same K/V
    copied to a contiguous NHD cache (GQA 5:1, head dim 80, page 48, null block 0,
    block-permuted tables, a zero-length padding request)."""
    torch.manual_seed(0)
    hq, hkv, d, page = 10, 2, 80, 48
    q_lens, kv_lens = [1, 7, 60], [50, 7, 130]
    nblocks = 12
    kv = _vllm_cache(nblocks, hkv, page, d, d)
    perm = (torch.randperm(nblocks - 1) + 1).tolist()  # block 0 = null block
    table = torch.zeros(4, 3, dtype=torch.int32)
    for b, n in enumerate(kv_lens):
        for i in range(-(-n // page)):
            table[b, i] = perm.pop()
    common = _common(q_lens, kv_lens, block_table=table,
                     slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64), pad_reqs=1)
    md = core.metadata_from_common(common)
    params = core.AttnLayerParams(num_heads=hq, num_kv_heads=hkv, head_size=d, head_size_v=d,
                                  scale=d ** -0.5, window_size=window, softcap=softcap)
    sinks = torch.randn(hq) if with_sinks else None
    n = sum(q_lens)
    query = torch.randn(n + 3, hq, d)  # 3 padded rows past num_actual_tokens
    output = torch.full((n + 3, hq, d), 7.0)
    core.run_attention(params, md, query, kv, output, sinks=sinks)
    k_plain, v_plain = (t.contiguous() for t in core.kv_cache_views(kv, d, d))
    expected = ops.paged_attention(
        query[:n], k_plain, v_plain, cu_seqlens_q=common.query_start_loc,
        seqused_k=common.seq_lens, block_table=table, softmax_scale=d ** -0.5,
        window_size=window, softcap=softcap, sinks=sinks, backend="reference")
    torch.testing.assert_close(output[:n], expected, rtol=1e-5, atol=1e-5)
    assert torch.all(output[n:] == 7.0)


def test_paged_attention_support_reports_kernel_level(monkeypatch):
    """The builder's CUDA-graph level is the picked kernel's; no kernel -> NEVER and why."""
    level, reason = core.paged_attention_support(device="cpu", dtype=torch.float32,
                                                 head_size=64, page_size=32)
    assert reason is None and level == CGSupport.NEVER  # the CPU reference: no graphs
    from aiter_attn.kernels.registry import Capabilities, KernelRegistry

    gpu_only = KernelRegistry()
    gpu_only.register("paged_attention", "gpu", lambda *a, **k: None,
                      Capabilities(devices={"cuda"}, features={"window"},
                                   cg_support=CGSupport.ALWAYS))
    monkeypatch.setattr(core, "kernel_registry", lambda: gpu_only)
    assert core.paged_attention_support(device="cuda", dtype=torch.float16, head_size=128,
                                        sliding_window=True) == (CGSupport.ALWAYS, None)
    level, reason = core.paged_attention_support(device="cuda", dtype=torch.float16,
                                                 head_size=128, sinks=True)
    assert level == CGSupport.NEVER and "sinks" in reason


def _attn_spec(head_size, *, dtype=torch.float16, block_size=16, sliding_window=None):
    """A stand-in for vLLM's per-layer ``FullAttentionSpec`` / ``SlidingWindowSpec``."""
    spec = SimpleNamespace(block_size=block_size, num_kv_heads=2, head_size=head_size,
                           head_size_v=head_size, dtype=dtype)
    if sliding_window is not None:
        spec.sliding_window = sliding_window
    return spec


def test_group_cudagraph_support_reads_uniform_type_group_specs(monkeypatch):
    """vLLM's V1 runner asks the builder's CUDA-graph level with the group's spec, which is a
    ``UniformTypeKVCacheSpecs`` (per-layer specs in ``kv_cache_specs``, no dtype / head_size of
    its own) when the group's layers differ in head count or size: the level is the weakest
    over those layers, and a single layer's spec is read as before."""
    from aiter_attn.kernels.registry import Capabilities, KernelRegistry

    reg = KernelRegistry()
    reg.register("paged_attention", "gpu", lambda *a, **k: None,
                 Capabilities(devices={"cuda"}, max_head_dim=128, features={"window"},
                              cg_support=CGSupport.ALWAYS), priority=10)
    reg.register("paged_attention", "slow", lambda *a, **k: None,
                 Capabilities(devices={"cuda"}, features={"window"},
                              cg_support=CGSupport.NEVER))
    monkeypatch.setattr(core, "kernel_registry", lambda: reg)
    small, big = _attn_spec(64), _attn_spec(256)
    assert core.group_cudagraph_support(small, device="cuda") == CGSupport.ALWAYS
    assert core.group_cudagraph_support(big, device="cuda") == CGSupport.NEVER
    uniform = SimpleNamespace(block_size=16, kv_cache_specs={"l0": small, "l1": _attn_spec(128)})
    assert core.group_cudagraph_support(uniform, device="cuda") == CGSupport.ALWAYS
    mixed = SimpleNamespace(block_size=16, kv_cache_specs={"l0": small, "l1": big})
    assert core.group_cudagraph_support(mixed, device="cuda") == CGSupport.NEVER
    windowed = SimpleNamespace(block_size=16, kv_cache_specs={
        "l0": _attn_spec(64, sliding_window=8), "l1": _attn_spec(128, sliding_window=8)})
    assert core.group_cudagraph_support(windowed, device="cuda") == CGSupport.ALWAYS


def test_sinks_follow_in_place_weight_reloads():
    """The float32 sinks the kernels read follow vLLM's sinks parameter when its values are
    replaced in place with no ``process_weights_after_loading`` after (vLLM's
    ``reload_weights(is_checkpoint_format=False)`` does ``param.copy_(w)``; RL weight syncs
    call ``model.load_weights``): a bf16 parameter is re-read into the same float32 buffer on
    every call (one tensor, so memoised calls and captured graphs keep reading it); a float32
    one is passed as is. Attention with the reloaded sinks equals the reference with them."""
    assert core.refresh_sinks(None, None) is None
    torch.manual_seed(3)
    param = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16), requires_grad=False)
    buf = core.refresh_sinks(param, None)
    assert buf.dtype == torch.float32 and torch.equal(buf, param.float())
    new = torch.randn(4).to(torch.bfloat16)
    with torch.no_grad():
        param.copy_(new)
    again = core.refresh_sinks(param, buf)
    assert again is buf and torch.equal(again, new.float())
    f32 = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    assert core.refresh_sinks(f32, None) is f32

    hq, hkv, d, page = 4, 2, 32, 16
    kv = _vllm_cache(4, hkv, page, d, d)
    table = torch.tensor([[2, 1], [3, 0]], dtype=torch.int32)
    common = _common([3, 1], [20, 9], block_table=table,
                     slot_mapping=torch.zeros(4, dtype=torch.int64))
    md = core.metadata_from_common(common)
    params = core.AttnLayerParams(num_heads=hq, num_kv_heads=hkv, head_size=d, head_size_v=d,
                                  scale=d ** -0.5)
    query = torch.randn(4, hq, d)
    out = core.run_attention(params, md, query, kv, torch.empty(4, hq, d),
                             sinks=core.refresh_sinks(param, buf))
    k_plain, v_plain = (t.contiguous() for t in core.kv_cache_views(kv, d, d))
    expected = ops.paged_attention(
        query, k_plain, v_plain, cu_seqlens_q=common.query_start_loc,
        seqused_k=common.seq_lens, block_table=table, softmax_scale=d ** -0.5,
        sinks=new.float(), backend="reference")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_models_needing_more_than_causal_masks_are_refused():
    """A multimodal prefix-LM (Gemma3, PaliGemma: image tokens attend bidirectionally through
    ``mm_req_doc_ranges``) or an R-SWA model (``rswa_prefix_lens``) needs masks our kernels do
    not apply: vLLM's GPU selector refuses such models for a backend without
    ``supports_mm_prefix`` / ``supports_rswa``, its CPU platform does not ask, so the builder
    must refuse them instead of serving plain causal attention."""
    plain = SimpleNamespace(is_mm_prefix_lm=False, rswa_window=None)
    assert core.unsupported_model_reason(plain) == ""
    assert core.unsupported_model_reason(None) == ""
    why = core.unsupported_model_reason(SimpleNamespace(is_mm_prefix_lm=True, rswa_window=None))
    assert "is_mm_prefix_lm=True" in why and "--language-model-only" in why
    why = core.unsupported_model_reason(SimpleNamespace(is_mm_prefix_lm=False, rswa_window=128))
    assert "rswa_window=128" in why


def test_register_without_vllm_logs_and_returns(monkeypatch, caplog):
    """A plugin that cannot load says why and registers nothing (here: no vLLM at all)."""
    import sys

    from aiter_attn.integrations import vllm as plugin

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    monkeypatch.delitem(sys.modules, "aiter_attn.integrations.vllm.backend", raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.aiter_attn"):
        plugin.register()
    assert "vLLM plugin not registered" in caplog.text and "keeps its own" in caplog.text


def test_register_disabled_by_env(monkeypatch, caplog):
    from aiter_attn.integrations import vllm as plugin

    monkeypatch.setenv(plugin.ENV_DISABLE, "0")
    with caplog.at_level(logging.INFO, logger="vllm.plugins.aiter_attn"):
        plugin.register()
    assert "not registering" in caplog.text


@pytest.mark.skipif(not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
                    reason="Triton needs a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_triton_kernels_read_and_write_vllm_layout_in_place(monkeypatch):
    """The Triton write and attention kernels (the GPU path) on vLLM's interleaved K|V cells,
    through strided views, equal the reference on a plain copy (float32; GQA 3:1, page 16,
    a padding slot)."""
    monkeypatch.setenv("AITER_ATTN_BACKEND", "triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1)
    hq, hkv, d, page = 3, 1, 32, 16
    kv = _vllm_cache(5, hkv, page, d, d).to(dev)
    params = core.AttnLayerParams(num_heads=hq, num_kv_heads=hkv, head_size=d, head_size_v=d,
                                  scale=d ** -0.5, window_size=(7, 0))
    table = torch.tensor([[3, 1], [4, 0]], dtype=torch.int32, device=dev)
    q_lens, kv_lens = [4, 1], [20, 9]
    slots = torch.tensor([1 * page + 0, 1 * page + 1, 1 * page + 2, 1 * page + 3, 4 * page + 8,
                          -1], device=dev)  # request 0 tokens 16..19, request 1 token 8, pad
    key, value = torch.randn(6, hkv, d, device=dev), torch.randn(6, hkv, d, device=dev)
    expected_kv = kv.clone()
    monkeypatch.setenv("AITER_ATTN_BACKEND", "reference")
    core.write_kv_cache(params, expected_kv, key, value, slots)
    monkeypatch.setenv("AITER_ATTN_BACKEND", "triton")
    core.write_kv_cache(params, kv, key, value, slots)
    assert torch.equal(kv, expected_kv)
    common = _common(q_lens, kv_lens, block_table=table, slot_mapping=slots)
    common.query_start_loc, common.seq_lens = (common.query_start_loc.to(dev),
                                               common.seq_lens.to(dev))
    md = core.metadata_from_common(common)
    query = torch.randn(5, hq, d, device=dev)
    out = torch.zeros(5, hq, d, device=dev)
    core.run_attention(params, md, query, kv, out)
    k_plain, v_plain = (t.contiguous() for t in core.kv_cache_views(kv, d, d))
    ref = ops.paged_attention(query, k_plain, v_plain, cu_seqlens_q=md.cu_seqlens_q,
                              seqused_k=md.seqused_k, block_table=table, softmax_scale=d ** -0.5,
                              window_size=(7, 0), backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ fp8 KV caches (vLLM's uint8)

@pytest.mark.parametrize("kv_cache_dtype,fp8", [("fp8", torch.float8_e4m3fn),
                                                ("fp8_e4m3", torch.float8_e4m3fn),
                                                ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_kv_cache_written_and_read_with_the_layer_scales(kv_cache_dtype, fp8):
    """vLLM allocates an fp8 cache as uint8 and keeps each layer's scales as float32 0-d
    tensors: the write stores ``fp8(K / k_scale)`` in vLLM's bytes (padding rows untouched),
    and the attention equals the reference over the dequantised K/V (``fp8 · scale``) in a
    plain float32 cache (GQA 5:1, head dim 80, page 48, block-permuted tables, null block
    0). Scales of 1 would give other bytes and other rows."""
    torch.manual_seed(1)
    assert core.fp8_cache_dtype(kv_cache_dtype) is fp8
    hq, hkv, d, page, nblocks = 10, 2, 80, 48, 8
    kv = torch.zeros(nblocks * page * hkv * 2 * d, dtype=torch.uint8).view(
        nblocks, page, hkv, 2 * d).permute(0, 2, 1, 3)
    params = core.AttnLayerParams(num_heads=hq, num_kv_heads=hkv, head_size=d, head_size_v=d,
                                  scale=d ** -0.5, kv_dtype=fp8)
    k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.03)
    kv_lens = [50, 100]
    perm = (torch.randperm(nblocks - 1) + 1).tolist()
    table = torch.zeros(2, 3, dtype=torch.int32)
    slots = []
    for b, n in enumerate(kv_lens):
        for i in range(-(-n // page)):
            table[b, i] = perm.pop()
        slots += [int(table[b, t // page]) * page + t % page for t in range(n)]
    slots = torch.tensor(slots + [-1, -1])  # two padding rows
    key = torch.randn(len(slots), hkv, d) * 2
    value = torch.randn(len(slots), hkv, d) * 2
    core.write_kv_cache(params, kv, key, value, slots, k_scale, v_scale)
    k8, v8 = core.kv_cache_views(kv, d, d, fp8)
    assert k8.dtype == fp8 and k8.data_ptr() == kv.data_ptr()
    live = slots >= 0
    rows_k = k8.reshape(-1, hkv, d)[slots[live]]
    fmax = torch.finfo(fp8).max
    want = (key[live] / 0.05).clamp(-fmax, fmax).to(fp8)
    assert torch.equal(rows_k.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(want.view(torch.uint8), key[live].to(fp8).view(torch.uint8))
    common = _common([1, 4], kv_lens, block_table=table,
                     slot_mapping=slots[:5], pad_reqs=0)
    md = core.metadata_from_common(common)
    query = torch.randn(5, hq, d)
    out = torch.full((5, hq, d), float("nan"))
    core.run_attention(params, md, query, kv, out, k_scale=k_scale, v_scale=v_scale)
    k_plain = k8.float() * 0.05
    v_plain = v8.float() * 0.03
    expected = ops.paged_attention(
        query, k_plain.contiguous(), v_plain.contiguous(), cu_seqlens_q=common.query_start_loc,
        seqused_k=common.seq_lens, block_table=table, softmax_scale=d ** -0.5,
        backend="reference")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    wrong = ops.paged_attention(
        query, k8.float().contiguous(), v8.float().contiguous(),
        cu_seqlens_q=common.query_start_loc, seqused_k=common.seq_lens, block_table=table,
        softmax_scale=d ** -0.5, backend="reference")
    assert not torch.allclose(out, wrong, rtol=1e-2, atol=1e-2)


def test_fp8_views_refuse_a_cache_of_another_width():
    kv = _vllm_cache(2, 1, 16, 32, 32)  # float32: 4 bytes an element
    with pytest.raises(ValueError, match="vLLM allocated this cache for another"):
        core.kv_cache_views(kv, 32, 32, torch.float8_e4m3fn)


def test_spec_dtypes_of_an_fp8_group():
    """vLLM's spec of an fp8 cache says uint8: the kernel request reads the fp8 type from
    the server's cache_config and the queries' from model_config, so the registry is asked
    for an fp8 kernel (the CPU reference serves it)."""
    spec = _attn_spec(64, dtype=torch.uint8, block_size=32)
    cfg = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8_e5m2"),
                          model_config=SimpleNamespace(dtype=torch.bfloat16))
    assert core.spec_dtypes(spec, cfg) == (torch.bfloat16, torch.float8_e5m2)
    assert core.spec_dtypes(_attn_spec(64), None) == (torch.float16, None)
    req = core.layer_kernel_request(device="cpu", dtype=torch.bfloat16, head_size=64,
                                    kv_dtype=torch.float8_e5m2)
    assert req.kv_dtype is torch.float8_e5m2 and "fp8" in req.features
    level, reason = core.paged_attention_support(device="cpu", dtype=torch.float32,
                                                 head_size=64, kv_dtype=torch.float8_e4m3fn)
    assert reason is None and level == CGSupport.NEVER
    assert core.group_cudagraph_support(spec, device="cpu", vllm_config=cfg) == CGSupport.NEVER


# ------------------------------------------------------------- encoder-only layers (no cache)

@pytest.mark.parametrize("window", [(-1, -1), (6, 0)], ids=["full", "window-7"])
def test_encoder_attention_is_bidirectional_over_each_request(window):
    """vLLM's ENCODER_ONLY layers: each request's queries attend over all of its own tokens'
    K/V of the step, in both directions (a causal window ``(w - 1, 0)`` made symmetric), and
    over no other request's; a padding request (repeated ``query_start_loc``) and rows past
    ``num_actual_tokens`` are left alone (GQA 5:1, head dim 80)."""
    torch.manual_seed(2)
    hq, hkv, d = 10, 2, 80
    q_lens = [3, 1, 40]
    n = sum(q_lens)
    common = _common(q_lens, q_lens, block_table=torch.zeros(4, 1, dtype=torch.int32),
                     slot_mapping=torch.zeros(n, dtype=torch.int64), causal=False, pad_reqs=1)
    md = core.metadata_from_common(common, encoder=True)
    params = core.AttnLayerParams(num_heads=hq, num_kv_heads=hkv, head_size=d, head_size_v=d,
                                  scale=d ** -0.5, window_size=window)
    query, key, value = torch.randn(n + 2, hq, d), torch.randn(n + 2, hkv, d), torch.randn(
        n + 2, hkv, d)
    out = torch.full((n + 2, hq, d), 7.0)
    core.run_encoder_attention(params, md, query, key, value, out)
    start = 0
    for length in q_lens:
        q = query[start:start + length].float()
        k = key[start:start + length].repeat_interleave(hq // hkv, 1).float()
        v = value[start:start + length].repeat_interleave(hq // hkv, 1).float()
        s = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        if window[0] >= 0:
            pos = torch.arange(length)
            s = s.masked_fill((pos[:, None] - pos[None, :]).abs() > window[0], float("-inf"))
        want = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        torch.testing.assert_close(out[start:start + length], want, rtol=1e-5, atol=1e-5)
        start += length
    assert torch.all(out[n:] == 7.0)
    # the first token of the long request saw the tokens after it
    causal = torch.full_like(out, 7.0)
    ops.paged_attention(query[4:5], key[4:5].reshape(1, 1, hkv, d),
                        value[4:5].reshape(1, 1, hkv, d),
                        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                        seqused_k=torch.tensor([1], dtype=torch.int32),
                        block_table=torch.zeros(1, 1, dtype=torch.int32),
                        softmax_scale=d ** -0.5, out=causal[4:5])
    assert not torch.allclose(out[4], causal[4], rtol=1e-3, atol=1e-3)


def test_encoder_only_groups_are_never_captured():
    """An encoder-only layer's group (vLLM's ``EncoderOnlyAttentionSpec``) reports NEVER:
    its page table of one-token pages is built per step from the host's length hint."""
    EncoderOnlyAttentionSpec = type("EncoderOnlyAttentionSpec", (SimpleNamespace,), {})
    spec = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                    head_size_v=64, dtype=torch.float16)
    assert core.group_cudagraph_support(spec, device="cuda") == CGSupport.NEVER
    uniform = SimpleNamespace(kv_cache_specs={"a": spec, "b": _attn_spec(64)})
    assert core.group_cudagraph_support(uniform, device="cuda") == CGSupport.NEVER


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_triton_kernels_on_vllm_fp8_cache_in_place(monkeypatch, fp8):
    """The Triton write and attention kernels (the GPU path; the interpreter here) on
    vLLM's uint8 fp8 cache through the strided fp8 views, with 0-d scale tensors (k ≠ v):
    the same bytes as the reference write, and rows matching the reference read of those
    bytes to float16's relative error (float16 queries; GQA 3:1, page 16, a padding slot).
    K/V are fp8 grid values
    times power-of-two scales, whose quantisation is exact: the interpreter's float → fp8
    cast loses the carry into the exponent (31.93 → 16 in e4m3), so it must have nothing to
    round; a dropped, doubled or swapped scale still shows (tests/test_fp8_formats.py)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, page = 3, 1, 32, 16
    kv = torch.zeros(5 * page * hkv * 2 * d, dtype=torch.uint8, device=dev).view(
        5, page, hkv, 2 * d).permute(0, 2, 1, 3)
    params = core.AttnLayerParams(num_heads=hq, num_kv_heads=hkv, head_size=d, head_size_v=d,
                                  scale=d ** -0.5, kv_dtype=fp8)
    k_s, v_s = 2.0 ** -4, 2.0 ** 2
    ks, vs = torch.tensor(k_s, device=dev), torch.tensor(v_s, device=dev)
    fmax = torch.finfo(fp8).max

    def grid(n, scale):  # fp8 grid values times the scale: quantised exactly
        x = (torch.randn(n, hkv, d, generator=g) * fmax / 16).to(fp8).float() * scale
        return x.half().to(dev)

    table = torch.tensor([[3, 1], [4, 0]], dtype=torch.int32, device=dev)
    q_lens, kv_lens = [4, 1], [20, 9]
    slots = torch.tensor([1 * page + 0, 1 * page + 1, 1 * page + 2, 1 * page + 3, 4 * page + 8,
                          -1], device=dev)
    # every cell first holds a reference write of other K/V, then this step's
    monkeypatch.setenv("AITER_ATTN_BACKEND", "reference")
    core.write_kv_cache(params, kv, grid(5 * page, k_s), grid(5 * page, v_s),
                        torch.arange(5 * page, device=dev), ks, vs)
    key, value = grid(6, k_s), grid(6, v_s)
    expected_kv = kv.clone()
    core.write_kv_cache(params, expected_kv, key, value, slots, ks, vs)
    monkeypatch.setenv("AITER_ATTN_BACKEND", "triton")
    core.write_kv_cache(params, kv, key, value, slots, ks, vs)
    assert torch.equal(kv, expected_kv)
    common = _common(q_lens, kv_lens, block_table=table, slot_mapping=slots)
    common.query_start_loc, common.seq_lens = (common.query_start_loc.to(dev),
                                               common.seq_lens.to(dev))
    md = core.metadata_from_common(common)
    query = torch.randn(5, hq, d, generator=g).half().to(dev)
    out = torch.zeros(5, hq, d, device=dev, dtype=torch.float16)
    core.run_attention(params, md, query, kv, out, k_scale=ks, v_scale=vs)
    k8, v8 = core.kv_cache_views(kv, d, d, fp8)
    ref = ops.paged_attention(query.float(), (k8.float() * k_s).contiguous(),
                              (v8.float() * v_s).contiguous(), cu_seqlens_q=md.cu_seqlens_q,
                              seqused_k=md.seqused_k, block_table=table,
                              softmax_scale=d ** -0.5, backend="reference")
    assert_close_rel(out, ref, 2e-3, f"Triton attention over vLLM's {fp8} cache")


def test_triton_kernel_runs_encoder_layers_on_one_token_pages(monkeypatch):
    """The encoder-only path on the Triton kernel (the interpreter here): the step's K/V
    as pages of one token, non-causal, equals the reference (float32, GQA 3:1)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(4)
    hq, hkv, d = 3, 1, 32
    q_lens = [5, 12]
    n = sum(q_lens)
    common = _common(q_lens, q_lens, block_table=torch.zeros(2, 1, dtype=torch.int32),
                     slot_mapping=torch.zeros(n, dtype=torch.int64), causal=False)
    common.query_start_loc, common.seq_lens = (common.query_start_loc.to(dev),
                                               common.seq_lens.to(dev))
    md = core.metadata_from_common(common, encoder=True)
    params = core.AttnLayerParams(num_heads=hq, num_kv_heads=hkv, head_size=d, head_size_v=d,
                                  scale=d ** -0.5)
    query = torch.randn(n, hq, d, device=dev)
    key, value = torch.randn(n, hkv, d, device=dev), torch.randn(n, hkv, d, device=dev)
    outs = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("AITER_ATTN_BACKEND", backend)
        outs[backend] = torch.zeros(n, hq, d, device=dev)
        core.run_encoder_attention(params, md, query, key, value, outs[backend])
    torch.testing.assert_close(outs["triton"], outs["reference"], rtol=1e-4, atol=1e-4)
