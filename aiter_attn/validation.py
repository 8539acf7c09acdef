"""Structural input checks that cost no device sync; each error names the argument, the value,
what is allowed and the fix."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

__all__ = ["check_tensor", "check_same_device", "ATTN_DTYPES", "INDEX_DTYPES"]

ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    hint: str = "",
) -> torch.Tensor:
    """Check type, dtype, rank and (``None`` = any) sizes of a tensor argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}. {hint}".strip())
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(
            f"{name} has dtype {t.dtype}; allowed: {_fmt_dtypes(dtypes)}. "
            f"Convert it with .to(...). {hint}".strip()
        )
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} ({t.dim()}-D); expected {ndim}-D. {hint}".strip()
        )
    if shape is not None:
        for i, want in enumerate(shape):
            if want is not None and t.shape[i] != want:
                expect = tuple("*" if s is None else s for s in shape)
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; expected {expect}. {hint}".strip()
                )
    return t


def check_same_device(ref_name: str, ref: torch.Tensor, **others) -> None:
    """Every tensor in ``others`` lives on ``ref``'s device."""
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; move all inputs to "
                "one device."
            )
