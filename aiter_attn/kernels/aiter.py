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
kernel object. All argument marshalling is in :mod:`aiter_attn.kernels.aiter_marshal`; the
MLA kernel object is in :mod:`.aiter_mla`, what the kernel objects share in :mod:`.aiter_common`
(both re-exported here).
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional

import attrs
import torch

from ..hookspecs import hookimpl
from ..types import FP8_DTYPES, CGSupport
from ..validation import unit_stride
from . import aiter_marshal as M
from .aiter_common import (_T, AITER_FUNCTIONS, OPTIONAL_FUNCTIONS, _AiterKernel, _call, _max_bs,
                           _max_q, _static, _unit, accepted_params, resolve)
from .aiter_mla import AiterMLA, AiterMLAPlan, mla_buffer_spec
from .base import AttentionKernel, KernelPlan, mask_literal, plan_hints, token_count_error
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
