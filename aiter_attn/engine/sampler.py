"""Token selection: greedy argmax, or seeded temperature + top-p sampling per request."""

from __future__ import annotations

from typing import Sequence

import torch

from .request import Request

__all__ = ["sample_tokens", "top_p_filter"]


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the nucleus of ``probs`` (float32 ``[V]``) and renormalise.

    The nucleus is the smallest highest-probability set whose mass reaches ``top_p``; the most
    likely token always stays.
    """
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_p, dim=0) - sorted_p
    sorted_p = torch.where(mass_before < top_p, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return kept / kept.sum()


def sample_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """One token id per request from float32 ``logits [len(requests), V]``.

    Greedy requests take ``argmax`` (first index on ties, as ``transformers`` does). Sampling
    requests draw from ``softmax(logits / temperature)`` after top-p, with the request's own
    CPU generator (seeded once from its ``seed``), so a seed reproduces the same text whatever
    else is in the batch.
    """
    if len(requests) == 0:
        return []
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, req in enumerate(requests):
        p = req.params
        if p.greedy:
            continue
        if req.generator is None:
            g = torch.Generator()
            if p.seed is not None:
                g.manual_seed(p.seed)
            else:
                g.seed()  # non-deterministic, and leaves the global RNG alone
            req.generator = g
        row = logits[i].float().cpu()
        # shifting by the max first keeps a tiny temperature finite: the max maps to 0, the
        # rest to ≤ 0 (or -inf), never inf - inf = NaN; the softmax is the same
        probs = torch.softmax((row - row.max()) / p.temperature, dim=-1)
        probs = top_p_filter(probs, p.top_p)
        tokens[i] = int(torch.multinomial(probs, 1, generator=req.generator))
    return tokens
