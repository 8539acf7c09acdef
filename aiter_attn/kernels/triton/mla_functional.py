"""The functional Triton absorbed-MLA entry point, :func:`mla_paged_attention`: checks its
arguments, then plan + run of a :class:`.mla.TritonMLA` bound to these tensors in one call
(re-exported by :mod:`.mla`)."""

from __future__ import annotations

from typing import Optional

import torch

from ...types import FP8_DTYPES
from ...validation import INDEX_DTYPES
from ..base import _adhoc_metadata, mla_layer_params, mla_request

__all__ = ["mla_paged_attention"]


def mla_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    kv_lora_rank: int,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    kv_scale=None,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
    block_h: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    page_chunk: Optional[int] = None,
    split_v_load: Optional[bool] = None,
    lse: Optional[torch.Tensor] = None,
    batch_invariant: bool = False,
    gluon: Optional[bool] = None,
    v_pairs: Optional[bool] = None,
    pdl=None,
    narrow: Optional[bool] = None,
    fused_merge: Optional[bool] = None,
    ring: Optional[bool] = None,
    kv_desc: Optional[bool] = None,
    lazy_rescale: Optional[bool] = None,
    half_partials: Optional[bool] = None,
    qk_split: Optional[int] = None,
    balanced=None,
    stream: Optional[bool] = None,
) -> torch.Tensor:
    """Absorbed MLA over a paged latent cache (Triton). Same contract as
    :func:`aiter_attn.kernels.reference.mla_paged_attention_reference`.

    Args:
        q: ``[T, H, R + rope]`` fp16/bf16/fp32 (absorbed ``q_nope`` then ``q_rope``).
        kv_cache: ``[num_pages, page_size, 1, R + rope]`` in q's dtype or fp8 (then
            ``kv_scale`` dequantises keys and values).
        out: ``[T, H, R]`` in q's dtype, written in place and returned.
        kv_lora_rank: ``R``; values are the first ``R`` dims of each latent vector.
        cu_seqlens_q: int32 ``[B + 1]``; seqused_k: int32 ``[B]`` (this step's tokens included);
        block_table: int32 ``[B, max_pages]``.
        softmax_scale: multiplies q·k. causal: mask keys after each query's position.
        kv_scale: scalar tensor (read on the device) or number; ``None`` = 1. Applies to an
            fp8 cache only; ignored on any other cache dtype.
        custom_mask, mask_indptr: flat bool tree mask and int64 ``[B + 1]`` offsets into it
            (request b's mask is ``[q_len, L]`` row-major at ``mask_indptr[b]``).
        max_seqlen_k: host bound on ``seqused_k`` used to size split-KV; defaults to the
            block table's capacity (no device read).
        num_kv_splits, block_h, block_n, num_warps, num_stages: override the launch
            heuristics (tests, tuning).
        split_v_load: load the value part of each latent tile a second time (an L2 hit)
            instead of reusing the converted key tile, so that Triton pipelines both loads;
            default: on when the cache dtype differs from q's (fp8 caches).
        page_chunk: key tiles whose page ids are read in one load (0: one lookup per tile,
            carried a tile ahead); used when the page size divides ``block_n`` or is a
            multiple of it. Rounded up to a power of two. Default: 0 for head blocks of ≤ 16
            (memory-bound; H200 16 heads 128x8k: 4.0 TB/s vs 2.7 chunked), else 16
            (compute-bound; 128 heads 64x4k: 227 vs 168 TFLOP/s with 64-key tiles).
        lse: optional float32 ``[T, H]``: also receives the natural-log LSE of each row's
            scaled logits (``-inf`` with nothing visible), the flash-attn convention.
        v_pairs: fp8 latents: read the values as 16-bit column pairs (no byte-wise shared
            loads; see ``_launch_config.MLA_FP8_VALUE_PAIRS``, the default); used on head blocks
            under 64 rows of caches whose rows start on 16-byte boundaries.
        pdl: programmatic dependent launch (sm_90+): ``True`` the attention launch and the
            split merge may each start while the kernel before finishes, ``"reduce"`` only
            the merge; ``"early"`` as ``True``, and the narrow kernel reads its indices,
            prefetches q to L2 and issues its first tiles of keys older than the step's new
            ones before it waits, and its merge lets the next launch start before it waits:
            the kernel right before must not write those (``_pdl``'s contract). Off by
            default for the Triton kernel (see ``_launch_config.LaunchConfig``), ``"early"``
            for the narrow kernel (``_launch_config.MLA_NARROW_PDL``; ``pdl=False`` turns
            it off).
        gluon: ``False``: never the warp-specialised Gluon kernel (:mod:`.mla_gluon`); by
            default it serves the launches it can (64-head blocks of bf16/fp16 latents
            512 + 64, pages of a multiple of 64 keys, no mask, NVIDIA sm_90).
        narrow: the narrow Gluon kernel (:mod:`.mla_narrow_gluon`) for up to 16 heads
            where it serves (bf16/fp16 latents 512 + 64, ``gcd(page, 64) >= 16``, no mask,
            not batch-invariant, NVIDIA sm_90); the default there
            (``_launch_config.MLA_NARROW``) unless ``balanced`` asks for the balanced
            launch; ``False``: the Triton kernel.
        fused_merge: the split merge inside the Triton launch (``True``: the last split
            program of a token's head block merges it; ``"cooperative"``: a cooperative
            launch whose splits wait for each other and each merge a column slice, GPU only,
            every program resident; head blocks of up to 16, up to 16 splits, not
            batch-invariant); default :data:`._launch_config.MLA_FUSED_MERGE`.
        ring: ``True``: the ring Gluon kernel (:mod:`.mla_ring_gluon`: 32-key tiles, q in
            registers, two programs per SM) where the narrow kernel would serve.
        kv_desc: the Triton kernel reads whole latent tiles through tensor descriptors (TMA
            on sm_90) where the cache allows; default
            :data:`._launch_config.MLA_KV_DESCRIPTORS`.
        lazy_rescale: the Triton kernel moves its running maximum (and rescales the
            accumulator) only when a head's maximum grows by more than 2^8, and keeps its
            row sums per element (one cross-warp reduction a tile); default
            :data:`._launch_config.MLA_LAZY_RESCALE`.
        half_partials: the Triton and narrow kernels' split partials (``o / l`` per split)
            in q's 16-bit dtype instead of float32, half the bytes written and merged (head blocks
            of up to 16, bf16/fp16 queries, not batch-invariant; the LSEs stay float32);
            default :data:`._launch_config.MLA_HALF_PARTIALS`.
        qk_split: ``2`` / ``4``: the Triton kernel computes q·Kᵀ as two / four independent
            mma chains over the latent halves / quarters and p·V into as many part
            accumulators (latents of q's dtype, power-of-two widths, rank ≥ 32 / 64); default
            :data:`._launch_config.MLA_QK_SPLIT`.
        balanced: ``True`` / a positive int: decode steps (one query per request, up to 16
            heads, a cache of q's dtype, no mask) split the keys so that every program (as
            many as the SMs hold, or that many) gets the same number of key tiles, requests
            crossing programs merged by LSE (:mod:`.mla_balanced`); other steps keep the
            split launch.
        stream: ``True``: 16-head decode steps the narrow kernel would serve run the
            persistent stream kernel instead (:mod:`.mla_stream_gluon`: one program per SM
            over equal shares of the batch's keys, crossing requests, merged by LSE); default
            :data:`._launch_config.MLA_STREAM`.
        batch_invariant: each row's bits independent of the rest of the batch: keys split
            every :data:`BATCH_INVARIANT_SPLIT_TOKENS` (rounded to ``block_n``) at absolute
            positions, the split path and a fixed-order merge always (the split count, a
            power of two covering ``max_seqlen_k``, only sets how many programs launch).
    """
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; expected [num_pages, page_size, 1, "
            "kv_lora_rank + rope_dim] (one latent head)."
        )
    if kv_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(
            "kv_cache and out must be contiguous in their last dim; pass .contiguous() tensors."
        )
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k),
                    ("block_table", block_table)):
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; allowed: int32, int64.")
    total_dim = q.shape[2]
    if not 0 < kv_lora_rank <= total_dim or kv_cache.shape[3] != total_dim:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank} with q dim {total_dim} and kv_cache dim "
            f"{kv_cache.shape[3]}; need 0 < kv_lora_rank ≤ q dim == kv_cache dim."
        )
    if custom_mask is not None and mask_indptr is None:
        raise ValueError("custom_mask needs mask_indptr (int64 [batch + 1]); pass both.")
    # the launch writes out / lse by these shapes without a bound (a wider out kept garbage
    # columns, an lse of another shape or dtype got the [T, H] float32 row layout)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if tuple(out.shape) != (num_tokens, num_heads, kv_lora_rank):
        raise ValueError(f"out has shape {tuple(out.shape)}; expected [{num_tokens}, "
                         f"{num_heads}, {kv_lora_rank}] (num_tokens, num_heads, kv_lora_rank).")
    if lse is not None and (lse.dtype != torch.float32
                            or tuple(lse.shape) != (num_tokens, num_heads)):
        raise ValueError(f"lse is {lse.dtype} {tuple(lse.shape)}; expected float32 "
                         f"[{num_tokens}, {num_heads}] (num_tokens, num_heads).")
    if q.stride(-1) != 1:
        q = q.contiguous()
    tuning = {k: v for k, v in dict(
        num_kv_splits=num_kv_splits, block_h=block_h, block_n=block_n, num_warps=num_warps,
        num_stages=num_stages, page_chunk=page_chunk, split_v_load=split_v_load,
        gluon=gluon, v_pairs=v_pairs, pdl=pdl, narrow=narrow,
        fused_merge=fused_merge, ring=ring, kv_desc=kv_desc,
        lazy_rescale=lazy_rescale, half_partials=half_partials,
        qk_split=qk_split, balanced=balanced, stream=stream).items() if v is not None}
    from .mla import TritonMLA  # late: mla.py re-exports this function
    kernel = TritonMLA(mla_request(q, kv_cache, kv_lora_rank,
                                   custom_mask=custom_mask is not None, lse=lse is not None,
                                   batch_invariant=batch_invariant, causal=causal), tuning)
    md = _adhoc_metadata(q, kv_cache, cu_seqlens_q, seqused_k, block_table, custom_mask,
                         mask_indptr, max_seqlen_q, max_seqlen_k, "mla_paged_attention")
    params = mla_layer_params(scale=softmax_scale, device=q.device, kv_lora_rank=kv_lora_rank,
                              num_q_heads=q.shape[1], head_dim=total_dim, kv_scale=kv_scale,
                              fp8=kv_cache.dtype in FP8_DTYPES, causal=causal)
    return kernel.run(q, (kv_cache,), kernel.plan(md), params, out, lse=lse)
