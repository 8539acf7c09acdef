"""What the graph manager plans through: one small adapter per kind of backend.

The manager never branches on modes or architectures; it asks a *source* for a planner per
captured mode. A planner has the same ``plan(batch, out=buffers)`` as eager planning, declares
its buffers from :class:`~aiter_attn.graph.buffers.GraphLimits`, and binds the planned
metadata where the step function will find it.

A backend names its source itself (``backend.graph_source()``), so nothing here probes
attributes:

* :class:`BackendSource`: an :class:`~aiter_attn.AttentionBackend`; the planner of a mode is
  the registry's metadata strategy for ``(mode, config.arch)`` and the kernels its execution
  strategy bound.
* :class:`MultiStepSource`: a :class:`~aiter_attn.multistep.MultiStepDraftBackend`; one DECODE
  planner that plans every draft step at once (shared index buffers, then each step's metadata
  and kernel plans through the backend's one strategy pair, step ``i``'s into ``step{i}.``
  buffers); the step function calls ``ms.forward(i, …)`` per step and layer.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..batch import ForwardBatch
from ..strategies.base import BufferSpec
from ..contract import capturable_modes, contract_of
from ..registry import StrategySelectionError
from ..types import BackendConfig, CGSupport, ForwardMode
from .buffers import GraphLimits

__all__ = ["BackendSource", "MultiStepSource", "source_for", "check_kernels_capturable"]


def _min_support(mode: ForwardMode, pair=None) -> CGSupport:
    """What capturing ``mode`` needs: its contract's ``capture_needs`` (the pair's contract
    when given)."""
    contract = pair.contract(mode) if pair is not None else contract_of(mode)
    return contract.capture_needs if contract.capture_needs is not None else CGSupport.ALWAYS


def check_kernels_capturable(executor, mode: ForwardMode, need: CGSupport, arch,
                             strategy: str) -> None:
    """Raise ValueError naming the first kernel bound by ``executor`` whose ``cg_support``
    is below ``need`` (what capturing ``mode`` needs), and the setting to change."""
    for group in executor.groups.values():
        k = group.kernel
        if k.cg_support < need:
            raise ValueError(
                f"kernel {k.name!r} (op {k.op}) serving {mode.name} × {arch.name} via strategy "
                f"{strategy!r} declares cg_support={k.cg_support.name}; capturing {mode.name} "
                f"needs {need.name} or stronger. Pick a capturable kernel "
                "(BackendConfig.kernel_backend / AITER_ATTN_BACKEND, e.g. 'triton') or "
                f"leave {mode.name} out of CudaGraphManager(modes=...).")


class _StrategyPlanner:
    """A registry metadata strategy, bound through the backend facade."""

    rows_per_request_of = staticmethod(lambda limits: limits.q_len)

    def __init__(self, backend, mode: ForwardMode):
        pair = backend.pair_for(mode)
        if pair.cg_support < _min_support(mode, pair):
            raise ValueError(
                f"strategy {pair.name!r} serving {mode.name} × {backend.config.arch.name} declares "
                f"cg_support={pair.cg_support.name}; capturing {mode.name} needs "
                f"{_min_support(mode, pair).name} or stronger. Leave {mode.name} out of modes.")
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
        check_kernels_capturable(self.executor, self.mode,
                                 _min_support(self.mode, self.backend.pair_for(self.mode)),
                                 self.backend.config.arch, self.name)

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
        """DECODE, plus the speculative modes a capturable strategy serves when spec is set.

        The pair of a mode is the one the backend itself would plan with
        (``backend.pair_for``: a forced ``AttentionBackend(strategy=...)`` included); a mode
        it cannot serve is left out."""
        modes = [ForwardMode.DECODE]
        if self.config.spec is not None:
            for m in capturable_modes():
                try:
                    pair = self.backend.pair_for(m)
                except StrategySelectionError:
                    continue
                if pair.contract(m).tokens != "draft":
                    continue
                if pair.cg_support >= _min_support(m, pair):
                    modes.append(m)
        return modes

    def contract(self, mode: ForwardMode):
        """The mode contract of the pair serving ``mode`` (what the graph limits read)."""
        try:
            return self.backend.pair_for(mode).contract(mode)
        except ValueError:  # no pair serves it: the manager reports that when it plans
            return contract_of(mode)

    def planner(self, mode: ForwardMode) -> _StrategyPlanner:
        return _StrategyPlanner(self.backend, mode)

    def planner_key(self, mode: ForwardMode) -> str:
        """Modes whose planners share a key share one set of buffers (one strategy pair)."""
        return self.backend.pair_for(mode).name


class _MultiStepPlanner:
    """Every draft-decode step planned at once (``MultiStepDraftBackend.init_forward_metadata``).

    The "metadata" whose frozen parts the manager checks is the list of
    ``(step batch, step metadata)`` pairs: their device tensors are views of the shared step
    buffers and their kernel plans live in the ``step{i}.`` buffers, so none may move
    between capture and replay.
    """

    name = "multi_step_draft"

    def __init__(self, ms):
        self.ms = ms
        self.mode = ForwardMode.DECODE
        need = _min_support(self.mode, ms.pair)
        if ms.pair.cg_support < need:
            raise ValueError(
                f"step strategy {ms.pair.name!r} declares cg_support={ms.pair.cg_support.name}; "
                f"capturing multi-step draft decode needs {need.name} or stronger. Pass "
                "MultiStepDraftBackend(step_strategy=) a capturable pair, or run it eagerly.")

    def rows_per_request_of(self, limits: GraphLimits) -> int:
        return self.ms.rows_per_request

    def buffer_spec(self, limits: GraphLimits) -> BufferSpec:
        return self.ms.buffer_spec(limits.max_bs, limits.max_seq_len)

    def plan(self, batch: ForwardBatch, out: dict):
        steps = self.ms.init_forward_metadata(batch, out=out)
        return list(zip(steps, self.ms.step_metadata))

    def check_capturable(self) -> None:
        """Raise if a kernel the steps bound cannot run under CUDA-graph capture."""
        check_kernels_capturable(self.ms.executor, self.mode, _min_support(self.mode,
                                                                           self.ms.pair),
                                 self.ms.config.arch, self.ms.pair.name)

    def bind(self, run_batch: ForwardBatch, metadata) -> None:
        """The plan itself made every step current in the multi-step backend."""


class MultiStepSource:
    """Plans multi-step draft decode through a :class:`~aiter_attn.multistep.MultiStepDraftBackend`.

    The captured batch is the DECODE batch of committed lengths the draft model continues;
    the step function runs every draft step, calling ``ms.forward(i, q, k, v, layer)``. Token
    inputs have ``ms.rows_per_request`` (``topk``) rows per request. The bounds come from the
    step pair's DECODE contract.
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

    def contract(self, mode: ForwardMode):
        """The step pair's contract of ``mode`` (DECODE: one token per branch row)."""
        return self.ms.pair.contract(mode)


def source_for(backend) -> "BackendSource | MultiStepSource":
    """The planning adapter of ``backend``: a source as is, else ``backend.graph_source()``
    (:class:`~aiter_attn.AttentionBackend` → :class:`BackendSource`,
    :class:`~aiter_attn.multistep.MultiStepDraftBackend` → :class:`MultiStepSource`)."""
    if isinstance(backend, (BackendSource, MultiStepSource)):
        return backend
    make = getattr(type(backend), "graph_source", None)
    if make is None:
        raise TypeError(
            f"CudaGraphManager plans through an aiter_attn.AttentionBackend or a "
            f"MultiStepDraftBackend (or a class whose graph_source() returns a BackendSource / "
            f"MultiStepSource), got {type(backend).__name__}.")
    return make(backend)
