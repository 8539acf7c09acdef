"""What a captured graph froze of its metadata, and the check that a replay's plan matches it.

A CUDA graph bakes in tensor addresses, shapes and host integers. A replay is only correct if
its freshly planned metadata has exactly the same ones; only tensor *contents* may change.
Every tensor on the backend's device is compared by address, on the CPU too (a no-capture
CPU run checks the very addresses a graph would bake in); host mirrors (attrs fields named
``*_cpu``, and tensors on another device than the backend's) are compared by shape and dtype
only, since a graph never reads them. The step's kernel plans
(:class:`~aiter_attn.kernels.base.StepPlans` on ``AttnMetadata.kernel_plans``) are walked
like the metadata: every :class:`~aiter_attn.kernels.base.KernelPlan` is an attrs class, so
its device tensors (split workspaces, counters, folded masks) are compared by address, its
launch configuration by value; a kernel plan that allocates under ``out=`` is caught too.
:func:`metadata_signature` records them (walking attrs values, mappings and sequences);
:func:`diff_signatures` names every field that moved. The manager checks this on every replay,
so a strategy that allocates, resizes or computes a host size from the batch under ``out=``
fails loudly instead of replaying stale or foreign memory.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Optional

import attrs
import torch

__all__ = ["SIGNATURE_KEY", "GraphMetadataMismatch", "metadata_signature", "describe_signature", "diff_signatures"]


class GraphMetadataMismatch(RuntimeError):
    """A replay planned metadata that differs (addresses, shapes, host values) from capture."""


#: attrs field metadata key: ``{SIGNATURE_KEY: False}`` leaves a field out of the signature
#: (a memo a run fills lazily, e.g. a kernel plan's per-flag constexpr cache; never anything
#: a graph reads).
SIGNATURE_KEY = "graph_signature"

_SCALARS = (bool, int, float, str, enum.Enum, torch.dtype, type(None))


def _host(x: torch.Tensor):
    return ("host tensor", tuple(x.shape), x.dtype)


def _elsewhere(x: torch.Tensor, device) -> bool:
    d = x.device
    return d.type != device.type or (device.index is not None and d.index != device.index)


def _frozen(x: torch.Tensor, device):
    if device is not None and _elsewhere(x, device):  # host tensors: never read by a graph
        return _host(x)
    return ("tensor", x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device))


def _is_mirror(name: str) -> bool:
    """An attrs field holding a host mirror (``seq_lens_cpu``, …): never read by a graph."""
    return name.endswith("_cpu")


def _step_plans():
    global _STEP_PLANS
    if _STEP_PLANS is None:
        from ..kernels.base import StepPlans

        _STEP_PLANS = StepPlans
    return _STEP_PLANS


_STEP_PLANS = None


def _walk(x: Any, path: str, out: dict, device) -> None:
    if isinstance(x, torch.Tensor):
        out[path] = _frozen(x, device)
    elif isinstance(x, _step_plans()):  # the step's kernel plans, in planning order
        plans = x.frozen_plans()
        for i, plan in enumerate(plans):
            _walk(plan, f"{path}[{i}:{type(plan).__qualname__}]", out, device)
        out[f"{path}.__len__"] = len(plans)
    elif attrs.has(type(x)):
        for f in attrs.fields(type(x)):
            if not f.metadata.get(SIGNATURE_KEY, True):
                continue
            v = getattr(x, f.name)
            if isinstance(v, torch.Tensor) and _is_mirror(f.name):
                out[f"{path}.{f.name}"] = _host(v)
            else:
                _walk(v, f"{path}.{f.name}", out, device)
    elif isinstance(x, Mapping):
        for k in sorted(x, key=str):
            _walk(x[k], f"{path}[{k!r}]", out, device)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _walk(v, f"{path}[{i}]", out, device)
        out[f"{path}.__len__"] = len(x)
    elif isinstance(x, _SCALARS):
        out[path] = x
    else:  # opaque helper objects (kernel handles): only their type is part of the contract
        out[path] = ("object", type(x).__qualname__)


_SCALAR, _TENSOR, _PLANS, _ATTRS, _MAP, _SEQ, _OBJECT = range(7)
_KINDS: dict = {}


def _kind(cls) -> int:
    """How :func:`_walk` treats instances of ``cls`` (cached per type: the hot path)."""
    k = _KINDS.get(cls)
    if k is None:
        if issubclass(cls, torch.Tensor):
            k = _TENSOR
        elif issubclass(cls, _step_plans()):
            k = _PLANS
        elif attrs.has(cls):
            k = _ATTRS
        elif issubclass(cls, Mapping):
            k = _MAP
        elif issubclass(cls, (list, tuple)):
            k = _SEQ
        elif issubclass(cls, _SCALARS):
            k = _SCALAR
        else:
            k = _OBJECT
        _KINDS[cls] = k
    return k


def _fast(x: Any, out: list, device) -> None:
    """The values of :func:`_walk` in the same order, without building paths (hot path)."""
    k = _kind(type(x))
    if k == _SCALAR:
        out.append(x)
    elif k == _TENSOR:
        out.append(_frozen(x, device))
    elif k == _ATTRS:
        for name, mirror in _field_names(type(x)):
            v = getattr(x, name)
            if mirror and isinstance(v, torch.Tensor):
                out.append(_host(v))
            else:
                _fast(v, out, device)
    elif k == _SEQ:
        out.append(len(x))
        for v in x:
            _fast(v, out, device)
    elif k == _MAP:
        for key in sorted(x, key=str):
            out.append(key)
            _fast(x[key], out, device)
    elif k == _PLANS:
        plans = x.frozen_plans()
        out.append(len(plans))
        for plan in plans:
            out.append(type(plan))
            _fast(plan, out, device)
    else:
        out.append(("object", type(x).__qualname__))


_FIELDS: dict = {}


def _field_names(cls) -> tuple:
    """``(name, is host mirror)`` of the attrs fields of ``cls`` in the signature."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple((f.name, _is_mirror(f.name)) for f in attrs.fields(cls)
                                     if f.metadata.get(SIGNATURE_KEY, True))
    return names


def metadata_signature(metadata: Any, device: Optional[torch.device] = None) -> tuple:
    """The frozen parts of ``metadata``: every device tensor's address, shape, stride, dtype
    and device, every host scalar, and the structure around them (a hashable tuple).

    ``device``: the backend's device; tensors elsewhere are host tensors (shape and dtype
    only). ``None``: every tensor is compared by address. Attrs fields named ``*_cpu`` are
    host mirrors either way.
    """
    out: list = []
    _fast(metadata, out, None if device is None else torch.device(device))
    return tuple(out)


def describe_signature(metadata: Any, device: Optional[torch.device] = None) -> dict:
    """``path → frozen value``: :func:`metadata_signature` with names (for error messages)."""
    out: dict = {}
    _walk(metadata, "metadata", out, None if device is None else torch.device(device))
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
