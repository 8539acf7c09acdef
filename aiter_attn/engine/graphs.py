"""CUDA graphs in the engine: DECODE (and n-gram chain TARGET_VERIFY) steps replay captured
graphs through :class:`~aiter_attn.graph.CudaGraphManager`.

:class:`EngineGraphs` owns one manager for the runner's backend, captured when the runner is
built (before any request holds pages) for the batch sizes :func:`engine_capture_sizes`
derives from ``EngineConfig.max_batch_size``. A real batch is padded to the next captured size
by the manager (padding rows read the null page and write slot 0 of it); only the real rows'
logits come back. EXTEND steps, tree verifies and chain verifies with fewer drafts than
captured stay eager (:meth:`EngineGraphs.serves` says which).

``EngineConfig(cuda_graph=None)`` turns graphs on for a model on CUDA whose forward is known
to be capturable (:func:`graph_capturable`). On the CPU the manager runs in no-capture mode:
it plans into the same static buffers and runs the step function eagerly on the static batch
(CPU mirrors frozen at capture), so forcing ``EngineConfig(cuda_graph=True)`` there exercises
every piece of this path except the graph itself.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Optional

import torch

from ..batch import ForwardBatch
from ..graph import CudaGraphManager
from ..graph.buffers import default_capture_sizes
from ..types import ForwardMode

__all__ = ["EngineGraphs", "engine_capture_sizes", "graph_capturable", "graphs_enabled"]

log = logging.getLogger(__name__)


def graph_capturable(model) -> bool:
    """Whether ``model``'s forward is known to be capturable (static shapes, no host sync):
    its ``cuda_graph_capturable`` attribute if it has one, else True for the engine's own
    :class:`~aiter_attn.engine.model.LlamaFamilyModel` only (transformers modules, e.g. MoE
    routing, may sync)."""
    from .model import LlamaFamilyModel

    flag = getattr(model, "cuda_graph_capturable", None)
    return bool(flag) if flag is not None else isinstance(model, LlamaFamilyModel)


def graphs_enabled(cuda_graph: Optional[bool], model) -> bool:
    """``EngineConfig.cuda_graph`` resolved for ``model``: ``None`` = on when the model is on
    CUDA and :func:`graph_capturable`; ``True``/``False`` as given."""
    if cuda_graph is None:
        return torch.device(model.device).type == "cuda" and graph_capturable(model)
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph={cuda_graph!r} must be True, False or None (None = on "
                        "when the model is on CUDA and capturable).")
    return cuda_graph


def engine_capture_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture for an engine running at most ``max_batch_size`` requests:
    the manager's 1, 2, 4, 8, 16, … ladder, ending at ``max_batch_size``."""
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size!r} must be an int ≥ 1.")
    return default_capture_sizes(max_batch_size)


class EngineGraphs:
    """Capture/replay of the engine's fixed-shape steps.

    Args:
        model: the runner's ``EngineModel``.
        backend: the runner's ``AttentionBackend`` (its ``config.spec`` sizes verify graphs).
        max_batch_size: most requests in one step (the largest captured size).
        verify: also capture chain TARGET_VERIFY (``config.spec.topk == 1`` required).

    Attributes:
        manager: the :class:`CudaGraphManager`.
        replays: ``Counter`` of replayed steps per ``ForwardMode`` name.
        padded: ``Counter`` of those replays that ran with padding rows (real batch smaller
            than the captured size), per ``ForwardMode`` name.
    """

    def __init__(self, model, backend, *, max_batch_size: int, verify: bool = False):
        modes = [ForwardMode.DECODE]
        spec = backend.config.spec
        if verify:
            if spec is None or spec.topk != 1:
                raise ValueError(
                    f"verify graphs need chain drafts (BackendConfig.spec.topk == 1), got "
                    f"spec={spec!r}; pass verify=False to keep TARGET_VERIFY eager.")
            modes.append(ForwardMode.TARGET_VERIFY)
        self.model = model
        self.backend = backend
        self.manager = CudaGraphManager(
            backend, capture_sizes=engine_capture_sizes(max_batch_size), modes=modes,
            token_inputs={"input_ids": ((), torch.int64)})
        self._captured = False
        self.replays: Counter = Counter()
        self.padded: Counter = Counter()

    @property
    def uses_cuda_graph(self) -> bool:
        """True when real graphs are captured (CUDA); False in no-capture mode (CPU)."""
        return self.manager.use_cuda_graph

    def serves(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` replays a graph: a captured mode, the captured tokens per request,
        no custom (tree) mask, at most the largest captured size (host ints only)."""
        mode, bs = batch.forward_mode, batch.batch_size
        if mode not in self.manager.modes or not 1 <= bs <= self.manager.capture_sizes[-1]:
            return False
        spec = batch.spec_info
        if spec is not None and spec.custom_mask is not None:
            return False
        return batch.num_tokens == bs * self.manager.limits(mode).q_len

    def _step(self, batch: ForwardBatch, inputs: dict) -> torch.Tensor:
        return self.model.forward(inputs["input_ids"], batch.positions, batch, self.backend)

    def capture(self) -> None:
        """Capture every mode and size (once; the runner calls it when it is built, and
        :meth:`run` makes sure it happened)."""
        if self._captured:
            return
        with torch.inference_mode():
            self.manager.capture(self._step)
        self._captured = True
        log.info("engine graphs: %s for sizes %s (%s)",
                 "/".join(m.name for m in self.manager.modes), self.manager.capture_sizes,
                 "CUDA graphs" if self.uses_cuda_graph else "no-capture mode")

    def run(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[batch.num_tokens, vocab]`` of ``batch`` (one row per token),
        replayed at the next captured size. The result is a view of static memory that the
        next replay overwrites: consume (or clone) it first."""
        self.capture()
        with torch.inference_mode():
            logits = self.manager.replay(batch, input_ids=input_ids)
        self.replays[batch.forward_mode.name] += 1
        if self.manager.last_entry.bs > batch.batch_size:
            self.padded[batch.forward_mode.name] += 1
        return logits
