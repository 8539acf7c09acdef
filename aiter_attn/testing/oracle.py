"""Dense float64 attention oracle: the same semantics as ``ops.paged_attention`` computed from
per-request dense K/V, independent of pages, slots and kernels."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["dense_attention"]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    return_lse: bool = False,
):
    """One request in float64.

    q ``[n, Hq, D]`` are the last ``n`` of the ``L`` positions of k ``[L, Hkv, D]`` /
    v ``[L, Hkv, Dv]``; ``mask`` bool ``[n, L]`` (True = visible) is applied literally.
    Returns float64 ``[n, Hq, Dv]``; rows with nothing visible (and no sinks) are zero. With
    ``return_lse``, also the float64 ``[n, Hq]`` natural-log LSE of each row's visible logits
    and sink (``-inf`` with neither): ``(out, lse)``.
    """
    n, hq, _ = q.shape
    L, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    qd = q.double().cpu()
    kd = k.double().cpu().repeat_interleave(g, 1)
    vd = v.double().cpu().repeat_interleave(g, 1)
    pos = torch.arange(L - n, L).view(n, 1)  # absolute position of each query
    key = torch.arange(L).view(1, L)
    visible = torch.ones(n, L, dtype=torch.bool)
    if causal:
        visible &= key <= pos
    if window[0] >= 0:
        visible &= key >= pos - window[0]
    if window[1] >= 0:
        visible &= key <= pos + window[1]
    if mask is not None:
        visible &= mask.bool().cpu()
    logits = torch.einsum("nhd,lhd->hnl", qd, kd) * scale
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double().cpu().view(hq, 1, 1).expand(hq, n, 1)], -1)
    out = torch.zeros(n, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.logsumexp(logits, dim=-1).transpose(0, 1).contiguous()  # [n, Hq]
    for i in range(n):
        row = logits[:, i]  # [Hq, L (+1)]
        if not torch.isfinite(row).any():
            continue  # nothing visible, no sink: zeros
        w = torch.softmax(row, dim=-1)[:, :L]
        out[i] = torch.einsum("hl,lhd->hd", w, vd)
    return (out, lse) if return_lse else out
