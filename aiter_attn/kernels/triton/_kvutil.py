"""Small helpers shared by this package's Triton kernels (host side only)."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ...types import FP8_DTYPES
from ...validation import check_scale
from . import _interpreting as interpreting  # one TRITON_INTERPRET check, in the package

__all__ = [
    "is_fp8",
    "fp8_max",
    "tl_dtype",
    "interpreting",
    "max_shared_mem",
    "num_sms",
    "next_pow2",
    "scale_args",
]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _max_shared_mem(index: int) -> int:
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["max_shared_mem"])
    except Exception:  # an unknown driver: assume the smallest current budget (AMD LDS)
        return 64 * 1024


def max_shared_mem(device: torch.device) -> Optional[int]:
    """Shared memory one program may use on ``device`` in bytes (a cached host query: the
    driver call costs far more than a launch when repeated per call); ``None`` off-GPU."""
    if device.type != "cuda":
        return None
    return _max_shared_mem(device.index if device.index is not None
                           else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a host query, no tensor sync); 8 on CPU."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def scale_args(scale, device: torch.device):
    """``(tensor_or_dummy, float_value, from_ptr)`` for a dequant/quant scale argument.

    A tensor scale is read by the kernel itself (no host read: CUDA-graph safe); a Python
    number or ``None`` (= 1.0) is passed by value.
    """
    check_scale("scale", scale)  # one number: a per-head tensor is refused, never truncated
    if isinstance(scale, torch.Tensor):
        if scale.device != device:
            raise ValueError(
                f"scale tensor is on {scale.device} but the cache is on {device}; move it."
            )
        return scale.reshape(-1).to(torch.float32), 1.0, True
    value = 1.0 if scale is None else float(scale)
    # The kernel does not read the pointer then: an uninitialised placeholder launches nothing.
    return torch.empty(1, dtype=torch.float32, device=device), value, False


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of a torch dtype (used for casts inside kernels)."""
    table = {
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float32: tl.float32,
    }
    for name, tl_name in (
        ("float8_e4m3fn", "float8e4nv"),
        ("float8_e4m3fnuz", "float8e4b8"),
        ("float8_e5m2", "float8e5"),
        ("float8_e5m2fnuz", "float8e5b16"),
    ):
        if hasattr(torch, name) and hasattr(tl, tl_name):
            table[getattr(torch, name)] = getattr(tl, tl_name)
    return table[dtype]
