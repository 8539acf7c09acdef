"""Deliberately broken kernels: the conformance suite's self-test.

Each :class:`Mutant` is a kernel with one realistic bug (a kernel that never writes ``out``,
that ignores ``softmax_scale``, that scribbles on the KV cache, …), registered under the
backend name ``mutant-<bug>`` at a priority no automatic selection ever reaches. ``aiter-attn
verify --backend mutant-<bug>`` must fail, naming the cases that catch it, and ``aiter-attn
verify --self-test`` runs them all. This module is also a plugin (the hook below), so a
throwaway plugin can register the mutants the way a vendor registers kernels.

Every mutant wraps the op's torch reference, so the one bug is the only difference.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from ...hookspecs import hookimpl
from ...kernels import reference as R
from ...kernels import reference_extra as RE
from ...kernels.base import (AttentionKernel, FunctionPlan, MLAKernel, mask_literal,
                             plan_hints)
from ...kernels.reference_5d import paged_attention_5d_reference
from ...kernels.registry import FEATURES, Capabilities
from ...types import CGSupport

__all__ = ["Mutant", "MUTANTS", "PRIORITY", "register_mutants", "self_test",
           "aiter_attn_register_kernels"]

#: far below every real kernel (the references are 0): never chosen automatically.
PRIORITY = -1000


@attrs.frozen
class Mutant:
    """One broken kernel: backend ``name`` of ``op``; ``catches``: cases that must fail it."""

    name: str
    op: str
    fn: Callable = attrs.field(eq=False)
    bug: str
    catches: tuple
    cg_support: CGSupport = CGSupport.NEVER


def _no_out(q, k, v, out, **kw):
    return R.paged_attention_reference(q, k, v, torch.empty_like(out), **kw)


def _ignores_scale(q, k, v, out, **kw):
    kw["softmax_scale"] = q.shape[-1] ** -0.5
    return R.paged_attention_reference(q, k, v, out, **kw)


def _writes_kv_cache(q, k, v, out, **kw):
    R.paged_attention_reference(q, k, v, out, **kw)
    k[0].zero_()  # "scratch space" in the null page
    return out


def _gqa_tiled(q, k, v, out, **kw):
    g = q.shape[1] // k.shape[2]  # query head h reads KV head h % Hkv instead of h // g
    return R.paged_attention_reference(q, k.repeat(1, 1, g, 1), v.repeat(1, 1, g, 1), out, **kw)


def _window_off_by_one(q, k, v, out, **kw):
    left, right = kw["window_size"]
    kw["window_size"] = (left + 1 if left >= 0 else left, right)
    return R.paged_attention_reference(q, k, v, out, **kw)


def _reads_past_seqused_k(q, k, v, out, **kw):
    """Loads the whole last page (or the next table entry) and multiplies the masked lanes
    by zero, which keeps NaN: 0 · NaN = NaN."""
    R.paged_attention_reference(q, k, v, out, **kw)
    ps, cu, bt = k.shape[1], kw["cu_seqlens_q"].tolist(), kw["block_table"]
    for b, L in enumerate(kw["seqused_k"].tolist()):
        n = -(-L // ps)
        tail = v[int(bt[b, n - 1]), L - (n - 1) * ps:] if L % ps else v[int(bt[b, n])]
        out[cu[b]:cu[b + 1]] += (tail.float() * 0).sum().to(out.dtype)
    return out


def _nan_on_empty_rows(q, k, v, out, **kw):
    """Normalises by the row's exp-sum without guarding zero: NaN (0/0) where a row sees no
    key, instead of zeros (and its LSE)."""
    lse = kw.pop("lse", None)
    row_lse = torch.empty(out.shape[:2], dtype=torch.float32, device=out.device)
    R.paged_attention_reference(q, k, v, out, lse=row_lse, **kw)
    empty = torch.isneginf(row_lse)
    out[empty] = float("nan")
    if lse is not None:
        lse.copy_(torch.where(empty, torch.full_like(row_lse, float("nan")), row_lse))
    return out


def _one_sided_window(q, k, v, out, **kw):
    """Applies only the window's left edge: a non-causal query sees every key to its right."""
    kw["window_size"] = (kw["window_size"][0], -1)
    return paged_attention_5d_reference(q, k, v, out, **kw)


def _empty_rows_drop_sink(q, k, v, out, **kw):
    """Guards rows that see no key with ``lse = -inf`` before the sink is added: such a row's
    LSE must be the sink's logit."""
    lse = kw.get("lse")
    R.paged_attention_reference(q, k, v, out, **kw)
    if lse is not None and kw.get("sinks") is not None:
        no_sink = torch.empty_like(lse)
        R.paged_attention_reference(q, k, v, torch.empty_like(out), **{**kw, "sinks": None,
                                                                        "lse": no_sink})
        lse[torch.isneginf(no_sink)] = float("-inf")
    return out


def _clobber_zero_length(out, cu_seqlens_q):
    """One program per request writes row ``cu_seqlens_q[b]`` even where request ``b`` has no
    query: the zeros of its empty softmax land on the next request's first row."""
    cu = cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        if cu[b] == cu[b + 1] < out.shape[0]:
            out[cu[b]] = 0


def _zero_length_clobbers(q, k, v, out, **kw):
    R.paged_attention_reference(q, k, v, out, **kw)
    _clobber_zero_length(out, kw["cu_seqlens_q"])
    return out


def _mla_zero_length_clobbers(q, kv, out, **kw):
    R.mla_paged_attention_reference(q, kv, out, **kw)
    _clobber_zero_length(out, kw["cu_seqlens_q"])
    return out


def _nan_on_empty_rows_of(ref):
    """:func:`_nan_on_empty_rows` for another reference (q and the caches, then ``out``)."""

    def fn(*args, **kw):
        *inputs, out = args
        lse = kw.pop("lse", None)
        row_lse = torch.empty(out.shape[:2], dtype=torch.float32, device=out.device)
        ref(*inputs, out, lse=row_lse, **kw)
        empty = torch.isneginf(row_lse)
        out[empty] = float("nan")
        if lse is not None:
            lse.copy_(row_lse)
        return out

    return fn


_HOST_LENS: dict = {}


def _stale_on_replay(q, k, v, out, **kw):
    """Keeps the lengths it saw first per buffer (as if planned once at capture)."""
    key = (kw["seqused_k"].data_ptr(), q.data_ptr(), out.data_ptr())
    kw["seqused_k"] = _HOST_LENS.setdefault(key, kw["seqused_k"].clone())
    return R.paged_attention_reference(q, k, v, out, **kw)


def _lse_log2(q, k, v, out, **kw):
    """Returns the LSE in base 2 (what an exp2-based kernel keeps internally)."""
    res = R.paged_attention_reference(q, k, v, out, **kw)
    if kw.get("lse") is not None:
        kw["lse"].mul_(1.4426950408889634)  # log2(e)
    return res


def _merge_nan_on_empty(o_a, lse_a, o_b, lse_b, out, out_lse):
    """The textbook formula: NaN where both parts are empty, and reads the empty part's o."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    out.copy_(((w_a.unsqueeze(-1) * o_a.float() + w_b.unsqueeze(-1) * o_b.float())
               / (w_a + w_b).unsqueeze(-1)).to(out.dtype))
    out_lse.copy_(m + torch.log(w_a + w_b))
    return out, out_lse


class _PlanCopiesLengths(AttentionKernel):
    """A kernel object whose plan keeps a private copy of ``seqused_k`` instead of reading
    the metadata's tensor (or placing its copy in the static buffers): after a re-plan, the
    captured run still sees the capture's lengths."""

    def plan(self, md, out=None):
        mq, mk = plan_hints(md)
        mask = md.mask
        return FunctionPlan(
            num_tokens=md.query.num_tokens, mask_literal=mask_literal(md),
            cu_seqlens_q=md.query.cu_seqlens_q, seqused_k=md.pages.seqused_k.clone(),
            block_table=md.pages.block_table,
            custom_mask=None if mask is None else mask.custom_mask,
            mask_indptr=None if mask is None else mask.mask_indptr,
            max_seqlen_q=mq, max_seqlen_k=mk)

    def run(self, q, cache, plan, params, out, lse=None):
        extra = {} if lse is None else {"lse": lse}
        return R.paged_attention_reference(
            q, *cache, out, cu_seqlens_q=plan.cu_seqlens_q, seqused_k=plan.seqused_k,
            block_table=plan.block_table, softmax_scale=params.scale,
            causal=params.causal and not plan.mask_literal, window_size=params.window,
            softcap=params.softcap, sinks=params.sinks, k_scale=params.k_scale,
            v_scale=params.v_scale, custom_mask=plan.custom_mask,
            mask_indptr=plan.mask_indptr, **extra)


class _MLAPlanCopiesLengths(MLAKernel):
    """The MLA kernel object with the same bug as :class:`_PlanCopiesLengths`: its plan keeps
    a private copy of ``seqused_k``, so a replay after a re-plan reads the capture's lengths."""

    def plan(self, md, out=None):
        mq, mk = plan_hints(md)
        return FunctionPlan(
            num_tokens=md.query.num_tokens, mask_literal=mask_literal(md),
            cu_seqlens_q=md.query.cu_seqlens_q, seqused_k=md.pages.seqused_k.clone(),
            block_table=md.pages.block_table, max_seqlen_q=mq, max_seqlen_k=mk)

    def run(self, q, cache, plan, params, out, lse=None):
        extra = {} if lse is None else {"lse": lse}
        return R.mla_paged_attention_reference(
            q, cache[0], out, kv_lora_rank=out.shape[-1], cu_seqlens_q=plan.cu_seqlens_q,
            seqused_k=plan.seqused_k, block_table=plan.block_table, softmax_scale=params.scale,
            causal=params.causal and not plan.mask_literal,
            kv_scale=params.k_scale if params.has_scales else None, **extra)


def _mla_ignores_scale(q, kv, out, **kw):
    kw["softmax_scale"] = q.shape[-1] ** -0.5
    return R.mla_paged_attention_reference(q, kv, out, **kw)


def _5d_ignores_scale(q, k, v, out, **kw):
    kw["softmax_scale"] = q.shape[-1] ** -0.5
    return paged_attention_5d_reference(q, k, v, out, **kw)


def _write_kv_null_page(k_cache, v_cache, slots, k, v, **kw):
    R.write_kv_reference(k_cache, v_cache, slots, k, v, **kw)
    k_cache[0].zero_()


def _write_kv_unscaled_fp8(k_cache, v_cache, slots, k, v, **kw):
    """Declares fp8 but casts the values without dividing by k_scale / v_scale."""
    kw["k_scale"] = kw["v_scale"] = None
    R.write_kv_reference(k_cache, v_cache, slots, k, v, **kw)


def _write_kv_fp8_overflow_nan(k_cache, v_cache, slots, k, v, *, k_scale=None,
                               v_scale=None, **kw):
    """fp8 without saturation: a value past the format's range is stored as NaN (what a
    plain e4m3fn conversion of an out-of-range value gives in hardware without ``satfinite``)."""
    R.write_kv_reference(k_cache, v_cache, slots, k, v, k_scale=k_scale, v_scale=v_scale,
                         **kw)
    for cache, x, s in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        if cache is None or x is None:
            continue
        over = (x.float() / float(s)).abs() > torch.finfo(cache.dtype).max
        rows = cache.view(-1, *cache.shape[2:])
        for i in over.reshape(over.shape[0], -1).any(-1).nonzero().flatten().tolist():
            slot = int(slots[i])
            row = rows[slot].float()
            row[over[i].view(row.shape)] = float("nan")
            rows[slot] = row.to(cache.dtype)


def _write_kv_swa_untranslated(k_cache, v_cache, slots, k, v, *, full_to_swa, **kw):
    keep = slots >= 0
    R.write_kv_reference(k_cache, v_cache, slots[keep], k[keep], v[keep], **kw)


def _write_kv_5d_k_only(k_cache, v_cache, slots, k, v, **kw):
    RE.write_kv_5d_reference(k_cache, v_cache.clone(), slots, k, v, **kw)


def _page_table_min_one_page(req_to_token, req_pool_indices, seq_lens, page_size, out):
    """Takes ``max(1, ceil(seq_len / page_size))`` pages: an empty request gets its first
    ``req_to_token`` page instead of the null page."""
    return R.build_page_table_reference(req_to_token, req_pool_indices, seq_lens.clamp_min(1),
                                        page_size, out)


def _page_table_no_zero(req_to_token, req_pool_indices, seq_lens, page_size, out):
    before = out.clone()
    R.build_page_table_reference(req_to_token, req_pool_indices, seq_lens, page_size, out)
    n_pages = (seq_lens.long() + page_size - 1) // page_size
    past = torch.arange(out.shape[1], device=out.device).unsqueeze(0) >= n_pages.unsqueeze(1)
    out[past] = before[past]  # leaves stale entries where the null page belongs
    return out


def _swa_tables_untranslated(req_to_token, req_pool_indices, seq_lens, page_size, full_to_swa,
                             out, out_swa):
    R.build_page_table_reference(req_to_token, req_pool_indices, seq_lens, page_size, out)
    out_swa.copy_(out)
    return out


def _ragged_shifted(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, total):
    R.build_ragged_kv_indices_reference(req_to_token, req_pool_indices, seq_lens, kv_indptr,
                                        kv_indices, total)
    kv_indices[:total] = kv_indices[:total].roll(1)
    return kv_indptr, kv_indices


def _tree_mask_transposed(seq_lens, tree, q_len, mask_indptr, out, total):
    flat = tree.reshape(-1, q_len, q_len).transpose(1, 2).contiguous()
    return RE.build_tree_mask_reference(seq_lens, flat, q_len, mask_indptr, out, total)


def _draft_positions(req_to_token, req_pool_indices, seq_lens, page_size, topk, num_steps,
                     cu_seqlens_q, draft_req_pool_indices, seqused_k, positions, out_cache_loc,
                     block_table):
    RE.build_draft_decode_indices_reference(
        req_to_token, req_pool_indices, seq_lens, page_size, topk, num_steps, cu_seqlens_q,
        draft_req_pool_indices, seqused_k, positions, out_cache_loc, block_table)
    positions.copy_(seqused_k)  # the new token's position is seqused_k - 1


M = Mutant
#: every mutant and the cases that must fail it.
MUTANTS = (
    M("mutant-no-out", "paged_attention", _no_out,
      "never writes `out`; returns a correct tensor instead", ("decode-page1-gqa4:1-d64",)),
    M("mutant-ignores-scale", "paged_attention", _ignores_scale,
      "ignores softmax_scale (uses 1/sqrt(head_dim))", ("decode-page16-gqa5:1-d80",)),
    M("mutant-writes-kv-cache", "paged_attention", _writes_kv_cache,
      "writes into the KV cache it should only read", ("decode-page1-gqa4:1-d64",)),
    M("mutant-gqa-tiled", "paged_attention", _gqa_tiled,
      "maps query head h to KV head h % num_kv_heads", ("decode-page16-gqa5:1-d80",)),
    M("mutant-window-off-by-one", "paged_attention", _window_off_by_one,
      "sees one key more than the window's left edge", ("window-page16-w8",)),
    M("mutant-reads-past-seqused-k", "paged_attention", _reads_past_seqused_k,
      "reads the slots past seqused_k (masked lanes times zero)", ("decode-page16-gqa5:1-d80",)),
    M("mutant-stale-on-replay", "paged_attention", _stale_on_replay,
      "declares graph support but keeps the lengths of its first call per buffer",
      ("decode-page1-gqa4:1-d64", "decode-page16-gqa5:1-d80"), CGSupport.ALWAYS),
    M("mutant-plan-copies-lengths", "paged_attention", _PlanCopiesLengths,
      "kernel object whose plan keeps its own copy of seqused_k (stale on replay)",
      ("decode-page16-gqa5:1-d80",), CGSupport.ALWAYS),
    M("mutant-nan-on-empty-rows", "paged_attention", _nan_on_empty_rows,
      "NaN (0/0) for rows that see no key instead of zeros and an LSE of -inf",
      ("custom-mask-empty-rows-lse",)),
    M("mutant-lse-log2", "paged_attention", _lse_log2,
      "returns the log-sum-exp in base 2", ("lse-extend-page16-gqa5:1-window-sinks",)),
    M("mutant-merge-nan-on-empty", "merge_attention_states", _merge_nan_on_empty,
      "textbook merge: reads empty parts, NaN when both are empty",
      ("merge-states-with-empty-parts",)),
    M("mutant-mla-ignores-scale", "mla_paged_attention", _mla_ignores_scale,
      "MLA kernel ignoring softmax_scale", ("mla-decode-h16-page1",)),
    M("mutant-mla-plan-copies-lengths", "mla_paged_attention", _MLAPlanCopiesLengths,
      "MLA kernel object whose plan keeps its own copy of seqused_k (stale on replay)",
      ("mla-decode-h16-page1", "mla-decode-h4-page64"), CGSupport.ALWAYS),
    M("mutant-5d-ignores-scale", "paged_attention_5d", _5d_ignores_scale,
      "5-D kernel ignoring softmax_scale", ("5d-decode-page16-gqa4:1",)),
    M("mutant-5d-window-one-sided", "paged_attention_5d", _one_sided_window,
      "5-D kernel applying only the window's left edge", ("5d-window-two-sided-noncausal",)),
    M("mutant-empty-rows-drop-sink", "paged_attention", _empty_rows_drop_sink,
      "LSE -inf for a row that sees no key although it has a sink",
      ("custom-mask-empty-rows-sinks-lse",)),
    M("mutant-zero-length-clobbers", "paged_attention", _zero_length_clobbers,
      "writes a row for a request with no query (onto the next request's first row)",
      ("mixed-page16-zero-length-requests",)),
    M("mutant-mla-zero-length-clobbers", "mla_paged_attention", _mla_zero_length_clobbers,
      "MLA kernel writing a row for a request with no query",
      ("mla-zero-length-requests-h16-page1",)),
    M("mutant-5d-nan-on-empty-rows", "paged_attention_5d",
      _nan_on_empty_rows_of(paged_attention_5d_reference),
      "5-D kernel: NaN (0/0) for rows that see no key", ("5d-custom-mask-empty-rows-lse",)),
    M("mutant-mla-nan-on-empty-rows", "mla_paged_attention",
      _nan_on_empty_rows_of(R.mla_paged_attention_reference),
      "MLA kernel: NaN (0/0) for rows that see no key",
      ("mla-custom-mask-empty-rows-lse-h16-page1",)),
    M("mutant-write-kv-null-page", "write_kv", _write_kv_null_page,
      "also zeroes the null page", ("write_kv-page16-gqa",)),
    M("mutant-write-kv-fp8-unscaled", "write_kv", _write_kv_unscaled_fp8,
      "declares fp8 but stores the values without dividing by k_scale / v_scale",
      ("write_kv-fp8e4m3fn-page16-scales",)),
    M("mutant-write-kv-fp8-overflow-nan", "write_kv", _write_kv_fp8_overflow_nan,
      "stores fp8 values past the format's range as NaN instead of saturating them",
      ("write_kv-fp8e4m3fn-page16-scales",)),
    M("mutant-write-kv-swa-untranslated", "write_kv_swa", _write_kv_swa_untranslated,
      "writes the full-pool slot, not its SWA translation", ("write_kv_swa-page16",)),
    M("mutant-write-kv-5d-k-only", "write_kv_5d", _write_kv_5d_k_only,
      "writes K but not V", ("write_kv_5d-shuffled-page16",)),
    M("mutant-page-table-no-zero", "build_page_table", _page_table_no_zero,
      "leaves stale entries past each request's pages", ("page_table-page16",)),
    M("mutant-page-table-min-one-page", "build_page_table", _page_table_min_one_page,
      "gives an empty request one page instead of none", ("page_table-zero-length-request",)),
    M("mutant-swa-tables-untranslated", "build_page_tables_swa", _swa_tables_untranslated,
      "copies the full table as the SWA table", ("page_tables_swa-page16",)),
    M("mutant-ragged-shifted", "build_ragged_kv_indices", _ragged_shifted,
      "kv_indices off by one position", ("ragged_kv_indices",)),
    M("mutant-tree-mask-transposed", "build_tree_mask", _tree_mask_transposed,
      "reads the tree mask transposed", ("tree_mask-q4",)),
    M("mutant-draft-positions", "build_draft_decode_indices", _draft_positions,
      "positions = seqused_k instead of seqused_k - 1",
      ("draft_decode_indices-topk2-steps3-page4",)),
)
del M


def _capabilities(m: Mutant) -> Capabilities:
    return Capabilities(features=FEATURES, cg_support=m.cg_support)


@hookimpl
def aiter_attn_register_kernels(register):
    """Register every mutant (priority :data:`PRIORITY`)."""
    for m in MUTANTS:
        register(m.op, m.name, m.fn, _capabilities(m), priority=PRIORITY)


def register_mutants(registry=None) -> None:
    """Add the mutants to ``registry`` (default: the process-wide one) if not there yet."""
    if registry is None:
        from ...plugins import kernel_registry

        registry = kernel_registry()
    from ...plugins import add_kernels

    # the plugin's own hook, through the loader's registration path
    add_kernels(registry, aiter_attn_register_kernels, source="mutants", skip_registered=True)


def self_test(device: str = "cpu", *, quick: bool = False) -> list:
    """Run the suite on every mutant: ``[(mutant, report, missed)]`` where ``missed`` lists
    the cases of ``mutant.catches`` that did not fail (empty when the suite caught it)."""
    from .runner import run_conformance

    register_mutants()
    out = []
    for m in MUTANTS:
        report = run_conformance(m.name, device=device, ops=[m.op],
                                 names=m.catches if quick else None)
        out.append((m, report, [c for c in m.catches if c not in report.failed()]))
    return out
