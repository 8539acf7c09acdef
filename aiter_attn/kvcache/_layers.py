"""Per-layer buffer bookkeeping shared by the KV pools (MHA, 5-D, MLA): one zeroed buffer per
layer, and the check of a ``layer_id`` against the pool's layer count."""

from __future__ import annotations

import operator

import torch

__all__ = ["zeros_per_layer", "check_layer_id", "check_page_size"]


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
    try:
        ok = not isinstance(page_size, bool) and operator.index(page_size) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{where}: page_size={page_size!r} must be a positive integer (tokens "
                         "per page), the same as BackendConfig.page_size.")
