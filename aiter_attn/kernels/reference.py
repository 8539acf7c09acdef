"""Readable float32 torch references for every op. Tests and benchmarks import these.

They favour clarity over speed (a Python loop over requests) and are the CPU default.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..hookspecs import hookimpl
from ..kv_scales import TOKEN_SCALE_FEATURE, check_token_scale_caches
from ..types import CGSupport, FP8_DTYPES, kv_dequant_scales
from ..validation import check_paged_index_values, check_scale
from .registry import Capabilities

__all__ = [
    "paged_attention_reference",
    "mla_paged_attention_reference",
    "merge_attention_states_reference",
    "build_page_tables_swa_reference",
    "write_kv_reference",
    "build_page_table_reference",
    "build_ragged_kv_indices_reference",
    "quantize_to_cache",
    "quantize_per_token_head",
]


def _scale_value(scale, name: str = "scale") -> float:
    check_scale(name, scale)  # one number: a per-head tensor is refused, never truncated
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        return float(scale.float().reshape(()))
    return float(scale)


def quantize_to_cache(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """Cast ``x`` to the cache dtype; fp8 divides by ``scale`` and saturates to the dtype's range."""
    if dtype in FP8_DTYPES:
        s = scale if isinstance(scale, torch.Tensor) else torch.tensor(_scale_value(scale))
        check_scale("scale", s)
        y = x.float() / s.to(x.device).float()
        fmax = torch.finfo(dtype).max
        return y.clamp(-fmax, fmax).to(dtype)
    return x.to(dtype)


def quantize_per_token_head(x: torch.Tensor, dtype: torch.dtype, scale=None):
    """Quantise ``x`` ``[T, H, D]`` to the fp8 ``dtype`` with one scale per (token, head):
    ``s = amax(|x|, D) / (fp8_max · scale)`` (1 where the vector is all zeros) and
    ``q = saturate(x / (s · scale))``, in float32 (the Triton write does the same operations
    in the same order). ``scale`` is the layer's scalar scale (None = 1), which a read applies
    on top: ``q · s · scale``. Returns ``(q [T, H, D] dtype, s float32 [T, H])``."""
    check_scale("scale", scale)
    # device scalars made without a host→device copy or a read back (graph-capturable)
    if isinstance(scale, torch.Tensor):
        layer = scale.to(device=x.device, dtype=torch.float32).reshape(())
    else:
        layer = torch.full((), 1.0 if scale is None else float(scale), dtype=torch.float32,
                           device=x.device)
    xf = x.float()
    fmax = torch.full((), torch.finfo(dtype).max, dtype=torch.float32, device=x.device)
    s = xf.abs().amax(dim=-1) / (fmax * layer)
    s = torch.where(s > 0, s, torch.ones_like(s))
    y = xf / (s * layer).unsqueeze(-1)
    return y.clamp(-fmax, fmax).to(dtype), s


def _gather_request_kv(cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``[kv_len, heads, dim]`` float32 from a paged ``[num_pages, page_size, heads, dim]`` cache."""
    page_size = cache.shape[1]
    n_pages = -(-kv_len // page_size)
    blocks = cache[pages[:n_pages].long()]  # [n_pages, page_size, H, D]
    return blocks.reshape(n_pages * page_size, *cache.shape[2:])[:kv_len].float()


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale=None,
    v_scale=None,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    lse: Optional[torch.Tensor] = None,
    batch_invariant: bool = False,
    k_scale_cache: Optional[torch.Tensor] = None,
    v_scale_cache: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Paged attention in float32.

    For request ``b`` with ``L = seqused_k[b]`` keys and ``n`` queries, query ``i`` sits at
    absolute position ``p = L - n + i`` and attends to key ``j`` iff
    ``(not causal or j ≤ p)`` and ``p - left ≤ j ≤ p + right`` (``-1`` = unbounded) and, with a
    custom mask, ``mask[b][i, j]``. Logits ``s = scale · q·k``; with softcap ``c > 0``,
    ``s ← c·tanh(s/c)``. With sinks, softmax runs over ``[s, sink_h]`` and the sink column has
    no value. A row with no visible key (and no sink) outputs zeros. ``k_scale``/``v_scale``
    multiply the keys/values read from an fp8 cache; on any other cache they do not apply.
    ``k_scale_cache``/``v_scale_cache`` (fp8 caches, float32 ``[pages, page_size, Hkv]``):
    per-(token, head) scales, multiplied on top (:mod:`aiter_attn.kv_scales`).

    With ``lse`` (float32 ``[T, Hq]``), also writes ``lse[t, h] = ln Σ exp(s)`` over the visible
    (scaled, soft-capped) logits and the sink: the flash-attn convention; ``-inf`` for a row
    with nothing visible and no sink.

    Batch-invariant by construction (``batch_invariant`` is accepted and changes nothing): each
    request is computed alone, with torch ops whose shapes are its own.

    Shapes: q ``[T, Hq, D]``; caches ``[pages, page_size, Hkv, D|Dv]``; out ``[T, Hq, Dv]``.
    Index inputs may be strided views. Their values are checked first
    (:func:`aiter_attn.validation.check_paged_index_values`: a bad page id, ``cu_seqlens_q``
    or ``seqused_k`` raises ``ValueError``).
    """
    check_paged_index_values(
        num_tokens=q.shape[0], num_pages=k_cache.shape[0], page_size=k_cache.shape[1],
        cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table, causal=causal,
        window_size=window_size, custom_mask=custom_mask, mask_indptr=mask_indptr,
        max_seqlen_q=max_seqlen_q)
    token_scales = check_token_scale_caches(k_cache, v_cache, k_scale_cache, v_scale_cache)
    # k/v scales dequantise fp8 caches only (aiter_attn.types.kv_dequant_scales)
    k_scale, v_scale = kv_dequant_scales(k_cache.dtype, k_scale, v_scale)
    ks, vs = _scale_value(k_scale, "k_scale"), _scale_value(v_scale, "v_scale")
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    lens = seqused_k.tolist()
    left, right = window_size
    for b in range(len(lens)):
        q0, q1 = cu[b], cu[b + 1]
        n, kv_len = q1 - q0, lens[b]
        if n == 0:
            continue
        k = _gather_request_kv(k_cache, block_table[b], kv_len) * ks  # [L, Hkv, D]
        v = _gather_request_kv(v_cache, block_table[b], kv_len) * vs
        if token_scales:  # one more factor per (key, head)
            k = k * _gather_request_kv(k_scale_cache.unsqueeze(-1), block_table[b], kv_len)
            v = v * _gather_request_kv(v_scale_cache.unsqueeze(-1), block_table[b], kv_len)
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()  # [n, Hq, D]
        s = torch.einsum("nhd,lhd->hnl", qb, k) * softmax_scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(kv_len - n, kv_len, device=q.device).unsqueeze(1)  # [n, 1]
        key = torch.arange(kv_len, device=q.device).unsqueeze(0)  # [1, L]
        visible = torch.ones(n, kv_len, dtype=torch.bool, device=q.device)
        if causal:
            visible &= key <= pos
        if left >= 0:
            visible &= key >= pos - left
        if right >= 0:
            visible &= key <= pos + right
        if custom_mask is not None:
            start = int(mask_indptr[b])
            visible &= custom_mask[start : start + n * kv_len].reshape(n, kv_len).bool()
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(num_q_heads, 1, 1).expand(num_q_heads, n, 1)
            s = torch.cat([s, sink], dim=-1)
        if lse is not None:
            lse[q0:q1] = torch.logsumexp(s, dim=-1).transpose(0, 1).to(lse.dtype)  # [n, Hq]
        # no key at all (non-causal, seqused_k 0, no sink): zeros, like a fully masked row
        row_max = s.amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(s - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
        o = torch.einsum("hnl,lhd->nhd", p[..., :kv_len], v)
        out[q0:q1] = o.to(out.dtype)
    return out


def mla_paged_attention_reference(
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
    lse: Optional[torch.Tensor] = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Absorbed MLA: one latent KV head; keys are the whole ``kv_lora_rank + rope`` vector, values
    its first ``kv_lora_rank`` dims. q ``[T, H, kv_lora + rope]``, kv_cache
    ``[pages, page_size, 1, kv_lora + rope]``, out ``[T, H, kv_lora]``; optional ``lse``
    float32 ``[T, H]`` as in :func:`paged_attention_reference`.

    The index values (``max_seqlen_q`` included) are checked first, as in
    :func:`paged_attention_reference`, and errors name this op."""
    check_paged_index_values(
        num_tokens=q.shape[0], num_pages=kv_cache.shape[0], page_size=kv_cache.shape[1],
        cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table, causal=causal,
        custom_mask=custom_mask, mask_indptr=mask_indptr, max_seqlen_q=max_seqlen_q,
        op="mla_paged_attention")
    return paged_attention_reference(
        q,
        kv_cache,
        kv_cache[..., :kv_lora_rank],
        out,
        cu_seqlens_q=cu_seqlens_q,
        seqused_k=seqused_k,
        block_table=block_table,
        softmax_scale=softmax_scale,
        causal=causal,
        k_scale=kv_scale,
        v_scale=kv_scale,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        lse=lse,
    )


def merge_attention_states_reference(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets, in float32.

    With ``M = max(lse_a, lse_b)``, ``w_x = exp(lse_x − M)``:
    ``out = (w_a·o_a + w_b·o_b) / (w_a + w_b)`` and ``out_lse = M + ln(w_a + w_b)``. A side
    with ``lse = −inf`` (nothing visible) has weight 0 and its ``o`` is never read into the
    result (so even a NaN there cannot leak); both sides ``−inf`` give ``out = 0`` and
    ``out_lse = −inf``.

    Shapes: o_a, o_b, out ``[T, H, D]``; lse_a, lse_b, out_lse float32 ``[T, H]``.
    """
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    den = wa + wb
    ta = torch.where((wa > 0).unsqueeze(-1), wa.unsqueeze(-1) * o_a.float(), 0.0)
    tb = torch.where((wb > 0).unsqueeze(-1), wb.unsqueeze(-1) * o_b.float(), 0.0)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out.copy_(((ta + tb) / safe.unsqueeze(-1)).to(out.dtype))
    out_lse.copy_(torch.where(den > 0, m + torch.log(safe), float("-inf")).to(out_lse.dtype))
    return out, out_lse


def write_kv_reference(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    *,
    k_scale=None,
    v_scale=None,
    k_scale_cache: Optional[torch.Tensor] = None,
    v_scale_cache: Optional[torch.Tensor] = None,
) -> None:
    """Reshape-and-cache: ``cache.flat[slots[t]] = quantise(k[t])`` for every token ``t``.

    Caches ``[pages, page_size, H, D]``; slots int64 ``[T]``; k ``[T, H, D]``. Slots are
    written exactly; a negative slot (a padding row, as in the Triton writer) is skipped;
    every other slot is left byte-identical. No host sync (graph-capturable): skipped rows
    are redirected to the reserved slot 0 and write back its own bytes.

    With ``k_scale_cache``/``v_scale_cache`` (fp8 caches; float32 ``[pages, page_size, H]``)
    each (token, head) vector is quantised with its own scale
    (:func:`quantize_per_token_head`), which is stored at the same slot and head.
    """
    if check_token_scale_caches(k_cache, v_cache if v is not None else None, k_scale_cache,
                                v_scale_cache if v is not None else None):
        q, s = quantize_per_token_head(k, k_cache.dtype, k_scale)
        _write_slots(k_cache, slots, q)
        _write_slots(k_scale_cache, slots, s)
        if v_cache is not None and v is not None:
            q, s = quantize_per_token_head(v, v_cache.dtype, v_scale)
            _write_slots(v_cache, slots, q)
            _write_slots(v_scale_cache, slots, s)
        return
    _write_slots(k_cache, slots, quantize_to_cache(k, k_cache.dtype, k_scale))
    if v_cache is not None and v is not None:
        _write_slots(v_cache, slots, quantize_to_cache(v, v_cache.dtype, v_scale))


_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache.flat[slots[t]] = values[t]`` for ``slots[t] ≥ 0``; negative slots untouched.
    Compares raw bytes (``torch.where`` has no fp8 kernels).

    Without a host sync (no boolean indexing), every row writes somewhere: a padding row
    writes the last live row's value into that row's slot (the same bytes the live row
    writes, so the duplicate index is harmless whichever write lands last), or, in a batch
    with no live row, slot 0's own bytes back. (Redirecting padding rows to slot 0 with slot
    0's old bytes raced with a live row writing slot 0: on CUDA the stale bytes won; H200,
    ``test_gpu_token_head_write_bytes_equal_reference``, 2026-12-04.)"""
    raw = cache.view(_RAW_DTYPES[cache.element_size()])  # [pages, page_size, ...]
    if slots.numel() == 0:
        return
    page_size = cache.shape[1]  # pages may be strided apart (padded pages): no flat view
    slots = slots.long()
    vals = values.view(raw.dtype)
    live = slots >= 0
    pos = torch.arange(slots.shape[0], device=slots.device)
    last = torch.where(live, pos, -1).max()  # 0-dim, on the device
    has_live = last >= 0
    # index_select with a 1-element index: indexing with a 0-dim tensor reads it on the host
    last = last.clamp_min(0).view(1)
    target = torch.where(has_live, slots.index_select(0, last), 0)
    target_val = torch.where(has_live, vals.index_select(0, last), raw[0, :1])
    shape = (-1, *([1] * (vals.dim() - 1)))
    idx = torch.where(live, slots, target)
    raw[idx // page_size, idx % page_size] = torch.where(live.view(shape), vals, target_val)


def build_page_table_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[b, i] = req_to_token[req_pool_indices[b], i·page_size] // page_size`` for
    ``i < ceil(seq_lens[b] / page_size)``, else 0 (null page). No host sync.

    req_to_token int32 ``[R, C]``; req_pool_indices int64 ``[B]``; seq_lens int32 ``[B]``;
    out int32 ``[B, W]``.
    """
    width = out.shape[1]
    cols = req_to_token[:, ::page_size][:, :width]
    rows = cols.index_select(0, req_pool_indices.long()) // page_size
    n_pages = (seq_lens.long() + page_size - 1) // page_size
    idx = torch.arange(rows.shape[1], device=out.device).unsqueeze(0)
    rows = torch.where(idx < n_pages.unsqueeze(1), rows, torch.zeros_like(rows))
    out.zero_()
    out[:, : rows.shape[1]] = rows.to(out.dtype)
    return out


def build_page_tables_swa_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    full_to_swa: torch.Tensor,
    out: torch.Tensor,
    out_swa: torch.Tensor,
) -> torch.Tensor:
    """The full page table (as :func:`build_page_table_reference`) and its SWA translation
    ``out_swa[b, i] = full_to_swa[out[b, i] · page_size] // page_size`` (0 past each
    request's pages, and where the SWA copy was freed). full_to_swa int64 ``[full_slots]``;
    out_swa like out. Returns ``out``."""
    build_page_table_reference(req_to_token, req_pool_indices, seq_lens, page_size, out)
    first_slot = out.to(torch.int64) * page_size
    out_swa.copy_(torch.div(full_to_swa[first_slot], page_size, rounding_mode="floor"))
    n_pages = (seq_lens.long() + page_size - 1) // page_size
    idx = torch.arange(out.shape[1], device=out.device).unsqueeze(0)
    out_swa.masked_fill_(idx >= n_pages.unsqueeze(1), 0)
    return out


def build_ragged_kv_indices_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    total: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level ragged indices: ``kv_indptr = [0, cumsum(seq_lens)]`` and
    ``kv_indices[kv_indptr[b] + j] = req_to_token[req_pool_indices[b], j]``. ``total`` is the
    host-known ``sum(seq_lens)`` (from the CPU mirror) so nothing syncs.

    kv_indptr int32 ``[B + 1]``; kv_indices int32 ``[≥ total]``.
    """
    bs = seq_lens.shape[0]
    kv_indptr[:1].zero_()  # a tensor op: a scalar store copies from the host (no capture)
    torch.cumsum(seq_lens, dim=0, out=kv_indptr[1 : bs + 1])
    if total:
        req = torch.repeat_interleave(
            torch.arange(bs, device=seq_lens.device), seq_lens.long(), output_size=total
        )
        pos = torch.arange(total, device=seq_lens.device) - kv_indptr[req].long()
        kv_indices[:total] = req_to_token[req_pool_indices.long()[req], pos].to(kv_indices.dtype)
    return kv_indptr, kv_indices


@hookimpl
def aiter_attn_register_kernels(register):
    """Register the references: any device, any dtype, every feature; lowest priority."""
    everything = Capabilities(
        features={"sinks", "softcap", "window", "fp8", "custom_mask", "v_head_dim_differs",
                  "non_causal", "lse", "batch_invariant", TOKEN_SCALE_FEATURE},
        cg_support=CGSupport.NEVER,
    )
    register("paged_attention", "reference", paged_attention_reference, everything, priority=0)
    register("mla_paged_attention", "reference", mla_paged_attention_reference, everything,
             priority=0)
    # torch ops on device tensors only, no host reads: capture-safe
    register("merge_attention_states", "reference", merge_attention_states_reference,
             Capabilities(cg_support=CGSupport.ALWAYS), priority=0)
    index_caps = Capabilities(cg_support=CGSupport.ALWAYS, features={"fp8"})
    register("write_kv", "reference", write_kv_reference,
             Capabilities(cg_support=CGSupport.ALWAYS, features={"fp8", TOKEN_SCALE_FEATURE}),
             priority=0)
    register("build_page_table", "reference", build_page_table_reference, index_caps, priority=0)
    register("build_page_tables_swa", "reference", build_page_tables_swa_reference, index_caps,
             priority=0)
    register("build_ragged_kv_indices", "reference", build_ragged_kv_indices_reference,
             index_caps, priority=0)
