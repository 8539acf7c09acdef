"""A small rig for graph-manager tests: a block-permuted pool (null page 0, filled with noise so
a wrong read shows), requests that join and leave, decode-like batches for every capturable
mode, per-layer q/k/v owned by the manager as token inputs, and the eager run to compare with.

Architectures: MHA (``MHAKVPool``), MLA (absorbed form over ``MLAKVPool``), SWA
(``SWAKVPool`` with alternating window / full layers).
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from aiter_attn import (AttentionBackend, AttnArch, BackendConfig, ForwardBatch, ForwardMode,
                        LayerSpec, SpecDecodeConfig, SpecInfo)
from aiter_attn.kvcache import MHAKVPool, PageAllocator, ReqToTokenPool

SPEC_MODES = (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)


def full_to_tree_part(mask: torch.Tensor, seq_lens, n: int) -> torch.Tensor:
    """The ``[bs, n, n]`` draft part of a full-layout mask (its last ``n`` columns)."""
    parts, off = [], 0
    for L in seq_lens:
        parts.append(mask[off:off + n * L].view(n, L)[:, L - n:])
        off += n * L
    return torch.stack(parts) if parts else torch.zeros(0, n, n, dtype=torch.bool)


@attrs.define(eq=False)
class Rig:
    arch: AttnArch
    config: BackendConfig
    layers: list
    req_pool: ReqToTokenPool
    alloc: PageAllocator
    kv_pool: object
    backend: AttentionBackend
    gen: torch.Generator
    rows: list = attrs.field(factory=list)

    @classmethod
    def make(cls, arch="mha", *, page_size=16, hq=10, hkv=2, head_dim=16, num_layers=2,
             max_context_len=128, max_bs=8, spec: Optional[SpecDecodeConfig] = None,
             dtype=torch.float32, seed=0, num_pages=None, window=5, device="cpu", rope=8):
        arch = AttnArch.parse(arch)
        g = torch.Generator().manual_seed(seed)
        cfg = BackendConfig(page_size=page_size, max_batch_size=max_bs,
                            max_context_len=max_context_len, dtype=dtype, arch=arch, spec=spec,
                            device=device)
        num_pages = num_pages or (max_bs + 2) * (-(-max_context_len // page_size)) + 2
        req_pool = ReqToTokenPool(max_bs * 2 + 2, max_context_len, device)
        alloc = PageAllocator(num_pages, page_size, shuffle_seed=seed + 1)
        if arch == AttnArch.MLA:
            from aiter_attn.kvcache import MLAKVPool
            from aiter_attn.strategies.mla import mla_layer_specs

            lora = head_dim
            layers = [mla_layer_specs(i, num_heads=hq, kv_lora_rank=lora, qk_nope_head_dim=16,
                                      qk_rope_head_dim=rope, v_head_dim=16,
                                      scaling=(16 + rope) ** -0.5)[0]
                      for i in range(num_layers)]
            pool = MLAKVPool(num_pages, page_size, lora, rope, num_layers, dtype=dtype,
                             device=device)
            bufs = pool.latent_buffers
        elif arch == AttnArch.SWA:
            from aiter_attn.kvcache import SWAKVPool

            is_swa = [i % 2 == 0 for i in range(num_layers)]
            layers = [LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                                sliding_window=window if is_swa[i] else None)
                      for i in range(num_layers)]
            pool = SWAKVPool.create(num_full_pages=num_pages, num_swa_pages=num_pages,
                                    page_size=page_size, num_kv_heads=hkv, head_dim=head_dim,
                                    layer_is_swa=is_swa, dtype=dtype, device=device)
            # a shuffled full→SWA page map, page 0 ↦ 0
            perm = torch.cat([torch.zeros(1, dtype=torch.int64),
                              torch.randperm(num_pages - 1, generator=g) + 1])
            slots = torch.arange(num_pages * page_size)
            pool.full_to_swa_index_mapping.copy_((perm[slots // page_size] * page_size
                                                  + slots % page_size).to(device))
            bufs = (pool.full.k_buffers + pool.full.v_buffers + pool.swa.k_buffers
                    + pool.swa.v_buffers)
        else:
            layers = [LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim)
                      for i in range(num_layers)]
            pool = MHAKVPool(num_pages, page_size, hkv, head_dim, num_layers, dtype=dtype,
                             device=device)
            bufs = pool.k_buffers + pool.v_buffers
        for b in bufs:  # noise everywhere, the null page too
            b.copy_(torch.randn(b.shape, generator=g).to(device=device, dtype=b.dtype))
        be = AttentionBackend(cfg, req_pool, pool)
        return cls(arch, cfg, layers, req_pool, alloc, pool, be, g)

    # -- requests -------------------------------------------------------------------------
    def join(self, prefix_len: int) -> int:
        row = self.req_pool.alloc()
        self.alloc.extend(self.req_pool, row, prefix_len)
        self.rows.append(row)
        return row

    def leave(self, row: int) -> None:
        self.rows.remove(row)
        self.alloc.release(self.req_pool, row)

    def q_len(self, mode) -> int:
        mode = ForwardMode.parse(mode)
        return self.config.spec.num_draft_tokens if mode in SPEC_MODES else 1

    def batch(self, mode, rows=None, *, tree_part: bool = False) -> ForwardBatch:
        """Reserve slots for the mode's tokens of every row and build the batch (a tree mask in
        SGLang's full layout, or with ``tree_part`` only its ``[bs, q, q]`` draft part)."""
        mode = ForwardMode.parse(mode)
        rows = list(self.rows if rows is None else rows)
        n = self.q_len(mode)
        locs = [self.alloc.extend(self.req_pool, r, n) for r in rows]
        seq = [self.alloc.tokens_held(r) for r in rows]
        spec = None
        if mode in SPEC_MODES:
            sc = self.config.spec
            mask = None
            if mode == ForwardMode.TARGET_VERIFY and sc.topk > 1:
                mask = self.tree_mask(seq, n)
                if tree_part:
                    mask = full_to_tree_part(mask, seq, n)
            spec = SpecInfo(num_draft_tokens=n, topk=sc.topk, custom_mask=mask)
        dev = self.config.device
        if spec is not None and spec.custom_mask is not None:
            spec.custom_mask = spec.custom_mask.to(dev)
        return ForwardBatch.from_lengths(
            forward_mode=mode, req_pool_indices=rows, seq_lens=seq,
            out_cache_loc=torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64),
            extend_seq_lens=[n] * len(rows), spec_info=spec, device=dev)

    def tree_mask(self, seq_lens, n) -> torch.Tensor:
        """Flat SGLang-layout mask: prefix visible; draft part a random tree (each token sees
        itself and a random subset of earlier drafts)."""
        blocks = []
        idx = torch.arange(n)
        below, diag = idx[:, None] > idx[None, :], idx[:, None] == idx[None, :]
        for L in seq_lens:
            tri = ((torch.rand(n, n, generator=self.gen) < 0.5) & below) | diag
            blk = torch.ones(n, L, dtype=torch.bool)
            blk[:, L - n:] = tri
            blocks.append(blk.reshape(-1))
        return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)

    # -- per-token inputs ---------------------------------------------------------------------
    def token_inputs(self) -> dict:
        """``name → (trailing shape, dtype)`` of every layer's q/k(/v)."""
        out = {}
        for l in self.layers:
            out[f"q{l.layer_id}"] = ((l.num_q_heads * l.head_dim,), self.config.dtype)
            out[f"k{l.layer_id}"] = ((l.num_kv_heads * l.head_dim,), self.config.dtype)
            if self.arch != AttnArch.MLA:
                out[f"v{l.layer_id}"] = ((l.num_kv_heads * l.v_head_dim,), self.config.dtype)
        return out

    def random_inputs(self, batch: ForwardBatch, num_tokens: Optional[int] = None) -> dict:
        """Random token inputs (:meth:`token_inputs`) for ``num_tokens`` rows (default: the
        batch's tokens; multi-step drafting has one row per branch)."""
        n = batch.num_tokens if num_tokens is None else num_tokens
        return {name: torch.randn((n, *shape), generator=self.gen).to(self.config.device, dtype)
                for name, (shape, dtype) in self.token_inputs().items()}

    def step_fn(self):
        """The function a graph captures: every layer's attention on the static batch."""
        be, layers = self.backend, self.layers

        def step(batch, inputs):
            return tuple(be.forward(inputs[f"q{l.layer_id}"], inputs[f"k{l.layer_id}"],
                                    inputs.get(f"v{l.layer_id}"), l, batch)
                         for l in layers)
        return step

    def multistep_step_fn(self, ms):
        """The function a graph captures for ``MultiStepDraftBackend`` ``ms``: per layer, the
        outputs of every draft step concatenated along dim 1."""
        layers = self.layers

        def fn(batch, inputs):
            return tuple(torch.cat([
                ms.forward(i, inputs[f"q{l.layer_id}"], inputs[f"k{l.layer_id}"],
                           inputs.get(f"v{l.layer_id}"), l)
                for i in range(ms.num_passes)], dim=1) for l in layers)
        return fn

    def join_drafting(self, bs: int, max_prefix: int):
        """Join ``bs`` requests (prefix lengths drawn in ``[1, max_prefix)``), reserve the draft
        slots of every branch (``config.spec``), and return ``(rows, batch)``: the DECODE batch
        over their committed lengths that ``MultiStepDraftBackend`` plans from."""
        from aiter_attn.multistep import draft_columns_needed

        rows = [self.join(int(torch.randint(1, max_prefix, (1,), generator=self.gen)))
                for _ in range(bs)]
        committed = [self.alloc.tokens_held(r) for r in rows]
        spec = self.config.spec
        need = draft_columns_needed(torch.tensor(committed), self.config.page_size, spec.topk,
                                    spec.num_steps)
        for r, c, n in zip(rows, committed, need.tolist()):
            self.alloc.extend(self.req_pool, r, n - c)  # the draft slots of every branch
        batch = ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=rows,
                                          seq_lens=committed, device=self.config.device,
                                          out_cache_loc=torch.zeros(bs, dtype=torch.int64))
        return rows, batch

    def eager(self, batch: ForwardBatch, inputs: dict, save_kv_cache: bool = True):
        self.backend.init_forward_metadata(batch)
        return tuple(self.backend.forward(inputs[f"q{l.layer_id}"], inputs[f"k{l.layer_id}"],
                                          inputs.get(f"v{l.layer_id}"), l, batch,
                                          save_kv_cache=save_kv_cache)
                     for l in self.layers)

    def kv_tensors(self) -> list:
        p = self.kv_pool
        if self.arch == AttnArch.MLA:
            return list(p.latent_buffers)
        if self.arch == AttnArch.SWA:
            return p.full.k_buffers + p.full.v_buffers + p.swa.k_buffers + p.swa.v_buffers
        return p.k_buffers + p.v_buffers

    def snapshot(self) -> list:
        return [t.clone() for t in self.kv_tensors()]

    def foreign_writes(self, before: list, batch: ForwardBatch) -> list:
        """``(buffer index, slot)`` written since ``before`` that are neither this batch's
        slots nor the dummy slot 0 (SWA buffers: translated slots)."""
        full = set(batch.out_cache_loc.cpu().tolist()) | {0}
        allowed = [full] * len(before)
        if self.arch == AttnArch.SWA:
            swa = set(self.kv_pool.translate(batch.out_cache_loc).cpu().tolist()) | {0}
            n_full = len(self.kv_pool.full.k_buffers) * 2
            allowed = [full] * n_full + [swa] * (len(before) - n_full)
        bad = []
        for i, (a, b, ok) in enumerate(zip(before, self.kv_tensors(), allowed)):
            fa = a.reshape(a.shape[0] * a.shape[1], -1)
            fb = b.reshape(b.shape[0] * b.shape[1], -1)
            for s in (fa != fb).any(dim=1).nonzero().flatten().cpu().tolist():
                if s not in ok:
                    bad.append((i, s))
        return bad

    def manager(self, **kw):
        from aiter_attn.graph import CudaGraphManager

        kw.setdefault("capture_sizes", [1, 2, 4, 8])
        kw.setdefault("use_cuda_graph", self.config.device != "cpu")
        return CudaGraphManager(self.backend, token_inputs=self.token_inputs(), **kw)


