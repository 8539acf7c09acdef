"""KV bookkeeping for the engine: request rows, pages, reservations and prefix sharing.

Admission reserves every page a request can ever need (K/V of prompt + ``max_new_tokens`` - 1
tokens: the last generated token is never fed; :meth:`KVCacheManager.max_kv_tokens_of`), so a
running request never runs out of pages and nothing has to be preempted. Prefix caching lets
a new request reuse the whole, already computed pages of a running request whose tokens start
the same way (``PageAllocator.share_prefix``); pages are reference counted here, and a page
returns to the free list when its last holder finishes.

With the hybrid SWA pool (``swa_window`` set by :mod:`aiter_attn.engine.arch`) a donor returns
the SWA copies of pages that fell out of its window. A prefix of ``n`` tokens is then reused
only if the donor still holds the SWA pages of its last ``swa_window`` tokens (what the new
request's first query sees; otherwise nothing is reused and the prompt is recomputed), and a
shared page keeps its SWA copy until it is out of the window of every request holding it
(:meth:`KVCacheManager.swa_keep_pages`).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..kvcache import PageAllocator, ReqToTokenPool
from .request import Request

__all__ = ["KVCacheManager"]

log = logging.getLogger(__name__)


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVCacheManager:
    """Owns the ``ReqToTokenPool`` and the ``PageAllocator`` of one engine.

    Args:
        num_pages: pages in the pool (page 0 is the null page).
        page_size: tokens per page.
        max_requests: requests that may run at once.
        max_context_len: most tokens one request may hold.
        device: where ``req_to_token`` lives.
        prefix_caching: reuse the computed whole pages of running requests.
        shuffle_seed: hand out pages in a seeded random order (block-permuted pools for tests).
    """

    def __init__(self, *, num_pages: int, page_size: int, max_requests: int,
                 max_context_len: int, device="cpu", prefix_caching: bool = True,
                 shuffle_seed: Optional[int] = None):
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_context_len = max_context_len
        self.prefix_caching = prefix_caching
        self.req_pool = ReqToTokenPool(max_requests + 1, max_context_len, str(device))
        self.allocator = PageAllocator(num_pages, page_size, shuffle_seed=shuffle_seed)
        self._live: dict[int, Request] = {}  # row -> running request
        self._refs: dict[int, int] = {}  # page -> holders
        self._reserved = 0  # pages promised to running requests, not yet handed out
        #: largest sliding window of the hybrid SWA pool's layers (``None``: no SWA pool)
        self.swa_window: Optional[int] = None

    # -- sizing ---------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def max_tokens_of(self, req: Request) -> int:
        return min(len(req.prompt_ids) + req.params.max_new_tokens, self.max_context_len)

    def max_kv_tokens_of(self, req: Request) -> int:
        """Most tokens whose K/V ``req`` ever holds: all of its tokens but the last generated
        one, which finishes it unfed (speculative drafts never go past this either)."""
        return self.max_tokens_of(req) - 1

    def check_fits(self, req: Request) -> None:
        """Raise if ``req`` could never run on this pool, naming the setting to change."""
        if len(req.prompt_ids) == 0:
            raise ValueError(f"request {req.rid} has an empty prompt; give at least one token.")
        if len(req.prompt_ids) >= self.max_context_len:
            raise ValueError(
                f"request {req.rid}: prompt of {len(req.prompt_ids)} tokens leaves no room to "
                f"generate under max_context_len={self.max_context_len}; raise max_context_len."
            )
        need = self.pages_for(self.max_kv_tokens_of(req))
        if need > self.num_pages - 1:
            raise ValueError(
                f"request {req.rid} may need {need} pages of {self.page_size} tokens but the pool "
                f"has {self.num_pages - 1}; raise the KV pool size (kv_tokens) or lower "
                "max_new_tokens."
            )

    @property
    def available_pages(self) -> int:
        """Free pages not promised to a running request."""
        return self.allocator.free_pages - self._reserved

    @property
    def available_rows(self) -> int:
        return self.req_pool.available

    # -- lifecycle ------------------------------------------------------------------------
    def _best_donor(self, req: Request):
        best, best_len = None, 0
        limit = len(req.prompt_ids) - 1  # the last prompt token must be fed to get logits
        for donor in self._live.values():
            n = _common_prefix(req.prompt_ids[:limit], donor.tokens[: donor.num_computed])
            n = (n // self.page_size) * self.page_size
            if n > best_len and self._swa_prefix_held(donor, n):
                best, best_len = donor, n
        return best, best_len

    def _swa_prefix_held(self, donor: Request, n: int) -> bool:
        """True when ``donor`` still holds the SWA copy of every page overlapping the last
        ``swa_window`` of its first ``n`` tokens (always true without an SWA pool). A query at
        position ``p ≥ n`` sees keys ``≥ p - window + 1 ≥ n - window + 1``."""
        if self.swa_window is None:
            return True
        first = max(n - self.swa_window + 1, 0) // self.page_size
        swa_pages = self.allocator.swa_pages_of(donor.row)
        return all(swa_pages[first:n // self.page_size])

    def swa_keep_pages(self, req: Request) -> frozenset:
        """Pages of ``req`` whose SWA copy another running holder still needs: shared pages
        (same index in every holder) that are not yet out of that holder's window, given its
        next query position ``num_computed``. Pass as ``keep_pages`` when freeing ``req``'s
        out-of-window SWA pages."""
        if self.swa_window is None or req.row is None:
            return frozenset()
        pages = self.allocator.pages_of(req.row)
        shared = {p: i for i, p in enumerate(pages) if self._refs.get(p, 1) > 1}
        if not shared:
            return frozenset()
        keep = set()
        for other in self._live.values():
            if other is req:
                continue
            first_visible = other.num_computed - self.swa_window + 1
            for p in self.allocator.pages_of(other.row):
                i = shared.get(p)
                if i is not None and (i + 1) * self.page_size - 1 >= first_visible:
                    keep.add(p)
        return frozenset(keep)

    def prefix_in_flight(self, req: Request) -> bool:
        """True when a running request is still prefilling whole pages that ``req``'s prompt
        shares with it (waiting a step or two then lets ``req`` reuse them)."""
        if not self.prefix_caching:
            return False
        limit = len(req.prompt_ids) - 1
        for donor in self._live.values():
            n = _common_prefix(req.prompt_ids[:limit], donor.prompt_ids)
            if n // self.page_size > min(n, donor.num_computed) // self.page_size:
                return True
        return False

    def try_admit(self, req: Request) -> bool:
        """Give ``req`` a row, its reused prefix and its page reservation; False if full."""
        if self.available_rows == 0:
            return False
        donor, shared = self._best_donor(req) if self.prefix_caching else (None, 0)
        need = self.pages_for(self.max_kv_tokens_of(req)) - shared // self.page_size
        if need > self.available_pages:
            return False
        row = self.req_pool.alloc()
        req.row = row
        if donor is not None:
            n = self.allocator.share_prefix(self.req_pool, donor.row, row, shared)
            pages = self.allocator.pages_of(row)
            for p in pages:
                self._refs[p] = self._refs.get(p, 1) + 1
            req.cached_tokens, req.shared_pages = n, pages
            req.num_computed = n
            log.debug("request %d reuses %d tokens (%d pages) of request %d", req.rid, n,
                      len(pages), donor.rid)
        req.reserved_pages = need
        self._reserved += need
        self._live[row] = req
        return True

    def extend(self, req: Request, num_tokens: int) -> torch.Tensor:
        """Slots (int64 ``[num_tokens]``) for the next ``num_tokens`` tokens of ``req``."""
        before = len(self.allocator.pages_of(req.row))
        slots = self.allocator.extend(self.req_pool, req.row, num_tokens)
        new_pages = self.allocator.pages_of(req.row)[before:]
        for p in new_pages:
            self._refs[p] = 1
        used = min(len(new_pages), req.reserved_pages)
        req.reserved_pages -= used
        self._reserved -= used
        return slots

    def release(self, req: Request) -> None:
        """Return ``req``'s row, its unused reservation, and every page nobody else holds."""
        if req.row is None:
            return
        pages = self.allocator.pages_of(req.row)
        keep = set()
        for p in pages:
            left = self._refs.get(p, 1) - 1
            if left > 0:
                self._refs[p] = left
                keep.add(p)
            else:
                self._refs.pop(p, None)
        self.allocator.release(self.req_pool, req.row, keep_pages=frozenset(keep))
        self._reserved -= req.reserved_pages
        req.reserved_pages = 0
        req.pages = pages
        self._live.pop(req.row, None)
        req.row = None

    def page_refcount(self, page: int) -> int:
        return self._refs.get(page, 0)
