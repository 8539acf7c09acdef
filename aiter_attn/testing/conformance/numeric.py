"""Inputs and judges of the ops compared with the float64 oracle: the attention ops (with
their log-sum-exp) and ``merge_attention_states``."""

from __future__ import annotations

import torch

from ..oracle import dense_attention
from ._base import Prepared, layout, quantize, same_storage, to, trap_cache
from .cases import ConformanceCase

__all__ = ["attention_inputs", "merge_inputs"]


def merge_inputs(case: ConformanceCase, device, g) -> Prepared:
    """Two partial states over disjoint keys, some rows empty (``lse = -inf``) in one part,
    one row empty in both, with NaN in the empty parts' outputs (never to be read)."""
    T, H, D = sum(case.q_lens), case.num_q_heads, case.head_dim
    o_a, o_b = (torch.randn(T, H, D, generator=g).to(case.dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(T, H, generator=g) * 3 for _ in range(2))
    lse_a[0, :2] = float("-inf")
    lse_b[min(1, T - 1), 1:3] = float("-inf")
    lse_a[T - 1, H - 1] = lse_b[T - 1, H - 1] = float("-inf")
    o_a[torch.isneginf(lse_a)] = float("nan")
    o_b[torch.isneginf(lse_b)] = float("nan")
    m = torch.maximum(lse_a, lse_b).double()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a, w_b = (torch.exp(x.double() - m) for x in (lse_a, lse_b))
    num = (w_a.unsqueeze(-1) * torch.nan_to_num(o_a.double())
           + w_b.unsqueeze(-1) * torch.nan_to_num(o_b.double()))
    den = (w_a + w_b).unsqueeze(-1)
    e_out = torch.where(den > 0, num / torch.where(den > 0, den, 1), 0)
    e_lse = m + torch.log(w_a + w_b)
    t = to(dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b,
                 out=torch.full((T, H, D), float("nan"), dtype=case.dtype),
                 out_lse=torch.full((T, H), float("nan"))), device)

    def invoke(tensors, backend):
        from ... import ops

        return ops.merge_attention_states(tensors["o_a"], tensors["lse_a"], tensors["o_b"],
                                          tensors["lse_b"], tensors["out"], tensors["out_lse"],
                                          backend=backend)

    def judge(tensors, ret):
        out, lse = tensors["out"], tensors["out_lse"]
        if not (isinstance(ret, tuple) and len(ret) == 2 and same_storage(ret[0], out)
                and same_storage(ret[1], lse)):
            return None, "must return (out, out_lse), the buffers it was given"
        err, reason = _rel_check("out", out, e_out, case.bound)
        if reason:
            return err, reason
        return _lse_check(lse, e_lse, case.bound, err)

    return Prepared(t, ("out", "out_lse"), invoke, judge)


def attention_inputs(case: ConformanceCase, device, g, lens) -> Prepared:
    from ...kernels.reference_5d import vec_width
    from ...kernels.reference_extra import kv_5d_from_nhd

    kv_dtype = case.kv_dtype or case.dtype
    ps = case.page_size
    mla = case.op == "mla_paged_attention"
    d, dv = case.head_dim, case.v_head_dim or case.head_dim
    hkv = 1 if mla else case.num_kv_heads
    num_pages, block_table, slots = layout(case, g, lens)
    k_cache = trap_cache(num_pages, ps, hkv, d, kv_dtype, case.k_scale, block_table, lens, g)
    v_cache = None if mla else trap_cache(num_pages, ps, hkv, dv, kv_dtype, case.v_scale,
                                           block_table, lens, g)
    dense_k, dense_v = [], []
    for s in slots:
        kst, kdq = quantize(torch.randn(len(s), hkv, d, generator=g), kv_dtype, case.k_scale)
        k_cache.view(-1, hkv, d)[s] = kst
        dense_k.append(kdq)
        if mla:
            dense_v.append(kdq[..., :dv])
        else:
            vst, vdq = quantize(torch.randn(len(s), hkv, dv, generator=g), kv_dtype,
                                 case.v_scale)
            v_cache.view(-1, hkv, dv)[s] = vst
            dense_v.append(vdq)
    q_scale = 3.0 if case.softcap else 1.0  # push logits into the soft-cap's bend
    q = (torch.randn(sum(case.q_lens), case.num_q_heads, d, generator=g) * q_scale).to(case.dtype)
    t = dict(q=q, cu_seqlens_q=torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()],
                                            dtype=torch.int32),
             seqused_k=torch.tensor(lens, dtype=torch.int32), block_table=block_table,
             out=torch.full((q.shape[0], case.num_q_heads, dv), float("nan"), dtype=case.dtype))
    if case.lse:
        t["out_lse"] = torch.full((q.shape[0], case.num_q_heads), float("nan"))
    masks = None
    if case.custom_mask:
        masks, flat, indptr = [], [], [0]
        for n, L in zip(case.q_lens, case.kv_lens):
            m = torch.rand(n, L, generator=g) < 0.6
            m[torch.arange(n), torch.arange(L - n, L)] = True  # a draft token sees itself
            if case.empty_rows:
                m[0] = False  # this query sees nothing: zeros out, LSE -inf
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
    t = to(t, device)

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
            outs, lses, start = [], [], 0
            for b, n in enumerate(case.q_lens):
                o, lse = dense_attention(
                    qc[start:start + n], dense_k[b], dense_v[b], scale=case.softmax_scale,
                    causal=case.causal, window=tuple(case.window), softcap=case.softcap,
                    sinks=t["sinks"].cpu() if case.sinks else None,
                    mask=None if masks is None else masks[b], return_lse=True)
                outs.append(o)
                lses.append(lse)
                start += n
            expected_cache["e"] = (torch.cat(outs), torch.cat(lses))
        return expected_cache["e"]

    def judge(tensors, ret):
        out, lse = tensors["out"], tensors.get("out_lse")
        if lse is not None:
            if not (isinstance(ret, tuple) and len(ret) == 2):
                return None, (f"returned {type(ret).__name__} for a call with out_lse; a kernel "
                              "asked for the LSE must return (out, lse)")
            if not same_storage(ret[1], lse):
                return None, "returned an LSE tensor that is not `out_lse` (callers read it)"
            ret = ret[0]
        reason = _check_returned(ret, out)
        if reason:
            return None, reason
        e, e_lse = expected()
        err, reason = _rel_check("out", out, e, case.bound)
        if reason or lse is None:
            return err, reason
        return _lse_check(lse, e_lse, case.bound, err)

    outputs = ("out", "out_lse") if case.lse else ("out",)
    return Prepared(t, outputs, invoke, judge)


def _check_returned(ret, out) -> str:
    if same_storage(ret, out):
        return ""
    what = "None" if ret is None else (
        f"a {type(ret).__name__}" if not isinstance(ret, torch.Tensor)
        else "a tensor that is not `out` (callers read `out`)")
    return f"returned {what}; a kernel must write `out` and return it"


def _rel_check(name, actual, expected, bound):
    bad = ~torch.isfinite(actual.float().cpu())
    if bad.any():
        return None, (f"{int(bad.sum())} non-finite values in `{name}` (NaN where the kernel "
                      f"did not write it, or it read a NaN trap slot), first at "
                      f"{bad.nonzero()[0].tolist()}")
    err = float((actual.double().cpu() - expected).norm() / expected.norm().clamp_min(1e-12))
    if not err <= bound:
        return err, f"`{name}`: relative error {err:.2e} > bound {bound:.0e}"
    return err, ""


def _lse_check(lse, expected, bound, err):
    """LSE rows with nothing visible are exactly ``-inf``; the others within ``bound``."""
    a = lse.double().cpu()
    empty = torch.isneginf(expected)
    if not torch.equal(torch.isneginf(a), empty):
        return err, ("`out_lse` is -inf exactly where nothing is visible: "
                     f"{int((torch.isneginf(a) != empty).sum())} rows disagree")
    e2, reason = _rel_check("out_lse", a[~empty], expected[~empty], bound)
    return max(err, e2 or 0.0), reason
