"""``AttentionBackend``: the thin facade an engine holds (SGLang's method names).

It has no mode/arch branching of its own: the strategy registry picks a
(MetadataStrategy, ExecutionStrategy) pair per forward mode for the configured architecture,
and the facade delegates.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .batch import ForwardBatch
from .contract import contract_of
from .kernels.registry import CheckedRegistry
from .kv_scales import check_pool_format
from .metadata import AttnMetadata
from .registry import StrategyPair
from .strategies.base import StrategyContext
from .types import BackendConfig, ForwardMode, LayerSpec
from .validation import check_tensor, debug_checks_enabled

__all__ = ["AttentionBackend", "validate_batch"]

log = logging.getLogger(__name__)


def validate_batch(batch: ForwardBatch, config: BackendConfig, req_to_token: torch.Tensor) -> None:
    """Structural checks of a batch (no device sync). Raise before any kernel runs."""
    if not isinstance(batch, ForwardBatch):
        raise TypeError(f"batch must be an aiter_attn.ForwardBatch, got {type(batch).__name__}.")
    bs = batch.batch_size
    check_tensor("batch.seq_lens_cpu", batch.seq_lens_cpu, dtypes=(torch.int32, torch.int64),
                 ndim=1, hint="seq_lens_cpu is the int64 CPU mirror of seq_lens.")
    if batch.seq_lens_cpu.device.type != "cpu":
        raise ValueError("batch.seq_lens_cpu must live on the CPU (it is the host mirror).")
    check_tensor("batch.seq_lens", batch.seq_lens, dtypes=(torch.int32,), ndim=1, shape=(bs,),
                 hint="seq_lens is int32 [batch].")
    check_tensor("batch.req_pool_indices", batch.req_pool_indices,
                 dtypes=(torch.int32, torch.int64), ndim=1, shape=(bs,),
                 hint="req_pool_indices is int64 [batch].")
    check_tensor("batch.out_cache_loc", batch.out_cache_loc, dtypes=(torch.int32, torch.int64),
                 ndim=1, hint="out_cache_loc is int64 [num_tokens].")
    for name in ("seq_lens", "req_pool_indices", "out_cache_loc"):
        t = getattr(batch, name)
        if t.device != req_to_token.device:
            raise ValueError(
                f"batch.{name} is on {t.device} but the backend's pools are on "
                f"{req_to_token.device}; build the batch on the backend's device."
            )
    if bs == 0:
        return
    max_len = int(batch.seq_lens_cpu.max())
    # a kv_slack mode's KV may hold this step's draft tokens past max_context_len (contract)
    slack = int(batch.q_lens_cpu[0]) if contract_of(batch.forward_mode).kv_slack else 0
    limit = min(config.max_context_len + slack, req_to_token.shape[1])
    if max_len > limit:
        bound = f"max_context_len={limit}" if not slack else (
            f"{limit} (max_context_len + {slack} draft tokens, or the ReqToTokenPool width)")
        raise ValueError(
            f"a request holds {max_len} tokens > {bound}; raise "
            "BackendConfig.max_context_len (and the ReqToTokenPool width) or shorten it."
        )
    if int(batch.seq_lens_cpu.min()) < 1:
        raise ValueError("batch.seq_lens_cpu has a request with length < 1; every request needs "
                         "at least its own token.")
    ragged = not contract_of(batch.forward_mode).uniform  # query lengths from extend_seq_lens
    if ragged:
        if batch.extend_seq_lens is None or batch.extend_seq_lens_cpu is None:
            raise ValueError(
                f"{batch.forward_mode.name} needs extend_seq_lens and extend_seq_lens_cpu; "
                "build the batch with ForwardBatch.from_lengths(..., extend_seq_lens=...)."
            )
        check_tensor("batch.extend_seq_lens", batch.extend_seq_lens, dtypes=(torch.int32,),
                     ndim=1, shape=(bs,))
        check_tensor("batch.extend_seq_lens_cpu", batch.extend_seq_lens_cpu,
                     dtypes=(torch.int32, torch.int64), ndim=1, shape=(bs,),
                     hint="extend_seq_lens_cpu is the int64 CPU mirror of extend_seq_lens.")
        if batch.extend_seq_lens_cpu.device.type != "cpu":
            raise ValueError("batch.extend_seq_lens_cpu must live on the CPU (it is the host "
                             "mirror of extend_seq_lens).")
    q_lens = batch.q_lens_cpu
    if ragged:
        if bool((q_lens > batch.seq_lens_cpu).any()) or bool((q_lens < 0).any()):
            raise ValueError("extend_seq_lens must be in 0..seq_lens per request (new tokens "
                             "cannot exceed the request's total length).")
    elif (short := batch.first_row_shorter_than(int(q_lens[0]))) is not None:
        # uniform modes: seq_lens counts this step's draft tokens too (KV length after them)
        raise ValueError(
            f"batch.seq_lens_cpu[{short}]={int(batch.seq_lens_cpu[short])} < the "
            f"{int(q_lens[0])} query tokens per request of {batch.forward_mode.name}: seq_lens "
            "is the KV length after this step's tokens, so it includes the draft tokens; "
            "add them (seq_lens + num_draft_tokens).")
    if int(q_lens.sum()) != batch.num_tokens:
        raise ValueError(
            f"out_cache_loc has {batch.num_tokens} slots but the batch has {int(q_lens.sum())} "
            f"query tokens for {batch.forward_mode.name}; give one slot per new token."
        )


def _refuse_extra(kwargs: dict) -> None:
    """Raise for the layer-call keywords that carry a value but that no strategy reads."""
    extra = sorted(name for name, value in kwargs.items() if value is not None)
    if extra:
        raise TypeError(
            f"forward() got {extra}, which AttentionBackend does not read (its layer call takes "
            "q, k, v, layer, forward_batch, save_kv_cache and sinks); drop them, or fold what "
            "they carry into q/k (e.g. concatenate the rotary part) before the call.")


class AttentionBackend:
    """Attention for one model over a paged KV cache.

    Args:
        config: static settings (page size, limits, dtypes, architecture).
        req_to_token: int32 ``[R, max_context_len]`` (or a ``ReqToTokenPool``).
        kv_pool: the KV pool of ``config.arch`` (``MHAKVPool`` for MHA).
        extra: architecture-specific objects handed to strategies (SWA pool, …).
        strategies / kernels: registries (default: the process-wide plugin-loaded ones).
        strategy: force a strategy pair by name for every mode it serves.
    """

    def __init__(self, config: BackendConfig, req_to_token, kv_pool, *,
                 extra: Optional[dict] = None, strategies=None, kernels=None,
                 strategy: Optional[str] = None):
        from . import plugins

        if not isinstance(config, BackendConfig):
            raise TypeError(f"config must be a BackendConfig, got {type(config).__name__}.")
        req_to_token = getattr(req_to_token, "req_to_token", req_to_token)
        check_tensor("req_to_token", req_to_token, dtypes=(torch.int32,), ndim=2,
                     hint="req_to_token is int32 [max_requests, max_context_len].")
        pool_page = getattr(kv_pool, "page_size", None)
        if isinstance(pool_page, int) and pool_page != config.page_size:
            raise ValueError(
                f"kv_pool {type(kv_pool).__name__} has page_size={pool_page} but "
                f"BackendConfig.page_size={config.page_size} (default 1); build both with the "
                f"same page size, e.g. BackendConfig(page_size={pool_page}, ...).")
        check_pool_format(config, kv_pool)  # where the per-(token, head) scales live
        self.config = config
        self.strategies = strategies if strategies is not None else plugins.strategy_registry()
        kernels = kernels if kernels is not None else plugins.kernel_registry()
        if config.batch_invariant:
            from .kernels.batch_invariant import BatchInvariantKernels

            kernels = BatchInvariantKernels(kernels)
        if config.debug_checks:  # every kernel this backend selects checks its index values
            kernels = CheckedRegistry(kernels)
        self.ctx = StrategyContext(config=config, req_to_token=req_to_token, kv_pool=kv_pool,
                                   kernels=kernels, extra=dict(extra or {}))
        self._forced = strategy
        self._by_mode: dict = {}
        self._instances: dict = {}
        self.forward_metadata: Optional[AttnMetadata] = None
        self._batch: Optional[ForwardBatch] = None
        self._step: Optional[tuple] = None  # forward's per-step memo (see forward)
        self._device = self.ctx.device  # the pools' device (q is checked against it)
        self._debug = debug_checks_enabled()  # + deep metadata invariants (testing.invariants)
        self.graph_manager = None

    # -- selection -----------------------------------------------------------------------
    def pair_for(self, mode) -> StrategyPair:
        mode = ForwardMode.parse(mode)
        pair = self._by_mode.get(mode)
        if pair is None:
            pair = self.strategies.select(mode, self.config.arch, self.config, name=self._forced)
            self._by_mode[mode] = pair
        return pair

    def strategies_for(self, mode):
        """``(metadata_strategy, execution_strategy)`` instances for ``mode`` (one per pair)."""
        pair = self.pair_for(mode)
        inst = self._instances.get(pair.name)
        if inst is None:
            inst = (pair.metadata(self.ctx), pair.execution(self.ctx))
            self._instances[pair.name] = inst
        return inst

    # -- SGLang's method names ----------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch,
                              out: Optional[dict] = None) -> AttnMetadata:
        """Plan this step's metadata. Validates the batch first.

        ``out``: static buffers (the planner's ``buffer_spec``) to plan into, as CUDA-graph
        capture/replay does (the step's kernel plans go there too); ``None`` (eager) plans
        into fresh buffers sized for the batch.
        """
        validate_batch(forward_batch, self.config, self.ctx.req_to_token)
        planner, executor = self.strategies_for(forward_batch.forward_mode)
        md = planner.plan(forward_batch, out)
        # once per step for every bound layer group; under ``out`` the kernels' plans place
        # their tensors (split workspaces, …) in the static buffers too, so a captured graph
        # never reads memory a later plan freed
        executor.plan_kernels(md, forward_batch, out)
        if self._debug:
            from .testing.invariants import check_invariants

            check_invariants(md, forward_batch, self.ctx)
        self.forward_metadata, self._batch = md, forward_batch
        return md

    def forward(self, q, k, v, layer: LayerSpec, forward_batch: ForwardBatch,
                save_kv_cache: bool = True, *, sinks=None, **kwargs: Any) -> torch.Tensor:
        """Attention of one layer: ``[num_tokens, num_q_heads * v_head_dim]``.

        The hot path: what depends only on the step (token count, batch size, the mode's
        execution strategy) is looked up once per planned metadata (``_step``), then O(1)
        checks of q/k/v and the strategy's run (one binding lookup, the output, the launch).

        ``**kwargs`` takes SGLang's extra keywords so its calls fit; one with a value (``None``
        is no value) is refused: nothing here reads it, so its effect would be lost silently.
        """
        if kwargs:
            _refuse_extra(kwargs)
        md = self.forward_metadata
        if md is None or self._batch is not forward_batch:
            raise RuntimeError(
                "forward() before init_forward_metadata() for this batch; call "
                "backend.init_forward_metadata(batch) once per step, before the layers."
            )
        step = self._step
        if step is None or step[0] is not md or step[1] is not forward_batch:
            step = self._step = (md, forward_batch, forward_batch.num_tokens,
                                 forward_batch.batch_size,
                                 self.strategies_for(forward_batch.forward_mode)[1])
        if layer.__class__ is not LayerSpec and not isinstance(layer, LayerSpec):
            raise TypeError(f"layer must be a LayerSpec, got {type(layer).__name__}.")
        self._check_qkv(q, k, v, layer, step[2])
        if sinks is not None:
            self._check_sinks(sinks, layer)
        if step[3] == 0:
            return q.new_zeros(0, layer.num_q_heads * layer.v_head_dim)
        return step[4].run(q, k, v, layer, forward_batch, md, save_kv_cache=save_kv_cache,
                           sinks=sinks)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kw)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
        return self.forward(q, k, v, layer, forward_batch, save_kv_cache, **kw)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padding rows get this KV length (≥ 1 so no row is empty)."""
        return 1

    # -- CUDA graphs: delegated to aiter_attn.graph.CudaGraphManager --------------------
    def graph_source(self):
        """The :class:`~aiter_attn.graph.sources.BackendSource` a
        :class:`~aiter_attn.graph.CudaGraphManager` plans through."""
        from .graph.sources import BackendSource

        return BackendSource(self)

    def graph_support(self, mode):
        """A cell's CUDA-graph support: the weaker of its strategy pair's and its bound
        kernels' (the pair's alone until a layer has bound a kernel)."""
        pair = self.pair_for(mode)
        _, executor = self.strategies_for(mode)
        k = executor.kernel_cg_support()
        return pair.cg_support if k is None else min(pair.cg_support, k)

    def bind_forward_metadata(self, forward_batch: ForwardBatch, metadata: AttnMetadata) -> None:
        """Make ``metadata`` (planned into static buffers by the graph manager) current."""
        self.forward_metadata, self._batch = metadata, forward_batch

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: Optional[int] = None, **kw):
        """Allocate every static buffer for batches up to ``max_bs`` (see CudaGraphManager)."""
        from .graph import CudaGraphManager

        self.graph_manager = CudaGraphManager(self, max_bs=max_bs, max_num_tokens=max_num_tokens,
                                              **kw)
        return self.graph_manager

    def _graphs(self):
        if self.graph_manager is None:
            raise RuntimeError("call backend.init_cuda_graph_state(max_bs, max_num_tokens) first.")
        return self.graph_manager

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens,
                                                 encoder_lens, forward_mode, spec_info, **kw):
        """Plan ``bs`` rows into the static buffers before capture; returns the static
        ForwardBatch to pass to ``forward`` inside the captured function."""
        if encoder_lens is not None:
            raise ValueError("encoder_lens is set: cross-attention is not captured; run eagerly.")
        return self._graphs().plan_capture(bs, forward_mode, req_pool_indices, seq_lens,
                                           spec_info, **kw)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens,
                                                seq_lens_sum, encoder_lens, forward_mode,
                                                spec_info, seq_lens_cpu=None, **kw):
        """Refill and re-plan the static buffers of size ``bs`` before ``graph.replay()``."""
        if encoder_lens is not None:
            raise ValueError("encoder_lens is set: cross-attention is not captured; run eagerly.")
        return self._graphs().plan_replay(bs, forward_mode, req_pool_indices, seq_lens,
                                          spec_info, seq_lens_cpu=seq_lens_cpu, **kw)

    def _check_sinks(self, sinks, layer: LayerSpec) -> None:
        """O(1) checks of a per-call ``sinks`` (it overrides ``layer.sinks``), before any KV
        write or launch: the kernels read one float per query head from it unchecked, so a
        short tensor would be read past its end (the Triton kernels) and a wrong type or
        device fail inside a kernel."""
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"sinks must be a torch.Tensor (float32 [num_q_heads]), got "
                            f"{type(sinks).__name__}.")
        if tuple(sinks.shape) != (layer.num_q_heads,):
            raise ValueError(
                f"sinks has shape {tuple(sinks.shape)}; expected ({layer.num_q_heads},), one "
                f"logit per query head of layer {layer.layer_id} on this rank.")
        if not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks has dtype {sinks.dtype}; pass float32 sink logits "
                            "(sinks.float()).")
        if sinks.device != self._device:
            raise ValueError(f"sinks is on {sinks.device}; the backend's pools are on "
                             f"{self._device}.")

    def _check_qkv(self, q, k, v, layer: LayerSpec, n) -> None:
        """O(1) checks of one layer call (type, dtype, element counts, device) for a step of
        ``n`` tokens (an int, or the step's :class:`ForwardBatch`): the hot path."""
        if n.__class__ is not int:
            n = n.num_tokens
        if q.__class__ is not torch.Tensor and not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}.")
        if q.dtype != self.config.dtype:
            raise TypeError(f"q has dtype {q.dtype}; q must be in the backend's dtype "
                            f"{self.config.dtype}.")
        if q.numel() != n * layer.num_q_heads * layer.head_dim:
            raise ValueError(
                f"q has shape {tuple(q.shape)}; expected {n} tokens × {layer.num_q_heads} heads × "
                f"{layer.head_dim} (layer {layer.layer_id})."
            )
        if q.device != self._device:
            raise ValueError(f"q is on {q.device}; the backend's pools are on {self._device}.")
        if k is not None and k.numel() != n * layer.num_kv_heads * layer.head_dim:
            raise ValueError(
                f"k has shape {tuple(k.shape)}; expected {n} × {layer.num_kv_heads} × "
                f"{layer.head_dim}."
            )
        if v is not None and v.numel() != n * layer.num_kv_heads * layer.v_head_dim:
            raise ValueError(
                f"v has shape {tuple(v.shape)}; expected {n} × {layer.num_kv_heads} × "
                f"{layer.v_head_dim}."
            )
        for name, t in (("k", k), ("v", v)):  # written into the pool: same dtype/device as q
            if t is None:
                continue
            if t.dtype != self.config.dtype:
                raise TypeError(f"{name} has dtype {t.dtype}; {name} must be in the backend's "
                                f"dtype {self.config.dtype} (BackendConfig.dtype), like q.")
            if t.device != self._device:
                raise ValueError(f"{name} is on {t.device}; the backend's pools are on "
                                 f"{self._device}.")
