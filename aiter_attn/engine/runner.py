"""One forward of the model over the paged KV cache: builds the step's ``ForwardBatch``.

A pure decode step is one DECODE forward; a step with prefill chunks is one EXTEND forward,
its decoding requests (if any) riding along as extend rows of length 1 (or a separate DECODE
forward with ``EngineConfig(mixed_steps=False)``). The runner knows nothing of the model class beyond
the ``EngineModel`` protocol. With CUDA graphs on, DECODE (and full chain verify) batches
are handed to :class:`~aiter_attn.engine.graphs.EngineGraphs` instead of being planned here.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..backend import AttentionBackend
from ..batch import ForwardBatch
from ..types import BackendConfig, ForwardMode, SpecDecodeConfig
from .arch import build_kv_setup
from .graphs import EngineGraphs
from .kv_manager import KVCacheManager
from .protocol import EngineModel

__all__ = ["ModelRunner", "check_kernel_backend"]


def check_kernel_backend(name: Optional[str]) -> None:
    """Raise ``ValueError`` unless ``name`` (``None`` = the registry's best) names a registered
    kernel backend: checked when the engine is built, not at its first forward, where the
    requests already admitted went down with the step."""
    if name is None:
        return
    from ..plugins import kernel_registry

    reg = kernel_registry()
    names = sorted({i.name for op in reg.ops() for i in reg.implementations(op)})
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"kernel_backend={name!r} is not a registered kernel backend; "
                         f"registered: {names} (or None for the best that serves). Is its "
                         "plugin installed and allowed (AITER_ATTN_PLUGINS)?")


class ModelRunner:
    """Owns the KV pool and the attention backend of one model.

    Args:
        model: any ``EngineModel``.
        kv: rows/pages bookkeeping (its ``req_pool`` is the backend's ``req_to_token``).
        max_batch_size: most requests in one forward.
        kernel_backend: force a kernel backend by name (``None`` = registry's best).
        cuda_graph: replay DECODE steps (and chain TARGET_VERIFY steps when ``spec`` has
            ``topk == 1``) through :class:`~aiter_attn.engine.graphs.EngineGraphs`; on the CPU
            this is the manager's no-capture mode.
        debug_checks: the backend's checked mode (``BackendConfig.debug_checks``).
        batch_invariant: ``BackendConfig.batch_invariant``.
        cascade_min_shared_tokens: ``BackendConfig.cascade_min_shared_tokens``.
    """

    def __init__(self, model: EngineModel, kv: KVCacheManager, *, max_batch_size: int,
                 kernel_backend: Optional[str] = None, swa_pool: bool = True,
                 chunk_tokens: int = 512, spec: Optional[SpecDecodeConfig] = None,
                 cuda_graph: bool = False, batch_invariant: bool = False,
                 debug_checks: bool = False,
                 cascade_min_shared_tokens: Optional[int] = None):
        check_kernel_backend(kernel_backend)
        layout = model.kv_layout
        device = str(model.device)
        self.model = model
        self.kv = kv
        # Pool and BackendConfig.arch come from the model's layer specs (engine/arch.py).
        self.kv_setup = build_kv_setup(model, kv, device=device, swa_pool=swa_pool,
                                       chunk_tokens=chunk_tokens)
        self.kv_pool = self.kv_setup.pool
        self.config = BackendConfig(page_size=kv.page_size, max_batch_size=max_batch_size,
                                    max_context_len=kv.max_context_len, dtype=layout.dtype,
                                    device=device, kernel_backend=kernel_backend,
                                    arch=self.kv_setup.arch, spec=spec,
                                    debug_checks=debug_checks,
                                    batch_invariant=batch_invariant,
                                    cascade_min_shared_tokens=cascade_min_shared_tokens,
                                    **self.kv_setup.config_kw)
        self.backend = AttentionBackend(self.config, kv.req_pool, self.kv_pool,
                                        extra=self.kv_setup.extra)
        self.graphs: Optional[EngineGraphs] = None
        if cuda_graph:
            self.graphs = EngineGraphs(model, self.backend, max_batch_size=max_batch_size,
                                       verify=spec is not None and spec.topk == 1)
            self.graphs.capture()

    def run_batch(self, batch: ForwardBatch, input_ids: torch.Tensor,
                  logits_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 logits of an unplanned ``batch``. When the graphs serve it (DECODE, full
        chain verify) it is replayed and every token's row comes back (``logits_indices`` is
        not used: those modes want every row); otherwise it is planned
        (``init_forward_metadata``) and run eagerly, keeping the ``logits_indices`` rows."""
        if self.graphs is not None and self.graphs.serves(batch):
            return self.graphs.run(batch, input_ids)
        self.backend.init_forward_metadata(batch)
        return self.model.forward(input_ids, batch.positions, batch, self.backend,
                                  logits_indices=logits_indices)

    def after_step(self, items: Sequence[tuple]) -> None:
        """Architecture bookkeeping once ``items``' tokens are committed (SWA: free pages
        that fell out of every window)."""
        if self.kv_setup.after_step is not None:
            self.kv_setup.after_step(items)

    def forward(self, mode: ForwardMode, items: Sequence[tuple]) -> torch.Tensor:
        """Feed ``items`` = ``((request, num_tokens), ...)`` and return float32 logits
        ``[len(items), vocab]`` of each request's last fed token.

        Reserves the tokens' KV slots and advances each request's ``num_computed``.
        """
        device = self.model.device
        ids, slots, seq_lens, new_lens = [], [], [], []
        for req, n in items:
            start = req.num_computed
            ids.extend(req.tokens[start:start + n])
            slots.append(self.kv.extend(req, n))
            seq_lens.append(start + n)
            new_lens.append(n)
        batch = ForwardBatch.from_lengths(
            forward_mode=mode, req_pool_indices=[req.row for req, _ in items], seq_lens=seq_lens,
            out_cache_loc=torch.cat(slots),
            extend_seq_lens=new_lens if mode is ForwardMode.EXTEND else None, device=device,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(device)
        last = None
        if mode is not ForwardMode.DECODE:
            last = (torch.cumsum(torch.tensor(new_lens), 0) - 1).to(device)
        logits = self.run_batch(batch, input_ids, last)
        for req, n in items:
            req.num_computed += n
        self.after_step(items)
        return logits
