"""Paged batches whose requests share leading pages, for the cascade tests.

A layout is a list of groups; a group is ``(prefix_pages, members)`` with members
``(k, own_len, q_len)``: the member's page-table row starts with the first ``k`` of the
group's ``prefix_pages`` page ids (the same ids for every member), followed by pages of its
own holding ``own_len`` tokens, the last ``q_len`` of which are this step's queries. Pages are
block-permuted over the pool; page 0 is a null page full of noise. ``pad_rows`` appends
CUDA-graph padding rows (every page the null page, one key, one query).
"""

from __future__ import annotations

import torch

from aiter_attn.kernels.reference import paged_attention_reference


class SharedCase:
    def __init__(self, layout, *, hq=8, hkv=2, d=64, page=16, dtype=torch.float32, seed=0,
                 pad_rows=0, device="cpu", extra_width=2):
        g = torch.Generator().manual_seed(seed)
        rows = []  # (page list, kv_len, q_len)
        need = 1
        for prefix_pages, members in layout:
            need += prefix_pages
            for k, own, _ in members:
                need += -(-own // page)
        perm = (torch.randperm(need + 3 - 1, generator=g) + 1).tolist()
        for prefix_pages, members in layout:
            prefix = [perm.pop() for _ in range(prefix_pages)]
            for k, own, q_len in members:
                if not (1 <= q_len <= own or (q_len == 0 and own >= 0)):
                    raise ValueError(f"member {(k, own, q_len)}: q_len must be in 1..own_len")
                own_pages = [perm.pop() for _ in range(-(-own // page))]
                rows.append((prefix[:k] + own_pages, k * page + own, q_len))
        for _ in range(pad_rows):
            rows.append(([], 1, 1))
        total = need + 3
        width = max(len(r[0]) for r in rows) + extra_width
        self.page, self.hq, self.hkv, self.d, self.dtype = page, hq, hkv, d, dtype
        self.k_cache = torch.randn(total, page, hkv, d, generator=g).to(dtype)
        self.v_cache = torch.randn(total, page, hkv, d, generator=g).to(dtype)
        bt = torch.zeros(len(rows), width, dtype=torch.int32)
        for b, (pages, _, _) in enumerate(rows):
            bt[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.block_table = bt
        self.kv_lens = [r[1] for r in rows]
        self.q_lens = [r[2] for r in rows]
        self.seqused_k = torch.tensor(self.kv_lens, dtype=torch.int32)
        self.cu = torch.tensor([0] + torch.tensor(self.q_lens).cumsum(0).tolist(),
                               dtype=torch.int32)
        self.q = torch.randn(int(self.cu[-1]), hq, d, generator=g).to(dtype)
        self.scale = d ** -0.5
        self.device = device

    def to(self, device):
        for name in ("k_cache", "v_cache", "block_table", "seqused_k", "cu", "q"):
            setattr(self, name, getattr(self, name).to(device))
        self.device = device
        return self

    def args(self):
        return dict(cu_seqlens_q=self.cu, seqused_k=self.seqused_k,
                    block_table=self.block_table, softmax_scale=self.scale)

    def oracle(self, *, window_size=(-1, -1), softcap=0.0, sinks=None, lse=False):
        """The ordinary paged attention over the full table, in float32 (and its LSE)."""
        out = torch.empty(self.q.shape[0], self.hq, self.d, dtype=torch.float32,
                          device=self.q.device)
        l = torch.empty(self.q.shape[0], self.hq, dtype=torch.float32, device=self.q.device)
        paged_attention_reference(
            self.q.float(), self.k_cache.float(), self.v_cache.float(), out, **self.args(),
            window_size=window_size, softcap=softcap, sinks=sinks, lse=l)
        return (out, l) if lse else out
