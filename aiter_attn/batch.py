"""What the engine hands the backend each step: :class:`ForwardBatch` and :class:`SpecInfo`.

Device tensors drive the kernels; the ``*_cpu`` mirrors give the host the integers it needs
(totals, maxima) so planning never reads a device tensor back (no device→host sync).
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs
import torch

from .contract import contract_of
from .types import ForwardMode

__all__ = ["ForwardBatch", "SpecInfo"]


@attrs.define(kw_only=True, eq=False)
class SpecInfo:
    """Speculative-decoding inputs of a TARGET_VERIFY / DRAFT_EXTEND step.

    Attributes:
        num_draft_tokens: query tokens per request in TARGET_VERIFY / DRAFT_EXTEND_V2.
        topk: draft branching; 1 = chain (causal), > 1 = tree (``custom_mask`` required).
        custom_mask: bool (or uint8), flat; SGLang's layout: for request ``b`` a row-major
            ``[q_len, seq_len_b]`` block (True = may attend; ``seq_len_b`` counts the draft
            tokens, so the first ``seq_len_b - q_len`` columns are the cached prefix), blocks
            concatenated in batch order. The tree part alone, ``[batch, q_len, q_len]``
            (prefix implicitly visible), is accepted too and expanded on the device. ``None``
            for chains. See :mod:`aiter_attn.strategies.spec`.
        mask_indptr: int64 ``[batch + 1]`` offsets into ``custom_mask``; the strategies rebuild
            it on the device from ``seq_lens`` (a value given here is not read).
        qo_indptr / block_table: int32 ``[batch + 1]`` / ``[batch, max_pages]`` planned by the
            caller for one step of multi-step draft decode
            (:class:`aiter_attn.multistep.MultiStepDraftBackend` sets them; the
            ``mha.draft_decode_step`` strategy uses them as they are). ``None`` otherwise.
    """

    num_draft_tokens: int = 1
    topk: int = 1
    custom_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    qo_indptr: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None


def _host_ints(name: str, values) -> torch.Tensor:
    """int64 CPU tensor of ``values`` (host ints); a float is refused, not truncated."""
    t = torch.as_tensor(values.tolist() if isinstance(values, torch.Tensor) else list(values))
    if t.dim() != 1 or (t.numel() and (t.dtype == torch.bool or t.is_floating_point()
                                       or t.is_complex())):
        raise ValueError(f"{name}={t.tolist()!r} must be a flat sequence of integers (one per "
                         "request).")
    return t.to(torch.int64)


def _uniform_q_len(mode, spec_info: Optional[SpecInfo]) -> Optional[int]:
    """Query tokens per request by ``mode``'s contract (``None``: ragged); a draft-count mode
    without ``spec_info`` counts one (a plain :class:`SpecInfo`)."""
    return contract_of(mode).q_len(spec_info=spec_info if spec_info is not None else SpecInfo())


@attrs.define(kw_only=True, eq=False)
class ForwardBatch:
    """One forward step.

    Attributes:
        forward_mode: what this step does.
        req_pool_indices: int64 ``[batch]``: each request's row in ``req_to_token``.
        seq_lens: int32 ``[batch]``: KV length per request *after* this step's tokens.
        seq_lens_cpu: int64 ``[batch]`` on the CPU: mirror of ``seq_lens``.
        extend_seq_lens: int32 ``[batch]``: new (query) tokens per request (EXTEND/DRAFT_EXTEND).
        extend_seq_lens_cpu: CPU mirror of ``extend_seq_lens``.
        extend_prefix_lens_cpu: CPU mirror of the cached-prefix length per request.
        out_cache_loc: int64 ``[num_tokens]``: KV slot each new token is written to.
        positions: int64 ``[num_tokens]``: absolute position of each new token.
        spec_info: speculative inputs, or ``None``.
        encoder_lens: int32 ``[batch]`` for cross attention, else ``None``.
    """

    forward_mode: ForwardMode = attrs.field(converter=ForwardMode.parse)
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: Optional[torch.Tensor] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[torch.Tensor] = None
    extend_prefix_lens_cpu: Optional[torch.Tensor] = None
    spec_info: Optional[SpecInfo] = None
    encoder_lens: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def q_lens_cpu(self) -> torch.Tensor:
        """int64 ``[batch]`` query tokens per request, on the CPU (no sync)."""
        n = _uniform_q_len(self.forward_mode, self.spec_info)
        if n is None:
            return self.extend_seq_lens_cpu.to(torch.int64)
        return torch.full((self.batch_size,), n, dtype=torch.int64)

    @property
    def num_tokens(self) -> int:
        """Query tokens in this step (host integer)."""
        return int(self.out_cache_loc.shape[0])

    @property
    def seq_lens_sum(self) -> int:
        return int(self.seq_lens_cpu.sum())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_cpu.max()) if self.batch_size else 0

    def first_row_shorter_than(self, n: int) -> Optional[int]:
        """The first request whose KV length (``seq_lens_cpu``, this step's tokens included)
        is below ``n``, or ``None`` (host mirror: no sync). A uniform mode's request shorter
        than its ``n`` query tokens would put queries before position 0."""
        short = self.seq_lens_cpu < n
        return int(short.to(torch.uint8).argmax()) if bool(short.any()) else None

    @classmethod
    def from_lengths(
        cls,
        *,
        forward_mode: ForwardMode | str,
        req_pool_indices: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int],
        out_cache_loc: torch.Tensor,
        extend_seq_lens: Optional[Sequence[int]] = None,
        spec_info: Optional[SpecInfo] = None,
        device: str | torch.device = "cpu",
    ) -> "ForwardBatch":
        """Build a batch from host lists (tests, the reference engine).

        ``extend_seq_lens`` defaults to one token per request (decode) or the verify/draft
        token count; positions are the last ``q_len`` positions of each request (index
        order: for a tree draft the model's RoPE needs prefix + depth instead; attention never
        reads them, the tree window derives path positions from the mask).
        """
        mode = ForwardMode.parse(forward_mode)
        seq_cpu = _host_ints("seq_lens", seq_lens)
        bs = int(seq_cpu.shape[0])
        if extend_seq_lens is None:
            ext = torch.full((bs,), _uniform_q_len(mode, spec_info) or 1, dtype=torch.int64)
        else:
            ext = _host_ints("extend_seq_lens", extend_seq_lens)
            if ext.shape[0] != bs:  # would broadcast against seq_lens (prefix, positions)
                raise ValueError(
                    f"extend_seq_lens has {ext.shape[0]} entries for {bs} requests (seq_lens); "
                    "give one new-token count per request.")
        rpi_n = len(req_pool_indices)
        if rpi_n != bs:
            raise ValueError(f"req_pool_indices has {rpi_n} entries for {bs} requests "
                             "(seq_lens); give one req_to_token row per request.")
        prefix = seq_cpu - ext
        positions = (
            torch.cat([torch.arange(int(p), int(s)) for p, s in zip(prefix, seq_cpu)])
            if bs
            else torch.zeros(0, dtype=torch.int64)
        )
        rpi = torch.as_tensor(req_pool_indices, dtype=torch.int64)
        return cls(
            forward_mode=mode,
            req_pool_indices=rpi.to(device),
            seq_lens=seq_cpu.to(device=device, dtype=torch.int32),
            seq_lens_cpu=seq_cpu,
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            positions=positions.to(device),
            extend_seq_lens=ext.to(device=device, dtype=torch.int32),
            extend_seq_lens_cpu=ext,
            extend_prefix_lens_cpu=prefix,
            spec_info=spec_info,
        )
