"""The AMD vendor plugin: our ops on top of ``aiter``'s kernels (ROCm only).

It registers kernels only where ``import aiter`` works *and* torch is a ROCm build with a
device (``torch.version.hip``); elsewhere its hook registers nothing and says why at debug
level. The kernels were written against the ``amd-aiter`` wheel's signatures (checked on the
CPU by ``tests/test_aiter_contract.py``) and have not been run on an AMD GPU here.

======================  ==========================================================
our op                  aiter function
======================  ==========================================================
paged_attention         ``paged_attention_ragged`` (decode, head dim 64/128; fp8 as
                        ``"fp8_e4m3"``), ``mha_batch_prefill_func`` (prefill/extend),
                        ``unified_attention`` (sliding windows, sinks, verify, fp8)
mla_paged_attention     ``mla_decode_fwd`` (+ ``get_mla_metadata_info_v1`` /
                        ``get_mla_metadata_v1`` persistent work metadata; 4/8 heads
                        padded to 16), ``mla_prefill_fwd`` (extend, bf16 cache)
varlen_attention        ``flash_attn_varlen_func`` (dense ragged q/k/v, MLA extend
                        without prefix)
paged_attention_5d      ``pa_decode_gluon`` (5-D shuffled layout, ≤ 4 query tokens per
                        request; newer releases only)
======================  ==========================================================

fp8 caches are accepted in the running GPU's native e4m3 format only (gfx942:
``float8_e4m3fnuz``, gfx950: ``float8_e4m3fn``; :func:`native_fp8`). Steps aiter's kernels
cannot serve (head sizes, head counts, dtypes the wheel has no kernel for) are routed to
another aiter function or planned and run by the next registered kernel.

The attention ops are plan/run kernel objects (:mod:`aiter_attn.kernels.base`), bound once
per layer group: ``plan(md, out=None)`` (once per step) routes between aiter's functions on
the step's ``max_seqlen_q``, builds the token-level ``kv_indptr``/``kv_indices`` and
last-page lengths, the persistent-MLA work metadata (``get_mla_metadata_v1``) and the
workspaces, eagerly or into the graph manager's static buffers (declared by
``buffer_spec(limits)``, or added once with ``out.setdefault``); ``run`` only makes the
aiter call of the planned route. Nothing is allocated per layer call besides what the
caller's output needs, and the module keeps no state: resolved functions live on the bound
kernel object. All argument marshalling is in :mod:`aiter_attn.kernels.aiter_marshal`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Optional

import attrs
import torch

from ..hookspecs import hookimpl
from ..types import FP8_DTYPES, CGSupport
from ..validation import unit_stride
from . import aiter_marshal as M
from .base import (AttentionKernel, KernelPlan, MLAKernel, mask_literal, mla_request, plan_hints,
                   token_count_error)
from .registry import Capabilities

__all__ = [
    "AITER_FUNCTIONS",
    "OPTIONAL_FUNCTIONS",
    "availability",
    "native_fp8",
    "resolve",
    "accepted_params",
    "mla_buffer_spec",
    "AiterPagedAttention",
    "AiterMLA",
    "AiterPagedAttention5D",
    "AiterPlan",
    "AiterMLAPlan",
    "aiter_paged_attention",
    "aiter_mla_paged_attention",
    "aiter_varlen_attention",
    "aiter_paged_attention_5d",
    "aiter_attn_register_kernels",
]

log = logging.getLogger(__name__)

#: aiter function → modules that define it, newest layout first.
AITER_FUNCTIONS = {
    "flash_attn_varlen_func": ("aiter.ops.mha",),
    "mha_batch_prefill_func": ("aiter.ops.mha",),
    "paged_attention_ragged": ("aiter.ops.attention",),
    "get_mla_metadata_info_v1": ("aiter.ops.attention",),
    "get_mla_metadata_v1": ("aiter.ops.attention",),
    "mla_decode_fwd": ("aiter.mla",),
    "mla_prefill_fwd": ("aiter.mla",),
    "unified_attention": ("aiter.ops.triton.attention.unified_attention",
                          "aiter.ops.triton.unified_attention"),
    "pa_decode_gluon": ("aiter.ops.triton.gluon.pa_decode_gluon",),
}
#: functions some releases lack; the kernels that need them are then not registered.
OPTIONAL_FUNCTIONS = frozenset({"pa_decode_gluon"})

def availability() -> tuple[bool, str]:
    """``(True, "")`` where the plugin can run, else ``(False, why)``."""
    if getattr(torch.version, "hip", None) is None:
        return False, "torch is not a ROCm build (torch.version.hip is None)"
    if not torch.cuda.is_available():
        return False, "no ROCm device is visible"
    try:
        importlib.import_module("aiter")
    except Exception as exc:  # aiter's import compiles/loads native code; any failure counts
        return False, f"import aiter failed: {type(exc).__name__}: {exc}"
    return True, ""


def native_fp8() -> tuple[Optional[torch.dtype], str]:
    """``(format, device)``: the e4m3 dtype aiter's kernels read on the running GPU, from
    aiter's own architecture (``aiter.jit.utils.chip_info.get_gfx``, as its
    ``aiter.utility.dtypes.fp8`` is chosen) and :data:`aiter_marshal.NATIVE_FP8`; or
    ``(None, why)`` where aiter cannot tell (no aiter, an architecture without fp8 kernels).
    Imports aiter when called (at registration), never at our import."""
    try:
        gfx = importlib.import_module("aiter.jit.utils.chip_info").get_gfx()
    except Exception as exc:  # aiter's import or its rocminfo query; any failure counts
        return None, (f"the device's architecture is unknown (aiter's get_gfx: "
                      f"{type(exc).__name__}: {exc})")
    native = M.NATIVE_FP8.get(gfx)
    if native is None:
        return None, f"aiter has no fp8 format for {gfx} (it has {sorted(M.NATIVE_FP8)})"
    return native, str(gfx)


def resolve(name: str):
    """The aiter function ``name`` (raises ``ImportError`` if absent). Not cached here: bound
    kernel objects resolve their functions once, when bound."""
    errors = []
    for module in AITER_FUNCTIONS[name]:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{module}: {exc}")
    raise ImportError(f"aiter has no {name} ({'; '.join(errors)}); upgrade amd-aiter.")


def _params_of(fn) -> Optional[frozenset]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a compiled wrapper without a signature
        return None


def accepted_params(name: str) -> Optional[frozenset]:
    """Parameter names of the installed aiter function (``None`` if it cannot be inspected)."""
    return _params_of(resolve(name))


def _call(call: M.AiterCall):
    """One call of a function resolved now (the functional, non-attention ops)."""
    return resolve(call.fn)(*call.args, **call.kwargs)


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


def _max_q(cu_seqlens_q: torch.Tensor, hint: Optional[int]) -> int:
    if hint is not None:
        return int(hint)
    # a functional call without max_seqlen_q (eager only; strategies always pass the hint)
    return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0


def _static(out, name, shape, dtype, device, cap_rows=None):
    """``shape`` rows: a fresh tensor (eager, ``out is None``) or the leading rows of the
    static buffer ``name`` (added once with ``cap_rows`` rows when a kernel bound after the
    graph manager was built plans into ``out`` for the first time)."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = out.get(name)
    if buf is None:
        rows = max(shape[0], cap_rows or 0)
        buf = out.setdefault(name, torch.empty((rows, *shape[1:]), dtype=dtype, device=device))
    if tuple(buf.shape[1:]) != tuple(shape[1:]) or buf.shape[0] < shape[0]:
        raise RuntimeError(
            f"static buffer {name!r} has shape {tuple(buf.shape)} but this plan needs "
            f"{tuple(shape)}; build CudaGraphManager after binding the layers so the aiter "
            "kernel's buffer_spec sizes it.")
    return buf[: shape[0]]


def _max_bs(out, md) -> int:
    """The largest batch the static buffers serve (their ``cu_seqlens_q``), else this one."""
    cu = out.get("cu_seqlens_q") if out is not None else None
    return max(cu.shape[0] - 1 if cu is not None else md.batch_size, md.batch_size, 1)


_T = dict(eq=False, repr=False)

#: the persistent-MLA work-metadata buffers, in aiter's order (:func:`M.mla_work_buffer_spec`)
_WORK_NAMES = ("work_metadata", "work_indptr", "work_info_set", "reduce_indptr",
               "reduce_final_map", "reduce_partial_map")


class _AiterKernel:
    """What the aiter kernel objects share: functions resolved once per binding (on first
    use), per-object static-buffer names, the token indices planned into them."""

    FUNCTIONS: tuple = ()

    def _resolve(self):
        self._fns: dict = {}  # name -> (function, accepted parameter names), on first use
        self._tag = f"aiter.{self.op}.{id(self):x}."

    def _entry(self, name: str):
        hit = self._fns.get(name)
        if hit is None:
            fn = resolve(name)
            hit = self._fns[name] = (fn, _params_of(fn))
        return hit

    def _fn(self, name: str):
        return self._entry(name)[0]

    def _params(self, name: str) -> Optional[frozenset]:
        return self._entry(name)[1]

    def _call(self, call: M.AiterCall):
        return self._entry(call.fn)[0](*call.args, **call.kwargs)

    def _fallback(self, why: str):
        """The best non-aiter kernel of this op serving the bound request (bound once), for
        the steps aiter's functions cannot serve."""
        nxt = getattr(self, "_next", None)
        if nxt is None:
            from ..plugins import kernel_registry

            for impl in kernel_registry().implementations(self.op):
                if impl.name != "aiter" and impl.capabilities.reject_reason(self.request) is None:
                    log.debug("%s: %s; using %s", self.op, why, impl.name)
                    nxt = self._next = impl.bind(self.request)
                    break
            else:
                raise ValueError(f"aiter cannot serve this {self.op} step ({why}) and no other "
                                 f"{self.op} kernel is registered for it; pick another backend.")
        return nxt

    def _token_indices(self, md, block_table, seqused_k, out):
        """``(kv_indptr, kv_indices, last_page_lens)`` of the step (1-token pages)."""
        bs, width = block_table.shape
        ps = md.pages.page_size
        dev = block_table.device
        max_bs = _max_bs(out, md)
        indptr = _static(out, self._tag + "kv_indptr", (bs + 1,), torch.int32, dev, max_bs + 1)
        indices = _static(out, self._tag + "kv_indices", (bs * width * ps,), torch.int32, dev,
                          max_bs * width * ps)
        ones = _static(out, self._tag + "last_page_lens", (bs,), torch.int32, dev, max_bs)
        ones.fill_(1)  # block size 1: every last page holds one token
        kv_indptr, kv_indices = M.token_kv_indices(block_table, seqused_k, ps,
                                                   kv_indptr=indptr, kv_indices=indices)
        return kv_indptr, kv_indices, ones

    def _index_spec(self, limits, page_size: int) -> dict:
        pages = -(-limits.max_seq_len // page_size)
        return {self._tag + "kv_indptr": ((limits.max_bs + 1,), torch.int32),
                self._tag + "kv_indices": ((limits.max_bs * pages * page_size,), torch.int32),
                self._tag + "last_page_lens": ((limits.max_bs,), torch.int32)}


def _unit(device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------
# paged_attention


@attrs.frozen(kw_only=True)
class AiterPlan(KernelPlan):
    """One step of :class:`AiterPagedAttention` for one layer group.

    Attributes:
        route: the aiter function serving the step (:func:`aiter_marshal.route_paged_attention`).
        args: ``(cu_seqlens_q, seqused_k, block_table)``.
        kv: ``(kv_indptr, kv_indices, last_page_lens)`` (ragged and prefill routes).
        workspace: ``paged_attention_ragged``'s uint8 workspace.
        max_q / max_k / partitions: host integers of the call.
        unit: float32 ``[1]`` of 1.0 (the ragged kernel's scales on 16-bit caches).
    """

    route: str
    args: tuple = attrs.field(**_T)
    kv: Optional[tuple] = attrs.field(default=None, **_T)
    workspace: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    unit: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    max_q: int
    max_k: int
    partitions: int = 0


class AiterPagedAttention(_AiterKernel, AttentionKernel):
    """``paged_attention`` on aiter: ``paged_attention_ragged`` (decode),
    ``mha_batch_prefill_func`` (prefill/extend), ``unified_attention`` (windows, sinks, fp8
    extend on releases without ``k_descale``); the route is chosen in ``plan``."""

    op = "paged_attention"
    FUNCTIONS = ("paged_attention_ragged", "mha_batch_prefill_func", "unified_attention")

    def __init__(self, request=None):
        super().__init__(request)
        if request is not None:
            self._bind(request)

    def _bind(self, request):
        self._resolve()
        f = request.features
        self.causal = "non_causal" not in f
        self.has_sinks = "sinks" in f
        self.has_window = "window" in f
        self.fp8 = request.kv_dtype in FP8_DTYPES
        extra = dict(request.extra)
        self.q_heads = extra.get("q_heads")
        self.kv_heads = extra.get("kv_heads")
        self.head_dim = request.head_dim
        self.v_head_dim = request.v_head_dim or request.head_dim
        self._unit = None

    def __call__(self, q, k_cache, v_cache, out, **kwargs):
        if kwargs.get("custom_mask") is not None:
            raise ValueError("the aiter backend takes no custom_mask (tree verify); its "
                             "capabilities exclude it, so pick another backend for this call.")
        if self.request is None:  # the functional convenience: bind to these tensors
            from ..ops import paged_attention_request

            req = paged_attention_request(
                q, k_cache, v_cache, window_size=tuple(kwargs.get("window_size", (-1, -1))),
                softcap=kwargs.get("softcap", 0.0), sinks=kwargs.get("sinks"),
                causal=kwargs.get("causal", True))
            return type(self)(req)(q, k_cache, v_cache, out, **kwargs)
        return super().__call__(q, k_cache, v_cache, out, **kwargs)

    def buffer_spec(self, limits):
        """Token indices and the ragged workspace for ``limits`` (static under graphs)."""
        from ..strategies.base import BufferSpec

        req = self.request
        if req is None:
            return BufferSpec({})
        spec = self._index_spec(limits, req.page_size)
        pages = -(-limits.max_seq_len // req.page_size)
        nbytes = M.ragged_workspace_bytes(limits.max_bs, self.q_heads, self.v_head_dim,
                                          pages * req.page_size)
        spec[self._tag + "workspace"] = ((nbytes,), torch.uint8)
        return BufferSpec(spec)

    def plan(self, md, out: Optional[dict] = None) -> AiterPlan:
        """Route on the step's ``max_seqlen_q``; token indices and workspace (no sync with
        the strategies' host hints)."""
        if md.mask is not None:
            raise ValueError("the aiter backend takes no custom_mask (tree verify); its "
                             "capabilities exclude it, so pick another backend.")
        query, pages = md.query, md.pages
        cu, seqused_k, block_table = map(unit_stride, (query.cu_seqlens_q, pages.seqused_k,
                                                       pages.block_table))
        hint_q, hint_k = plan_hints(md)
        max_q = _max_q(cu, hint_q)
        bs, width = block_table.shape
        max_ctx = width * pages.page_size
        max_k = int(hint_k) if hint_k is not None else max_ctx
        ragged_reason = None
        if max_q <= 1:
            ragged_reason = M.ragged_decode_reason(
                num_tokens=query.num_tokens, batch=bs, q_heads=self.q_heads,
                kv_heads=self.kv_heads, head_dim=self.head_dim, v_head_dim=self.v_head_dim)
        route = M.route_paged_attention(
            max_q, causal=self.causal, has_sinks=self.has_sinks, has_window=self.has_window,
            is_fp8=self.fp8, prefill_params=self._params("mha_batch_prefill_func"),
            ragged_reason=ragged_reason)
        common = dict(num_tokens=query.num_tokens, mask_literal=mask_literal(md), route=route,
                      args=(cu, seqused_k, block_table), max_q=max_q, max_k=max_k)
        if route == "unified_attention":
            return AiterPlan(**common)
        kv = self._token_indices(md, block_table, seqused_k, out)
        if route == "mha_batch_prefill_func":
            return AiterPlan(kv=kv, **common)
        if self._unit is None:
            self._unit = _unit(cu.device)
        nbytes = M.ragged_workspace_bytes(bs, self.q_heads, self.v_head_dim, max_ctx)
        cap = None
        if out is not None and out.get(self._tag + "workspace") is None:
            cap = M.ragged_workspace_bytes(_max_bs(out, md), self.q_heads, self.v_head_dim,
                                           max_ctx)
        ws = _static(out, self._tag + "workspace", (nbytes,), torch.uint8, cu.device, cap)
        return AiterPlan(kv=kv, workspace=ws, unit=self._unit,
                         partitions=M.max_num_partitions(max_ctx), **common)

    def run(self, q, cache, plan: AiterPlan, params, out, lse=None):
        """The planned route's aiter call; allocates nothing (a prefill release that returns
        a new tensor is copied into ``out``)."""
        if q.shape[0] != plan.num_tokens:
            raise token_count_error(self.name, q.shape[0], plan)
        k_cache, v_cache = cache
        cu, seqused_k, block_table = plan.args
        ks = params.k_scale_t if params.has_scales else None
        vs = params.v_scale_t if params.has_scales else None
        route = plan.route
        if route == "unified_attention":
            self._call(M.build_unified_attention_call(
                q, k_cache, v_cache, out, cu_seqlens_q=cu, seqused_k=seqused_k,
                block_table=block_table, max_seqlen_q=plan.max_q, softmax_scale=params.scale,
                window_size=params.window, softcap=params.softcap, sinks=params.sinks,
                k_scale=ks, v_scale=vs))
            return out
        kv_indptr, kv_indices, ones = plan.kv
        if route == "paged_attention_ragged":
            self._call(M.build_paged_attention_ragged_call(
                out, plan.workspace, q, k_cache, v_cache, softmax_scale=params.scale,
                kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_lens=ones,
                max_num_partitions=plan.partitions, softcap=params.softcap,
                k_scale=plan.unit if ks is None else ks,  # 1.0 unless the cache is fp8
                v_scale=plan.unit if vs is None else vs))
            return out
        res = self._call(M.build_mha_batch_prefill_call(
            q, k_cache, v_cache, cu_seqlens_q=cu, kv_indptr=kv_indptr, kv_indices=kv_indices,
            max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k, softmax_scale=params.scale,
            causal=params.causal and not plan.mask_literal, softcap=params.softcap, out=out,
            k_scale=ks, v_scale=vs, params=self._params("mha_batch_prefill_func")))
        if isinstance(res, torch.Tensor) and res.data_ptr() != out.data_ptr():
            out.copy_(res)
        return out


# --------------------------------------------------------------------------------------------
# mla_paged_attention


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


# --------------------------------------------------------------------------------------------
# varlen_attention (a plain function: not an attention op of the kernel-object machinery)


def aiter_varlen_attention(q, k, v, out, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal=True, window_size=(-1, -1),
                           softcap=0.0):
    """Dense ragged attention (no cache): ``flash_attn_varlen_func``."""
    res = _call(M.build_flash_attn_varlen_call(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, out=out))
    if isinstance(res, torch.Tensor) and res.data_ptr() != out.data_ptr():
        out.copy_(res)
    return out


# --------------------------------------------------------------------------------------------
# paged_attention_5d


@attrs.frozen(kw_only=True)
class Aiter5DPlan(KernelPlan):
    """One step of :class:`AiterPagedAttention5D`: ``pa_decode_gluon``'s arguments, or the
    plan of the next registered kernel (``fallback``) for steps gluon cannot serve."""

    args: tuple = attrs.field(**_T)
    max_q: int
    max_ctx: int
    fallback: Optional[object] = attrs.field(default=None, **_T)
    inner: Optional[KernelPlan] = None


class AiterPagedAttention5D(_AiterKernel, AttentionKernel):
    """``paged_attention_5d`` with ``pa_decode_gluon``: decode/verify with a uniform query
    length ≤ 4 per request, causal. Other steps (longer or ragged queries) are planned and
    run by the next registered ``paged_attention_5d`` kernel, chosen once per binding;
    windows, soft-cap and custom masks are excluded by the capabilities."""

    op = "paged_attention_5d"
    FUNCTIONS = ("pa_decode_gluon",)

    def __init__(self, request=None):
        super().__init__(request)
        if request is not None:
            self._resolve()
            self._next = None

    def __call__(self, q, k_cache, v_cache, out, **kwargs):
        if self.request is None:
            from ..strategies.vec5d import paged_attention_5d_request

            req = paged_attention_5d_request(
                q, k_cache, v_cache, window_size=tuple(kwargs.get("window_size", (-1, -1))),
                softcap=kwargs.get("softcap", 0.0), sinks=kwargs.get("sinks"),
                causal=kwargs.get("causal", True), custom_mask=kwargs.get("custom_mask"))
            return type(self)(req)(q, k_cache, v_cache, out, **kwargs)
        return super().__call__(q, k_cache, v_cache, out, **kwargs)

    def buffer_spec(self, limits):
        from ..strategies.base import BufferSpec

        return BufferSpec({})

    def plan(self, md, out: Optional[dict] = None) -> Aiter5DPlan:
        query, pages = md.query, md.pages
        cu, seqused_k, block_table = map(unit_stride, (query.cu_seqlens_q, pages.seqused_k,
                                                       pages.block_table))
        bs = block_table.shape[0]
        max_q = _max_q(cu, plan_hints(md)[0])
        causal = "non_causal" not in self.request.features and md.mask is None
        common = dict(num_tokens=query.num_tokens, mask_literal=mask_literal(md),
                      args=(seqused_k, block_table), max_q=max_q,
                      max_ctx=block_table.shape[1] * pages.page_size)
        if not 1 <= max_q <= 4 or query.num_tokens != bs * max_q or not causal:
            nxt = self._fallback(f"{query.num_tokens} query tokens for {bs} requests, max "
                                 f"{max_q}")
            return Aiter5DPlan(fallback=nxt, inner=nxt.plan(md, out), **common)
        return Aiter5DPlan(**common)

    def run(self, q, cache, plan: Aiter5DPlan, params, out, lse=None):
        if plan.fallback is not None:
            return plan.fallback.run(q, cache, plan.inner, params, out, lse=lse)
        if q.shape[0] != plan.num_tokens:
            raise token_count_error(self.name, q.shape[0], plan)
        k_cache, v_cache = cache
        seqused_k, block_table = plan.args
        self._call(M.build_pa_decode_gluon_call(
            out, q, k_cache, v_cache, seqused_k=seqused_k, block_table=block_table,
            softmax_scale=params.scale, query_length=plan.max_q, max_context_len=plan.max_ctx,
            compute_type=out.dtype,
            k_scale=params.k_scale_t if params.has_scales else None,
            v_scale=params.v_scale_t if params.has_scales else None, sinks=params.sinks))
        return out


# --------------------------------------------------------------------------------------------
# the functional conveniences (the op's keyword convention; one binding per call)


def aiter_paged_attention(q, k_cache, v_cache, out, **kwargs):
    """``ops.paged_attention`` on aiter in one call (:class:`AiterPagedAttention`)."""
    return AiterPagedAttention()(q, k_cache, v_cache, out, **kwargs)


def aiter_mla_paged_attention(q, kv_cache, out, **kwargs):
    """``ops.mla_paged_attention`` on aiter in one call (:class:`AiterMLA`)."""
    return AiterMLA()(q, kv_cache, out, **kwargs)


def aiter_paged_attention_5d(q, k_cache, v_cache, out, **kwargs):
    """``paged_attention_5d`` on aiter in one call (:class:`AiterPagedAttention5D`)."""
    return AiterPagedAttention5D()(q, k_cache, v_cache, out, **kwargs)


def _prefill_takes_descale() -> bool:
    """Whether the installed ``mha_batch_prefill_func`` takes ``k_descale`` (fp8 caches)."""
    try:
        params = accepted_params("mha_batch_prefill_func")
    except ImportError:
        return False
    return params is not None and "k_descale" in params


def _paged_predicate(req) -> Optional[str]:
    if "non_causal" in req.features and req.features & {"sinks", "window"}:
        return "aiter serves sinks/windows only causally (unified_attention)"
    if {"non_causal", "fp8"} <= req.features and not _prefill_takes_descale():
        # extend steps would need mha_batch_prefill_func (fp8: k_descale) or
        # unified_attention (causal only)
        return ("non-causal attention over an fp8 cache: this aiter release's "
                "mha_batch_prefill_func takes no k_descale and unified_attention is causal "
                "only; use a 16-bit cache or another backend for this layer")
    # sinks and windows always run on unified_attention; fp8 extend steps too where the
    # release's mha_batch_prefill_func takes no k_descale
    unified = bool(req.features & {"sinks", "window"}) or (
        "fp8" in req.features and not _prefill_takes_descale())
    why = M.unified_page_size_reason(req.page_size) if unified else None
    if why is not None:
        return why
    for name, dim in (("head_dim", req.head_dim), ("v_head_dim", req.v_head_dim)):
        # mha_batch_prefill_func pads other sizes internally, which breaks a caller's out=
        if dim is not None and dim % 8:
            return f"{name} {dim} is not a multiple of 8"
    return None


def _mla_shape(req) -> Optional[str]:
    # aiter's MLA kernels are built for DeepSeek's latent shape: kv_lora 512 + rope 64.
    if (req.head_dim, req.v_head_dim) not in ((576, 512), (576, None), (None, None)):
        return (f"head_dim {req.head_dim} / v_head_dim {req.v_head_dim}: aiter MLA serves "
                "576 (kv_lora_rank 512 + rope 64) / 512 only")
    heads = dict(req.extra).get("heads")
    if heads is None:
        return None
    try:
        M.mla_head_padding(heads)
    except ValueError as exc:
        return str(exc)
    return None


def _checks(*checks):
    """One predicate: the first reason of ``checks`` (each ``request -> reason or None``)."""
    def predicate(req) -> Optional[str]:
        for check in checks:
            reason = check(req)
            if reason is not None:
                return reason
        return None
    return predicate


def capabilities() -> dict:
    """The capabilities each registered aiter kernel declares (op → Capabilities). The fp8
    cache format they accept is the running device's native one, decided here, once
    (:func:`native_fp8`)."""
    fp8 = {d for d in (getattr(torch, "float8_e4m3fn", None),
                       getattr(torch, "float8_e4m3fnuz", None)) if d is not None}
    act = {torch.float16, torch.bfloat16}
    native, device = native_fp8()

    def fp8_format(req) -> Optional[str]:
        return M.fp8_format_reason(req.kv_dtype, native, device)

    return {
        "paged_attention": Capabilities(
            devices={"cuda"}, dtypes=act, kv_dtypes=act | fp8, max_head_dim=256,
            features={"sinks", "softcap", "window", "fp8", "non_causal"},
            cg_support=CGSupport.UNIFORM_BATCH, predicate=_checks(fp8_format, _paged_predicate)),
        # asm_mla.cu has kernels for bf16 (and fp8) queries and caches only; the layer's
        # queries go in as they are
        "mla_paged_attention": Capabilities(
            devices={"cuda"}, dtypes={torch.bfloat16}, kv_dtypes={torch.bfloat16} | fp8,
            features={"fp8"},
            cg_support=CGSupport.UNIFORM_BATCH, predicate=_checks(fp8_format, _mla_shape)),
        # dense ragged prefill: not used in captured steps, never verified under capture
        "varlen_attention": Capabilities(
            devices={"cuda"}, dtypes=act, max_head_dim=256,
            features={"window", "softcap", "non_causal", "v_head_dim_differs"},
            cg_support=CGSupport.NEVER),
        # pa_decode_gluon: block sizes 16/64/1024; its sliding-window masking was not
        # verified against our convention, so windows go to another kernel.
        "paged_attention_5d": Capabilities(
            devices={"cuda"}, dtypes=act, kv_dtypes=act | fp8, page_sizes={16, 64, 1024},
            features={"sinks", "fp8"}, cg_support=CGSupport.UNIFORM_BATCH,
            predicate=fp8_format),
    }


_KERNELS = {
    "paged_attention": (AiterPagedAttention, AiterPagedAttention.FUNCTIONS),
    "mla_paged_attention": (AiterMLA, AiterMLA.FUNCTIONS),
    "varlen_attention": (aiter_varlen_attention, ("flash_attn_varlen_func",)),
    "paged_attention_5d": (AiterPagedAttention5D, AiterPagedAttention5D.FUNCTIONS),
}

#: above the portable Triton kernels (100) on ROCm.
PRIORITY = 150


@hookimpl
def aiter_attn_register_kernels(register):
    """Register the aiter kernels where aiter runs (ROCm); elsewhere register nothing."""
    ok, why = availability()
    if not ok:
        log.debug("aiter kernels not registered: %s", why)
        return
    caps = capabilities()
    for op, (fn, needs) in _KERNELS.items():
        try:
            for name in needs:
                resolve(name)
        except ImportError as exc:
            log.info("aiter kernel for %s not registered: %s", op, exc)
            continue
        register(op, "aiter", fn, caps[op], priority=PRIORITY)
