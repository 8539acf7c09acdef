"""The aiter vendor plugin's ``mla_paged_attention`` kernel object (:class:`AiterMLA`):
``mla_decode_fwd`` with aiter's persistent work metadata (``get_mla_metadata_info_v1`` /
``get_mla_metadata_v1``; 4/8 heads padded to 16) for decode-like steps, ``mla_prefill_fwd``
for extend on a bf16 cache, and the next registered kernel for the rest. Registered by
:mod:`.aiter`; marshalling in :mod:`.aiter_marshal`."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from . import aiter_marshal as M
from ..validation import unit_stride
from .aiter_common import _T, _AiterKernel, _max_bs, _max_q, _params_of, _static, resolve
from .base import KernelPlan, MLAKernel, mla_request, plan_hints, token_count_error

__all__ = ["mla_buffer_spec", "AiterMLA", "AiterMLAPlan"]


def mla_buffer_spec(max_batch: int, max_seqlen_q: int, num_heads: int, q_dtype, kv_dtype, *,
                    cu_num: Optional[int] = None, prefix: str = "aiter.mla.", info_fn=None):
    """The persistent-MLA work metadata for ``max_batch`` requests of ``max_seqlen_q`` query
    tokens as a :class:`~aiter_attn.strategies.base.BufferSpec` (names ``prefix + name``).
    Empty when the layer does not use the persistent kernel. ``info_fn`` (aiter's
    ``get_mla_metadata_info_v1``, resolved when not given and ``cu_num`` is ``None``) gives
    the sizes where aiter runs; elsewhere ``cu_num`` compute units and the 0.1.7 formula."""
    from ..strategies.base import BufferSpec

    plan = M.mla_decode_plan(num_heads, kv_dtype, max_seqlen_q)
    if not plan.persistent:
        return BufferSpec({})
    specs = _mla_work_specs(max_batch, max_seqlen_q, plan, q_dtype, kv_dtype, cu_num=cu_num,
                            info_fn=info_fn)
    return BufferSpec({prefix + s.name: (s.shape, s.dtype) for s in specs})


def _mla_work_specs(batch, max_q, plan, q_dtype, kv_dtype, *, cu_num=None, info_fn=None):
    info = None
    if cu_num is None:
        fn = info_fn if info_fn is not None else resolve("get_mla_metadata_info_v1")
        call = M.build_mla_metadata_info_call(batch, max_q, plan, q_dtype, kv_dtype,
                                              params=_params_of(fn))
        info = fn(*call.args, **call.kwargs)
    return M.mla_work_buffer_spec(batch, max_q, plan.padded_heads, kv_dtype,
                                  cu_num=cu_num or 1, fast_mode=plan.fast_mode, info=info)

#: the persistent-MLA work-metadata buffers, in aiter's order (:func:`M.mla_work_buffer_spec`)
_WORK_NAMES = ("work_metadata", "work_indptr", "work_info_set", "reduce_indptr",
               "reduce_final_map", "reduce_partial_map")



@attrs.frozen(kw_only=True)
class AiterMLAPlan(KernelPlan):
    """One step of :class:`AiterMLA` for one layer group.

    Attributes:
        route: ``"mla_decode_fwd"`` (uniform query length ≤ 4), ``"mla_prefill_fwd"``, or
            ``"fallback"``: a step aiter's kernels cannot serve (:meth:`AiterMLA.step_reason`),
            planned (``inner``) and run by the next registered kernel (``fallback``).
        args: ``(cu_seqlens_q, kv_indptr, kv_indices, last_page_lens)``.
        decode: the :class:`~aiter_attn.kernels.aiter_marshal.MLADecodePlan` (decode route).
        work: the persistent kernel's work metadata, filled by ``get_mla_metadata_v1`` in
            the plan (``None`` for the non-persistent kernel).
        q_pad / o_pad: head-padded query and output ``[T, padded, ·]`` (4/8 heads).
        max_q: host query bound.
    """

    route: str
    args: tuple = attrs.field(**_T)
    decode: Optional[M.MLADecodePlan] = None
    work: Optional[dict] = attrs.field(default=None, **_T)
    q_pad: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    o_pad: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    max_q: int
    fallback: Optional[object] = attrs.field(default=None, **_T)
    inner: Optional[KernelPlan] = None


class AiterMLA(_AiterKernel, MLAKernel):
    """``mla_paged_attention`` on aiter: ``mla_decode_fwd`` for decode-like steps (uniform
    query length ≤ 4; persistent mode with ``get_mla_metadata_v1`` work metadata planned once
    per step; 4/8 heads padded to 16 into planned buffers), ``mla_prefill_fwd`` otherwise.
    Steps neither serves for this head count (:meth:`step_reason`) are planned and run by the
    next registered ``mla_paged_attention`` kernel, chosen once per binding."""

    FUNCTIONS = ("mla_decode_fwd", "mla_prefill_fwd", "get_mla_metadata_info_v1",
                 "get_mla_metadata_v1")

    def __init__(self, request=None):
        super().__init__(request)
        if request is not None:
            self._bind(request)

    def _bind(self, request):
        self._resolve()
        self.heads = dict(request.extra).get("heads")
        self.dim, self.rank = request.head_dim, request.v_head_dim
        self.q_dtype, self.kv_dtype = request.dtype, request.kv_dtype
        self.padded, self.repeat = M.mla_head_padding(self.heads)
        self._sizes: dict = {}  # (batch, max_q) -> work-buffer specs (host ints, once each)
        self._next = None  # the kernel serving the steps aiter cannot (bound on first use)

    def __call__(self, q, kv_cache, out, **kwargs):
        if kwargs.get("custom_mask") is not None or not kwargs.get("causal", True):
            raise ValueError("the aiter MLA backend serves causal attention without custom "
                             "masks.")
        if self.request is None:  # the functional convenience: bind to these tensors
            req = mla_request(q, kv_cache, kwargs["kv_lora_rank"])
            return type(self)(req)(q, kv_cache, out, **kwargs)
        return super().__call__(q, kv_cache, out, **kwargs)

    def _work_specs(self, batch, max_q, dplan):
        key = (batch, max_q)
        specs = self._sizes.get(key)
        if specs is None:
            specs = self._sizes[key] = _mla_work_specs(
                batch, max_q, dplan, self.q_dtype, self.kv_dtype,
                info_fn=self._fn("get_mla_metadata_info_v1"))
        return specs

    def step_reason(self, max_q: int) -> Optional[str]:
        """Why aiter's MLA kernels cannot serve a step of ``max_q`` query tokens per request
        for this layer (``None``: they can); host integers only."""
        if max_q > 4:
            return M.mla_prefill_reason(self.heads, self.q_dtype, self.kv_dtype, max_q)
        dplan = M.mla_decode_plan(self.heads, self.kv_dtype, max_q)
        # the queries reach aiter as the layer's dtype (never quantised here)
        return M.mla_decode_reason(dplan, self.kv_dtype, max(max_q, 1), q_dtype=self.q_dtype)

    def buffer_spec(self, limits):
        """Token indices, the persistent kernel's work metadata (sized by aiter's
        ``get_mla_metadata_info_v1`` for ``limits.max_bs`` requests of ``limits.q_len``
        queries) and the head-padding buffers, for ``limits``; for a cell aiter cannot serve,
        the next kernel's buffers."""
        from ..strategies.base import BufferSpec

        req = self.request
        if req is None:
            return BufferSpec({})
        why = self.step_reason(limits.q_len)
        if why is not None:
            return self._fallback(why).buffer_spec(limits)
        spec = self._index_spec(limits, req.page_size)
        if limits.q_len > 4:  # mla_prefill_fwd: token indices only
            return BufferSpec(spec)
        dplan = M.mla_decode_plan(self.heads, self.kv_dtype, limits.q_len)
        if dplan.persistent:
            for s in self._work_specs(limits.max_bs, limits.q_len, dplan):
                spec[self._tag + s.name] = (s.shape, s.dtype)
        if self.repeat > 1:
            spec[self._tag + "q_pad"] = ((limits.max_num_tokens, self.padded, self.dim),
                                         self.q_dtype)
            spec[self._tag + "o_pad"] = ((limits.max_num_tokens, self.padded, self.rank),
                                         self.q_dtype)
        return BufferSpec(spec)

    def _work(self, out, md, max_q, dplan, device) -> dict:
        if out is None:
            return M.allocate_buffers(self._work_specs(max(md.batch_size, 1), max_q, dplan),
                                      device)
        names = [self._tag + n for n in _WORK_NAMES]
        if any(n not in out for n in names):  # bound after the graph manager was built
            for s in self._work_specs(_max_bs(out, md), max_q, dplan):
                out.setdefault(self._tag + s.name,
                               torch.empty(s.shape, dtype=s.dtype, device=device))
        return {n[len(self._tag):]: out[n] for n in names}

    def plan(self, md, out: Optional[dict] = None) -> AiterMLAPlan:
        """Route, token indices and (decode) the work metadata: one
        ``get_mla_metadata_v1`` call per step, into static buffers under graphs."""
        if md.mask is not None:
            raise ValueError("the aiter MLA backend serves causal attention without custom "
                             "masks; pick another backend for tree verify.")
        query, pages = md.query, md.pages
        cu, seqused_k, block_table = map(unit_stride, (query.cu_seqlens_q, pages.seqused_k,
                                                       pages.block_table))
        max_q = _max_q(cu, plan_hints(md)[0])
        why = self.step_reason(max_q)
        if why is not None:
            nxt = self._fallback(why)
            return AiterMLAPlan(route="fallback", num_tokens=query.num_tokens, args=(),
                                max_q=max_q, fallback=nxt, inner=nxt.plan(md, out))
        kv_indptr, kv_indices, ones = self._token_indices(md, block_table, seqused_k, out)
        common = dict(num_tokens=query.num_tokens, mask_literal=False, max_q=max_q,
                      args=(cu, kv_indptr, kv_indices, ones))
        if max_q > 4:
            return AiterMLAPlan(route="mla_prefill_fwd", **common)
        dev = cu.device
        dplan = M.mla_decode_plan(self.heads, self.kv_dtype, max_q)
        work = None
        if dplan.persistent:
            work = self._work(out, md, max_q, dplan, dev)
            self._call(M.build_mla_metadata_call(
                cu, kv_indptr, ones, work, dplan, max_seqlen_qo=max_q, q_dtype=self.q_dtype,
                kv_dtype=self.kv_dtype, params=self._params("get_mla_metadata_v1")))
        q_pad = o_pad = None
        if self.repeat > 1:
            t = query.num_tokens
            cap = None if out is None else _max_bs(out, md) * max(query.max_seqlen_q, 1)
            q_pad = _static(out, self._tag + "q_pad", (t, self.padded, self.dim), self.q_dtype,
                            dev, cap)
            o_pad = _static(out, self._tag + "o_pad", (t, self.padded, self.rank),
                            self.q_dtype, dev, cap)
        return AiterMLAPlan(route="mla_decode_fwd", decode=dplan, work=work, q_pad=q_pad,
                            o_pad=o_pad, **common)

    def run(self, q, cache, plan: AiterMLAPlan, params, out, lse=None):
        """The planned route's aiter call; allocates nothing (padded heads go through the
        plan's buffers)."""
        if plan.fallback is not None:
            return plan.fallback.run(q, cache, plan.inner, params, out, lse=lse)
        t = q.shape[0]
        if t != plan.num_tokens:
            raise token_count_error(self.name, t, plan)
        kv_cache = cache[0]
        cu, kv_indptr, kv_indices, ones = plan.args
        scale = params.k_scale_t if params.has_scales else None  # fp8 caches only
        if plan.route == "mla_prefill_fwd":  # a bf16 cache (step_reason): no scales
            self._call(M.build_mla_prefill_call(
                q, kv_cache, out, qo_indptr=cu, kv_indptr=kv_indptr, kv_indices=kv_indices,
                last_page_lens=ones, max_seqlen_q=plan.max_q, softmax_scale=params.scale))
            return out
        r = self.repeat
        if r > 1:
            q_in, o = plan.q_pad, plan.o_pad
            q_in.view(t, self.heads, r, self.dim).copy_(
                q.unsqueeze(2).expand(t, self.heads, r, self.dim))
        else:
            q_in, o = q, out
        self._call(M.build_mla_decode_call(
            q_in, kv_cache, o, qo_indptr=cu, kv_indptr=kv_indptr, kv_indices=kv_indices,
            last_page_lens=ones, max_seqlen_q=plan.max_q, softmax_scale=params.scale,
            plan=plan.decode, buffers=plan.work, q_scale=scale, kv_scale=scale,
            params=self._params("mla_decode_fwd")))
        if r > 1:
            out.copy_(M.unpad_heads(o, r))
        return out
