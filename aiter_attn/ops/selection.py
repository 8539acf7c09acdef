"""Kernel selection for the ops: the process-wide kernel registry and the request keys
(:class:`~aiter_attn.kernels.registry.KernelRequest`) the attention ops select by."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..kernels.registry import KernelRequest
from ..types import FP8_DTYPES

__all__ = ["paged_attention_request", "attention_features", "with_call_features",
           "call_extras"]


_PLUGIN_STATE: Optional[dict] = None


def _registry():
    """The process-wide kernel registry (a dict lookup once loaded)."""
    global _PLUGIN_STATE
    state = _PLUGIN_STATE
    reg = state.get("kernels") if state is not None else None
    if reg is None:
        from .. import plugins

        reg = plugins.kernel_registry()
        _PLUGIN_STATE = plugins._state
    return reg


def attention_features(*, kv_dtype: torch.dtype, head_dim: int, v_head_dim: int,
                       window_size=(-1, -1), softcap=0.0, sinks=None, causal=True,
                       custom_mask=None) -> set:
    """The optional features an attention call uses (``KernelRequest.features``): ``sinks``,
    ``softcap``, ``window``, ``fp8`` (cache dtype), ``custom_mask``, ``v_head_dim_differs``,
    ``non_causal``. Shared by every paged-attention op's request builder."""
    features = set()
    if sinks is not None:
        features.add("sinks")
    if softcap and softcap > 0:
        features.add("softcap")
    if tuple(window_size) != (-1, -1):
        features.add("window")
    if kv_dtype in FP8_DTYPES:
        features.add("fp8")
    if custom_mask is not None:
        features.add("custom_mask")
    if v_head_dim != head_dim:
        features.add("v_head_dim_differs")
    if not causal:
        features.add("non_causal")
    return features


def paged_attention_request(
    q, k_cache, v_cache, *, window_size=(-1, -1), softcap=0.0, sinks=None, causal=True,
    custom_mask=None,
) -> KernelRequest:
    """The kernel-registry key for a paged-attention call with these inputs."""
    features = attention_features(
        kv_dtype=k_cache.dtype, head_dim=k_cache.shape[-1], v_head_dim=v_cache.shape[-1],
        window_size=window_size, softcap=softcap, sinks=sinks, causal=causal,
        custom_mask=custom_mask)
    return KernelRequest(
        op="paged_attention",
        device=q.device.type,
        dtype=q.dtype,
        kv_dtype=k_cache.dtype,
        head_dim=q.shape[-1],
        v_head_dim=v_cache.shape[-1],
        page_size=k_cache.shape[1],
        features=features,
        extra=(("q_heads", q.shape[1]), ("kv_heads", k_cache.shape[2])),
    )


def with_call_features(req: KernelRequest, *, lse: bool = False,
                       batch_invariant: bool = False) -> KernelRequest:
    """``req`` with the per-call features ``lse`` / ``batch_invariant`` added when asked."""
    extra = ({"lse"} if lse else set()) | ({"batch_invariant"} if batch_invariant else set())
    return attrs.evolve(req, features=req.features | extra) if extra else req


def call_extras(lse, batch_invariant) -> dict:
    """Keyword arguments a kernel gets only when the call uses them (kernels that do not
    declare the feature never see them)."""
    extra = {}
    if lse is not None:
        extra["lse"] = lse
    if batch_invariant:
        extra["batch_invariant"] = True
    return extra
