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
    dev = q.device  # float64 on the inputs' device: a GPU test's oracle stays off the host
    qd = q.double()
    kd = k.to(dev, torch.float64).repeat_interleave(g, 1)
    vd = v.to(dev, torch.float64).repeat_interleave(g, 1)
    pos = torch.arange(L - n, L, device=dev).view(n, 1)  # absolute position of each query
    key = torch.arange(L, device=dev).view(1, L)
    visible = torch.ones(n, L, dtype=torch.bool, device=dev)
    if causal:
        visible &= key <= pos
    if window[0] >= 0:
        visible &= key >= pos - window[0]
    if window[1] >= 0:
        visible &= key <= pos + window[1]
    if mask is not None:
        if tuple(mask.shape) != (n, L):  # a [L] or [1, L] mask would broadcast over the rows
            raise ValueError(f"mask has shape {tuple(mask.shape)}; expected ({n}, {L}) (one row "
                             "per query, one column per key position).")
        visible &= mask.to(dev).bool()
    sink = None if sinks is None else sinks.to(dev, torch.float64).view(hq, 1, 1)
    out = torch.empty(n, hq, v.shape[-1], dtype=torch.float64, device=dev)
    lse = torch.empty(n, hq, dtype=torch.float64, device=dev)
    # query rows in chunks of at most ~64 Mi logits each, all rows of a chunk at once
    rows = max(1, (1 << 26) // max(1, hq * (L + 1)))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        logits = torch.einsum("nhd,lhd->hnl", qd[a:b], kd) * scale  # [Hq, c, L]
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~visible[a:b], float("-inf"))
        if sink is not None:
            logits = torch.cat([logits, sink.expand(hq, b - a, 1)], -1)
        chunk_lse = torch.logsumexp(logits, dim=-1)  # [Hq, c]; -inf: nothing visible, no sink
        lse[a:b] = chunk_lse.transpose(0, 1)
        # a row with nothing visible has lse -inf: subtract 0 there, so its weights are
        # exp(-inf) = 0 and its output zeros
        shift = torch.where(torch.isfinite(chunk_lse), chunk_lse, 0.0).unsqueeze(-1)
        w = torch.exp(logits - shift)[..., :L]
        out[a:b] = torch.einsum("hnl,lhd->nhd", w, vd)
    out, lse = out.cpu(), lse.cpu()
    return (out, lse) if return_lse else out
