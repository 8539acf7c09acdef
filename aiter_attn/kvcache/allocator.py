"""Page allocation for a paged KV cache, with page 0 (slots ``0..page_size-1``) reserved as the
null page that padding and unused page-table entries point to."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ._layers import check_int, check_page_size
from .req_to_token import ReqToTokenPool, row_index

__all__ = ["PageAllocator", "check_token_count"]


def check_token_count(value, name: str) -> int:
    """A count of tokens as an int: ValueError unless an integer ≥ 0 (a bool or a float, even
    a whole one, is refused: it would become a float length or slot)."""
    return check_int(value, name, 0, " (a number of tokens)")


@attrs.define(eq=False)
class PageAllocator:
    """Hands out pages and fills ``req_to_token`` with their slots.

    A request's tokens fill its pages in order, so token ``i`` lives at slot
    ``page_of(i // page_size) * page_size + i % page_size`` and a page table is
    ``req_to_token[:, ::page_size] // page_size``.

    Args:
        num_pages: pages in the pool, the null page 0 included.
        page_size: tokens per page.
        shuffle_seed: if set, free pages are handed out in a seeded random order (tests use
            this for block-permuted pools, so reading a wrong page shows).
    """

    num_pages: int
    page_size: int
    shuffle_seed: Optional[int] = None
    _free: list = attrs.field(init=False)
    _pages_of: dict = attrs.field(init=False, factory=dict)  # req row -> list of pages
    _lens: dict = attrs.field(init=False, factory=dict)  # req row -> tokens held

    def __attrs_post_init__(self):
        check_page_size(self.page_size, "PageAllocator")
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages}: need ≥ 2 (page 0 is the null page).")
        pages = list(range(1, self.num_pages))
        if self.shuffle_seed is not None:
            g = torch.Generator().manual_seed(self.shuffle_seed)
            pages = [pages[i] for i in torch.randperm(len(pages), generator=g).tolist()]
        self._free = pages[::-1]  # pop() from the end hands out pages[0] first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def tokens_held(self, row: int) -> int:
        return self._lens.get(row_index(row, "tokens_held"), 0)

    def pages_of(self, row: int) -> list[int]:
        return list(self._pages_of.get(row_index(row, "pages_of"), []))

    def extend(self, pool: ReqToTokenPool, row: int, num_new_tokens: int) -> torch.Tensor:
        """Reserve slots for ``num_new_tokens`` more tokens of request ``row``.

        Returns int64 ``[num_new_tokens]`` slots (the step's ``out_cache_loc`` part) on the
        pool's device, and writes them into ``pool.req_to_token[row]``.
        """
        num_new_tokens = check_token_count(num_new_tokens, "num_new_tokens")
        row = pool.check_allocated(row, f"extend(row={row})")
        start = self._lens.get(row, 0)
        end = start + num_new_tokens
        if end > pool.max_context_len:
            raise ValueError(
                f"request row {row} would hold {end} tokens > max_context_len="
                f"{pool.max_context_len}; raise BackendConfig.max_context_len or cut the request."
            )
        pages = self._pages_of.setdefault(row, [])
        need = -(-end // self.page_size) - len(pages)
        if need > len(self._free):
            raise RuntimeError(
                f"KV pool out of pages: need {need}, {len(self._free)} free of {self.num_pages}; "
                "raise the pool's num_pages or admit fewer requests."
            )
        for _ in range(need):
            pages.append(self._free.pop())
        pos = torch.arange(start, end, dtype=torch.int64)
        page_ids = torch.as_tensor(pages, dtype=torch.int64)
        slots = page_ids[pos // self.page_size] * self.page_size + pos % self.page_size
        self._lens[row] = end
        slots = slots.to(pool.device)
        pool.req_to_token[row, start:end] = slots.to(torch.int32)
        return slots

    def truncate(self, row: int, num_tokens: int) -> None:
        """Forget every token of ``row`` past ``num_tokens`` (rejected speculative drafts).

        The row keeps its pages (the next ``extend`` reuses their slots); only the held length
        moves back. Raises unless ``0 ≤ num_tokens ≤ tokens_held(row)``.
        """
        row = row_index(row, "truncate")
        num_tokens = check_token_count(num_tokens, "num_tokens")
        held = self._lens.get(row, 0)
        if not 0 <= num_tokens <= held:
            raise ValueError(
                f"truncate(row={row}, num_tokens={num_tokens}): must be in 0..{held}, the "
                "tokens the row holds."
            )
        self._lens[row] = num_tokens

    def share_prefix(self, pool: ReqToTokenPool, src_row: int, dst_row: int, num_tokens: int) -> int:
        """Let ``dst_row`` reuse the first whole pages of ``src_row`` (prefix caching).

        Only whole pages are shared (a partial page would be written by both). Returns the
        number of tokens now cached for ``dst_row``; pages are reference counted by the caller.
        """
        num_tokens = check_token_count(num_tokens, "num_tokens")
        src_row = row_index(src_row, "share_prefix(src_row)")
        if src_row not in self._pages_of:
            raise ValueError(f"share_prefix: src_row={src_row} holds no pages of this allocator; "
                             "share from a live request that was extended.")
        dst_row = pool.check_allocated(dst_row, f"share_prefix(dst_row={dst_row})")
        shared_pages = min(num_tokens, self._lens.get(src_row, 0)) // self.page_size
        if self._lens.get(dst_row, 0) or self._pages_of.get(dst_row):
            # a row truncated to 0 tokens still owns its pages: replacing them would leak them
            raise ValueError(f"dst_row={dst_row} already holds tokens or pages; share before "
                             "extending (or release the row and share into a fresh one).")
        pages = self._pages_of[src_row][:shared_pages]
        self._pages_of[dst_row] = list(pages)
        n = shared_pages * self.page_size
        self._lens[dst_row] = n
        pool.req_to_token[dst_row, :n] = pool.req_to_token[src_row, :n]
        return n

    def release(self, pool: ReqToTokenPool, row: int, keep_pages: frozenset = frozenset()) -> None:
        """Return the pages of request ``row`` (except ``keep_pages``, still shared) and its row.

        Raises ValueError, changing nothing, for a row that is not allocated (released twice,
        never handed out, row 0): freeing it again would hand it to two requests."""
        row = pool.check_allocated(row, f"release(row={row})")
        for p in self._pages_of.pop(row, []):
            if p not in keep_pages:
                self._free.append(p)
        self._lens.pop(row, None)
        pool.free(row)
