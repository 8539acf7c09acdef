"""The AMD vendor plugin: our ops on top of ``aiter``'s kernels (ROCm only).

It registers kernels only where ``import aiter`` works *and* torch is a ROCm build with a
device (``torch.version.hip``); elsewhere its hook registers nothing and says why at debug
level. The kernels were written against the ``amd-aiter`` wheel's signatures (checked on the
CPU by ``tests/test_aiter_contract.py``) and have not been run on an AMD GPU here.

======================  ==========================================================
our op                  aiter function
======================  ==========================================================
paged_attention         ``paged_attention_ragged`` (decode; fp8 as ``"fp8_e4m3"``),
                        ``mha_batch_prefill_func`` (prefill/extend),
                        ``unified_attention`` (sliding windows, sinks, verify, fp8)
mla_paged_attention     ``mla_decode_fwd`` (+ ``get_mla_metadata_info_v1`` /
                        ``get_mla_metadata_v1`` persistent work metadata; 4/8 heads
                        padded to 16), ``mla_prefill_fwd`` (extend)
varlen_attention        ``flash_attn_varlen_func`` (dense ragged q/k/v, MLA extend
                        without prefix)
paged_attention_5d      ``pa_decode_gluon`` (5-D shuffled layout, ≤ 4 query tokens per
                        request; newer releases only)
======================  ==========================================================

All argument marshalling is in :mod:`aiter_attn.kernels.aiter_marshal`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
from typing import Optional

import torch

from ..hookspecs import hookimpl
from ..types import CGSupport, kv_dequant_scales
from ..validation import check_scale, unit_stride
from . import aiter_marshal as M
from .registry import Capabilities

__all__ = [
    "AITER_FUNCTIONS",
    "OPTIONAL_FUNCTIONS",
    "availability",
    "resolve",
    "accepted_params",
    "reset_api",
    "reserve_mla_workspace",
    "mla_buffer_spec",
    "use_mla_workspace",
    "MLA_BUFFER_PREFIX",
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

_lock = threading.Lock()
_api: dict = {}


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


def resolve(name: str):
    """The aiter function ``name`` (imported on first use; raises ``ImportError`` if absent)."""
    with _lock:
        if name in _api:
            return _api[name]
        errors = []
        for module in AITER_FUNCTIONS[name]:
            try:
                fn = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as exc:
                errors.append(f"{module}: {exc}")
                continue
            _api[name] = fn
            return fn
        raise ImportError(f"aiter has no {name} ({'; '.join(errors)}); upgrade amd-aiter.")


@functools.lru_cache(maxsize=None)
def _params_of(fn) -> Optional[frozenset]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a compiled wrapper without a signature
        return None


def accepted_params(name: str) -> Optional[frozenset]:
    """Parameter names of the installed aiter function (``None`` if it cannot be inspected)."""
    return _params_of(resolve(name))


def reset_api() -> None:
    """Forget resolved functions and workspaces (tests inject a fake ``aiter``)."""
    with _lock:
        _api.clear()
        _workspaces.clear()
        _retired.clear()
    _params_of.cache_clear()


def _call(call: M.AiterCall):
    return resolve(call.fn)(*call.args, **call.kwargs)


# --------------------------------------------------------------------------------------------
# workspaces: grown on demand in eager mode; reserve them before graph capture. A workspace
# that is outgrown is kept alive (``_retired``), never freed: a graph captured with it keeps
# reading valid memory at its captured address whatever eager batches run in between.

_workspaces: dict = {}
_retired: list = []


def _workspace(key, nbytes: int, device) -> torch.Tensor:
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < nbytes:
        if buf is not None:
            _retired.append(buf)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _workspaces[key] = buf
    return buf


#: prefix of the persistent-MLA buffers in a graph manager's BufferSpec.
MLA_BUFFER_PREFIX = "aiter_mla_"


def _mla_key(device, plan, max_seqlen_q, q_dtype, kv_dtype):
    return ("mla", str(torch.device(device)), plan.padded_heads, int(max_seqlen_q), q_dtype,
            kv_dtype)


def mla_buffer_spec(max_batch: int, max_seqlen_q: int, num_heads: int, q_dtype, kv_dtype, *,
                    cu_num: Optional[int] = None):
    """The persistent-MLA work metadata as a graph manager's
    :class:`~aiter_attn.strategies.base.BufferSpec` (names prefixed ``aiter_mla_``), sized for
    ``max_batch`` requests of ``max_seqlen_q`` query tokens. Empty when the layer does not use
    the persistent kernel. Where aiter runs, its ``get_mla_metadata_info_v1`` gives the sizes;
    elsewhere (planning on the CPU) ``cu_num`` compute units and the 0.1.7 formula do."""
    from ..strategies.base import BufferSpec

    plan = M.mla_decode_plan(num_heads, kv_dtype, max_seqlen_q)
    if not plan.persistent:
        return BufferSpec({})
    info = None
    if cu_num is None:
        info = _call(M.build_mla_metadata_info_call(
            max_batch, max_seqlen_q, plan, q_dtype, kv_dtype,
            params=accepted_params("get_mla_metadata_info_v1")))
    specs = M.mla_work_buffer_spec(max_batch, max_seqlen_q, plan.padded_heads, kv_dtype,
                                   cu_num=cu_num or 1, fast_mode=plan.fast_mode, info=info)
    return BufferSpec({MLA_BUFFER_PREFIX + s.name: (s.shape, s.dtype) for s in specs})


def use_mla_workspace(buffers, max_batch: int, max_seqlen_q: int, num_heads: int, q_dtype,
                      kv_dtype, device) -> dict:
    """Make MLA layers of this shape plan their work metadata into ``buffers`` (allocated by a
    graph manager from :func:`mla_buffer_spec`) for batches of up to ``max_batch``."""
    plan = M.mla_decode_plan(num_heads, kv_dtype, max_seqlen_q)
    names = ("work_metadata", "work_indptr", "work_info_set", "reduce_indptr",
             "reduce_final_map", "reduce_partial_map")
    missing = [MLA_BUFFER_PREFIX + n for n in names if MLA_BUFFER_PREFIX + n not in buffers]
    if missing:
        raise ValueError(f"buffers lack {missing}; allocate them from mla_buffer_spec(...).")
    bufs = {n: buffers[MLA_BUFFER_PREFIX + n] for n in names}
    bufs["_max_batch"] = int(max_batch)
    key = _mla_key(device, plan, max_seqlen_q, q_dtype, kv_dtype)
    with _lock:
        if key in _workspaces:
            _retired.append(_workspaces[key])  # a captured graph may still read them
        _workspaces[key] = bufs
    return bufs


def reserve_mla_workspace(max_batch: int, max_seqlen_q: int, num_heads: int, q_dtype,
                          kv_dtype, device) -> dict:
    """The persistent-MLA work metadata for up to ``max_batch`` requests: the buffers given to
    :func:`use_mla_workspace` if they are large enough, else allocated here (once per shape;
    call it before graph capture to keep allocation out of the captured region)."""
    plan = M.mla_decode_plan(num_heads, kv_dtype, max_seqlen_q)
    key = _mla_key(device, plan, max_seqlen_q, q_dtype, kv_dtype)
    bufs = _workspaces.get(key)
    if bufs is not None and bufs["_max_batch"] >= max_batch:
        return bufs
    spec = mla_buffer_spec(max_batch, max_seqlen_q, num_heads, q_dtype, kv_dtype)
    return use_mla_workspace(spec.allocate(device), max_batch, max_seqlen_q, num_heads, q_dtype,
                             kv_dtype, device)


def _max_q(cu_seqlens_q: torch.Tensor, max_seqlen_q: Optional[int]) -> int:
    if max_seqlen_q is not None:
        return int(max_seqlen_q)
    # Eager fallback: strategies pass max_seqlen_q from host mirrors; this path syncs.
    return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0


def _scale_tensor(scale, device) -> torch.Tensor:
    check_scale("scale", scale)  # one number: a per-head tensor is refused, never truncated
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.tensor([1.0 if scale is None else float(scale)], dtype=torch.float32,
                        device=device)


# --------------------------------------------------------------------------------------------
# kernels (the calling conventions of aiter_attn.kernels.reference)


def aiter_paged_attention(q, k_cache, v_cache, out, *, cu_seqlens_q, seqused_k, block_table,
                          softmax_scale, causal=True, window_size=(-1, -1), softcap=0.0,
                          sinks=None, k_scale=None, v_scale=None, custom_mask=None,
                          mask_indptr=None, max_seqlen_q=None, max_seqlen_k=None):
    """``ops.paged_attention`` on aiter; routing in :func:`aiter_marshal.route_paged_attention`."""
    if custom_mask is not None:
        raise ValueError("the aiter backend takes no custom_mask (tree verify); its capabilities "
                         "exclude it, so pick another backend for this call.")
    cu_seqlens_q, seqused_k, block_table = map(unit_stride,
                                               (cu_seqlens_q, seqused_k, block_table))
    fp8 = k_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32)
    max_q = _max_q(cu_seqlens_q, max_seqlen_q)
    route = M.route_paged_attention(
        max_q, causal=causal, has_sinks=sinks is not None, window=window_size, is_fp8=fp8,
        prefill_params=accepted_params("mha_batch_prefill_func"))
    k_scale, v_scale = kv_dequant_scales(k_cache.dtype, k_scale, v_scale)  # fp8 only
    ks = _scale_tensor(k_scale, q.device) if fp8 else None
    vs = _scale_tensor(v_scale, q.device) if fp8 else None
    if route == "unified_attention":
        _call(M.build_unified_attention_call(
            q, k_cache, v_cache, out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
            block_table=block_table, max_seqlen_q=max_q, softmax_scale=softmax_scale,
            window_size=window_size, softcap=softcap, sinks=sinks, k_scale=ks, v_scale=vs))
        return out
    page_size = k_cache.shape[1]
    kv_indptr, kv_indices = M.token_kv_indices(block_table, seqused_k, page_size)
    if route == "paged_attention_ragged":
        bs, width = block_table.shape
        max_ctx = width * page_size
        nbytes = M.ragged_workspace_bytes(bs, q.shape[1], v_cache.shape[3], max_ctx)
        ones = torch.ones(bs, dtype=torch.int32, device=q.device)
        _call(M.build_paged_attention_ragged_call(
            out, _workspace(("ragged", str(q.device)), nbytes, q.device), q, k_cache, v_cache,
            softmax_scale=softmax_scale, kv_indptr=kv_indptr, kv_indices=kv_indices,
            kv_last_page_lens=ones, max_num_partitions=M.max_num_partitions(max_ctx),
            softcap=softcap, k_scale=_scale_tensor(k_scale, q.device),
            v_scale=_scale_tensor(v_scale, q.device)))  # 1.0 unless the cache is fp8
        return out
    max_k = max_seqlen_k if max_seqlen_k is not None else block_table.shape[1] * page_size
    res = _call(M.build_mha_batch_prefill_call(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, kv_indptr=kv_indptr,
        kv_indices=kv_indices, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=softmax_scale, causal=causal, softcap=softcap, out=out,
        k_scale=ks, v_scale=vs, params=accepted_params("mha_batch_prefill_func")))
    if isinstance(res, torch.Tensor) and res.data_ptr() != out.data_ptr():
        out.copy_(res)
    return out


def aiter_mla_paged_attention(q, kv_cache, out, *, kv_lora_rank, cu_seqlens_q, seqused_k,
                              block_table, softmax_scale, causal=True, kv_scale=None,
                              custom_mask=None, mask_indptr=None, max_seqlen_q=None,
                              max_seqlen_k=None):
    """``ops.mla_paged_attention`` on aiter: ``mla_decode_fwd`` for decode-like batches (uniform
    query length ≤ 4 given by ``max_seqlen_q``), ``mla_prefill_fwd`` otherwise."""
    if custom_mask is not None or not causal:
        raise ValueError("the aiter MLA backend serves causal attention without custom masks.")
    cu_seqlens_q, seqused_k, block_table = map(unit_stride,
                                               (cu_seqlens_q, seqused_k, block_table))
    bs = block_table.shape[0]
    page_size = kv_cache.shape[1]
    max_q = _max_q(cu_seqlens_q, max_seqlen_q)
    kv_indptr, kv_indices = M.token_kv_indices(block_table, seqused_k, page_size)
    ones = torch.ones(bs, dtype=torch.int32, device=q.device)
    fp8 = kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32)
    kv_scale, _ = kv_dequant_scales(kv_cache.dtype, kv_scale, kv_scale)  # fp8 only
    if max_q > 4:
        # mla_prefill_fwd takes no descale: fold it (keys: into the softmax scale; values:
        # into the output). Extend is never captured, so reading a tensor scale here is allowed.
        ks = 1.0 if kv_scale is None else float(kv_scale)
        _call(M.build_mla_prefill_call(
            q, kv_cache, out, qo_indptr=cu_seqlens_q, kv_indptr=kv_indptr, kv_indices=kv_indices,
            last_page_lens=ones, max_seqlen_q=max_q, softmax_scale=softmax_scale * ks))
        if ks != 1.0:
            out.mul_(ks)
        return out
    plan = M.mla_decode_plan(q.shape[1], kv_cache.dtype, max_q)
    bufs = None
    if plan.persistent:
        bufs = reserve_mla_workspace(bs, max_q, q.shape[1], q.dtype, kv_cache.dtype, q.device)
        _call(M.build_mla_metadata_call(
            cu_seqlens_q, kv_indptr, ones, bufs, plan, max_seqlen_qo=max_q, q_dtype=q.dtype,
            kv_dtype=kv_cache.dtype, params=accepted_params("get_mla_metadata_v1")))
    q_in = M.pad_heads(q, plan.repeat)
    o = out if plan.repeat == 1 else out.new_empty(q.shape[0], plan.padded_heads, out.shape[2])
    scale = _scale_tensor(kv_scale, q.device) if fp8 else None
    _call(M.build_mla_decode_call(
        q_in, kv_cache, o, qo_indptr=cu_seqlens_q, kv_indptr=kv_indptr, kv_indices=kv_indices,
        last_page_lens=ones, max_seqlen_q=max_q, softmax_scale=softmax_scale, plan=plan,
        buffers=bufs, q_scale=scale, kv_scale=scale,
        params=accepted_params("mla_decode_fwd")))
    if plan.repeat != 1:
        out.copy_(M.unpad_heads(o, plan.repeat))
    return out


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


def _fallback_5d(q, k_cache, v_cache, out, why: str, **kwargs):
    """Run the best non-aiter ``paged_attention_5d`` implementation that serves this call."""
    from ..plugins import kernel_registry
    from .registry import KernelRequest

    features = {f for f, on in (("sinks", kwargs.get("sinks") is not None),
                                ("fp8", k_cache.dtype not in (torch.float16, torch.bfloat16)))
                if on}
    req = KernelRequest(op="paged_attention_5d", device=q.device.type, dtype=q.dtype,
                        kv_dtype=k_cache.dtype, head_dim=q.shape[-1], v_head_dim=out.shape[-1],
                        page_size=k_cache.shape[3], features=features)
    for impl in kernel_registry().implementations("paged_attention_5d"):
        if impl.name != "aiter" and impl.capabilities.reject_reason(req) is None:
            log.debug("paged_attention_5d: %s; using %s", why, impl.name)
            return impl.fn(q, k_cache, v_cache, out, **kwargs)
    raise ValueError(f"aiter's pa_decode_gluon cannot serve this call ({why}) and no other "
                     "paged_attention_5d kernel is registered; pick another backend.")


def aiter_paged_attention_5d(q, k_cache, v_cache, out, *, cu_seqlens_q, seqused_k, block_table,
                             softmax_scale, causal=True, window_size=(-1, -1), softcap=0.0,
                             sinks=None, k_scale=None, v_scale=None, custom_mask=None,
                             mask_indptr=None, max_seqlen_q=None, max_seqlen_k=None):
    """``paged_attention_5d`` (the calling convention of ``paged_attention_5d_reference``) with
    ``pa_decode_gluon``: decode/verify with a uniform query length ≤ 4 per request. Other
    calls (longer or ragged queries) go to the next registered implementation; windows,
    soft-cap and custom masks are excluded by the capabilities."""
    cu_seqlens_q, seqused_k, block_table = map(unit_stride,
                                               (cu_seqlens_q, seqused_k, block_table))
    kwargs = dict(cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table,
                  softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                  softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                  custom_mask=custom_mask, mask_indptr=mask_indptr, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k)
    bs = block_table.shape[0]
    max_q = _max_q(cu_seqlens_q, max_seqlen_q)
    if not 1 <= max_q <= 4 or q.shape[0] != bs * max_q or not causal:
        return _fallback_5d(q, k_cache, v_cache, out,
                            f"{q.shape[0]} query tokens for {bs} requests, max {max_q}", **kwargs)
    fp8 = k_cache.dtype not in (torch.float16, torch.bfloat16)
    k_scale, v_scale = kv_dequant_scales(k_cache.dtype, k_scale, v_scale)  # fp8 only
    _call(M.build_pa_decode_gluon_call(
        out, q, k_cache, v_cache, seqused_k=seqused_k, block_table=block_table,
        softmax_scale=softmax_scale, query_length=max_q,
        max_context_len=block_table.shape[1] * k_cache.shape[3], compute_type=out.dtype,
        k_scale=_scale_tensor(k_scale, q.device) if fp8 else None,
        v_scale=_scale_tensor(v_scale, q.device) if fp8 else None, sinks=sinks))
    return out


def _paged_predicate(req) -> Optional[str]:
    if "non_causal" in req.features and req.features & {"sinks", "window"}:
        return "aiter serves sinks/windows only causally (unified_attention)"
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


def capabilities() -> dict:
    """The capabilities each registered aiter kernel declares (op → Capabilities)."""
    fp8 = {d for d in (getattr(torch, "float8_e4m3fn", None),
                       getattr(torch, "float8_e4m3fnuz", None)) if d is not None}
    act = {torch.float16, torch.bfloat16}
    return {
        "paged_attention": Capabilities(
            devices={"cuda"}, dtypes=act, kv_dtypes=act | fp8, max_head_dim=256,
            features={"sinks", "softcap", "window", "fp8", "non_causal"},
            cg_support=CGSupport.UNIFORM_BATCH, predicate=_paged_predicate),
        "mla_paged_attention": Capabilities(
            devices={"cuda"}, dtypes=act, kv_dtypes=act | fp8, features={"fp8"},
            cg_support=CGSupport.UNIFORM_BATCH, predicate=_mla_shape),
        # dense ragged prefill: not used in captured steps, never verified under capture
        "varlen_attention": Capabilities(
            devices={"cuda"}, dtypes=act, max_head_dim=256,
            features={"window", "softcap", "non_causal", "v_head_dim_differs"},
            cg_support=CGSupport.NEVER),
        # pa_decode_gluon: block sizes 16/64/1024; its sliding-window masking was not
        # verified against our convention, so windows go to another kernel.
        "paged_attention_5d": Capabilities(
            devices={"cuda"}, dtypes=act, kv_dtypes=act | fp8, page_sizes={16, 64, 1024},
            features={"sinks", "fp8"}, cg_support=CGSupport.UNIFORM_BATCH),
    }


_KERNELS = {
    "paged_attention": (aiter_paged_attention, ("paged_attention_ragged",
                                                "mha_batch_prefill_func", "unified_attention")),
    "mla_paged_attention": (aiter_mla_paged_attention,
                            ("mla_decode_fwd", "mla_prefill_fwd", "get_mla_metadata_info_v1",
                             "get_mla_metadata_v1")),
    "varlen_attention": (aiter_varlen_attention, ("flash_attn_varlen_func",)),
    "paged_attention_5d": (aiter_paged_attention_5d, ("pa_decode_gluon",)),
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
