"""What the aiter vendor plugin's kernel objects share (:mod:`.aiter`, :mod:`.aiter_mla`):
the table of aiter functions and where each lives, their resolution and signatures, the
static-buffer helpers, and :class:`_AiterKernel` (functions resolved once per binding, the
step's token indices, the fallback kernel for steps aiter cannot serve)."""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Optional

import torch

from . import aiter_marshal as M

__all__ = ["AITER_FUNCTIONS", "OPTIONAL_FUNCTIONS", "resolve", "accepted_params"]

log = logging.getLogger("aiter_attn.kernels.aiter")

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
