"""What a captured graph froze of its metadata, and the check that a replay's plan matches it.

A CUDA graph bakes in tensor addresses, shapes and host integers. A replay is only correct if
its freshly planned metadata has exactly the same ones; only tensor *contents* may change.
:func:`metadata_signature` records them (walking attrs values, mappings and sequences);
:func:`diff_signatures` names every field that moved. The manager checks this on every replay,
so a strategy that allocates, resizes or computes a host size from the batch under ``out=``
fails loudly instead of replaying stale or foreign memory.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping

import attrs
import torch

__all__ = ["GraphMetadataMismatch", "metadata_signature", "diff_signatures"]


class GraphMetadataMismatch(RuntimeError):
    """A replay planned metadata that differs (addresses, shapes, host values) from capture."""


def _walk(x: Any, path: str, out: dict) -> None:
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu":  # host tensors (CPU mirrors) are never read by a graph
            out[path] = ("host tensor", tuple(x.shape), x.dtype)
        else:
            out[path] = ("tensor", x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype,
                         str(x.device))
    elif attrs.has(type(x)):
        for f in attrs.fields(type(x)):
            _walk(getattr(x, f.name), f"{path}.{f.name}", out)
    elif isinstance(x, Mapping):
        for k in sorted(x, key=str):
            _walk(x[k], f"{path}[{k!r}]", out)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _walk(v, f"{path}[{i}]", out)
        out[f"{path}.__len__"] = len(x)
    elif x is None or isinstance(x, (bool, int, float, str, enum.Enum, torch.dtype)):
        out[path] = x
    else:  # opaque helper objects (kernel handles): only their type is part of the contract
        out[path] = ("object", type(x).__qualname__)


def metadata_signature(metadata: Any) -> dict:
    """``path → frozen value`` for every tensor (address, shape, stride, dtype, device) and
    host scalar in ``metadata``."""
    out: dict = {}
    _walk(metadata, "metadata", out)
    return out


def diff_signatures(captured: dict, replayed: dict, limit: int = 6) -> list[str]:
    """Human-readable differences, at most ``limit``."""
    diffs = []
    for key in sorted(set(captured) | set(replayed)):
        a, b = captured.get(key, "<absent>"), replayed.get(key, "<absent>")
        if a != b:
            diffs.append(f"{key}: captured {a!r}, now {b!r}")
            if len(diffs) >= limit:
                break
    return diffs
