"""Random inputs of a conformance case, and what a correct kernel must produce from them.

:func:`prepare` returns a :class:`Prepared`: every tensor argument of the call by name, the
names the op may write (``out``; a KV write's caches; an index builder's outputs), a
function that calls the op through :mod:`aiter_attn.ops` with a forced backend, and a judge
that compares what the call left in those tensors with the expectation.

Traps for kernels that read where they must not: pages are a random permutation of
``1..num_pages-1``; the null page 0 and every slot of a request's last page past its length
hold NaN; pages no request owns hold large noise. Output buffers start as NaN (attention)
or a sentinel integer (index builders), so a kernel that leaves part of its output unwritten
fails.
"""

from __future__ import annotations

from typing import Callable, Optional

import attrs
import torch

from ..oracle import dense_attention
from .cases import ATTENTION_OPS, WRITE_OPS, ConformanceCase

__all__ = ["Prepared", "prepare", "SENTINEL"]

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


def _gen(case: ConformanceCase, variant: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + case.seed + 7919 * variant
                                         + sum(map(ord, case.name)))


def _lens(case: ConformanceCase, variant: int) -> tuple:
    """KV lengths of a variant: the second run of a graph-capturable kernel sees shorter
    requests in the same buffers (each still on as many pages, so every shape is the same)
    where no host-side size depends on them."""
    fixed = case.custom_mask or case.op in ("build_ragged_kv_indices", "build_tree_mask")
    if variant == 0 or fixed:
        return case.kv_lens
    ps = case.page_size
    return tuple(max(n, ((L - 1) // ps) * ps + 1) for n, L in zip(case.q_lens, case.kv_lens))


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: float):
    """(stored, dequantised float32) for a cache dtype; fp8 divides by ``scale`` and saturates."""
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        stored = x.to(dtype)
        return stored, stored.float()
    fmax = torch.finfo(dtype).max
    stored = (x / scale).clamp(-fmax, fmax).to(dtype)
    return stored, stored.float() * scale


def _layout(case: ConformanceCase, g: torch.Generator, lens: tuple):
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


def _trap_cache(num_pages, ps, heads, dim, dtype, scale, block_table, kv_lens, g):
    """A cache of noise with NaN in the null page and past each request's length in its
    last page (where a correct kernel never reads)."""
    raw = torch.randn(num_pages, ps, heads, dim, generator=g) * 3
    raw[0] = float("nan")
    for b, L in enumerate(kv_lens):
        if L % ps:
            raw[int(block_table[b, (L - 1) // ps]), L % ps:] = float("nan")
    return _quantize(raw, dtype, scale)[0]


def _to(tensors: dict, device) -> dict:
    return {k: v.to(device) for k, v in tensors.items()}


def _same_storage(ret, out) -> bool:
    return isinstance(ret, torch.Tensor) and (
        ret is out or (ret.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
                       and ret.shape == out.shape))


def _attention(case: ConformanceCase, device, g, lens) -> Prepared:
    from ...kernels.reference_5d import vec_width
    from ...kernels.reference_extra import kv_5d_from_nhd

    kv_dtype = case.kv_dtype or case.dtype
    ps = case.page_size
    mla = case.op == "mla_paged_attention"
    d, dv = case.head_dim, case.v_head_dim or case.head_dim
    hkv = 1 if mla else case.num_kv_heads
    num_pages, block_table, slots = _layout(case, g, lens)
    k_cache = _trap_cache(num_pages, ps, hkv, d, kv_dtype, case.k_scale, block_table, lens, g)
    v_cache = None if mla else _trap_cache(num_pages, ps, hkv, dv, kv_dtype, case.v_scale,
                                           block_table, lens, g)
    dense_k, dense_v = [], []
    for s in slots:
        kst, kdq = _quantize(torch.randn(len(s), hkv, d, generator=g), kv_dtype, case.k_scale)
        k_cache.view(-1, hkv, d)[s] = kst
        dense_k.append(kdq)
        if mla:
            dense_v.append(kdq[..., :dv])
        else:
            vst, vdq = _quantize(torch.randn(len(s), hkv, dv, generator=g), kv_dtype,
                                 case.v_scale)
            v_cache.view(-1, hkv, dv)[s] = vst
            dense_v.append(vdq)
    q_scale = 3.0 if case.softcap else 1.0  # push logits into the soft-cap's bend
    q = (torch.randn(sum(case.q_lens), case.num_q_heads, d, generator=g) * q_scale).to(case.dtype)
    t = dict(q=q, cu_seqlens_q=torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()],
                                            dtype=torch.int32),
             seqused_k=torch.tensor(lens, dtype=torch.int32), block_table=block_table,
             out=torch.full((q.shape[0], case.num_q_heads, dv), float("nan"), dtype=case.dtype))
    masks = None
    if case.custom_mask:
        masks, flat, indptr = [], [], [0]
        for n, L in zip(case.q_lens, case.kv_lens):
            m = torch.rand(n, L, generator=g) < 0.6
            m[torch.arange(n), torch.arange(L - n, L)] = True  # a draft token sees itself
            masks.append(m)
            flat.append(m.reshape(-1))
            indptr.append(indptr[-1] + n * L)
        t.update(custom_mask=torch.cat(flat), mask_indptr=torch.tensor(indptr))
    if case.sinks:
        t["sinks"] = torch.randn(case.num_q_heads, generator=g).float() + 1.0
    fp8 = kv_dtype != case.dtype
    if mla:
        t["kv_cache"] = k_cache
        if fp8:
            t["kv_scale"] = torch.tensor(case.k_scale)
    else:
        if case.op == "paged_attention_5d":
            k_cache, v_cache = kv_5d_from_nhd(k_cache, v_cache, vec_width(kv_dtype),
                                              v_shuffled=case.v_layout == "shuffled")
        t.update(k_cache=k_cache, v_cache=v_cache)
        if fp8:
            t.update(k_scale=torch.tensor(case.k_scale), v_scale=torch.tensor(case.v_scale))
    scalars = dict(softmax_scale=case.softmax_scale, causal=case.causal,
                   max_seqlen_q=max(case.q_lens), max_seqlen_k=max(case.kv_lens))
    if not mla:
        if tuple(case.window) != (-1, -1):
            scalars["window_size"] = tuple(case.window)
        if case.softcap:
            scalars["softcap"] = case.softcap
    t = _to(t, device)

    def invoke(tensors, backend):
        from ... import ops

        kw = dict(tensors)
        if case.op == "mla_paged_attention":
            q_, kv = kw.pop("q"), kw.pop("kv_cache")
            return ops.mla_paged_attention(q_, kv, kv_lora_rank=dv, backend=backend, **kw,
                                           **scalars)
        q_, kc, vc = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache")
        if case.op == "paged_attention_5d":
            from ...strategies.vec5d import paged_attention_5d

            return paged_attention_5d(q_, kc, vc, backend=backend, **kw, **scalars)
        return ops.paged_attention(q_, kc, vc, backend=backend, **kw, **scalars)

    expected_cache = {}

    def expected():
        if "e" not in expected_cache:
            qc = t["q"].cpu()
            outs, start = [], 0
            for b, n in enumerate(case.q_lens):
                outs.append(dense_attention(
                    qc[start:start + n], dense_k[b], dense_v[b], scale=case.softmax_scale,
                    causal=case.causal, window=tuple(case.window), softcap=case.softcap,
                    sinks=t["sinks"].cpu() if case.sinks else None,
                    mask=None if masks is None else masks[b]))
                start += n
            expected_cache["e"] = torch.cat(outs)
        return expected_cache["e"]

    def judge(tensors, ret):
        out = tensors["out"]
        if not _same_storage(ret, out):
            what = "None" if ret is None else (
                f"a {type(ret).__name__}" if not isinstance(ret, torch.Tensor)
                else "a tensor that is not `out` (callers read `out`)")
            return None, f"returned {what}; a kernel must write `out` and return it"
        bad = ~torch.isfinite(out.float().cpu())
        if bad.any():
            return None, (f"{int(bad.sum())} non-finite values in `out` (NaN where the kernel "
                          f"did not write it, or it read a NaN trap slot), first at "
                          f"{bad.nonzero()[0].tolist()}")
        e = expected()
        err = float((out.double().cpu() - e).norm() / e.norm().clamp_min(1e-12))
        if not err <= case.bound:
            return err, f"relative error {err:.2e} > bound {case.bound:.0e}"
        return err, ""

    return Prepared(t, ("out",), invoke, judge)


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
    """Values that quantise exactly (``fp8 value · scale``): no rounding mode to argue about."""
    return torch.randn(*shape, generator=g).to(dtype).float() * scale


def _write(case: ConformanceCase, device, g, lens) -> Prepared:
    from ...kernels import reference as R
    from ...kernels import reference_extra as RE
    from ...kernels.reference_5d import vec_width
    from ...types import FP8_DTYPES

    kv_dtype = case.kv_dtype or case.dtype
    ps, h, d = case.page_size, case.num_kv_heads, case.head_dim
    dv = case.head_dim if case.v_head_dim is None else case.v_head_dim
    num_pages, block_table, slots = _layout(case, g, lens)
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
    k_cache = _trap_cache(pool_pages, ps, h, d, kv_dtype, case.k_scale, block_table, lens, g)
    v_cache = (_trap_cache(pool_pages, ps, h, dv, kv_dtype, case.v_scale, block_table, lens, g)
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
    t = _to(t, device)

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


def _index(case: ConformanceCase, device, g, lens) -> Prepared:
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
    t = _to(t, device)

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


def prepare(case: ConformanceCase, device="cpu", variant: int = 0) -> Prepared:
    """The inputs of ``case`` on ``device``; ``variant`` draws other values of the same shapes
    (for the second run of a graph-capturable kernel)."""
    g, lens = _gen(case, variant), _lens(case, variant)
    if case.op in ATTENTION_OPS:
        return _attention(case, device, g, lens)
    if case.op in WRITE_OPS:
        return _write(case, device, g, lens)
    return _index(case, device, g, lens)
