"""The plan value of the Triton absorbed-MLA launch (:class:`TritonMLAPlan`: what
:meth:`.mla.TritonMLA.plan` decides once per step and layer group, and
:meth:`.mla.TritonMLA.run` launches), the fused merge's modes and the ``tuning`` keys the
kernel object reads."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..base import MEMO, KernelPlan

__all__ = ["TritonMLAPlan", "TUNING_KEYS", "LAST_SPLIT", "COOPERATIVE"]

_T = dict(eq=False, repr=False)

#: ``FUSED_MERGE`` of the Triton kernel: the last split of a (token, head block) to finish
#: merges it; or a cooperative launch whose splits all wait, then each merge a column slice
LAST_SPLIT, COOPERATIVE = 1, 2


@attrs.frozen(kw_only=True)
class TritonMLAPlan(KernelPlan):
    """One step's launch of the Triton MLA kernel for one layer group.

    Attributes:
        grid: ``(num_tokens · head_blocks, splits)``.
        args: ``(cu_seqlens_q, seqused_k, block_table)`` tensors (unit stride).
        mask: ``(mask_uint8, mask_indptr)`` or ``None``.
        batch / head_blocks / splits: host integers of the launch.
        use_parts: the split path runs (partials + merge).
        part_o / part_lse: split partials ``[T, H, S, R]`` / ``[T, H, S]`` float32 (``None``
            without the split path; ``part_o`` in q's 16-bit dtype with ``half_partials``).
        cfg_kw: the launch configuration's constexprs; kw_cache: per-layer-flag dicts.
    """

    grid: tuple
    args: tuple = attrs.field(**_T)
    mask: Optional[tuple] = attrs.field(default=None, **_T)
    batch: int
    head_blocks: int
    splits: int
    use_parts: bool
    part_o: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    part_lse: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    cfg_kw: dict = attrs.field(factory=dict, **_T)
    kw_cache: dict = attrs.field(factory=dict, metadata=MEMO, **_T)
    #: the warp-specialised Gluon kernel (:mod:`.mla_gluon`) serves the launch when its
    #: tensors allow (checked per run); same grid, splits and partials
    gluon: bool = False
    #: the narrow Gluon kernels (:mod:`.mla_narrow_gluon`, or with ``ring``
    #: :mod:`.mla_ring_gluon`; up to 16 heads) where they serve the step: ``(splits,
    #: part_o, part_lse, ring, counters, one_query, pdl, merge_kw)`` of its own launch
    #: (partials ``None`` without splits; ``counters``: the narrow kernel merges its splits
    #: itself; ``pdl``: :func:`._pdl.pdl_mode` of its split merge launch, ``False`` without
    #: one; ``merge_kw``: that launch's PDL keywords, planned once); a
    #: run whose tensors they cannot read takes the Triton launch (its partials view the
    #: same static workspace: one of the two launches runs a step)
    narrow: Optional[tuple] = attrs.field(default=None, **_T)
    #: the one-launch merge (``FUSED_MERGE``): int32 counters, one per (token, head block),
    #: zero before and after every launch (``None``: the merge is a second launch)
    counters: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    #: the balanced launch (:mod:`.mla_balanced`, ``tuning["balanced"]``) where it serves the
    #: step: ``(programs, part_o [P, H, 2, R], part_lse [P, H, 2], launch keywords)``
    balanced: Optional[tuple] = attrs.field(default=None, **_T)
    #: the stream kernel (:mod:`.mla_stream_gluon`, ``tuning["stream"]``) where it serves
    #: the step: ``(launch keywords, merge keywords)`` of its launch and of the balanced
    #: merge launch; a run whose tensors it cannot read takes the split path (whose
    #: partials this plan also holds)
    stream: Optional[tuple] = attrs.field(default=None, **_T)


#: the ``tuning`` keys :class:`TritonMLA` reads (a misspelt key would otherwise be ignored
#: without a word, and a benchmark would time the default under the option's name)
TUNING_KEYS = frozenset({
    "num_kv_splits", "block_h", "block_n", "num_warps", "num_stages", "page_chunk",
    "split_v_load", "v_pairs", "pdl", "fused_merge", "kv_desc", "lazy_rescale",
    "half_partials", "qk_split", "ring", "one_query", "narrow", "gluon", "balanced",
    "balanced_rates", "stream"})

