"""The SGLang attention backend over :class:`aiter_attn.AttentionBackend`.

:class:`AiterAttnSGLangBackend` implements SGLang 0.5.23's backend contract and is combined
with SGLang's own ``AttentionBackend`` base class at registration
(:func:`build_backend_class`), so SGLang's defaults (``forward`` dispatch by mode, the
``shared_read_ends`` audit, flags such as ``needs_cpu_seq_lens``) stay SGLang's.

Phases (SGLang → ours):

* eager: ``init_forward_metadata(fb)`` → translate the batch, ``AttentionBackend.
  init_forward_metadata`` (our plan); ``forward_extend/forward_decode(…, fb)`` → our run.
* CUDA graphs: ``init_cuda_graph_state(max_bs, max_num_tokens)`` → our
  :class:`~aiter_attn.CudaGraphManager` (static buffers). Capture and replay both call
  ``init_forward_metadata_out_graph(fb, in_capture)`` (or the older
  ``init_forward_metadata_capture_cuda_graph`` / ``…_replay_cuda_graph``): the padded rows are
  planned into the manager's static buffers, outside the graph, with no device→host sync
  (host integers from ``seq_lens_cpu``). ``init_forward_metadata_in_graph`` records nothing:
  every metadata write happened before replay. The captured ``forward`` writes K/V through the
  ``out_cache_loc`` of the batch SGLang captured with (its static buffer, refreshed by SGLang
  before every replay), so replay needs no slots from us.

Under DP attention SGLang pads a batch with tokens of no request after it is planned (EXTEND
in translation, DRAFT_EXTEND_V2 after its pre-pad plan): the layers run on the planned tokens
and the padding rows' output is zeros.

``forward`` always uses the batch object SGLang passes: the eager batch planned by
``init_forward_metadata``, or, after graph planning, the captured batch (bound on the first
layer's call).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Optional

import attrs
import torch

from ...backend import AttentionBackend
from ...contract import contract_of
from ...graph.manager import graph_mode
from ...types import ForwardMode, SpecDecodeConfig
from ..vllm.core import refresh_sinks
from .translate import SGLangMHAPool, config_from_runner, layer_spec, map_mode, to_forward_batch

__all__ = ["AiterAttnSGLangBackend", "build_backend_class"]

log = logging.getLogger(__name__)

class AiterAttnSGLangBackend:
    """SGLang attention backend (contract of ``sglang.srt.layers.attention.base_attn_backend.
    AttentionBackend``, 0.5.23) running :class:`aiter_attn.AttentionBackend`.

    Args:
        model_runner: SGLang's ``ModelRunner`` (``req_to_token_pool``, ``token_to_kv_pool``,
            ``page_size``, ``dtype``, ``kv_cache_dtype``, ``device``).
        spec: speculative settings (sizes the verify / draft-extend graph buffers); the
            plugin's factory reads them from SGLang's ``get_spec()``.
        strategies / kernels: registries for :class:`aiter_attn.AttentionBackend`.
    """

    needs_cpu_seq_lens = True

    def __init__(self, model_runner, *, spec: Optional[SpecDecodeConfig] = None,
                 strategies=None, kernels=None):
        super().__init__()
        self.config = config_from_runner(model_runner, spec)
        self.pool = SGLangMHAPool(model_runner.token_to_kv_pool, self.config.page_size,
                                  self.config.device)
        self.core = AttentionBackend(self.config, model_runner.req_to_token_pool.req_to_token,
                                     self.pool, strategies=strategies, kernels=kernels)
        # NGRAM's verify input carries no topk: its tree breadth is the server's topk
        self._spec_topk = None if spec is None else spec.topk
        self.data_type = self.config.dtype
        self.kv_cache_dtype = self.config.kv_cache_dtype
        self.forward_metadata = None
        self._layers: dict = {}
        self._sinks: dict = {}
        self._planned = None  # (SGLang batch, our batch) that forward may run
        self._graph_step = None  # (static batch, metadata) planned for the next captured fb
        self._slots: dict = {}

    # -- eager ----------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        """Plan this step (eager) for SGLang's ``forward_batch``."""
        batch = to_forward_batch(forward_batch, spec_topk=self._spec_topk)
        self.forward_metadata = self.core.init_forward_metadata(batch)
        self._planned, self._graph_step = (forward_batch, batch), None

    # -- CUDA graphs (0.5.23 names) --------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, **kwargs):
        """Allocate every static buffer for batches up to ``max_bs``."""
        self.core.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """KV length SGLang gives padding rows (≥ 1, so no row is empty)."""
        return self.core.get_cuda_graph_seq_len_fill_value()

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Plan ``forward_batch``'s (padded) rows into the static buffers, before capture or
        before ``graph.replay()``. Without graph state (never ``init_cuda_graph_state``) it
        plans eagerly."""
        if self.core.graph_manager is None:
            self.init_forward_metadata(forward_batch)
            return
        self._plan_graph(forward_batch.batch_size, forward_batch.forward_mode,
                         forward_batch.req_pool_indices, forward_batch.seq_lens,
                         getattr(forward_batch, "seq_lens_cpu", None),
                         getattr(forward_batch, "spec_info", None),
                         getattr(forward_batch, "encoder_lens", None), capturing=in_capture,
                         num_padding=getattr(forward_batch, "num_padding", None))

    def init_forward_metadata_in_graph(self, forward_batch):
        """Nothing to record: the static buffers were planned outside the graph."""

    # -- CUDA graphs (names before 0.5.23) ---------------------------------------------------
    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices,
                                                 seq_lens, encoder_lens, forward_mode,
                                                 spec_info, **kwargs):
        """Older SGLang's capture hook: same as ``init_forward_metadata_out_graph(fb,
        in_capture=True)``."""
        self._plan_graph(bs, forward_mode, req_pool_indices, seq_lens,
                         kwargs.get("seq_lens_cpu"), spec_info, encoder_lens, capturing=True)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens,
                                                seq_lens_sum, encoder_lens, forward_mode,
                                                spec_info, seq_lens_cpu=None, **kwargs):
        """Older SGLang's replay hook: same as ``init_forward_metadata_out_graph(fb)``."""
        self._plan_graph(bs, forward_mode, req_pool_indices, seq_lens, seq_lens_cpu, spec_info,
                         encoder_lens, capturing=False)

    def _plan_graph(self, bs, forward_mode, req_pool_indices, seq_lens, seq_lens_cpu,
                    spec_info, encoder_lens, *, capturing: bool, num_padding=None):
        mgr = self.core.graph_manager
        if mgr is None:
            raise RuntimeError("CUDA-graph planning before init_cuda_graph_state(max_bs, "
                               "max_num_tokens); SGLang calls it when it builds its graph "
                               "runner.")
        mode = map_mode(forward_mode)
        if not contract_of(mode).capturable:
            raise ValueError(
                f"forward_mode={mode.name} reached the CUDA-graph hooks: SGLang's full prefill "
                "CUDA graph (--cuda-graph-backend-prefill=full) captures ragged extend "
                "batches, which the aiter_attn backend plans on the host every step; use "
                "--cuda-graph-backend-prefill=breakable (the default on CUDA) or disabled.")
        gmode = graph_mode(mode)  # the mode whose graphs serve it (its contract's)
        q = mgr.limits(gmode).q_len
        if seq_lens_cpu is None:
            if not capturing:
                raise ValueError(
                    "seq_lens_cpu is None on replay: the aiter_attn backend plans from the CPU "
                    "mirror (reading seq_lens back would sync); keep needs_cpu_seq_lens=True.")
            seq_lens_cpu = seq_lens[:bs].to("cpu", torch.int64)  # before capture: may sync
        if mode == ForwardMode.DRAFT_EXTEND_V2 and q > 1:
            # SGLang pads rows with the fill value (1), shorter than the step's q tokens; real
            # rows never are, so the clamp touches padding rows only.
            seq_lens = seq_lens[:bs].clamp(min=q)
            seq_lens_cpu = torch.as_tensor(list(seq_lens_cpu[:bs]) if isinstance(
                seq_lens_cpu, (list, tuple)) else seq_lens_cpu[:bs], dtype=torch.int64).clamp(
                min=q)
        view = SimpleNamespace(
            batch_size=bs, forward_mode=forward_mode, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu, out_cache_loc=self._dummy_slots(bs * q),
            spec_info=spec_info, encoder_lens=encoder_lens, positions=None,
            num_padding=num_padding)  # rows after the real ones (0.5.23's replay view)
        batch = to_forward_batch(view, spec_topk=self._spec_topk)
        entry = mgr.load(batch, padded_bs=bs, capturing=capturing)
        self.forward_metadata = self.core.forward_metadata
        self._graph_step = (entry.run_batch, self.core.forward_metadata)
        self._planned = None

    def _dummy_slots(self, n: int) -> torch.Tensor:
        # Planning reads no slots; the captured writes use SGLang's static out_cache_loc.
        t = self._slots.get(n)
        if t is None:
            t = self._slots[n] = torch.zeros(n, dtype=torch.int64, device=self.core.ctx.device)
        return t

    # -- run ------------------------------------------------------------------------------
    def _batch_for(self, forward_batch):
        if self._planned is not None and self._planned[0] is forward_batch:
            return self._planned[1]
        if self._graph_step is not None:
            static, md = self._graph_step
            batch = attrs.evolve(static,
                                 out_cache_loc=forward_batch.out_cache_loc[: static.num_tokens])
            self.core.bind_forward_metadata(batch, md)
            self._planned, self._graph_step = (forward_batch, batch), None
            return batch
        if self._planned is not None and _same_step(self._planned[0], forward_batch):
            # SGLang's breakable / piecewise prefill graphs plan the live batch and replay
            # attention on their static view of it (same request tensors, slots in a static
            # buffer): run the plan with the view's slots, as SGLang's backends do.
            planned = self._planned[1]
            batch = attrs.evolve(
                planned, out_cache_loc=forward_batch.out_cache_loc[: planned.num_tokens])
            self.core.bind_forward_metadata(batch, self.forward_metadata)
            self._planned = (forward_batch, batch)
            return batch
        raise RuntimeError(
            "forward_extend/forward_decode with a batch that was not planned: call "
            "init_forward_metadata(forward_batch) (or the graph hooks) for this batch first.")

    def _layer(self, layer):
        spec = self._layers.get(layer.layer_id)
        if spec is None:
            spec = self._layers[layer.layer_id] = layer_spec(layer)
        return spec

    def _sinks_f32(self, layer_id: int, sinks):
        """float32 sinks holding the parameter's values now: SGLang updates weights in place
        (``update_weights_from_tensor`` / ``_from_disk`` copy into ``param.data``), so a copy
        made once would go stale. One buffer per layer, refreshed on every call (a captured
        graph replays the refresh); see
        :func:`aiter_attn.integrations.vllm.core.refresh_sinks`."""
        buf = refresh_sinks(sinks, self._sinks.get(layer_id))
        if buf is not None and buf is not sinks:
            self._sinks[layer_id] = buf
        return buf

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache, sinks=None, **kwargs):
        extra = sorted(n for n, val in kwargs.items() if val is not None)
        if extra:
            raise TypeError(f"forward got {extra}, which the aiter_attn SGLang backend does not "
                            "implement (only sinks); serve this model with another backend.")
        batch = self._batch_for(forward_batch)
        spec, n = self._layer(layer), batch.num_tokens
        sinks = self._sinks_f32(layer.layer_id, sinks)
        if q.shape[0] == n or not _dp_padded(forward_batch, q, n):
            return self.core.forward(q, k, v, spec, batch, save_kv_cache, sinks=sinks)
        # DP-attention padding: the trailing rows belong to no request; they attend to nothing
        # and write nothing, and their output rows are zeros.
        out = q.new_zeros(q.shape[0], spec.num_q_heads * spec.v_head_dim)
        out[:n] = self.core.forward(q[:n], None if k is None else k[:n],
                                    None if v is None else v[:n], spec, batch, save_kv_cache,
                                    sinks=sinks)
        return out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """EXTEND / MIXED / TARGET_VERIFY / DRAFT_EXTEND(_V2): ``[num_tokens, H * Dv]``."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """DECODE: ``[bs, H * Dv]``."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        """EAGLE verify's hook under ``SGLANG_ENABLE_OVERLAP_PLAN_STREAM`` (the base class
        raises): nothing to patch, the verify plan ran after the draft (the plan stream waits
        on it) and read its final tree mask."""


def _dp_padded(forward_batch, q, n: int) -> bool:
    """Whether ``q`` is the planned step's ``n`` tokens followed by DP-attention padding:
    more rows than planned, and SGLang padded the batch's slots to the same count (host
    shapes only)."""
    loc = getattr(forward_batch, "out_cache_loc", None)
    return q.shape[0] > n and loc is not None and loc.shape[0] == q.shape[0]


def _same_step(planned, forward_batch) -> bool:
    """Whether ``forward_batch`` is a view of the ``planned`` SGLang batch (the prefill graph
    runners' ``static_forward_batch``): same mode and size, the very same request tensors, at
    least the planned slots. Host checks only."""
    try:
        return (forward_batch.forward_mode == planned.forward_mode
                and forward_batch.batch_size == planned.batch_size
                and forward_batch.req_pool_indices is planned.req_pool_indices
                and forward_batch.seq_lens is planned.seq_lens
                and forward_batch.out_cache_loc is not None
                and forward_batch.out_cache_loc.shape[0] >= planned.out_cache_loc.shape[0])
    except AttributeError:
        return False


def build_backend_class(base: type) -> type:
    """:class:`AiterAttnSGLangBackend` with SGLang's ``AttentionBackend`` ``base`` after it in
    the MRO (our methods win; SGLang's defaults fill the rest)."""
    return type("AiterAttnBackend", (AiterAttnSGLangBackend, base),
                {"__module__": __name__, "__doc__": AiterAttnSGLangBackend.__doc__})
