"""What a bound Triton MLA kernel object (:class:`.mla.TritonMLA`) keeps across steps: the
split partials' workspace (eager, or views of a CUDA graph's static buffers), the fused
merge's zeroed counters and the TMA descriptors of each latent cache it has read.

:class:`MLAWorkspace` is a mixin of :class:`.mla.TritonMLA`: it reads the attributes
``_bind`` sets (``heads``, ``rank``, ``rope``, ``batch_invariant``, ``_ws``), the
descriptor cache ``_descs``, the kernel base's ``name`` / ``request`` and the kernel's
``_config`` / ``_narrow_splits``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._kvutil import interpreting, num_sms
from .mla_narrow_gluon import narrow_descriptors, narrow_mla_layout_reason
from .mla_plan import TritonMLAPlan
from .mla_stream_gluon import stream_descriptors, stream_q_descriptors, stream_q_reason
from .prefill import TensorDescriptor, _capability

__all__ = ["MLAWorkspace"]


def _tma_device(device: torch.device) -> bool:
    """Tensor-descriptor reads of the cache: NVIDIA sm_90 or later, or Triton's interpreter
    (which reads descriptors on the CPU)."""
    if TensorDescriptor is None:
        return False
    if interpreting():
        return True
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(device)[0] >= 9


#: cache tensors whose TMA descriptors one kernel keeps (then it starts over)
_DESCS_KEEP = 64

#: the fused merge's counters of plans without a graph's static buffers, one zeroed buffer
#: per (device, stream): every launch leaves its counters at zero, and launches on one stream
#: are ordered (two streams never share counters)
_EAGER_COUNTERS: dict = {}


def _eager_counters(tiles: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for ``tiles`` (token, head block) pairs on ``device``'s current
    stream (made, or grown, on first need). Under CUDA-graph capture without a cached
    buffer: a fresh one, not cached (its zero fill is a captured node: it runs at replay
    only, so the buffer is not zero before a first replay)."""
    cuda = device.type == "cuda"
    key = (device, torch.cuda.current_stream(device).cuda_stream if cuda else 0)
    buf = _EAGER_COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        if cuda and torch.cuda.is_current_stream_capturing():
            return torch.zeros(tiles, dtype=torch.int32, device=device)
        buf = _EAGER_COUNTERS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32,
                                                 device=device)
    return buf[:tiles]


class MLAWorkspace:
    """The split workspace, merge counters and cache descriptors of :class:`.mla.TritonMLA`
    (a mixin: see the module docstring for what it reads of the kernel object)."""

    def _workspace_rows(self, max_bs, q_len, max_k, device) -> int:
        """Split-partial rows (``splits · tokens``) of any batch of up to ``max_bs`` requests
        of ``q_len`` queries: the static workspace under CUDA graphs."""
        rows = 0
        for bs in range(1, max_bs + 1):
            splits = self._config(bs * q_len, max_k, device)[2]
            if splits > 1 or self.batch_invariant:
                rows = max(rows, splits * bs * q_len)
            nsplits = self._narrow_splits(bs * q_len, max_k, device, None, None)
            if nsplits is not None and nsplits > 1:
                rows = max(rows, nsplits * bs * q_len)
        programs = self._balanced_programs(device) if q_len == 1 else None
        if programs is not None:  # two partial slots a program (:mod:`.mla_balanced`)
            rows = max(rows, 2 * programs)
        if q_len == 1 and self._stream_wanted():  # two a program, one program per SM
            rows = max(rows, 2 * num_sms(torch.device(device)))
        return rows

    def buffer_spec(self, limits):
        """The split partials' static workspace for ``limits`` (a
        :class:`~aiter_attn.graph.buffers.GraphLimits`): flat float32 buffers."""
        from ...strategies.base import BufferSpec

        if self.request is None:
            return BufferSpec({})
        # a captured step's key bound: its static table's width in keys (whole pages)
        page = self.request.page_size or 1
        rows = self._workspace_rows(limits.max_bs, limits.q_len,
                                    limits.table_pages(page) * page,
                                    torch.device(self.request.device))
        if not rows:
            return BufferSpec({})
        return BufferSpec({self._ws + ".o": ((rows * self.heads * self.rank,), torch.float32),
                           self._ws + ".lse": ((rows * self.heads,), torch.float32),
                           # zero-filled by allocate(); the fused merge leaves them zero
                           self._ws + ".cnt": ((limits.max_bs * limits.q_len * self.heads,),
                                               torch.int32)})

    def _counters(self, tiles, md, out, device):
        """The fused merge's zeroed int32 counters, ``tiles`` of them: the graph's static
        buffer (``out``), else this device and stream's own (:func:`_eager_counters`)."""
        if out is None:
            return _eager_counters(tiles, device)
        buf = out.get(self._ws + ".cnt")
        if buf is None:  # bound after the graph manager was built: sized once, here
            cu = out.get("cu_seqlens_q")
            max_bs = cu.shape[0] - 1 if cu is not None else md.batch_size
            cap = max(tiles, max(max_bs, 1) * md.query.max_seqlen_q * self.heads)
            buf = out.setdefault(self._ws + ".cnt",
                                 torch.zeros(cap, dtype=torch.int32, device=device))
        if buf.numel() < tiles:
            raise RuntimeError(
                f"{self.name}: the static MLA merge counters hold {buf.numel()} entries but "
                f"this plan needs {tiles}; build CudaGraphManager after binding the layers so "
                "the kernel's buffer_spec sizes them.")
        return buf[:tiles]

    def _partials(self, splits, num_tokens, md, out, device, dtype=torch.float32):
        """Split partials ``o`` ``[T, H, S, R]`` of ``dtype`` (float32, or q's 16-bit dtype:
        then a 16-bit view of the same float32 workspace, half of it used) and float32 LSEs
        ``[T, H, S]``: fresh tensors, or views of the graph's static buffers in ``out``."""
        shape_o = (num_tokens, self.heads, splits, self.rank)
        shape_l = (num_tokens, self.heads, splits)
        if out is None:
            return (torch.empty(shape_o, dtype=dtype, device=device),
                    torch.empty(shape_l, dtype=torch.float32, device=device))
        rows = splits * num_tokens
        buf = out.get(self._ws + ".o")
        if buf is None:  # bound after the graph manager was built: sized once, here
            cu = out.get("cu_seqlens_q")
            max_bs = cu.shape[0] - 1 if cu is not None else md.batch_size
            cap = max(rows, self._workspace_rows(max(max_bs, 1), md.query.max_seqlen_q,
                                                 md.pages.max_seqlen_k, device))
            buf = out.setdefault(self._ws + ".o", torch.empty(
                cap * self.heads * self.rank, dtype=torch.float32, device=device))
            out.setdefault(self._ws + ".lse", torch.empty(cap * self.heads,
                                                          dtype=torch.float32, device=device))
        lse = out[self._ws + ".lse"]
        if buf.numel() < rows * self.heads * self.rank:
            raise RuntimeError(
                f"{self.name}: the static MLA split workspace holds "
                f"{buf.numel() // (self.heads * self.rank)} rows but this plan needs {rows}; "
                "build CudaGraphManager after binding the layers so the kernel's buffer_spec "
                "sizes it.")
        n_o, n_l = rows * self.heads * self.rank, rows * self.heads
        return buf.view(dtype)[:n_o].view(shape_o), lse[:n_l].view(shape_l)

    def tile_descs(self, kv_cache, plan: TritonMLAPlan):
        """The Triton launch's latent-tile descriptors of ``kv_cache`` under ``plan``
        (``None`` without ``KV_DESC``, or where TMA cannot read the rows)."""
        kw = plan.cfg_kw
        if not kw["KV_DESC"]:
            return None
        return self._cache_descs(kv_cache, kw["BLOCK_N"], self.rank // kw["QK_SPLIT"])

    def _kept_descs(self, kind, t, make, *args):
        """``make(t, *args)`` (TMA descriptors of tensor ``t``, or ``None``) once per
        ``kind`` and tensor (data pointer, shape, strides, dtype), then only looked up; the
        table is cleared when it holds :data:`_DESCS_KEEP`."""
        key = (kind, t.data_ptr(), t.shape, t.stride(), t.dtype)
        descs = self._descs.get(key, 0)
        if descs == 0:
            if len(self._descs) >= _DESCS_KEEP:
                self._descs.clear()
            descs = self._descs[key] = make(t, *args)
        return descs

    def _stream_descs(self, kv_cache):
        """The stream kernel's two descriptors of ``kv_cache`` (:func:`.mla_stream_gluon
        .stream_descriptors`); ``None`` where TMA cannot read the rows."""
        return self._kept_descs("stream", kv_cache, _stream_kv_descs)

    def _stream_q_descs(self, q):
        """The stream kernel's q descriptors (:func:`.mla_stream_gluon.stream_q_descriptors`),
        kept per q buffer (a graph's static q, or an engine's reused one); ``None`` where its
        loader cannot read q by TMA."""
        return self._kept_descs("stream-q", q, _stream_q_descs)

    def _cache_descs(self, kv_cache, block_n: Optional[int] = None, cols: Optional[int] = None):
        """The TMA descriptors of ``kv_cache`` (rows ``[slots, R + rope]``), built once per
        cache tensor (data pointer, shape, strides, dtype) and then only looked up: the
        narrow kernel's two (``block_n`` ``None``), or the Triton kernel's blocks
        ``[block_n, cols]`` (``cols``: R, or R/QK_SPLIT) and ``[block_n, rope]``;
        ``None`` where TMA cannot read the rows
        (:func:`.mla_narrow_gluon.narrow_mla_layout_reason`)."""
        cols = cols or self.rank
        return self._kept_descs((block_n, cols), kv_cache, _cache_tile_descs, block_n, cols,
                                self.rope)


def _cache_tile_descs(kv_cache, block_n, cols, rope):
    """:meth:`MLAWorkspace._cache_descs`'s descriptors, made (``None``: TMA cannot read the
    rows, or this Triton has no tensor descriptors)."""
    if narrow_mla_layout_reason(kv_cache) is not None:
        return None
    if block_n is None:
        return narrow_descriptors(kv_cache)
    if TensorDescriptor is None:
        return None
    p, ps, _, d = kv_cache.shape
    rows = kv_cache.as_strided((p * ps, d), (kv_cache.stride(1), 1))
    return tuple(TensorDescriptor(rows, [p * ps, d], [kv_cache.stride(1), 1], [block_n, w])
                 for w in (cols, rope))


def _stream_kv_descs(kv_cache):
    """The stream kernel's cache descriptors, made (``None``: TMA cannot read the rows)."""
    return (stream_descriptors(kv_cache) if narrow_mla_layout_reason(kv_cache) is None
            else None)


def _stream_q_descs(q):
    """The stream kernel's q descriptors, made (``None``: its loader cannot read q)."""
    return stream_q_descriptors(q) if stream_q_reason(q) is None else None
