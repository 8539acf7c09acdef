"""Execution helpers shared by the NHD-family strategies (MHA, SWA, VEC5D): one attention call
through the layer group's bound kernel object (:func:`attend_layer`), and a tree mask with a sliding window folded in at the tokens' path
positions, derived from the mask (a branch sees the ``w`` most recent tokens of its own path)."""

from __future__ import annotations

import torch

from ..batch import ForwardBatch
from ..kernels.registry import KernelRequest
from ..kv_scales import TOKEN_SCALE_FEATURE
from ..metadata import AttnMetadata, CustomMask, QueryLayout
from ..types import FP8_DTYPES, LayerSpec
from .base import ExecutionStrategy

__all__ = ["attend_layer", "effective_causal", "effective_window", "kv_pair_error",
           "require_pool", "window_tree_mask", "write_kv_request", "write_kwargs"]


def window_tree_mask(mask: CustomMask, batch: ForwardBatch, query: QueryLayout,
                     window: int) -> CustomMask:
    """Fold HF ``sliding_window = window`` into a tree mask at the tokens' path positions.

    For request ``b`` (``L`` keys, ``n`` queries, block ``[mask_indptr[b], mask_indptr[b+1])``
    of the flat mask, row-major ``[n, L]``): key ``j < L - n`` (cached prefix) is at position
    ``j``; draft token ``t`` is at ``L - n + depth(t)``, where ``depth(t)`` = (draft tokens
    row ``t`` of the mask sees) − 1: its ancestors, itself excluded (SGLang's EAGLE positions,
    prefix + depth). The positions come from the mask itself, so they are right for every
    tree whatever ``batch.positions`` holds (it is not read). The result keeps ``mask[i, j]``
    where ``pos(j) ≥ pos(i) - window + 1`` and is False past the last block.

    Graph-safe: elementwise passes over the whole mask tensor and one scatter-add into
    ``[num_tokens]`` (sizes are shapes: static buffers under CUDA graphs), every index on the
    device; no host integer from the batch. Returns a new mask of the same shape with the
    same ``mask_indptr``.
    """
    bs = batch.batch_size
    if bs == 0:
        return mask
    dev = mask.custom_mask.device
    n = query.max_seqlen_q
    ip = mask.mask_indptr.to(torch.int64)
    seq = batch.seq_lens.to(torch.int64)
    e = torch.arange(mask.custom_mask.numel(), dtype=torch.int64, device=dev)
    b = torch.searchsorted(ip[1:], e, right=True)
    valid = b < bs
    b = b.clamp(max=bs - 1)
    local = torch.where(valid, e - ip[b], torch.zeros_like(e))
    L = seq[b]
    i, j = local // L, local % L
    prefix = L - n
    visible = valid & mask.custom_mask.reshape(-1).bool()
    is_draft = j >= prefix
    # depth of each query token: the draft tokens its row sees, minus itself
    num_tokens = max(int(query.cu_seqlens_q.shape[0] - 1) * n, 1)  # a shape: bs · n
    cu = query.cu_seqlens_q.to(torch.int64)
    row = (cu[b] + i.clamp(max=n - 1)).clamp(max=num_tokens - 1)
    seen = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    seen.scatter_add_(0, row, (visible & is_draft).to(torch.int64))
    depth = (seen - 1).clamp(min=0)
    q_pos = prefix + depth[row]
    key_row = (cu[b] + (j - prefix).clamp(min=0, max=n - 1)).clamp(max=num_tokens - 1)
    k_pos = torch.where(is_draft, prefix + depth[key_row], j)
    keep = visible & (k_pos >= q_pos - (window - 1))
    return CustomMask(custom_mask=keep.view(mask.custom_mask.shape), mask_indptr=mask.mask_indptr)


def attend_layer(executor: ExecutionStrategy, request_fn, q, k_cache, v_cache, layer: LayerSpec,
                 batch: ForwardBatch, md: AttnMetadata, sinks=None, *, pages_key=None,
                 kv_scales=None):
    """One attention call of ``layer`` through its group's kernel object: bound once per
    layer group (``request_fn`` builds the group's request on first use: the op's
    ``*_request(q, k_cache, v_cache, window_size=, softcap=, sinks=, causal=,
    custom_mask=)``), planned once per step, launched here. ``pages_key`` names the
    ``md.extras`` page table the layer reads (``None``: ``md.pages``). ``sinks`` default to
    ``layer.sinks``. ``kv_scales``: the pool's per-(token, head) ``(k_scales, v_scales)`` of
    the layer (bound once into its params), or ``None``. Returns ``[num_tokens, Hq * Dv]`` in
    ``q``'s dtype.

    The hot path: one dict lookup for the binding, one for the step's plan, the output
    allocation and the launch.
    """
    b = executor.bind_layer(layer, md, request_fn, q, k_cache, v_cache, sinks, pages_key,
                            kv_scales)
    kp = md.kernel_plans.plans.get(b.group)
    if kp is None:  # first call of this group in the step (or a group bound just now)
        kp = executor.plan_group(executor.groups[b.group], md, batch)
    num_tokens = q.shape[0]
    out = q.new_empty((num_tokens, b.out_heads, b.out_dim))  # q's dtype and device
    b.kernel.run(q, (k_cache, v_cache), kp, b.params, out)
    return out.view(num_tokens, b.out_width)


def write_kv_request(op: str, k_cache: torch.Tensor, k: torch.Tensor,
                     token_scales: bool = False) -> KernelRequest:
    """The kernel-registry key of a KV write ``op`` (``write_kv`` / ``write_kv_swa``) into NHD
    ``k_cache`` from ``k``; ``token_scales``: the write also quantises per (token, head)."""
    features = {"fp8"} if k_cache.dtype in FP8_DTYPES else set()
    if token_scales:
        features.add(TOKEN_SCALE_FEATURE)
    return KernelRequest(op=op, device=k_cache.device.type, dtype=k.dtype,
                         kv_dtype=k_cache.dtype, head_dim=k_cache.shape[3],
                         page_size=k_cache.shape[1], features=features)


def write_kwargs(layer: LayerSpec, kv_scales) -> dict:
    """The scale keywords of a KV write of ``layer``: its k/v scales, plus the pool's
    per-(token, head) scale buffers when it has them (``kv_scales``)."""
    kw = {"k_scale": layer.k_scale, "v_scale": layer.v_scale}
    if kv_scales is not None:
        kw["k_scale_cache"], kw["v_scale_cache"] = kv_scales
    return kw


def kv_pair_error(layer: LayerSpec, k, v) -> ValueError:
    """The error of a layer call that would write only one of K and V (``k`` or ``v`` is
    ``None`` with ``save_kv_cache=True``): NHD-family caches store both for every slot."""
    given, missing = ("k", "v") if v is None else ("v", "k")
    return ValueError(
        f"layer {layer.layer_id}: {given} given but {missing}=None with save_kv_cache=True; the "
        f"KV cache stores both k and v of every new token. Pass both ([num_tokens, "
        "num_kv_heads * head_dim(_v)]), or neither with save_kv_cache=False when the cache "
        "already holds them.")


def require_pool(ctx, pool_cls: type, arch: str, hint: str = ""):
    """``ctx.kv_pool`` if it is a ``pool_cls`` with ``BackendConfig.page_size``; else TypeError
    (naming ``arch`` and ending with ``hint``) or ValueError (the two page sizes)."""
    pool = ctx.kv_pool
    if not isinstance(pool, pool_cls):
        raise TypeError(
            f"arch={arch} needs an aiter_attn.kvcache.{pool_cls.__name__} as kv_pool, got "
            f"{type(pool).__name__}{hint}."
        )
    if pool.page_size != ctx.config.page_size:
        raise ValueError(
            f"{pool_cls.__name__} page_size={pool.page_size} != BackendConfig.page_size="
            f"{ctx.config.page_size}; build both with the same page size."
        )
    return pool


def effective_causal(layer: LayerSpec, md: AttnMetadata) -> bool:
    """Causal unless the layer is not (cross-attention, ``causal=False``) or a tree mask is
    planned: a mask is applied literally
    (the kernel runs non-causal and the mask alone says what each query sees), the project's
    convention for MHA, MLA and the seed."""
    return layer.is_causal and md.mask is None


def effective_window(layer: LayerSpec, md: AttnMetadata) -> tuple[int, int]:
    """The ``window_size`` the kernel sees (``(-1, -1)`` when folded into a tree mask)."""
    if md.mask is not None and layer.sliding_window is not None:
        return (-1, -1)
    return layer.window_size()
