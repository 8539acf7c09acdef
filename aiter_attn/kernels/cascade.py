"""Cascade (shared-prefix) attention as a plan/run kernel object wrapping the ordinary kernel.

:class:`CascadeKernel` wraps the bound ``paged_attention`` kernel of a layer group (any
kernel declaring the ``lse`` feature: Triton, the reference, a plugin's). Per step, ``plan``
groups the batch on the device (:func:`~aiter_attn.kernels.cascade_plan.plan_cascade_index`:
runs of consecutive requests whose leading page ids agree over at least
``min_shared_tokens``), plans the wrapped kernel over each request's *own* pages (its row
after the run's shared pages, ``seqused_k − S``) and sizes the shared pass; ``run`` launches

1. the wrapped kernel over the own pages with the LSE (sinks, window, soft-cap as usual),
   under CUDA-graph capture on a GPU on a side stream of the kernel object, concurrent with
2. the shared pass: each run's queries tiled together against the run's shared pages, read
   once per (run, KV head, query tile, key split) (:mod:`aiter_attn.kernels.triton.cascade`),
3. the merge by LSE, in place into ``out``.

A batch with no qualifying run costs the grouping (a few small index ops in ``plan``), an
early-exit launch and the merge pass over ``out``. Nothing reads the device on the host, so
the Triton path is CUDA-graph capturable (the grouping is recomputed into static buffers by
every replay's plan); the reference path (``impl="reference"``) groups on the host and is
eager-only like the reference kernel itself.

Exact against the ordinary kernel over the full table: see
:mod:`aiter_attn.kernels.reference_cascade` for why every feature splits (windows starting
inside the shared prefix included). Causal layers without a custom mask only; fp8 caches are
served by the ordinary kernel (``cascade_reject_reason``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import attrs
import torch

from ..graph.signature import SIGNATURE_KEY
from ..metadata import PageTable
from ..types import CGSupport, FP8_DTYPES
from ..validation import check_attention_scalars, unit_stride
from .base import AttentionKernel, KernelPlan, LayerParams, plan_hints, token_count_error
from .cascade_plan import (CascadeIndex, cascade_index_buffers, num_tiles_bound,
                           plan_cascade_index)

__all__ = ["CascadeKernel", "CascadePlan", "cascade_paged_attention", "cascade_reject_reason",
           "min_shared_pages"]

_T = dict(eq=False, repr=False)


def min_shared_pages(min_shared_tokens: int, page_size: int) -> int:
    """Whole pages a run must share: ``ceil(min_shared_tokens / page_size)`` (≥ 1)."""
    return max(1, -(-int(min_shared_tokens) // int(page_size)))


def cascade_reject_reason(request, kernel) -> Optional[str]:
    """Why a layer group's kernel cannot be wrapped (``None``: it can). ``request`` is the
    group's :class:`~aiter_attn.kernels.registry.KernelRequest`."""
    feats = request.features
    for f, why in (("custom_mask", "a custom mask is applied literally"),
                   ("non_causal", "the shared pass assumes causal attention"),
                   ("batch_invariant", "cascade makes a row's reduction depend on its batch"),
                   ("fp8", "fp8 caches use the ordinary kernel")):
        if f in feats:
            return why
    if request.kv_dtype in FP8_DTYPES:
        return "fp8 caches use the ordinary kernel"
    caps = getattr(kernel, "capabilities", None)
    if caps is None or "lse" not in caps.features:
        return f"kernel {getattr(kernel, 'name', '?')!r} does not declare the 'lse' feature"
    if kernel.op != "paged_attention":
        return f"op {kernel.op} (NHD pages only)"
    return None


@attrs.frozen(kw_only=True)
class CascadePlan(KernelPlan):
    """One step's cascade launch for one layer group.

    Attributes:
        inner: the wrapped kernel's plan: over the own pages when ``cascade``, else over the
            full table (the ordinary launch).
        cascade: the cascade passes run (a batch of ≥ 2 requests with tokens).
        index: the step's grouping (:class:`~aiter_attn.kernels.cascade_plan.CascadeIndex`).
        block_table: the full page table (the shared pages are the run leaders' rows).
        own_lse: float32 ``[T, Hq]`` workspace of the own pass's LSE.
        part_acc / part_ml: float32 ``[splits, T, Hq, DV_PAD]`` / ``[splits, T, Hq, 2]``
            shared partials.
        cfg: the shared pass's launch parameters.
        groups: host groups (reference path only).
    """

    inner: KernelPlan = attrs.field(**_T)
    cascade: bool = False
    index: Optional[CascadeIndex] = attrs.field(default=None, **_T)
    block_table: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    cu_seqlens_q: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    seqused_k: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    own_lse: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    part_acc: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    part_ml: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    cfg: dict = attrs.field(factory=dict, **_T)
    #: the stream of the own pass when it overlaps the shared pass (a real GPU, the
    #: ``overlap`` tuning on; used while a CUDA graph is captured, eager calls stay on one
    #: stream); ``None``: both passes on the caller's stream
    side_stream: Optional[object] = attrs.field(default=None, metadata={SIGNATURE_KEY: False},
                                                **_T)
    # host groups of the (eager-only) reference path: never read by a graph
    groups: tuple = attrs.field(default=(), metadata={SIGNATURE_KEY: False})


def _triton_runs_on(device) -> bool:
    from .triton import TRITON_DEVICES

    return device.type in TRITON_DEVICES


def _on_gpu(device) -> bool:
    from .triton._kvutil import interpreting

    return device.type == "cuda" and not interpreting()


class CascadeKernel(AttentionKernel):
    """The cascade wrapper of a bound ``paged_attention`` kernel (see the module docstring).

    Args:
        inner: the bound kernel (declaring ``lse``).
        min_shared_tokens: least tokens a run must share (rounded up to whole pages).
        impl: ``"triton"`` (shared pass and merge in Triton: capturable) or ``"reference"``
            (torch, host grouping: eager only).
        tag: names this page table's grouping buffers (``"full"``, ``"swa_pages"``): groups
            of one step reading the same table share one grouping.
    """

    op = "paged_attention"

    def __init__(self, inner: AttentionKernel, *, min_shared_tokens: int,
                 impl: str = "triton", tag: str = "full"):
        super().__init__(inner.request)
        if impl not in ("triton", "reference"):
            raise ValueError(f"impl={impl!r}; allowed: 'triton', 'reference'.")
        if int(min_shared_tokens) < 1:
            raise ValueError(f"min_shared_tokens={min_shared_tokens}; must be ≥ 1 (use None "
                             "or 0 in BackendConfig.cascade_min_shared_tokens to disable).")
        self.inner = inner
        self.min_shared_tokens = int(min_shared_tokens)
        self.impl = impl
        self.tag = tag
        self.name = f"{inner.name}+cascade"
        self.capabilities = inner.capabilities
        extra = dict(inner.request.extra) if inner.request is not None else {}
        self.q_heads = extra.get("q_heads")
        self.kv_heads = extra.get("kv_heads")
        req = inner.request
        self.head_dim = req.head_dim if req is not None else None
        self.v_head_dim = (req.v_head_dim or req.head_dim) if req is not None else None
        self._side_stream = None

    @property
    def cg_support(self) -> CGSupport:
        if self.impl != "triton":
            return CGSupport.NEVER
        return self.inner.cg_support

    # -- sizes ---------------------------------------------------------------------------
    def _dv_pad(self) -> int:
        from .triton._kvutil import next_pow2

        return max(16, next_pow2(self.v_head_dim))

    def _cfg(self, num_tokens: int, max_k: int, device) -> dict:
        from .triton._kvutil import next_pow2, num_sms
        from .triton.cascade import shared_config

        req = self.inner.request
        fp32 = req is not None and torch.float32 in (req.dtype, req.kv_dtype)
        return shared_config(group=self.q_heads // self.kv_heads,
                             head_dim_pad=max(16, next_pow2(max(self.head_dim,
                                                                self.v_head_dim))),
                             fp32=fp32, on_gpu=_on_gpu(device), num_tokens=num_tokens,
                             max_k=max(max_k, 1), num_kv_heads=self.kv_heads,
                             sms=num_sms(device))

    def _names(self, block_t: int) -> dict:
        ix = f"cascade.{self.tag}.t{block_t}."
        return {
            "index": ix,
            "own_lse": f"cascade.own_lse.{self.q_heads}h",
            "acc": f"cascade.part_acc.{self.q_heads}h{self._dv_pad()}",
            "ml": f"cascade.part_ml.{self.q_heads}h",
        }

    def _workspace_shapes(self, max_bs, max_tokens, width, max_k, device) -> dict:
        cfg = self._cfg(1, max_k, device)  # splits never grow with the token count
        names = self._names(cfg["block_t"])
        tiles = num_tiles_bound(max_tokens, max_bs, cfg["block_t"])
        ix = names["index"]
        i32, f32 = torch.int32, torch.float32
        rows = cfg["num_splits"] * max_tokens
        return {
            ix + "own_block_table": ((max_bs, width), i32),
            ix + "own_seqused_k": ((max_bs,), i32),
            ix + "tiles": ((tiles, 4), i32),
            ix + "q_pos": ((max_tokens,), i32),
            ix + "tok_shared": ((max_tokens,), i32),
            ix + "shared_pages": ((max_bs,), i32),
            ix + "links": ((max_bs,), i32),
            ix + "scratch": ((4 * max_bs,), i32),
            names["own_lse"]: ((max_tokens, self.q_heads), f32),
            names["acc"]: ((rows, self.q_heads, self._dv_pad()), f32),
            names["ml"]: ((rows, self.q_heads, 2), f32),
        }

    def buffer_spec(self, limits):
        """The wrapped kernel's static buffers and the cascade's (grouping, own LSE, shared
        partials) for ``limits``."""
        from ..strategies.base import BufferSpec

        spec = self.inner.buffer_spec(limits)
        if self.request is None or self.impl != "triton":
            return spec
        width = limits.table_pages(self.request.page_size)
        shapes = self._workspace_shapes(limits.max_bs, limits.max_num_tokens, width,
                                        limits.max_seq_len, torch.device(self.request.device))
        return spec.merge(BufferSpec(shapes))

    def _static(self, out, name, shape, dtype, device, need_rows):
        buf = out.get(name)
        if buf is None:
            buf = out.setdefault(name, torch.zeros(shape, dtype=dtype, device=device))
        if buf.shape[0] < need_rows or (len(shape) > 1 and buf.shape[1] < shape[1]):
            raise RuntimeError(
                f"{self.name}: the static buffer {name!r} holds {tuple(buf.shape)} but this "
                f"plan needs {need_rows} rows; build CudaGraphManager after binding the layers "
                "(AttentionBackend.bind_layers) so the kernel's buffer_spec sizes it.")
        return buf

    # -- plan / run ----------------------------------------------------------------------
    def plan(self, md, out: Optional[dict] = None) -> CascadePlan:
        """Group the batch (device ops, no sync), plan the wrapped kernel over the own pages
        and size the shared pass."""
        query, pages = md.query, md.pages
        bs = query.cu_seqlens_q.shape[0] - 1
        num_tokens = query.num_tokens
        if bs < 2 or num_tokens == 0 or md.mask is not None:
            return CascadePlan(num_tokens=num_tokens if bs else 0,
                               inner=self.inner.plan(md, out))
        device = query.cu_seqlens_q.device
        _, hint_k = plan_hints(md)
        width = pages.block_table.shape[1]
        max_k = int(hint_k) if hint_k is not None else width * pages.page_size
        cfg = self._cfg(num_tokens, max_k, device)
        names = self._names(cfg["block_t"])
        n_tiles = num_tiles_bound(num_tokens, bs, cfg["block_t"])
        splits = cfg["num_splits"]
        static = out is not None
        if static:
            cu_all = out.get("cu_seqlens_q")
            max_bs = max(cu_all.shape[0] - 1 if cu_all is not None else bs, bs)
            max_tokens = max(max_bs * max(query.max_seqlen_q, 1), num_tokens)
            shapes = self._workspace_shapes(max_bs, max_tokens, width, max_k, device)
            bufs = {}
            for name, (shape, dtype) in shapes.items():
                need = shape[0]
                if name.endswith(("tiles",)):
                    need = n_tiles
                elif name.endswith(("q_pos", "tok_shared")) or name == names["own_lse"]:
                    need = num_tokens
                elif name in (names["acc"], names["ml"]):
                    need = splits * num_tokens
                elif name.endswith("scratch"):
                    need = 4 * bs
                else:
                    need = bs
                bufs[name] = self._static(out, name, shape, dtype, device, need)
            ix = {k[len(names["index"]):]: v for k, v in bufs.items()
                  if k.startswith(names["index"])}
            own_lse = bufs[names["own_lse"]][:num_tokens]
            acc = bufs[names["acc"]][: splits * num_tokens]
            ml = bufs[names["ml"]][: splits * num_tokens]
        else:
            ix = None
            own_lse = torch.empty(num_tokens, self.q_heads, dtype=torch.float32, device=device)
            acc = torch.empty(splits * num_tokens, self.q_heads, self._dv_pad(),
                              dtype=torch.float32, device=device)
            ml = torch.empty(splits * num_tokens, self.q_heads, 2, dtype=torch.float32,
                             device=device)
        # one grouping per step and page table (layer groups reading it share it)
        key = ("cascade.index", self.tag, cfg["block_t"], self.min_shared_tokens,
               id(pages.block_table))
        plans = md.kernel_plans
        index = plans.get(key) if plans is not None else None
        if index is None:
            planner = plan_cascade_index
            if self.impl == "triton" and _triton_runs_on(device):
                # three launches instead of ~90 small torch ops (the torch planner stays for
                # the reference path and the meta device of the no-sync tests)
                from .triton.cascade_index import plan_cascade_index_triton as planner

                if ix is None:
                    ix = cascade_index_buffers(bs, width, num_tokens, n_tiles, device)
            index = planner(
                pages.block_table, pages.seqused_k, query.cu_seqlens_q,
                page_size=pages.page_size,
                min_shared_pages=min_shared_pages(self.min_shared_tokens, pages.page_size),
                num_tokens=num_tokens, block_t=cfg["block_t"], out=ix)
            if plans is not None:
                plans[key] = index
        own_view = attrs.evolve(md, pages=PageTable(
            block_table=index.own_block_table, seqused_k=index.own_seqused_k,
            max_seqlen_k=pages.max_seqlen_k, page_size=pages.page_size))
        groups = ()
        if self.impl == "reference":
            from .reference_cascade import cascade_groups_reference

            groups = tuple(cascade_groups_reference(
                pages.block_table, pages.seqused_k, query.cu_seqlens_q, pages.page_size,
                min_shared_pages(self.min_shared_tokens, pages.page_size)))
        side = None
        if self.impl == "triton" and _on_gpu(device) and cfg.get("overlap"):
            if self._side_stream is None:  # once per kernel object, on its first GPU plan
                self._side_stream = torch.cuda.Stream(device)
            side = self._side_stream
        return CascadePlan(
            side_stream=side,
            num_tokens=num_tokens, inner=self.inner.plan(own_view, out), cascade=True,
            # the shared pass reads the leaders' rows with unit stride along the last axis:
            # a strided view (``buf[:, ::2]``, a column-major table) is materialised here
            # (graph buffers never are strided, so captured addresses stay the caller's)
            index=index, block_table=unit_stride(pages.block_table),
            cu_seqlens_q=query.cu_seqlens_q,
            seqused_k=pages.seqused_k, own_lse=own_lse,
            part_acc=acc.view(splits, num_tokens, self.q_heads, self._dv_pad()),
            part_ml=ml.view(splits, num_tokens, self.q_heads, 2), cfg=cfg, groups=groups)

    def run(self, q, cache, plan: CascadePlan, params: LayerParams, out, lse=None):
        """The own pass, the shared pass and the merge (launches only)."""
        if not plan.cascade:
            return self.inner.run(q, cache, plan.inner, params, out, lse=lse)
        if q.shape[0] != plan.num_tokens:
            raise token_count_error(self.name, q.shape[0], plan)
        side = plan.side_stream  # set for the Triton path on a GPU only
        if side is not None and not torch.cuda.is_current_stream_capturing():
            # eager calls stay on one stream: the fork and join cost more host time than the
            # overlap saves GPU time (H200, 2026-12-04 00:24: 0.2195 ms eager with the side
            # stream against 0.1464 on one stream; replayed 0.0565 against 0.0603)
            side = None
        own_stream = contextlib.nullcontext()
        if side is not None:
            # the own pass (memory-bound, many small programs) on a side stream, concurrent
            # with the shared pass (compute-bound): a fork and a join of events, no host
            # sync; the captured graph gets two parallel branches
            main = torch.cuda.current_stream(q.device)
            side.wait_stream(main)
            own_stream = torch.cuda.stream(side)
        own = out
        if self.impl == "reference" and self.inner.name == "reference" \
                and out.dtype != torch.float32:
            # the torch reference writes any dtype: keep its own pass in float32 so that the
            # merged result is rounded to out's dtype once (eager-only path: allocating is fine)
            own = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        with own_stream:
            self.inner.run(q, cache, plan.inner, params, own, lse=plan.own_lse)
        k_cache, v_cache = cache
        if self.impl == "reference":
            return self._run_reference(q, k_cache, v_cache, plan, params, own, out, lse)
        from .triton.cascade import cascade_merge_triton, cascade_shared_triton

        ix = plan.index
        cascade_shared_triton(
            q, k_cache, v_cache, plan.part_acc, plan.part_ml, ix.tiles, ix.q_pos,
            plan.block_table, softmax_scale=params.scale, window_left=params.window[0],
            softcap=params.softcap,
            k_scale_t=params.k_scale_t if params.has_scales else None,
            v_scale_t=params.v_scale_t if params.has_scales else None, cfg=plan.cfg)
        if side is not None:
            main.wait_stream(side)
        cascade_merge_triton(out, plan.own_lse, plan.part_acc, plan.part_ml, ix.tok_shared, lse)
        return out

    def _run_reference(self, q, k_cache, v_cache, plan, params, own, out, lse):
        """Shared pass and merge in torch; ``own`` holds the own pass (``out`` or a float32
        buffer), the merged result goes to ``out``."""
        from .reference import merge_attention_states_reference
        from .reference_cascade import cascade_shared_reference

        shared, shared_lse = cascade_shared_reference(
            q, k_cache, v_cache, plan.groups, cu_seqlens_q=plan.cu_seqlens_q,
            seqused_k=plan.seqused_k, block_table=plan.block_table,
            softmax_scale=params.scale, window_size=params.window, softcap=params.softcap,
            k_scale=params.k_scale, v_scale=params.v_scale)
        merged_lse = lse if lse is not None else torch.empty_like(plan.own_lse)
        merged = torch.empty_like(shared)
        merge_attention_states_reference(own.float(), plan.own_lse, shared, shared_lse, merged,
                                         merged_lse)
        out.copy_(merged.to(out.dtype))
        return out


def _impl_for(inner, device) -> str:
    """``"triton"`` where the Triton kernels run on ``device`` and the wrapped kernel is not
    the reference; else ``"reference"``."""
    from .triton import TRITON_DEVICES

    if getattr(inner, "name", "") == "reference" or device.type not in TRITON_DEVICES:
        return "reference"
    return "triton"


def cascade_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    min_shared_tokens: int,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale=None,
    v_scale=None,
    out: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    backend: Optional[str] = None,
    return_lse: bool = False,
):
    """Causal paged attention (``ops.paged_attention`` semantics) computed the cascade way:
    runs of consecutive requests sharing ≥ ``min_shared_tokens`` leading tokens of identical
    pages read them once (see the module docstring). Arguments as
    :func:`aiter_attn.ops.paged_attention` (``backend`` picks the wrapped kernel and with it
    the shared pass: ``"reference"`` or ``"triton"``). Returns ``out`` (and the float32
    ``[T, Hq]`` LSE with ``return_lse``)."""
    from .. import ops
    from ..plugins import kernel_registry

    if isinstance(min_shared_tokens, bool) or not isinstance(min_shared_tokens, int) \
            or min_shared_tokens < 1:
        raise ValueError(f"min_shared_tokens={min_shared_tokens!r}; must be an int ≥ 1 (the "
                         "least tokens a run of requests must share).")
    # the checks of ops.paged_attention (the same arguments, refused by the same names): the
    # kernels launch on them unchecked
    ops._validate_paged(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, out,
                        sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    ops._check_window(window_size)
    return_lse = ops._check_flag("return_lse", return_lse)
    max_seqlen_q = ops._check_hint("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = ops._check_hint("max_seqlen_k", max_seqlen_k)
    softmax_scale, softcap = check_attention_scalars(softmax_scale, softcap, k_scale=k_scale,
                                                     v_scale=v_scale)
    ops._check_sinks(sinks, q.shape[1])
    req = ops.paged_attention_request(q, k_cache, v_cache, window_size=tuple(window_size),
                                      softcap=softcap, sinks=sinks, causal=True)
    req = ops.with_call_features(req, lse=True)
    inner = kernel_registry().select(req, backend=backend).bind(req)
    why = cascade_reject_reason(req, inner)
    if why is not None:
        raise ValueError(f"cascade_paged_attention cannot serve this call: {why}; use "
                         "ops.paged_attention.")
    kernel = CascadeKernel(inner, min_shared_tokens=min_shared_tokens,
                           impl=_impl_for(inner, q.device))
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=q.dtype,
                          device=q.device)
    lse = (torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
           if return_lse else None)
    kernel(q, k_cache, v_cache, out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
           block_table=block_table, softmax_scale=softmax_scale, causal=True,
           window_size=tuple(window_size), softcap=softcap, sinks=sinks, k_scale=k_scale,
           v_scale=v_scale, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, lse=lse)
    return (out, lse) if return_lse else out
