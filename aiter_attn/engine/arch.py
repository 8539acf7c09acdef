"""Which KV pool and backend architecture a model needs, read from its layer specs.

A model declares its attention through ``layer_specs`` (one :class:`~aiter_attn.LayerSpec` per
layer, see :mod:`aiter_attn.engine.protocol`). :func:`model_arch` reads the architecture off
them (a model may also say so itself with an ``attn_arch`` attribute):

* a layer with ``kv_lora_rank > 0`` → :attr:`AttnArch.MLA` (DeepSeek-V2/V3: absorbed specs,
  one latent cache per layer, :class:`~aiter_attn.kvcache.MLAKVPool`);
* a layer with a ``sliding_window`` and the hybrid pool enabled → :attr:`AttnArch.SWA`
  (sliding-window layers on their own, smaller :class:`~aiter_attn.kvcache.SWAKVPool` part);
* otherwise :attr:`AttnArch.MHA` (windows, if any, applied by the kernel over the full pool).

:func:`build_kv_setup` maps the architecture to its pool builder (a table, one function per
architecture) and returns a :class:`KVSetup` the runner uses as it is.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import attrs

from ..kvcache import MHAKVPool
from ..types import AttnArch
from .kv_manager import KVCacheManager

__all__ = ["KVSetup", "model_arch", "build_kv_setup", "swa_pool_pages"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class KVSetup:
    """What the runner needs for one architecture.

    Attributes:
        arch: the backend architecture (``BackendConfig.arch``).
        pool: the KV pool handed to ``AttentionBackend``.
        config_kw: extra ``BackendConfig`` fields (e.g. ``swa_window``).
        extra: ``AttentionBackend(extra=...)`` objects.
        after_step: called with the runner's ``items`` after each forward (SWA: return the
            SWA pages no future query can see), or ``None``.
        copy_slots: ``(src, dst)`` int64 full slots → copy every layer's KV of ``src`` to
            ``dst`` (tree speculative decoding moves an accepted branch into place).
    """

    arch: AttnArch
    pool: object
    config_kw: dict = attrs.field(factory=dict)
    extra: dict = attrs.field(factory=dict)
    after_step: Optional[Callable] = None
    copy_slots: Optional[Callable] = None


def _copy_buffers(buffers, src, dst) -> None:
    """``buf[dst] = buf[src]`` over the flattened slots of every paged buffer."""
    for buf in buffers:
        flat = buf.view(-1, *buf.shape[2:])
        flat[dst] = flat[src]


def _mha_copy(pool):
    return lambda src, dst: _copy_buffers([*pool.k_buffers, *pool.v_buffers], src, dst)


def model_arch(model, *, swa_pool: bool = True) -> AttnArch:
    """The architecture ``model`` needs (its ``attn_arch`` if it declares one)."""
    declared = getattr(model, "attn_arch", None)
    if declared is not None:
        return AttnArch.parse(declared)
    specs = model.layer_specs
    if any(s.kv_lora_rank > 0 for s in specs):
        return AttnArch.MLA
    if swa_pool and any(s.sliding_window is not None for s in specs):
        return AttnArch.SWA
    return AttnArch.MHA


def swa_pool_pages(*, window: int, page_size: int, max_requests: int, chunk_tokens: int,
                   full_pages: int) -> int:
    """Pages of the SWA pool: per request the window plus one step's new tokens (whole pages,
    +1 for a page straddling the window's start), plus the null page; never more than the full
    pool."""
    per_req = -(-(window + chunk_tokens) // page_size) + 1
    return min(max_requests * per_req + 1, full_pages)


def _mha(model, kv: KVCacheManager, *, device: str, **_) -> KVSetup:
    lay = model.kv_layout
    pool = MHAKVPool(kv.num_pages, kv.page_size, lay.num_kv_heads, lay.head_dim, lay.num_layers,
                     dtype=lay.dtype, device=device, v_head_dim=lay.v_head_dim)
    return KVSetup(AttnArch.MHA, pool, copy_slots=_mha_copy(pool))


def _swa(model, kv: KVCacheManager, *, device: str, chunk_tokens: int, **_) -> KVSetup:
    from ..kvcache import SWAKVPool, SWAPageAllocator

    lay = model.kv_layout
    flags = [s.sliding_window is not None for s in model.layer_specs]
    window = max(s.sliding_window for s in model.layer_specs if s.sliding_window is not None)
    n_swa = swa_pool_pages(window=window, page_size=kv.page_size,
                           max_requests=kv.req_pool.size - 1,
                           chunk_tokens=chunk_tokens, full_pages=kv.num_pages)
    pool = SWAKVPool.create(num_full_pages=kv.num_pages, num_swa_pages=n_swa,
                            page_size=kv.page_size, num_kv_heads=lay.num_kv_heads,
                            head_dim=lay.head_dim, layer_is_swa=flags, dtype=lay.dtype,
                            device=device, v_head_dim=lay.v_head_dim)
    if kv.allocator.free_pages != kv.num_pages - 1:
        raise ValueError("the hybrid SWA pool replaces the page allocator: build the runner "
                         "before any request holds pages.")
    alloc = SWAPageAllocator(pool, shuffle_seed=kv.allocator.shuffle_seed)
    kv.allocator = alloc
    # Prefix reuse checks the donor still holds the prefix's last window (kv_manager.py).
    kv.swa_window = window

    def free_out_of_window(items) -> None:
        for req, _ in items:
            if req.row is not None:
                alloc.free_swa_out_of_window(req.row, window, next_position=req.num_computed,
                                             keep_pages=kv.swa_keep_pages(req))

    def copy_slots(src, dst) -> None:
        _mha_copy(pool.full)(src, dst)
        _mha_copy(pool.swa)(pool.translate(src), pool.translate(dst))

    log.info("hybrid SWA pool: %d of %d layers on %d SWA pages (full pool %d pages)",
             sum(flags), len(flags), n_swa, kv.num_pages)
    return KVSetup(AttnArch.SWA, pool, config_kw={"swa_window": window},
                   after_step=free_out_of_window, copy_slots=copy_slots)


def _mla(model, kv: KVCacheManager, *, device: str, **_) -> KVSetup:
    from ..kvcache import MLAKVPool

    s0 = model.layer_specs[0]
    pool = MLAKVPool(kv.num_pages, kv.page_size, s0.kv_lora_rank, s0.qk_rope_head_dim,
                     len(model.layer_specs), dtype=model.kv_layout.dtype, device=device)
    return KVSetup(AttnArch.MLA, pool,
                   copy_slots=lambda src, dst: _copy_buffers(pool.latent_buffers, src, dst))


#: architecture → pool builder ``(model, kv, *, device, chunk_tokens) -> KVSetup``.
POOL_BUILDERS: dict = {AttnArch.MHA: _mha, AttnArch.SWA: _swa, AttnArch.MLA: _mla}


def build_kv_setup(model, kv: KVCacheManager, *, device: str, swa_pool: bool = True,
                   chunk_tokens: int = 512) -> KVSetup:
    """Pool, ``BackendConfig`` fields and step hook for ``model`` (see the module docstring).

    Args:
        model: an ``EngineModel``.
        kv: the engine's page bookkeeping (its allocator is replaced for the SWA pool).
        device: where the pool lives.
        swa_pool: put sliding-window layers on their own pool (hybrid SWA).
        chunk_tokens: most new tokens one request feeds per step (sizes the SWA pool).
    """
    arch = model_arch(model, swa_pool=swa_pool)
    builder = POOL_BUILDERS.get(arch)
    if builder is None:
        raise ValueError(f"the engine has no KV pool builder for arch={arch.value!r}; "
                         f"supported: {sorted(a.value for a in POOL_BUILDERS)}.")
    return builder(model, kv, device=device, chunk_tokens=chunk_tokens)
