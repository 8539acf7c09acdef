"""Input checks; each error names the argument, the value, what is allowed and the fix.

Structural checks (types, dtypes, shapes, devices, scalar arguments) cost no device sync and
run at every op. Value checks of index inputs (:func:`check_paged_index_values`,
:func:`check_slot_values`) read device tensors: the reference kernels, which sync anyway,
always run them; GPU kernels run them in the checked mode (:func:`checked_kernel`, turned on
by ``AITER_ATTN_DEBUG=1`` or ``BackendConfig(debug_checks=True)``).
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os
from typing import Callable, Iterable, Optional, Sequence

import torch

__all__ = [
    "check_tensor",
    "check_int",
    "is_int_at_least",
    "check_page_size_arg",
    "check_host_count",
    "check_pool_rows",
    "check_pool_values",
    "check_same_device",
    "check_finite",
    "check_scale",
    "check_attention_scalars",
    "check_paged_index_values",
    "check_slot_values",
    "NULL_SLOT",
    "debug_checks_enabled",
    "env_value",
    "checked_kernel",
    "CheckedKernel",
    "unit_stride",
    "require_unit_stride",
    "check_own_elements",
    "ATTN_DTYPES",
    "INDEX_DTYPES",
    "DEBUG_ENV",
]

#: Environment variable that turns the checked mode on process-wide.
DEBUG_ENV = "AITER_ATTN_DEBUG"

ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    hint: str = "",
) -> torch.Tensor:
    """Check type, dtype, rank and (``None`` = any) sizes of a tensor argument. ``shape``
    is the whole shape: it fixes the rank too (one entry per axis), ``ndim`` given or not."""
    if ndim is None and shape is not None:
        ndim = len(shape)  # a tensor with more (or fewer) axes than ``shape`` names is refused
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}. {hint}".strip())
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(
            f"{name} has dtype {t.dtype}; allowed: {_fmt_dtypes(dtypes)}. "
            f"Convert it with .to(...). {hint}".strip()
        )
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} ({t.dim()}-D); expected {ndim}-D. {hint}".strip()
        )
    if shape is not None:
        for i, want in enumerate(shape):
            if want is not None and t.shape[i] != want:
                sizes = ["*" if s is None else str(s) for s in shape]
                expect = f"({', '.join(sizes)}{',' if len(sizes) == 1 else ''})"
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; expected {expect}. {hint}".strip()
                )
    return t


def check_same_device(ref_name: str, ref: torch.Tensor, **others) -> None:
    """Every tensor in ``others`` lives on ``ref``'s device."""
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; move all inputs to "
                "one device."
            )


# --------------------------------------------------------------------------------------------
# strides of index tensors (kernels that index with unit stride)


def unit_stride(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` itself when its last axis has unit stride, else a dense copy (``None`` passes).

    The kernels index the last axis of every index input (``cu_seqlens_q``, ``seqused_k``,
    a ``block_table`` row, ``mask_indptr``, ``slots``, …) with stride 1 and take the other
    strides as arguments, so a strided view (``block_table[:, ::2]``, ``seqused_k[::2]``)
    is materialised here; a row-sliced table (``buf[:bs, :w]``) is not copied.
    """
    if t is None or t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def require_unit_stride(name: str, t: Optional[torch.Tensor]) -> None:
    """An output the kernel writes along its last axis with stride 1: refuse a strided view
    (a copy would take the writes), or one whose elements share memory (an axis of more than
    one element with stride 0, e.g. ``buf.expand(n, w)``: the kernel's programs would write
    each other's rows, the last one winning; torch refuses such in-place writes too)."""
    if t is None or t.dim() == 0:
        return
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} has strides {tuple(t.stride())}; the kernel writes it with unit stride "
            f"along its last axis. Pass a tensor contiguous in its last dim (e.g. a fresh "
            f"buffer) and copy it into the view afterwards.")
    check_own_elements(name, t)


def check_own_elements(name: str, t: Optional[torch.Tensor]) -> None:
    """An output whose elements are distinct memory: refuse an axis of more than one element
    with stride 0 (``buf.expand(n, ...)``), whose rows every program would overwrite, the
    last one winning (torch refuses such in-place writes too)."""
    if t is not None and 0 in t.stride() \
            and any(n > 1 and s == 0 for n, s in zip(t.shape, t.stride())):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} and strides {tuple(t.stride())}: several of "
            f"its elements are one memory location (an expanded view), so the kernel's writes "
            f"would overwrite each other. Pass a buffer of its own (e.g. .clone() or "
            f"torch.empty) and copy from it afterwards.")



# --------------------------------------------------------------------------------------------
# scalar arguments (cheap host checks at the op)


def is_int_at_least(value, low: int) -> bool:
    """Whether ``value`` is an integer (not a bool) ``≥ low``."""
    try:
        return not isinstance(value, bool) and operator.index(value) >= low
    except TypeError:
        return False


def check_int(value, name: str, low: int = 0, hint: str = "") -> int:
    """``value`` as an int; ValueError unless it is an integer (not a bool, not a float, even a
    whole one) ``≥ low``. ``name`` and ``hint`` make the message."""
    if not is_int_at_least(value, low):
        raise ValueError(f"{name}={value!r} must be an integer ≥ {low}{hint}.")
    return operator.index(value)


def check_finite(name: str, value, *, minimum: Optional[float] = None, hint: str = "") -> float:
    """``value`` as a float, refusing NaN/±inf (and values below ``minimum``). A Python
    number or a one-element CPU tensor: reading a device tensor would be a device sync."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{name}={value!r} must be a real number. {hint}".strip())
    if isinstance(value, torch.Tensor) and (value.device.type != "cpu" or value.numel() != 1):
        # float() of a device tensor waits for the device: the op's scalars stay on the host
        raise TypeError(f"{name} is a tensor of shape {tuple(value.shape)} on "
                        f"{value.device}; pass a Python float (e.g. {name}=float(x) once, "
                        f"outside the step). {hint}".strip())
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name}={v}; must be a finite number. {hint}".strip())
    if minimum is not None and v < minimum:
        raise ValueError(f"{name}={v}; must be ≥ {minimum}. {hint}".strip())
    return v


def check_scale(name: str, value) -> None:
    """A k/v (de)quantisation scale: ``None`` (= 1), a finite positive number, or a floating
    tensor holding exactly one element (0-d or ``[1]``; a host tensor's value is checked like a
    number's, a device tensor's is read by the kernel, no sync).

    Only per-layer (scalar) scales are served. A per-(sequence, kv-head) descale tensor, the
    ``[batch, num_kv_heads]`` that vLLM and flash-attention pass, is refused rather than
    truncated to its first element: the fp8 write, every read kernel (reference, Triton NHD
    and 5-D, MLA, aiter) and the pools all quantise with one scale per layer.
    """
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} is a tensor of shape {tuple(value.shape)} ({value.numel()} elements); "
                "only a scalar scale is supported: a number or a 0-d / 1-element tensor. "
                "Per-head or per-sequence descales are not served (using their first element "
                "would silently mis-scale the other heads): quantise the cache with one scale "
                "per layer (e.g. the max over heads) or keep it in fp16/bf16."
            )
        if not value.is_floating_point():
            raise TypeError(f"{name} has dtype {value.dtype}; a scale tensor must be floating "
                            "point. Convert it with .float().")
        if value.device.type == "cpu":  # a host value reads without a sync: check it
            v = float(value.reshape(()))
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}=tensor({v}); a quantisation scale must be a finite "
                                 "positive number.")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number, a 1-element tensor or None.")
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name}={value!r}; a quantisation scale must be a finite positive "
                         "number.")


def check_attention_scalars(softmax_scale, softcap=0.0, **scales) -> tuple[float, float]:
    """The scalar arguments of an attention op: ``softmax_scale`` finite, ``softcap`` finite
    and ≥ 0, every k/v scale in ``scales`` one number (:func:`check_scale`). Returns
    ``(softmax_scale, softcap)`` as floats. Host-only: no device sync."""
    scale = check_finite("softmax_scale", softmax_scale,
                         hint="It multiplies q·k; usually head_dim ** -0.5.")
    cap = check_finite("softcap", softcap, minimum=0.0, hint="0 disables soft-capping.")
    for name, value in scales.items():
        check_scale(name, value)
    return scale, cap


# --------------------------------------------------------------------------------------------
# value checks of index inputs (they read device values: the reference kernel always runs
# them, GPU kernels in the checked mode)


_ENV_KEYS: dict = {}


def env_value(name: str) -> Optional[str]:
    """``os.environ.get(name)``, read per call but cheaply where it is unset (the hot path
    reads ``AITER_ATTN_DEBUG`` / ``AITER_ATTN_BACKEND`` on every op call): one lookup in
    ``os.environ``'s own table instead of its encode/decode round trip."""
    env = os.environ
    data = getattr(env, "_data", None)
    if data is None:  # os.environ replaced by a plain mapping
        return env.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = env.encodekey(name)
    if key not in data:
        return None
    return env.get(name)


def debug_checks_enabled() -> bool:
    """The process-wide checked mode: ``AITER_ATTN_DEBUG=1`` in the environment (read per
    call). ``BackendConfig(debug_checks=True)`` turns it on for one backend's kernels only."""
    return env_value(DEBUG_ENV) not in (None, "", "0")


def _capturing(t: torch.Tensor) -> bool:
    """Values cannot be read while a CUDA graph is being captured; checks are skipped then."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_paged_index_values(
    *,
    num_tokens: int,
    num_pages: int,
    page_size: int,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool = True,
    window_size=(-1, -1),
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    op: str = "paged_attention",
) -> None:
    """The values of a paged-attention call's index inputs (shapes are checked by the op):

    - ``cu_seqlens_q`` starts at 0, never decreases and ends at ``num_tokens`` (a smaller end
      leaves output rows unwritten, a larger one reads past q);
    - ``0 ≤ seqused_k[b]``, and ``seqused_k[b] ≥ q_len[b]`` when queries have positions
      (causal or windowed: they are the last ``q_len`` of the ``seqused_k`` keys);
    - ``max_seqlen_q`` (when given) bounds every ``q_len`` (it sizes the Triton grid);
    - each request's ``ceil(seqused_k / page_size)`` pages fit its ``block_table`` row and
      are pages of the cache (``0 ≤ id < num_pages``; ``-1`` is not "no page");
    - with a tree mask, request ``b``'s ``[q_len, L]`` block lies inside ``custom_mask``.

    Reads the tensors to the host (syncs); skipped during CUDA-graph capture. Raises
    ``ValueError`` naming the op, the argument, the request and the value.
    """
    if _capturing(seqused_k):
        return
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    lens = [int(x) for x in seqused_k.tolist()]
    if cu and cu[0] != 0:
        raise ValueError(f"{op}: cu_seqlens_q[0]={cu[0]}; must be 0 (request 0's queries "
                         "start at row 0 of q).")
    for b in range(len(lens)):
        q_len, kv_len = cu[b + 1] - cu[b], lens[b]
        if q_len < 0:
            raise ValueError(f"{op}: cu_seqlens_q decreases at request {b} "
                             f"(cu_seqlens_q[{b}]={cu[b]}, cu_seqlens_q[{b + 1}]={cu[b + 1]}); "
                             "it must hold non-decreasing query offsets.")
        if kv_len < 0:
            raise ValueError(f"{op}: seqused_k[{b}]={kv_len}; a KV length must be ≥ 0.")
        positional = causal or tuple(window_size) != (-1, -1)
        if positional and kv_len < q_len:
            raise ValueError(
                f"{op}: seqused_k[{b}]={kv_len} < request {b}'s {q_len} queries; a request's "
                "queries are the last q_len of its seqused_k keys, so seqused_k must count "
                "this step's tokens too.")
        if max_seqlen_q is not None and q_len > int(max_seqlen_q):
            raise ValueError(f"{op}: request {b} has {q_len} queries but max_seqlen_q="
                             f"{max_seqlen_q}; the hint must bound every request's query "
                             "count (or leave it None).")
        need = -(-kv_len // page_size)
        if need > block_table.shape[1]:
            raise ValueError(
                f"{op}: seqused_k[{b}]={kv_len} needs {need} pages of {page_size} tokens but "
                f"block_table has {block_table.shape[1]} columns; widen the table.")
    if cu and cu[-1] != num_tokens:
        raise ValueError(
            f"{op}: cu_seqlens_q[-1]={cu[-1]} but q has {num_tokens} tokens; the last offset "
            "must equal the token count (rows past a smaller one are never written; a larger "
            "one reads past q).")
    if lens and block_table.shape[1]:
        need_t = (seqused_k.to(torch.int64) + page_size - 1) // page_size
        cols = torch.arange(block_table.shape[1], device=block_table.device)
        used = cols.unsqueeze(0) < need_t.unsqueeze(1)
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0].tolist())
            raise ValueError(
                f"{op}: block_table[{b}, {i}]={int(block_table[b, i])} is not a page of the "
                f"cache (0..{num_pages - 1}) but request {b} reads it (seqused_k[{b}]="
                f"{lens[b]}); point unused entries past a request's pages at the null page 0.")
    if custom_mask is not None and mask_indptr is not None:
        ip = [int(x) for x in mask_indptr.tolist()]
        for b in range(len(lens)):
            q_len = cu[b + 1] - cu[b]
            end = ip[b] + q_len * lens[b]
            if ip[b] < 0 or end > custom_mask.numel():
                raise ValueError(
                    f"{op}: request {b}'s mask block [{ip[b]}, {end}) (mask_indptr[{b}] + "
                    f"q_len·seqused_k = {q_len}·{lens[b]}) is outside custom_mask's "
                    f"{custom_mask.numel()} elements.")


#: slot 0 of the null page 0: written by padding tokens (any number of them), read by no one
NULL_SLOT = 0


def check_slot_values(slots: torch.Tensor, num_slots: int, *, name: str = "slots",
                      op: str = "write_kv") -> None:
    """Every KV-write slot is ``< num_slots`` and no two tokens write the same slot. Two
    writes of one slot in a batch race on the GPU: which token's K/V the cache keeps is left
    to chance. Exempt: negative slots (skipped by contract) and :data:`NULL_SLOT`, slot 0 of
    the null page 0, where every CUDA-graph padding token writes
    (:data:`aiter_attn.graph.buffers.DUMMY_SLOT`) and no request reads.
    Reads ``slots`` to the host; skipped during CUDA-graph capture."""
    if slots.numel() == 0 or _capturing(slots):
        return
    top = int(slots.max())
    if top >= num_slots:
        t = int((slots >= num_slots).nonzero()[0, 0])
        raise ValueError(f"{op}: {name}[{t}]={int(slots[t])} is past the cache's {num_slots} "
                         "slots (pages · page_size); slots come from the pool's allocator.")
    tokens = (slots > NULL_SLOT).nonzero().flatten()  # the live rows, in token order
    if tokens.numel() < 2:
        return
    ordered, order = slots.index_select(0, tokens).sort(stable=True)
    same = (ordered[1:] == ordered[:-1]).nonzero()
    if same.numel():
        i = int(same[0, 0])
        a, b = int(tokens[order[i]]), int(tokens[order[i + 1]])
        raise ValueError(
            f"{op}: {name}[{a}] and {name}[{b}] both write slot {int(ordered[i])}; two tokens "
            "of one batch cannot share a KV slot (on the GPU either write may land last). "
            "Give each token its own slot from the pool's allocator, or a negative slot to "
            "skip that token's write (padding tokens may share the null slot 0).")


# --------------------------------------------------------------------------------------------
# the checked mode: value checks in front of any registered kernel


def _check_paged_call(op: str, page_axis: int):
    def check(q, k_cache, v_cache, out, *, cu_seqlens_q, seqused_k, block_table, causal=True,
              window_size=(-1, -1), custom_mask=None, mask_indptr=None, max_seqlen_q=None,
              **_):
        check_paged_index_values(
            num_tokens=q.shape[0], num_pages=k_cache.shape[0],
            page_size=k_cache.shape[page_axis], cu_seqlens_q=cu_seqlens_q,
            seqused_k=seqused_k, block_table=block_table, causal=causal,
            window_size=window_size, custom_mask=custom_mask, mask_indptr=mask_indptr,
            max_seqlen_q=max_seqlen_q, op=op)
    return check


def _check_mla_call(q, kv_cache, out, *, cu_seqlens_q, seqused_k, block_table, causal=True,
                    custom_mask=None, mask_indptr=None, max_seqlen_q=None, **_):
    check_paged_index_values(
        num_tokens=q.shape[0], num_pages=kv_cache.shape[0], page_size=kv_cache.shape[1],
        cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table,
        causal=causal, custom_mask=custom_mask, mask_indptr=mask_indptr,
        max_seqlen_q=max_seqlen_q, op="mla_paged_attention")


def _check_write_call(op: str, page_axis: int):
    def check(k_cache, v_cache, slots, k, v, *, full_to_swa=None, **_):
        if full_to_swa is not None:  # slots index the full pool's translation table
            check_slot_values(slots, full_to_swa.numel(), op=op)
        else:
            check_slot_values(slots, k_cache.shape[0] * k_cache.shape[page_axis], op=op)
    return check


#: op → value check taking the op's calling convention (that of its reference kernel)
_VALUE_CHECKS: dict = {
    "paged_attention": _check_paged_call("paged_attention", 1),
    "paged_attention_5d": _check_paged_call("paged_attention_5d", 3),
    "mla_paged_attention": _check_mla_call,
    "write_kv": _check_write_call("write_kv", 1),
    "write_kv_swa": _check_write_call("write_kv_swa", 1),
    "write_kv_5d": _check_write_call("write_kv_5d", 3),
}


def checked_kernel(op: str, fn: Callable) -> Callable:
    """``fn`` (a kernel of ``op`` in its reference calling convention) preceded by the op's
    value checks (:func:`check_paged_index_values`, :func:`check_slot_values`): the checked
    mode. Ops without value checks return ``fn`` itself. The checks sync, so this is for
    debugging (``aiter-attn generate --check``), never the hot path."""
    check = _VALUE_CHECKS.get(op)
    if check is None:
        return fn

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        check(*args, **kwargs)
        return fn(*args, **kwargs)

    checked.unchecked = fn
    return checked


#: the cache's page axis per attention op (NHD pages and MLA latents: 1; the 5-D K layout
#: ``[pages, Hkv, D // x, page_size, x]``: 3), which the checked mode compares with the plan's
#: page size
_CACHE_PAGE_AXIS = {"paged_attention": 1, "extend_attention": 1, "mla_paged_attention": 1,
                    "paged_attention_5d": 3}


class CheckedKernel:
    """A bound attention kernel object (``plan``/``run``, see
    :class:`aiter_attn.kernels.base.AttentionKernel`) in the checked mode.

    ``plan(md)`` remembers the step's metadata; ``run`` (first call per plan and cache) checks
    its page size and index values against the cache (:func:`check_paged_index_values`)
    before the kernel launches; the functional ``__call__`` checks its arguments. Everything
    else is the wrapped kernel's (``unchecked``).
    """

    _KEEP = 64  # plans remembered (a step plans each layer group once)
    memo_plans = False  # ops never memoise a checked call (its checks run on every call)

    def __init__(self, kernel):
        self.unchecked = kernel
        self._plans: dict = {}

    def __getattr__(self, name):
        return getattr(self.unchecked, name)

    def plan(self, md, out=None):
        plan = self.unchecked.plan(md, out)
        if len(self._plans) >= self._KEEP:
            self._plans.pop(next(iter(self._plans)))
        self._plans[id(plan)] = [plan, md, set()]
        return plan

    def run(self, q, cache, plan, params, out, **kwargs):
        entry = self._plans.get(id(plan))
        if entry is not None and entry[0] is plan:
            _, md, seen = entry
            k_cache = cache[0]
            if (q.shape[0], k_cache.shape) not in seen:
                self._check(md, q, k_cache, params)
                seen.add((q.shape[0], k_cache.shape))
        return self.unchecked.run(q, cache, plan, params, out, **kwargs)

    def _check(self, md, q, k_cache, params) -> None:
        from .kernels.base import mask_literal, plan_hints

        op = getattr(self.unchecked, "op", "paged_attention")
        axis = _CACHE_PAGE_AXIS.get(op)
        if axis is not None and k_cache.dim() > axis \
                and k_cache.shape[axis] != md.pages.page_size:
            # the kernels address the cache with the plan's page size: a table of other pages
            # passes every index check below and reads the wrong tokens
            raise ValueError(
                f"{op}: the plan's page table has page_size={md.pages.page_size} but the cache "
                f"has {k_cache.shape[axis]} tokens per page (k_cache {tuple(k_cache.shape)}, "
                f"axis {axis}); build the metadata with the pool's page size.")
        mask = md.mask
        check_paged_index_values(
            num_tokens=q.shape[0], num_pages=k_cache.shape[0], page_size=md.pages.page_size,
            cu_seqlens_q=md.query.cu_seqlens_q, seqused_k=md.pages.seqused_k,
            block_table=md.pages.block_table, causal=params.causal and not mask_literal(md),
            window_size=params.window, custom_mask=None if mask is None else mask.custom_mask,
            mask_indptr=None if mask is None else mask.mask_indptr,
            max_seqlen_q=plan_hints(md)[0], op=op)

    def __call__(self, q, k_cache, v_cache, out, **kwargs):
        op = getattr(self.unchecked, "op", "paged_attention")
        _VALUE_CHECKS[op](q, k_cache, v_cache, out, **kwargs)
        return self.unchecked(q, k_cache, v_cache, out, **kwargs)


# --------------------------------------------------------------------------------------------
# index-builder inputs (build_page_table, build_ragged_kv_indices, build_tree_mask)


def check_page_size_arg(page_size) -> None:
    """An index builder's ``page_size``: a positive int (not a bool)."""
    if not is_int_at_least(page_size, 1):
        raise ValueError(f"page_size={page_size!r}; must be a positive int (the cache's tokens "
                         "per page).")


def check_host_count(name, value, what: str) -> int:
    """A host int ≥ 0 (``total``, ``q_len``): a device tensor would need a sync to read."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be a Python int ≥ 0 ({what}); pass int(...) "
                        "of a host value.")
    if value < 0:
        raise ValueError(f"{name}={value}; must be ≥ 0 ({what}).")
    return int(value)


def check_pool_rows(req_to_token, req_pool_indices, seq_lens, op: str) -> None:
    """The shared inputs of the index builders: the pool's ``[R, C]`` token table and one
    pool row and one length per request (shapes, dtypes, devices; no device reads)."""
    check_tensor("req_to_token", req_to_token, dtypes=INDEX_DTYPES, ndim=2,
                 hint=f"{op}: req_to_token is the pool's int32 [max_requests, max_context] "
                      "token table.")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1,
                 hint=f"{op}: seq_lens is int32 [batch]: KV length per request.")
    check_tensor("req_pool_indices", req_pool_indices, dtypes=INDEX_DTYPES, ndim=1,
                 shape=(seq_lens.shape[0],),
                 hint=f"{op}: req_pool_indices is int64 [batch], one req_to_token row per "
                      "request (as many as seq_lens).")
    check_same_device("req_to_token", req_to_token, req_pool_indices=req_pool_indices,
                      seq_lens=seq_lens)


def check_pool_values(req_to_token, req_pool_indices, seq_lens, op: str, total=None) -> None:
    """The checked mode (``AITER_ATTN_DEBUG=1``): the values the builders read (syncs)."""
    if _capturing(seq_lens):
        return
    rows, cols = req_to_token.shape
    for b, (r, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        if not 0 <= r < rows:
            raise ValueError(f"{op}: req_pool_indices[{b}]={r} is not a row of req_to_token "
                             f"(0..{rows - 1}); pass the request's pool slot.")
        if not 0 <= n <= cols:
            raise ValueError(f"{op}: seq_lens[{b}]={n}; must be in 0..{cols} (req_to_token's "
                             "width): a length past it reads other requests' tokens.")
    if total is not None and total != (n_sum := int(seq_lens.sum())):
        raise ValueError(f"{op}: total={total} but sum(seq_lens)={n_sum}; pass the batch's "
                         "seq_lens_sum.")
