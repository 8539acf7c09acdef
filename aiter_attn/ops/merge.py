"""The merge op, :func:`merge_attention_states`: two partial attention results over
disjoint key sets combined into the result over their union."""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.registry import KernelRequest
from ..validation import ATTN_DTYPES, check_own_elements, check_same_device, check_tensor
from .selection import _registry

__all__ = ["merge_attention_states"]


def merge_attention_states(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    out_lse: Optional[torch.Tensor] = None,
    *,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets into the result over their
    union, exactly (up to rounding): with ``M = max(lse_a, lse_b)`` and ``w = exp(lse − M)``,
    ``out = (w_a·o_a + w_b·o_b) / (w_a + w_b)``, ``out_lse = M + ln(w_a + w_b)``.

    A part with ``lse = -inf`` (nothing visible) has weight 0 and its ``o`` is ignored; both
    ``-inf`` give ``out = 0``, ``out_lse = -inf`` (no NaN). Sinks belong to exactly one of
    the two parts (the part computed with them).

    Args:
        o_a, o_b: ``[num_tokens, num_heads, head_dim]`` (fp16/bf16/fp32, same dtype), e.g.
            ``paged_attention(..., return_lse=True)`` outputs.
        lse_a, lse_b: float32 ``[num_tokens, num_heads]`` natural-log LSEs.
        out: optional ``[num_tokens, num_heads, head_dim]`` in o_a's dtype (may be o_a or o_b).
        out_lse: optional float32 ``[num_tokens, num_heads]`` (may be lse_a or lse_b).
        backend: force an implementation by name.

    Returns:
        ``(out, out_lse)``.
    """
    check_tensor("o_a", o_a, dtypes=ATTN_DTYPES, ndim=3,
                 hint="o_a is [num_tokens, num_heads, head_dim].")
    shape = tuple(o_a.shape)
    check_tensor("o_b", o_b, dtypes=(o_a.dtype,), ndim=3, shape=shape,
                 hint="o_b is [num_tokens, num_heads, head_dim] like o_a.")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, t, dtypes=(torch.float32,), ndim=2, shape=shape[:2],
                     hint=f"{name} is float32 [num_tokens, num_heads] (return_lse=True output).")
    if out is not None:
        check_tensor("out", out, dtypes=(o_a.dtype,), ndim=3, shape=shape,
                     hint="out is [num_tokens, num_heads, head_dim] in o_a's dtype.")
    if out_lse is not None:
        check_tensor("out_lse", out_lse, dtypes=(torch.float32,), ndim=2, shape=shape[:2],
                     hint="out_lse is float32 [num_tokens, num_heads].")
    check_own_elements("out", out)
    check_own_elements("out_lse", out_lse)
    check_same_device("o_a", o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, out=out, out_lse=out_lse)
    req = KernelRequest(op="merge_attention_states", device=o_a.device.type, dtype=o_a.dtype,
                        head_dim=shape[2])
    sel = _registry().select(req, backend=backend)
    if out is None:
        out = torch.empty_like(o_a)
    if out_lse is None:
        out_lse = torch.empty(shape[:2], dtype=torch.float32, device=o_a.device)
    return sel.fn(o_a, lse_a, o_b, lse_b, out, out_lse)
