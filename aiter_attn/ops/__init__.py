"""Functional ops: the kernel contract. Each validates its inputs (no device sync), selects an
implementation from the kernel registry (cached per request) and runs it; the attention ops
select a kernel object once per cheap key and call it (plan + run in one call: see
:mod:`aiter_attn.kernels.base`).

``backend=None`` picks the best registered implementation; ``"reference"`` / ``"triton"`` / a
plugin's name forces one (and raises with reasons if it cannot serve).

One family of ops per module, every name re-exported here: :func:`paged_attention` and its
call memo live in this module (its names are looked up here, so a test that patches
``ops._validate_paged`` or ``ops.paged_attention_request`` reaches it); :mod:`.mla`
(:func:`mla_paged_attention`), :mod:`.merge` (:func:`merge_attention_states`),
:mod:`.kv_write` (:func:`write_kv`) and :mod:`.index` (the index builders); shared by them,
:mod:`.selection` (the kernel registry and request keys) and :mod:`._checks` (argument
checks).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.base import FunctionKernel, LayerParams, _adhoc_metadata
from ..types import FP8_DTYPES
from ..validation import check_attention_scalars, debug_checks_enabled, env_value, unit_stride
from . import selection as _selection
from ._checks import (_check_flag, _check_hint, _check_mask, _check_sinks, _check_window,
                      _lse_buffer, _validate_paged)
from .index import (build_draft_decode_indices, build_page_table, build_page_tables_swa,
                    build_ragged_kv_indices, build_tree_mask)
from .kv_write import write_kv
from .merge import merge_attention_states
from .mla import mla_paged_attention
from .selection import (_registry, attention_features, call_extras, paged_attention_request,
                        with_call_features)

# names this module held before the split into per-family modules, importable from here still
# (the argument checks now look ``check_tensor`` up in ._checks, not here)
import numbers  # noqa: F401
import attrs  # noqa: F401
from ..kernels.base import mla_request  # noqa: F401
from ..kernels.registry import KernelRequest  # noqa: F401
from ..validation import (ATTN_DTYPES, INDEX_DTYPES, check_host_count,  # noqa: F401
                          check_own_elements, check_page_size_arg, check_pool_rows,
                          check_pool_values, check_same_device, check_scale, check_tensor)
from ._checks import _check_batch_tensors, _check_cache_axes  # noqa: F401

__all__ = [
    "paged_attention",
    "mla_paged_attention",
    "merge_attention_states",
    "write_kv",
    "build_page_table",
    "build_page_tables_swa",
    "build_draft_decode_indices",
    "build_tree_mask",
    "build_ragged_kv_indices",
    "paged_attention_request",
    "attention_features",
    "with_call_features",
    "call_extras",
]


def __getattr__(name):
    # ``_PLUGIN_STATE`` lives beside ``_registry`` (which rebinds it) in .selection
    if name == "_PLUGIN_STATE":
        return _selection._PLUGIN_STATE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
    out: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
    return_lse: bool = False,
    out_lse: Optional[torch.Tensor] = None,
    batch_invariant: bool = False,
):
    """Attention of ragged queries over a paged KV cache (decode, prefill, extend, mixed).

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]`` fp16/bf16/fp32.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim(_v)]`` (NHD pages),
            fp16/bf16/fp32 or fp8 (then ``k_scale``/``v_scale`` dequantise).
        cu_seqlens_q: int32 ``[batch + 1]``: query offsets; request b's queries are the last
            ``q_len[b]`` tokens of its ``seqused_k[b]`` keys.
        seqused_k: int32 ``[batch]``: KV length per request, this step's tokens included.
        block_table: int32 ``[batch, max_pages]``: page ids per request.
        softmax_scale: multiplies q·k.
        causal: mask keys after each query's position.
        window_size: flash-attn ``(left, right)``; HF ``sliding_window=w`` ⇒ ``(w-1, 0)``.
        softcap: logits ← ``softcap·tanh(logits/softcap)`` when > 0.
        sinks: float32 ``[num_q_heads]``: an extra unscaled logit per head with no value.
        k_scale, v_scale: dequantisation scales for fp8 caches: a number or a 0-d / 1-element
            tensor (per-head / per-sequence descale tensors are refused, see
            :func:`aiter_attn.validation.check_scale`).
        out: optional ``[num_tokens, num_q_heads, head_dim_v]`` output buffer.
        custom_mask, mask_indptr: tree-verify mask (bool flat, int64 ``[batch + 1]``).
        backend: force an implementation by name.
        return_lse: also return the float32 ``[num_tokens, num_q_heads]`` log-sum-exp of each
            row (natural log of Σ exp over the visible scaled, soft-capped logits and the sink:
            the flash-attn convention; ``-inf`` for a fully masked row, whose output is 0).
            Only kernels declaring the ``lse`` feature are selected.
        out_lse: optional float32 ``[num_tokens, num_q_heads]`` buffer for it (implies
            ``return_lse``).
        batch_invariant: each row's output bitwise independent of the other requests in the
            batch, of the batch size and of the ``max_seqlen_*`` hints (fixed tiles, splits of
            a fixed key count, fixed-order reduction, no atomics). Only kernels declaring the
            ``batch_invariant`` feature are selected.

    Returns:
        ``[num_tokens, num_q_heads, head_dim_v]`` in q's dtype; with ``return_lse`` (or
        ``out_lse``) the pair ``(out, lse)``.
    """
    reg = _registry()
    # the call memo: a call whose tensors have the shapes, dtypes, devices and strides of an
    # earlier validated call, with the same scalars and the same index tensors (by identity:
    # the plan holds them and reads no values), reuses that call's selection, plan and layer
    # constants and only allocates its output and launches
    key = _call_key(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, softmax_scale,
                    causal, window_size, softcap, sinks, k_scale, v_scale, out, max_seqlen_q,
                    max_seqlen_k, custom_mask, mask_indptr, backend, return_lse, out_lse,
                    batch_invariant)
    if key is not None:
        hit = reg.calls.get(key)
        if hit is not None:
            kernel, plan, params, shape, reusable, md, _ = hit
            if plan is None or (reusable is not None and not reusable(plan)):
                # a split workspace (one call's scratch) or changed launch tuning: plan
                # again from the kept metadata (validation, selection, params still hold)
                plan = kernel.plan(md)
                hit[1] = plan if reusable is None or reusable(plan) else None
            if out is None:
                out = q.new_empty(shape)  # q's dtype and device
            if out_lse is None and not return_lse:
                return kernel.run(q, (k_cache, v_cache), plan, params, out)
            lse = _lse_buffer(True, out_lse, q)
            return kernel.run(q, (k_cache, v_cache), plan, params, out, lse=lse), lse
    _validate_paged(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, out,
                    sinks=sinks, custom_mask=custom_mask, mask_indptr=mask_indptr,
                    k_scale=k_scale, v_scale=v_scale)
    _check_window(window_size)
    causal = _check_flag("causal", causal)
    return_lse = _check_flag("return_lse", return_lse)
    batch_invariant = _check_flag("batch_invariant", batch_invariant)
    max_seqlen_q = _check_hint("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_hint("max_seqlen_k", max_seqlen_k)
    softmax_scale, softcap = check_attention_scalars(softmax_scale, softcap, k_scale=k_scale,
                                                     v_scale=v_scale)
    _check_sinks(sinks, q.shape[1])
    _check_mask(custom_mask, mask_indptr, cu_seqlens_q)
    lse = _lse_buffer(return_lse, out_lse, q)
    window_size = tuple(window_size)
    # select once per cheap key (everything the request depends on), then plan + run

    def request():
        req = paged_attention_request(q, k_cache, v_cache, window_size=window_size,
                                      softcap=softcap, sinks=sinks, causal=causal,
                                      custom_mask=custom_mask)
        # batch_invariant travels in the request: the bound kernel plans accordingly
        return with_call_features(req, lse=lse is not None, batch_invariant=batch_invariant)

    bkey = ("paged_attention", q.dtype, q.device.type, q.shape[1], q.shape[2], k_cache.dtype,
            k_cache.shape[1], k_cache.shape[2], v_cache.shape[3], window_size != (-1, -1),
            softcap > 0, sinks is not None, bool(causal), custom_mask is not None,
            lse is not None, bool(batch_invariant))
    kernel = reg.bound(bkey, request, backend=backend)
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype, device=q.device)
    if key is None or not _memo_plans(kernel):
        extra = call_extras(lse, False)
        out = kernel(
            q, k_cache, v_cache, out,
            cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table,
            softmax_scale=float(softmax_scale), causal=causal, window_size=window_size,
            softcap=float(softcap), sinks=sinks, k_scale=k_scale, v_scale=v_scale,
            custom_mask=custom_mask, mask_indptr=mask_indptr,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **extra,
        )
        return out if lse is None else (out, lse)
    # what the kernel's functional call does (AttentionKernel.__call__), kept for the memo
    md = _adhoc_metadata(q, k_cache, cu_seqlens_q, seqused_k, block_table, custom_mask,
                         mask_indptr, max_seqlen_q, max_seqlen_k, kernel.op)
    params = LayerParams.create(
        scale=softmax_scale, device=q.device, window=window_size, softcap=softcap,
        causal=causal, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        fp8=k_cache.dtype in FP8_DTYPES)
    plan = kernel.plan(md)
    if lse is None:
        out = kernel.run(q, (k_cache, v_cache), plan, params, out)
    else:
        out = kernel.run(q, (k_cache, v_cache), plan, params, out, lse=lse)
    # memoise only a call whose plan reads the caller's own tensors (the kernels copy a
    # strided index input or strided sinks: a memo would keep reading the copy), and not
    # while a CUDA graph is captured (tensors made now, the params' fp8 scale tensors, hold
    # their values only once the graph replays); a plan that holds a workspace of its own
    # (``plan_reusable`` false) is made again per call from the kept metadata
    held = (cu_seqlens_q, seqused_k, block_table, sinks, custom_mask, mask_indptr)
    if all(unit_stride(t) is t for t in held) and not (
            q.is_cuda and torch.cuda.is_current_stream_capturing()):
        calls = reg.calls
        if len(calls) >= _CALLS_KEEP:
            try:  # the oldest; another thread may be storing too
                calls.pop(next(iter(calls)), None)
            except (RuntimeError, StopIteration):
                calls.clear()
        # the entry holds the keyed tensors themselves, so their ids stay theirs (and no
        # plan with a workspace: that is planned per call)
        reusable = getattr(kernel, "plan_reusable", None)
        calls[key] = [kernel, plan if reusable is None or reusable(plan) else None, params,
                      (q.shape[0], q.shape[1], v_cache.shape[3]), reusable, md, held]
    return out if lse is None else (out, lse)


#: memoised ops calls (each holds its index tensors alive: keep few)
_CALLS_KEEP = 32
_NUMBERS = (float, int)


def _memo_plans(kernel) -> bool:
    """Whether ``kernel``'s functional call is plan + run with :class:`LayerParams`, so a
    memo of its plan and params replays the call: adapted functions (their plan keeps the
    index tensors) and kernels declaring ``memo_plans = True`` (the Triton ones)."""
    return isinstance(kernel, FunctionKernel) or getattr(kernel, "memo_plans", False) is True


def _meta(t):
    """Identity, shape, dtype, device and strides of an optional tensor argument the plan
    or the layer constants hold (sinks, mask)."""
    if t is None:
        return None
    return (id(t), t.shape, t.dtype, t.device, t.stride())


def _out_meta(t):
    """Shape, dtype and device of an optional output buffer (validated per call by these)."""
    if t is None:
        return None
    return (t.shape, t.dtype, t.device)


def _call_key(q, k_cache, v_cache, cu, sk, bt, softmax_scale, causal, window_size, softcap,
              sinks, k_scale, v_scale, out, max_q, max_k, custom_mask, mask_indptr, backend,
              return_lse, out_lse, batch_invariant):
    """The memo key of a :func:`paged_attention` call, or ``None`` when the call is not
    memoised (the checked mode; a scalar that is not a plain number, bool or int; a
    non-tensor argument: the full path then validates and raises). Everything validation,
    selection and planning depend on is in it: each tensor's shape, dtype and device (and
    strides: the plan's index layout), the index tensors' and sinks' identity, the scalars'
    values and the environment's backend override."""
    if (softmax_scale.__class__ not in _NUMBERS or softcap.__class__ not in _NUMBERS
            or causal.__class__ is not bool or return_lse.__class__ is not bool
            or batch_invariant.__class__ is not bool or window_size.__class__ is not tuple
            or not (k_scale is None or k_scale.__class__ in _NUMBERS)
            or not (v_scale is None or v_scale.__class__ in _NUMBERS)
            or not (max_q is None or max_q.__class__ is int)
            or not (max_k is None or max_k.__class__ is int)
            or debug_checks_enabled()):
        return None
    try:
        if len(window_size) != 2 or window_size[0].__class__ is not int \
                or window_size[1].__class__ is not int:
            return None
        opt = None
        if sinks is not None or out is not None or out_lse is not None \
                or custom_mask is not None or mask_indptr is not None:
            opt = (_meta(sinks), _out_meta(out), _out_meta(out_lse), _meta(custom_mask),
                   _meta(mask_indptr))
        return (q.shape, q.dtype, q.device, k_cache.shape, k_cache.dtype, k_cache.device,
                v_cache.shape, v_cache.dtype, v_cache.device,
                id(cu), cu.shape, cu.dtype, cu.device, cu.stride(),
                id(sk), sk.shape, sk.dtype, sk.device, sk.stride(),
                id(bt), bt.shape, bt.dtype, bt.device, bt.stride(),
                softmax_scale, softcap, causal, window_size, k_scale, v_scale, max_q, max_k,
                backend, return_lse, batch_invariant, env_value("AITER_ATTN_BACKEND"), opt)
    except AttributeError:  # not a tensor: the full path names it
        return None
