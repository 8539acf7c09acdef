"""Hybrid sliding-window KV cache: full-attention layers keep their KV in the full pool,
sliding-window (SWA) layers in a separate, smaller SWA pool.

Every token has a *full* slot (what ``req_to_token`` and ``out_cache_loc`` hold). The
translation table ``full_to_swa_index_mapping`` (int64 ``[full_slots]``, SGLang's name) gives
its slot in the SWA pool, or 0 (the SWA pool's null slot) once the token's SWA page has been
freed. Pages map whole: full page ``f`` ↦ SWA page ``s`` means slot ``f·P + o`` ↦ ``s·P + o``,
so an SWA page table is ``full_to_swa[full_page · P] // P``.

Window convention (one, end to end): HF ``sliding_window = w`` means a query sees the ``w``
most recent keys including itself, i.e. flash-attn ``window_size = (w - 1, 0)``
(:meth:`aiter_attn.LayerSpec.window_size`). A future query at position ``p ≥ n`` (``n`` =
tokens held) sees keys ``≥ p - w + 1 ≥ n - w + 1``, so an SWA page whose last token is
``< n - w + 1`` is dead for every layer and :meth:`SWAPageAllocator.free_swa_out_of_window`
may return it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs
import torch

from .allocator import PageAllocator, check_token_count
from .mha import MHAKVPool
from .req_to_token import ReqToTokenPool, row_index

__all__ = ["SWAKVPool", "SWAPageAllocator"]


@attrs.define(eq=False)
class SWAKVPool:
    """Two NHD pools (full and SWA layers) plus the full→SWA slot translation table.

    Build with :meth:`create`. ``kv_buffers(layer_id)`` returns the buffers of whichever pool
    holds the layer, so callers index layers by their model-wide id.

    Attributes:
        full: :class:`MHAKVPool` of the full-attention layers.
        swa: :class:`MHAKVPool` of the sliding-window layers (usually far fewer pages).
        full_to_swa_index_mapping: int64 ``[full.num_slots]``: SWA slot of each full slot
            (0 = none / freed; slot 0 of both pools is the null slot).
        layer_is_swa: per model layer, whether it lives in the SWA pool.
    """

    full: MHAKVPool
    swa: MHAKVPool
    full_to_swa_index_mapping: torch.Tensor
    layer_is_swa: tuple
    _sub_index: tuple = attrs.field(init=False)

    def __attrs_post_init__(self):
        idx, counts = [], [0, 0]
        for is_swa in self.layer_is_swa:
            idx.append(counts[int(is_swa)])
            counts[int(is_swa)] += 1
        if counts[0] != self.full.num_layers or counts[1] != self.swa.num_layers:
            raise ValueError(
                f"layer_is_swa names {counts[0]} full and {counts[1]} SWA layers but the pools "
                f"hold {self.full.num_layers} and {self.swa.num_layers}; build with "
                "SWAKVPool.create."
            )
        if self.full.kv_scale_granularity != self.swa.kv_scale_granularity:
            raise ValueError(
                f"full kv_scale_granularity={self.full.kv_scale_granularity!r} != SWA "
                f"{self.swa.kv_scale_granularity!r}; build both with SWAKVPool.create.")
        if self.full.page_size != self.swa.page_size:
            raise ValueError(
                f"full page_size={self.full.page_size} != SWA page_size={self.swa.page_size}; "
                "whole pages translate, so both pools need the same page size."
            )
        self._sub_index = tuple(idx)

    @classmethod
    def create(
        cls,
        *,
        num_full_pages: int,
        num_swa_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        layer_is_swa: Sequence[bool],
        dtype: torch.dtype = torch.float16,
        device: str = "cpu",
        v_head_dim: Optional[int] = None,
        kv_scale_granularity: str = "per_layer",
    ) -> "SWAKVPool":
        """Pools for a model whose layer ``i`` is sliding-window iff ``layer_is_swa[i]``
        (``kv_scale_granularity``: as :class:`MHAKVPool`'s, for both sub-pools)."""
        flags = tuple(bool(f) for f in layer_is_swa)
        n_swa = sum(flags)
        fmt = dict(dtype=dtype, device=device, v_head_dim=v_head_dim,
                   kv_scale_granularity=kv_scale_granularity)
        full = MHAKVPool(num_full_pages, page_size, num_kv_heads, head_dim, len(flags) - n_swa,
                         **fmt)
        swa = MHAKVPool(num_swa_pages, page_size, num_kv_heads, head_dim, n_swa, **fmt)
        mapping = torch.zeros(full.num_slots, dtype=torch.int64, device=device)
        return cls(full=full, swa=swa, full_to_swa_index_mapping=mapping, layer_is_swa=flags)

    @property
    def page_size(self) -> int:
        return self.full.page_size

    @property
    def num_layers(self) -> int:
        return len(self.layer_is_swa)

    @property
    def kv_scale_granularity(self) -> str:
        """``"per_layer"`` or ``"per_token_head"`` (both sub-pools alike)."""
        return self.full.kv_scale_granularity

    @property
    def device(self) -> torch.device:
        return self.full_to_swa_index_mapping.device

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(
                f"layer_id={layer_id} outside the model's {self.num_layers} layers "
                "(SWAKVPool.create(layer_is_swa=...) lists every layer)."
            )

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` keeps its KV in the SWA pool."""
        self._check_layer(layer_id)
        return self.layer_is_swa[layer_id]

    def pool_of(self, layer_id: int) -> MHAKVPool:
        """The sub-pool holding layer ``layer_id``."""
        return self.swa if self.is_swa_layer(layer_id) else self.full

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` NHD pages of the pool that holds ``layer_id``."""
        return self.pool_of(layer_id).kv_buffers(self._sub_index[layer_id])

    def scale_buffers(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Per-(token, head) ``(k_scales, v_scales)`` of the pool holding ``layer_id`` (see
        :meth:`MHAKVPool.scale_buffers`), or ``None``."""
        return self.pool_of(layer_id).scale_buffers(self._sub_index[layer_id])

    def translate(self, full_slots: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int64 SWA slots of ``full_slots`` (any int dtype, any shape); on the device, no sync.

        A negative (padding) slot stays -1, as the SWA writes skip it; slot 0 (the null slot)
        and a slot whose SWA page was freed translate to 0."""
        idx = full_slots.reshape(-1).long()
        pad = idx < 0
        # gather at 0 for padding, then put -1 back (index_select would fail on -1)
        swa = self.full_to_swa_index_mapping.index_select(0, idx.clamp(min=0)).masked_fill_(pad, -1)
        if out is None:
            return swa.view(full_slots.shape)
        out.view(-1).copy_(swa)
        return out


@attrs.define(eq=False)
class SWAPageAllocator:
    """Allocates full pages (through a :class:`PageAllocator`) and, for each, one SWA page.

    ``extend`` returns full slots (``out_cache_loc``) and keeps ``full_to_swa_index_mapping``
    in step; ``free_swa_out_of_window`` returns SWA pages no future query can see;
    ``release`` frees both when a request finishes. It offers :class:`PageAllocator`'s methods
    (``extend``, ``share_prefix``, ``release``, ``tokens_held``, ``pages_of``, ``free_pages``)
    so an engine can use either.

    Args:
        pool: the :class:`SWAKVPool` whose translation table this allocator owns.
        shuffle_seed: hand out pages of both pools in a seeded random order (block-permuted
            pools in tests).
    """

    pool: SWAKVPool
    shuffle_seed: Optional[int] = None
    full: PageAllocator = attrs.field(init=False)
    _swa_free: list = attrs.field(init=False)
    _swa_of: dict = attrs.field(init=False, factory=dict)  # full page -> SWA page
    # row -> (shortest length a truncate may leave, end of the row's freed SWA tokens)
    _floor: dict = attrs.field(init=False, factory=dict)
    # largest window free_swa_out_of_window was given (how far back a query sees)
    _window: int = attrs.field(init=False, default=1)

    def __attrs_post_init__(self):
        ps = self.pool.page_size
        self.full = PageAllocator(self.pool.full.num_pages, ps, shuffle_seed=self.shuffle_seed)
        pages = list(range(1, self.pool.swa.num_pages))
        if self.shuffle_seed is not None:
            g = torch.Generator().manual_seed(self.shuffle_seed + 7919)
            pages = [pages[i] for i in torch.randperm(len(pages), generator=g).tolist()]
        self._swa_free = pages[::-1]

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def free_pages(self) -> int:
        """Free pages of the full pool (as :attr:`PageAllocator.free_pages`)."""
        return self.full.free_pages

    @property
    def swa_free_pages(self) -> int:
        """Free pages of the SWA pool."""
        return len(self._swa_free)

    def tokens_held(self, row: int) -> int:
        return self.full.tokens_held(row)

    def truncate(self, row: int, num_tokens: int) -> None:
        """As :meth:`PageAllocator.truncate`: the row keeps its full pages and their SWA
        pages; only the held length moves back (rejected speculative drafts).

        Raises, changing nothing, where the next query (at ``num_tokens``) would see a key
        whose SWA page :meth:`free_swa_out_of_window` already returned (it would read the
        null slot's zeros)."""
        row = row_index(row, "truncate")
        num_tokens = check_token_count(num_tokens, "num_tokens")
        floor, freed_end = self._floor.get(row, (0, 0))
        if num_tokens < floor:
            raise ValueError(
                f"truncate(row={row}, num_tokens={num_tokens}): the row's SWA pages of tokens "
                f"0..{freed_end - 1} were freed (free_swa_out_of_window), so a query at "
                f"{num_tokens} would read freed keys; truncate to ≥ {floor} only (pass "
                "free_swa_out_of_window the committed length as next_position).")
        self.full.truncate(row, num_tokens)

    def pages_of(self, row: int) -> list[int]:
        """Full pages of ``row`` (as :meth:`PageAllocator.pages_of`)."""
        return self.full.pages_of(row)

    def swa_pages_of(self, row: int) -> list[int]:
        """SWA page of each full page of ``row`` (0 where freed)."""
        return [self._swa_of.get(p, 0) for p in self.full.pages_of(row)]

    def _map(self, full_page: int, swa_page: int) -> None:
        ps = self.page_size
        m = self.pool.full_to_swa_index_mapping
        if swa_page:
            m[full_page * ps:(full_page + 1) * ps] = torch.arange(
                swa_page * ps, (swa_page + 1) * ps, dtype=m.dtype, device=m.device)
        else:
            m[full_page * ps:(full_page + 1) * ps] = 0

    def extend(self, req_pool: ReqToTokenPool, row: int, num_new_tokens: int) -> torch.Tensor:
        """Reserve ``num_new_tokens`` more tokens of ``row`` in both pools.

        Returns the int64 full slots (``out_cache_loc``); writes ``req_to_token[row]`` and the
        translation of every new page. Raises before changing anything if either pool is full.
        """
        num_new_tokens = check_token_count(num_new_tokens, "num_new_tokens")
        ps = self.page_size
        held = self.full.tokens_held(row)
        have = len(self.full.pages_of(row))
        need = -(-(held + num_new_tokens) // ps) - have
        if need > len(self._swa_free):
            raise RuntimeError(
                f"SWA pool out of pages: need {need}, {len(self._swa_free)} free of "
                f"{self.pool.swa.num_pages}; free out-of-window pages "
                "(SWAPageAllocator.free_swa_out_of_window) or give the SWA pool more pages."
            )
        slots = self.full.extend(req_pool, row, num_new_tokens)
        for fp in self.full.pages_of(row)[have:]:
            sp = self._swa_free.pop()
            self._swa_of[fp] = sp
            self._map(fp, sp)
        return slots

    def share_prefix(self, req_pool: ReqToTokenPool, src_row: int, dst_row: int,
                     num_tokens: int) -> int:
        """Prefix caching: ``dst_row`` reuses ``src_row``'s first whole pages (and their SWA
        pages, through the shared translation). Returns the tokens now cached for ``dst_row``.

        Where :meth:`free_swa_out_of_window` already returned some of those SWA pages, only a
        prefix whose next query (at its length) sees no freed key is shared (none if no such
        prefix exists), and ``dst_row`` inherits the truncate floor of the freed pages."""
        num_tokens = check_token_count(num_tokens, "num_tokens")
        src = row_index(src_row, "share_prefix(src_row)")
        ps = self.page_size
        pages = self.full.pages_of(src)[: min(num_tokens, self.full.tokens_held(src)) // ps]
        freed = [i for i, fp in enumerate(pages) if fp not in self._swa_of]
        if not freed:
            return self.full.share_prefix(req_pool, src_row, dst_row, num_tokens)
        reach = self._window - 1  # a query at n sees keys ≥ n - reach
        n_pages = len(pages)
        # the longest whole-page prefix whose window [n - reach, n) holds no freed page
        while n_pages and any(i < n_pages and (i + 1) * ps > n_pages * ps - reach
                              for i in freed):
            n_pages -= 1
        n = self.full.share_prefix(req_pool, src_row, dst_row, n_pages * ps)
        inside = [i for i in freed if i < n_pages]
        if inside:
            end = (max(inside) + 1) * ps
            dst = row_index(dst_row, "share_prefix(dst_row)")
            self._floor[dst] = max(self._floor.get(dst, (0, 0)), (end + reach, end))
        return n

    def free_swa_out_of_window(self, row: int, window: int, *, next_position: Optional[int] = None,
                               keep_pages: frozenset = frozenset()) -> int:
        """Return the SWA pages of ``row`` that fall entirely out of every window.

        Args:
            row: the request's ``req_to_token`` row.
            window: the largest HF ``sliding_window`` among the model's SWA layers.
            next_position: position of the request's next query token; defaults to the
                tokens held. With speculative decoding pass the committed (accepted) length,
                since draft tokens may be rolled back.
            keep_pages: full pages to leave alone (shared with another request whose next
                query is earlier).

        A page whose last token is before ``next_position - window + 1`` is unmapped
        (translation → 0, the SWA null slot) and its SWA page goes back to the free list; the
        full page stays (full-attention layers still read it). Returns the pages freed.
        Afterwards :meth:`truncate` refuses a length whose next query would see a freed key.
        """
        if window is None or window < 1:
            raise ValueError(f"window={window!r}; pass the largest sliding_window (≥ 1) of the "
                             "model's SWA layers.")
        row = row_index(row, "free_swa_out_of_window")
        self._window = max(self._window, int(window))
        held = self.full.tokens_held(row)
        nxt = held if next_position is None else int(next_position)
        if not 0 <= nxt <= held:
            raise ValueError(f"next_position={next_position} outside 0..{held} (tokens held by "
                             f"row {row}).")
        first_visible = nxt - window + 1
        if first_visible <= 0:
            return 0
        freed = 0
        for i, fp in enumerate(self.full.pages_of(row)[: first_visible // self.page_size]):
            if fp in keep_pages:
                continue
            sp = self._swa_of.pop(fp, None)
            if sp is None:
                continue
            self._map(fp, 0)
            self._swa_free.append(sp)
            freed += 1
            # a query at n sees keys ≥ n - window + 1: those must lie past this page
            end = (i + 1) * self.page_size
            self._floor[row] = max(self._floor.get(row, (0, 0)), (end + window - 1, end))
        return freed

    def release(self, req_pool: ReqToTokenPool, row: int,
                keep_pages: frozenset = frozenset()) -> None:
        """Free ``row``'s pages in both pools (except ``keep_pages``, still shared) and its row
        (ValueError, changing nothing, for a row that is not allocated)."""
        row = req_pool.check_allocated(row, f"release(row={row})")
        self._floor.pop(row, None)
        for fp in self.full.pages_of(row):
            if fp in keep_pages:
                continue
            sp = self._swa_of.pop(fp, None)
            if sp is not None:
                self._map(fp, 0)
                self._swa_free.append(sp)
        self.full.release(req_pool, row, keep_pages)
