"""Argument marshalling for AMD's ``aiter`` kernels: plain Python and torch, tested on the CPU.

Everything that turns our op arguments (:mod:`aiter_attn.ops`) into the arguments of an
``aiter`` function lives here, so it can be checked without a ROCm device:

- dtype names (``paged_attention_ragged`` takes ``kv_cache_dtype`` as a string);
- MLA head padding (the ``mla_decode_fwd`` kernels take 16·k heads: 4 or 8 heads are
  repeat-interleaved to 16 and the padded outputs dropped);
- page table → token-level ``kv_indptr``/``kv_indices`` (the ragged and MLA kernels address
  the cache as pages of one token) and ``kv_last_page_lens``, built on the device with static
  sizes (no host sync);
- sizes of the persistent-MLA work metadata (``get_mla_metadata_info_v1``) as buffer specs a
  CUDA-graph manager can allocate once;
- call builders: each returns an :class:`AiterCall` (function name, positional and keyword
  arguments) that :mod:`aiter_attn.kernels.aiter` hands to the real function. Arguments are
  passed by keyword so a renamed or reordered parameter fails loudly (the contract test binds
  every call against the signatures read from the ``amd-aiter`` wheel). Parameters that only
  newer ``aiter`` releases take are added only when ``params`` (the names the installed
  function accepts) lists them.

Facts about ``aiter`` come from the ``amd-aiter`` 0.1.7 wheel's source and SGLang's AITER
backend; the kernels themselves run only on ROCm.
"""

from __future__ import annotations

import math
from typing import Optional

import attrs
import torch

__all__ = [
    "AiterCall",
    "WorkBuffer",
    "MLADecodePlan",
    "PARTITION_SIZE",
    "kv_cache_dtype_name",
    "NATIVE_FP8",
    "fp8_format_reason",
    "mla_head_padding",
    "mla_decode_plan",
    "mla_decode_reason",
    "MLA_DECODE_A16W8_HEADS",
    "MLA_PREFILL_HEADS",
    "MLA_PREFILL_DTYPES",
    "mla_prefill_reason",
    "pad_heads",
    "unpad_heads",
    "kv_last_page_lens",
    "token_kv_indices",
    "max_num_partitions",
    "ragged_workspace_bytes",
    "mla_work_buffer_spec",
    "allocate_buffers",
    "vec5d_x",
    "RAGGED_MAX_GQA",
    "RAGGED_HEAD_SIZES",
    "ragged_decode_reason",
    "unified_page_size_reason",
    "route_paged_attention",
    "build_paged_attention_ragged_call",
    "build_mha_batch_prefill_call",
    "build_flash_attn_varlen_call",
    "build_unified_attention_call",
    "build_mla_metadata_info_call",
    "build_mla_metadata_call",
    "build_mla_decode_call",
    "build_mla_prefill_call",
    "build_pa_decode_gluon_call",
]

#: KV positions per partition of aiter's split-K decode kernels (``partition_size``).
PARTITION_SIZE = 256

_FP8_E4M3 = tuple(
    d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e4m3fnuz", None))
    if d is not None
)
_FP8_E5M2 = tuple(
    d for d in (getattr(torch, "float8_e5m2", None), getattr(torch, "float8_e5m2fnuz", None))
    if d is not None
)


@attrs.frozen
class AiterCall:
    """One call of an ``aiter`` function: ``fn`` is its name (see ``AITER_FUNCTIONS``)."""

    fn: str
    args: tuple = ()
    kwargs: dict = attrs.field(factory=dict)


@attrs.frozen
class WorkBuffer:
    """One static buffer to allocate once: ``torch.empty(shape, dtype=dtype, device=...)``.
    (:func:`aiter_attn.kernels.aiter.mla_buffer_spec` turns a set of them into the graph
    manager's :class:`~aiter_attn.strategies.base.BufferSpec`.)"""

    name: str
    shape: tuple
    dtype: torch.dtype


def _has(params: Optional[frozenset], name: str) -> bool:
    return params is not None and name in params


# --------------------------------------------------------------------------------------------
# dtypes, heads, page tables


def kv_cache_dtype_name(kv_dtype: torch.dtype) -> str:
    """The ``kv_cache_dtype`` string ``paged_attention_ragged`` takes for a cache dtype.

    fp16/bf16 → ``"auto"`` (no dequantisation); e4m3 fp8 (``float8_e4m3fn`` /
    ``float8_e4m3fnuz``) → ``"fp8_e4m3"`` (dequantised in the kernel with ``k_scale`` /
    ``v_scale``). aiter has no e5m2 string, so e5m2 raises.
    """
    if kv_dtype in (torch.float16, torch.bfloat16):
        return "auto"
    if kv_dtype in _FP8_E4M3:
        return "fp8_e4m3"
    allowed = "float16, bfloat16, float8_e4m3fn, float8_e4m3fnuz"
    hint = " aiter's paged_attention_ragged has no e5m2 mode;" if kv_dtype in _FP8_E5M2 else ""
    raise ValueError(
        f"kv cache dtype {kv_dtype} is not supported by aiter's paged attention;{hint} "
        f"allowed: {allowed}. Store the cache in one of those."
    )


#: the e4m3 format aiter's kernels decode on each GPU architecture: the device's native one,
#: which its conversion instructions read (``__builtin_amdgcn_cvt_pk_f32_fp8``); the wheel's
#: ``aiter/utility/dtypes.py`` (``defaultDtypes``, looked up with ``get_gfx()``). aiter has no
#: fp8 format for other architectures.
NATIVE_FP8 = {
    "gfx942": getattr(torch, "float8_e4m3fnuz", None),  # MI300
    "gfx950": getattr(torch, "float8_e4m3fn", None),  # MI350
}


def fp8_format_reason(kv_dtype: torch.dtype, native: Optional[torch.dtype],
                      device: str) -> Optional[str]:
    """Why aiter's kernels cannot read a ``kv_dtype`` cache on a device whose native e4m3
    format is ``native`` (``None``: unknown, with ``device`` saying why), or ``None`` if they
    can. 16-bit caches always can; an fp8 cache only in the native format (the other e4m3
    has another exponent bias and NaN encoding: its bytes would be misread)."""
    if kv_dtype not in _FP8_E4M3 and kv_dtype not in _FP8_E5M2:
        return None
    if native is None:
        return (f"kv cache dtype {kv_dtype}: aiter's kernels read fp8 in the device's native "
                f"fp8 format only, and {device}; use a 16-bit cache or another backend")
    if kv_dtype != native:
        return (f"kv cache dtype {kv_dtype}: aiter's kernels on this {device} device read "
                f"fp8 as {native}, its native fp8 format (a {kv_dtype} cache would be "
                f"misread); store the cache as {native} or use another backend")
    return None


def mla_head_padding(num_heads: int) -> tuple[int, int]:
    """``(padded_heads, repeat)`` for aiter's MLA decode: 4 and 8 heads are padded to 16 by
    repeating each head ``16 // num_heads`` times; multiples of 16 up to 128 pass unchanged."""
    if num_heads in (4, 8):
        return 16, 16 // num_heads
    if num_heads % 16 == 0 and 16 <= num_heads <= 128:
        return num_heads, 1
    raise ValueError(
        f"num_heads={num_heads} is not supported by aiter's MLA decode; allowed: 4, 8 or a "
        "multiple of 16 in [16, 128]. Change the tensor-parallel size so each rank holds such "
        "a head count."
    )


def pad_heads(q: torch.Tensor, repeat: int) -> torch.Tensor:
    """``[T, H, D] → [T, H·repeat, D]``: head ``h`` becomes heads
    ``h·repeat … h·repeat + repeat - 1``."""
    return q if repeat == 1 else q.repeat_interleave(repeat, dim=1)


def unpad_heads(o: torch.Tensor, repeat: int) -> torch.Tensor:
    """Inverse of :func:`pad_heads` on outputs: keep the first copy of every head."""
    return o if repeat == 1 else o[:, ::repeat]


@attrs.frozen
class MLADecodePlan:
    """How one MLA layer calls ``mla_decode_fwd`` (chosen once per layer spec and config).

    Attributes:
        num_heads / padded_heads / repeat: see :func:`mla_head_padding`.
        persistent: use the persistent kernel with ``get_mla_metadata_v1`` work metadata.
        fast_mode, intra_batch_mode: metadata options (``intra_batch_mode`` only reaches
            aiter releases that take it).
        max_split_per_batch: KV splits per request for the persistent kernel (or ``None``).
    """

    num_heads: int
    padded_heads: int
    repeat: int
    persistent: bool
    fast_mode: bool
    intra_batch_mode: bool
    max_split_per_batch: Optional[int]


def mla_decode_plan(num_heads: int, kv_dtype: torch.dtype, max_seqlen_q: int = 1) -> MLADecodePlan:
    """Pick the MLA decode mode the way SGLang's AITER backend does.

    The persistent kernel serves 16 heads, 128 heads with an fp8 cache, and 32…128 heads (a
    multiple of 16) for single-token decode; SGLang keeps the non-persistent kernel for 16
    and 128 heads with a 16-bit cache (faster there). ``fast_mode`` is on for 32/64/128 heads.
    """
    padded, repeat = mla_head_padding(num_heads)
    fp8 = kv_dtype in _FP8_E4M3 or kv_dtype in _FP8_E5M2
    natively = padded == 16 or (padded == 128 and fp8)
    simulated = padded % 16 == 0 and 32 <= padded <= 128 and max_seqlen_q == 1
    persistent = (natively or simulated) and not (padded in (16, 128) and not fp8)
    fast = padded in (32, 64, 128)
    split = (64 if max_seqlen_q == 1 else 32) if persistent else None
    return MLADecodePlan(num_heads, padded, repeat, persistent, fast, not fast and persistent,
                         split)


#: query heads per latent KV head of ``mla_decode_fwd``'s kernels for 16-bit queries over an
#: fp8 cache: the wheel's ``asm_mla.cu`` (``mla_decode_stage1_asm_fwd``, bf16-query /
#: fp8-cache branch) has only ``mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps``, persistent. The
#: 128-head fp8 kernels (``mla_a8w8_qh128_*``) take fp8 queries, which the plugin does not
#: pass; for any other combination ``impl_ptr`` stays null and ``TORCH_CHECK`` fails.
MLA_DECODE_A16W8_HEADS = frozenset({16})


def mla_decode_reason(plan: MLADecodePlan, kv_dtype: torch.dtype, max_seqlen_q: int, *,
                      q_dtype: torch.dtype) -> Optional[str]:
    """Why ``mla_decode_fwd`` cannot serve a step of ``max_seqlen_q`` query tokens per
    request with ``plan`` and ``q_dtype`` queries, or ``None`` if it can (``amd-aiter``
    0.1.7's ``aiter/mla.py`` and ``asm_mla.cu``).

    Non-persistent, ``get_meta_param`` asserts the head count is 16 or 128; persistent, the
    kernel takes 16 heads, 128 heads on an fp8 cache, or 32…512 heads (a multiple of 16)
    simulated as 16 for single-token decode only; the decode kernels take ≤ 4 query tokens.
    16-bit queries over an fp8 cache reach a kernel only with
    :data:`MLA_DECODE_A16W8_HEADS` heads (after the simulation), persistent.
    """
    h = plan.padded_heads
    if not 1 <= max_seqlen_q <= 4:
        return (f"max_seqlen_q={max_seqlen_q}: mla_decode_fwd serves 1..4 query tokens per "
                "request")
    fp8 = kv_dtype in _FP8_E4M3 or kv_dtype in _FP8_E5M2
    if plan.persistent:
        native = h == 16 or (h == 128 and fp8)
        if not native and not (h % 16 == 0 and 32 <= h <= 512 and max_seqlen_q == 1):
            return (f"{h} heads with {max_seqlen_q} query tokens per request: the persistent "
                    "mla_decode_fwd serves 16 heads, 128 on an fp8 cache, or 32..512 for "
                    "single-token decode")
        launched = h if native else 16  # mla.py runs 32..512 heads as 16
    elif h in (16, 128):
        launched = h
    else:
        return (f"{h} heads with {max_seqlen_q} query tokens per request: the non-persistent "
                "mla_decode_fwd serves 16 or 128 heads")
    if fp8 and q_dtype not in _FP8_E4M3:
        allowed = sorted(MLA_DECODE_A16W8_HEADS)
        if not plan.persistent or launched not in MLA_DECODE_A16W8_HEADS:
            return (f"{h} heads with {q_dtype} queries over an fp8 cache: mla_decode_fwd's "
                    f"16-bit-query fp8 kernels (mla_a16w8_*) take {allowed} heads per latent "
                    "head, persistent; the step runs on the next kernel")
    return None


#: query heads per latent KV head that ``mla_prefill_fwd``'s kernel takes (the wheel's
#: ``asm_mla.cu``, ``mla_prefill_asm_fwd``: ``gqa_ratio == 16 || gqa_ratio == 128``)
MLA_PREFILL_HEADS = frozenset({16, 128})

#: query and cache dtypes ``mla_prefill_fwd`` reads: ``mla_prefill_asm_fwd`` has only the
#: ``mla_pfl_bf16_a16w16_*`` kernels, branches on the query's dtype alone and never checks
#: the cache's (an fp8 cache would be read as bf16).
MLA_PREFILL_DTYPES = frozenset({torch.bfloat16})


def mla_prefill_reason(heads: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                       max_seqlen_q: int) -> Optional[str]:
    """Why ``mla_prefill_fwd`` cannot serve an extend step of ``heads`` query heads (one
    latent head), or ``None`` if it can: :data:`MLA_PREFILL_HEADS` heads, queries and cache
    in :data:`MLA_PREFILL_DTYPES`."""
    if heads not in MLA_PREFILL_HEADS:
        return (f"{heads} heads with {max_seqlen_q} query tokens per request: "
                f"mla_prefill_fwd takes {sorted(MLA_PREFILL_HEADS)} heads")
    allowed = sorted(map(str, MLA_PREFILL_DTYPES))
    for name, dtype in (("query", q_dtype), ("kv cache", kv_dtype)):
        if dtype not in MLA_PREFILL_DTYPES:
            return (f"{name} dtype {dtype} with {max_seqlen_q} query tokens per request: "
                    f"mla_prefill_fwd's kernels (mla_pfl_bf16_a16w16_*) read {allowed} only; "
                    "the step runs on the next kernel")
    return None


def kv_last_page_lens(seqused_k: torch.Tensor, page_size: int,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tokens in each request's last page: ``(seqused_k - 1) % page_size + 1`` (0 for empty).

    seqused_k int32 ``[B]`` → int32 ``[B]``; no host sync.
    """
    lens = seqused_k.to(torch.int32)
    res = torch.where(lens > 0, (lens - 1) % page_size + 1, torch.zeros_like(lens))
    if out is None:
        return res
    out[: res.shape[0]].copy_(res)
    return out[: res.shape[0]]


def token_kv_indices(
    block_table: torch.Tensor,
    seqused_k: torch.Tensor,
    page_size: int,
    *,
    kv_indptr: Optional[torch.Tensor] = None,
    kv_indices: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page table → token-level ragged indices for kernels that see the cache as 1-token pages.

    ``kv_indptr = [0, cumsum(seqused_k)]`` and
    ``kv_indices[kv_indptr[b] + j] = block_table[b, j // page_size]·page_size + j % page_size``
    for ``j < seqused_k[b]``. Sizes are static (``B·W·page_size`` entries, W = table width), so
    this runs under graph capture and never syncs; entries past the total are left as they
    were (buffers) or 0 (fresh).

    Args:
        block_table: int32 ``[B, W]`` page ids.
        seqused_k: int32 ``[B]`` KV lengths.
        kv_indptr / kv_indices: optional int32 ``[≥ B + 1]`` / ``[≥ B·W·page_size]`` buffers.

    Returns:
        ``(kv_indptr[:B + 1], kv_indices)``.
    """
    bs, width = block_table.shape
    cap = bs * width * page_size
    dev = block_table.device
    if kv_indptr is None:
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
    if kv_indices is None:
        kv_indices = torch.zeros(cap, dtype=torch.int32, device=dev)
    if kv_indices.shape[0] < cap:
        raise ValueError(
            f"kv_indices has {kv_indices.shape[0]} entries; it needs batch·pages·page_size = "
            f"{bs}·{width}·{page_size} = {cap}. Size the buffer from the static bounds."
        )
    lens = seqused_k.to(torch.int64)
    kv_indptr[:1].zero_()  # a tensor op: a scalar store copies from the host (no capture)
    torch.cumsum(lens, 0, out=kv_indptr[1 : bs + 1])
    j = torch.arange(width * page_size, device=dev)  # [W·P]
    slots = block_table.to(torch.int64)[:, j // page_size] * page_size + j % page_size  # [B, W·P]
    dest = kv_indptr[:bs].to(torch.int64).unsqueeze(1) + j  # [B, W·P]
    valid = j.unsqueeze(0) < lens.unsqueeze(1)
    # Invalid positions write into a scratch tail so the scatter keeps a static size.
    scratch = torch.zeros(cap + 1, dtype=kv_indices.dtype, device=dev)
    scratch[:cap].copy_(kv_indices[:cap])
    dest = torch.where(valid, dest, torch.full_like(dest, cap))
    scratch.scatter_(0, dest.reshape(-1), slots.reshape(-1).to(kv_indices.dtype))
    kv_indices[:cap].copy_(scratch[:cap])
    return kv_indptr[: bs + 1], kv_indices


def max_num_partitions(max_context_len: int, partition_size: int = PARTITION_SIZE) -> int:
    """Split-K partitions of the ragged/gluon decode kernels: ``ceil(max_context_len / 256)``."""
    return -(-int(max_context_len) // partition_size)


def ragged_workspace_bytes(max_batch: int, num_q_heads: int, head_dim: int,
                           max_context_len: int, partition_size: int = PARTITION_SIZE) -> int:
    """Bytes of the uint8 workspace ``paged_attention_ragged`` needs: per (request, head,
    partition) a float32 partial output of ``head_dim`` plus two float32 softmax statistics."""
    parts = max_num_partitions(max_context_len, partition_size)
    rows = max_batch * num_q_heads * parts
    return rows * head_dim * 4 + 2 * rows * 4


def mla_work_buffer_spec(
    batch_size: int,
    max_seqlen_qo: int,
    num_heads: int,
    kv_dtype: torch.dtype,
    *,
    cu_num: int,
    fast_mode: bool = False,
    info: Optional[tuple] = None,
) -> tuple[WorkBuffer, ...]:
    """Static buffers of the persistent MLA decode kernel's work metadata.

    ``info`` is what aiter's ``get_mla_metadata_info_v1`` returned on the device (six
    ``(shape, dtype)`` pairs, authoritative); without it the sizes follow the ``amd-aiter``
    0.1.7 formula (tiles of 128 packed query rows for 16 heads or 128 heads with fp8, else 16)
    with ``cu_num`` compute units. Size them for the largest captured batch; smaller batches
    plan into the same buffers.

    Returns specs named ``work_metadata``, ``work_indptr``, ``work_info_set``,
    ``reduce_indptr``, ``reduce_final_map``, ``reduce_partial_map`` (aiter's order).
    """
    names = ("work_metadata", "work_indptr", "work_info_set", "reduce_indptr",
             "reduce_final_map", "reduce_partial_map")
    if info is None:
        if num_heads % 16:
            raise ValueError(f"num_heads={num_heads}; pad MLA heads to a multiple of 16 first "
                             "(see mla_head_padding).")
        if cu_num <= 0 or batch_size <= 0 or max_seqlen_qo <= 0:
            raise ValueError(f"batch_size={batch_size}, max_seqlen_qo={max_seqlen_qo}, "
                             f"cu_num={cu_num}: all must be positive.")
        fp8 = kv_dtype in _FP8_E4M3 or kv_dtype in _FP8_E5M2
        rows = 128 if num_heads == 16 or (num_heads == 128 and fp8) else 16
        tiles = batch_size * math.ceil(max_seqlen_qo * num_heads / rows)
        if fast_mode:
            max_work = tiles + cu_num - 1
            split_tiles = min(batch_size + cu_num - 1, (cu_num - 1) * 2) * (tiles // batch_size)
        else:
            max_work = split_tiles = tiles * cu_num
        info = (((2,), torch.uint64), ((cu_num + 1,), torch.int32), ((max_work, 8), torch.int32),
                ((tiles + 1,), torch.int32), ((tiles, 2), torch.int32),
                ((split_tiles,), torch.int32))
    if len(info) != 6:
        raise ValueError(f"get_mla_metadata_info_v1 returned {len(info)} entries; expected 6.")
    specs = []
    for name, (shape, dtype) in zip(names, info):
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        specs.append(WorkBuffer(name, tuple(int(s) for s in shape), dtype))
    return tuple(specs)


def allocate_buffers(specs, device) -> dict:
    """``{spec.name: torch.empty(spec.shape, dtype=spec.dtype, device=device)}``."""
    return {s.name: torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs}


def vec5d_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector in the 5-D layout: K is
    ``[pages, kv_heads, head_dim // x, page_size, x]`` with ``x = 16 // itemsize``."""
    return 16 // torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------------------------
# routing and call builders


#: the largest query heads per KV head ``paged_attention_ragged`` launches (the
#: ``switch(gqa_ratio)`` of its launcher in the wheel's ``attention_ragged.cu``: 1…16; the
#: JIT kernel's ``wg_start_head_idx = kv_head_idx * GQA_RATIO_PER_LOOP`` also mis-places
#: heads of later KV heads above 16).
RAGGED_MAX_GQA = 16

#: the head sizes ``paged_attention_ragged`` launches (the ``switch(head_size)`` of
#: ``CALL_CUSTOM_LAUNCHER_BLK_HEAD`` in the wheel's ``attention_ragged.cu``). The JIT kernel
#: it runs (``pa_kernels.cuh``) computes ``VHELOOP = HEAD_SIZE / 16 / NWARPS`` blocks of 64
#: value dims, so other sizes (16, 80, 96, …) would leave value dims unwritten.
RAGGED_HEAD_SIZES = frozenset({64, 128})


def ragged_decode_reason(*, num_tokens: int, batch: int, q_heads: Optional[int],
                         kv_heads: Optional[int], head_dim: Optional[int],
                         v_head_dim: Optional[int]) -> Optional[str]:
    """Why ``paged_attention_ragged`` cannot serve a decode step, or ``None`` if it can.

    Its grid is ``(num_seqs = query.size(0), partitions, kv_heads)`` and query row ``b``
    reads request ``b``'s KV (``kv_indptr[b]``), so the step needs exactly one query token
    per request; its GQA ratio must be one its launcher dispatches
    (1…:data:`RAGGED_MAX_GQA`); and one head size (``query.size(2)``) serves queries, keys
    and values, so ``head_dim == v_head_dim`` in :data:`RAGGED_HEAD_SIZES`. Host integers
    only (no sync).
    """
    if num_tokens != batch:
        return (f"{num_tokens} query tokens for {batch} requests (paged_attention_ragged "
                "reads one query token per request)")
    sizes = ", ".join(map(str, sorted(RAGGED_HEAD_SIZES)))
    if head_dim not in RAGGED_HEAD_SIZES or v_head_dim != head_dim:
        return (f"head_dim={head_dim}, v_head_dim={v_head_dim}: paged_attention_ragged "
                f"launches head_dim == v_head_dim in {{{sizes}}} only; the step takes the "
                "extend route")
    if not q_heads or not kv_heads:
        return "the layer's head counts are unknown (the request carries no q_heads/kv_heads)"
    gqa = q_heads // kv_heads
    if q_heads % kv_heads or not 1 <= gqa <= RAGGED_MAX_GQA:
        return (f"gqa ratio {q_heads}/{kv_heads} = {q_heads / kv_heads:g}: "
                f"paged_attention_ragged launches 1..{RAGGED_MAX_GQA}")
    return None


def unified_page_size_reason(page_size: Optional[int]) -> Optional[str]:
    """Why ``unified_attention`` cannot run over pages of ``page_size`` tokens, or ``None``.

    The wheel's ``aiter/ops/triton/unified_attention.py`` tiles the keys by the page
    (``TILE_SIZE = block_size``) for all-decode steps and in its 3-D (split-KV) kernel, and
    its kernels build ``tl.arange(0, TILE_SIZE)``, which Triton accepts for powers of 2 only
    (``arange's range must be a power of 2``): other page sizes fail on the device.
    """
    if page_size is None or (page_size > 0 and page_size & (page_size - 1) == 0):
        return None
    return (f"page_size {page_size} is not a power of 2: aiter's unified_attention (sinks, "
            "sliding windows, fp8 extend without k_descale) tiles decode steps by the page "
            "with tl.arange(0, page_size), which Triton builds for powers of 2 only; use "
            "pages of 16, 32, 64, … or another backend")


def route_paged_attention(max_seqlen_q: int, *, causal: bool = True, has_sinks: bool = False,
                          window: tuple = (-1, -1), has_window: bool = False,
                          is_fp8: bool = False,
                          prefill_params: Optional[frozenset] = None,
                          ragged_reason: Optional[str] = None) -> str:
    """Which aiter function serves a ``paged_attention`` call (a kernel object decides once
    per step, in its plan, from its layer group's features and the step's ``max_seqlen_q``).

    Sinks and sliding windows (``window`` other than ``(-1, -1)``, or ``has_window``) go to
    ``unified_attention`` (it takes both; it is causal only). Single-token decode goes to
    ``paged_attention_ragged`` unless ``ragged_reason`` (:func:`ragged_decode_reason`) says
    it cannot serve the step; longer queries (and those decode steps) to
    ``mha_batch_prefill_func``, unless the cache is fp8 and the installed release of that
    function takes no ``k_descale`` (then ``unified_attention``, which dequantises).
    """
    special = has_sinks or has_window or tuple(window) != (-1, -1)
    if special:
        if not causal:
            raise ValueError("aiter serves sinks and sliding windows only with causal=True "
                             "(unified_attention); use another backend for this layer.")
        return "unified_attention"
    if max_seqlen_q <= 1 and ragged_reason is None:
        return "paged_attention_ragged"
    if is_fp8 and not _has(prefill_params, "k_descale"):
        if not causal:
            raise ValueError("fp8 caches with causal=False are not served by this aiter "
                             "release; use another backend.")
        return "unified_attention"
    return "mha_batch_prefill_func"


def build_paged_attention_ragged_call(
    out, workspace, q, k_cache, v_cache, *, softmax_scale, kv_indptr, kv_indices,
    kv_last_page_lens, max_num_partitions, softcap=0.0, k_scale, v_scale,
    partition_size=PARTITION_SIZE,
) -> AiterCall:
    """Decode over token-level indices. Caches ``[pages, page_size, Hkv, D]`` are viewed as
    ``[slots, 1, Hkv, D]`` (block size 1); ``k_scale``/``v_scale`` are float32 ``[1]``."""
    hkv = k_cache.shape[2]
    return AiterCall("paged_attention_ragged", kwargs=dict(
        out=out, workspace_buffer=workspace, query=q,
        key_cache=k_cache.view(-1, 1, hkv, k_cache.shape[3]),
        value_cache=v_cache.view(-1, 1, hkv, v_cache.shape[3]),
        scale=float(softmax_scale), kv_indptr=kv_indptr, kv_page_indices=kv_indices,
        kv_last_page_lens=kv_last_page_lens, block_size=1,
        max_num_partitions=int(max_num_partitions), alibi_slopes=None,
        kv_cache_dtype=kv_cache_dtype_name(k_cache.dtype), kv_cache_layout="NHD",
        logits_soft_cap=float(softcap), k_scale=k_scale, v_scale=v_scale,
        fp8_out_scale=None, partition_size=int(partition_size),
    ))


def build_mha_batch_prefill_call(
    q, k_cache, v_cache, *, cu_seqlens_q, kv_indptr, kv_indices, max_seqlen_q, max_seqlen_k,
    softmax_scale, causal=True, softcap=0.0, out=None, k_scale=None, v_scale=None,
    params: Optional[frozenset] = None,
) -> AiterCall:
    """Prefill/extend over token-level indices (cache viewed as ``[slots, Hkv, D]``).

    fp8 descales are passed only to releases that take them (``params``)."""
    hkv = k_cache.shape[2]
    kwargs = dict(
        q=q, k=k_cache.view(-1, hkv, k_cache.shape[3]), v=v_cache.view(-1, hkv, v_cache.shape[3]),
        cu_seqlens_q=cu_seqlens_q, kv_indptr=kv_indptr, kv_page_indices=kv_indices,
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
        softmax_scale=float(softmax_scale), logits_soft_cap=float(softcap), causal=bool(causal),
        window_size=(-1, -1), return_lse=False, return_attn_probs=False, out=out,
    )
    if k_scale is not None and _has(params, "k_descale"):
        kwargs.update(k_descale=k_scale, v_descale=v_scale)
    return AiterCall("mha_batch_prefill_func", kwargs=kwargs)


def build_flash_attn_varlen_call(
    q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
    causal=True, window_size=(-1, -1), softcap=0.0, out=None,
) -> AiterCall:
    """Dense ragged attention: q ``[Tq, Hq, D]``, k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]``
    (MLA extend without prefix: qk head dim ≠ v head dim)."""
    return AiterCall("flash_attn_varlen_func", kwargs=dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
        softmax_scale=float(softmax_scale), logits_soft_cap=float(softcap), causal=bool(causal),
        window_size=tuple(window_size), return_lse=False, return_attn_probs=False, out=out,
    ))


def build_unified_attention_call(
    q, k_cache, v_cache, out, *, cu_seqlens_q, seqused_k, block_table, max_seqlen_q,
    softmax_scale, window_size=(-1, -1), softcap=0.0, sinks=None, k_scale=None, v_scale=None,
) -> AiterCall:
    """Paged attention over our NHD page table (SWA windows, sinks, verify, fp8).

    ``max_seqlen_k`` is the static bound ``block_table.shape[1]·page_size`` (no host sync);
    ``window_size`` is flash-attn ``(left, right)``, the same convention as our op. Pages
    whose size is not a power of 2 raise ``ValueError`` (:func:`unified_page_size_reason`)."""
    page_size = k_cache.shape[1]
    why = unified_page_size_reason(page_size)
    if why is not None:
        raise ValueError(why)
    return AiterCall("unified_attention", kwargs=dict(
        q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=int(max_seqlen_q), seqused_k=seqused_k,
        max_seqlen_k=int(block_table.shape[1] * page_size), softmax_scale=float(softmax_scale),
        causal=True, window_size=tuple(window_size), block_table=block_table,
        softcap=float(softcap), q_descale=None, k_descale=k_scale, v_descale=v_scale,
        sinks=sinks,
    ))


def build_mla_metadata_info_call(batch_size, max_seqlen_qo, plan: MLADecodePlan, q_dtype,
                                 kv_dtype, *, params: Optional[frozenset] = None) -> AiterCall:
    """Sizes of the persistent MLA work metadata for ``batch_size`` requests."""
    kwargs = dict(batch_size=int(batch_size), max_seqlen_qo=int(max_seqlen_qo),
                  num_head_qo=plan.padded_heads, q_dtype=q_dtype, kv_dtype=kv_dtype,
                  is_sparse=False, fast_mode=plan.fast_mode)
    if _has(params, "num_kv_splits") and plan.max_split_per_batch:
        kwargs["num_kv_splits"] = plan.max_split_per_batch
    if _has(params, "intra_batch_mode"):
        kwargs["intra_batch_mode"] = plan.intra_batch_mode
    return AiterCall("get_mla_metadata_info_v1", kwargs=kwargs)


def build_mla_metadata_call(
    qo_indptr, kv_indptr, last_page_lens, buffers: dict, plan: MLADecodePlan, *,
    max_seqlen_qo, q_dtype, kv_dtype, params: Optional[frozenset] = None,
) -> AiterCall:
    """Fill the work-metadata ``buffers`` (from :func:`mla_work_buffer_spec`) for one batch.

    Token-level KV (page size 1) with one latent KV head; queries per request are uniform
    (decode, verify, draft-extend v2)."""
    kwargs = dict(
        seqlens_qo_indptr=qo_indptr, seqlens_kv_indptr=kv_indptr,
        # SGLang's AITER backend plans with is_causal=False for decode and verify alike (the
        # decode kernel masks draft tokens itself); we follow the path it runs in production.
        num_heads_per_head_k=plan.padded_heads, num_heads_k=1, is_causal=False,
        work_metadata_ptrs=buffers["work_metadata"], work_indptr=buffers["work_indptr"],
        reduce_indptr=buffers["reduce_indptr"], reduce_final_map=buffers["reduce_final_map"],
        reduce_partial_map=buffers["reduce_partial_map"], kv_granularity=16,
        max_seqlen_qo=int(max_seqlen_qo), uni_seqlen_qo=int(max_seqlen_qo),
        fast_mode=plan.fast_mode, max_split_per_batch=plan.max_split_per_batch or -1,
        # In amd-aiter 0.1.7 the Python stub calls this `work_info` (and lists it after
        # work_indptr), but the stub is a @compile_ops shell: calls reach the pybind function,
        # whose argument is `work_info_set` (before work_indptr). By keyword, both orders agree.
        work_info_set=buffers["work_info_set"],
    )
    optional = dict(kv_last_page_lens=last_page_lens, page_size=1,
                    intra_batch_mode=plan.intra_batch_mode, dtype_q=q_dtype, dtype_kv=kv_dtype)
    kwargs.update({k: v for k, v in optional.items() if _has(params, k)})
    return AiterCall("get_mla_metadata_v1", kwargs=kwargs)


def build_mla_decode_call(
    q, kv_cache, o, *, qo_indptr, kv_indptr, kv_indices, last_page_lens, max_seqlen_q,
    softmax_scale, plan: MLADecodePlan, buffers: Optional[dict] = None, q_scale=None,
    kv_scale=None, params: Optional[frozenset] = None,
) -> AiterCall:
    """Absorbed MLA decode/verify. ``q``/``o`` already padded to ``plan.padded_heads``;
    ``kv_cache`` ``[pages, page_size, 1, D]`` is viewed as 1-token pages."""
    kwargs = dict(
        q=q, kv_buffer=kv_cache.view(-1, 1, 1, kv_cache.shape[-1]), o=o, qo_indptr=qo_indptr,
        kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_lens=last_page_lens,
        max_seqlen_q=int(max_seqlen_q), sm_scale=float(softmax_scale), logit_cap=0.0,
        q_scale=q_scale, kv_scale=kv_scale,
    )
    if plan.persistent:
        if buffers is None:
            raise ValueError("the persistent MLA kernel needs work-metadata buffers; build them "
                             "with mla_work_buffer_spec/allocate_buffers.")
        kwargs.update(
            work_meta_data=buffers["work_metadata"], work_indptr=buffers["work_indptr"],
            work_info_set=buffers["work_info_set"], reduce_indptr=buffers["reduce_indptr"],
            reduce_final_map=buffers["reduce_final_map"],
            reduce_partial_map=buffers["reduce_partial_map"],
            num_kv_splits=plan.max_split_per_batch,
        )
        if _has(params, "intra_batch_mode"):
            kwargs["intra_batch_mode"] = plan.intra_batch_mode
    return AiterCall("mla_decode_fwd", kwargs=kwargs)


def build_mla_prefill_call(q, kv_cache, o, *, qo_indptr, kv_indptr, kv_indices, last_page_lens,
                           max_seqlen_q, softmax_scale) -> AiterCall:
    """Absorbed MLA extend over the latent cache (1-token pages)."""
    return AiterCall("mla_prefill_fwd", kwargs=dict(
        q=q, kv_buffer=kv_cache.view(-1, 1, 1, kv_cache.shape[-1]), o=o, qo_indptr=qo_indptr,
        kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_lens=last_page_lens,
        max_seqlen_q=int(max_seqlen_q), sm_scale=float(softmax_scale), logit_cap=0.0,
    ))


def build_pa_decode_gluon_call(
    out, q, k_cache, v_cache, *, seqused_k, block_table, softmax_scale, query_length,
    max_context_len, compute_type, k_scale=None, v_scale=None, sinks=None,
    partition_size=PARTITION_SIZE,
) -> AiterCall:
    """Decode over the 5-D layout: K ``[pages, Hkv, D // x, page, x]``, V
    ``[pages, Hkv, page // x, D, x]`` (or 4-D ``[pages, Hkv, D, page]``); ``query_length`` ≤ 4
    tokens per request, the same for every request. No sliding window (``sliding_window=0``):
    we have not verified its convention against ours."""
    return AiterCall("pa_decode_gluon", kwargs=dict(
        output=out, query=q, key_cache=k_cache, value_cache=v_cache, context_lengths=seqused_k,
        block_tables=block_table, softmax_scale=float(softmax_scale),
        query_length=int(query_length),
        max_context_partition_num=max_num_partitions(max_context_len, partition_size),
        context_partition_size=int(partition_size), compute_type=compute_type,
        query_scale=None, key_scale=k_scale, value_scale=v_scale, sinks=sinks, sliding_window=0,
    ))
