"""What the graph manager plans through: one small adapter per kind of backend.

The manager never branches on modes or architectures; it asks a *source* for a planner per
captured mode. A planner has the same ``plan(batch, out=buffers)`` as eager planning, declares
its buffers from :class:`~aiter_attn.graph.buffers.GraphLimits`, and binds the planned
metadata where the step function will find it.

* :class:`BackendSource`: an :class:`~aiter_attn.AttentionBackend`; the planner of a mode is
  the registry's metadata strategy for ``(mode, config.arch)``.
* :class:`MultiStepSource`: a :class:`~aiter_attn.multistep.MultiStepDraftBackend`; one DECODE
  planner that plans every draft step at once into the shared step buffers, and binds each
  step backend to its step batch (``ms.step_batches[i]``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..batch import ForwardBatch
from ..strategies.base import BufferSpec
from ..types import BackendConfig, CGSupport, ForwardMode
from .buffers import GraphLimits

__all__ = ["BackendSource", "MultiStepSource", "source_for"]


def _min_support(mode: ForwardMode) -> CGSupport:
    if mode == ForwardMode.DECODE:
        return CGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    return CGSupport.UNIFORM_BATCH


class _StrategyPlanner:
    """A registry metadata strategy, bound through the backend facade."""

    rows_per_request_of = staticmethod(lambda limits: limits.q_len)

    def __init__(self, backend, mode: ForwardMode):
        pair = backend.pair_for(mode)
        if pair.cg_support < _min_support(mode):
            raise ValueError(
                f"strategy {pair.name!r} serving {mode.name} × {backend.config.arch.name} declares "
                f"cg_support={pair.cg_support.name}; capturing {mode.name} needs "
                f"{_min_support(mode).name} or stronger. Leave {mode.name} out of modes.")
        self.backend = backend
        self.name = pair.name
        self.mode = mode
        self.strategy, self.executor = backend.strategies_for(mode)

    def buffer_spec(self, limits: GraphLimits) -> BufferSpec:
        """The metadata strategy's buffers merged with its bound kernels' (the kernels a
        layer binds later add theirs to the same dict at their first static plan)."""
        spec = self.strategy.buffer_spec(limits.max_bs, limits.max_num_tokens,
                                         limits.max_seq_len)
        return spec.merge(self.executor.kernel_buffer_spec(limits))

    def plan(self, batch: ForwardBatch, out: dict):
        md = self.strategy.plan(batch, out=out)
        self.executor.plan_kernels(md, batch, out)
        return md

    def check_capturable(self) -> None:
        """Raise if a bound kernel of this cell cannot run under CUDA-graph capture."""
        need = _min_support(self.mode)
        for group in self.executor.groups.values():
            k = group.kernel
            if k.cg_support < need:
                raise ValueError(
                    f"kernel {k.name!r} (op {k.op}) serving {self.mode.name} × "
                    f"{self.backend.config.arch.name} via strategy {self.name!r} declares "
                    f"cg_support={k.cg_support.name}; capturing {self.mode.name} needs "
                    f"{need.name} or stronger. Pick a capturable kernel "
                    "(BackendConfig.kernel_backend / AITER_ATTN_BACKEND, e.g. 'triton') or "
                    f"leave {self.mode.name} out of CudaGraphManager(modes=...).")

    def bind(self, run_batch: ForwardBatch, metadata) -> None:
        self.backend.bind_forward_metadata(run_batch, metadata)


class BackendSource:
    """Plans through an :class:`~aiter_attn.AttentionBackend`'s strategies."""

    def __init__(self, backend):
        self.backend = backend
        self.config: BackendConfig = backend.config
        self.req_to_token: torch.Tensor = backend.ctx.req_to_token

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device

    def fill_value(self) -> int:
        return int(self.backend.get_cuda_graph_seq_len_fill_value())

    def default_modes(self) -> list[ForwardMode]:
        """DECODE, plus the speculative modes a capturable strategy serves when spec is set."""
        modes = [ForwardMode.DECODE]
        if self.config.spec is not None:
            for m in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
                pair, _ = self.backend.strategies.candidates(m, self.config.arch, self.config)
                if pair is not None and pair.cg_support >= _min_support(m):
                    modes.append(m)
        return modes

    def planner(self, mode: ForwardMode) -> _StrategyPlanner:
        return _StrategyPlanner(self.backend, mode)

    def planner_key(self, mode: ForwardMode) -> str:
        """Modes whose planners share a key share one set of buffers (one strategy pair)."""
        return self.backend.pair_for(mode).name


class _MultiStepPlanner:
    """Every draft-decode step planned at once (``MultiStepDraftBackend.init_forward_metadata``).

    The "metadata" whose frozen parts the manager checks is the list of
    ``(step batch, step metadata)`` pairs: their device tensors are views of the shared step
    buffers, so they must not move between capture and replay.
    """

    name = "multi_step_draft"

    def __init__(self, ms):
        self.ms = ms

    def rows_per_request_of(self, limits: GraphLimits) -> int:
        return self.ms.topk

    def buffer_spec(self, limits: GraphLimits) -> BufferSpec:
        return self.ms.buffer_spec(limits.max_bs, limits.max_seq_len)

    def plan(self, batch: ForwardBatch, out: dict):
        steps = self.ms.init_forward_metadata(batch, out=out)
        return [(sb, be.forward_metadata) for sb, be in zip(steps, self.ms.attn_backends)]

    def bind(self, run_batch: ForwardBatch, metadata) -> None:
        """Each step backend was bound to its step batch by the plan itself."""


class MultiStepSource:
    """Plans multi-step draft decode through a :class:`~aiter_attn.multistep.MultiStepDraftBackend`.

    The captured batch is the DECODE batch of committed lengths the draft model continues;
    the step function runs every draft step, reading ``ms.step_batches[i]`` and calling
    ``ms.attn_backends[i].forward``. Token inputs have ``topk`` rows per request.
    """

    def __init__(self, ms):
        self.ms = ms
        self.config: BackendConfig = ms.config
        self.req_to_token: torch.Tensor = ms.req_to_token

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device

    def fill_value(self) -> int:
        return 1

    def default_modes(self) -> list[ForwardMode]:
        return [ForwardMode.DECODE]

    def planner(self, mode: ForwardMode) -> _MultiStepPlanner:
        if mode != ForwardMode.DECODE:
            raise ValueError(
                f"multi-step draft decode is captured as DECODE batches of committed lengths; "
                f"got modes containing {mode.name}. Use modes=['decode'].")
        return _MultiStepPlanner(self.ms)

    def planner_key(self, mode: ForwardMode) -> str:
        return _MultiStepPlanner.name


def source_for(backend) -> "BackendSource | MultiStepSource":
    """The adapter for ``backend`` (an AttentionBackend or a MultiStepDraftBackend)."""
    if isinstance(backend, (BackendSource, MultiStepSource)):
        return backend
    if hasattr(backend, "attn_backends") and hasattr(backend, "step_batches"):
        return MultiStepSource(backend)  # a MultiStepDraftBackend
    if not hasattr(backend, "strategies_for"):
        raise TypeError(
            f"backend must be an aiter_attn.AttentionBackend or a MultiStepDraftBackend, got "
            f"{type(backend).__name__}.")
    return BackendSource(backend)
