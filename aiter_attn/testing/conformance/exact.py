"""Inputs and judges of the ops compared byte for byte with their torch reference: the KV
writes (untouched slots included) and the index builders."""

from __future__ import annotations

from typing import Optional

import torch

from ._base import SENTINEL, Prepared, layout, to, trap_cache
from .cases import ConformanceCase

__all__ = ["write_inputs", "index_inputs"]


def _exact_judge(expected: dict, regions: Optional[dict] = None):
    """Judge comparing each named tensor with its expectation byte for byte (``regions``:
    name → number of leading elements that count)."""
    regions = regions or {}

    def judge(tensors, ret):
        for name, want in expected.items():
            got = tensors[name].detach().cpu()
            n = regions.get(name)
            g_, w_ = (got, want) if n is None else (got.reshape(-1)[:n], want.reshape(-1)[:n])
            if not torch.equal(_bytes(g_), _bytes(w_)):
                diff = (_bytes(g_) != _bytes(w_)).reshape(-1).nonzero()
                return None, (f"`{name}` differs from the reference at {diff.numel()} bytes, "
                              f"first at flat byte {int(diff[0])}")
        return 0.0, ""

    return judge


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def _fp8_grid(shape, dtype, scale, g) -> torch.Tensor:
    """Values that quantise exactly (``fp8 value · scale``): no rounding mode to argue about;
    the first and last elements are 4× past the format's range (a writer saturates them to
    ±max, never NaN)."""
    x = torch.randn(*shape, generator=g).to(dtype).float() * scale
    flat = x.view(-1)
    big = 4 * torch.finfo(dtype).max * scale
    flat[0], flat[-1] = big, -big
    return x


def write_inputs(case: ConformanceCase, device, g, lens) -> Prepared:
    from ...kernels import reference as R
    from ...kernels import reference_extra as RE
    from ...kernels.reference_5d import vec_width
    from ...types import FP8_DTYPES

    kv_dtype = case.kv_dtype or case.dtype
    ps, h, d = case.page_size, case.num_kv_heads, case.head_dim
    dv = case.head_dim if case.v_head_dim is None else case.v_head_dim
    num_pages, block_table, slots = layout(case, g, lens)
    new = torch.cat([s[L - n:] for s, n, L in zip(slots, case.q_lens, lens)])
    skips = case.op != "write_kv"  # these ops skip negative slots (graph padding rows)
    if skips:
        new = torch.cat([new[:1], torch.tensor([-1]), new[1:]])
    fp8 = kv_dtype in FP8_DTYPES

    def values(dim, scale):
        if fp8:
            return _fp8_grid((new.shape[0], h, dim), kv_dtype, scale, g).to(case.dtype)
        return torch.randn(new.shape[0], h, dim, generator=g).to(case.dtype)

    k = values(d, case.k_scale)
    v = values(dv, case.v_scale) if dv else None
    t = dict(slots=new, k=k)
    if v is not None:
        t["v"] = v
    if fp8:
        t.update(k_scale=torch.tensor(case.k_scale), v_scale=torch.tensor(case.v_scale))
    pool_pages = num_pages
    if case.op == "write_kv_swa":
        # the SWA pool is smaller and page-granularly mapped; unmapped full pages map to -1
        pool_pages = num_pages + 2
        swa_page = torch.randperm(pool_pages - 1, generator=g)[:num_pages] + 1
        swa_page[0] = 0
        slot = torch.arange(num_pages * ps)
        f2s = swa_page[slot // ps] * ps + slot % ps
        f2s[:ps] = -1
        t["full_to_swa"] = f2s
    k_cache = trap_cache(pool_pages, ps, h, d, kv_dtype, case.k_scale, block_table, lens, g)
    v_cache = (trap_cache(pool_pages, ps, h, dv, kv_dtype, case.v_scale, block_table, lens, g)
               if dv else None)
    if case.op == "write_kv_5d":
        k_cache, v_cache = RE.kv_5d_from_nhd(k_cache, v_cache, vec_width(kv_dtype),
                                             v_shuffled=case.v_layout == "shuffled")
    t["k_cache"] = k_cache
    if v_cache is not None:
        t["v_cache"] = v_cache
    want = {"k_cache": k_cache.clone()}
    if v_cache is not None:
        want["v_cache"] = v_cache.clone()
    ref = {"write_kv": R.write_kv_reference, "write_kv_swa": RE.write_kv_translated_reference,
           "write_kv_5d": RE.write_kv_5d_reference}[case.op]
    extra = {"full_to_swa": t["full_to_swa"]} if case.op == "write_kv_swa" else {}
    ref(want["k_cache"], want.get("v_cache"), new, k, v, k_scale=t.get("k_scale"),
        v_scale=t.get("v_scale"), **extra)
    t = to(t, device)

    def invoke(tensors, backend):
        from ... import ops

        kw = dict(tensors)
        args = (kw.pop("k_cache"), kw.pop("v_cache", None), kw.pop("slots"), kw.pop("k"),
                kw.pop("v", None))
        if case.op == "write_kv":
            return ops.write_kv(*args, backend=backend, **kw)
        if case.op == "write_kv_5d":
            from ...strategies.vec5d import write_kv_5d

            return write_kv_5d(*args, backend=backend, **kw)
        return _write_kv_swa(*args, backend=backend, **kw)

    return Prepared(t, tuple(want), invoke, _exact_judge(want))


def _write_kv_swa(k_cache, v_cache, slots, k, v, *, full_to_swa, k_scale=None, v_scale=None,
                  backend=None):
    """Op ``write_kv_swa`` through the registry, with the request the SWA strategy builds."""
    from ...kernels.registry import KernelRequest
    from ...plugins import kernel_registry
    from ...types import FP8_DTYPES

    req = KernelRequest(op="write_kv_swa", device=k_cache.device.type, dtype=k.dtype,
                        kv_dtype=k_cache.dtype, head_dim=k_cache.shape[3],
                        page_size=k_cache.shape[1],
                        features={"fp8"} if k_cache.dtype in FP8_DTYPES else ())
    return kernel_registry().select(req, backend=backend).fn(
        k_cache, v_cache, slots, k, v, full_to_swa=full_to_swa, k_scale=k_scale,
        v_scale=v_scale)


def _req_to_token(case: ConformanceCase, g, cols: int):
    """``req_to_token`` int32 ``[bs + 2, cols]`` (request rows permuted among garbage rows,
    distinct block-permuted pages per row) and ``req_pool_indices`` int64 ``[bs]``."""
    ps, bs = case.page_size, len(case.kv_lens)
    rows = bs + 2
    per_row = -(-cols // ps)
    pages = torch.randperm(rows * per_row + 1, generator=g)[: rows * per_row] + 1
    r2t = (pages.view(rows, per_row).repeat_interleave(ps, 1) * ps
           + torch.arange(ps).repeat(per_row)).to(torch.int32)[:, :cols].contiguous()
    rpi = torch.randperm(rows, generator=g)[:bs]
    return r2t, rpi, (rows * per_row + 2) * ps


def index_inputs(case: ConformanceCase, device, g, lens) -> Prepared:
    from ...kernels import reference as R
    from ...kernels import reference_extra as RE

    ps, bs = case.page_size, len(case.kv_lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    def full(shape, dtype):
        return torch.full(shape, SENTINEL, dtype=dtype)

    op, regions = case.op, {}
    if op == "build_draft_decode_indices":
        from ...multistep import draft_columns_needed

        cols = int(draft_columns_needed(torch.tensor(case.kv_lens), ps, case.topk,
                                        case.num_steps).max()) + ps
    else:
        cols = max(case.kv_lens) + 2 * ps
    r2t, rpi, slots = _req_to_token(case, g, cols)
    width = -(-max(case.kv_lens) // ps) + 1
    t = dict(req_to_token=r2t, req_pool_indices=rpi, seq_lens=seq_lens)
    if op == "build_page_table":
        t["out"] = full((bs, width), torch.int32)
        outputs = ("out",)
    elif op == "build_page_tables_swa":
        swa_page = torch.randperm(slots // ps + 1, generator=g)[: slots // ps] + 1
        swa_page[torch.rand(swa_page.shape, generator=g) < 0.2] = 0  # freed SWA pages
        slot = torch.arange(slots)
        f2s = swa_page[slot // ps] * ps + slot % ps
        f2s[:ps] = 0
        t.update(full_to_swa=f2s, out=full((bs, width), torch.int32),
                 out_swa=full((bs, width), torch.int32))
        outputs = ("out", "out_swa")
    elif op == "build_ragged_kv_indices":
        total = sum(case.kv_lens)
        t.update(kv_indptr=full((bs + 1,), torch.int32), kv_indices=full((total + 5,),
                                                                         torch.int32))
        outputs, regions = ("kv_indptr", "kv_indices"), {"kv_indices": total}
    elif op == "build_tree_mask":
        q = case.q_len
        tree = torch.rand(bs, q, q, generator=g) < 0.5
        tree[:, torch.arange(q), torch.arange(q)] = True
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64),
                            torch.cumsum(seq_lens.long() * q, 0)])
        total = int(indptr[-1])
        out = torch.rand(total + 7, generator=g) < 0.5
        t = dict(seq_lens=seq_lens, tree=tree, mask_indptr=indptr, out=out)
        outputs, regions = ("out",), {"out": total}
    else:  # build_draft_decode_indices
        rows, steps = bs * case.topk, case.num_steps - 1
        width = -(-(max(case.kv_lens) + case.num_steps) // ps) + 1
        t.update(cu_seqlens_q=full((rows + 1,), torch.int32),
                 draft_req_pool_indices=full((rows,), torch.int64),
                 seqused_k=full((steps, rows), torch.int32),
                 positions=full((steps, rows), torch.int64),
                 out_cache_loc=full((steps, rows), torch.int64),
                 block_table=full((steps, rows, width), torch.int32))
        outputs = ("cu_seqlens_q", "draft_req_pool_indices", "seqused_k", "positions",
                   "out_cache_loc", "block_table")
    want = {n: t[n].clone() for n in outputs}
    _call_index(op, case, {**t, **want}, reference=(R, RE))
    t = to(t, device)

    def invoke(tensors, backend):
        return _call_index(op, case, tensors, backend=backend)

    return Prepared(t, outputs, invoke, _exact_judge(want, regions))


def _call_index(op, case, t, *, backend=None, reference=None):
    """Call index op ``op`` on the tensors ``t`` through ``aiter_attn.ops`` (or, with
    ``reference=(reference, reference_extra)``, its torch reference directly)."""
    from ... import ops

    ps = case.page_size
    if reference is not None:
        R, RE = reference
        fns = {"build_page_table": R.build_page_table_reference,
               "build_page_tables_swa": R.build_page_tables_swa_reference,
               "build_ragged_kv_indices": R.build_ragged_kv_indices_reference,
               "build_tree_mask": RE.build_tree_mask_reference,
               "build_draft_decode_indices": RE.build_draft_decode_indices_reference}
        fn, kw = fns[op], {}
    else:
        fn, kw = getattr(ops, op), {"backend": backend}
    common = (t.get("req_to_token"), t.get("req_pool_indices"), t["seq_lens"])
    if op == "build_page_table":
        return fn(*common, ps, t["out"], **kw)
    if op == "build_page_tables_swa":
        return fn(*common, ps, t["full_to_swa"], t["out"], t["out_swa"], **kw)
    if op == "build_ragged_kv_indices":
        return fn(*common, t["kv_indptr"], t["kv_indices"], sum(case.kv_lens), **kw)
    if op == "build_tree_mask":
        total = case.q_len * sum(case.kv_lens)
        return fn(t["seq_lens"], t["tree"], case.q_len, t["mask_indptr"], t["out"], total,
                  **kw)
    return fn(*common, ps, case.topk, case.num_steps, t["cu_seqlens_q"],
              t["draft_req_pool_indices"], t["seqused_k"], t["positions"], t["out_cache_loc"],
              t["block_table"], **kw)
