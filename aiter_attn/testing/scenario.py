"""Build realistic paged batches for tests: block-permuted pools with a null page 0, random
cached prefixes, and the dense K/V of every request for the float64 oracle."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import attrs
import torch

from ..batch import ForwardBatch, SpecInfo
from ..kvcache import MHAKVPool, PageAllocator, ReqToTokenPool
from ..types import BackendConfig, ForwardMode, LayerSpec
from .oracle import dense_attention

__all__ = ["PagedScenario", "fill_noise", "write_token_major"]


def fill_noise(buffers: Sequence[torch.Tensor], generator: torch.Generator) -> None:
    """Fill every slot of ``buffers`` (null page too) with N(0, 1) noise drawn from
    ``generator``, cast to each buffer's dtype, so that a wrong page read shows."""
    for buf in buffers:
        buf.copy_(torch.randn(buf.shape, generator=generator).to(buf.dtype))


def write_token_major(kv_pool, layer: LayerSpec, slots: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
    """Write k ``[n, Hkv, D]`` / v ``[n, Hkv, Dv]`` of ``layer`` at ``slots`` ``[n]`` (int64) of a
    token-major pool (buffers ``[pages, page, Hkv, D]``), quantised like the cache stores them."""
    from ..kernels.reference import quantize_to_cache

    kc, vc = kv_pool.kv_buffers(layer.layer_id)
    slots = slots.to(kc.device)  # k/v may come from a CPU generator; the pool may be on a GPU
    kc.view(-1, *kc.shape[2:])[slots] = quantize_to_cache(k.to(kc.device), kc.dtype, layer.k_scale)
    vc.view(-1, *vc.shape[2:])[slots] = quantize_to_cache(v.to(vc.device), vc.dtype, layer.v_scale)


@attrs.define(eq=False)
class PagedScenario:
    """A KV pool holding ``prefix_lens`` cached tokens per request, and the next step's batch.

    Build with :meth:`make`; then ``q, k, v = scenario.step_inputs(layer)``, run the backend,
    and compare with :meth:`expected`.
    """

    config: BackendConfig
    layers: list
    req_pool: ReqToTokenPool
    allocator: PageAllocator
    kv_pool: MHAKVPool
    rows: list
    dense_k: dict  # (layer_id, req index) -> [L, Hkv, D] float32 of every token so far
    dense_v: dict
    generator: torch.Generator
    batch: Optional[ForwardBatch] = None
    new_k: dict = attrs.field(factory=dict)
    new_v: dict = attrs.field(factory=dict)

    @classmethod
    def make(cls, config: BackendConfig, layers: Sequence[LayerSpec], prefix_lens: Sequence[int],
             *, seed: int = 0, num_pages: Optional[int] = None, kv_scale: float = 1.0):
        """An ``MHAKVPool`` of ``num_pages`` (default: twice :meth:`pages_needed`) pages full of
        noise, a block-permuted allocator, and ``prefix_lens`` cached tokens per request.

        ``kv_scale`` must stay 1.0: the cache is quantised with each layer's ``k_scale`` /
        ``v_scale`` (set those on the :class:`LayerSpec`)."""
        if kv_scale != 1.0:  # it was accepted and ignored: a scaled-cache test tested nothing
            raise ValueError(f"kv_scale={kv_scale!r}: PagedScenario.make does not scale the cache; "
                             "set LayerSpec.k_scale / v_scale on the layers instead.")
        g = torch.Generator().manual_seed(seed)
        ps = config.page_size
        num_pages = num_pages or 2 * cls.pages_needed(prefix_lens, ps)
        l0 = layers[0]
        pool = MHAKVPool(num_pages, ps, l0.num_kv_heads, l0.head_dim, len(layers),
                         dtype=config.kv_cache_dtype, device=config.device, v_head_dim=l0.v_head_dim)
        fill_noise(pool.k_buffers + pool.v_buffers, g)
        alloc = PageAllocator(num_pages, ps, shuffle_seed=seed + 1)
        return cls.from_pool(config, layers, pool, alloc, prefix_lens, generator=g)

    @staticmethod
    def pages_needed(prefix_lens: Sequence[int], page_size: int, extra_tokens: int = 64) -> int:
        """Pages for every prefix plus ``extra_tokens`` new tokens per request, plus 4 spare."""
        return sum(-(-(p + extra_tokens) // page_size) for p in prefix_lens) + 4

    @classmethod
    def from_pool(cls, config: BackendConfig, layers: Sequence[LayerSpec], kv_pool, allocator,
                  prefix_lens: Sequence[int], *, generator: torch.Generator,
                  write_prefix: Optional[Callable] = None):
        """A scenario over a caller-built pool and allocator (SWA, 5-D layouts, ...).

        Allocates one request row per entry of ``prefix_lens`` and writes that many random
        tokens per layer (k ``[L, Hkv, D]``, v ``[L, Hkv, Dv]`` float32, drawn from
        ``generator``) through ``write_prefix(kv_pool, layer, slots, k, v)`` — by default
        :func:`write_token_major` — keeping their cache-rounded dense copies for the oracle.
        """
        write_prefix = write_prefix or write_token_major
        g = generator
        req_pool = ReqToTokenPool(len(prefix_lens) + 2, config.max_context_len, config.device)
        rows = [req_pool.alloc() for _ in prefix_lens]
        sc = cls(config, list(layers), req_pool, allocator, kv_pool, rows, {}, {}, g)
        for i, (row, plen) in enumerate(zip(rows, prefix_lens)):
            slots = allocator.extend(req_pool, row, plen)
            for layer in layers:
                k = torch.randn(plen, layer.num_kv_heads, layer.head_dim, generator=g)
                v = torch.randn(plen, layer.num_kv_heads, layer.v_head_dim, generator=g)
                write_prefix(kv_pool, layer, slots, k, v)
                kc, vc = kv_pool.kv_buffers(layer.layer_id)
                sc.dense_k[(layer.layer_id, i)] = sc._roundtrip(k, kc.dtype, layer.k_scale)
                sc.dense_v[(layer.layer_id, i)] = sc._roundtrip(v, vc.dtype, layer.v_scale)
        return sc

    @staticmethod
    def _roundtrip(x, dtype, scale):
        from ..kernels.reference import quantize_to_cache
        from ..types import kv_dequant_scales

        scale, _ = kv_dequant_scales(dtype, scale, scale)  # fp8 caches only
        scale = 1.0 if scale is None else scale
        return quantize_to_cache(x, dtype, scale).float() * scale

    def next_batch(self, mode: ForwardMode | str, new_lens: Sequence[int],
                   spec_info: Optional[SpecInfo] = None) -> ForwardBatch:
        """Reserve slots for ``new_lens`` tokens per request and build the step's batch."""
        mode = ForwardMode.parse(mode)
        locs, seq = [], []
        for row, n in zip(self.rows, new_lens):
            locs.append(self.allocator.extend(self.req_pool, row, n))
            seq.append(self.allocator.tokens_held(row))
        out_cache_loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64)
        self.batch = ForwardBatch.from_lengths(
            forward_mode=mode, req_pool_indices=self.rows, seq_lens=seq,
            out_cache_loc=out_cache_loc, extend_seq_lens=list(new_lens), spec_info=spec_info,
            device=self.config.device,
        )
        return self.batch

    def step_inputs(self, layer: LayerSpec, dtype: Optional[torch.dtype] = None):
        """Random q/k/v ``[num_tokens, heads * dim]`` for ``layer`` in the step's batch."""
        dtype = dtype or self.config.dtype
        n = self.batch.num_tokens
        g = self.generator
        q = torch.randn(n, layer.num_q_heads * layer.head_dim, generator=g).to(dtype)
        k = torch.randn(n, layer.num_kv_heads * layer.head_dim, generator=g).to(dtype)
        v = torch.randn(n, layer.num_kv_heads * layer.v_head_dim, generator=g).to(dtype)
        self.new_k[layer.layer_id], self.new_v[layer.layer_id] = k, v
        dev = self.config.device
        return q.to(dev), k.to(dev), v.to(dev)

    def expected(self, layer: LayerSpec, q: torch.Tensor, *, masks=None,
                 causal: Optional[bool] = None) -> torch.Tensor:
        """float64 ``[num_tokens, Hq * Dv]`` from dense per-request K/V (prefix + this step)."""
        b = self.batch
        q_lens = b.q_lens_cpu.tolist()
        if masks is not None and len(masks) != len(q_lens):
            raise ValueError(f"masks has {len(masks)} entries for {len(q_lens)} requests; give "
                             "one [q_len, seq_len] mask per request of the step.")
        k_new = self.new_k[layer.layer_id].view(-1, layer.num_kv_heads, layer.head_dim)
        v_new = self.new_v[layer.layer_id].view(-1, layer.num_kv_heads, layer.v_head_dim)
        qv = q.view(-1, layer.num_q_heads, layer.head_dim).cpu()
        kc, _ = self.kv_pool.kv_buffers(layer.layer_id)
        outs, t = [], 0
        for i, n in enumerate(q_lens):
            kn = self._roundtrip(k_new[t:t + n].float(), kc.dtype, layer.k_scale)
            vn = self._roundtrip(v_new[t:t + n].float(), kc.dtype, layer.v_scale)
            k = torch.cat([self.dense_k[(layer.layer_id, i)], kn])
            v = torch.cat([self.dense_v[(layer.layer_id, i)], vn])
            outs.append(dense_attention(
                qv[t:t + n], k, v, scale=layer.scaling,
                causal=layer.is_causal if causal is None else causal,
                window=layer.window_size(), softcap=layer.logit_cap, sinks=layer.sinks,
                mask=None if masks is None else masks[i],
            ))
            t += n
        width = layer.num_q_heads * layer.v_head_dim  # (a step of zero tokens: [0, width])
        return (torch.cat(outs).view(t, width) if outs
                else torch.zeros(0, width, dtype=torch.float64))

    def commit_step(self) -> None:
        """Append this step's K/V to the dense copies (after the backend wrote the pool)."""
        q_lens = self.batch.q_lens_cpu.tolist()
        for layer in self.layers:
            if layer.layer_id not in self.new_k:
                continue
            kc, _ = self.kv_pool.kv_buffers(layer.layer_id)
            kn = self.new_k[layer.layer_id].view(-1, layer.num_kv_heads, layer.head_dim)
            vn = self.new_v[layer.layer_id].view(-1, layer.num_kv_heads, layer.v_head_dim)
            t = 0
            for i, n in enumerate(q_lens):
                key = (layer.layer_id, i)
                self.dense_k[key] = torch.cat(
                    [self.dense_k[key], self._roundtrip(kn[t:t + n].float(), kc.dtype, layer.k_scale)])
                self.dense_v[key] = torch.cat(
                    [self.dense_v[key], self._roundtrip(vn[t:t + n].float(), kc.dtype, layer.v_scale)])
                t += n
