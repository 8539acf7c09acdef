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
from ..base import MEMO, AttentionKernel, KernelPlan, mask_literal, plan_hints, token_count_error
from ._kvutil import next_pow2
from ._launch import Launcher, intern_spec, tensor_key
from ._launch_config import (CARRIED_PAGE_LOOKUP, FP8_VALUE_PAIRS, PREFETCH_PAGES,
                             TUNING_OVERRIDES, _cdiv, choose_config)
from ._pdl import pdl_kwargs
from ._kvutil import num_sms
from .decode_gluon import (DEFAULT_CONFIG, _box_rows, cache_descriptors, choose_splits,
                           gluon_decode_layout_reason, gluon_decode_reject_reason, plan_part,
                           run_planned)
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
        ints: ``(batch, q_blocks_per_seq, num_splits, split_tiles, bt_width)``: ``split_tiles``
            the batch-invariant split size, or (``PREFETCH_PAGES``) the tiles per split of a
            request as long as ``max_seqlen_k``; ``bt_width`` the block table's columns.
        bt_stride: block_table's row stride.
        split: the split path runs (partials + reduction): more than one split, or
            batch-invariant mode (always).
        fixed_order: batch-invariant: fixed-size splits, reduction in index order.
        counters: fused reduction (``LaunchConfig.fused_reduce``): int32 per-tile counters of
            finished splits (zero between launches); ``None``: the reduction is a second
            launch.
        part_acc / part_ml: split partials (``None`` without the split path).
        part_strides: their strides (zeros without splits).
        gluon: the Gluon decode kernel's launch (:mod:`.decode_gluon`) where it serves the
            step: ``(splits, part_acc, part_ml)`` (partials ``None`` without splits);
            layers it cannot serve (sinks, soft-cap, a left window, scales, a cache layout
            TMA cannot read) run the Triton launch of the same plan.
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
    gluon: Optional[tuple] = attrs.field(default=None, **_T)
    cfg_kw: dict = attrs.field(factory=dict, **_T)
    kw_cache: dict = attrs.field(factory=dict, metadata=MEMO, **_T)


class TritonPagedAttention(AttentionKernel):
    """``paged_attention`` (NHD pages ``[pages, page_size, Hkv, D]``) as plan/run."""

    op = "paged_attention"

    def __init__(self, request=None):
        super().__init__(request)
        self._layouts: dict = {}
        self._pmemo: dict = {}  # id(LayerParams) -> the layer's launch part
        self._gluon_why: dict = {}  # device -> why the Gluon decode kernel cannot serve
        self._gdescs: dict = {}  # cache tensors -> their TMA descriptors (or None)
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
            gsplits = self._gluon_splits(q_len, max_k, bs, device, None)
            if gsplits is not None and gsplits > 1:
                rows = max(rows, gsplits * bs * q_len)
        return rows

    def _gluon_splits(self, max_q, max_k, batch, device, mask) -> Optional[int]:
        """The Gluon decode kernel's split count for a step (``None``: the step is not one
        it serves: more than one query per request, a custom mask, batch-invariant mode,
        the 5-D layout, or what :func:`.decode_gluon.gluon_decode_reject_reason` refuses;
        ``TUNING_OVERRIDES["gluon_decode"] = False`` turns it off, ``"gluon_splits"``
        fixes the count)."""
        if (max_q != 1 or mask is not None or self.batch_invariant or not self.nhd_pages
                or not TUNING_OVERRIDES.get("gluon_decode", True)):
            return None
        why = self._gluon_why.get(device, 0)
        if why == 0:
            why = self._gluon_why[device] = self._gluon_reason(device)
        if why is not None:
            return None
        forced = TUNING_OVERRIDES.get("gluon_splits")
        if forced:
            return int(forced)
        return choose_splits(batch * self.kv_heads, max(max_k, 1), num_sms(device),
                             DEFAULT_CONFIG.block_n)

    def _gluon_reason(self, device) -> Optional[str]:
        """Why the Gluon decode kernel cannot serve this kernel's layers on ``device`` at
        all (the page size is checked per cache layout at run time)."""
        return gluon_decode_reject_reason(
            q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
            v_head_dim=self.v_head_dim, dtype=self.dtype, kv_dtype=self.kv_dtype,
            page_size=DEFAULT_CONFIG.block_n, device=torch.device(device))

    def buffer_spec(self, limits):
        """The split partials' static workspace for ``limits`` (a
        :class:`~aiter_attn.graph.buffers.GraphLimits`)."""
        from ...strategies.base import BufferSpec

        if self.request is None or limits.q_len > 64:
            return BufferSpec({})
        device = torch.device(self.request.device)
        # a captured step's key bound: its static table's width in keys (whole pages)
        page = self.request.page_size or 1
        rows = self._workspace_rows(limits.max_bs, limits.q_len,
                                    limits.table_pages(page) * page, device)
        if not rows:
            return BufferSpec({})
        return BufferSpec({
            self._ws_name + ".acc": ((rows, self.q_heads, self.dv_pad), torch.float32),
            self._ws_name + ".ml": ((rows, self.q_heads, 2), torch.float32),
            # zero-filled by allocate(); the fused reduction leaves them zero after each launch
            self._ws_name + ".cnt": ((self._counter_tiles(limits.max_bs, limits.q_len),),
                                     torch.int32),
        })

    def _counter_tiles(self, max_bs, q_len) -> int:
        """Fused-reduction counters any batch of up to ``max_bs`` requests of ``q_len``
        queries needs: one per (q-block, head chunk) tile, the q-blocks bounded by tokens +
        requests (the searched grid) and the head chunks by the query heads."""
        return max_bs * (q_len + 1) * self.q_heads

    def _static(self, out, suffix, need, md, capacity, make):
        """The workspace buffer ``<ws><suffix>`` of the graph's static ``out``, whose leading
        axis holds at least ``need``: made on first use (``make(n)``, ``n`` = the larger of
        ``need`` and ``capacity(max_bs)`` for the graph's largest batch) when the graph
        manager was built before the layers were bound."""
        name = self._ws_name + suffix
        buf = out.get(name)
        if buf is None:
            cu = out.get("cu_seqlens_q")
            max_bs = max(cu.shape[0] - 1 if cu is not None else md.batch_size, 1)
            buf = out.setdefault(name, make(max(capacity(max_bs), need)))
        if buf.shape[0] < need:
            raise RuntimeError(
                f"{self.name}: the static buffer {name} holds {buf.shape[0]} rows but this "
                f"plan needs {need}; build CudaGraphManager after binding the layers "
                "(AttentionBackend.bind_layers) so the kernel's buffer_spec sizes it.")
        return buf

    def _counters(self, tiles, md, out, device):
        """Zeroed int32 fused-reduction counters, ``tiles`` of them (graph plans: the
        static workspace's, left at zero by every launch)."""
        def make(n):
            return torch.zeros(n, dtype=torch.int32, device=device)

        if out is None:
            return make(tiles)
        return self._static(out, ".cnt", tiles, md,
                            lambda bs: self._counter_tiles(bs, md.query.max_seqlen_q), make)

    def _partials(self, splits, num_tokens, md, out, device):
        rows = splits * num_tokens
        if out is None:
            acc = torch.empty(splits, num_tokens, self.q_heads, self.dv_pad, dtype=torch.float32,
                              device=device)
            ml = torch.empty(splits, num_tokens, self.q_heads, 2, dtype=torch.float32,
                             device=device)
            return acc, ml

        def capacity(bs):
            return self._workspace_rows(bs, md.query.max_seqlen_q, md.pages.max_seqlen_k,
                                        device)

        acc = self._static(out, ".acc", rows, md, capacity, lambda n: torch.empty(
            n, self.q_heads, self.dv_pad, dtype=torch.float32, device=device))
        ml = self._static(out, ".ml", rows, md, capacity, lambda n: torch.empty(
            n, self.q_heads, 2, dtype=torch.float32, device=device))
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
        # the fused reduction (one launch) needs zeroed counters, one per (q-block, head
        # chunk) tile; its last split puts each back to 0, so a static buffer serves every
        # replay and layer (graph plans: the workspace's, eager plans: their own)
        fused = bool(cfg.fused_reduce and split and not cfg.batch_invariant
                     and part_acc is not None)
        grid_h = self.kv_heads * num_hchunks
        counters = self._counters(grid_q * grid_h, md, out, device) if fused else None
        page_size = pages.page_size
        tile_in_page = page_size % cfg.block_n == 0
        page_chunk = cfg.page_chunk_for(page_size)
        mask = md.mask
        # split decode whose splits fit one chunk of the chunked lookup (1x4k: 16 splits of
        # two tiles): each program reads its page ids in its first round trip, guessing the
        # request is max_seqlen_k long (checked on the device; a wrong guess costs the usual
        # load). Longer splits would carry the guess's registers through the whole loop
        # (sm_90, fp8 8x64k: 8 more bytes spilled) for one round trip in many tiles.
        split_tiles = cfg.split_tiles
        guess = _cdiv(_cdiv(max_k, cfg.block_n), splits)
        prefetch = bool(split and not cfg.batch_invariant and not search and page_chunk
                        and guess <= page_chunk and mask is None
                        and TUNING_OVERRIDES.get("prefetch_pages", PREFETCH_PAGES))
        if prefetch:
            split_tiles = guess
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
            SPLITS_PAD=next_pow2(splits) if fused else 1,
            SPLIT_CHUNK=_split_chunk(splits, cfg.block_m, self.dv_pad) if fused else 1,
            COMPUTE_DTYPE=self.compute,
            CLAMP_Q=self.clamp_q, DOT_PRECISION=self.dot_precision,
            # fp8 values as 16-bit column pairs where the cache layout allows (_launch_kw),
            # on tiles of fewer than 64 rows: their dots are mma.sync, which reads a
            # transposed 8-bit operand byte by byte (64-row tiles use wgmma, which reads
            # shared memory itself: sm_90 builds, scripts/inspect_sm90.py)
            V_PAIRS=bool(self.fp8 and self.v_head_dim == self.dv_pad and cfg.block_m < 64
                         and TUNING_OVERRIDES.get("v_pairs", FP8_VALUE_PAIRS)),
            NUM_STAGES=cfg.num_stages, WARP_SPEC=cfg.warp_spec, PAGE_CHUNK=page_chunk,
            PREFETCH_PAGES=prefetch,
            # the per-tile lookup with page ids carried a tile ahead (one-wave decode, or
            # an option)
            PAGE_AHEAD=bool(not page_chunk
                            and TUNING_OVERRIDES.get("page_ahead",
                                                     cfg.page_ahead or CARRIED_PAGE_LOOKUP)),
            # slot-index addressing where the cache layout allows it (_kw)
            FLAT_SLOTS=cfg.flat_slots,
            num_warps=cfg.num_warps, **pdl_kwargs(cfg.pdl, reduction=False))
        gluon = None
        gsplits = (self._gluon_splits(max_q, max_k, max(batch, 1), device, mask)
                   if _box_rows(page_size, DEFAULT_CONFIG.block_n) >= 16 else None)
        if gsplits is not None and num_tokens == batch and batch:
            gparts = (self._partials(gsplits, num_tokens, md, out, device) if gsplits > 1
                      else (None, None))
            gluon = (gsplits, *gparts)
        return TritonPlan(
            num_tokens=num_tokens if batch else 0, mask_literal=mask_literal(md), gluon=gluon,
            grid=(grid_q, self.kv_heads * num_hchunks, splits),
            args=(cu, seqused_k, block_table), mask=mask_t,
            ints=(batch, q_blocks_per_seq, splits, split_tiles, block_table.shape[1]),
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
        causal, softcap, sinks, scales, (kx, vx, pairs, flat), write_lse, token_scales = key
        kw = dict(plan.cfg_kw)
        kw.update(CAUSAL=causal and not plan.mask_literal, HAS_SOFTCAP=softcap, HAS_SINKS=sinks,
                  HAS_SCALES=scales, KX=kx, VX=vx, WRITE_LSE=write_lse,
                  TOKEN_SCALES=token_scales, V_PAIRS=kw["V_PAIRS"] and pairs,
                  FLAT_SLOTS=kw["FLAT_SLOTS"] and flat)
        plan.kw_cache[key] = kw
        return kw

    #: caches are NHD pages ``[pages, page_size, Hkv, D]`` (slot addressing may apply)
    nhd_pages = True

    #: ``ops.paged_attention`` may memoise a functional call's plan and params (see
    #: :meth:`plan_reusable`): the functional call is exactly plan + run
    memo_plans = True

    def plan_reusable(self, plan: TritonPlan) -> bool:
        """Whether ``plan`` (made for a functional call) can serve a later call with the same
        index tensors and hints: it holds no workspace of its own (the split partials and
        counters are one call's scratch: a later call on another stream could overwrite
        them while this one reads) and the launch tuning it was made under is still the
        current one (``TUNING_OVERRIDES``). Otherwise ``ops`` plans again."""
        if (plan.part_acc is not None or plan.counters is not None
                or (plan.gluon is not None and plan.gluon[1] is not None)):
            return False
        made = plan.kw_cache.get(_OVERRIDES)
        if made is None:
            made = plan.kw_cache[_OVERRIDES] = dict(TUNING_OVERRIDES)
        return made == TUNING_OVERRIDES

    # -- the per-layer launch ------------------------------------------------------------
    # A layer call combines three groups of launch arguments, each prepared once where it
    # stops changing: the plan's (index tensors, workspace, ints: once per step, memoised in
    # ``plan.kw_cache``), the layer's (:class:`LayerParams`: once per layer, ``_pmemo``) and
    # the cache layout's (strides: once per cache shape, ``self._layouts``). Each group has an
    # interned id of everything Triton specialises on (:func:`._launch.intern_spec`), so the
    # call's key for the direct launch (:mod:`._launch`) is those ids plus the per-call
    # tensors' dtype, alignment and strides. A new kernel argument goes into the part where it stops
    # changing AND into that part's spec (tensors by ``tensor_key``, ints by value), or into
    # the call key if it changes per call: a key that misses an argument Triton specialises
    # on would launch a kernel compiled for other values (tests/test_direct_launch.py).

    def _plan_launch(self, plan: TritonPlan) -> tuple:
        """The plan's part of the launch (memoised on the plan): ``(sid, p1, p2, ints, p4,
        parts, mid, tail, bt_width)`` with ``p1`` = (counters, cu, seqused_k, block_table),
        ``p2`` = the mask pair, ``ints`` = the plan's first four ints, ``p4`` = (bt_stride,
        *part_strides), ``parts`` = the split partials or ``None``; ``mid``/``tail``: the
        argument runs of a layer without scales / lse (``tail`` ends with ``bt_width``, the
        kernel's last argument)."""
        cu = plan.args[0]
        counters = plan.counters if plan.counters is not None else cu
        mask_t, mask_ip = plan.mask if plan.mask is not None else (cu, cu)
        parts = (plan.part_acc, plan.part_ml) if plan.split else None
        tensors = (counters, *plan.args, mask_t, mask_ip) + (parts or ())
        spec = ("plan", plan.ints, plan.bt_stride, plan.part_strides, plan.mask_literal,
                plan.split, plan.num_splits, plan.fixed_order, plan.dv_pad,
                tuple(plan.cfg_kw.items()), tuple(tensor_key(t) for t in tensors))
        p1, p2 = (counters, *plan.args), (mask_t, mask_ip)
        p4 = (plan.bt_stride, *plan.part_strides)
        pl = (intern_spec(spec), p1, p2, plan.ints[:4], p4, parts,
              (*p1, cu, cu, cu, cu, cu, *p2),  # [6]: p1, the scale stand-ins, p2
              (*p4, 0, 0, plan.ints[4]),  # [7]: p4, the strides of an absent lse, bt_width
              plan.ints[4])  # [8]: bt_width (the kernel's last argument)
        plan.kw_cache[_PLAN_LAUNCH] = pl
        plan.kw_cache.setdefault(_OVERRIDES, dict(TUNING_OVERRIDES))  # see plan_reusable
        return pl

    def _params_launch(self, params) -> tuple:
        """The layer's part: ``(params, sid, flags, scales, values, scale_strides)``
        (memoised per :class:`LayerParams` object in ``self._pmemo``: the kernel object
        lives with its backend, so the memo never outlives the layers' buffers). ``scales`` = (sinks,
        k_scale, v_scale, k_scale_cache, v_scale_cache) tensors with a present one standing
        in for absent ones, or ``None`` when the layer has none (the plan's
        ``cu_seqlens_q`` stands in then); ``values`` = (scale, softcap, left, right);
        ``scale_strides``: the per-(token, head) scale buffers' strides (zeros without)."""
        w = params.window
        left = w[0] if w[0] >= 0 else _UNBOUNDED
        right = w[1] if w[1] >= 0 else _UNBOUNDED
        ksc = params.k_scale_cache
        token_scales = ksc is not None
        given = (params.sinks, params.k_scale_t if params.has_scales else None,
                 params.v_scale_t if params.has_scales else None, ksc,
                 params.v_scale_cache if token_scales else None)
        present = [t for t in given if t is not None]
        scales = None
        if present:
            scales = tuple(present[0] if t is None else t for t in given)
        flags = (params.causal, params.softcap > 0, params.sinks is not None,
                 params.has_scales, token_scales)
        values = (float(params.scale), float(params.softcap), left, right)
        sstr = tuple(ksc.stride()) if token_scales else (0, 0, 0)
        sid = intern_spec(("params", flags, left, right, sstr,
                           None if scales is None else tuple(tensor_key(t) for t in scales)))
        memo = self._pmemo
        if len(memo) >= _PARAMS_KEEP:
            memo.clear()
        pe = memo[id(params)] = (params, sid, flags, scales, values, sstr)
        return pe

    def _layout_launch(self, k_cache, v_cache) -> tuple:
        """The cache layout's part: ``(sid, strides, kx, vx, pairs, flat)`` (strides: k's four
        then v's; ``pairs``: the layout lets an fp8 launch read values as 16-bit column pairs;
        ``flat``: slot-index addressing is exact for it)."""
        k_strides, v_strides, kx, vx = self._layout(k_cache, v_cache)
        strides = (*k_strides, *v_strides)
        # 8-bit values can be read as 16-bit column pairs (V_PAIRS): unit head-dim stride,
        # token / page / head strides of whole 16-byte vectors (the kernel tells the compiler
        # every row of pairs starts on one: tl.multiple_of)
        pairs = vx == 1 and v_strides[3] == 1 and all(s % 16 == 0 for s in v_strides[:3])
        # slot-index addressing (the kernel's FLAT_SLOTS): NHD pages whose page stride is
        # page_size token rows, every slot index page · page_size + in_page within int32
        page = k_cache.shape[1]
        flat = (self.nhd_pages and k_strides[0] == page * k_strides[1]
                and v_strides[0] == page * v_strides[1]
                and max(k_cache.shape[0], v_cache.shape[0]) * page < 2 ** 31)
        return (intern_spec(("layout", strides, kx, vx, flat)), strides, kx, vx, pairs, flat)

    def _launch_args(self, q, cache, plan: TritonPlan, params, out, lse):
        """``(args, key, pe, layout)`` of the attention kernel's launch: O(1) checks, no
        allocation. ``key`` identifies what Triton specialises the launch on (see
        :mod:`._launch`); ``pe``/``layout`` (the layer's and the layout's parts) give the
        constexprs (:meth:`_launch_kw`), needed only when the launch is not a direct one."""
        k_cache, v_cache = cache
        lk = (k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride())
        layout = self._layouts.get(lk)
        if layout is None:
            layout = self._layouts[lk] = self._layout_launch(k_cache, v_cache)
        pl = plan.kw_cache.get(_PLAN_LAUNCH)
        if pl is None:
            pl = self._plan_launch(plan)
        pe = self._pmemo.get(id(params))
        if pe is None or pe[0] is not params:
            pe = self._params_launch(params)
        qs, os_ = q.stride(), out.stride()
        if qs[2] != 1 or os_[2] != 1:
            raise ValueError(
                f"{self.name}: the last (head-dim) axis of q and out must be contiguous; pass "
                ".contiguous() tensors.")
        scales = pe[3]
        mid = pl[6] if scales is None else (*pl[1], *scales, *pl[2])
        parts = pl[5]
        pa, pm = parts if parts is not None else (out, out)
        if lse is not None:
            ls = lse.stride()
            lse_t, tail, lkey = lse, (*pl[4], ls[0], ls[1], pl[8]), (tensor_key(lse), ls)
            align = (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | out.data_ptr()
                     | lse.data_ptr()) & 15
        else:
            lse_t, tail, lkey = out, pl[7], None
            align = (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
                     | out.data_ptr()) & 15
        if align:  # some per-call tensor is not 16-byte aligned: say which
            align = tuple(t.data_ptr() % 16 == 0 for t in (q, k_cache, v_cache, out, lse_t))
        args = (q, k_cache, v_cache, out, pa, pm, lse_t, *mid, *pe[4], *pl[3], qs[0], qs[1],
                *layout[1], *pe[5], os_[0], os_[1], *tail)
        key = (pl[0], pe[1], layout[0], q.dtype, k_cache.dtype, v_cache.dtype, out.dtype, lkey,
               align, qs, os_)
        return args, key, pe, layout

    def _launch_kw(self, plan: TritonPlan, pe, layout, write_lse: bool, key) -> dict:
        """The attention launch's constexprs (memoised per layer flags on the plan). Every
        launch key's first launch comes here (the direct path reuses what it compiled), so
        the combination checks below guard the direct launches too."""
        causal, softcap, sinks, scales, token_scales = pe[2]
        kx, vx = layout[2], layout[3]
        if token_scales and (kx, vx) != (1, 1):
            raise ValueError(f"{self.name}: per-(token, head) scales are served on NHD pages "
                             "only (op paged_attention), not the 5-D layout.")
        align = key[8]  # 0: every per-call tensor 16-byte aligned, else one flag each
        pairs = layout[4] and (align == 0 or align[2])
        fkey = (causal, softcap, sinks, scales, (kx, vx, pairs, layout[5]), write_lse,
                token_scales)
        kw = plan.kw_cache.get(fkey)
        return kw if kw is not None else self._kw(plan, fkey)

    def _reduce(self, plan: TritonPlan, params, out, args, lse, key, jit=False):
        grid = (plan.num_tokens, out.shape[1], 1)
        rargs, rkey = self._reduce_args(plan, params, out, args, lse, key)
        if not jit and _REDUCE.launch_cached(grid, rargs, rkey):
            return
        rkw = dict(DV=self.v_head_dim, DV_PAD=plan.dv_pad, SPLITS_PAD=next_pow2(plan.num_splits),
                   HAS_SINKS=params.sinks is not None, WRITE_LSE=lse is not None,
                   FIXED_ORDER=plan.fixed_order, num_warps=4,
                   **pdl_kwargs(plan.cfg_kw["PDL"], reduction=True))
        if jit:
            _reduce_splits_kernel[grid](*rargs, **rkw)
        else:
            _REDUCE.launch(grid, rargs, rkw, rkey)

    @staticmethod
    def _reduce_args(plan: TritonPlan, params, out, args, lse, key):
        """``(args, key)`` of the split reduction: the attention key covers every argument
        here but the strides of out / lse."""
        os_ = out.stride()
        ls = lse.stride() if lse is not None else (0, 0)
        rargs = (out, plan.part_acc, plan.part_ml,
                 params.sinks if params.sinks is not None else plan.part_ml, args[6],
                 plan.num_splits, os_[0], os_[1], *plan.part_strides, ls[0], ls[1])
        return rargs, ("reduce", key, ls)

    def run(self, q, cache, plan: TritonPlan, params, out, lse=None):
        """Launch (and the split reduction). O(1) checks; allocates nothing."""
        n = q.shape[0]
        if n != plan.num_tokens:
            if plan.num_tokens == 0:
                return out
            raise token_count_error(self.name, n, plan)
        if n == 0:
            return out
        if plan.gluon is not None and self._run_gluon(q, cache, plan, params, out, lse):
            return out
        args, key, pe, layout = self._launch_args(q, cache, plan, params, out, lse)
        if not _ATTN.launch_cached(plan.grid, args, key):
            _ATTN.launch(plan.grid, args,
                         self._launch_kw(plan, pe, layout, lse is not None, key), key)
        if plan.split and plan.counters is None:
            self._reduce(plan, params, out, args, lse, key)
        return out

    def _run_gluon(self, q, cache, plan: TritonPlan, params, out, lse) -> bool:
        """Launch the Gluon decode kernel (and its split reduction) if it serves this layer:
        no sinks, soft-cap, left window or scales, a cache layout TMA can read (checked once
        per cache tensor pair). ``False``: the caller runs the Triton launch."""
        pe = self._pmemo.get(id(params))
        if pe is None or pe[0] is not params:
            pe = self._params_launch(params)
        flags, values = pe[2], pe[4]
        if flags[1] or flags[2] or flags[3] or flags[4] or values[2] != _UNBOUNDED:
            return False
        k_cache, v_cache = cache
        ck = (k_cache.data_ptr(), k_cache.shape, k_cache.stride(), v_cache.data_ptr(),
              v_cache.shape, v_cache.stride())
        descs = self._gdescs.get(ck, 0)
        if descs == 0:
            if len(self._gdescs) >= _PARAMS_KEEP:
                self._gdescs.clear()
            ok = (gluon_decode_layout_reason(q, k_cache, v_cache, out) is None
                  and _box_rows(k_cache.shape[1], DEFAULT_CONFIG.block_n) >= 16)
            descs = None
            if ok:
                k_d, v_d = cache_descriptors(k_cache, v_cache)
                # the descriptors' specialisation: dtype, block shape and layout of each
                dsid = intern_spec(("gluon-descs", k_cache.dtype, tuple(k_d.block_shape),
                                    repr(k_d.layout), k_cache.shape[1]))
                descs = (dsid, k_d, v_d, k_cache.shape[1])
            self._gdescs[ck] = descs
        if descs is None or q.stride(2) != 1 or out.stride(2) != 1:
            return False
        part = plan.kw_cache.get(_GLUON_LAUNCH)
        if part is None:
            splits, pa, pm = plan.gluon
            cu, seqused_k, block_table = plan.args
            gp = plan_part(splits, pa, pm, cu, seqused_k, block_table, plan.ints[0],
                           self.kv_heads)
            part = plan.kw_cache[_GLUON_LAUNCH] = (intern_spec(gp[0]), gp)
        run_planned(part[1], part[0], descs, q, out, values[0], lse)
        return True

    def bare_launch(self, q, cache, plan: TritonPlan, params, out, *, direct: bool = False):
        """A zero-argument callable that launches this plan's kernel(s) with every argument
        prebuilt: the launch floor the host benchmark compares :meth:`run` with. ``direct``:
        through the direct launch of :mod:`._launch` (as :meth:`run` launches where it
        applies); else Triton's own ``kernel[grid](*args, **kw)``."""
        args, key, pe, layout = self._launch_args(q, cache, plan, params, out, None)
        kw = self._launch_kw(plan, pe, layout, False, key)
        grid = plan.grid
        reduce = plan.split and plan.counters is None
        if direct:
            def launch():
                _ATTN.launch(grid, args, kw, key)
                if reduce:
                    self._reduce(plan, params, out, args, None, key)
            return launch
        launcher = _paged_attn_kernel[grid]
        if reduce:
            def launch():
                launcher(*args, **kw)
                self._reduce(plan, params, out, args, None, key, jit=True)
            return launch
        return lambda: launcher(*args, **kw)


#: memo keys of a plan's launch part / the tuning it was made under in ``TritonPlan.kw_cache``
_PLAN_LAUNCH = "launch"
_GLUON_LAUNCH = "gluon"
_OVERRIDES = "overrides"
#: layers' launch parts a kernel object keeps (id(LayerParams) -> part, holding the params
#: so the id stays theirs; cleared when full)
_PARAMS_KEEP = 1024
_ATTN = Launcher(_paged_attn_kernel)
_REDUCE = Launcher(_reduce_splits_kernel)


def _split_chunk(splits: int, block_m: int, dv_pad: int) -> int:
    """Splits per load of the fused reduction: a ``[chunk, block_m, dv_pad]`` float32 tile of
    at most 8192 elements (64 registers a thread at 4 warps), at least 1."""
    chunk = 1
    while chunk * 2 <= next_pow2(splits) and chunk * 2 * block_m * dv_pad <= 8192:
        chunk *= 2
    return chunk


class TritonPagedAttention5D(TritonPagedAttention):
    """``paged_attention_5d`` (the vectorised 5-D layout) with the same kernel: only the
    cache addressing differs. k_cache ``[pages, Hkv, D // x, page_size, x]``; v_cache shuffled
    ``[pages, Hkv, page_size // x, Dv, x]`` or hd_page ``[pages, Hkv, Dv, page_size]``."""

    op = "paged_attention_5d"
    nhd_pages = False

    @classmethod
    def request_for(cls, q, k_cache, v_cache):
        from ...strategies.vec5d import paged_attention_5d_request

        return paged_attention_5d_request(q, k_cache, v_cache)

    def _layout(self, k_cache, v_cache):
        ks, vs = k_cache.stride(), v_cache.stride()
        # a one-element innermost axis (hd_page V of one-token pages) is read at index 0
        # only: PyTorch leaves it any stride, even in a .contiguous() tensor
        if (ks[4] != 1 and k_cache.shape[4] != 1) or (vs[-1] != 1 and v_cache.shape[-1] != 1):
            raise ValueError(
                f"{self.name}: the innermost axis of k_cache and v_cache must be contiguous; "
                "pass .contiguous() tensors.")
        kx = k_cache.shape[4]
        if v_cache.dim() == 5:  # shuffled: token o at (o // x) * vs[2] + o % x, dim d at d * vs[3]
            return ((ks[0], ks[3], ks[1], ks[2]), (vs[0], vs[2], vs[1], vs[3]), kx,
                    v_cache.shape[4])
        # hd_page: token o at o, dim d at d * vs[2]
        return (ks[0], ks[3], ks[1], ks[2]), (vs[0], vs[3], vs[1], vs[2]), kx, 1
