"""Benchmark inputs: one set of K/V values laid out both as a block-permuted paged cache (ours,
aiter) and as dense ``[B, Hkv, L, D]`` tensors (SDPA, flex), plus byte and FLOP counts."""

from __future__ import annotations

import attrs
import torch

__all__ = ["MHAInputs", "MLAInputs", "make_mha", "make_mla"]


@attrs.define(eq=False)
class MHAInputs:
    bs: int
    q_len: int
    ctx: int
    hq: int
    hkv: int
    d: int
    page: int
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [pages, page, Hkv, D] (maybe fp8)
    v_cache: torch.Tensor
    dense_k: torch.Tensor | None  # [B, Hkv, L, D] bf16 (None for fp8 rows)
    dense_v: torch.Tensor | None
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    scale: float
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def kv_bytes(self) -> int:
        return 2 * self.bs * self.ctx * self.hkv * self.d * self.k_cache.element_size()

    @property
    def bytes_moved(self) -> int:
        """K/V read (each cached element once) + q read + out written."""
        qo = 2 * self.q.numel() * self.q.element_size()
        return self.kv_bytes + qo

    @property
    def flops(self) -> float:
        """QKᵀ and PV: 4·D per visible (query, key) pair and query head; causal prefill counts
        the triangle (S²/2 per sequence)."""
        if self.q_len == 1:
            pairs = self.ctx
        else:
            pairs = self.q_len * self.ctx / 2  # q_len == ctx rows here (plain prefill)
        return 4.0 * self.bs * self.hq * self.d * pairs


def _paged_from_dense(dense: torch.Tensor, page: int, perm: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D]`` → pages ``[1 + B·L/page, page, H, D]`` with page ``1 + perm[i]`` holding
    the i-th page of the concatenated requests; page 0 is a null page of noise."""
    b, h, L, d = dense.shape
    n = b * L // page
    tokens = dense.permute(0, 2, 1, 3).reshape(n, page, h, d)
    cache = torch.randn(n + 1, page, h, d, device=dense.device, dtype=dense.dtype)
    cache[1 + perm] = tokens
    return cache


def make_mha(bs: int, ctx: int, *, q_len: int = 1, hq: int = 32, hkv: int = 8, d: int = 128,
             page: int = 16, dtype=torch.bfloat16, kv_dtype=None, device="cuda",
             dense: bool = True, seed: int = 0) -> MHAInputs:
    """Decode (``q_len = 1``) or plain causal prefill (``q_len = ctx``) inputs."""
    if ctx % page:
        raise ValueError(f"ctx={ctx} must be a multiple of page={page} here.")
    g = torch.Generator(device=device).manual_seed(seed)
    dk = torch.randn(bs, hkv, ctx, d, device=device, dtype=dtype, generator=g)
    dv = torch.randn(bs, hkv, ctx, d, device=device, dtype=dtype, generator=g)
    npp = ctx // page
    perm = torch.randperm(bs * npp, device=device, generator=g)
    k_cache = _paged_from_dense(dk, page, perm)
    v_cache = _paged_from_dense(dv, page, perm)
    block_table = (1 + perm).view(bs, npp).to(torch.int32)
    k_scale = v_scale = None
    if kv_dtype is not None and kv_dtype != dtype:
        k_scale = torch.tensor(k_cache.float().abs().amax().item() / 448.0, device=device)
        v_scale = torch.tensor(v_cache.float().abs().amax().item() / 448.0, device=device)
        k_cache = (k_cache.float() / k_scale).to(kv_dtype)
        v_cache = (v_cache.float() / v_scale).to(kv_dtype)
    q = torch.randn(bs * q_len, hq, d, device=device, dtype=dtype, generator=g)
    cu = torch.arange(0, bs + 1, device=device, dtype=torch.int32) * q_len
    seqused = torch.full((bs,), ctx, device=device, dtype=torch.int32)
    if not dense:
        dk = dv = None
    return MHAInputs(bs, q_len, ctx, hq, hkv, d, page, q, k_cache, v_cache, dk, dv,
                     block_table, cu, seqused, d ** -0.5, k_scale, v_scale)


@attrs.define(eq=False)
class MLAInputs:
    bs: int
    ctx: int
    heads: int
    rank: int
    rope: int
    page: int
    q: torch.Tensor  # [B, H, R + rope]
    kv_cache: torch.Tensor  # [pages, page, 1, R + rope]
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    scale: float
    kv_scale: torch.Tensor | None = None

    @property
    def bytes_moved(self) -> int:
        kv = self.bs * self.ctx * (self.rank + self.rope) * self.kv_cache.element_size()
        return kv + self.q.numel() * self.q.element_size() + \
            self.bs * self.heads * self.rank * self.q.element_size()

    @property
    def flops(self) -> float:
        return 2.0 * self.bs * self.heads * self.ctx * (2 * self.rank + self.rope)


def make_mla(bs: int, ctx: int, *, heads: int, rank: int = 512, rope: int = 64, page: int = 64,
             dtype=torch.bfloat16, kv_dtype=None, device="cuda", seed: int = 0) -> MLAInputs:
    g = torch.Generator(device=device).manual_seed(seed)
    dense = torch.randn(bs, 1, ctx, rank + rope, device=device, dtype=dtype, generator=g)
    npp = ctx // page
    perm = torch.randperm(bs * npp, device=device, generator=g)
    cache = _paged_from_dense(dense, page, perm)
    kv_scale = None
    if kv_dtype is not None and kv_dtype != dtype:
        kv_scale = torch.tensor(cache.float().abs().amax().item() / 448.0, device=device)
        cache = (cache.float() / kv_scale).to(kv_dtype)
    q = torch.randn(bs, heads, rank + rope, device=device, dtype=dtype, generator=g)
    cu = torch.arange(0, bs + 1, device=device, dtype=torch.int32)
    seqused = torch.full((bs,), ctx, device=device, dtype=torch.int32)
    return MLAInputs(bs, ctx, heads, rank, rope, page, q, cache, (1 + perm).view(bs, npp).int(),
                     cu, seqused, (rank + rope) ** -0.5, kv_scale)
