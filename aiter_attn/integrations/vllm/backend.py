"""aiter_attn as a vLLM (0.32) v1 attention backend: the three roles vLLM names.

* :class:`AiterAttnBackend`: what the backend supports (as data vLLM's selector reads) and
  which builder / impl it uses. It declares the ``LBNHC`` KV-cache layout, so vLLM allocates
  token-major pages and our kernels run on them in place (see :mod:`.core`).
* :class:`AiterAttnMetadataBuilder`: once per step and KV-cache group, maps vLLM's
  ``CommonAttentionMetadata`` onto our plan (:func:`.core.metadata_from_common`); its CUDA-graph
  support level is the one our kernel registry reports for the kernel it would pick.
* :class:`AiterAttnImpl`: per layer, normalises window / soft-cap once, reads the sinks
  parameter as float32 on every forward (:func:`.core.refresh_sinks`), writes K/V into
  vLLM's cache (``do_kv_cache_update``; an fp8 cache quantised with the layer's
  ``_k_scale`` / ``_v_scale``) and runs :func:`aiter_attn.ops.paged_attention`; an
  encoder-only layer (no cache) attends over its step's K/V (:func:`.core
  .run_encoder_attention`).

This module imports vLLM; :mod:`aiter_attn.integrations.vllm` registers it by class path only.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ...types import CGSupport
from . import core
from .registration import registered_name

__all__ = ["AiterAttnBackend", "AiterAttnMetadataBuilder", "AiterAttnImpl"]

# under "vllm" so it shows in vLLM's log (our own package logger has no handler there)
log = init_logger("vllm.plugins.aiter_attn.backend")

#: kv_cache_dtype strings served: the model's own dtype, or fp8 with each layer's scales
#: (:data:`.core.FP8_KV_CACHE_DTYPES`).
_KV_CACHE_DTYPES = ["auto", "float16", "bfloat16", *core.FP8_KV_CACHE_DTYPES]


#: attention types served: decoder self-attention over the paged cache, and encoder-only
#: (bidirectional, no cache: :func:`.core.run_encoder_attention`)
_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)


def _device_type() -> str:
    return "cpu" if current_platform.is_cpu() else "cuda"


class AiterAttnMetadataBuilder(AttentionMetadataBuilder[core.AiterAttnMetadata]):
    """Builds one :class:`~.core.AiterAttnMetadata` per step for a KV-cache group.

    Our kernels take mixed prefill/decode batches in any order, so the batch is not reordered
    (``reorder_batch_threshold = None``), and groups that differ only in their pages share one
    build (``update_block_table``).
    """

    reorder_batch_threshold: Optional[int] = None
    supports_update_block_table: bool = True

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        why = core.unsupported_model_reason(getattr(vllm_config, "model_config", None))
        if why:
            raise NotImplementedError(
                f"aiter_attn's vLLM backend cannot serve this model: {why}. Otherwise serve "
                "it with vLLM's own attention (on the CPU: disable the plugin with "
                "AITER_ATTN_VLLM=0 or VLLM_PLUGINS set to a list without 'aiter_attn').")
        self._encoder = core.is_encoder_only(kv_cache_spec)
        kernel = _kernel_name(kv_cache_spec, core.layer_query_heads(vllm_config), vllm_config)
        log.info_once("aiter_attn: serving vLLM attention as %s (%s kernels, %s pages of %d)",
                      registered_name(), kernel, type(kv_cache_spec).__name__,
                      kv_cache_spec.block_size)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """The CUDA-graph level of the kernel our registry picks for this group's layers
        (vLLM takes the weakest across groups): ``ALWAYS`` for the Triton kernel on a GPU,
        ``NEVER`` for the reference (the CPU, where vLLM captures no graphs anyway).
        ``kv_cache_spec`` is a layer's spec or, from vLLM's V1 runner, the group's
        ``UniformTypeKVCacheSpecs`` (see :func:`.core.group_cudagraph_support`). Each layer's
        query heads come from ``vllm_config``, so a layer whose GQA group the Triton kernel
        cannot take (it would run the reference) makes the group ``NEVER``."""
        level = core.group_cudagraph_support(kv_cache_spec, device=_device_type(),
                                             vllm_config=vllm_config)
        return AttentionCGSupport[CGSupport(level).name]

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> core.AiterAttnMetadata:
        return core.metadata_from_common(common_attn_metadata, encoder=self._encoder)

    def build_for_cudagraph_capture(
            self, common_attn_metadata: CommonAttentionMetadata) -> core.AiterAttnMetadata:
        return core.metadata_from_common(common_attn_metadata, capturing=True,
                                         encoder=self._encoder)

    def update_block_table(self, metadata: core.AiterAttnMetadata, blk_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> core.AiterAttnMetadata:
        return metadata.with_block_table(blk_table, slot_mapping)


class AiterAttnImpl(AttentionImpl[core.AiterAttnMetadata]):
    """One attention layer on this rank (vLLM passes this rank's head counts)."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: Optional[int] = None, alibi_slopes: Optional[list] = None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None, head_size_v: Optional[int] = None,
                 **unsupported) -> None:
        why = _unsupported_layer(alibi_slopes, kv_cache_dtype, attn_type, unsupported)
        if why:
            raise NotImplementedError(
                f"aiter_attn's vLLM backend cannot serve this layer: {why}. Serve this model "
                "with vLLM's own attention (on the CPU: disable the plugin with "
                "VLLM_PLUGINS set to a list without 'aiter_attn', or AITER_ATTN_VLLM=0).")
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_size = head_size
        self.head_size_v = head_size if head_size_v is None else head_size_v
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = sliding_window
        fp8 = core.fp8_cache_dtype(kv_cache_dtype)
        if fp8 is not None and current_platform.is_rocm():
            fp8 = current_platform.fp8_dtype() if kv_cache_dtype != "fp8_e5m2" else fp8
        self.params = core.AttnLayerParams(
            num_heads=num_heads, num_kv_heads=self.num_kv_heads, head_size=head_size,
            head_size_v=self.head_size_v, scale=self.scale,
            window_size=core.window_from_vllm(sliding_window),
            softcap=float(logits_soft_cap or 0.0), kv_dtype=fp8)
        # vLLM's layer parameter (this rank's heads); loaded after construction.
        self.sinks = sinks
        self._sinks_f32: Optional[torch.Tensor] = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # made here, outside any CUDA-graph capture; refreshed on every forward
        self._sinks_f32 = core.refresh_sinks(self.sinks, None)

    def _sinks(self) -> Optional[torch.Tensor]:
        """float32 ``[num_heads]`` sinks holding the parameter's current values (weights may
        be reloaded in place without ``process_weights_after_loading``), or None."""
        self._sinks_f32 = core.refresh_sinks(self.sinks, self._sinks_f32)
        return self._sinks_f32

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's K/V into vLLM's cache (vLLM calls this before :meth:`forward`,
        as ``forward_includes_kv_cache_update`` is False); encoder-only layers keep none."""
        if self.attn_type == AttentionType.ENCODER_ONLY:
            return
        core.write_kv_cache(self.params, kv_cache, key, value, slot_mapping,
                            *_scales(layer, self.params))

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[core.AiterAttnMetadata],
                output: torch.Tensor, output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``output[:num_actual_tokens]`` ← attention of ``query`` over the cache.

        Shapes: query ``[num_tokens, num_heads, head_size]``; output ``[num_tokens, num_heads,
        head_size_v]``; kv_cache vLLM's per-layer ``[num_blocks, num_kv_heads, block_size,
        head_size + head_size_v]``.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "aiter_attn's vLLM backend has no fused output quantization; leave the "
                "attention output-quant fusion off (-cc.pass_config.fuse_attn_quant=False).")
        if attn_metadata is None:  # vLLM's profiling / warm-up run: zeros, as vLLM's GPU
            return output.fill_(0)   # backends give (torch.empty would carry garbage, NaN too)
        if self.attn_type == AttentionType.ENCODER_ONLY:
            return core.run_encoder_attention(self.params, attn_metadata, query, key, value,
                                              output, sinks=self._sinks())
        k_scale, v_scale = _scales(layer, self.params)
        return core.run_attention(self.params, attn_metadata, query, kv_cache, output,
                                  sinks=self._sinks(), k_scale=k_scale, v_scale=v_scale)


def _scales(layer, params: core.AttnLayerParams) -> tuple:
    """``(k_scale, v_scale)`` of an fp8 layer: vLLM's float32 0-d ``_k_scale`` /
    ``_v_scale`` buffers of the attention layer (on the device, so a captured graph reads
    what they hold; a quantised checkpoint loads them, 1.0 otherwise); ``(None, None)`` for a
    cache of the model's dtype."""
    if params.kv_dtype is None:
        return None, None
    return layer._k_scale, layer._v_scale


def _kernel_name(spec, num_heads: Optional[int] = None, vllm_config=None) -> str:
    from ...plugins import kernel_registry

    num_kv_heads = getattr(spec, "num_kv_heads", None)
    dtype, kv_dtype = core.spec_dtypes(spec, vllm_config)
    req = core.layer_kernel_request(
        device=_device_type(), dtype=dtype, kv_dtype=kv_dtype, head_size=spec.head_size,
        head_size_v=spec.head_size_v, page_size=spec.block_size,
        num_heads=num_heads if num_kv_heads else None, num_kv_heads=num_kv_heads)
    try:
        return kernel_registry().select(req).impl.name
    except Exception as exc:  # only a log line; the layer itself raises with the reason
        return f"no kernel: {exc}"


def _unsupported_layer(alibi_slopes, kv_cache_dtype, attn_type, unsupported) -> str:
    if alibi_slopes is not None:
        return "ALiBi slopes are not supported"
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        return (f"kv_cache_dtype={kv_cache_dtype!r} (served: {_KV_CACHE_DTYPES}; "
                "per-token-head and other packed formats are not)")
    if attn_type not in _ATTN_TYPES:
        return (f"attn_type={attn_type!r} (served: decoder self-attention and encoder-only "
                "attention; not cross-attention or an encoder-decoder's encoder)")
    if unsupported:
        return f"unsupported layer arguments {sorted(unsupported)}"
    return ""


class AiterAttnBackend(AttentionBackend):
    """vLLM's view of aiter_attn: capabilities as data, plus the builder and impl classes."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = list(_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        """The registry name vLLM knows us by: ``CUSTOM`` on GPUs, ``CPU_ATTN`` on the CPU
        (vLLM's CPU platform always picks that name, so the plugin registers over it)."""
        return registered_name()

    @staticmethod
    def get_impl_cls() -> type[AiterAttnImpl]:
        return AiterAttnImpl

    @staticmethod
    def get_builder_cls() -> type[AiterAttnMetadataBuilder]:
        return AiterAttnMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]  # any page size

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Token-major pages: [num_blocks, block_size, num_kv_heads, head_size] views of K and V.
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in _ATTN_TYPES

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability):
        """Why no kernel of ours serves this layer (the registry's reasons), or None."""
        if use_mla:
            return None  # reported by vLLM itself as "MLA not supported"
        _, reason = core.paged_attention_support(
            device=_device_type(), dtype=dtype, head_size=head_size, page_size=block_size,
            sinks=has_sink, kv_dtype=core.fp8_cache_dtype(kv_cache_dtype))
        return None if reason is None else f"aiter_attn: {reason}"
