"""The engine-independent half of the vLLM integration: how vLLM's per-step metadata and KV
cache map onto :mod:`aiter_attn.ops`. Nothing here imports vLLM, so it is tested without it;
:mod:`.backend` binds it to vLLM's ``AttentionBackend`` / builder / impl classes.

vLLM's KV cache (0.32, ``vllm/v1/kv_cache_interface.py``): each attention layer gets one
tensor with the *logical* shape ``[num_blocks, num_kv_heads, block_size, head_size +
head_size_v]`` (``[B, H, N, C]``: K and V side by side in the last dim); the *physical* order is
the resolved :class:`KVCacheLayout`. Our backend declares ``LBNHC`` only, so each block is
``[N, H, C]`` in memory: token-major pages, our NHD layout with K and V interleaved per (token,
head). :func:`kv_cache_views` returns the K and V halves as ``[num_blocks, block_size,
num_kv_heads, head_size(_v)]`` strided views of that same memory: kernels write and read vLLM's
cache in place, no copy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ... import ops
from ...kernels.registry import KernelSelectionError
from ...plugins import kernel_registry
from ...types import CGSupport

__all__ = [
    "FP8_KV_CACHE_DTYPES",
    "fp8_cache_dtype",
    "is_encoder_only",
    "AiterAttnMetadata",
    "AttnLayerParams",
    "kv_cache_views",
    "metadata_from_common",
    "unsupported_model_reason",
    "window_from_vllm",
    "batch_window",
    "write_kv_cache",
    "refresh_sinks",
    "run_attention",
    "run_encoder_attention",
    "paged_attention_support",
    "layer_specs",
    "group_cudagraph_support",
    "layer_query_heads",
    "layer_kernel_request",
    "spec_dtypes",
]


#: vLLM's fp8 ``kv_cache_dtype`` strings -> the element type of the cache (vLLM allocates
#: it as uint8 and quantises K/V with each layer's ``_k_scale`` / ``_v_scale``; ``"fp8"`` is
#: e4m3, as vLLM's ``fp8_e4m3`` on CUDA and the CPU). Any other string: the model's dtype.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                       "fp8_e5m2": torch.float8_e5m2}


def fp8_cache_dtype(kv_cache_dtype: Optional[str]) -> Optional[torch.dtype]:
    """The fp8 element type our kernels read a vLLM cache of ``kv_cache_dtype`` as
    (:data:`FP8_KV_CACHE_DTYPES`); ``None`` (also for ``None``): the model's dtype."""
    return FP8_KV_CACHE_DTYPES.get(kv_cache_dtype or "auto")


def is_encoder_only(spec) -> bool:
    """Whether a KV-cache spec is vLLM's ``EncoderOnlyAttentionSpec`` (encoder-only layers:
    no cache; their pages are the step's own tokens, :func:`metadata_from_common`)."""
    return type(spec).__name__ == "EncoderOnlyAttentionSpec"


def window_from_vllm(sliding_window: Optional[int]) -> tuple[int, int]:
    """vLLM's ``sliding_window`` (a query sees itself and the ``w - 1`` keys before it, as in
    vLLM's FlashAttention/Triton backends) as our flash-attn ``(left, right)`` pair."""
    if sliding_window is None:
        return (-1, -1)
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r}; expected None or an int ≥ 1.")
    return (sliding_window - 1, 0)


def batch_window(window_size: tuple[int, int], causal: bool) -> tuple[int, int]:
    """The layer's window for one batch: a causal window ``(w - 1, 0)`` made symmetric,
    ``(w - 1, w - 1)``, when the batch is non-causal (vLLM's DFlash drafters), as vLLM's
    FlashAttention (``_maybe_symmetrize_window``) and FlexAttention (``|q - kv| < w``) attend;
    full attention ``(-1, -1)`` and other windows unchanged."""
    left, right = window_size
    if not causal and left >= 0 and right == 0:
        return (left, left)
    return window_size


def kv_cache_views(kv_cache: torch.Tensor, head_size: int,
                   head_size_v: Optional[int] = None,
                   kv_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of one layer's vLLM KV cache, in our page layout, sharing its memory.

    Args:
        kv_cache: vLLM's per-layer cache, logical ``[num_blocks, num_kv_heads, block_size,
            head_size + head_size_v]`` (any float or fp8 dtype, any physical layout; an fp8
            cache as vLLM allocates it: uint8).
        head_size, head_size_v: K and V head dims (``head_size_v`` defaults to ``head_size``).
        kv_dtype: the element type to read a one-byte cache as (an fp8 type:
            :func:`fp8_cache_dtype`); ``None``: the tensor's own.

    Returns:
        ``(k_cache, v_cache)``: ``[num_blocks, block_size, num_kv_heads, head_size(_v)]`` views
        (``v_cache`` starts ``head_size`` elements into each (token, head) cell).
    """
    head_size_v = head_size if head_size_v is None else head_size_v
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4:
        raise ValueError(
            f"kv_cache has shape {tuple(getattr(kv_cache, 'shape', ()))}; expected vLLM's "
            "per-layer [num_blocks, num_kv_heads, block_size, head_size + head_size_v].")
    if kv_dtype is not None and kv_cache.dtype != kv_dtype:
        if kv_cache.element_size() != kv_dtype.itemsize:
            raise ValueError(
                f"kv_cache is {kv_cache.dtype} but the layer's cache dtype is {kv_dtype}; "
                "vLLM allocated this cache for another kv_cache_dtype.")
        kv_cache = kv_cache.view(kv_dtype)  # vLLM's uint8 bytes, read as fp8
    if kv_cache.shape[3] != head_size + head_size_v:
        raise ValueError(
            f"kv_cache last dim is {kv_cache.shape[3]} but head_size={head_size} + "
            f"head_size_v={head_size_v} = {head_size + head_size_v}; this cache was packed "
            "for another backend (per-token-head scales?), which aiter_attn does not read.")
    pages = kv_cache.permute(0, 2, 1, 3)  # [B, N, H, C]: a view, no copy
    return pages[..., :head_size], pages[..., head_size:]


@dataclass
class AiterAttnMetadata:
    """One step's attention plan, built once per KV-cache group and shared by its layers.

    Every tensor is vLLM's own (persistent input buffers on the device), passed through as
    our ops take them: nothing is copied or recomputed.

    Attributes:
        num_actual_tokens: the requests' tokens (rows of q attended and of ``output``
            written): vLLM's padded ``num_actual_tokens`` cut at ``query_start_loc_cpu[-1]``;
            under CUDA-graph capture the padded count (every replay's rows).
        cu_seqlens_q: int32 ``[num_reqs + 1]``: vLLM's ``query_start_loc``.
        seqused_k: int32 ``[num_reqs]``: vLLM's ``seq_lens`` (KV length, this step included).
        block_table: int32 ``[num_reqs, max_blocks]``: vLLM's ``block_table_tensor``
            (kernel block ids; block 0 is vLLM's null block, as ours).
        slot_mapping: int64 ``[num_tokens]``: vLLM's ``slot_mapping`` (``-1`` = padding).
        causal: vLLM's ``causal`` (a bool; per-request tensors are rejected by the builder).
        max_seqlen_q, max_seqlen_k: host hints for the kernels' grid; ``None`` = static
            bounds (used while capturing a CUDA graph whose replays may differ).
    """

    num_actual_tokens: int
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None

    def with_block_table(self, block_table: torch.Tensor,
                         slot_mapping: torch.Tensor) -> "AiterAttnMetadata":
        """The same plan over another KV-cache group's pages (vLLM's ``update_block_table``)."""
        return replace(self, block_table=block_table, slot_mapping=slot_mapping)


def metadata_from_common(common, *, capturing: bool = False,
                         encoder: bool = False) -> AiterAttnMetadata:
    """Map vLLM's ``CommonAttentionMetadata`` onto :class:`AiterAttnMetadata`.

    Args:
        common: the ``CommonAttentionMetadata`` of this step (read by attribute name only).
        encoder: the group's layers are encoder-only (:func:`is_encoder_only`): no cache, so
            the pages are the step's own tokens, one a page (page ``t`` is token ``t``;
            request ``b``'s row counts up from ``query_start_loc[b]``, its length the
            request's query count), built here once for every layer of the step, on the
            device from ``query_start_loc`` and the host hint ``max_query_len`` (no sync).
        capturing: the metadata is for a CUDA-graph capture. The grid hints are then kept
            only where every replay of that graph shares them: ``max_seqlen_q`` for a uniform
            batch (vLLM replays such graphs only for batches of that query length), never
            ``max_seqlen_k`` (the kernels read each request's length on the device); and
            ``num_actual_tokens`` stays vLLM's padded count (replays have fewer real tokens,
            which the kernels find in ``query_start_loc`` on the device).

    Raises:
        NotImplementedError: ``common.causal`` is a per-request tensor (prefix-LM masks).
    """
    causal = common.causal
    if isinstance(causal, torch.Tensor):
        raise NotImplementedError(
            "aiter_attn's vLLM backend takes causal as a bool; this batch has per-request "
            "causal flags (a prefix-LM / multimodal model). Serve it with vLLM's own backend.")
    max_q = int(common.max_query_len)
    num_tokens = int(common.num_actual_tokens)
    if capturing:
        uniform = max_q * int(common.num_reqs) == num_tokens
        max_seqlen_q, max_seqlen_k = (max_q if uniform else None), None
    else:
        max_seqlen_q, max_seqlen_k = max_q, int(common.max_seq_len)
        num_tokens = _request_tokens(common, num_tokens)
    md = AiterAttnMetadata(
        num_actual_tokens=num_tokens,
        cu_seqlens_q=common.query_start_loc,
        seqused_k=common.seq_lens,
        block_table=common.block_table_tensor,
        slot_mapping=common.slot_mapping,
        causal=bool(causal),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    return _one_token_pages(md) if encoder else md


def _one_token_pages(md: AiterAttnMetadata) -> AiterAttnMetadata:
    """``md`` with an encoder-only step's own tokens as its pages (:func:`metadata_from_common`,
    ``encoder``): ``seqused_k`` the requests' query counts (0 for padding requests) and a
    block table of one-token page ids."""
    n, cu = md.num_actual_tokens, md.cu_seqlens_q
    width = md.max_seqlen_q if md.max_seqlen_q is not None else n
    table = (cu[:-1, None].to(torch.int32)
             + torch.arange(width, dtype=torch.int32, device=cu.device)).clamp_(
                 max=max(n - 1, 0))
    return replace(md, seqused_k=(cu[1:] - cu[:-1]).to(torch.int32), block_table=table,
                   max_seqlen_k=md.max_seqlen_q)


def _request_tokens(common, num_tokens: int) -> int:
    """The tokens that belong to a request: vLLM's ``num_actual_tokens`` is the *padded*
    count (piecewise CUDA-graph sizes, DP padding; padding requests repeat the last
    ``query_start_loc``), so rows past ``query_start_loc[-1]`` are no request's. Read from the
    host copy ``query_start_loc_cpu`` (no device sync); a capture keeps the padded count."""
    cu_cpu = getattr(common, "query_start_loc_cpu", None)
    if isinstance(cu_cpu, torch.Tensor) and cu_cpu.numel() and cu_cpu.device.type == "cpu":
        return min(num_tokens, int(cu_cpu[-1]))
    return num_tokens


def unsupported_model_reason(model_config) -> str:
    """Why this model's attention needs masks our kernels do not apply, or ``""``.

    vLLM's GPU selector refuses these models for a backend without ``supports_mm_prefix`` /
    ``supports_rswa``; its CPU platform picks ``CPU_ATTN`` (us) without asking, and the
    per-step fields that carry them (``CommonAttentionMetadata.mm_req_doc_ranges``,
    ``rswa_prefix_lens``) would otherwise be ignored, serving plain causal attention.

    Args:
        model_config: vLLM's ``ModelConfig`` (read by attribute: ``is_mm_prefix_lm``,
            ``rswa_window``), or None.
    """
    if model_config is None:
        return ""
    if getattr(model_config, "is_mm_prefix_lm", False):
        return ("the model is a multimodal prefix-LM (is_mm_prefix_lm=True: image tokens "
                "attend to each other bidirectionally), and aiter_attn applies only causal / "
                "window masks; serve it text-only (--language-model-only, or "
                "--limit-mm-per-prompt with every modality at 0, turns those masks off)")
    rswa = getattr(model_config, "rswa_window", None)
    if rswa is not None:
        return (f"the model uses reference sliding-window attention (rswa_window={rswa}), "
                "which aiter_attn does not implement (only full or sliding-window)")
    return ""


@dataclass(frozen=True)
class AttnLayerParams:
    """A layer's constants, normalised once at construction (vLLM's impl ``__init__``).

    Attributes:
        num_heads, num_kv_heads: this rank's query / KV heads (vLLM passes local counts).
        head_size, head_size_v: K and V head dims.
        scale: softmax scale.
        window_size: flash-attn ``(left, right)`` (see :func:`window_from_vllm`).
        softcap: logit soft-cap (0 = off).
        kv_dtype: an fp8 cache's element type (:func:`fp8_cache_dtype`), whose K/V are written
            and read with the layer's scales; ``None``: the cache holds the model's dtype.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    scale: float
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    kv_dtype: Optional[torch.dtype] = None


def write_kv_cache(params: AttnLayerParams, kv_cache: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, slot_mapping: torch.Tensor, k_scale=None,
                   v_scale=None) -> None:
    """Write this step's K/V (``[num_tokens, num_kv_heads, head_size(_v)]``) into vLLM's cache
    at ``slot_mapping`` (int64 ``[>= num_tokens]``, ``-1`` = padding row, not written); an fp8
    cache (``params.kv_dtype``) takes ``K / k_scale`` and ``V / v_scale`` (the layer's float32
    0-d scale tensors, read on the device)."""
    k_cache, v_cache = kv_cache_views(kv_cache, params.head_size, params.head_size_v,
                                      params.kv_dtype)
    n = min(key.shape[0], slot_mapping.shape[0])
    key, value, slots = key[:n], value[:n], slot_mapping[:n]
    if slots.device.type == "cpu":
        # The reference writer indexes every slot, so padding rows are dropped here (free on
        # the CPU); the GPU kernels skip negative slots themselves, with no host sync.
        keep = slots >= 0
        if not bool(keep.all()):
            key, value, slots = key[keep], value[keep], slots[keep]
    ops.write_kv(k_cache, v_cache, slots, key, value, k_scale=k_scale, v_scale=v_scale)


def refresh_sinks(sinks: Optional[torch.Tensor],
                  buf: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The float32 contiguous ``[num_heads]`` sinks the kernels take, read from vLLM's sinks
    parameter now: vLLM may replace weights in place with no ``process_weights_after_loading``
    after (``reload_weights(is_checkpoint_format=False)`` does ``param.copy_(w)``; RL weight
    syncs call ``model.load_weights``), so a copy made once would go stale.

    Args:
        sinks: the layer's sinks parameter (any float dtype, ``[num_heads]``) or None.
        buf: the float32 buffer this returned last time for this layer, or None.

    Returns:
        ``sinks`` itself when it is float32 and contiguous; else ``buf`` (made when None or
        unfit) refreshed from ``sinks`` in place: the same tensor every call, so memoised ops
        calls and captured CUDA graphs keep reading it (a graph replays the refresh). None
        without sinks.
    """
    if sinks is None:
        return None
    if sinks.dtype == torch.float32 and sinks.is_contiguous():
        return sinks
    if buf is None or buf.shape != sinks.shape or buf.device != sinks.device:
        buf = torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device)
    buf.copy_(sinks.detach())
    return buf


def run_attention(params: AttnLayerParams, md: AiterAttnMetadata, query: torch.Tensor,
                  kv_cache: torch.Tensor, output: torch.Tensor,
                  sinks: Optional[torch.Tensor] = None, k_scale=None,
                  v_scale=None) -> torch.Tensor:
    """Attention of ``query`` (``[num_tokens, num_heads, head_size]``) over vLLM's cache into
    ``output`` (``[num_tokens, num_heads, head_size_v]``, rows past ``num_actual_tokens``
    untouched). ``sinks``: float32 ``[num_heads]`` or None; ``k_scale`` / ``v_scale``: an fp8
    cache's dequantisation scales (the layer's, as it was written with)."""
    k_cache, v_cache = kv_cache_views(kv_cache, params.head_size, params.head_size_v,
                                      params.kv_dtype)
    n = md.num_actual_tokens
    ops.paged_attention(
        query[:n], k_cache, v_cache,
        cu_seqlens_q=md.cu_seqlens_q, seqused_k=md.seqused_k, block_table=md.block_table,
        softmax_scale=params.scale, causal=md.causal,
        window_size=batch_window(params.window_size, md.causal),
        softcap=params.softcap, sinks=sinks, out=output[:n],
        max_seqlen_q=md.max_seqlen_q, max_seqlen_k=md.max_seqlen_k, k_scale=k_scale,
        v_scale=v_scale,
    )
    return output


def run_encoder_attention(params: AttnLayerParams, md: AiterAttnMetadata,
                          query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          output: torch.Tensor,
                          sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """vLLM's encoder-only layers (``AttentionType.ENCODER_ONLY``: BERT-style embedding and
    classification models): each request's queries attend, bidirectionally, over its own
    tokens' K/V of this step; there is no KV cache. The step's ``key`` / ``value``
    (``[num_tokens, num_kv_heads, head_size(_v)]``) serve in place as pages of one token,
    whose table ``md`` holds (``metadata_from_common(..., encoder=True)``). Window (made
    symmetric), soft-cap and sinks apply as in :func:`run_attention`."""
    n = md.num_actual_tokens
    if n == 0:
        return output
    k_pages = key[:n].reshape(n, 1, params.num_kv_heads, params.head_size)
    v_pages = value[:n].reshape(n, 1, params.num_kv_heads, params.head_size_v)
    ops.paged_attention(
        query[:n], k_pages, v_pages, cu_seqlens_q=md.cu_seqlens_q, seqused_k=md.seqused_k,
        block_table=md.block_table, softmax_scale=params.scale, causal=False,
        window_size=batch_window(params.window_size, False), softcap=params.softcap,
        sinks=sinks, out=output[:n], max_seqlen_q=md.max_seqlen_q,
        max_seqlen_k=md.max_seqlen_k)
    return output


def paged_attention_support(*, device: str, dtype: torch.dtype, head_size: int,
                            head_size_v: Optional[int] = None, page_size: Optional[int] = None,
                            num_heads: Optional[int] = None,
                            num_kv_heads: Optional[int] = None, sliding_window: bool = False,
                            sinks: bool = False, softcap: bool = False,
                            kv_dtype: Optional[torch.dtype] = None) -> tuple:
    """``(cg_support, reason)`` of the paged-attention kernel our registry would pick for a
    layer like this on ``device``: its :class:`~aiter_attn.types.CGSupport`, or
    ``(CGSupport.NEVER, why)`` when no kernel can serve it. ``kv_dtype``: an fp8 cache's
    type (:func:`fp8_cache_dtype`; ``None``: the model's ``dtype``)."""
    req = layer_kernel_request(device=device, dtype=dtype, head_size=head_size,
                               head_size_v=head_size_v, page_size=page_size, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, sliding_window=sliding_window,
                               sinks=sinks, softcap=softcap, kv_dtype=kv_dtype)
    try:
        sel = kernel_registry().select(req)
    except KernelSelectionError as exc:
        return CGSupport.NEVER, str(exc)
    return sel.impl.capabilities.cg_support, None


def layer_kernel_request(*, device: str, dtype: torch.dtype, head_size: int,
                         head_size_v: Optional[int] = None, page_size: Optional[int] = None,
                         num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                         sliding_window: bool = False, sinks: bool = False,
                         softcap: bool = False, kv_dtype: Optional[torch.dtype] = None):
    """The ``paged_attention`` :class:`~aiter_attn.kernels.registry.KernelRequest` of a layer
    like this, as ``ops.paged_attention`` makes it (the head counts decide the GQA group
    limit; ``None``: not checked). ``dtype``: the queries'; ``kv_dtype``: the cache's
    (``None``: ``dtype``)."""
    head_size_v = head_size if head_size_v is None else head_size_v
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    features = ops.attention_features(
        kv_dtype=kv_dtype, head_dim=head_size, v_head_dim=head_size_v,
        window_size=(0, 0) if sliding_window else (-1, -1), softcap=1.0 if softcap else 0.0,
        sinks=True if sinks else None)
    extra = ()
    if num_heads is not None and num_kv_heads is not None:
        extra = (("q_heads", num_heads), ("kv_heads", num_kv_heads))
    from ...kernels.registry import KernelRequest

    return KernelRequest(op="paged_attention", device=device, dtype=dtype, kv_dtype=kv_dtype,
                         head_dim=head_size, v_head_dim=head_size_v, page_size=page_size,
                         features=features, extra=extra)


def layer_specs(kv_cache_spec) -> tuple:
    """The per-layer specs a KV-cache group's spec covers, as vLLM's
    ``kv_cache_interface.iter_layer_specs``: a ``UniformTypeKVCacheSpecs`` (one group of
    layers of one type that differ in head count or size) holds them in ``kv_cache_specs``
    and has no ``dtype`` / ``head_size`` of its own; any other spec is its own layer's."""
    specs = getattr(kv_cache_spec, "kv_cache_specs", None)
    return (kv_cache_spec,) if specs is None else tuple(specs.values())


def layer_query_heads(vllm_config, layer_name: Optional[str] = None) -> Optional[int]:
    """This rank's query heads of a layer, from vLLM's config (a KV-cache spec holds only the
    KV heads): the attention layer's ``num_heads`` in
    ``compilation_config.static_forward_context`` when ``layer_name`` is there, else the
    model's ``model_config.get_num_attention_heads(parallel_config)``; None without a
    config that says (the GQA group is then not checked)."""
    if vllm_config is None:
        return None
    if layer_name is not None:
        ctx = getattr(getattr(vllm_config, "compilation_config", None),
                      "static_forward_context", None) or {}
        heads = getattr(ctx.get(layer_name), "num_heads", None)
        if heads:
            return int(heads)
    model_config = getattr(vllm_config, "model_config", None)
    parallel_config = getattr(vllm_config, "parallel_config", None)
    if model_config is None or parallel_config is None:
        return None
    get_heads = getattr(model_config, "get_num_attention_heads", None)
    return None if get_heads is None else int(get_heads(parallel_config))


def spec_dtypes(spec, vllm_config=None) -> tuple:
    """``(dtype, kv_dtype)`` of a layer's KV-cache spec: the queries' and the cache's element
    type (``None``: the same). vLLM's spec of an fp8 cache says uint8; the fp8 type is the
    server's ``cache_config.cache_dtype`` (:func:`fp8_cache_dtype`) and the queries are in
    ``model_config.dtype``."""
    fp8 = fp8_cache_dtype(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype",
                                  None))
    model_dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    if fp8 is None or not isinstance(model_dtype, torch.dtype):
        return spec.dtype, None
    return model_dtype, fp8


def group_cudagraph_support(kv_cache_spec, *, device: str, vllm_config=None) -> CGSupport:
    """The CUDA-graph level of a KV-cache group (the builder's ``get_cudagraph_support``):
    the weakest over its layers' specs (:func:`layer_specs`; vLLM's V1 runner passes the
    group's spec, the V2 runner a layer's) of :func:`paged_attention_support`, each read
    from the spec's ``dtype``, ``head_size``, ``head_size_v``, ``block_size``,
    ``num_kv_heads`` and ``sliding_window`` (absent = none; an fp8 cache's types from
    ``vllm_config``: :func:`spec_dtypes`), with the layer's query heads
    from ``vllm_config`` (:func:`layer_query_heads`): the registry then picks the kernel
    ``ops.paged_attention`` will run, which for a GQA group over the Triton kernel's limit is
    the reference (``NEVER``). ``NEVER`` for a group with no layer spec, and for encoder-only
    layers (``EncoderOnlyAttentionSpec``: prefill-only models, whose one-token page tables
    are built per step). Called once at start-up, never per step."""
    specs = getattr(kv_cache_spec, "kv_cache_specs", None)
    named = [(None, kv_cache_spec)] if specs is None else list(specs.items())
    levels = []
    for name, spec in named:
        if is_encoder_only(spec):
            # no cache: the one-token page table is built per step from the lengths on the
            # host's hint (:func:`metadata_from_common`), which a captured graph would freeze
            levels.append(CGSupport.NEVER)
            continue
        num_kv_heads = getattr(spec, "num_kv_heads", None)
        num_heads = layer_query_heads(vllm_config, name) if num_kv_heads else None
        dtype, kv_dtype = spec_dtypes(spec, vllm_config)
        levels.append(paged_attention_support(
            device=device, dtype=dtype, kv_dtype=kv_dtype, head_size=spec.head_size,
            head_size_v=getattr(spec, "head_size_v", None), page_size=spec.block_size,
            num_heads=num_heads, num_kv_heads=num_kv_heads if num_heads else None,
            sliding_window=getattr(spec, "sliding_window", None) is not None)[0])
    return min(levels, default=CGSupport.NEVER)
