"""Small paged-attention and MLA calls built by hand, and strided views with garbage in the
skipped elements (shared by the index-input, value-check and scale tests).

A case is a block-permuted paged cache with a random null page 0, GQA 2:1, two requests of
``q_lens`` queries over ``kv_lens`` keys, and a block table one column wider than needed
(null page past each request's pages).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

__all__ = ["paged_case", "mla_case", "strided", "attn_kwargs"]


def _pages(kv_lens, page_size, g, spare_cols=1, spare_pages=2):
    need = [-(-n // page_size) for n in kv_lens]
    num_pages = 1 + sum(need) + spare_pages
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    width = max(need) + spare_cols
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    return table, num_pages


def paged_case(*, q_lens=(3, 2), kv_lens=(7, 5), page_size=4, hq=4, hkv=2, d=16,
               dtype=torch.float32, device="cpu", seed=0) -> SimpleNamespace:
    """The inputs of one ``paged_attention`` call (NHD caches)."""
    g = torch.Generator().manual_seed(seed)
    table, num_pages = _pages(kv_lens, page_size, g)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return SimpleNamespace(
        q=torch.randn(int(cu[-1]), hq, d, generator=g).to(device, dtype),
        k_cache=torch.randn(num_pages, page_size, hkv, d, generator=g).to(device, dtype),
        v_cache=torch.randn(num_pages, page_size, hkv, d, generator=g).to(device, dtype),
        cu_seqlens_q=cu.to(device), seqused_k=torch.tensor(kv_lens, dtype=torch.int32).to(device),
        block_table=table.to(device), softmax_scale=d ** -0.5, num_pages=num_pages,
        page_size=page_size, q_lens=list(q_lens), kv_lens=list(kv_lens))


def mla_case(*, q_lens=(3, 2), kv_lens=(7, 5), page_size=4, heads=4, rank=32, rope=16,
             dtype=torch.float32, device="cpu", seed=0) -> SimpleNamespace:
    """The inputs of one ``mla_paged_attention`` call (one latent head)."""
    g = torch.Generator().manual_seed(seed)
    table, num_pages = _pages(kv_lens, page_size, g)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return SimpleNamespace(
        q=torch.randn(int(cu[-1]), heads, rank + rope, generator=g).to(device, dtype),
        kv_cache=torch.randn(num_pages, page_size, 1, rank + rope, generator=g).to(device, dtype),
        kv_lora_rank=rank, cu_seqlens_q=cu.to(device),
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32).to(device),
        block_table=table.to(device), softmax_scale=(rank + rope) ** -0.5,
        num_pages=num_pages, page_size=page_size, q_lens=list(q_lens), kv_lens=list(kv_lens))


def attn_kwargs(c, **over) -> dict:
    """Keyword arguments of the op for case ``c`` (``over`` replaces any of them)."""
    kw = dict(cu_seqlens_q=c.cu_seqlens_q, seqused_k=c.seqused_k, block_table=c.block_table,
              softmax_scale=c.softmax_scale)
    kw.update(over)
    return kw


def strided(t: torch.Tensor, garbage) -> torch.Tensor:
    """A view equal to ``t`` whose last axis has stride 2; the skipped elements hold
    ``garbage`` (a scalar or a tensor shaped like ``t``), so a kernel that assumes unit
    stride reads them and goes wrong (the interpreter honours the pointer arithmetic)."""
    base = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    base[..., 0::2] = t
    base[..., 1::2] = garbage
    view = base[..., 0::2]
    assert view.stride(-1) == 2 and torch.equal(view, t)
    return view
