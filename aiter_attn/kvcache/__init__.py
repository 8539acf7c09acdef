"""Paged KV cache: request→token table, page allocation with a null page, per-arch KV pools."""

from .allocator import PageAllocator
from .mha import MHAKVPool
from .mla import MLAKVPool
from .req_to_token import ReqToTokenPool
from .swa import SWAKVPool, SWAPageAllocator
from .vec5d import Vec5DKVPool

__all__ = ["ReqToTokenPool", "PageAllocator", "MHAKVPool", "MLAKVPool", "SWAKVPool",
           "SWAPageAllocator", "Vec5DKVPool"]
