"""Launch configuration of the Triton ``paged_attention`` kernel, from host integers only.

Shapes, the caller's ``max_seqlen_q``/``max_seqlen_k`` hints, the device's SM count and
shared memory (queried once per device) pick the tile shapes, warps, pipeline depth, split
count and page lookup. ``docs/triton_tuning.md`` has the H200 measurements behind each
default; :data:`TUNING_OVERRIDES` lets the tuning script and tests try others.

Batch-invariant mode (``batch_invariant=True``): nothing that depends on the rest of the batch
(batch size, the longest request, the SM count divided among programs) may reach the
arithmetic of a row. The tile shapes then depend only on the head geometry and dtypes, the
keys are split by a fixed number of tokens (:data:`BATCH_INVARIANT_SPLIT_TOKENS`, aligned to
absolute key positions, so a request's split boundaries are its own), the split path and its
reduction always run (the reduction sums the splits one by one in index order: trailing empty
splits add exact zeros), and there are no atomics. The batch only sets how many split programs
are launched.
"""

from __future__ import annotations

import functools

from ._kvutil import interpreting, max_shared_mem, next_pow2, num_sms
from ._pdl import EARLY_KEYS, pdl_mode

__all__ = ["TUNING_OVERRIDES", "OVERRIDE_KEYS", "check_overrides", "LaunchConfig",
           "choose_config", "BATCH_INVARIANT_SPLIT_TOKENS",
           "FP8_VALUE_PAIRS", "MLA_FP8_VALUE_PAIRS", "MLA_FUSED_MERGE", "MLA_KV_DESCRIPTORS",
           "MLA_LAZY_RESCALE", "MLA_HALF_PARTIALS", "MLA_QK_SPLIT", "MLA_BALANCED", "MLA_NARROW",
           "MLA_NARROW_PDL", "MLA_STREAM",
           "PREFETCH_PAGES",
           "CARRIED_PAGE_LOOKUP"]

#: Keys per split in batch-invariant mode (rounded up to a multiple of ``block_n``).
BATCH_INVARIANT_SPLIT_TOKENS = 512


def _cdiv(a: int, b: int) -> int:
    # plain ints: triton.cdiv is a JIT-callable and costs microseconds per host call
    return -(-a // b)


class LaunchConfig:
    """Launch parameters chosen from shapes and host hints only."""

    __slots__ = ("block_m", "block_n", "num_warps", "num_stages", "heads", "block_q",
                 "num_splits", "warp_spec", "page_chunk", "split_tiles", "fused_reduce", "pdl",
                 "page_ahead", "flat_slots")

    def __init__(self, block_m, block_n, num_warps, num_stages, heads, block_q, num_splits,
                 warp_spec=False, page_chunk=0, split_tiles=0, fused_reduce=False, pdl=False,
                 page_ahead=False, flat_slots=False):
        self.block_m, self.block_n = block_m, block_n
        self.num_warps, self.num_stages = num_warps, num_stages
        self.heads, self.block_q, self.num_splits = heads, block_q, num_splits
        self.warp_spec, self.page_chunk = warp_spec, page_chunk
        #: > 0: batch-invariant splits of this many key tiles each, at absolute tile
        #: multiples (the split path always runs, the reduction sums in a fixed order)
        self.split_tiles = split_tiles
        #: split path in one launch: the last split program of a tile reduces it (a
        #: per-tile atomic counter); never in batch-invariant mode. Off by default until
        #: measured (``TUNING_OVERRIDES["fused_reduce"] = True`` turns it on)
        self.fused_reduce = fused_reduce
        #: programmatic dependent launch (sm_90+; the kernels wait, ``gdc_wait``, before
        #: their first read, so results are the same): ``True`` the attention launch and
        #: its split reduction may each start while the kernel before finishes;
        #: ``"reduce"`` only the reduction; ``False`` neither. Off by default: on the H200
        #: both launches early cost 1x4k 1.38 -> 1.25 TB/s and 16x4k 3.63 -> 3.45
        #: (docs/benchmarks.md, eighth session)
        self.pdl = pdl
        #: the per-tile page lookup with page ids carried a tile ahead (the kernel's
        #: ``PAGE_AHEAD``, see :data:`CARRIED_PAGE_LOOKUP`), chosen for one-wave decode
        self.page_ahead = page_ahead
        #: K/V rows addressed by their int32 slot index (page · page_size + in_page) times
        #: the token stride, where the cache layout allows (the kernel's ``FLAT_SLOTS``)
        self.flat_slots = flat_slots

    @property
    def batch_invariant(self) -> bool:
        return self.split_tiles > 0

    def page_chunk_for(self, page_size: int) -> int:
        """The chunked page lookup's tiles per chunk for ``page_size``: ``page_chunk`` where
        the page size divides ``block_n`` or is a multiple of it, else 0 (a lookup per tile)."""
        fits = page_size % self.block_n == 0 or self.block_n % page_size == 0
        return self.page_chunk if fits else 0


#: fp8 caches: read the value tile as 16-bit pairs of adjacent head-dim columns (the kernel's
#: ``V_PAIRS``: ldmatrix.trans into two half-width dots) instead of byte by byte. The sm_90
#: build loses its 384 byte-wise shared loads and most spills (64x16k: 216 -> 32 B) at the
#: same shared memory. On by default since the H200 timed it (2026-12-04, graph replay,
#: e4m3 decode): 8x64k 2.61 -> 3.59 TB/s, 64x16k 3.00 -> 3.65, 1x32k 1.56 -> 1.95
#: (``TUNING_OVERRIDES["v_pairs"] = False``: the byte-wise reads).
FP8_VALUE_PAIRS = True

#: The MLA kernel's fp8 value pairs (``mla_paged_attention(..., v_pairs=)``, the same read as
#: :data:`FP8_VALUE_PAIRS` on the latent rows). On by default since the H200 timed it
#: (2026-12-04, 16 heads, e4m3, graph replay): 64x4k 0.97 -> 1.32 TB/s, 128x8k 1.01 -> 1.47.
MLA_FP8_VALUE_PAIRS = True

#: The MLA kernel's split merge in the attention launch (``mla_paged_attention(...,
#: fused_merge=)``): the last split program of a (token, head block) to finish merges it, so
#: a split step is one launch. Head blocks of up to 16 (the memory-bound kernel), up to
#: 16 splits, never batch-invariant.
MLA_FUSED_MERGE = False

#: The Triton MLA kernel reads whole latent tiles through tensor descriptors (TMA on sm_90;
#: ``mla_paged_attention(..., kv_desc=)``) where the cache allows: 16-bit latents of q's dtype,
#: a power-of-two rank and rope, pages holding whole tiles, no custom mask, not
#: batch-invariant. The split's last, partial tile keeps the masked pointer loads.
MLA_KV_DESCRIPTORS = False

#: The Triton MLA kernel's online softmax keeps its running maximum until some head's tile
#: maximum exceeds it by more than 8 (log2 units, p ≤ 256): most tiles skip the ``[H, R]``
#: accumulator rescale (``mla_paged_attention(..., lazy_rescale=)``); its row sums are kept
#: per element ``[H, BLOCK_N]`` and summed once after the last tile, so a tile has one
#: cross-warp reduction (the maximum) instead of two.
MLA_LAZY_RESCALE = False

#: The Triton MLA kernel's split partials ``o / l`` in q's 16-bit dtype instead of float32
#: (``mla_paged_attention(..., half_partials=)``; the LSEs stay float32): head blocks of up to
#: 16, 16-bit queries, not batch-invariant. At 16 heads 64x4k with 4 splits the partials are
#: 8.4 MB written and read back (5.6% of the step's bytes beside the 302 MB cache read); half
#: of that goes. Each partial row is a weighted mean of values, so its rounding (2^-9 in
#: bf16) is that of the output row the merge then rounds again (rows at fp16's largest
#: finite can round past it to inf: the merges read an fp16 ±inf as ±65504,
#: ``mla_merge._partial_f32``). On by default since the
#: twenty-fourth session: with the 16-bit merge split by split (``mla_merge.merge_splits``),
#: H100 replayed 64x4k 2.73 -> 2.79-2.80 TB/s, 128x8k 3.01-3.03 -> 3.04 (docs/benchmarks.md);
#: every MLA gpu test passes with it (``scripts/gpu_session.sh sixtyninth``).
MLA_HALF_PARTIALS = True

#: The balanced launch of 16-head MLA decode (:mod:`.mla_balanced`: every program the same
#: number of key tiles, as many programs as the SMs hold; ``mla_paged_attention(...,
#: balanced=)``): off until timed. The split launch's ``tokens × splits`` programs leave
#: slots empty (64×4k: 256 programs for 264 slots on 132 SMs; 66×4k took 114.1 µs where
#: 64×4k took 112.3 on an H100, docs/benchmarks.md "Twenty-fifth session") and wait on a
#: skewed batch's longest request.
MLA_BALANCED = False

#: The narrow Gluon kernel (:mod:`.mla_narrow_gluon`) for MLA of up to 16 heads where it
#: serves (sm_90, bf16/fp16 q and cache of one dtype, latents 512 + 64, pages whose gcd with
#: 64 is at least 16, no custom mask, not batch-invariant); other steps keep the Triton
#: kernel, and an explicit ``balanced`` option keeps the balanced launch
#: (``mla_paged_attention(..., narrow=False)`` opts out). The default since the twenty-sixth
#: session: on the H200 it ran 16 heads 64×4k at 3.87–3.88 TB/s and 128×8k at 4.43–4.44
#: replayed, against 3.81–3.82 / 4.16–4.18 for the Triton kernel (docs/benchmarks.md,
#: "Twenty-fifth session"), and every MLA gpu test passes with it
#: (``scripts/gpu_session.sh seventyninth``).
MLA_NARROW = True

#: The stream kernel (:mod:`.mla_stream_gluon`) for 16-head MLA decode: one program per SM
#: over shares of the batch's keys that cross requests (``mla_paged_attention(...,
#: stream=True)``, weighed by ``balanced_rates``): off. Correct, but its first sm_90 builds
#: spilled (0.9–1.7 KB a thread) and took twice the narrow kernel's 64×4k step on an H100,
#: whatever the program count (docs/benchmarks.md, "Thirtieth session"); the spill-free
#: build runs 64×4k at 86 % of the narrow kernel's speed on an H100 ("Thirty-first
#: session"), whose stream is already at the copy ceiling.
MLA_STREAM = False

#: The narrow kernel's programmatic dependent launches (the ``pdl`` option): ``"early"``
#: (:data:`._pdl.EARLY_KEYS`), the default: the attention launch starts while the kernel
#: before it runs, reads its indices, prefetches q to L2 and issues its first tiles of keys
#: older than the step's new ones before ``griddepcontrol.wait``; its split merge starts at
#: once and waits on the device, and lets the next launch start before it waits. So a step's
#: first tiles stream during the previous launch's tail (the SMs its programs left). The
#: contract (``_pdl``): the kernel right before, if it signals its dependents early, writes
#: no index tensor and no key but the step's new ones. H100, 16 heads replayed: 64×4k
#: 0.1097 -> 0.1073 ms (2.77 -> 2.84 TB/s), 128×8k 0.4029 -> 0.4014 against ``"reduce"``
#: (only the merge early; 2.76 -> 2.79 TB/s against none, ``seventyeighth``;
#: ``scripts/gpu_session.sh ninetyfifth``, docs/benchmarks.md). ``"reduce"``, ``True``
#: (no reads before the wait) or ``False`` opt out.
MLA_NARROW_PDL = EARLY_KEYS

#: The Triton MLA kernel's q·Kᵀ over the latent columns as two or four independent mma
#: chains (2, 4) or one (1; ``mla_paged_attention(..., qk_split=)``). With 16 heads each
#: warp's scores are one m16n8 accumulator over K = 576: the sm_90 SASS is a chain of 36
#: dependent HMMAs a tile (about 36 × the mma latency per tile and warp). Halves (R/2 deep,
#: the rope a third chain) or quarters run side by side; p·V then updates as many part
#: accumulators.
MLA_QK_SPLIT = 1

#: Split decode whose splits fit one chunk of the chunked page lookup (1x4k: 16 splits of two
#: tiles): read the page ids in the program's first round trip (the kernel's
#: ``PREFETCH_PAGES``), with ``cu_seqlens_q`` and ``seqused_k``, guessing the request is
#: ``max_seqlen_k`` long. The sm_90 build then has K/V one round trip after the start instead
#: of two. Off: on the H200 (2026-12-04) 1x4k went 1.52 -> 1.54 TB/s, within noise
#: (``TUNING_OVERRIDES["prefetch_pages"]`` turns it on).
PREFETCH_PAGES = False

#: Launches on the per-tile page lookup (page_chunk 0: bf16 decode with splits of three or
#: more tiles, 16x4k / 1x32k / 64x4k / 8x64k): read each tile's page ids one tile ahead and
#: carry them through the loop (the kernel's ``PAGE_AHEAD``), so Triton's pipeliner keeps
#: two tiles of K/V copies in flight (sm_90 TTGIR ``async_wait {num = 2}``, 168 registers and
#: no spills at 16x4k) where the per-tile lookup issues a tile's copies only after the tile
#: before has computed. The ring then really holds 3 stages (136 KB of shared memory with
#: 128-key tiles: one program per SM where the per-tile lookup's 73 KB fit three; 64-key
#: tiles: 70 KB). Timed on the H200 (2026-12-04): slower than the per-tile lookup on split
#: launches (1x32k 3.12 -> 2.78 TB/s; 64-key tiles 3.15), faster for one wave of programs
#: without splits (16x4k 3.64 -> 3.84), so the chooser takes it there only
#: (:attr:`LaunchConfig.page_ahead`); ``True`` here (or ``TUNING_OVERRIDES["page_ahead"]``)
#: forces it on every per-tile launch.
CARRIED_PAGE_LOOKUP = False

#: Shared memory (bytes, after the margin) a device needs before bf16 decode in one wave
#: takes the carried page lookup with 128-key tiles (its ring: 136 KB on sm_90).
ONE_WAVE_MIN_SMEM = 160 * 1024

#: Tuning overrides (scripts/tune_triton_paged_attention.py and tests only): ``block_m``,
#: ``block_n``, ``num_warps``, ``num_stages``, ``min_split_tokens``, ``num_splits``, ``heads``
#: (query heads packed per program), ``warp_spec`` (Triton's automatic warp specialisation of
#: the unmasked key loop), ``page_chunk`` (key tiles per block-table load, 0 = per tile),
#: ``split_tokens`` (keys per split in batch-invariant mode), ``fused_reduce`` (the split
#: reduction inside the attention launch: the last split of a tile reduces it), ``pdl``
#: (programmatic dependent launch where the device has it: ``True`` or ``"reduce"``, see
#: :attr:`LaunchConfig.pdl`), ``v_pairs`` (fp8 value reads as 16-bit column pairs, see
#: :data:`FP8_VALUE_PAIRS`), ``prefetch_pages`` (see :data:`PREFETCH_PAGES`), ``page_ahead``
#: (see :data:`CARRIED_PAGE_LOOKUP`), ``waves`` (programs per SM the bf16 split count aims
#: at, 2 by default), ``flat_slots`` (slot-index K/V addressing, see
#: :attr:`LaunchConfig.flat_slots`), ``gluon_decode`` (``False``: plain fp16/bf16 decode on
#: sm_90 keeps this kernel instead of :mod:`.decode_gluon`'s), ``gluon_splits`` (that
#: kernel's split count instead of :func:`.decode_gluon.choose_splits`).
TUNING_OVERRIDES: dict = {}

#: Every key :data:`TUNING_OVERRIDES` understands (the kernels read it with ``.get``, so a
#: misspelt key would be ignored without a word: :func:`choose_config` refuses unknown keys
#: in its cached host work, so no call pays for it; the benchmarks check theirs up front).
OVERRIDE_KEYS = frozenset({
    "block_m", "block_n", "num_warps", "num_stages", "min_split_tokens", "num_splits",
    "heads", "warp_spec", "page_chunk", "split_tokens", "fused_reduce", "pdl", "v_pairs",
    "prefetch_pages", "page_ahead", "waves", "flat_slots", "gluon_decode", "gluon_splits"})


def check_overrides(overrides: dict, where: str) -> dict:
    """``overrides`` if every key is one of :data:`OVERRIDE_KEYS`, else ``ValueError`` naming
    the unknown keys, ``where`` they came from and the keys allowed."""
    unknown = sorted(set(overrides) - OVERRIDE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown launch override(s) {unknown}; allowed: "
                         f"{sorted(OVERRIDE_KEYS)} (aiter_attn.kernels.triton._launch_config).")
    return overrides


def choose_config(*, group, max_q, max_k, head_dim_pad, batch, num_kv_heads, device,
                  fp32=False, fp8_kv=False, batch_invariant=False) -> LaunchConfig:
    """Launch parameters (docs/triton_tuning.md has the measurements behind the defaults).

    ``batch_invariant``: tiles from the head geometry and dtypes only, splits of a fixed key
    count (see the module docstring); ``max_k`` then only sets how many splits are launched.
    """
    ov = tuple(sorted(TUNING_OVERRIDES.items()))
    on_gpu = device.type == "cuda" and not interpreting()
    smem = max_shared_mem(device) - 2048 if on_gpu else 0  # margin for Triton's own buffers
    pdl = pdl_mode(TUNING_OVERRIDES.get("pdl"), device)
    if batch_invariant:
        cfg = _invariant_config_cached(group, head_dim_pad, ov, interpreting(), fp32, smem)
        per_split = cfg.split_tiles * cfg.block_n
        return LaunchConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.heads,
                            cfg.block_q, max(1, _cdiv(max(max_k, 1), per_split)),
                            cfg.warp_spec, cfg.page_chunk, cfg.split_tiles, pdl=pdl)
    sms = num_sms(device) if on_gpu else 0
    return _choose_config_cached(group, max_q, max_k, head_dim_pad, batch, num_kv_heads, sms, ov,
                                 interpreting(), fp32, fp8_kv, smem, pdl)


@functools.lru_cache(maxsize=256)
def _invariant_config_cached(group, head_dim_pad, ov, interpreting, fp32, smem):
    """The batch-invariant tiles: one shape for decode and prefill rows alike (64-row tiles
    of ``group`` heads, 64-key tiles; 32 for head dims over 128 or float32), chunked page
    lookup. ``num_splits`` is left 1 here; the caller sets it from ``max_k``."""
    ov = check_overrides(dict(ov), "TUNING_OVERRIDES")  # a misspelt key is no silent default
    small = head_dim_pad > 128 or fp32
    block_m = 32 if small else 64
    block_n = 32 if small else 64
    num_warps, num_stages = 4, (2 if fp32 else 3)
    block_n, num_stages = _fit_smem(block_m, block_n, num_stages, head_dim_pad,
                                    4 if fp32 else 2, smem)
    if interpreting:
        block_m, block_n = min(block_m, 32), 32
    block_m = max(ov.get("block_m", block_m), 16)
    block_n = ov.get("block_n", block_n)
    heads = min(ov.get("heads", group), group, block_m)
    split_tokens = ov.get("split_tokens", BATCH_INVARIANT_SPLIT_TOKENS)
    split_tiles = max(1, _cdiv(split_tokens, block_n))
    page_chunk = int(ov.get("page_chunk", 16))
    return LaunchConfig(block_m, block_n, ov.get("num_warps", num_warps),
                        ov.get("num_stages", num_stages), heads, block_m // heads, 1,
                        bool(ov.get("warp_spec", False)),
                        next_pow2(page_chunk) if page_chunk else 0, split_tiles)


def _fit_smem(block_m, block_n, num_stages, head_dim_pad, elem, budget):
    """Drop pipeline stages (to 2), then halve ``block_n`` (to 16) until the K/V ring
    (``stages · block_n · 2 · head_dim · elem``) and the q tile fit in ``budget`` bytes."""
    def need(bn, st):
        return st * bn * 2 * head_dim_pad * elem + block_m * head_dim_pad * elem
    while budget and need(block_n, num_stages) > budget and (num_stages > 2 or block_n > 16):
        if num_stages > 2:
            num_stages -= 1
        else:
            block_n //= 2
    return block_n, num_stages


@functools.lru_cache(maxsize=4096)
def _choose_config_cached(group, max_q, max_k, head_dim_pad, batch, num_kv_heads, sms, ov,
                          interpreting, fp32, fp8_kv, smem, pdl=False):
    ov = check_overrides(dict(ov), "TUNING_OVERRIDES")  # a misspelt key is no silent default
    decode_like = max_q * min(group, 64) <= 64
    if decode_like:
        # memory-bound: wide key tiles keep ~190 KB of K/V in flight per SM (H200: BLOCK_N 128
        # gave 4.0-4.3 TB/s where 64 gave 3.1-3.5)
        block_m = max(16, next_pow2(min(group, 64) * max_q))
        block_n = 128 if head_dim_pad <= 128 else 32
        num_warps, num_stages = 4, 3
        # per-tile page lookup for 2-byte caches (H200, bf16: 3.2-4.3 TB/s, the chunked lookup
        # 2.8-4.3); chunked for fp8, whose tiles are compute-heavier (2.3 -> 3.0 TB/s, 64x16k)
        page_chunk = 16 if fp8_kv else 0
    else:
        # compute-bound: 128-row tiles, 8 warps, 3 stages with the chunked page lookup (H200:
        # 1x8k 329 -> 379 TFLOP/s with 128-key tiles; 8x2k 258 -> 290 with 64-key tiles)
        block_m = 128 if head_dim_pad <= 128 else 64
        block_n = (128 if max_k >= 4096 else 64) if head_dim_pad <= 128 else 32
        num_warps = 8 if head_dim_pad >= 128 else 4
        num_stages = 3
        page_chunk = 16
        if fp32:  # 4-byte tiles: stay well inside 227 KB of shared memory
            block_m, block_n, num_warps, num_stages = (64 if head_dim_pad <= 128 else 32), 32, 4, 2
    block_n, num_stages = _fit_smem(block_m, block_n, num_stages, head_dim_pad,
                                    4 if fp32 else 2, smem)
    if interpreting:
        # the CPU interpreter pays per padded element: small tiles (and more of them, so the
        # masked/unmasked tile split is exercised by short test sequences)
        block_m, block_n = min(block_m, 32), 32
    block_m = max(ov.get("block_m", block_m), 16)
    block_n = ov.get("block_n", block_n)
    num_warps = ov.get("num_warps", num_warps)
    num_stages = ov.get("num_stages", num_stages)
    heads = min(ov.get("heads", group), group, block_m)
    block_q = block_m // heads
    num_splits, page_ahead = 1, False
    # (request, kv head, head chunk, q block) programs before any split
    ctas = batch * num_kv_heads * _cdiv(group, heads) * _cdiv(max_q, block_q)
    if decode_like and sms:
        # flash-decoding: enough (request, kv head, split) programs for two waves of SMs,
        # each split at least min_split_tokens keys
        min_tokens = ov.get("min_split_tokens", 256)
        # fp8 tiles are compute-heavier: with less than one wave of programs aim for four
        # (H200 fp8 8x64k: 5 splits 1.70 TB/s, 8 splits 2.55, 16 splits 2.50)
        if fp8_kv and ctas < sms:  # whole waves: 8 splits at 8x64k (512 programs) beat 9
            target = (4 * sms) // ctas
        else:
            target = _cdiv(ov.get("waves", 2) * sms, ctas)
        num_splits = max(1, min(target, _cdiv(max_k, min_tokens), 64))
        if (not fp8_kv and not fp32 and head_dim_pad <= 128 and smem >= ONE_WAVE_MIN_SMEM
                and 3 * sms <= 4 * ctas <= 4 * sms and _cdiv(max_k, block_n) >= 8
                and not {"num_splits", "page_chunk", "page_ahead", "block_n"} & set(ov)):
            # about one wave of (request, kv head) programs (16x4k: 128 on 132 SMs): no
            # splits, so no reduction launch, and K/V copies two tiles ahead with the carried
            # page lookup (H200 16x4k, graph replay: 3.64 -> 3.82 TB/s; its 136 KB ring holds
            # one program per SM, which is all one wave has)
            num_splits, page_ahead = 1, True
    num_splits = ov.get("num_splits", num_splits)
    # slot-index K/V addressing (FLAT_SLOTS, where the cache layout allows it) for bf16/fp16
    # decode: fewer address instructions (H200, graph replay: 1x4k 1.54 -> 1.70 TB/s, 1x32k
    # 3.06 -> 3.25, 64x4k 4.13 -> 4.24, 256x4k 4.24 -> 4.36), but the split build takes 213
    # registers instead of 168, so not where splits rely on three programs per SM (more
    # than two per SM launched: 8x64k 4.28 -> 3.28)
    flat_slots = decode_like and not fp8_kv and not fp32
    if flat_slots and sms and num_splits > 1:
        flat_slots = ctas * num_splits <= 2 * sms
    flat_slots = bool(ov.get("flat_slots", flat_slots))
    if (decode_like and not fp32 and num_splits > 1 and "page_chunk" not in ov
            and _cdiv(max_k, num_splits * block_n) <= 2):
        # splits of one or two key tiles (1x4k: 16 splits of 256 keys): the chunked lookup
        # issues every copy of the split at once (H200, 1x4k: 1.39 -> 1.55 TB/s with chunks
        # of 4 tiles, 1.52 with 8, 1.49 with 16; at 3 or more tiles per split, 16x4k and
        # 1x32k, it was slower: 3.69 -> 2.97, 3.00 -> 2.52 with chunks of 4)
        page_chunk = 4
    return LaunchConfig(block_m, block_n, num_warps, num_stages, heads, block_q, num_splits,
                   bool(ov.get("warp_spec", False)),
                   next_pow2(int(ov.get("page_chunk", page_chunk))) if ov.get("page_chunk",
                                                                               page_chunk) else 0,
                   fused_reduce=bool(ov.get("fused_reduce", False)), pdl=pdl,
                   page_ahead=page_ahead, flat_slots=flat_slots)
