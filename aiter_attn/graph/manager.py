"""``CudaGraphManager``: static buffers owned in one place, one planning path, capture/replay.

The manager owns, for a list of captured batch sizes,

* the static inputs every graph reads (:class:`~aiter_attn.graph.buffers.StaticInputs`) and
  optional per-token model inputs (``token_inputs``, e.g. ``input_ids`` or hidden states);
* every strategy's declared buffers (``MetadataStrategy.buffer_spec``), sized once from
  :class:`~aiter_attn.types.BackendConfig` with the slack of each captured mode.

Capture and replay call the very same ``plan(batch, out=buffers)`` as eager planning; the only
difference is that the batch is a fixed set of views into the static inputs. Replay pads the
real batch to the next captured size (see :mod:`aiter_attn.graph.padding`), plans, checks that
the plan froze the same addresses, shapes and host values as at capture
(:mod:`aiter_attn.graph.signature`), and replays. On the CPU, or with ``use_cuda_graph=False``,
"replay" runs the captured function eagerly on the same static batch, so every piece of logic
but the graph itself is exercised without a GPU. The function always receives a batch whose CPU
mirrors (``seq_lens_cpu``, …) are frozen at their capture values, which is what a real graph
sees: an execution strategy that reads host values from the batch goes wrong on the CPU exactly
as it would under replay, instead of only on the GPU.

Typical use::

    mgr = CudaGraphManager(backend, capture_sizes=[1, 2, 4, 8],
                           token_inputs={"input_ids": ((), torch.int64)})
    mgr.capture(lambda batch, inputs: model(inputs["input_ids"], batch))
    logits = mgr.replay(real_batch, input_ids=ids)   # real rows only

``backend`` may also be a :class:`~aiter_attn.multistep.MultiStepDraftBackend` (multi-step
draft decode; see :mod:`aiter_attn.graph.sources`).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping
from typing import Callable, Iterable, Optional, Sequence

import attrs
import torch

from ..batch import ForwardBatch, SpecInfo
from ..contract import contract_of
from ..types import ForwardMode
from ..validation import check_int, is_int_at_least
from .buffers import (CAPTURABLE_MODES, GraphLimits, StaticInputs, default_capture_sizes)
from .padding import GraphLimitError, check_mask_fits, load_padded, next_capture_size
from .signature import (GraphMetadataMismatch, describe_signature, diff_signatures,
                        metadata_signature)
from .sources import source_for

__all__ = ["CudaGraphManager", "GraphLimitError", "GraphMetadataMismatch", "graph_mode"]

log = logging.getLogger(__name__)

StepFn = Callable[[ForwardBatch, dict], object]


def graph_mode(mode) -> ForwardMode:
    """The mode whose graphs serve ``mode``: its contract's ``graph_mode`` (IDLE replays
    DECODE graphs, an all-padding batch); a mode that is never captured maps to itself (the
    limits then say why it cannot be)."""
    contract = contract_of(mode)
    return contract.graph_mode if contract.graph_mode is not None else contract.mode


@attrs.define(eq=False)
class _ModeState:
    """One captured mode: its bounds, planner and that planner's static buffers."""

    limits: GraphLimits
    planner: object
    buffers: dict
    spec: Optional[SpecInfo]
    rows_per_request: int  # token-input / output rows per request


@attrs.define(eq=False)
class _Entry:
    """One (mode, batch size): the static batch view, its plan's frozen signature, the graph."""

    mode: ForwardMode
    bs: int
    batch: ForwardBatch  # planned every replay: live CPU mirrors
    run_batch: ForwardBatch  # what fn sees: same device tensors, CPU mirrors frozen at capture
    inputs: dict
    signature: Optional[tuple] = None
    described: Optional[dict] = None  # the capture's signature with names (error messages)
    # the capture's metadata: kernels bound while the captured function first ran plan their
    # groups lazily into it, so its signature is taken again at the first replay (settled)
    captured: object = None
    settled: bool = True
    graph: Optional[object] = None
    fn: Optional[StepFn] = None
    outputs: object = None


def _slice_rows(x, n: int):
    if isinstance(x, torch.Tensor):
        return x[:n]
    if isinstance(x, list) or type(x) is tuple:
        return type(x)(_slice_rows(v, n) for v in x)
    if isinstance(x, tuple):  # a namedtuple: built from its fields
        return type(x)(*(_slice_rows(v, n) for v in x))
    if isinstance(x, Mapping):
        return {k: _slice_rows(v, n) for k, v in x.items()}
    return x


_MIRRORS = ("seq_lens_cpu", "extend_seq_lens_cpu", "extend_prefix_lens_cpu")


def _batch_sizes(values, name: str, *, allow_empty: bool = False) -> list[int]:
    """``values`` as sorted distinct ints ≥ 1; a float (even a whole one), a bool or a string
    is refused, never truncated into a size nobody asked for."""
    given = list(values)  # an iterator is read once: the message lists what it held
    if (not given and not allow_empty) or not all(is_int_at_least(s, 1) for s in given):
        raise ValueError(f"{name}={given!r}; give batch sizes as integers ≥ 1.")
    return sorted({operator.index(s) for s in given})


class CudaGraphManager:
    """Static inputs + strategy buffers for captured batch sizes; capture and replay.

    Args:
        backend: the :class:`~aiter_attn.AttentionBackend` whose strategies plan (or a
            :class:`~aiter_attn.multistep.MultiStepDraftBackend`).
        capture_sizes: batch sizes to capture: integers ≥ 1, any order, repeats ignored (a
            float, bool or string is refused, not truncated); default: a 1, 2, 4, 8, 16, …
            ladder up to ``max_bs``.
        max_bs: largest batch (default: the largest capture size, else
            ``BackendConfig.max_batch_size``).
        max_num_tokens: optional extra bound on query tokens (SGLang's argument); never below
            ``max_bs · tokens per request`` of a mode.
        modes: modes to prepare (default: DECODE, plus TARGET_VERIFY and DRAFT_EXTEND_V2 when
            ``config.spec`` is set and a capturable strategy serves them). IDLE is served by
            DECODE's graphs.
        use_cuda_graph: capture real CUDA graphs (default: when the backend lives on CUDA);
            ``False`` runs the captured function eagerly on the static batch ("no-capture").
        token_inputs: per-token model inputs the manager should own, ``name → (trailing shape,
            dtype)``; replay copies them in and zero-pads the padding tokens.
    """

    def __init__(self, backend, *, capture_sizes: Optional[Iterable[int]] = None,
                 max_bs: Optional[int] = None, max_num_tokens: Optional[int] = None,
                 modes: Optional[Iterable] = None, use_cuda_graph: Optional[bool] = None,
                 token_inputs: Optional[Mapping[str, tuple]] = None):
        self.backend = backend
        self.source = source_for(backend)
        self.config = self.source.config
        device = self.source.device
        sizes = None
        if capture_sizes is not None:
            sizes = _batch_sizes(capture_sizes, "capture_sizes")
        if max_bs is None:
            max_bs = sizes[-1] if sizes else self.config.max_batch_size
        max_bs = check_int(max_bs, "max_bs", 1, " (the largest captured batch size)")
        if max_num_tokens is not None:
            max_num_tokens = check_int(max_num_tokens, "max_num_tokens", 0,
                                       " (query tokens of the largest batch; None = max_bs · "
                                       "tokens per request)")
        sizes = sizes or default_capture_sizes(max_bs)
        if sizes[-1] > max_bs:
            raise ValueError(f"capture size {sizes[-1]} > max_bs={max_bs}; drop it or raise max_bs.")
        self.capture_sizes: list[int] = sizes
        self.max_bs = max_bs
        if use_cuda_graph is None:
            use_cuda_graph = device.type == "cuda"
        if use_cuda_graph and device.type != "cuda":
            raise ValueError(
                f"use_cuda_graph=True needs the backend on a CUDA device (it is on {device}); "
                "pass use_cuda_graph=False to run captured steps eagerly.")
        self.use_cuda_graph = bool(use_cuda_graph)
        self._check_null_row()

        self._modes = self._prepare_modes(modes, max_bs, max_num_tokens, device)
        limits = [st.limits for st in self._modes.values()]
        self.static = StaticInputs.allocate(limits, device)
        rows = max(max(st.limits.max_num_tokens, st.limits.max_bs * st.rows_per_request)
                   for st in self._modes.values())
        self._token_inputs = {
            name: torch.zeros((rows, *tuple(shape)), dtype=dtype, device=device)
            for name, (shape, dtype) in dict(token_inputs or {}).items()
        }
        self._entries: dict[tuple, _Entry] = {}
        self._pool = None
        self.replays = 0
        #: the entry of the latest replay (tests read its padded ``outputs`` and ``batch``)
        self.last_entry: Optional[_Entry] = None

    # -- set-up ----------------------------------------------------------------------------
    def _check_null_row(self) -> None:
        # One-time read at construction (never on the hot path): padding relies on row 0.
        if bool((self.source.req_to_token[0] != 0).any()):
            raise ValueError(
                "req_to_token row 0 holds slots; it must stay reserved and all zeros (padding "
                "rows of captured batches point at it). Allocate rows with ReqToTokenPool.alloc().")

    def _prepare_modes(self, modes, max_bs, max_num_tokens, device) -> dict:
        """Per mode: bounds, planner and that planner's buffers (allocated once, shared by
        the modes one planner serves)."""
        states: dict[ForwardMode, _ModeState] = {}
        shared: dict[str, tuple] = {}  # planner key → (planner, limits of its modes)
        for m in self._resolve_modes(modes):
            lim = GraphLimits.from_config(self.config, m, max_bs, max_num_tokens,
                                          contract=self.source.contract(m))
            key = self.source.planner_key(m)
            if key not in shared:
                shared[key] = (self.source.planner(m), [])
            shared[key][1].append(lim)
        for planner, lims in shared.values():
            declared = planner.buffer_spec(lims[0])
            for lim in lims[1:]:
                declared = declared.merge(planner.buffer_spec(lim))
            bufs = declared.allocate(device)  # zero = null page / slot 0
            for lim in lims:
                spec = None
                if self.source.contract(lim.mode).tokens == "draft":
                    spec = SpecInfo(num_draft_tokens=self.config.spec.num_draft_tokens,
                                    topk=self.config.spec.topk)
                states[lim.mode] = _ModeState(lim, planner, bufs, spec,
                                              planner.rows_per_request_of(lim))
        return states

    def _resolve_modes(self, modes) -> list[ForwardMode]:
        if modes is None:
            return self.source.default_modes()
        modes = list(modes)
        if not modes:
            raise ValueError("modes=[]; give the modes to capture (e.g. ['decode']) or leave "
                             "modes out for the defaults (DECODE, plus the speculative modes "
                             "when BackendConfig.spec is set).")
        out = []
        for m in modes:
            m = graph_mode(m)
            if m not in CAPTURABLE_MODES:
                allowed = ", ".join(x.name for x in CAPTURABLE_MODES)
                raise ValueError(f"modes contains {m.name}, which cannot be captured; "
                                 f"capturable: {allowed} (IDLE uses DECODE's graphs).")
            if m not in out:
                out.append(m)
        return out

    @property
    def modes(self) -> list[ForwardMode]:
        return list(self._modes)

    def limits(self, mode) -> GraphLimits:
        return self._state(graph_mode(mode)).limits

    def strategy_buffers(self, mode) -> dict:
        """The static buffers ``mode``'s planner fills (shared by modes of one strategy pair)."""
        return self._state(graph_mode(mode)).buffers

    def fill_value(self, mode) -> int:
        """KV length of padding rows: the backend's fill value, at least the mode's q_len."""
        q = self._state(graph_mode(mode)).limits.q_len
        return max(self.source.fill_value(), q, 1)

    def _state(self, mode: ForwardMode) -> _ModeState:
        st = self._modes.get(mode)
        if st is None:
            raise GraphLimitError(
                f"forward_mode={mode.name} has no CUDA-graph buffers here (prepared: "
                f"{[m.name for m in self._modes]}); pass it in CudaGraphManager(modes=...) or "
                "set BackendConfig.spec for speculative modes, or run this step eagerly.")
        return st

    def entry(self, mode, bs: int) -> _Entry:
        """The static batch of ``(mode, bs)`` (created once; its tensors never change)."""
        mode = graph_mode(mode)
        key = (mode, bs)
        e = self._entries.get(key)
        if e is None:
            st = self._state(mode)
            if bs > st.limits.max_bs:
                raise GraphLimitError(
                    f"batch size {bs} > the graph buffers' max_bs={st.limits.max_bs}; raise "
                    "max_bs / BackendConfig.max_batch_size.")
            batch = self.static.batch_view(mode, bs, st.limits.q_len, st.spec,
                                           tree_mask=st.limits.mask_numel > 0)
            # A graph replays the host values its function saw at capture; give fn a batch
            # whose CPU mirrors stay frozen so no-capture runs see exactly what a graph sees.
            run_batch = attrs.evolve(batch, **{m: getattr(batch, m).clone() for m in _MIRRORS})
            rows = bs * st.rows_per_request
            inputs = {k: v[:rows] for k, v in self._token_inputs.items()}
            e = self._entries[key] = _Entry(mode, bs, batch, run_batch, inputs)
        return e

    # -- the one planning path ---------------------------------------------------------------
    def check_fits(self, batch: ForwardBatch) -> None:
        """Raise :class:`GraphLimitError` naming the limit and setting ``batch`` exceeds."""
        st = self._state(graph_mode(batch.forward_mode))
        lim = st.limits
        if batch.encoder_lens is not None:
            raise GraphLimitError("cross-attention batches (encoder_lens set) are not captured; "
                                  "run them eagerly.")
        bs = batch.batch_size
        if bs > self.capture_sizes[-1]:
            next_capture_size(self.capture_sizes, bs)  # raises, naming the setting
        if batch.num_tokens != bs * lim.q_len:
            raise GraphLimitError(
                f"{batch.forward_mode.name} batch has {batch.num_tokens} tokens for {bs} requests;"
                f" its graphs were captured with {lim.q_len} tokens per request "
                "(BackendConfig.spec.num_draft_tokens for speculative modes).")
        spec = batch.spec_info
        if st.spec is not None and spec is not None and (
                spec.num_draft_tokens != st.spec.num_draft_tokens or spec.topk != st.spec.topk):
            raise GraphLimitError(
                f"spec_info has num_draft_tokens={spec.num_draft_tokens}, topk={spec.topk}; the "
                f"graphs were captured for {st.spec.num_draft_tokens}, {st.spec.topk} "
                "(BackendConfig.spec).")
        if bs and lim.q_len > 1:
            # a row shorter than its queries (an engine's padding row at SGLang's fill value 1)
            i = batch.first_row_shorter_than(lim.q_len)
            if i is not None:
                raise GraphLimitError(
                    f"seq_lens_cpu[{i}]={int(batch.seq_lens_cpu[i])} < {lim.q_len} query tokens "
                    f"per request of {lim.mode.name}: every row, padding included, must hold "
                    f"its own draft tokens; pad rows with seq_len ≥ {lim.q_len} "
                    f"(CudaGraphManager.fill_value({lim.mode.name.lower()!r}) = "
                    f"{self.fill_value(lim.mode)}).")
        if bs and batch.max_seq_len > lim.max_seq_len:
            raise GraphLimitError(
                f"a request holds {batch.max_seq_len} KV tokens > the graph buffers' "
                f"max_seq_len={lim.max_seq_len} for {lim.mode.name}; raise "
                "BackendConfig.max_context_len.")

    def _plan(self, e: _Entry, *, capturing: bool):
        st = self._modes[e.mode]
        md = st.planner.plan(e.batch, st.buffers)
        dev = self.source.device
        sig = metadata_signature(md, dev)
        if capturing or e.signature is None:
            e.signature, e.described = sig, describe_signature(md, dev)
            e.captured, e.settled = md, False
            for m in _MIRRORS:
                getattr(e.run_batch, m).copy_(getattr(e.batch, m))
            st.planner.bind(e.run_batch, md)
            return md
        if not e.settled:  # the capture is complete: freeze what its run planned lazily
            e.signature = metadata_signature(e.captured, dev)
            e.described = describe_signature(e.captured, dev)
            e.settled = True  # e.captured stays: it holds what the graph reads
        if sig != e.signature:
            diffs = diff_signatures(e.described, describe_signature(md, dev))
            raise GraphMetadataMismatch(
                f"planner {st.planner.name!r} planned metadata for {e.mode.name} bs={e.bs} that "
                f"differs from capture: {'; '.join(diffs)}. Under out= a plan must write into "
                "the given buffers and take host sizes from static bounds only.")
        st.planner.bind(e.run_batch, md)
        return md

    def load(self, batch: ForwardBatch, *, padded_bs: Optional[int] = None,
             capturing: bool = False, **inputs) -> _Entry:
        """Validate ``batch``, pad it into the static inputs of the next captured size (or
        ``padded_bs``) and plan into the static buffers (no device→host sync)."""
        from ..backend import validate_batch

        mode = graph_mode(batch.forward_mode)
        st = self._state(mode)
        if isinstance(batch, ForwardBatch):  # the graph limits first: they name the setting
            self.check_fits(batch)
        validate_batch(batch, self.config, self.source.req_to_token)
        if padded_bs is not None and padded_bs < batch.batch_size:
            raise GraphLimitError(
                f"padded_bs={padded_bs} < the batch's {batch.batch_size} requests; pad to a size "
                "≥ the batch (or leave padded_bs out: the next captured size is used).")
        pbs = padded_bs if padded_bs is not None else next_capture_size(self.capture_sizes,
                                                                         batch.batch_size)
        e = self.entry(mode, pbs)
        fill = self.fill_value(mode)
        tree = st.limits.mask_numel > 0  # the static batch reads static.custom_mask
        check_mask_fits(self.static, batch, pbs, st.limits.q_len, fill, st.limits.max_seq_len,
                        tree_mask=tree)
        self._load_inputs(e, batch.batch_size * st.rows_per_request, inputs)
        load_padded(self.static, batch, pbs, st.limits.q_len, fill, tree_mask=tree)
        self._plan(e, capturing=capturing)
        return e

    def _load_inputs(self, e: _Entry, n: int, inputs: dict) -> None:
        missing = set(self._token_inputs) - set(inputs)
        unknown = set(inputs) - set(self._token_inputs)
        if unknown or missing:
            raise ValueError(
                f"token inputs {sorted(unknown)} are not owned by this manager and "
                f"{sorted(missing)} are missing; it owns {sorted(self._token_inputs)} "
                "(CudaGraphManager(token_inputs=...)).")
        for name, value in inputs.items():
            buf = self._token_inputs[name]
            if tuple(value.shape) != (n, *buf.shape[1:]):
                raise ValueError(
                    f"token input {name!r} has shape {tuple(value.shape)}; expected "
                    f"{(n, *buf.shape[1:])} (one row per query token).")
            # copy_ would convert silently (floats truncated into ids, q in another dtype
            # than eager would accept) or copy across devices with a sync: refuse instead
            if value.dtype != buf.dtype or value.device != buf.device:
                raise ValueError(
                    f"token input {name!r} is {value.dtype} on {value.device}; this manager "
                    f"owns it as {buf.dtype} on {buf.device} (CudaGraphManager(token_inputs="
                    "...)): convert it with .to(device, dtype) or declare that dtype.")
            buf[:n].copy_(value)
            buf[n: e.inputs[name].shape[0]].zero_()

    # -- capture / replay --------------------------------------------------------------------
    def _load_dummy(self, e: _Entry) -> None:
        st = self._modes[e.mode]
        dev = self.source.device
        empty = ForwardBatch(
            forward_mode=e.mode,
            req_pool_indices=torch.zeros(0, dtype=torch.int64, device=dev),
            seq_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            seq_lens_cpu=torch.zeros(0, dtype=torch.int64),
            out_cache_loc=torch.zeros(0, dtype=torch.int64, device=dev),
        )
        load_padded(self.static, empty, e.bs, st.limits.q_len, self.fill_value(e.mode),
                    tree_mask=st.limits.mask_numel > 0)
        for buf in e.inputs.values():
            buf.zero_()

    def capture(self, fn: StepFn, *, modes: Optional[Iterable] = None,
                sizes: Optional[Sequence[int]] = None) -> None:
        """Capture ``fn(batch, inputs)`` for every (mode, size), largest size first.

        ``fn`` runs one step on the static ``batch`` (call ``backend.forward(..., batch)`` in
        it) and returns per-token output tensors (a tensor, or a tuple/list/dict of them).
        Capture plans an all-padding batch into the static buffers, runs ``fn`` once to warm up
        (Triton compilation, workspaces), then records it in a graph sharing one memory pool.
        """
        # each (mode, size) once: IDLE is DECODE's graphs, a repeated size is the same graph
        modes = (list(dict.fromkeys(graph_mode(m) for m in modes)) if modes is not None
                 else self.modes)
        sizes = (self.capture_sizes if sizes is None
                 else _batch_sizes(sizes, "sizes", allow_empty=True))
        for s in sizes:
            if s not in self.capture_sizes:
                raise ValueError(f"size {s} is not one of capture_sizes={self.capture_sizes}.")
        for mode in modes:  # before any capture: never leave a half-captured manager
            self._state(mode)
        sizes = sorted(sizes, reverse=True)
        for mode in modes:
            for bs in sizes:
                self._capture_one(fn, mode, bs)

    def _capture_one(self, fn: StepFn, mode: ForwardMode, bs: int) -> None:
        e = self.entry(mode, bs)
        e.fn = fn
        self._load_dummy(e)
        self._plan(e, capturing=True)
        if not self.use_cuda_graph:
            e.outputs = fn(e.run_batch, e.inputs)
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.source.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(e.run_batch, e.inputs)  # warm-up: compile kernels, bind layers, workspaces
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # a cell's support is the weaker of its pair's and kernels': raise naming the kernel
        self._modes[mode].planner.check_capturable()
        self._plan(e, capturing=True)  # the layers bound in the warm-up plan their kernels
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            e.outputs = fn(e.run_batch, e.inputs)
        e.graph = graph
        log.debug("captured %s bs=%d", mode.name, bs)

    def replay(self, batch: ForwardBatch, **inputs):
        """Run one step of a real ``batch`` through the captured graph of the next size.

        Returns ``fn``'s outputs restricted to the real rows (views of static memory that the
        next replay overwrites: copy what must outlive it).
        """
        e = self.load(batch, **inputs)
        if e.fn is None:
            raise GraphLimitError(
                f"{e.mode.name} bs={e.bs} was not captured; call capture() first (or capture "
                "this mode and size).")
        if e.graph is not None:
            e.graph.replay()
        else:
            e.outputs = e.fn(e.run_batch, e.inputs)
        self.replays += 1
        self.last_entry = e
        rows = batch.batch_size * self._modes[e.mode].rows_per_request
        return _slice_rows(e.outputs, rows)

    def captured(self) -> list[tuple]:
        """``(mode, bs)`` of every captured entry."""
        return sorted(((e.mode, e.bs) for e in self._entries.values() if e.fn is not None),
                      key=lambda k: (k[0].value, k[1]))

    def buffer_pointers(self) -> dict[str, int]:
        """``name → data_ptr`` of every static buffer (they never change after construction)."""
        ptrs = {f"static.{k}": v.data_ptr() for k, v in self.static.tensors().items()}
        for mode, st in self._modes.items():
            for k, v in st.buffers.items():
                ptrs[f"{st.planner.name}.{k}"] = v.data_ptr()
        for k, v in self._token_inputs.items():
            ptrs[f"inputs.{k}"] = v.data_ptr()
        return ptrs

    # -- SGLang-shaped hooks (the engine owns its graphs and pads its own inputs) -------------
    def _hook_batch(self, bs, forward_mode, req_pool_indices, seq_lens, spec_info, seq_lens_cpu,
                    out_cache_loc, positions, *, need_slots: bool) -> ForwardBatch:
        q = self._state(graph_mode(forward_mode)).limits.q_len
        if seq_lens_cpu is None:
            if need_slots:  # replay: the hot path makes no device→host sync
                raise ValueError(
                    "seq_lens_cpu is required on replay: planning reads the CPU mirror of "
                    "seq_lens (reading seq_lens back would sync); pass seq_lens_cpu="
                    "forward_batch.seq_lens_cpu.")
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise ValueError("seq_lens_cpu is required while a CUDA graph is capturing "
                                 "(reading seq_lens back would sync).")
            seq_lens_cpu = seq_lens[:bs].to("cpu", torch.int64)  # capture time only
        if out_cache_loc is None:
            if need_slots:
                raise ValueError(
                    "out_cache_loc is required on replay: the captured graph writes this step's "
                    "K/V through the static out_cache_loc; pass out_cache_loc=forward_batch."
                    "out_cache_loc (padding tokens may hold DUMMY_SLOT).")
            out_cache_loc = torch.zeros(bs * q, dtype=torch.int64, device=self.source.device)
        return ForwardBatch(
            forward_mode=forward_mode, req_pool_indices=req_pool_indices[:bs],
            seq_lens=seq_lens[:bs].to(torch.int32), seq_lens_cpu=seq_lens_cpu[:bs].to(torch.int64),
            out_cache_loc=out_cache_loc[: bs * q],
            positions=None if positions is None else positions[: bs * q], spec_info=spec_info)

    def plan_capture(self, bs: int, forward_mode, req_pool_indices, seq_lens, spec_info=None, *,
                     seq_lens_cpu=None, out_cache_loc=None, positions=None) -> ForwardBatch:
        """Plan ``bs`` rows (the engine's padded inputs) into the static buffers before the
        engine captures; returns the static batch to pass to ``forward`` in the graph."""
        batch = self._hook_batch(bs, forward_mode, req_pool_indices, seq_lens, spec_info,
                                 seq_lens_cpu, out_cache_loc, positions, need_slots=False)
        return self.load(batch, padded_bs=bs, capturing=True).run_batch

    def plan_replay(self, bs: int, forward_mode, req_pool_indices, seq_lens, spec_info=None, *,
                    seq_lens_cpu=None, out_cache_loc=None, positions=None) -> ForwardBatch:
        """Refill and re-plan the buffers of a size planned by :meth:`plan_capture` (same
        buffers, same plan; raises if the plan's frozen parts moved)."""
        mode = graph_mode(forward_mode)
        if (mode, bs) not in self._entries:
            raise GraphLimitError(
                f"{mode.name} bs={bs} was never planned for capture; call "
                "init_forward_metadata_capture_cuda_graph for this size first.")
        batch = self._hook_batch(bs, forward_mode, req_pool_indices, seq_lens, spec_info,
                                 seq_lens_cpu, out_cache_loc, positions, need_slots=True)
        return self.load(batch, padded_bs=bs).run_batch
