"""Static buffers of CUDA-graph capture: sizes from :class:`BackendConfig`, allocated once.

Two kinds live here:

* :class:`GraphLimits`: the static bounds one forward mode needs (requests, query tokens per
  request, query tokens in all, KV length per request with its slack), derived from the
  backend config. Every buffer is sized from these, so the bounds, and the errors that name
  them, come from one place.
* :class:`StaticInputs`: the batch inputs a captured graph reads (``req_pool_indices``,
  ``seq_lens`` and its CPU mirror, ``out_cache_loc``, ``positions``, the speculative inputs),
  owned by the manager and refilled in place before every replay.

Strategies' own buffers come from ``MetadataStrategy.buffer_spec`` and are allocated by
:func:`allocate_strategy_buffers`; nothing here is ever reallocated after construction.
"""

from __future__ import annotations

from typing import Iterable, Optional

import attrs
import torch

from ..batch import ForwardBatch, SpecInfo
from ..contract import MODE_CONTRACTS, ModeContract, capturable_modes, contract_of
from ..types import BackendConfig, ForwardMode
from ..validation import NULL_SLOT

__all__ = [
    "NULL_REQ_ROW",
    "DUMMY_SLOT",
    "CAPTURABLE_MODES",
    "GraphLimits",
    "StaticInputs",
    "default_capture_sizes",
]

#: ``req_to_token`` row that padding requests use: never handed out, all zeros, so every
#: token of a padding row maps to the null slot 0 (``ReqToTokenPool`` reserves it).
NULL_REQ_ROW = 0
#: KV slot padding tokens write to: slot 0 of the null page 0, never a live request's slot
#: (the checked mode lets any number of tokens write it: :data:`~aiter_attn.validation.NULL_SLOT`).
DUMMY_SLOT = NULL_SLOT

#: Modes a graph can be captured for (IDLE replays the DECODE graphs): from the mode contracts.
CAPTURABLE_MODES = capturable_modes()


def default_capture_sizes(max_bs: int) -> list[int]:
    """SGLang-like ladder: 1, 2, 4, 8, then every 8 up to 256, then every 16; ``max_bs`` last."""
    if max_bs < 1:
        raise ValueError(f"max_bs={max_bs}; the largest captured batch size must be ≥ 1.")
    sizes = [s for s in (1, 2, 4) if s < max_bs]
    sizes += list(range(8, min(max_bs, 256) + 1, 8))
    sizes += list(range(272, max_bs + 1, 16))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


@attrs.frozen(kw_only=True)
class GraphLimits:
    """Static bounds of one captured mode.

    Attributes:
        mode: the graph mode (DECODE serves IDLE too).
        max_bs: most requests (the largest captured batch size).
        q_len: query tokens per request (1 for decode; ``num_draft_tokens`` for verify and
            draft-extend v2).
        max_num_tokens: ``max_bs · q_len``: query tokens in the largest batch.
        max_seq_len: KV tokens one request may hold in this mode: ``max_context_len`` plus
            the draft slack of speculative modes (``num_draft_tokens``). Page rounding is
            applied by each strategy's ``buffer_spec`` (``ceil(max_seq_len / page_size)``);
            :meth:`table_pages` is that width for the kernels' workspaces.
        mask_numel: elements of the flat tree mask (``max_num_tokens · max_seq_len``) when the
            mode takes a custom mask (tree verify, ``topk > 1``), else 0.
    """

    mode: ForwardMode
    max_bs: int
    q_len: int
    max_num_tokens: int
    max_seq_len: int
    mask_numel: int = 0

    def table_pages(self, page_size: int) -> int:
        """The static block table's width in pages (at least one): a captured step's key
        bound is this times ``page_size``, and the kernels' split counts follow it."""
        return max(-(-self.max_seq_len // max(page_size, 1)), 1)

    @classmethod
    def from_config(cls, config: BackendConfig, mode: ForwardMode, max_bs: int,
                    max_num_tokens: Optional[int] = None,
                    contract: Optional[ModeContract] = None) -> "GraphLimits":
        """Bounds for ``mode`` with up to ``max_bs`` requests, from its
        :class:`~aiter_attn.contract.ModeContract` (the strategy pair's, or the default).

        ``max_num_tokens`` (SGLang's argument) may only raise the token bound above
        ``max_bs · q_len``, never lower it.
        """
        mode = ForwardMode.parse(mode)
        contract = contract or contract_of(mode)
        if contract.graph_mode is not None:
            mode = contract.graph_mode
        if not contract.capturable or mode not in CAPTURABLE_MODES:
            allowed = ", ".join(m.name for m, c in MODE_CONTRACTS.items() if c.capturable)
            raise ValueError(
                f"forward_mode={mode.name} cannot be captured in a CUDA graph (its query "
                f"lengths are ragged); capturable: {allowed}. Run it eagerly."
            )
        if max_bs < 1:
            raise ValueError(f"max_bs={max_bs}; must be ≥ 1 (the largest captured batch size).")
        q_len = contract.q_len(config)
        tokens = max(max_bs * q_len, max_num_tokens or 0)
        max_seq_len = config.max_context_len + contract.slack(config)
        tree = contract.has_mask(config)
        return cls(mode=mode, max_bs=max_bs, q_len=q_len, max_num_tokens=tokens,
                   max_seq_len=max_seq_len, mask_numel=tokens * max_seq_len if tree else 0)


@attrs.define(eq=False)
class StaticInputs:
    """Batch inputs read by captured graphs, allocated once for the largest batch.

    Attributes (device tensors unless noted; each sized for ``max_bs`` requests or
    ``max_num_tokens`` tokens):
        req_pool_indices: int64 ``[max_bs]``.
        seq_lens: int32 ``[max_bs]``.
        seq_lens_cpu: int64 ``[max_bs]`` on the CPU, the host mirror of ``seq_lens``.
        extend_seq_lens: int32 ``[max_bs]`` and ``extend_seq_lens_cpu`` (int64, CPU): query
            tokens per request (constant per mode; set when a view is taken).
        extend_prefix_lens_cpu: int64 ``[max_bs]`` on the CPU.
        out_cache_loc: int64 ``[max_num_tokens]``.
        positions: int64 ``[max_num_tokens]``.
        custom_mask: bool ``[mask_numel]`` (empty when no captured mode takes a tree mask).
        mask_indptr: int64 ``[max_bs + 1]`` scratch for expanding a tree-part mask.
    """

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_seq_lens_cpu: torch.Tensor
    extend_prefix_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    #: ``(q_len, padded_bs)`` the ``extend_seq_lens`` buffers were last filled for
    extend_state: tuple = attrs.field(default=(0, 0), eq=False)

    @classmethod
    def allocate(cls, limits: Iterable[GraphLimits], device) -> "StaticInputs":
        limits = list(limits)
        max_bs = max(lim.max_bs for lim in limits)
        tokens = max(lim.max_num_tokens for lim in limits)
        mask = max(lim.mask_numel for lim in limits)
        dev = torch.device(device)
        return cls(
            req_pool_indices=torch.full((max_bs,), NULL_REQ_ROW, dtype=torch.int64, device=dev),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            seq_lens_cpu=torch.ones(max_bs, dtype=torch.int64),
            extend_seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            extend_seq_lens_cpu=torch.ones(max_bs, dtype=torch.int64),
            extend_prefix_lens_cpu=torch.zeros(max_bs, dtype=torch.int64),
            out_cache_loc=torch.full((tokens,), DUMMY_SLOT, dtype=torch.int64, device=dev),
            positions=torch.zeros(tokens, dtype=torch.int64, device=dev),
            custom_mask=torch.ones(mask, dtype=torch.bool, device=dev),
            mask_indptr=torch.zeros(max_bs + 1, dtype=torch.int64, device=dev),
        )

    @property
    def max_bs(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def max_num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer by name (tests compare their ``data_ptr`` across replays)."""
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self))
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def batch_view(self, mode: ForwardMode, bs: int, q_len: int,
                   spec: Optional[SpecInfo] = None, *, tree_mask: bool = False) -> ForwardBatch:
        """A :class:`ForwardBatch` of ``bs`` requests whose tensors are views of these buffers.

        The same object is planned at capture and at every replay of that graph, so its
        tensors (pointers, shapes) never change; only their contents are refilled.
        ``spec`` (verify / draft-extend v2) gets a static ``custom_mask`` (the whole buffer)
        when ``tree_mask``: the serving pair's mode contract plans a tree mask (the manager
        passes ``limits.mask_numel > 0``, which :meth:`GraphLimits.from_config` set from it).
        """
        n = bs * q_len
        spec_view = None
        if spec is not None:
            spec_view = SpecInfo(num_draft_tokens=spec.num_draft_tokens, topk=spec.topk,
                                 custom_mask=self.custom_mask if tree_mask else None,
                                 mask_indptr=None)
        return ForwardBatch(
            forward_mode=mode,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs],
            out_cache_loc=self.out_cache_loc[:n],
            positions=self.positions[:n],
            extend_seq_lens=self.extend_seq_lens[:bs],
            extend_seq_lens_cpu=self.extend_seq_lens_cpu[:bs],
            extend_prefix_lens_cpu=self.extend_prefix_lens_cpu[:bs],
            spec_info=spec_view,
        )
