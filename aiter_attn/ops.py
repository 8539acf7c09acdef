"""Functional ops: the kernel contract. Each validates its inputs (no device sync), selects an
implementation from the kernel registry (cached per request) and runs it; the attention ops
select a kernel object once per cheap key and call it (plan + run in one call: see
:mod:`aiter_attn.kernels.base`).

``backend=None`` picks the best registered implementation; ``"reference"`` / ``"triton"`` / a
plugin's name forces one (and raises with reasons if it cannot serve).
"""

from __future__ import annotations

import numbers
from typing import Optional

import attrs
import torch

from .kernels.base import FunctionKernel, LayerParams, _adhoc_metadata, mla_request
from .kernels.registry import KernelRequest
from .types import FP8_DTYPES
from .validation import (
    ATTN_DTYPES,
    INDEX_DTYPES,
    check_attention_scalars,
    check_own_elements,
    check_host_count,
    check_page_size_arg,
    check_pool_rows,
    check_pool_values,
    check_same_device,
    check_scale,
    check_tensor,
    debug_checks_enabled,
    env_value,
    unit_stride,
)

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


_PLUGIN_STATE: Optional[dict] = None


def _registry():
    """The process-wide kernel registry (a dict lookup once loaded)."""
    global _PLUGIN_STATE
    state = _PLUGIN_STATE
    reg = state.get("kernels") if state is not None else None
    if reg is None:
        from . import plugins

        reg = plugins.kernel_registry()
        _PLUGIN_STATE = plugins._state
    return reg


def _check_window(window_size):
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window_size)
    ):
        raise ValueError(
            f"window_size={window_size!r}; expected a (left, right) pair of ints ≥ -1 "
            "(-1 = unbounded). HF sliding_window=w is (w - 1, 0)."
        )


def _check_flag(name, value) -> bool:
    """A boolean argument: ``bool`` (numpy's too) or the ints 0 / 1; anything else (a string
    such as ``"False"``, ``None``) is refused rather than read by its truth value."""
    kind = type(value)
    if isinstance(value, bool) or (kind.__module__ == "numpy"
                                   and kind.__name__ in ("bool", "bool_")):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name}={value!r} must be a bool (True or False).")


def _check_hint(name, value):
    """A host length hint (``max_seqlen_q`` / ``max_seqlen_k``): ``None`` or an int ≥ 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be None or an int ≥ 0 (a host bound of the "
                        "per-request lengths; pass int(...)).")
    if value < 0:
        raise ValueError(f"{name}={value!r} must be None or an int ≥ 0 (a host bound of the "
                         "per-request lengths).")
    return int(value)


def _check_cache_axes(name, cache, *, heads: bool = True):
    """A paged cache ``[pages, page_size, heads, dim]`` with at least one token per page and
    (``heads``) one head: the ops divide by both."""
    if cache.shape[1] < 1:
        raise ValueError(f"{name} has shape {tuple(cache.shape)}; its page_size (axis 1) must "
                         "be ≥ 1.")
    if heads and cache.shape[2] < 1:
        raise ValueError(f"{name} has shape {tuple(cache.shape)}; its num_kv_heads (axis 2) "
                         "must be ≥ 1.")


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


def _lse_buffer(return_lse, out_lse, q):
    """The float32 ``[T, H]`` LSE buffer of a ``return_lse`` call (``out_lse`` checked, or a new
    one), or ``None`` without ``return_lse``/``out_lse``."""
    if out_lse is None:
        if not return_lse:
            return None
        return torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    check_tensor("out_lse", out_lse, dtypes=(torch.float32,), ndim=2,
                 shape=(q.shape[0], q.shape[1]),
                 hint="out_lse is float32 [num_tokens, num_q_heads].")
    check_own_elements("out_lse", out_lse)
    check_same_device("q", q, out_lse=out_lse)
    return out_lse


def _check_mask(custom_mask, mask_indptr, cu_seqlens_q):
    """A tree-verify mask: both or neither, bool/uint8 flat mask, ``[batch + 1]`` indptr
    (devices are checked with the op's other tensors)."""
    if (custom_mask is None) != (mask_indptr is None):
        raise ValueError("custom_mask and mask_indptr go together; pass both or neither.")
    if custom_mask is not None:
        check_tensor("custom_mask", custom_mask, dtypes=(torch.bool, torch.uint8), ndim=1)
        check_tensor("mask_indptr", mask_indptr, dtypes=INDEX_DTYPES, ndim=1,
                     shape=(cu_seqlens_q.shape[0],))


def _check_batch_tensors(q, cu_seqlens_q, seqused_k, block_table, out, v_head_dim: int):
    """The per-request index tensors and ``out`` of a paged call (any cache layout):
    cu_seqlens_q ``[batch + 1]``, seqused_k ``[batch]``, block_table ``[batch, *]``, out
    ``[num_tokens, num_q_heads, v_head_dim]`` in q's dtype."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, ndim=1,
                 hint="cu_seqlens_q is int32 [batch + 1].")
    if cu_seqlens_q.shape[0] == 0:
        raise ValueError("cu_seqlens_q has shape (0,); expected [batch + 1] offsets starting "
                         "at 0 (an empty batch is [0]).")
    bs = cu_seqlens_q.shape[0] - 1
    check_tensor("seqused_k", seqused_k, dtypes=INDEX_DTYPES, ndim=1, shape=(bs,),
                 hint="seqused_k is int32 [batch]: KV length per request.")
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2, shape=(bs, None),
                 hint="block_table is int32 [batch, max_pages_per_request].")
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), ndim=3,
                     shape=(q.shape[0], q.shape[1], v_head_dim),
                     hint="out is [num_tokens, num_q_heads, head_dim_v] in q's dtype.")
        check_own_elements("out", out)


def _check_sinks(sinks, num_q_heads: int) -> None:
    """Per-call sinks: ``None`` or floating ``[num_q_heads]`` logits."""
    if sinks is None:
        return
    check_tensor("sinks", sinks, ndim=1, shape=(num_q_heads,),
                 hint="sinks is float32 [num_q_heads].")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks has dtype {sinks.dtype}; sinks are floating-point logits "
                        "(float32 [num_q_heads]). Convert them with .float().")


def _validate_paged(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, out,
                    **optional_tensors):
    check_tensor("q", q, dtypes=ATTN_DTYPES, ndim=3,
                 hint="q is [num_tokens, num_q_heads, head_dim].")
    kv_dtypes = ATTN_DTYPES + tuple(FP8_DTYPES)
    check_tensor("k_cache", k_cache, dtypes=kv_dtypes, ndim=4,
                 hint="k_cache is [num_pages, page_size, num_kv_heads, head_dim].")
    _check_cache_axes("k_cache", k_cache)
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4,
                 shape=(k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], None),
                 hint="v_cache is [num_pages, page_size, num_kv_heads, head_dim_v] like k_cache.")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(
            f"q head_dim={q.shape[2]} but k_cache head_dim={k_cache.shape[3]}; they must match."
        )
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"num_q_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache.shape[2]}; "
            "GQA needs whole groups of query heads per KV head."
        )
    _check_batch_tensors(q, cu_seqlens_q, seqused_k, block_table, out, v_cache.shape[3])
    check_same_device("q", q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q,
                      seqused_k=seqused_k, block_table=block_table, out=out, **optional_tensors)


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


def mla_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    kv_lora_rank: int,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    kv_scale=None,
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
    """Absorbed MLA over a latent paged cache.

    Args:
        q: ``[num_tokens, num_heads, kv_lora_rank + rope_dim]`` (q_nope absorbed + q_rope).
        kv_cache: ``[num_pages, page_size, 1, kv_lora_rank + rope_dim]``; values are its first
            ``kv_lora_rank`` dims.
        Others as in :func:`paged_attention` (``return_lse``/``out_lse`` included).

    Returns:
        ``[num_tokens, num_heads, kv_lora_rank]`` in q's dtype; with ``return_lse`` the pair
        ``(out, lse)``, lse float32 ``[num_tokens, num_heads]``.
    """
    check_tensor("q", q, dtypes=ATTN_DTYPES, ndim=3,
                 hint="q is [num_tokens, num_heads, kv_lora_rank + rope_dim].")
    check_tensor("kv_cache", kv_cache, dtypes=ATTN_DTYPES + tuple(FP8_DTYPES), ndim=4,
                 shape=(None, None, 1, q.shape[2]),
                 hint="kv_cache is [num_pages, page_size, 1, kv_lora_rank + rope_dim].")
    _check_cache_axes("kv_cache", kv_cache, heads=False)
    causal = _check_flag("causal", causal)
    return_lse = _check_flag("return_lse", return_lse)
    batch_invariant = _check_flag("batch_invariant", batch_invariant)
    max_seqlen_q = _check_hint("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_hint("max_seqlen_k", max_seqlen_k)
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, numbers.Integral):
        raise TypeError(f"kv_lora_rank={kv_lora_rank!r} must be a Python int (the latent "
                        "width, e.g. 512); pass int(...).")
    kv_lora_rank = int(kv_lora_rank)
    if not 0 < kv_lora_rank <= q.shape[2]:
        raise ValueError(f"kv_lora_rank={kv_lora_rank}; must be in 1..{q.shape[2]} (q's last dim).")
    _validate_paged(q, kv_cache, kv_cache[..., :kv_lora_rank], cu_seqlens_q, seqused_k,
                    block_table, out, custom_mask=custom_mask, mask_indptr=mask_indptr,
                    kv_scale=kv_scale)
    softmax_scale, _ = check_attention_scalars(softmax_scale, kv_scale=kv_scale)
    _check_mask(custom_mask, mask_indptr, cu_seqlens_q)
    lse = _lse_buffer(return_lse, out_lse, q)
    # non_causal: kernels that serve causal attention only are not selected
    req = mla_request(q, kv_cache, kv_lora_rank, custom_mask=custom_mask is not None,
                      lse=lse is not None, batch_invariant=batch_invariant, causal=causal)
    sel = _registry().select(req, backend=backend)
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    extra = call_extras(lse, batch_invariant)
    out = sel.fn(
        q, kv_cache, out, kv_lora_rank=kv_lora_rank, cu_seqlens_q=cu_seqlens_q,
        seqused_k=seqused_k, block_table=block_table, softmax_scale=float(softmax_scale),
        causal=causal, kv_scale=kv_scale, custom_mask=custom_mask, mask_indptr=mask_indptr,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **extra,
    )
    return out if lse is None else (out, lse)


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


def write_kv(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    *,
    k_scale=None,
    v_scale=None,
    backend: Optional[str] = None,
) -> None:
    """Write this step's K/V into the paged cache at ``slots`` (int64 ``[num_tokens]``),
    quantising to fp8 with the scales when the cache is fp8. Touches only those slots.

    Caches ``[num_pages, page_size, heads, dim]``; k/v ``[num_tokens, heads, dim]``.
    """
    check_tensor("k_cache", k_cache, dtypes=ATTN_DTYPES + tuple(FP8_DTYPES), ndim=4,
                 hint="k_cache is [num_pages, page_size, num_kv_heads, head_dim].")
    _check_cache_axes("k_cache", k_cache)
    if (v_cache is None) != (v is None):
        raise ValueError("v_cache and v go together; pass both or neither (v_cache=None, "
                         "v=None: a single latent cache).")
    check_tensor("slots", slots, dtypes=INDEX_DTYPES, ndim=1,
                 hint="slots (out_cache_loc) is int64 [num_tokens].")
    check_tensor("k", k, dtypes=ATTN_DTYPES, ndim=3,
                 shape=(slots.shape[0], k_cache.shape[2], k_cache.shape[3]),
                 hint="k is [num_tokens, num_kv_heads, head_dim] matching the cache.")
    if v is not None:
        # v_cache's slots are k_cache's (a smaller v_cache would be written past its end)
        check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4,
                     shape=(k_cache.shape[0], k_cache.shape[1], None, None),
                     hint="v_cache is [num_pages, page_size, num_kv_heads, head_dim_v] with "
                          "k_cache's pages and dtype.")
        check_tensor("v", v, dtypes=ATTN_DTYPES, ndim=3,
                     shape=(slots.shape[0], v_cache.shape[2], v_cache.shape[3]),
                     hint="v is [num_tokens, num_kv_heads, head_dim_v] matching the cache.")
    check_same_device("k_cache", k_cache, v_cache=v_cache, slots=slots, k=k, v=v,
                      k_scale=k_scale, v_scale=v_scale)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    req = KernelRequest(
        op="write_kv", device=k_cache.device.type, dtype=k.dtype, kv_dtype=k_cache.dtype,
        head_dim=k_cache.shape[3], page_size=k_cache.shape[1],
        features={"fp8"} if k_cache.dtype in FP8_DTYPES else (),
    )
    _registry().select(req, backend=backend).fn(
        k_cache, v_cache, slots, k, v, k_scale=k_scale, v_scale=v_scale
    )


def build_page_table(req_to_token, req_pool_indices, seq_lens, page_size, out, *, backend=None):
    """Fill ``out`` (int32 ``[batch, max_pages]``) with each request's page ids (0 past its
    length). See :func:`aiter_attn.kernels.reference.build_page_table_reference`."""
    check_page_size_arg(page_size)
    check_pool_rows(req_to_token, req_pool_indices, seq_lens, "build_page_table")
    check_tensor("out", out, dtypes=INDEX_DTYPES, ndim=2, shape=(seq_lens.shape[0], None),
                 hint="out is the int32 [batch, max_pages] page table (one row per request).")
    check_same_device("out", out, req_to_token=req_to_token,
                      req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    if debug_checks_enabled():
        check_pool_values(req_to_token, req_pool_indices, seq_lens, "build_page_table")
    req = KernelRequest(op="build_page_table", device=out.device.type, page_size=page_size)
    return _registry().select(req, backend=backend).fn(
        req_to_token, req_pool_indices, seq_lens, page_size, out
    )


def build_page_tables_swa(req_to_token, req_pool_indices, seq_lens, page_size, full_to_swa, out,
                          out_swa, *, backend=None):
    """:func:`build_page_table` into ``out`` and, in the same pass, the SWA pool's table into
    ``out_swa`` (same shape): ``full_to_swa[page · page_size] // page_size`` per entry (0 past
    each request's pages). ``full_to_swa``: the hybrid pool's int64 ``[full_slots]`` mapping.
    See :func:`aiter_attn.kernels.reference.build_page_tables_swa_reference`."""
    check_same_device("out", out, full_to_swa=full_to_swa, out_swa=out_swa)
    req = KernelRequest(op="build_page_tables_swa", device=out.device.type, page_size=page_size)
    return _registry().select(req, backend=backend).fn(
        req_to_token, req_pool_indices, seq_lens, page_size, full_to_swa, out, out_swa
    )


def build_draft_decode_indices(req_to_token, req_pool_indices, seq_lens, page_size, topk,
                               num_steps, cu_seqlens_q, draft_req_pool_indices, seqused_k,
                               positions, out_cache_loc, block_table, *, backend=None):
    """The indices of every multi-step draft-decode pass in one device pass (no host sync):
    per-row query offsets and request rows, and per step the KV lengths, positions, the slots
    of this step's draft tokens and each branch's page table. See
    :func:`aiter_attn.kernels.reference_extra.build_draft_decode_indices_reference`."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r}; must be a positive int.")
    rows = seq_lens.shape[0] * topk
    steps = block_table.shape[0]
    for name, t, shape in (("cu_seqlens_q", cu_seqlens_q, (rows + 1,)),
                           ("draft_req_pool_indices", draft_req_pool_indices, (rows,)),
                           ("seqused_k", seqused_k, (steps, rows)),
                           ("positions", positions, (steps, rows)),
                           ("out_cache_loc", out_cache_loc, (steps, rows))):
        check_tensor(name, t, dtypes=INDEX_DTYPES, shape=shape,
                     hint="views of MultiStepDraftBackend's buffers sized for this batch.")
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=3,
                 shape=(steps, rows, None))
    check_same_device("block_table", block_table, req_to_token=req_to_token,
                      req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    req = KernelRequest(op="build_draft_decode_indices", device=block_table.device.type,
                        page_size=page_size)
    return _registry().select(req, backend=backend).fn(
        req_to_token, req_pool_indices, seq_lens, page_size, topk, num_steps, cu_seqlens_q,
        draft_req_pool_indices, seqused_k, positions, out_cache_loc, block_table)


def build_tree_mask(seq_lens, tree, q_len, mask_indptr, out, total, *, backend=None):
    """Expand a tree-verify mask's draft part to SGLang's full layout on the device (no host
    sync): for request ``b`` with ``L = seq_lens[b]`` keys and prefix ``P = L - q_len``,
    ``out[mask_indptr[b] + i·L + j] = j < P  or  tree[b, i, j - P]``. Arguments as
    :func:`aiter_attn.kernels.reference_extra.build_tree_mask_reference`."""
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1,
                 hint="seq_lens is int32 [batch]: KV length per request, draft tokens included.")
    bs = seq_lens.shape[0]
    check_tensor("tree", tree, dtypes=(torch.bool, torch.uint8),
                 hint="tree is the bool [batch, q_len, q_len] draft-tree visibility.")
    q_len = check_host_count("q_len", q_len, "the draft tokens per request")
    check_tensor("mask_indptr", mask_indptr, dtypes=INDEX_DTYPES, ndim=1, shape=(bs + 1,),
                 hint="mask_indptr is int64 [batch + 1]: each request's offset into out.")
    check_tensor("out", out, dtypes=(torch.bool, torch.uint8), ndim=1,
                 hint="out is the flat bool mask buffer [≥ total].")
    total = check_host_count("total", total, "q_len · sum(seq_lens), from the CPU mirror")
    if total > out.shape[0]:
        raise ValueError(f"total={total} mask elements but out holds {out.shape[0]}; size out "
                         "from q_len · sum(seq_lens) (or the graph manager's bound).")
    check_same_device("out", out, seq_lens=seq_lens, tree=tree, mask_indptr=mask_indptr)
    req = KernelRequest(op="build_tree_mask", device=out.device.type)
    return _registry().select(req, backend=backend).fn(seq_lens, tree, q_len, mask_indptr, out,
                                                        total)


def build_ragged_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
                            total: int, *, backend=None):
    """Token-level ``kv_indptr``/``kv_indices``; ``total`` = host-known ``sum(seq_lens)``.

    req_to_token int ``[R, C]``; req_pool_indices, seq_lens int ``[B]``; kv_indptr
    int32/int64 ``[≥ B + 1]``; kv_indices int32/int64 ``[≥ total]``. See
    :func:`aiter_attn.kernels.reference.build_ragged_kv_indices_reference`."""
    check_pool_rows(req_to_token, req_pool_indices, seq_lens, "build_ragged_kv_indices")
    bs = seq_lens.shape[0]
    check_tensor("kv_indptr", kv_indptr, dtypes=INDEX_DTYPES, ndim=1,
                 hint="kv_indptr is int32 [≥ batch + 1].")
    if kv_indptr.shape[0] < bs + 1:
        raise ValueError(f"kv_indptr has shape {tuple(kv_indptr.shape)}; needs ≥ batch + 1 = "
                         f"{bs + 1} entries. Size it from the batch (or the graph bound).")
    check_tensor("kv_indices", kv_indices, dtypes=INDEX_DTYPES, ndim=1,
                 hint="kv_indices is int32 [≥ total].")
    total = check_host_count("total", total, "sum(seq_lens), from the batch's CPU mirror")
    if total > kv_indices.shape[0]:
        raise ValueError(f"total={total} tokens but kv_indices holds {kv_indices.shape[0]}; "
                         "size it from the batch's seq_lens_sum (or the graph manager's bound).")
    check_same_device("kv_indices", kv_indices, req_to_token=req_to_token,
                      req_pool_indices=req_pool_indices, seq_lens=seq_lens, kv_indptr=kv_indptr)
    if debug_checks_enabled():
        check_pool_values(req_to_token, req_pool_indices, seq_lens, "build_ragged_kv_indices",
                           total=total)
    req = KernelRequest(op="build_ragged_kv_indices", device=kv_indices.device.type)
    return _registry().select(req, backend=backend).fn(
        req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, total
    )
