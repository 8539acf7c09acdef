"""The Triton paged-attention kernel as a plan/run object (ops ``paged_attention`` and
``paged_attention_5d``; the kernel itself is in :mod:`.paged_attention`).

``plan(md, out=None)`` (once per step and layer group) chooses the launch configuration from
host integers (shapes, ``max_seqlen_q``/``max_seqlen_k``, the device's SMs), computes the
grid, takes the split partials' workspace (allocated eagerly, or a view of a static buffer
under CUDA graphs) and keeps the index tensors; ``run(q, (k_cache, v_cache), plan, params,
out)`` (once per layer) checks one shape and launches with the precomputed arguments. No host
synchronisation anywhere; ``run`` allocates nothing.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch
import triton.language as tl

from ...types import FP8_DTYPES
from ...validation import unit_stride
from ..base import MEMO, AttentionKernel, KernelPlan, mask_literal, plan_hints
from ._kvutil import next_pow2
from ._launch_config import _cdiv, choose_config
from .paged_attention import (_TL_DTYPES, _UNBOUNDED, _paged_attn_kernel,
                              _reduce_splits_kernel)

__all__ = ["TritonPagedAttention", "TritonPagedAttention5D", "TritonPlan", "invariant_request"]


def invariant_request(request, batch_invariant: bool):
    """``request`` with the ``batch_invariant`` feature when asked (the bound kernel then
    plans batch-invariant launches: see :mod:`._launch_config`)."""
    if not batch_invariant:
        return request
    return attrs.evolve(request, features=request.features | {"batch_invariant"})

_T = dict(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class TritonPlan(KernelPlan):
    """One step's launch of the Triton kernel for one layer group.

    Attributes:
        grid: the attention kernel's grid.
        args: ``(cu_seqlens_q, seqused_k, block_table)`` tensors.
        mask: ``(mask_uint8, mask_indptr)`` or ``None``.
        ints: ``(batch, q_blocks_per_seq, num_splits, split_tiles)``.
        bt_stride: block_table's row stride.
        split: the split path runs (partials + reduction): more than one split, or
            batch-invariant mode (always).
        fixed_order: batch-invariant: fixed-size splits, reduction in index order.
        counters: fused reduction (``LaunchConfig.fused_reduce``): int32 per-tile counters of
            finished splits (zero between launches); ``None``: the reduction is a second
            launch.
        part_acc / part_ml: split partials (``None`` without the split path).
        part_strides: their strides (zeros without splits).
        cfg_kw: the launch configuration's constexprs (tile shapes, warps, stages).
        kw_cache: per-layer-flag constexpr dicts, built on first use.
    """

    grid: tuple
    args: tuple = attrs.field(**_T)
    mask: Optional[tuple] = attrs.field(default=None, **_T)
    ints: tuple
    bt_stride: int
    part_acc: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    part_ml: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    part_strides: tuple = (0, 0, 0, 0)
    num_splits: int = 1
    split: bool = False
    fixed_order: bool = False
    counters: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    dv_pad: int = 16
    cfg_kw: dict = attrs.field(factory=dict, **_T)
    kw_cache: dict = attrs.field(factory=dict, metadata=MEMO, **_T)


class TritonPagedAttention(AttentionKernel):
    """``paged_attention`` (NHD pages ``[pages, page_size, Hkv, D]``) as plan/run."""

    op = "paged_attention"

    def __init__(self, request=None):
        super().__init__(request)
        self._layouts: dict = {}
        if request is not None:
            self._bind(request)

    def _bind(self, request):
        extra = dict(request.extra)
        self.q_heads = extra.get("q_heads")
        self.kv_heads = extra.get("kv_heads")
        self.head_dim = request.head_dim
        self.v_head_dim = request.v_head_dim or request.head_dim
        self.dtype = request.dtype
        self.kv_dtype = request.kv_dtype
        self.group = self.q_heads // self.kv_heads
        self.d_pad = max(16, next_pow2(self.head_dim))
        self.dv_pad = max(16, next_pow2(self.v_head_dim))
        self.fp8 = self.kv_dtype in FP8_DTYPES
        self.fp32 = self.dtype == torch.float32 or self.kv_dtype == torch.float32
        compute = _TL_DTYPES[self.dtype]
        self.clamp_q = self.fp8 and self.dtype == torch.bfloat16
        if self.clamp_q:
            compute = tl.float16  # see CLAMP_Q in the kernel
        self.compute = compute
        self.dot_precision = "ieee" if self.dtype == torch.float32 else "tf32"
        self.batch_invariant = "batch_invariant" in request.features
        self._ws_name = (f"triton.{self.op}.partials.{self.q_heads}h{self.dv_pad}"
                         + (".bi" if self.batch_invariant else ""))

    @classmethod
    def request_for(cls, q, k_cache, v_cache):
        from ...ops import paged_attention_request

        return paged_attention_request(q, k_cache, v_cache)

    def __call__(self, q, k_cache, v_cache, out, **kwargs):
        if self.request is None:  # the functional convenience: bind to these tensors
            return type(self)(self.request_for(q, k_cache, v_cache))(q, k_cache, v_cache, out,
                                                                     **kwargs)
        return super().__call__(q, k_cache, v_cache, out, **kwargs)

    # -- launch configuration ------------------------------------------------------------
    def _config(self, max_q, max_k, batch, device):
        return choose_config(group=self.group, max_q=max_q, max_k=max(max_k, 1),
                             head_dim_pad=max(self.d_pad, self.dv_pad), batch=batch,
                             num_kv_heads=self.kv_heads, device=device, fp32=self.fp32,
                             fp8_kv=self.fp8, batch_invariant=self.batch_invariant)

    def _workspace_rows(self, max_bs, q_len, max_k, device) -> int:
        """Split-partial rows (``splits · tokens``) any batch of up to ``max_bs`` requests of
        ``q_len`` queries needs: the static workspace under CUDA graphs."""
        rows = 0
        for bs in range(1, max_bs + 1):
            cfg = self._config(q_len, max_k, bs, device)
            splits = cfg.num_splits
            if splits > 1 or cfg.batch_invariant:
                rows = max(rows, splits * bs * q_len)
        return rows

    def buffer_spec(self, limits):
        """The split partials' static workspace for ``limits`` (a
        :class:`~aiter_attn.graph.buffers.GraphLimits`)."""
        from ...strategies.base import BufferSpec

        if self.request is None or limits.q_len > 64:
            return BufferSpec({})
        device = torch.device(self.request.device)
        rows = self._workspace_rows(limits.max_bs, limits.q_len, limits.max_seq_len, device)
        if not rows:
            return BufferSpec({})
        return BufferSpec({
            self._ws_name + ".acc": ((rows, self.q_heads, self.dv_pad), torch.float32),
            self._ws_name + ".ml": ((rows, self.q_heads, 2), torch.float32),
        })

    def _partials(self, splits, num_tokens, md, out, device):
        rows = splits * num_tokens
        if out is None:
            acc = torch.empty(splits, num_tokens, self.q_heads, self.dv_pad, dtype=torch.float32,
                              device=device)
            ml = torch.empty(splits, num_tokens, self.q_heads, 2, dtype=torch.float32,
                             device=device)
            return acc, ml
        acc = out.get(self._ws_name + ".acc")
        if acc is None:
            cu = out.get("cu_seqlens_q")
            max_bs = cu.shape[0] - 1 if cu is not None else md.batch_size
            cap = self._workspace_rows(max(max_bs, 1), md.query.max_seqlen_q,
                                       md.pages.max_seqlen_k, device)
            acc = out.setdefault(self._ws_name + ".acc", torch.empty(
                max(cap, rows), self.q_heads, self.dv_pad, dtype=torch.float32, device=device))
            out.setdefault(self._ws_name + ".ml", torch.empty(
                max(cap, rows), self.q_heads, 2, dtype=torch.float32, device=device))
        ml = out[self._ws_name + ".ml"]
        if acc.shape[0] < rows:
            raise RuntimeError(
                f"{self.name}: the static split workspace holds {acc.shape[0]} rows but this "
                f"plan needs {rows}; build CudaGraphManager after binding the layers "
                "(AttentionBackend.bind_layers) so the kernel's buffer_spec sizes it.")
        return (acc[:rows].view(splits, num_tokens, self.q_heads, self.dv_pad),
                ml[:rows].view(splits, num_tokens, self.q_heads, 2))

    # -- plan / run ----------------------------------------------------------------------
    def plan(self, md, out: Optional[dict] = None) -> TritonPlan:
        """The launch of one step (host integers only: no sync)."""
        query, pages = md.query, md.pages
        # index inputs are read with unit stride along their last axis: materialise strided
        # views (the graph manager's static buffers never are; eager plans may copy)
        cu, seqused_k, block_table = map(
            unit_stride, (query.cu_seqlens_q, pages.seqused_k, pages.block_table))
        num_tokens = query.num_tokens
        batch = cu.shape[0] - 1
        hint_q, hint_k = plan_hints(md)
        max_q = int(hint_q) if hint_q is not None else num_tokens
        max_q = max(1, min(max_q, num_tokens)) if num_tokens else 1
        max_k = int(hint_k) if hint_k is not None else block_table.shape[1] * pages.page_size
        device = cu.device
        cfg = self._config(max_q, max_k, max(batch, 1), device)
        num_hchunks = _cdiv(self.group, cfg.heads)
        q_blocks_per_seq = _cdiv(max_q, cfg.block_q)
        search_grid = _cdiv(num_tokens, cfg.block_q) + batch
        search = hint_q is None or batch * q_blocks_per_seq > search_grid
        grid_q = search_grid if search else batch * q_blocks_per_seq
        splits = cfg.num_splits
        split = splits > 1 or cfg.batch_invariant
        if split and num_tokens and batch:
            part_acc, part_ml = self._partials(splits, num_tokens, md, out, device)
            part_strides = (part_acc.stride(0), part_acc.stride(1), part_ml.stride(0),
                            part_ml.stride(1))
        else:
            part_acc = part_ml = None
            part_strides = (0, 0, 0, 0)
        # the fused reduction (one launch) needs zeroed counters: eager plans allocate them;
        # graph plans keep the two launches for now (a static counter buffer is the next step)
        fused = bool(cfg.fused_reduce and split and not cfg.batch_invariant and out is None
                     and part_acc is not None)
        grid_h = self.kv_heads * num_hchunks
        counters = (torch.zeros(grid_q * grid_h, dtype=torch.int32, device=device)
                    if fused else None)
        page_size = pages.page_size
        tile_in_page = page_size % cfg.block_n == 0
        page_chunk = cfg.page_chunk if tile_in_page or cfg.block_n % page_size == 0 else 0
        mask = md.mask
        mask_t = None
        if mask is not None:
            m = mask.custom_mask
            m = unit_stride(m)
            mask_t = (m.view(torch.uint8) if m.dtype == torch.bool else m,
                      unit_stride(mask.mask_indptr))
        cfg_kw = dict(
            GROUP=self.group, HEADS=cfg.heads, NUM_HCHUNKS=num_hchunks,
            BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            D=self.head_dim, D_PAD=self.d_pad, DV=self.v_head_dim, DV_PAD=self.dv_pad,
            PAGE_SIZE=page_size, TILE_IN_PAGE=tile_in_page, HAS_CUSTOM_MASK=mask is not None,
            SEARCH_SEQ=search, SPLIT=split, FIXED_SPLITS=cfg.batch_invariant,
            FUSED_REDUCE=fused,
            COMPUTE_DTYPE=self.compute,
            CLAMP_Q=self.clamp_q, DOT_PRECISION=self.dot_precision,
            NUM_STAGES=cfg.num_stages, WARP_SPEC=cfg.warp_spec, PAGE_CHUNK=page_chunk,
            num_warps=cfg.num_warps)
        return TritonPlan(
            num_tokens=num_tokens if batch else 0, mask_literal=mask_literal(md),
            grid=(grid_q, self.kv_heads * num_hchunks, splits),
            args=(cu, seqused_k, block_table), mask=mask_t,
            ints=(batch, q_blocks_per_seq, splits, cfg.split_tiles),
            bt_stride=block_table.stride(0),
            part_acc=part_acc, part_ml=part_ml, part_strides=part_strides, num_splits=splits,
            split=split, fixed_order=cfg.batch_invariant, counters=counters,
            dv_pad=self.dv_pad, cfg_kw=cfg_kw)

    def _layout(self, k_cache, v_cache):
        """``(k_strides, v_strides, KX, VX)`` of the caches in the kernel's addressing."""
        ks, vs = k_cache.stride(), v_cache.stride()
        if ks[3] != 1 or vs[3] != 1:
            raise ValueError(
                f"{self.name}: the last (head-dim) axis of k_cache and v_cache must be "
                "contiguous; pass .contiguous() tensors.")
        return (ks[0], ks[1], ks[2], 1), (vs[0], vs[1], vs[2], 1), 1, 1

    @staticmethod
    def _kw(plan: TritonPlan, key):
        causal, softcap, sinks, scales, (kx, vx), write_lse, token_scales = key
        kw = dict(plan.cfg_kw)
        kw.update(CAUSAL=causal and not plan.mask_literal, HAS_SOFTCAP=softcap, HAS_SINKS=sinks,
                  HAS_SCALES=scales, KX=kx, VX=vx, WRITE_LSE=write_lse,
                  TOKEN_SCALES=token_scales)
        plan.kw_cache[key] = kw
        return kw

    def _launch_args(self, q, cache, plan: TritonPlan, params, out, lse):
        """``(args, kw)`` of the attention kernel's launch (O(1) checks, no allocation)."""
        k_cache, v_cache = cache
        key = (k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride())
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self._layout(k_cache, v_cache)
        k_strides, v_strides, kx, vx = layout
        write_lse = lse is not None
        ksc = params.k_scale_cache
        token_scales = ksc is not None
        if token_scales and (kx, vx) != (1, 1):
            raise ValueError(f"{self.name}: per-(token, head) scales are served on NHD pages "
                             "only (op paged_attention), not the 5-D layout.")
        key = (params.causal, params.softcap > 0, params.sinks is not None, params.has_scales,
               (kx, vx), write_lse, token_scales)
        kw = plan.kw_cache.get(key)
        if kw is None:
            kw = self._kw(plan, key)
        qs, os_ = q.stride(), out.stride()
        if qs[2] != 1 or os_[2] != 1:
            raise ValueError(
                f"{self.name}: the last (head-dim) axis of q and out must be contiguous; pass "
                ".contiguous() tensors.")
        cu = plan.args[0]
        sinks = params.sinks if params.sinks is not None else cu
        ks_t = params.k_scale_t if params.has_scales else cu
        vs_t = params.v_scale_t if params.has_scales else cu
        if token_scales:
            ksc_t, vsc_t, sstr = ksc, params.v_scale_cache, ksc.stride()
        else:
            ksc_t, vsc_t, sstr = cu, cu, (0, 0, 0)
        mask_t, mask_ip = plan.mask if plan.mask is not None else (cu, cu)
        w = params.window
        left = w[0] if w[0] >= 0 else _UNBOUNDED
        right = w[1] if w[1] >= 0 else _UNBOUNDED
        split = plan.split
        part_acc = plan.part_acc if split else out
        part_ml = plan.part_ml if split else out
        if write_lse:
            lse_t, ls = lse, lse.stride()
        else:
            lse_t, ls = out, (0, 0)
        counters = plan.counters if plan.counters is not None else cu
        args = (q, k_cache, v_cache, out, part_acc, part_ml, lse_t, counters, *plan.args, sinks,
                ks_t, vs_t, ksc_t, vsc_t, mask_t, mask_ip, params.scale, params.softcap, left,
                right, *plan.ints, qs[0], qs[1], *k_strides, *v_strides, *sstr, os_[0], os_[1],
                plan.bt_stride, *plan.part_strides, ls[0], ls[1])
        return args, kw

    def _reduce(self, plan: TritonPlan, params, out, args, kw, lse):
        os_ = out.stride()
        ls = lse.stride() if lse is not None else (0, 0)
        _reduce_splits_kernel[(plan.num_tokens, out.shape[1])](
            out, plan.part_acc, plan.part_ml,
            params.sinks if params.sinks is not None else plan.part_ml, args[6],
            plan.num_splits, os_[0], os_[1], *plan.part_strides, ls[0], ls[1],
            DV=kw["DV"], DV_PAD=plan.dv_pad, SPLITS_PAD=next_pow2(plan.num_splits),
            HAS_SINKS=params.sinks is not None, WRITE_LSE=lse is not None,
            FIXED_ORDER=plan.fixed_order, num_warps=4)

    def run(self, q, cache, plan: TritonPlan, params, out, lse=None):
        """Launch (and the split reduction). O(1) checks; allocates nothing."""
        if q.shape[0] != plan.num_tokens:
            if plan.num_tokens == 0:
                return out
            raise ValueError(f"{self.name}: q has {q.shape[0]} tokens but the plan was made for "
                             f"{plan.num_tokens}; plan this step's metadata first.")
        if plan.num_tokens == 0:
            return out
        args, kw = self._launch_args(q, cache, plan, params, out, lse)
        _paged_attn_kernel[plan.grid](*args, **kw)
        if plan.split and plan.counters is None:
            self._reduce(plan, params, out, args, kw, lse)
        return out

    def bare_launch(self, q, cache, plan: TritonPlan, params, out):
        """A zero-argument callable that launches this plan's kernel(s) with every argument
        prebuilt: the launch floor the host benchmark compares :meth:`run` with."""
        args, kw = self._launch_args(q, cache, plan, params, out, None)
        grid = plan.grid
        launcher = _paged_attn_kernel[grid]
        if plan.split and plan.counters is None:
            def launch():
                launcher(*args, **kw)
                self._reduce(plan, params, out, args, kw, None)
            return launch
        return lambda: launcher(*args, **kw)


class TritonPagedAttention5D(TritonPagedAttention):
    """``paged_attention_5d`` (the vectorised 5-D layout) with the same kernel: only the
    cache addressing differs. k_cache ``[pages, Hkv, D // x, page_size, x]``; v_cache shuffled
    ``[pages, Hkv, page_size // x, Dv, x]`` or hd_page ``[pages, Hkv, Dv, page_size]``."""

    op = "paged_attention_5d"

    @classmethod
    def request_for(cls, q, k_cache, v_cache):
        from ...strategies.vec5d import paged_attention_5d_request

        return paged_attention_5d_request(q, k_cache, v_cache)

    def _layout(self, k_cache, v_cache):
        ks, vs = k_cache.stride(), v_cache.stride()
        if ks[4] != 1 or vs[-1] != 1:
            raise ValueError(
                f"{self.name}: the innermost axis of k_cache and v_cache must be contiguous; "
                "pass .contiguous() tensors.")
        kx = k_cache.shape[4]
        if v_cache.dim() == 5:  # shuffled: token o at (o // x) * vs[2] + o % x, dim d at d * vs[3]
            return ((ks[0], ks[3], ks[1], ks[2]), (vs[0], vs[2], vs[1], vs[3]), kx,
                    v_cache.shape[4])
        # hd_page: token o at o, dim d at d * vs[2]
        return (ks[0], ks[3], ks[1], ks[2]), (vs[0], vs[3], vs[1], vs[2]), kx, 1
