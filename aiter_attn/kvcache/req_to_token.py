"""``ReqToTokenPool``: the ``[max_requests, max_context_len]`` table of KV slots per request."""

from __future__ import annotations

import attrs
import torch

__all__ = ["ReqToTokenPool"]


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

    def __attrs_post_init__(self):
        if self.size < 2:
            raise ValueError(f"size={self.size}: need at least 2 rows (row 0 is reserved).")
        self.req_to_token = torch.zeros(
            (self.size, self.max_context_len), dtype=torch.int32, device=self.device
        )
        self._free_rows = list(range(self.size - 1, 0, -1))

    def alloc(self) -> int:
        """Take a free row (never row 0)."""
        if not self._free_rows:
            raise RuntimeError(
                f"ReqToTokenPool is full ({self.size - 1} requests); raise its size "
                "(BackendConfig.max_batch_size or the engine's max_running_requests)."
            )
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self.req_to_token[row].zero_()
        self._free_rows.append(row)

    @property
    def available(self) -> int:
        return len(self._free_rows)
