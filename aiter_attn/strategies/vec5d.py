"""VEC5D strategies: the vectorised ("SHUFFLE") 5-D KV layout the seed routes to AMD's
``pa_decode_gluon``, for DECODE/IDLE, EXTEND/DRAFT_EXTEND, TARGET_VERIFY (chain and tree)
and DRAFT_EXTEND_V2.

Pages and slots are those of the NHD pool, so planning is exactly the MHA and speculative
planning (:mod:`aiter_attn.strategies.mha`, :mod:`aiter_attn.strategies.spec`) over
``req_to_token``; chain and tree verify are separate pairs chosen by
``BackendConfig.spec.topk``. Execution writes K/V with op ``write_kv_5d`` and attends with op
``paged_attention_5d``; both dispatch through the kernel registry. This module registers the
float32 torch reference of ``paged_attention_5d`` (:mod:`aiter_attn.kernels.reference_5d`,
where the layout and its sources are documented) and offers validated functional forms,
:func:`paged_attention_5d` and :func:`write_kv_5d`.
Sliding-window layers of a VEC5D model use the one pool with the window applied (tree verify
folds the window into the mask, as for SWA). A hybrid SWA pool in the 5-D layout (the seed
allocates its SWA sub-pool 5-D too) is not provided: ``AttnArch`` names one of the two.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..batch import ForwardBatch
from ..contract import CHAIN_VERIFY, TREE_VERIFY
from ..hookspecs import hookimpl
from ..kernels.reference_5d import paged_attention_5d_reference, v_layout_of, vec_width
from ..kernels.registry import Capabilities, KernelRequest
from ..metadata import AttnMetadata
from ..ops import (_check_batch_tensors, _check_mask, _check_sinks, _check_window, _lse_buffer,
                   attention_features, call_extras, with_call_features)
from ..registry import Cell, register_cells
from ..types import FP8_DTYPES, AttnArch, CGSupport, ForwardMode, LayerSpec
from ..validation import (
    ATTN_DTYPES,
    INDEX_DTYPES,
    check_attention_scalars,
    check_same_device,
    check_scale,
    check_tensor,
)
from .base import ExecutionStrategy
from .common import attend_layer, kv_pair_error, require_pool
from .mha import DecodeMetadata, ExtendMetadata
from .spec import (
    DraftDecodeStepMetadata,
    DraftExtendV2Metadata,
    VerifyChainMetadata,
    VerifyTreeMetadata,
)
from .swa import chain_verify_only, tree_verify_only

__all__ = [
    "paged_attention_5d",
    "paged_attention_5d_request",
    "write_kv_5d",
    "write_kv_5d_request",
    "check_5d_caches",
    "Vec5DExecution",
]


def _registry():
    from ..plugins import kernel_registry

    return kernel_registry()


def check_5d_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Structural checks of a 5-D K cache and its V cache (shuffled 5-D or hd_page 4-D)."""
    check_tensor("k_cache", k_cache, dtypes=ATTN_DTYPES + tuple(FP8_DTYPES), ndim=5,
                 hint="k_cache is [num_pages, num_kv_heads, head_dim // x, page_size, x].")
    n, h, _, p, x = k_cache.shape
    if x != vec_width(k_cache.dtype):
        raise ValueError(
            f"k_cache's last dim is {x} but x = 16 bytes / element size = "
            f"{vec_width(k_cache.dtype)} for {k_cache.dtype}; allocate it with Vec5DKVPool."
        )
    if v_cache.dim() == 5:
        check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=5,
                     shape=(n, h, p // x, None, x),
                     hint="shuffled v_cache is [num_pages, num_kv_heads, page_size // x, "
                          "head_dim_v, x].")
        if p % x:
            raise ValueError(f"page_size={p} is not a multiple of x={x} for the shuffled V layout.")
    else:
        check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4, shape=(n, h, None, p),
                     hint="v_cache is [num_pages, num_kv_heads, head_dim_v, page_size] (hd_page) "
                          "or the 5-D shuffled layout.")


def _v_head_dim(v_cache):
    return v_cache.shape[3] if v_cache.dim() == 5 else v_cache.shape[2]


def paged_attention_5d_request(q, k_cache, v_cache, *, window_size=(-1, -1), softcap=0.0,
                               sinks=None, causal=True, custom_mask=None) -> KernelRequest:
    """The kernel-registry key for a ``paged_attention_5d`` call with these inputs."""
    head_dim = k_cache.shape[2] * k_cache.shape[4]
    features = attention_features(
        kv_dtype=k_cache.dtype, head_dim=head_dim, v_head_dim=_v_head_dim(v_cache),
        window_size=window_size, softcap=softcap, sinks=sinks, causal=causal,
        custom_mask=custom_mask)
    return KernelRequest(
        op="paged_attention_5d", device=q.device.type, dtype=q.dtype, kv_dtype=k_cache.dtype,
        head_dim=head_dim, v_head_dim=_v_head_dim(v_cache), page_size=k_cache.shape[3],
        features=features,
        extra=(("q_heads", q.shape[1]), ("kv_heads", k_cache.shape[1]),
               ("v_layout", v_layout_of(v_cache))),
    )


def paged_attention_5d(q, k_cache, v_cache, *, cu_seqlens_q, seqused_k, block_table,
                       softmax_scale, causal=True, window_size=(-1, -1), softcap=0.0, sinks=None,
                       k_scale=None, v_scale=None, out=None, max_seqlen_q=None,
                       max_seqlen_k=None, custom_mask=None, mask_indptr=None,
                       backend: Optional[str] = None, return_lse: bool = False,
                       out_lse: Optional[torch.Tensor] = None, batch_invariant: bool = False):
    """:func:`aiter_attn.ops.paged_attention` over the 5-D layout.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``.
        k_cache: ``[num_pages, num_kv_heads, head_dim // x, page_size, x]``.
        v_cache: ``[num_pages, num_kv_heads, page_size // x, head_dim_v, x]`` (shuffled) or
            ``[num_pages, num_kv_heads, head_dim_v, page_size]`` (hd_page).
        Others exactly as in :func:`aiter_attn.ops.paged_attention` (``return_lse``,
        ``out_lse`` and ``batch_invariant`` included).

    Returns:
        ``[num_tokens, num_q_heads, head_dim_v]`` in q's dtype; with ``return_lse`` the pair
        ``(out, lse)``, lse float32 ``[num_tokens, num_q_heads]``.
    """
    check_tensor("q", q, dtypes=ATTN_DTYPES, ndim=3,
                 hint="q is [num_tokens, num_q_heads, head_dim].")
    check_5d_caches(k_cache, v_cache)
    head_dim = k_cache.shape[2] * k_cache.shape[4]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim={q.shape[2]} but k_cache holds head_dim={head_dim}.")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"num_q_heads={q.shape[1]} is not a multiple of num_kv_heads="
                         f"{k_cache.shape[1]}.")
    _check_batch_tensors(q, cu_seqlens_q, seqused_k, block_table, out, _v_head_dim(v_cache))
    _check_sinks(sinks, q.shape[1])
    check_same_device("q", q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q,
                      seqused_k=seqused_k, block_table=block_table, out=out, sinks=sinks,
                      custom_mask=custom_mask, mask_indptr=mask_indptr)
    _check_window(window_size)
    _check_mask(custom_mask, mask_indptr, cu_seqlens_q)
    softmax_scale, softcap = check_attention_scalars(softmax_scale, softcap, k_scale=k_scale,
                                                     v_scale=v_scale)
    lse = _lse_buffer(return_lse, out_lse, q)
    req = paged_attention_5d_request(q, k_cache, v_cache, window_size=window_size,
                                     softcap=softcap, sinks=sinks, causal=causal,
                                     custom_mask=custom_mask)
    req = with_call_features(req, lse=lse is not None, batch_invariant=batch_invariant)
    sel = _registry().select(req, backend=backend)
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], _v_head_dim(v_cache), dtype=q.dtype,
                          device=q.device)
    extra = call_extras(lse, False)
    # batch-invariant: a kernel bound to the request with the feature (it plans accordingly)
    fn = sel.bind(req) if batch_invariant else sel.fn
    out = fn(q, k_cache, v_cache, out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                 block_table=block_table, softmax_scale=float(softmax_scale), causal=causal,
                 window_size=tuple(window_size), softcap=float(softcap), sinks=sinks,
                 k_scale=k_scale, v_scale=v_scale, custom_mask=custom_mask,
                 mask_indptr=mask_indptr, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                 **extra)
    return out if lse is None else (out, lse)


def write_kv_5d_request(k_cache, v_cache, k) -> KernelRequest:
    """The kernel-registry key of a ``write_kv_5d`` call (``extra`` names the V layout so an
    implementation that takes only one layout can reject the other in its predicate)."""
    return KernelRequest(
        op="write_kv_5d", device=k_cache.device.type, dtype=k.dtype, kv_dtype=k_cache.dtype,
        head_dim=k_cache.shape[2] * k_cache.shape[4], page_size=k_cache.shape[3],
        features={"fp8"} if k_cache.dtype in FP8_DTYPES else (),
        extra=(("v_layout", v_layout_of(v_cache)),),
    )


def write_kv_5d(k_cache, v_cache, slots, k, v, *, k_scale=None, v_scale=None,
                backend: Optional[str] = None) -> None:
    """Write this step's K/V (``[T, kv_heads, head_dim(_v)]``) into the 5-D caches at ``slots``
    (int64 ``[T]``), quantising to fp8 with the scales when the cache is fp8."""
    check_5d_caches(k_cache, v_cache)
    check_tensor("slots", slots, dtypes=INDEX_DTYPES, ndim=1,
                 hint="slots (out_cache_loc) is int64 [num_tokens].")
    head_dim = k_cache.shape[2] * k_cache.shape[4]
    check_tensor("k", k, dtypes=ATTN_DTYPES, ndim=3,
                 shape=(slots.shape[0], k_cache.shape[1], head_dim),
                 hint="k is [num_tokens, num_kv_heads, head_dim] matching the cache.")
    check_tensor("v", v, dtypes=ATTN_DTYPES, ndim=3,
                 shape=(slots.shape[0], k_cache.shape[1], _v_head_dim(v_cache)),
                 hint="v is [num_tokens, num_kv_heads, head_dim_v] matching the cache.")
    check_same_device("k_cache", k_cache, v_cache=v_cache, slots=slots, k=k, v=v,
                      k_scale=k_scale, v_scale=v_scale)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    sel = _registry().select(write_kv_5d_request(k_cache, v_cache, k), backend=backend)
    sel.fn(k_cache, v_cache, slots, k, v, k_scale=k_scale, v_scale=v_scale)


class Vec5DExecution(ExecutionStrategy):
    """Write K/V with ``write_kv_5d``, then one ``paged_attention_5d`` over the page table."""

    def __init__(self, ctx):
        super().__init__(ctx)
        from ..kvcache.vec5d import Vec5DKVPool

        require_pool(ctx, Vec5DKVPool, "VEC5D")

    def run(self, q, k, v, layer: LayerSpec, batch: ForwardBatch, metadata: AttnMetadata, *,
            save_kv_cache: bool = True, sinks=None):
        k_cache, v_cache = self.ctx.kv_pool.kv_buffers(layer.layer_id)
        if self._fits.get(id(layer)) is not layer:  # first call: layer vs pool, before writes
            self.check_layer(layer, k_cache, v_cache)
        num_tokens = q.shape[0]
        q = q.view(num_tokens, layer.num_q_heads, layer.head_dim)
        if save_kv_cache and (k is None) != (v is None):
            raise kv_pair_error(layer, k, v)
        if save_kv_cache and k is not None:
            k3 = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
            write = self.kernel_for(("write_kv_5d", layer, k.dtype),
                                    lambda: write_kv_5d_request(k_cache, v_cache, k3),
                                    fallback=True)
            write.fn(k_cache, v_cache, batch.out_cache_loc, k3,
                     v.view(num_tokens, layer.num_kv_heads, layer.v_head_dim),
                     k_scale=layer.k_scale, v_scale=layer.v_scale)
        return attend_layer(self, paged_attention_5d_request, q, k_cache, v_cache, layer, batch,
                            metadata, sinks)


#: The VEC5D family's cells.
CELLS = (
    Cell(name="vec5d.decode", modes={ForwardMode.DECODE, ForwardMode.IDLE},
         metadata=DecodeMetadata, cg_support=CGSupport.ALWAYS,
         description="one token per request over the 5-D pool (pa_decode_gluon's layout)"),
    Cell(name="vec5d.extend", modes={ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND},
         metadata=ExtendMetadata, cg_support=CGSupport.NEVER,
         description="ragged extend/draft-extend over the 5-D pool"),
    Cell(name="vec5d.verify.chain", modes={ForwardMode.TARGET_VERIFY},
         contracts={ForwardMode.TARGET_VERIFY: CHAIN_VERIFY},
         metadata=VerifyChainMetadata, cg_support=CGSupport.UNIFORM_BATCH,
         supports=chain_verify_only, description="EAGLE chain over the 5-D pool: causal"),
    Cell(name="vec5d.verify.tree", modes={ForwardMode.TARGET_VERIFY},
         contracts={ForwardMode.TARGET_VERIFY: TREE_VERIFY},
         metadata=VerifyTreeMetadata, cg_support=CGSupport.UNIFORM_BATCH,
         supports=tree_verify_only, description="EAGLE tree over the 5-D pool: custom mask"),
    Cell(name="vec5d.draft_extend_v2", modes={ForwardMode.DRAFT_EXTEND_V2},
         metadata=DraftExtendV2Metadata, cg_support=CGSupport.UNIFORM_BATCH,
         description="fixed draft tokens per request over the 5-D pool"),
    # Forced by MultiStepDraftBackend ("<arch>.draft_decode_step"), never auto-selected.
    Cell(name="vec5d.draft_decode_step", modes={ForwardMode.DECODE},
         metadata=DraftDecodeStepMetadata, cg_support=CGSupport.ALWAYS, priority=-10,
         description="one multi-step draft-decode step over the 5-D pool"),
)


@hookimpl
def aiter_attn_register_strategies(register):
    register_cells(register, arch=AttnArch.VEC5D, execution=Vec5DExecution, cells=CELLS,
                   kernel_op="paged_attention_5d")


@hookimpl
def aiter_attn_register_kernels(register):
    """The ``paged_attention_5d`` reference: any device and dtype, every feature, priority 0.

    (``write_kv_5d``'s reference and Triton kernel are registered by
    :mod:`aiter_attn.kernels.reference_extra` and :mod:`aiter_attn.kernels.triton`.)
    """
    everything = Capabilities(
        features={"sinks", "softcap", "window", "fp8", "custom_mask", "v_head_dim_differs",
                  "non_causal", "lse", "batch_invariant"},
        cg_support=CGSupport.NEVER,
    )
    register("paged_attention_5d", "reference", paged_attention_5d_reference, everything,
             priority=0)
