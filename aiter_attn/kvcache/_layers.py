"""Per-layer buffer bookkeeping shared by the KV pools (MHA, 5-D, MLA): one zeroed buffer per
layer, and the check of a ``layer_id`` against the pool's layer count."""

from __future__ import annotations

import torch

from ..validation import check_int, is_int_at_least

__all__ = ["zeros_per_layer", "check_layer_id", "check_page_size", "check_int",
           "check_geometry"]


def zeros_per_layer(num_layers: int, shape: tuple, dtype: torch.dtype, device) -> list:
    """``num_layers`` separate zeroed tensors of ``shape`` and ``dtype`` on ``device``."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def check_layer_id(layer_id: int, num_layers: int) -> None:
    """Raise ValueError unless ``0 <= layer_id < num_layers``."""
    if not 0 <= layer_id < num_layers:
        raise ValueError(
            f"layer_id={layer_id} outside the pool's {num_layers} layers; size the pool "
            "with the model's num_hidden_layers."
        )


def check_page_size(page_size, where: str) -> None:
    """Raise ValueError unless ``page_size`` is a positive integer (tokens per page)."""
    if not is_int_at_least(page_size, 1):
        raise ValueError(f"{where}: page_size={page_size!r} must be a positive integer (tokens "
                         "per page), the same as BackendConfig.page_size.")


def check_geometry(where: str, dtype: torch.dtype, **sizes) -> None:
    """A pool's sizes and storage dtype, before any allocation: each ``sizes`` entry an integer
    ≥ 1 (``num_layers`` ≥ 0: a hybrid pool's full part may hold none), ``dtype`` a floating
    (fp32/fp16/bf16/fp8) ``torch.dtype``."""
    for name, value in sizes.items():
        check_int(value, f"{where}.{name}", 0 if name == "num_layers" else 1,
                  "; size the pool from the model's KV geometry")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}.dtype={dtype!r}: the KV cache stores floating values; pass "
                         "torch.float16, torch.bfloat16, torch.float32 or an fp8 dtype.")
