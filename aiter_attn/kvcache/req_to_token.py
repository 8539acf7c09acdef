"""``ReqToTokenPool``: the ``[max_requests, max_context_len]`` table of KV slots per request."""

from __future__ import annotations

import operator

import attrs
import torch

__all__ = ["ReqToTokenPool", "row_index"]


def row_index(row, what: str = "row") -> int:
    """``row`` as a Python int: an int, a NumPy int or a one-element integer tensor (a row read
    from ``req_pool_indices``). Rows key the allocators' dicts and the free set, where a tensor
    hashes by identity, so each is turned into its int first; a bool, a float or anything else
    raises ValueError."""
    is_bool = isinstance(row, bool) or (isinstance(row, torch.Tensor) and row.dtype == torch.bool)
    try:
        if not is_bool:
            return operator.index(row)
    except TypeError:
        pass
    raise ValueError(f"{what}: row={row!r} is not a row index; pass the int that "
                     "ReqToTokenPool.alloc() returned.")


@attrs.define(eq=False)
class ReqToTokenPool:
    """Owns ``req_to_token``: int32 ``[size, max_context_len]``; row r, column i is the KV slot
    of token i of the request in row r. Row 0 is never handed out (padding rows point at it and
    it maps every token to the null slot 0).
    """

    size: int
    max_context_len: int
    device: str = "cpu"
    req_to_token: torch.Tensor = attrs.field(init=False)
    _free_rows: list = attrs.field(init=False)
    _free_set: set = attrs.field(init=False)  # the same rows, for membership checks

    def __attrs_post_init__(self):
        if self.size < 2:
            raise ValueError(f"size={self.size}: need at least 2 rows (row 0 is reserved).")
        self.req_to_token = torch.zeros(
            (self.size, self.max_context_len), dtype=torch.int32, device=self.device
        )
        self._free_rows = list(range(self.size - 1, 0, -1))
        self._free_set = set(self._free_rows)

    def alloc(self) -> int:
        """Take a free row (never row 0)."""
        if not self._free_rows:
            raise RuntimeError(
                f"ReqToTokenPool is full ({self.size - 1} requests); raise its size "
                "(BackendConfig.max_batch_size or the engine's max_running_requests)."
            )
        row = self._free_rows.pop()
        self._free_set.discard(row)
        return row

    def check_allocated(self, row: int, what: str = "row") -> int:
        """``row`` as an int (:func:`row_index`); raise ValueError unless it was handed out by
        :meth:`alloc` and not freed since (row 0 is reserved for padding: it never holds slots
        and is never freed)."""
        row = row_index(row, what)
        if row == 0:
            raise ValueError(
                f"{what}: row 0 is reserved (padding rows of captured batches read it; it must "
                "stay all zeros); use a row from ReqToTokenPool.alloc().")
        if not 0 < row < self.size:
            raise ValueError(f"{what}: row {row} is outside the pool's rows 1..{self.size - 1}; "
                             "use a row from ReqToTokenPool.alloc().")
        if row in self._free_set:
            raise ValueError(
                f"{what}: row {row} is not allocated (never handed out, or already released); "
                "release each request once, and only rows from ReqToTokenPool.alloc().")
        return row

    def free(self, row: int) -> None:
        """Return ``row`` (zeroed) to the free list; raises for row 0, a row outside the pool
        or one that is already free (it would be handed to two requests)."""
        row = self.check_allocated(row, f"free(row={row})")
        self.req_to_token[row].zero_()
        self._free_rows.append(row)
        self._free_set.add(row)

    @property
    def available(self) -> int:
        return len(self._free_rows)
