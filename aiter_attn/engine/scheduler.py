"""Continuous batching: which requests run in the next step and with how many tokens.

Every step, each running request whose prompt is fully fed decodes one token; the rest of the
step's token budget goes to prefill chunks, first of requests already prefilling, then of
waiting requests admitted in arrival order while rows and pages allow. Requests join and
leave only between steps. With prefix caching, a waiting request whose prompt shares whole
pages with a request still prefilling them waits until those pages are computed, then reuses
them.
"""

from __future__ import annotations

from collections import deque

import attrs

from .kv_manager import KVCacheManager
from .request import Request, RequestStatus

__all__ = ["StepPlan", "Scheduler"]


@attrs.frozen
class StepPlan:
    """One step: ``prefill`` = ``((request, num_tokens), ...)`` chunks; ``decode`` = requests
    feeding their last sampled token."""

    prefill: tuple = ()
    decode: tuple = ()

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """FCFS continuous-batching scheduler with chunked prefill under a token budget.

    Args:
        kv: the engine's KV bookkeeping (rows, pages, prefix sharing).
        max_batch_size: most running requests.
        max_tokens_per_step: token budget of one step (decode tokens count first).
        chunk_size: most prompt tokens one request feeds in one step.
    """

    def __init__(self, kv: KVCacheManager, *, max_batch_size: int, max_tokens_per_step: int,
                 chunk_size: int):
        for name, value in (("max_batch_size", max_batch_size),
                            ("max_tokens_per_step", max_tokens_per_step),
                            ("chunk_size", chunk_size)):
            if value < 1:
                raise ValueError(f"{name}={value} must be ≥ 1.")
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        self.chunk_size = chunk_size
        self.waiting: deque = deque()
        self.running: list = []
        self.step_index = 0

    def add(self, req: Request) -> None:
        self.kv.check_fits(req)
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Plan the next step (admits waiting requests; changes no token counts)."""
        decode = [r for r in self.running if r.prefill_done]
        budget = self.max_tokens_per_step - len(decode)
        prefill = []
        for r in self.running:
            if budget <= 0:
                break
            if not r.prefill_done:
                n = min(r.num_pending, budget, self.chunk_size)
                prefill.append((r, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            r = self.waiting[0]
            if self.kv.prefix_in_flight(r) or not self.kv.try_admit(r):
                break
            self.waiting.popleft()
            r.status = RequestStatus.RUNNING
            r.joined_step = self.step_index
            self.running.append(r)
            n = min(r.num_pending, budget, self.chunk_size)
            prefill.append((r, n))
            budget -= n
        if not prefill and not decode and self.waiting:
            r = self.waiting[0]
            raise RuntimeError(
                f"request {r.rid} cannot be admitted even with nothing running "
                f"({self.kv.available_pages} pages, {self.kv.available_rows} rows free); "
                "raise the KV pool size or lower max_new_tokens."
            )
        self.step_index += 1
        return StepPlan(prefill=tuple(prefill), decode=tuple(decode))

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished and free its pages (before the next step is planned)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.release(req)
        self.running.remove(req)
