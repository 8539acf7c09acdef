"""Per-(token, head) fp8 KV scales: the option, its rules and the checks made before any kernel
runs (the per-layer rule is :func:`aiter_attn.types.kv_dequant_scales`).

``kv_scale_granularity`` (on :class:`~aiter_attn.types.BackendConfig` and the MHA / SWA pools):

* ``"per_layer"`` (default): one dequantisation scale per layer (``LayerSpec.k_scale`` /
  ``v_scale``), as before.
* ``"per_token_head"``: the pool keeps, next to each fp8 cache, a float32 scale per slot and KV
  head, ``[num_pages, page_size, num_kv_heads]`` per layer for K and for V (SGLang/vLLM call
  the idea "dynamic per-token quantisation"). The write quantises every (token, head) vector
  with its own scale and stores it::

      s = amax(|x|) / (fp8_max · layer_scale)      (s = 1 where amax = 0: zero-safe)
      stored = saturate(x / (s · layer_scale))

  and a read yields ``stored · s · layer_scale``. The layer scale therefore sits *on top*:
  it cancels on the write (``s · layer_scale = amax / fp8_max`` whatever it is) and is
  applied again on the read, so a checkpoint's per-layer scales can stay in the
  ``LayerSpec`` unchanged and the result is the same as with ``1.0`` (up to float32 rounding).
  Served on fp8 caches of the MHA and SWA architectures (NHD pools), by the reference and the
  Triton kernels (KV writes and paged attention); other kernels do not declare the
  ``kv_scale_per_token_head`` feature and are passed over.

The scale buffers are the pool's, allocated once: a captured CUDA graph reads them at fixed
addresses, and no step allocates or plans anything for them.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "GRANULARITIES",
    "PER_LAYER",
    "PER_TOKEN_HEAD",
    "TOKEN_SCALE_FEATURE",
    "check_granularity",
    "check_token_scale_caches",
    "check_pool_format",
]

PER_LAYER = "per_layer"
PER_TOKEN_HEAD = "per_token_head"
GRANULARITIES = (PER_LAYER, PER_TOKEN_HEAD)
#: The kernel-registry feature of writes and attention kernels that serve per-token-head scales.
TOKEN_SCALE_FEATURE = "kv_scale_per_token_head"


def check_granularity(value, *, kv_dtype: Optional[torch.dtype], where: str) -> str:
    """``value`` if it is a known granularity that ``kv_dtype`` can use, else ValueError
    naming ``where`` (e.g. ``"BackendConfig"``) and the fix."""
    from .types import FP8_DTYPES

    if value not in GRANULARITIES:
        raise ValueError(
            f"{where}.kv_scale_granularity={value!r}; allowed: {', '.join(map(repr, GRANULARITIES))}.")
    if value == PER_TOKEN_HEAD and kv_dtype not in FP8_DTYPES:
        raise ValueError(
            f"{where}.kv_scale_granularity='per_token_head' with a {kv_dtype} KV cache: "
            "per-(token, head) scales dequantise fp8 caches only (a float cache stores K/V as "
            "given). Use an fp8 cache dtype (torch.float8_e4m3fn or torch.float8_e5m2) or "
            "kv_scale_granularity='per_layer'.")
    return value


def _check_one(name: str, scales, cache: torch.Tensor) -> None:
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scales).__name__}.")
    want = tuple(cache.shape[:3])
    if scales.dtype != torch.float32 or tuple(scales.shape) != want:
        raise ValueError(
            f"{name} is {scales.dtype} {tuple(scales.shape)}; expected float32 {want} "
            "([num_pages, page_size, num_kv_heads] of the cache): one scale per slot and KV "
            "head (the pool's scale_buffers(layer_id)).")
    if scales.device != cache.device:
        raise ValueError(f"{name} is on {scales.device} but the cache is on {cache.device}.")


def check_token_scale_caches(k_cache: torch.Tensor, v_cache: Optional[torch.Tensor],
                             k_scale_cache, v_scale_cache) -> bool:
    """Check per-(token, head) scale caches against NHD caches ``[P, S, H, D]``; returns
    whether they are given. Both or neither; float32 ``[P, S, H]`` on the caches' device;
    fp8 caches only. ValueError/TypeError naming the argument otherwise."""
    if k_scale_cache is None and v_scale_cache is None:
        return False
    if k_scale_cache is None or (v_scale_cache is None) != (v_cache is None):
        raise ValueError("k_scale_cache and v_scale_cache go together (per-(token, head) "
                         "scales of K and of V); pass both or neither.")
    from .types import FP8_DTYPES

    if k_cache.dtype not in FP8_DTYPES:
        raise ValueError(
            f"k_scale_cache given with a {k_cache.dtype} cache: per-(token, head) scales "
            "dequantise fp8 caches only; drop them or use an fp8 cache.")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}; per-(token, head) scales "
                         "are served on NHD pages [num_pages, page_size, num_kv_heads, dim].")
    _check_one("k_scale_cache", k_scale_cache, k_cache)
    if v_cache is not None:
        _check_one("v_scale_cache", v_scale_cache, v_cache)
        if v_scale_cache.stride() != k_scale_cache.stride():
            raise ValueError(
                f"k_scale_cache strides {k_scale_cache.stride()} differ from v_scale_cache's "
                f"{v_scale_cache.stride()}; pass both as the pool allocates them (contiguous).")
    return True


def check_pool_format(config, kv_pool) -> None:
    """Where a :class:`~aiter_attn.types.BackendConfig` meets its pool: the pool's
    ``kv_scale_granularity`` (``"per_layer"`` for pools without the option) must be the
    config's, so that writes and reads agree on where the scales live."""
    pool_g = getattr(kv_pool, "kv_scale_granularity", PER_LAYER)
    if pool_g != config.kv_scale_granularity:
        raise ValueError(
            f"kv_pool {type(kv_pool).__name__} has kv_scale_granularity={pool_g!r} but "
            f"BackendConfig.kv_scale_granularity={config.kv_scale_granularity!r}; build both "
            "with the same value (the pool holds the per-(token, head) scale buffers).")
