"""Multi-step draft decode: every draft step planned at once, run through one strategy pair.

EAGLE's draft model proposes ``num_steps`` tokens per branch: the first comes from the draft
extend pass, then ``num_steps - 1`` decode passes follow, each over ``batch · topk`` rows (one
per branch). :class:`MultiStepDraftBackend` plans the index tensors of *all* passes in one
device pass into one set of buffers (``[num_steps - 1, …]``), then, per step, the step
strategy's metadata (views of row ``i``) and the step's kernel plans; nothing is recomputed
per layer and nothing syncs with the host.

It holds one metadata strategy and one execution strategy (the pair
``<arch>.draft_decode_step``): a layer's kernel is bound once and shared by every step, while
each step has its own plans (under CUDA graphs in its own static buffers, ``step{i}.<name>``).
There is no backend object per step: :meth:`MultiStepDraftBackend.forward` takes the step
index (``ms.step(i)`` is a cheap view with the usual ``forward(q, k, v, layer)``).

Draft-token slots (SGLang's layout). For request ``b`` with ``P`` committed tokens
(``seq_lens[b]``) let ``base = P - P % page_size`` and
``nnp = ceil((P % page_size + num_steps) / page_size)`` (pages per branch). Branch ``k``'s
logical token column ``c`` lives in ``req_to_token`` column ``c`` if ``c < base`` and
``c + k · nnp · page_size`` otherwise. With ``page_size == 1`` that is
``P + k · num_steps + step`` for the draft tokens; with ``topk == 1`` it is the identity.
With ``page_size > 1`` and ``topk > 1`` every branch owns whole pages, so the engine copies
the prefix's last partial page into each branch's first page (SGLang's EAGLE worker does),
and branch ``k``'s page table reads its own copy.

Step ``i`` (``0 ≤ i < num_steps - 1``), row ``r = b · topk + k``: one query at position
``P + i``, KV length ``P + i + 1``, its K/V written to ``out_cache_loc[i, r]`` (the slot of
branch ``k``'s token ``i``).

Typical use::

    ms = MultiStepDraftBackend(config, req_to_token, kv_pool)    # config.spec sets steps
    ms.init_forward_metadata(draft_batch)                         # seq_lens = committed
    for i in range(ms.num_passes):                                # num_steps - 1 passes
        out = ms.forward(i, q, k, v, layer)                       # per layer
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Optional

import torch

from . import ops
from .backend import AttentionBackend
from .batch import ForwardBatch, SpecInfo
from .metadata import AttnMetadata
from .registry import StrategySelectionError
from .strategies.base import BufferSpec
from .types import BackendConfig, ForwardMode, LayerSpec, SpecDecodeConfig
from .validation import INDEX_DTYPES, check_int, check_tensor

__all__ = ["MultiStepDraftBackend", "DraftStep", "draft_columns_needed"]

#: Prefix of the step planners' own buffers in :meth:`MultiStepDraftBackend.buffer_spec`.
_STEP_PREFIX = "step{}."


class _StepBuffers(MutableMapping):
    """Step ``i``'s view of the shared static buffer dict: its keys without the ``step{i}.``
    prefix. Writes land in the shared dict (a kernel plan's ``out.setdefault`` at capture
    adds a workspace that every later plan of the step finds), so nothing a captured graph
    reads is lost between plans. ``cu_seqlens_q`` reads the shared ``draft_cu_seqlens_q``
    (the static row bound kernels size their workspaces from)."""

    __slots__ = ("_out", "_prefix")
    _ALIASES = {"cu_seqlens_q": "draft_cu_seqlens_q"}

    def __init__(self, out: dict, prefix: str):
        self._out, self._prefix = out, prefix

    def __getitem__(self, key):
        try:
            return self._out[self._prefix + key]
        except KeyError:
            alias = self._ALIASES.get(key)
            if alias is None or alias not in self._out:
                raise
            return self._out[alias]

    def __setitem__(self, key, value):
        self._out[self._prefix + key] = value

    def __delitem__(self, key):
        del self._out[self._prefix + key]

    def __iter__(self):
        n = len(self._prefix)
        return (k[n:] for k in list(self._out) if k.startswith(self._prefix))

    def __len__(self):
        return sum(1 for k in self._out if k.startswith(self._prefix))


def draft_columns_needed(prefix_lens: torch.Tensor, page_size: int, topk: int,
                         num_steps: int) -> torch.Tensor:
    """``req_to_token`` columns each request needs for its draft slots (CPU int64 ``[bs]``):
    ``base + topk · nnp · page_size`` (see the module docstring)."""
    p = prefix_lens.long()
    base = p - p % page_size
    nnp = (p % page_size + num_steps + page_size - 1) // page_size
    return base + topk * nnp * page_size


class MultiStepDraftBackend:
    """``num_steps - 1`` draft-decode passes over one set of shared index buffers, run through
    one strategy pair (one metadata strategy, one execution strategy).

    Args:
        config: backend settings; ``config.spec`` gives ``topk`` and ``num_steps`` unless passed.
        req_to_token, kv_pool: as for :class:`AttentionBackend` (the draft model's pools).
        topk / num_steps: override ``config.spec``.
        step_strategy: the strategy pair every step runs through (default
            ``"<arch>.draft_decode_step"``, e.g. ``mha.draft_decode_step``); its metadata
            strategy must wrap the views this object plans (see
            :class:`~aiter_attn.strategies.spec.DraftDecodeStepMetadata`) and its contract
            must bring one query token per row.
        extra, strategies, kernels: as for :class:`AttentionBackend`.

    Attributes:
        pair: the step :class:`~aiter_attn.registry.StrategyPair`; ``contract`` its DECODE
            :class:`~aiter_attn.contract.ModeContract`.
        strategy / executor: the pair's metadata and execution strategies (one each, shared
            by every step: a layer's kernel is bound once).
        ctx: their :class:`~aiter_attn.strategies.base.StrategyContext`.
        step_batches: the step ForwardBatches of the last plan.
        step_metadata: the step :class:`~aiter_attn.metadata.AttnMetadata` of the last plan
            (each with its own kernel plans).
    """

    def __init__(self, config: BackendConfig, req_to_token, kv_pool, *,
                 topk: Optional[int] = None, num_steps: Optional[int] = None,
                 step_strategy: Optional[str] = None, extra: Optional[dict] = None,
                 strategies=None, kernels=None):
        spec = config.spec or SpecDecodeConfig()
        # an int ≥ 1, not rounded: the draft slot layout depends on it
        self.topk = check_int(topk if topk is not None else spec.topk, "topk", 1,
                              " (SpecDecodeConfig.topk)")
        self.num_steps = check_int(num_steps if num_steps is not None else spec.num_steps,
                                   "num_steps", 1, " (SpecDecodeConfig.num_steps)")
        self.config = config
        if step_strategy is None:
            step_strategy = f"{config.arch.value}.draft_decode_step"
        self.step_strategy = step_strategy
        # one facade for selection, context and the per-layer O(1) checks; every step plans
        # and runs through its one strategy pair (no backend per step)
        self._core = AttentionBackend(config, req_to_token, kv_pool, extra=extra,
                                      strategies=strategies, kernels=kernels,
                                      strategy=step_strategy)
        try:  # an unknown or unfit step strategy raises here, not at the first step
            self.pair = self._core.pair_for(ForwardMode.DECODE)
        except StrategySelectionError as exc:
            raise StrategySelectionError(
                f"multi-step draft decode on {config.arch.name} runs each step through "
                f"strategy {step_strategy!r}, which cannot be used: {exc} Pass "
                "step_strategy= a pair that wraps MultiStepDraftBackend's views.") from exc
        self.contract = self.pair.contract(ForwardMode.DECODE)
        if self.contract.q_len(config) != 1:
            raise ValueError(
                f"step strategy {self.pair.name!r} serves DECODE with {self.contract.tokens!r} "
                "query tokens per request; a draft step brings one token per branch row. Pass "
                "step_strategy= a DECODE pair with one token per request.")
        self.strategy, self.executor = self._core.strategies_for(ForwardMode.DECODE)
        self.ctx = self._core.ctx
        self.req_to_token = self.ctx.req_to_token
        self.page_size = config.page_size
        self.step_batches: list = []
        self.step_metadata: list = []
        self.graph_buffers: Optional[dict] = None

    @property
    def num_passes(self) -> int:
        """Decode passes: ``num_steps - 1``."""
        return self.num_steps - 1

    @property
    def rows_per_request(self) -> int:
        """Query rows per request in every step: ``topk`` branches × the step contract's
        tokens per row (one)."""
        return self.topk * self.contract.q_len(self.config)

    def graph_source(self):
        """The :class:`~aiter_attn.graph.sources.MultiStepSource` a
        :class:`~aiter_attn.graph.CudaGraphManager` plans through."""
        from .graph.sources import MultiStepSource

        return MultiStepSource(self)

    # -- steps ----------------------------------------------------------------------------
    def step(self, i: int) -> "DraftStep":
        """A cheap view of draft step ``i`` of the last plan (``forward(q, k, v, layer)``)."""
        self._check_step(i)
        return DraftStep(self, i)

    @property
    def attn_backends(self) -> list:
        """Deprecated: the step views (:meth:`step`); kept for code written against one
        backend per step (``attn_backends[i].forward(q, k, v, layer, step_batches[i])``)."""
        return [DraftStep(self, i) for i in range(self.num_passes)]

    def _check_step(self, i) -> None:
        if not isinstance(i, int) or not 0 <= i < self.num_passes:
            raise ValueError(
                f"step={i!r}; multi-step draft decode with num_steps={self.num_steps} has "
                f"decode passes 0..{self.num_passes - 1} (the first draft token comes from "
                "the draft extend).")

    def forward(self, step: int, q, k, v, layer: LayerSpec, save_kv_cache: bool = True, *,
                sinks=None) -> torch.Tensor:
        """Attention of ``layer`` in draft step ``step`` of the last plan:
        ``[rows, num_q_heads * v_head_dim]`` with ``rows = batch · topk`` (one query per
        branch). ``k``/``v`` ``[rows, Hkv, D]`` are written to the step's slots when
        ``save_kv_cache``. O(1) checks, then the step's planned kernels launch."""
        mds = self.step_metadata
        if not isinstance(step, int) or not 0 <= step < len(mds):
            if not mds and self.num_passes:
                raise RuntimeError(
                    "MultiStepDraftBackend.forward before init_forward_metadata(draft_batch); "
                    "plan every step once per draft round, before the layers.")
            self._check_step(step)
        batch, md = self.step_batches[step], mds[step]
        if not isinstance(layer, LayerSpec):
            raise TypeError(f"layer must be a LayerSpec, got {type(layer).__name__}.")
        self._core._check_qkv(q, k, v, layer, batch)
        if sinks is not None:
            self._core._check_sinks(sinks, layer)
        if batch.batch_size == 0:
            return q.new_zeros(0, layer.num_q_heads * layer.v_head_dim)
        return self.executor.run(q, k, v, layer, batch, md, save_kv_cache=save_kv_cache,
                                 sinks=sinks)

    # -- buffers ------------------------------------------------------------------------
    def buffer_spec(self, max_bs: int, max_seq_len: Optional[int] = None) -> BufferSpec:
        """Shared buffers for up to ``max_bs`` requests (``max_bs · topk`` rows per step) whose
        committed length is at most ``max_seq_len`` (default ``config.max_context_len``),
        plus each step's own buffers (``step{i}.<name>``): the step strategy's (e.g. the SWA
        page table the SWA step planner translates into) and its bound kernels' (split
        workspaces), so that a captured plan reads only these. A kernel bound later adds its
        buffers under the same prefix at its first static plan."""
        limits = self.step_limits(max_bs, max_seq_len)
        own = self.strategy.buffer_spec(limits.max_bs, limits.max_num_tokens, limits.max_seq_len)
        own = own.merge(self.executor.kernel_buffer_spec(limits))  # kernels bound so far
        per_step = {f"{_STEP_PREFIX.format(i)}{k}": v
                    for i in range(self.num_passes) for k, v in own.buffers.items()}
        max_seq_len = self.config.max_context_len if max_seq_len is None else max_seq_len
        return BufferSpec({**self._shared_spec(max_bs, max_seq_len).buffers, **per_step})

    def step_limits(self, max_bs: int, max_seq_len: Optional[int] = None):
        """The :class:`~aiter_attn.graph.buffers.GraphLimits` of one step for up to
        ``max_bs`` requests: ``max_bs · topk`` rows of the step contract's one token, KV up
        to ``max_seq_len + num_steps``."""
        from .graph.buffers import GraphLimits

        max_seq_len = self.config.max_context_len if max_seq_len is None else max_seq_len
        rows = max(max_bs, 1) * self.rows_per_request
        return GraphLimits(mode=ForwardMode.DECODE, max_bs=rows,
                           q_len=self.contract.q_len(self.config), max_num_tokens=rows,
                           max_seq_len=max_seq_len + self.num_steps)

    def _shared_spec(self, max_bs: int, max_seq_len: int) -> BufferSpec:
        """The index buffers every step reads (``[num_passes, rows, …]``)."""
        rows = max(max_bs, 1) * self.topk
        steps = max(self.num_passes, 1)
        width = max(-(-(max_seq_len + self.num_steps) // self.page_size), 1)
        return BufferSpec({
            "draft_cu_seqlens_q": ((rows + 1,), torch.int32),
            "draft_req_pool_indices": ((rows,), torch.int64),
            "draft_seqused_k": ((steps, rows), torch.int32),
            "draft_positions": ((steps, rows), torch.int64),
            "draft_out_cache_loc": ((steps, rows), torch.int64),
            "draft_block_table": ((steps, rows, width), torch.int32),
        })

    def init_cuda_graph_state(self, max_bs: int, max_seq_len: Optional[int] = None) -> dict:
        """Allocate the static buffers once (zero-filled: null page, slot 0)."""
        self.graph_buffers = self.buffer_spec(max_bs, max_seq_len).allocate(self.req_to_token.device)
        return self.graph_buffers

    # -- planning -----------------------------------------------------------------------
    def _validate(self, batch: ForwardBatch, out: Optional[dict]) -> None:
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be an aiter_attn.ForwardBatch, got {type(batch).__name__}.")
        if self.pair.contract(batch.forward_mode).graph_mode != ForwardMode.DECODE:
            raise ValueError(
                f"multi-step draft decode takes a DECODE batch whose seq_lens are the committed "
                f"lengths; got forward_mode={batch.forward_mode.name}.")
        bs = batch.batch_size
        hint = ("the draft batch holds one entry per request (build it with "
                "ForwardBatch.from_lengths).")
        check_tensor("batch.seq_lens_cpu", batch.seq_lens_cpu, dtypes=INDEX_DTYPES, ndim=1,
                     hint=hint)
        if batch.seq_lens_cpu.device.type != "cpu":
            raise ValueError("batch.seq_lens_cpu must live on the CPU (the host mirror of "
                             "seq_lens).")
        for name in ("req_pool_indices", "seq_lens"):
            check_tensor(f"batch.{name}", getattr(batch, name), dtypes=INDEX_DTYPES, ndim=1,
                         shape=(bs,), hint=hint)
        if batch.req_pool_indices.device != self.req_to_token.device:
            raise ValueError(f"batch tensors are on {batch.req_pool_indices.device}; the pools are "
                             f"on {self.req_to_token.device}.")
        if batch.batch_size == 0:
            return
        if int(batch.seq_lens_cpu.min()) < 1:
            raise ValueError("batch.seq_lens_cpu has a request with no committed token; draft "
                             "decode continues existing requests (seq_lens ≥ 1).")
        need = draft_columns_needed(batch.seq_lens_cpu, self.page_size, self.topk, self.num_steps)
        width = self.req_to_token.shape[1]
        if int(need.max()) > width:
            b = int(need.argmax())
            raise ValueError(
                f"request {b} (seq_len={int(batch.seq_lens_cpu[b])}) needs req_to_token columns "
                f"up to {int(need[b])} for topk={self.topk} × num_steps={self.num_steps} draft "
                f"slots > its width {width}; raise BackendConfig.max_context_len / the "
                "ReqToTokenPool width or finish the request.")
        if out is not None:
            rows = out["draft_req_pool_indices"].shape[0]
            if batch.batch_size * self.topk > rows:
                raise ValueError(
                    f"{batch.batch_size} requests × topk={self.topk} rows > the static buffers' "
                    f"{rows} rows; raise max_bs of init_cuda_graph_state.")
            cap = out["draft_block_table"].shape[2] * self.page_size - self.num_steps
            if batch.max_seq_len > cap:
                raise ValueError(
                    f"a request holds {batch.max_seq_len} committed tokens > {cap}, the static "
                    "draft page tables' bound; raise max_seq_len of init_cuda_graph_state.")

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> list[ForwardBatch]:
        """Plan every pass at once (device ops only; no host sync) and return the step batches.

        ``batch``: DECODE, ``seq_lens`` = committed tokens per request (draft slots laid out
        in ``req_to_token`` as the module docstring says). ``out``: static buffers from
        :meth:`init_cuda_graph_state` (views of them are returned) or ``None`` (allocated).
        """
        self._validate(batch, out)
        bs, topk, ps = batch.batch_size, self.topk, self.page_size
        rows = bs * topk
        steps = self.num_passes
        if out is None:
            out = self._shared_spec(bs, batch.max_seq_len).allocate(batch.device)
        r2t = self.req_to_token

        cu = out["draft_cu_seqlens_q"][: rows + 1]
        rpi = out["draft_req_pool_indices"][:rows]
        ops.build_draft_decode_indices(
            r2t, batch.req_pool_indices, batch.seq_lens, ps, topk, self.num_steps,
            cu, rpi, out["draft_seqused_k"][:steps, :rows], out["draft_positions"][:steps, :rows],
            out["draft_out_cache_loc"][:steps, :rows], out["draft_block_table"][:steps, :rows])

        prefix_cpu = batch.seq_lens_cpu.long().repeat_interleave(topk)
        q_len = self.contract.q_len(self.config)
        self.step_batches = [
            ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                req_pool_indices=rpi,
                seq_lens=out["draft_seqused_k"][i, :rows],
                seq_lens_cpu=prefix_cpu + i + 1,
                out_cache_loc=out["draft_out_cache_loc"][i, :rows],
                positions=out["draft_positions"][i, :rows],
                spec_info=SpecInfo(num_draft_tokens=q_len, topk=topk, qo_indptr=cu,
                                   block_table=out["draft_block_table"][i, :rows]),
            )
            for i in range(steps)
        ]
        return self.step_batches

    def init_forward_metadata(self, batch: ForwardBatch,
                              out: Optional[dict] = None) -> list[ForwardBatch]:
        """Plan all passes: the shared index tensors (:meth:`plan`), then per step the step
        strategy's metadata and the step's kernel plans for every bound layer group (under
        ``out``, step ``i``'s in its ``step{i}.`` buffers). Returns the step batches; run a
        layer of step ``i`` with :meth:`forward` ``(i, …)``."""
        step_batches = self.plan(batch, out)
        strategy, executor, debug = self.strategy, self.executor, self._core._debug
        mds = []
        for i, step_batch in enumerate(step_batches):
            # the step's metadata and kernel plans go to its own static buffers (never
            # regrown; a kernel's workspace added at capture stays in ``out`` for every later
            # plan of the step)
            step_out = None if out is None else _StepBuffers(out, _STEP_PREFIX.format(i))
            md = strategy.plan(step_batch, step_out)
            executor.plan_kernels(md, step_batch, step_out)
            if debug:
                from .testing.invariants import check_invariants

                check_invariants(md, step_batch, self.ctx)
            mds.append(md)
        self.step_metadata = mds
        return step_batches

    def init_forward_metadata_out_graph(self, batch: ForwardBatch):
        """Plan into the static buffers of :meth:`init_cuda_graph_state` (capture / replay)."""
        if self.graph_buffers is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) before planning into the "
                               "static buffers.")
        return self.init_forward_metadata(batch, out=self.graph_buffers)


class DraftStep:
    """A view of one draft step of a :class:`MultiStepDraftBackend`'s last plan (no state of
    its own: cheap to make).

    Attributes:
        index: the step (``0 ≤ index < num_passes``).
        batch / metadata: the step's ForwardBatch and AttnMetadata of the last plan.
    """

    __slots__ = ("ms", "index")

    def __init__(self, ms: MultiStepDraftBackend, index: int):
        self.ms, self.index = ms, index

    @property
    def batch(self) -> ForwardBatch:
        return self.ms.step_batches[self.index]

    @property
    def metadata(self) -> AttnMetadata:
        return self.ms.step_metadata[self.index]

    forward_metadata = metadata  # the AttentionBackend name (deprecated attn_backends use)

    def forward(self, q, k, v, layer: LayerSpec, forward_batch: Optional[ForwardBatch] = None,
                save_kv_cache: bool = True, *, sinks=None) -> torch.Tensor:
        """:meth:`MultiStepDraftBackend.forward` of this step. ``forward_batch`` (optional,
        the AttentionBackend signature) must be this step's batch of the last plan."""
        ms = self.ms
        if forward_batch is not None and (
                self.index >= len(ms.step_batches)
                or forward_batch is not ms.step_batches[self.index]):
            raise RuntimeError(
                f"draft step {self.index} got a batch that is not its step batch of the last "
                "plan; call ms.init_forward_metadata(draft_batch) and pass "
                f"ms.step_batches[{self.index}] (or no batch).")
        return ms.forward(self.index, q, k, v, layer, save_kv_cache, sinks=sinks)

    forward_decode = forward
