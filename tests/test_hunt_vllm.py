"""Defects found hunting the vLLM integration (aiter_attn/integrations/vllm): each test failed
before its fix.

Built on plain stand-ins for vLLM 0.32's ``CommonAttentionMetadata`` (the fields its
``GPUModelRunner._build_attention_metadata`` fills) and its per-layer KV cache (logical
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` over token-major ``LBNHC`` pages), so
no vLLM import is needed; outputs are compared with a float64 loop written from vLLM's own
conventions (``FlashAttentionImpl``: window ``w`` -> ``(w - 1, 0)``, made symmetric by
``_maybe_symmetrize_window`` when the batch is non-causal).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from aiter_attn.integrations.vllm import core


def _vllm_cache(num_blocks: int, num_kv_heads: int, block_size: int, d: int, *,
                generator: torch.Generator) -> torch.Tensor:
    """A per-layer cache as vLLM allocates it for our ``LBNHC`` layout: logical ``[B, H, N, 2D]``
    over token-major pages."""
    raw = torch.randn(num_blocks * block_size * num_kv_heads * 2 * d, generator=generator)
    return raw.view(num_blocks, block_size, num_kv_heads, 2 * d).permute(0, 2, 1, 3)


def _naive(q, kv, block_table, q_lens, kv_lens, *, d, scale, window: Optional[int],
           causal: bool, page: int) -> torch.Tensor:
    """vLLM's attention in float64, one query row at a time. Query ``i`` of a request sits at
    position ``kv_len - q_len + i``; a causal row sees keys ``j <= pos``; a window ``w`` keeps
    keys with ``pos - j < w`` (causal) or ``|pos - j| < w`` (non-causal: FlashAttention's
    ``_maybe_symmetrize_window``, FlexAttention's ``|q_idx - kv_idx| < sliding_window``)."""
    k_cache, v_cache = core.kv_cache_views(kv, d, d)
    rows, t = [], 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        pages = block_table[b, : -(-kv_len // page)].long()
        keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len].double()
        vals = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len].double()
        group = q.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        j = torch.arange(kv_len)
        for i in range(q_len):
            pos = kv_len - q_len + i
            vis = (j <= pos) if causal else torch.ones(kv_len, dtype=torch.bool)
            if window is not None:
                vis &= ((pos - j) < window) & (((j - pos) < window) | torch.tensor(causal))
            s = torch.einsum("hd,jhd->hj", q[t + i].double(), keys) * scale
            p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
            rows.append(torch.einsum("hj,jhd->hd", p, vals))
        t += q_len
    return torch.stack(rows)


def _batch(q_lens, kv_lens, *, page, hkv, d, seed, pad_reqs=0, pad_tokens=0, causal=True):
    """``(common, kv, query, key, value)``: a batch as vLLM's runner hands it over, the new
    tokens' slots chosen in a block-permuted table (null block 0), padded with ``pad_reqs``
    zero-length requests and ``pad_tokens`` rows past the last request (slot ``-1``)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = 2 + sum(-(-n // page) for n in kv_lens)
    kv = _vllm_cache(nblocks, hkv, page, d, generator=g)
    free = (torch.randperm(nblocks - 1, generator=g) + 1).tolist()
    width = max(-(-n // page) for n in kv_lens) + 1
    table = torch.zeros(len(q_lens) + pad_reqs, width, dtype=torch.int32)
    slots = []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        for i in range(-(-kv_len // page)):
            table[b, i] = free.pop()
        for pos in range(kv_len - q_len, kv_len):
            slots.append(int(table[b, pos // page]) * page + pos % page)
    n = sum(q_lens)
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    cu += [n] * pad_reqs  # vLLM: query_start_loc.np[num_reqs + 1:] = cu_num_tokens[-1]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    common = SimpleNamespace(
        query_start_loc=cu_t, query_start_loc_cpu=cu_t.clone(),
        seq_lens=torch.tensor(list(kv_lens) + [0] * pad_reqs, dtype=torch.int32),
        num_reqs=len(q_lens) + pad_reqs,
        num_actual_tokens=n + pad_tokens,  # vLLM passes the padded count (its own TODO says so)
        max_query_len=max(q_lens), max_seq_len=max(kv_lens), block_table_tensor=table,
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64), causal=causal)
    query = torch.randn(n + pad_tokens, 3 * hkv, d, generator=g)
    key = torch.randn(n + pad_tokens, hkv, d, generator=g)
    value = torch.randn(n + pad_tokens, hkv, d, generator=g)
    return common, kv, query, key, value


@pytest.mark.parametrize("backend", [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(
        not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
        reason="Triton needs a GPU or TRITON_INTERPRET=1")),
])
def test_padded_batch_attends_only_the_requests_tokens(monkeypatch, backend):
    """vLLM's ``CommonAttentionMetadata.num_actual_tokens`` is the *padded* token count
    (``num_tokens_padded``: piecewise CUDA-graph sizes, DP padding) while ``query_start_loc``
    ends at the real count (padding requests repeat it). The plan kept the padded count, so
    ``query[:num_actual_tokens]`` had rows past ``cu_seqlens_q[-1]`` and the reference kernel
    (what the registry picks on a GPU for head dims over 256 or GQA groups over 128, where
    vLLM then runs piecewise graphs) raised ``ValueError: cu_seqlens_q[-1]=... but q has ...
    tokens`` on every padded step. The plan now attends the requests' tokens
    (``query_start_loc_cpu[-1]``, no device sync); padding rows are neither written to the
    cache nor to ``output``. A CUDA-graph capture keeps the padded count (its replays differ)."""
    monkeypatch.setenv("AITER_ATTN_BACKEND", backend)
    hkv, d, page = 2, 32, 16
    q_lens, kv_lens = [1, 9, 4], [37, 9, 20]
    common, kv, query, key, value = _batch(q_lens, kv_lens, page=page, hkv=hkv, d=d, seed=0,
                                           pad_reqs=2, pad_tokens=5)
    n = sum(q_lens)
    params = core.AttnLayerParams(num_heads=3 * hkv, num_kv_heads=hkv, head_size=d,
                                  head_size_v=d, scale=d ** -0.5)
    before = kv.clone()
    core.write_kv_cache(params, kv, key, value, common.slot_mapping)
    written = (kv != before).any(dim=-1).any(dim=1)  # [B, N]
    assert int(written.sum()) == n  # the 5 padding rows (slot -1) wrote nothing

    md = core.metadata_from_common(common)
    output = torch.full((n + 5, 3 * hkv, d), float("nan"))
    core.run_attention(params, md, query, kv, output)
    expected = _naive(query, kv, common.block_table_tensor, q_lens, kv_lens, d=d,
                      scale=d ** -0.5, window=None, causal=True, page=page)
    torch.testing.assert_close(output[:n].double(), expected, rtol=1e-4, atol=1e-4)
    assert torch.isnan(output[n:]).all()  # rows of no request are left as vLLM gave them
    assert md.num_actual_tokens == n

    captured = core.metadata_from_common(common, capturing=True)
    assert captured.num_actual_tokens == n + 5


@pytest.mark.parametrize("window", [1, 5, 64])
def test_non_causal_batch_sliding_window_is_symmetric(window):
    """A non-causal batch (``causal=False``: vLLM's DFlash drafters with sliding-window layers,
    e.g. ``dflash_config.use_swa``; on the CPU they reach us as ``CPU_ATTN``) with a window
    ``w`` attends keys within ``w - 1`` positions on *both* sides, as vLLM's FlashAttention
    (``_maybe_symmetrize_window``) and FlexAttention (``|q - kv| < w``) do. The layer's window
    stayed ``(w - 1, 0)``, so every query lost the keys after it: silently causal attention."""
    hkv, d, page = 1, 32, 16
    q_lens, kv_lens = [6, 4, 1], [30, 4, 17]
    common, kv, query, _, _ = _batch(q_lens, kv_lens, page=page, hkv=hkv, d=d, seed=1,
                                     causal=False)
    md = core.metadata_from_common(common)
    assert md.causal is False
    params = core.AttnLayerParams(num_heads=3 * hkv, num_kv_heads=hkv, head_size=d,
                                  head_size_v=d, scale=d ** -0.5,
                                  window_size=core.window_from_vllm(window))
    n = sum(q_lens)
    output = torch.zeros(n, 3 * hkv, d)
    core.run_attention(params, md, query, kv, output)
    expected = _naive(query, kv, common.block_table_tensor, q_lens, kv_lens, d=d,
                      scale=d ** -0.5, window=window, causal=False, page=page)
    torch.testing.assert_close(output.double(), expected, rtol=1e-4, atol=1e-4)

    # a causal batch over the same layer keeps the one-sided window
    common.causal = True
    causal_out = torch.zeros(n, 3 * hkv, d)
    core.run_attention(params, core.metadata_from_common(common), query, kv, causal_out)
    expected = _naive(query, kv, common.block_table_tensor, q_lens, kv_lens, d=d,
                      scale=d ** -0.5, window=window, causal=True, page=page)
    torch.testing.assert_close(causal_out.double(), expected, rtol=1e-4, atol=1e-4)
