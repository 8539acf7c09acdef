"""Shared pieces of the conformance inputs: the :class:`Prepared` call, seeded generators,
block-permuted page layouts and caches with NaN traps (see :mod:`.inputs`)."""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from .cases import ConformanceCase

__all__ = ["Prepared", "SENTINEL", "gen", "lens_of", "quantize", "layout", "trap_cache", "to",
           "same_storage"]


#: what integer output buffers hold before the call.
SENTINEL = -7777


@attrs.define(eq=False)
class Prepared:
    """One ready call.

    Attributes:
        tensors: every tensor argument by name (inputs and outputs, on the case's device).
        outputs: names the op may write; every other tensor must stay byte-identical.
        invoke: ``(tensors, backend) -> return value``: the call through ``aiter_attn.ops``.
        judge: ``(tensors, returned) -> (rel_err or None, failure reason or "")`` against
            this preparation's expectation (it may judge tensors of another preparation of
            the same case: the double run of graph-capturable kernels).
    """

    tensors: dict
    outputs: tuple
    invoke: Callable
    judge: Callable


def gen(case: ConformanceCase, variant: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + case.seed + 7919 * variant
                                         + sum(map(ord, case.name)))


def lens_of(case: ConformanceCase, variant: int) -> tuple:
    """KV lengths of a variant: the second run of a graph-capturable kernel sees shorter
    requests in the same buffers (each still on as many pages, so every shape is the same)
    where no host-side size depends on them. With one token per page no request can get
    shorter on as many pages, so there each is one token shorter (its block-table row keeps
    every page): a kernel that keeps the first run's lengths still fails on page size 1."""
    fixed = case.custom_mask or case.op in ("build_ragged_kv_indices", "build_tree_mask")
    if variant == 0 or fixed:
        return case.kv_lens
    ps = case.page_size
    if ps == 1:
        return tuple(max(n, L - 1) for n, L in zip(case.q_lens, case.kv_lens))
    return tuple(max(n, ((L - 1) // ps) * ps + 1) for n, L in zip(case.q_lens, case.kv_lens))


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float):
    """(stored, dequantised float32) for a cache dtype; fp8 divides by ``scale`` and saturates."""
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        stored = x.to(dtype)
        return stored, stored.float()
    fmax = torch.finfo(dtype).max
    stored = (x / scale).clamp(-fmax, fmax).to(dtype)
    return stored, stored.float() * scale


def layout(case: ConformanceCase, g: torch.Generator, lens: tuple):
    """Block-permuted pages: ``(num_pages, block_table int32 [bs, W], slots per request)``;
    page 0 is null, and two pages no request owns follow the used ones (sized by the case's
    lengths; ``lens`` may be shorter on as many pages)."""
    ps = case.page_size
    pages_per = [-(-L // ps) for L in case.kv_lens]
    num_pages = sum(pages_per) + 3
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    block_table = torch.zeros(len(case.kv_lens), max(pages_per + [1]) + 1, dtype=torch.int32)
    slots = []
    for b, L in enumerate(lens):
        pages = [perm.pop() for _ in range(pages_per[b])]
        block_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        slots.append(torch.tensor([pages[j // ps] * ps + j % ps for j in range(L)],
                                  dtype=torch.long))
    return num_pages, block_table, slots


def trap_cache(num_pages, ps, heads, dim, dtype, scale, block_table, kv_lens, g):
    """A cache of noise with NaN in the null page and past each request's length in its
    last page (where a correct kernel never reads)."""
    raw = torch.randn(num_pages, ps, heads, dim, generator=g) * 3
    raw[0] = float("nan")
    for b, L in enumerate(kv_lens):
        if L % ps:
            raw[int(block_table[b, (L - 1) // ps]), L % ps:] = float("nan")
    return quantize(raw, dtype, scale)[0]


def to(tensors: dict, device) -> dict:
    return {k: v.to(device) for k, v in tensors.items()}


def same_storage(ret, out) -> bool:
    return isinstance(ret, torch.Tensor) and (
        ret is out or (ret.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
                       and ret.shape == out.shape))
