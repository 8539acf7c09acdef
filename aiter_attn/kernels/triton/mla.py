"""Triton absorbed-MLA paged attention (decode / verify / draft-extend over a latent cache):
its launch configuration and plan/run object. The kernel and its math: :mod:`.mla_kernel`;
the plan value: :mod:`.mla_plan`; the split workspace, merge counters and cache descriptors
the object keeps: :mod:`.mla_workspace`; the functional entry point
:func:`mla_paged_attention`: :mod:`.mla_functional` (all re-exported here).

Plan/run (:class:`TritonMLA`, the registered kernel object): ``plan(md, out=None)`` (once per
step and layer group) chooses the launch configuration and split count from host integers,
takes the split partials' workspace (allocated eagerly, a view of a static buffer under CUDA
graphs: ``buffer_spec(limits)`` / ``out.setdefault``) and keeps the index tensors;
``run(q, (kv_cache,), plan, params, out)`` (once per layer) checks one shape and launches.
:func:`mla_paged_attention` is plan + run in one call.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton

from ...validation import unit_stride
from ..base import MLAKernel, mask_literal, mla_request, plan_hints, token_count_error
from ._kvutil import interpreting, is_fp8, max_shared_mem, next_pow2, num_sms
from ._launch import Launcher, launch_key
from ._launch_config import (BATCH_INVARIANT_SPLIT_TOKENS, MLA_FP8_VALUE_PAIRS, MLA_FUSED_MERGE,
                             MLA_BALANCED, MLA_HALF_PARTIALS, MLA_KV_DESCRIPTORS,
                             MLA_LAZY_RESCALE, MLA_NARROW, MLA_NARROW_PDL,
                             MLA_QK_SPLIT, MLA_STREAM)
from .mla_balanced import (CLAIM_SCATTER, CLAIM_SM, balanced_reject_reason, check_rates,
                           claim_state, launch_balanced_mla, share_weights)
from .mla_functional import mla_paged_attention
from .mla_gluon import (GLUON_MLA_BLOCK_H, gluon_mla_reject_reason, gluon_mla_tensors_reason,
                        launch_gluon_mla)
from .mla_kernel import _LOG2E, _mla_fwd_kernel
from .mla_merge import merge_plan_spec, merge_splits
from .mla_narrow_gluon import (NARROW_MLA_MAX_HEADS, launch_narrow_mla,
                               narrow_mla_reject_reason, narrow_mla_splits, narrow_plan_spec)
from .mla_plan import COOPERATIVE, LAST_SPLIT, TUNING_KEYS, TritonMLAPlan
from .mla_ring_gluon import launch_ring_mla, ring_mla_splits
from .mla_stream_gluon import STREAM_UNIT, launch_stream_mla, stream_mla_reject_reason
from .mla_workspace import MLAWorkspace, _tma_device
from ._pdl import EARLY_KEYS, pdl_kwargs, pdl_mode

# names this module held before the split into mla_plan / mla_workspace / mla_functional,
# importable from here still
import attrs  # noqa: F401
from ...types import FP8_DTYPES  # noqa: F401
from ...validation import INDEX_DTYPES  # noqa: F401
from ..base import MEMO, KernelPlan, _adhoc_metadata, mla_layer_params  # noqa: F401
from .mla_narrow_gluon import narrow_descriptors, narrow_mla_layout_reason  # noqa: F401
from .mla_plan import _T  # noqa: F401
from .mla_workspace import _DESCS_KEEP, _EAGER_COUNTERS, _eager_counters  # noqa: F401
from .prefill import TensorDescriptor, _capability  # noqa: F401

__all__ = ["mla_paged_attention", "mla_launch_config", "TritonMLA", "TritonMLAPlan",
           "mla_request", "TUNING_KEYS"]

log = logging.getLogger(__name__)

#: Launch defaults, from the H200 sweeps of ``benchmarks/bench_attention.py --mla-sweep``
#: (bf16, kv_lora 512 + rope 64, page 64). 16 heads (2026-12-04, CUDA-graph replay): 32-key
#: tiles, 4 warps, 3 stages, two programs per SM: 64x4k 3.73 TB/s and 128x8k 4.31 against
#: 3.50 and 3.92 with (64, 4, 3) at one program per SM. 128 heads (2026-12-02): (64, 32, 8, 2)
#: within 5% of the best of 9 and reads each latent tile once per 64 heads.
_DEFAULTS = {16: (32, 4, 3), 32: (32, 8, 3), 64: (64, 8, 2)}  # block_h -> (block_n, warps, stages)
#: programs of 4-warp tiles that share an SM: the 16-head default holds 180 registers × 128
#: threads, so a third would exceed the SM's 65,536 registers
_MAX_RESIDENT = 2
#: the Triton kernel's launches (direct once compiled: :mod:`._launch`)
_MLA_FWD = Launcher(_mla_fwd_kernel)
#: ``TritonMLAPlan.kw_cache`` entry of the plan's narrow launch and merge specs
_NARROW_SPECS = "narrow-specs"


def _smem_budget(device: torch.device) -> Optional[int]:
    """Shared memory one program may use on ``device`` (bytes, less a margin for Triton's own
    buffers), ``None`` without a GPU."""
    total = max_shared_mem(device)
    return None if total is None else total - 4096


def ring_bytes(block_n: int, stages: int, dim: int, elem_size: int, kv_elem_size: int) -> int:
    """Shared memory of one program's latent ring: ``stages`` tiles ``[block_n, dim]`` of
    ``kv_elem_size`` bytes, and on a narrower cache two converted tiles of ``elem_size``
    bytes, one per dot (K^T for q·K, V for p·V take different shared-memory layouts).
    Measured on the H200 (fp8 cache, 16 heads, block_n 64, 3 stages): Triton asked for
    253,952 B = ring 110,592 + K^T 73,728 + V 65,536 + 4,096; one converted tile was counted
    before, which let 3 stages through and the launch raised OutOfResources."""
    convert = 2 * block_n * dim * elem_size if kv_elem_size < elem_size else 0
    return stages * block_n * dim * kv_elem_size + convert


def programs_per_sm(budget: Optional[int], num_warps: int, ring: int) -> int:
    """How many programs of ``num_warps`` warps with a latent ring of ``ring`` bytes one SM
    holds at once: two where the ring fits twice in ``budget`` (4-warp programs only: their
    registers), else one; one without a GPU (``budget`` None)."""
    if budget is None or num_warps > 4:
        return 1
    return max(1, min(_MAX_RESIDENT, budget // max(ring, 1)))


def mla_launch_config(num_heads: int, num_tokens: int, kv_bound: int, device: torch.device,
                      *, num_kv_splits: Optional[int] = None, block_h: Optional[int] = None,
                      block_n: Optional[int] = None, dim: int = 576, elem_size: int = 2,
                      kv_elem_size: Optional[int] = None):
    """``(block_h, block_n, num_splits, num_warps, num_stages)`` from host integers only.

    ``dim`` (padded latent width), ``elem_size`` (bytes of the compute dtype: the wider of q
    and the cache) and ``kv_elem_size`` (bytes of a cache element; a narrower cache is
    converted through two more tiles, one per dot) bound the pipelined tiles by the device's
    shared memory: the ring ``stages · block_n · dim · kv_elem_size`` (plus the converted
    tiles) must fit
    (the q tile is not counted: the H200 defaults were measured to fit with it);
    ``block_n`` halves (only when not given), then stages drop.
    """
    if block_h is None:
        block_h = 16 if num_heads <= 16 else (32 if num_heads <= 32 else 64)
    kv_elem_size = kv_elem_size or elem_size
    bn_default, num_warps, num_stages = _DEFAULTS.get(block_h, (32, 8, 2))
    budget = _smem_budget(device)

    def need(bn, stages):
        return ring_bytes(bn, stages, dim, elem_size, kv_elem_size)

    if block_n is None:
        block_n = bn_default
        if budget is not None:
            while block_n > 16 and need(block_n, min(num_stages, 2)) > budget:
                block_n //= 2
    if budget is not None:
        while num_stages > 1 and need(block_n, num_stages) > budget:
            num_stages -= 1
        if elem_size >= 4:  # fp32 dots stage extra layout copies in shared memory
            num_stages = min(num_stages, 2)
    head_blocks = triton.cdiv(num_heads, block_h)
    programs = max(1, head_blocks * num_tokens)
    if num_kv_splits is None:
        # split so that the programs fill the SMs once: one program per SM where the latent
        # ring fills shared memory, two where it fits twice (H200, 16 heads 64x4k with
        # 64-key tiles: 2 splits 3.17 TB/s, 4 splits 2.95; with 32-key tiles, two per SM:
        # 4 splits 3.73)
        resident = programs_per_sm(budget, num_warps, need(block_n, num_stages))
        by_len = max(1, triton.cdiv(max(kv_bound, 1), 4 * block_n))
        num_kv_splits = max(1, min(64, resident * num_sms(device) // programs, by_len))
    return block_h, block_n, int(num_kv_splits), num_warps, num_stages


#: the values of the launch-choice options (``tuning`` keys) a truthiness test would
#: otherwise read: ``pdl="off"`` or ``narrow="no"`` would turn the option on without a word
_OPTION_VALUES = {
    "pdl": (False, True, "reduce", EARLY_KEYS),
    "narrow": (False, True),
    "ring": (False, True),
    "fused_merge": (False, True, "cooperative"),
}


def _check_option_values(tuning: dict) -> None:
    """Refuse a value of a launch-choice option it does not take (when the kernel object is
    built: a bad value would otherwise fail only on the steps that read it, or never):
    :data:`_OPTION_VALUES`, and ``balanced`` (``False``, ``True`` or a positive int)."""
    for key, allowed in _OPTION_VALUES.items():
        value = tuning.get(key)
        if value is None:
            continue
        if not (isinstance(value, (bool, str)) and value in allowed):
            raise ValueError(f"TritonMLA: {key}={value!r}; allowed: "
                             f"{', '.join(map(repr, allowed))} (or leave it out for the "
                             "default).")
    _check_balanced(tuning.get("balanced"))
    _check_balanced(tuning.get("stream"), "stream")
    if tuning.get("balanced_rates") is not None:
        check_rates(tuning["balanced_rates"], "TritonMLA: balanced_rates")
        if not (tuning.get("balanced") or tuning.get("stream")):
            raise ValueError("TritonMLA: balanced_rates weighs the balanced launch's or the "
                             "stream kernel's slots; set balanced=True (or a program count) "
                             "or stream=True with it.")


def _check_balanced(option, name: str = "balanced") -> None:
    """Refuse a ``balanced`` / ``stream`` value (option or :data:`MLA_BALANCED`) other than
    ``None``, ``False``, ``True`` or a positive int."""
    if option is not None and not isinstance(option, bool) and not (
            isinstance(option, int) and option >= 1):
        raise ValueError(f"{name}={option!r}; allowed: False, True (as many programs as "
                         "the SMs hold) or a positive int (that many programs).")


class TritonMLA(MLAWorkspace, MLAKernel):
    """``mla_paged_attention`` (Triton) as plan/run, bound once per layer group.

    ``tuning`` (tests, benchmarks; keys in :data:`TUNING_KEYS`, others refused) overrides
    the launch heuristics: ``num_kv_splits``, ``block_h``, ``block_n``, ``num_warps``,
    ``num_stages``, ``page_chunk``, ``split_v_load``, ``v_pairs`` (fp8 value reads as 16-bit
    column pairs), ``pdl``, ``fused_merge`` (the split merge in the attention launch:
    ``True`` or ``"cooperative"``), ``kv_desc`` (latent tiles through tensor descriptors),
    ``lazy_rescale`` (the accumulator rescaled only when a maximum grows by more than 2^8;
    row sums per element), ``half_partials`` (split partials in q's 16-bit dtype),
    ``qk_split`` (2 / 4: q·Kᵀ as two / four independent mma chains over the latent halves
    / quarters), ``ring``
    (``True``: the ring Gluon kernel of :mod:`.mla_ring_gluon` for up to 16 heads),
    ``one_query`` (``False``: decode steps search ``cu_seqlens_q`` for their request like any
    other), ``narrow`` (the narrow Gluon kernel of :mod:`.mla_narrow_gluon` for up to 16
    heads where it serves: the default on sm_90, :data:`MLA_NARROW`; ``False``: the Triton
    kernel; its split merge starts early unless ``pdl=False``), ``stream`` (``True``: the
    persistent stream kernel of :mod:`.mla_stream_gluon` for 16-head decode where it serves,
    one program per SM over shares of the batch's keys, weighed by ``balanced_rates`` when
    given), ``gluon`` (``False``: never the Gluon kernels of :mod:`.mla_gluon`, which
    otherwise serves what :func:`.mla_gluon.gluon_mla_reject_reason` allows: 64-head blocks
    of bf16/fp16 latents 512 + 64 on NVIDIA sm_90). A key given ``None`` takes its default
    (as :func:`mla_paged_attention`'s keywords); ``pdl``, ``narrow``, ``ring``,
    ``fused_merge`` and ``balanced`` values are checked when the object is built.

    The split workspace, merge counters and cache descriptors it keeps across steps come
    from :class:`.mla_workspace.MLAWorkspace`.
    """

    def __init__(self, request=None, tuning: Optional[dict] = None):
        super().__init__(request)
        # a None value is the default, as in mla_paged_attention(...) (read with
        # tuning.get(key, default), None would otherwise turn the narrow kernel, its PDL
        # merge, the Gluon kernels, 16-bit partials and one_query off)
        self.tuning = {k: v for k, v in dict(tuning or {}).items() if v is not None}
        unknown = sorted(set(self.tuning) - TUNING_KEYS)
        if unknown:
            raise ValueError(f"TritonMLA: unknown tuning key(s) {unknown}; allowed: "
                             f"{sorted(TUNING_KEYS)}. Check the spelling.")
        _check_option_values(self.tuning)
        if "balanced_rates" in self.tuning:  # hashable, as every tuning value
            self.tuning["balanced_rates"] = check_rates(self.tuning["balanced_rates"])
        self._descs: dict = {}  # (kernel, cache key) -> its TMA descriptors (or None)
        self._shares: dict = {}  # (device, programs) -> the balanced launch's slot weights
        if request is not None:
            self._bind(request)

    def _bind(self, request):
        self.heads = dict(request.extra).get("heads")
        if self.heads is None:
            raise ValueError(f"{self.name}: the request has no ('heads', H) in extra; build it "
                             "with aiter_attn.kernels.triton.mla.mla_request(...).")
        self.dim = request.head_dim
        self.rank = request.v_head_dim
        self.rope = self.dim - self.rank
        self.dtype, self.kv_dtype = request.dtype, request.kv_dtype
        self.block_dv = max(16, next_pow2(self.rank))
        self.block_dr = max(16, next_pow2(max(self.rope, 1)))
        q_size = self.dtype.itemsize
        self.kv_size = self.kv_dtype.itemsize
        self.elem_size = max(q_size, self.kv_size)
        self.batch_invariant = "batch_invariant" in request.features
        self._ws = (f"triton.mla.partials.{self.heads}h{self.rank}"
                    + (".bi" if self.batch_invariant else ""))

    def __call__(self, q, kv_cache, out, **kwargs):
        if self.request is None:  # the functional convenience: bind to these tensors
            req = mla_request(q, kv_cache, kwargs["kv_lora_rank"],
                              custom_mask=kwargs.get("custom_mask") is not None,
                              lse=kwargs.get("lse") is not None,
                              batch_invariant=bool(kwargs.get("batch_invariant")),
                              causal=kwargs.get("causal", True))
            return type(self)(req, self.tuning)(q, kv_cache, out, **kwargs)
        return super().__call__(q, kv_cache, out, **kwargs)

    # -- launch configuration ------------------------------------------------------------
    def _config(self, num_tokens, kv_bound, device):
        t = self.tuning
        bh, bn, splits, warps, stages = mla_launch_config(
            self.heads, num_tokens, kv_bound, device, num_kv_splits=t.get("num_kv_splits"),
            block_h=t.get("block_h"), block_n=t.get("block_n"),
            dim=self.block_dv + self.block_dr, elem_size=self.elem_size,
            kv_elem_size=self.kv_size)
        fixed_chunk = 0
        if self.batch_invariant:
            fixed_chunk = -(-BATCH_INVARIANT_SPLIT_TOKENS // bn) * bn
            # a power of two: fewer distinct NUM_SPLITS compilations (extra splits are empty)
            splits = next_pow2(max(1, -(-max(kv_bound, 1) // fixed_chunk)))
        return bh, bn, splits, warps, stages, fixed_chunk

    def _narrow_splits(self, num_tokens, kv_bound, device, page_size, mask) -> Optional[int]:
        """The narrow Gluon kernel's split count (``None``: it does not serve the step:
        not asked for (``tuning["narrow"]``, default :data:`MLA_NARROW` unless the
        ``balanced`` option asks for the balanced launch), more than 16 heads, a custom
        mask, not sm_90 / bf16 / fp16 / 512 + 64, or ``tuning["gluon"] is False``;
        ``page_size=None`` skips the page check)."""
        ring = self.tuning.get("ring", False)
        wanted = self.tuning.get("narrow", MLA_NARROW
                                 and not self.tuning.get("balanced", MLA_BALANCED))
        if (not (wanted or ring) or not self.tuning.get("gluon", True)
                or self.heads > NARROW_MLA_MAX_HEADS):
            return None
        why = narrow_mla_reject_reason(
            heads=self.heads, rank=self.rank, rope=self.rope, dtype=self.dtype,
            kv_dtype=self.kv_dtype, page_size=64 if page_size is None else page_size,
            device=torch.device(device), masked=mask is not None,
            batch_invariant=self.batch_invariant)
        if why is not None:
            return None
        forced = self.tuning.get("num_kv_splits")
        if forced:
            return int(forced)
        split_rule = ring_mla_splits if ring else narrow_mla_splits
        return split_rule(num_tokens, max(kv_bound, 1), num_sms(torch.device(device)))

    def _balanced_programs(self, device) -> Optional[int]:
        """Programs of the balanced launch (``tuning["balanced"]``): ``True``, as many as
        the SMs hold at once (two 16-head programs per SM where the latent ring fits twice,
        as the split launch counts); a positive int, that many; ``False`` / absent:
        ``None`` (the split launch)."""
        option = self.tuning.get("balanced", MLA_BALANCED)
        _check_balanced(option)  # the module default is read here, not at __init__
        if not option:
            return None
        if option is True:
            _, bn, _, warps, stages, _ = self._config(1, 1, device)
            # the launch's own warps and stages (the tuning's overrides, as plan() takes them)
            warps = self.tuning.get("num_warps") or warps
            stages = self.tuning.get("num_stages") or stages
            ring = ring_bytes(bn, stages, self.block_dv + self.block_dr, self.elem_size,
                              self.kv_size)
            return (programs_per_sm(_smem_budget(device), warps, ring)
                    * num_sms(torch.device(device)))
        return option

    def _balanced_shares(self, programs: int, device) -> dict:
        """The balanced launch's slot weights and claim state where ``balanced_rates``
        weighs its slots (one rate per SM of ``device``), else nothing. Made once per
        (device, programs) and kept: the claim state's tickets run on across launches
        (:func:`.mla_balanced.claim_state`); on CUDA the programs claim their SM's slot,
        elsewhere (the interpreter) a scatter of their id."""
        if self.tuning.get("balanced_rates") is None:
            return {}
        key = (str(device), programs)
        got = self._shares.get(key)
        if got is None:
            sms = num_sms(torch.device(device))
            rates = self._rates_per_sm(sms, device)
            on_gpu = torch.device(device).type == "cuda"
            got = self._shares[key] = dict(
                shares=share_weights(rates, programs, device), claim=claim_state(programs,
                                                                                 device),
                claim_hint=CLAIM_SM if on_gpu else CLAIM_SCATTER, per_sm=programs // sms)
        return got

    def _rates_per_sm(self, sms: int, device) -> Optional[tuple]:
        """``tuning["balanced_rates"]`` (``None`` without), refused unless it has one rate
        for each of ``device``'s ``sms`` SMs."""
        rates = self.tuning.get("balanced_rates")
        if rates is not None and len(rates) != sms:
            raise ValueError(f"{self.name}: balanced_rates has {len(rates)} rates but "
                             f"{device} has {sms} SMs; measure one rate per SM on it.")
        return rates

    def _stream_wanted(self) -> bool:
        """``tuning["stream"]`` (default :data:`MLA_STREAM`) and the Gluon kernels allowed."""
        return bool(self.tuning.get("stream", MLA_STREAM) and self.tuning.get("gluon", True))

    def _stream_programs(self, batch, one_query, page_size, mask, device) -> Optional[int]:
        """Programs of the stream kernel (one per SM) where it is asked for and serves the
        step (:func:`.mla_stream_gluon.stream_mla_reject_reason`), else ``None``."""
        if not self._stream_wanted():
            return None
        dev = torch.device(device)
        why = stream_mla_reject_reason(
            heads=self.heads, rank=self.rank, rope=self.rope, dtype=self.dtype,
            kv_dtype=self.kv_dtype, page_size=page_size, device=dev, masked=mask is not None,
            batch_invariant=self.batch_invariant, one_query=one_query, batch=batch)
        if why is not None:
            return None
        option = self.tuning.get("stream", MLA_STREAM)
        return num_sms(dev) if option is True else int(option)

    def _stream_shares(self, programs: int, device) -> dict:
        """The stream kernel's cumulative slot weights (equal, or ``balanced_rates``: one
        rate per SM, then one program per SM) and, with rates, its claim state; made once
        per (device, programs)."""
        key = ("stream", str(device), programs)
        got = self._shares.get(key)
        if got is None:
            rates = self._rates_per_sm(programs, device)
            got = self._shares[key] = dict(
                shares=share_weights(rates or (1.0,) * programs, programs, device),
                claim=claim_state(programs, device) if rates is not None else None)
        return got

    # -- plan / run ----------------------------------------------------------------------
    def plan(self, md, out: Optional[dict] = None) -> TritonMLAPlan:
        """The launch of one step (host integers only: no sync)."""
        query, pages = md.query, md.pages
        cu, seqused_k, block_table = map(
            unit_stride, (query.cu_seqlens_q, pages.seqused_k, pages.block_table))
        num_tokens, batch = query.num_tokens, seqused_k.shape[0]
        page_size = pages.page_size
        hint_q, hint_k = plan_hints(md)
        kv_bound = int(hint_k) if hint_k is not None else block_table.shape[1] * page_size
        device = cu.device
        bh, bn, splits, warps, stages, fixed_chunk = self._config(max(num_tokens, 1), kv_bound,
                                                                  device)
        # decode: as many tokens as requests, none with more than one (host integers; the
        # metadata's contract cu_seqlens_q[-1] == num_tokens makes it one query each)
        t = self.tuning
        one_query = bool(num_tokens == batch and hint_q is not None and int(hint_q) <= 1
                         and t.get("one_query", True))
        page_chunk = t.get("page_chunk")
        if page_chunk is None:
            page_chunk = 0 if bh <= 16 else 16
        warps = t.get("num_warps") or warps
        stages = 1 if interpreting() else (t.get("num_stages") or stages)
        head_blocks = triton.cdiv(self.heads, bh)
        use_parts = splits > 1 or self.batch_invariant
        empty = num_tokens == 0 or batch == 0
        part_o = part_lse = None
        # 16-bit partials: the Triton kernel's 16-head blocks, the narrow kernel and the
        # balanced launch (the Gluon kernel of 64-head blocks writes float32), never
        # batch-invariant (its fixed-order merge stays float32)
        half_ok = bool(t.get("half_partials", MLA_HALF_PARTIALS)
                       and self.dtype in (torch.float16, torch.bfloat16)
                       and not self.batch_invariant)
        half = half_ok and bh <= 16
        mask = md.mask
        stream_p = (self._stream_programs(batch, one_query, page_size, mask, device)
                    if not empty else None)
        # the stream kernel replaces the narrow kernel where both would serve
        nsplits = (self._narrow_splits(num_tokens, kv_bound, device, page_size, mask)
                   if stream_p is None else None)
        balanced = None
        programs = self._balanced_programs(device)
        if programs is not None and not empty and nsplits is None and balanced_reject_reason(
                heads=self.heads, q_dtype=self.dtype, kv_dtype=self.kv_dtype,
                one_query=one_query, masked=mask is not None,
                batch_invariant=self.batch_invariant, batch=batch) is None:
            balanced = (programs, *self._partials(
                2, programs, md, out, device, self.dtype if half_ok else torch.float32))
            use_parts = False  # the balanced launch replaces the split launch and its merge
        if use_parts and not empty:
            part_o, part_lse = self._partials(splits, num_tokens, md, out, device,
                                              self.dtype if half else torch.float32)
        mask_t = None
        if mask is not None:
            m = unit_stride(mask.custom_mask)
            mask_t = (m.view(torch.uint8) if m.dtype == torch.bool else m,
                      unit_stride(mask.mask_indptr))
        split_v = t.get("split_v_load")
        # the one-launch merge: 16-head blocks (memory-bound: a second launch and its gap
        # are a few percent of the step), split counts its unrolled merge holds
        fused = self._fused_mode(t.get("fused_merge", MLA_FUSED_MERGE), bh, splits, warps,
                                 num_tokens * head_blocks * splits,
                                 ring_bytes(bn, stages, self.block_dv + self.block_dr,
                                            self.dtype.itemsize, self.kv_size), device) if (
            use_parts and not self.batch_invariant and not empty) else 0
        counters = self._counters(num_tokens * head_blocks, md, out, device) if fused else None
        even_d = self.block_dv == self.rank and self.block_dr == self.rope
        qk_split = self._qk_split(t.get("qk_split", MLA_QK_SPLIT), even_d, bh)
        kv_desc = bool(t.get("kv_desc", MLA_KV_DESCRIPTORS) and even_d and page_size % bn == 0
                       and self.kv_dtype == self.dtype and self.dtype != torch.float32
                       and fixed_chunk == 0 and mask is None and not split_v
                       and _tma_device(device))
        cfg_kw = dict(
            PAGE_SIZE=page_size, KV_LORA=self.rank, ROPE=self.rope,
            BLOCK_DV=self.block_dv, BLOCK_DR=self.block_dr, BLOCK_H=bh, BLOCK_N=bn,
            BLOCK_B=next_pow2(max(batch, 1)), NUM_SPLITS=splits, HAS_MASK=mask is not None,
            IEEE=self.dtype == torch.float32, TILE_IN_PAGE=page_size % bn == 0,
            EVEN_D=even_d,
            PAGE_CHUNK=next_pow2(page_chunk) if page_chunk > 0 and not kv_desc and (
                page_size % bn == 0 or bn % page_size == 0) else 0,
            FP16_DOTS=is_fp8(self.kv_dtype) and self.dtype == torch.bfloat16,
            # fp8 latents' values as 16-bit column pairs (the default; run() checks the cache
            # layout): head blocks under 64 rows, whose dots are mma.sync
            V_PAIRS=bool(is_fp8(self.kv_dtype) and self.block_dv == self.rank and bh < 64
                         and t.get("v_pairs", MLA_FP8_VALUE_PAIRS)),
            SPLIT_V_LOAD=self.kv_dtype != self.dtype if split_v is None else bool(split_v),
            FIXED_CHUNK=fixed_chunk, FUSED_MERGE=fused, ONE_QUERY=one_query,
            MERGE_SLICE=max(16, next_pow2(-(-self.block_dv // splits))), KV_DESC=kv_desc,
            QK_SPLIT=qk_split,
            LAZY_RESCALE=bool(t.get("lazy_rescale", MLA_LAZY_RESCALE)),
            num_warps=warps, num_stages=stages,
            **(dict(launch_cooperative_grid=True) if fused == COOPERATIVE else {}),
            **pdl_kwargs(pdl_mode(t.get("pdl"), device), reduction=False))
        gluon = bh == GLUON_MLA_BLOCK_H and t.get("gluon", True) and gluon_mla_reject_reason(
            heads=self.heads, rank=self.rank, rope=self.rope, dtype=self.dtype,
            kv_dtype=self.kv_dtype, page_size=page_size, device=device,
            masked=mask is not None, batch_invariant=self.batch_invariant) is None
        narrow = None
        if nsplits is not None and not empty:
            nparts = (self._partials(nsplits, num_tokens, md, out, device,
                                     self.dtype if half_ok else torch.float32)
                      if nsplits > 1 else (None, None))
            ring = bool(t.get("ring", False))
            # the narrow kernel's own split merge (fused_merge): counters, one per token
            ncount = (self._counters(num_tokens, md, out, device)
                      if nsplits > 1 and not ring and t.get("fused_merge", MLA_FUSED_MERGE)
                      else None)
            pdl = pdl_mode(t.get("pdl", MLA_NARROW_PDL), device) if not ring else False
            if nsplits == 1 and pdl != EARLY_KEYS:
                pdl = False  # no merge launch to start early (``"early"`` is the kernel's)
            if ncount is not None and pdl == "reduce":
                # merging its own splits there is no merge launch to start early; only
                # ``pdl=True`` (the kernel itself starts early, waiting on the device for
                # the kernel before) is left
                pdl = False
            merge_pdl = pdl_kwargs(pdl, reduction=True) if pdl else {}
            if pdl == EARLY_KEYS:  # the next step's launch may start during this merge
                merge_pdl["RELEASE_FIRST"] = True
            narrow = (nsplits, *nparts, ring, ncount, one_query, pdl, merge_pdl)
        stream = None
        if stream_p is not None:  # both launches' keywords, once per step
            s_o, s_l = self._partials(2, stream_p, md, out, device,
                                      self.dtype if half_ok else torch.float32)
            s_o, s_l = s_o.permute(0, 2, 1, 3), s_l.permute(0, 2, 1)
            sh = self._stream_shares(stream_p, device)
            pdl = pdl_mode(t.get("pdl", MLA_NARROW_PDL), device)
            stream = (dict(part_o=s_o, part_lse=s_l, shares=sh["shares"], claim=sh["claim"],
                           pdl=pdl),
                      dict(part_o=s_o, part_lse=s_l, programs=stream_p, block_n=STREAM_UNIT,
                           launches=("merge",), pdl=pdl, shares=sh["shares"]))
        if balanced is not None:  # the launch's keywords, once per step (run only launches)
            balanced = (*balanced, dict(
                part_o=balanced[1].permute(0, 2, 1, 3), part_lse=balanced[2].permute(0, 2, 1),
                programs=balanced[0], block_n=bn, num_warps=warps, num_stages=stages,
                ieee=self.dtype == torch.float32, pdl=pdl_mode(t.get("pdl"), device),
                **self._balanced_shares(balanced[0], device)))
        return TritonMLAPlan(
            num_tokens=0 if empty else num_tokens, mask_literal=mask_literal(md), narrow=narrow,
            grid=(num_tokens * head_blocks, splits), args=(cu, seqused_k, block_table),
            mask=mask_t, batch=batch, head_blocks=head_blocks, splits=splits,
            use_parts=use_parts, part_o=part_o, part_lse=part_lse, cfg_kw=cfg_kw,
            gluon=gluon, counters=counters, balanced=balanced, stream=stream)

    def _qk_split(self, option, even_d: bool, block_h: int) -> int:
        """``QK_SPLIT`` of the Triton kernel: 2 or 4 (q·Kᵀ as that many independent mma
        chains over the latent halves / quarters, p·V into as many part accumulators) where
        the ``qk_split`` option asks and the latents allow: a cache of q's dtype (fp8 caches
        keep their value-pair reads), power-of-two widths (``even_d``), parts of at least 16
        columns (an mma's k: a rank of at least 32 / 64), head blocks under 64 (``block_h``:
        64-row blocks are wgmma on sm_90, no chain of dependent mma.sync to shorten, and the
        parts only add spills: 40 → 88 bytes with quarters); else 1."""
        if option is None or option is False:
            return 1
        if isinstance(option, bool) or option not in (1, 2, 4):  # True: which count?
            raise ValueError(f"qk_split={option!r}; allowed: 1 (one chain), 2 (two halves) "
                             "or 4 (four quarters).")
        ok = (even_d and self.kv_dtype == self.dtype and self.rank >= 16 * option
              and block_h < 64)
        return int(option) if ok else 1

    @staticmethod
    def _fused_mode(option, block_h, splits, warps, programs, ring_bytes, device) -> int:
        """``FUSED_MERGE`` of a split launch: 0 (a merge launch), :data:`LAST_SPLIT` or
        :data:`COOPERATIVE` from the ``fused_merge`` option (``False`` / ``True`` /
        ``"cooperative"``), where it serves: head blocks of up to 16 (the memory-bound
        kernel), up to 16 splits; the cooperative form only compiled on a GPU (the
        interpreter runs programs one after another: the waits would never end) and with
        every program resident at once: ``programs`` within the SMs' count times the
        programs of ``warps`` warps whose latent ring (``ring_bytes``) fits one SM's shared
        memory (at most two: the 4-warp default's registers)."""
        if not option or block_h > 16 or splits > 16:
            return 0
        if option == "cooperative":
            budget = _smem_budget(device)
            if interpreting() or budget is None or warps > 4:
                return 0
            resident = min(_MAX_RESIDENT, budget // max(ring_bytes, 1))
            return COOPERATIVE if programs <= resident * num_sms(device) else 0
        if option is True:
            return LAST_SPLIT
        raise ValueError(f"fused_merge={option!r}; allowed: False, True (the last split "
                         "merges) or 'cooperative' (every split merges a slice).")

    def _narrow_specs(self, plan: TritonMLAPlan) -> tuple:
        """``(narrow, merge)``: the interned specs of the plan's narrow launch and of its
        split merge (``None`` without one), once per plan: each call's launch key is then
        the spec's id and the call's own few values (:func:`.mla_narrow_gluon
        .narrow_plan_spec`, :func:`.mla_merge.merge_plan_spec`)."""
        nsplits, n_o, n_l, _, ncount, one_q, pdl, merge_kw = plan.narrow
        cu, seqused_k, block_table = plan.args
        narrow = narrow_plan_spec(splits=nsplits, batch=plan.batch, cu_q=cu,
                                  seqused_k=seqused_k, block_table=block_table, part_o=n_o,
                                  part_lse=n_l, counters=ncount, one_query=one_q, pdl=pdl)
        merge = (merge_plan_spec(n_o, n_l, self.rank, self.block_dv, **merge_kw)
                 if nsplits > 1 and ncount is None else None)
        return narrow, merge

    @staticmethod
    def _kw(plan: TritonMLAPlan, key):
        causal, from_ptr, write_lse, pairs, descs = key
        kw = dict(plan.cfg_kw)
        kw.update(CAUSAL=causal and not plan.mask_literal, SCALE_FROM_PTR=from_ptr,
                  WRITE_LSE=write_lse, V_PAIRS=kw["V_PAIRS"] and pairs, KV_DESC=descs)
        plan.kw_cache[key] = kw
        return kw

    def run(self, q, cache, plan: TritonMLAPlan, params, out, lse=None):
        """Launch (and the split merge). O(1) checks; allocates nothing."""
        if q.shape[0] != plan.num_tokens:
            if plan.num_tokens == 0:
                return out
            raise token_count_error(self.name, q.shape[0], plan)
        if plan.num_tokens == 0:
            return out
        kv_cache = cache[0]
        if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or out.stride(-1) != 1:
            raise ValueError(f"{self.name}: q, kv_cache and out must be contiguous in their "
                             "last dim; pass .contiguous() tensors.")
        from_ptr = params.has_scales  # fp8 cache: the scale is read on the device
        write_lse = lse is not None
        # value pairs need every latent row on a 16-byte boundary (strides and base)
        pairs = plan.cfg_kw["V_PAIRS"] and not (
            (kv_cache.stride(0) | kv_cache.stride(1) | kv_cache.data_ptr()) % 16)
        kdescs = self.tile_descs(kv_cache, plan)
        key = (params.causal, from_ptr, write_lse, pairs, kdescs is not None)
        kw = plan.kw_cache.get(key)
        if kw is None:
            kw = self._kw(plan, key)
        cu, seqused_k, block_table = plan.args
        mask_arg, mask_ind = plan.mask if plan.mask is not None else (cu, cu)
        scale_t = params.k_scale_t if from_ptr else cu
        part_o = plan.part_o if plan.use_parts else out
        part_lse = plan.part_lse if plan.use_parts else out
        ps_o = part_o.stride() if plan.use_parts else (0, 0, 0)
        ps_l = part_lse.stride() if plan.use_parts else (0, 0)
        lse_t = lse if write_lse else part_lse
        ls = (lse.stride(0), lse.stride(1)) if write_lse else (0, 0)
        if plan.stream is not None and out.stride(2) == 1:
            sdescs = self._stream_descs(kv_cache)
            qdescs = self._stream_q_descs(q) if sdescs is not None else None
            if qdescs is not None:  # else the split path (its partials are planned too)
                launch_kw, merge_kw = plan.stream
                launch_stream_mla(q, kv_cache, out, seqused_k, block_table, params.scale,
                                  lse=lse, descs=sdescs, q_descs=qdescs, **launch_kw)
                launch_balanced_mla(q, kv_cache, out, seqused_k, block_table, rank=self.rank,
                                    qk_scale_log2=params.scale * _LOG2E, lse=lse, **merge_kw)
                return out
        descs = (self._cache_descs(kv_cache) if plan.narrow is not None and not from_ptr
                 else None)
        if descs is not None and q.stride(2) == 1 and out.stride(2) == 1:
            nsplits, n_o, n_l, ring, ncount, one_q, pdl, merge_kw = plan.narrow
            if ring:
                launch_ring_mla(q, kv_cache, out, cu, seqused_k, block_table, params.scale,
                                splits=nsplits, batch=plan.batch, causal=kw["CAUSAL"],
                                lse=lse if nsplits == 1 else None, part_o=n_o, part_lse=n_l)
                if nsplits > 1:
                    merge_splits(out, n_o, n_l, lse, self.rank, self.block_dv, **merge_kw)
                return out
            specs = plan.kw_cache.get(_NARROW_SPECS)
            if specs is None:
                specs = plan.kw_cache[_NARROW_SPECS] = self._narrow_specs(plan)
            launch_narrow_mla(q, kv_cache, out, cu, seqused_k, block_table, params.scale,
                              splits=nsplits, batch=plan.batch, causal=kw["CAUSAL"],
                              lse=lse if nsplits == 1 or ncount is not None else None,
                              part_o=n_o, part_lse=n_l, counters=ncount,
                              one_query=one_q, descs=descs, pdl=pdl, planned=specs[0])
            if nsplits > 1 and ncount is None:
                merge_splits(out, n_o, n_l, lse, self.rank, self.block_dv,
                             planned=specs[1], **merge_kw)
            return out
        if plan.balanced is not None:
            launch_balanced_mla(q, kv_cache, out, seqused_k, block_table, rank=self.rank,
                                qk_scale_log2=params.scale * _LOG2E,
                                scale_ptr=params.k_scale_t if from_ptr else None, lse=lse,
                                **plan.balanced[3])
            return out
        merged = False  # by the launch itself (the fused merge)
        if plan.gluon and gluon_mla_tensors_reason(q, kv_cache, out) is None:
            launch_gluon_mla(q, kv_cache, out, cu, seqused_k, block_table, params.scale,
                             splits=plan.splits, batch=plan.batch,
                             causal=kw["CAUSAL"], lse=lse if not plan.use_parts else None,
                             part_o=plan.part_o if plan.use_parts else None,
                             part_lse=plan.part_lse if plan.use_parts else None)
        else:
            self._launch_triton(q, kv_cache, out, plan, params, kw, lse_t, ls, scale_t,
                                mask_arg, mask_ind, part_o, part_lse, ps_o, ps_l,
                                kdescs or (kv_cache, kv_cache))
            merged = kw["FUSED_MERGE"]
        if plan.use_parts and not merged:
            merge_splits(out, part_o, part_lse, lse, self.rank, self.block_dv,
                         fixed_order=self.batch_invariant,
                         **pdl_kwargs(plan.cfg_kw["PDL"], reduction=True))
        return out

    def _launch_triton(self, q, kv_cache, out, plan, params, kw, lse_t, ls, scale_t,
                       mask_arg, mask_ind, part_o, part_lse, ps_o, ps_l, descs):
        cu, seqused_k, block_table = plan.args
        qs, os_ = q.stride(), out.stride()
        args = (q, kv_cache, descs[0], descs[1], out, part_o, part_lse, lse_t,
                cu, seqused_k, block_table, mask_arg, mask_ind, scale_t,
                plan.counters if plan.counters is not None else cu, params.scale * _LOG2E,
                1.0, self.heads, plan.batch, plan.head_blocks,
                qs[0], qs[1], kv_cache.stride(0), kv_cache.stride(1), os_[0], os_[1],
                block_table.stride(0), ps_o[0], ps_o[1], ps_o[2], ps_l[0], ps_l[1], *ls)
        _MLA_FWD.launch(plan.grid, args, kw, launch_key(args, kw))
