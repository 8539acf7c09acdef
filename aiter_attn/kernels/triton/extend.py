"""Extend/prefill attention in two passes merged by LSE (op ``extend_attention``).

An extend step's new tokens attend (a) causally to their own new keys and values, which the
strategy still holds as dense ``[T, Hkv, D]`` tensors (just written to the pool), and (b) to
the whole cached prefix of their request in the pool. This kernel object runs (b) with the
Triton paged kernel (:class:`~.attention.TritonPagedAttention`, non-causal, over the prefix
only: ``seqused_k - q_len`` keys, no sinks, LSE out) and (a) with the dense-tile kernel of
:mod:`.prefill`, whose epilogue merges (b)'s ``(o, lse)`` exactly, adds the sink once and
writes the output (and the LSE when asked). A step with no cached prefix anywhere (the host
hint ``md.extras["max_prefix_len"] == 0``) runs the dense pass alone.

Math: identical to ``paged_attention`` with ``causal=True`` over ``seqused_k`` keys of which the
last ``q_len`` are the step's tokens (bottom-right alignment), except that with an fp8 cache
the new tokens' keys/values are used as computed (unquantised), the prefix as stored.

Capabilities: sinks, soft-cap, fp8 and per-(token, head) scales (prefix pass), LSE, a value
head dim of its own. Declined (the registry then keeps the paged kernel): sliding windows
(the prefix pass would need absolute positions), tree masks, non-causal layers,
batch-invariant mode.

``plan(md, out=None)``: host integers only (``max_seqlen_q``, the prefix hint); prefix lengths
are computed on the device; workspaces come from ``out`` under CUDA graphs. ``run(q, cache,
plan, params, out, lse=None, *, k, v)`` launches one or two kernels.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..base import AttentionKernel, KernelPlan, plan_hints, token_count_error
from .attention import TritonPagedAttention
from .prefill import MAX_HEAD_DIM, PrefillConfig, choose_prefill_config, launch_dense

__all__ = ["TritonExtendAttention", "ExtendPlan", "extend_attention_request",
           "extend_reject_reason", "EXTEND_FEATURES"]

_T = dict(eq=False, repr=False)


def extend_attention_request(q, k_cache, v_cache, **kwargs):
    """The registry key of an ``extend_attention`` call: the ``paged_attention`` request of
    the same layer (:func:`aiter_attn.ops.paged_attention_request`) under this op's name."""
    from ...ops import paged_attention_request

    return attrs.evolve(paged_attention_request(q, k_cache, v_cache, **kwargs),
                        op="extend_attention")


def extend_reject_reason(request) -> Optional[str]:
    """Registry predicate (on top of the declared features)."""
    from .paged_attention import reject_reason

    why = reject_reason(request)
    if why is not None:
        return why
    if (request.head_dim or 0) > MAX_HEAD_DIM or (request.v_head_dim or 0) > MAX_HEAD_DIM:
        return f"head dim above {MAX_HEAD_DIM}"
    return None


#: features the two-pass kernel serves (windows, masks, non-causal, batch-invariant: declined)
EXTEND_FEATURES = frozenset({"sinks", "softcap", "fp8", "lse", "v_head_dim_differs",
                             "kv_scale_per_token_head"})


@attrs.frozen(kw_only=True)
class ExtendPlan(KernelPlan):
    """One step's launches.

    Attributes:
        cu_seqlens_q: int32 ``[B + 1]`` (the new tokens' offsets: queries and new K/V alike).
        grid / search: the dense kernel's grid and whether its programs search their
            request (ragged batches: :meth:`~.prefill.PrefillConfig.grid`).
        dense_cfg: its :class:`~.prefill.PrefillConfig`.
        paged_plan: the prefix pass's plan, or ``None`` when no request has a prefix.
        o_prefix / lse_prefix: the prefix pass's output ``[T, Hq, Dv]`` and float32 LSE
            ``[T, Hq]`` (workspaces), or ``None``.
    """

    cu_seqlens_q: torch.Tensor = attrs.field(**_T)
    grid: tuple
    search: bool = False
    dense_cfg: PrefillConfig
    paged_plan: Optional[KernelPlan] = attrs.field(default=None, **_T)
    o_prefix: Optional[torch.Tensor] = attrs.field(default=None, **_T)
    lse_prefix: Optional[torch.Tensor] = attrs.field(default=None, **_T)


class TritonExtendAttention(AttentionKernel):
    """Dense pass over the step's new tokens + paged pass over the cached prefix, merged by
    LSE (see the module docstring)."""

    op = "extend_attention"

    def __init__(self, request=None):
        super().__init__(request)
        self._prefix_params: dict = {}
        if request is not None:
            extra = dict(request.extra)
            self.q_heads, self.kv_heads = extra.get("q_heads"), extra.get("kv_heads")
            self.head_dim = request.head_dim
            self.v_head_dim = request.v_head_dim or request.head_dim
            self.dtype = request.dtype
            self.paged = TritonPagedAttention(attrs.evolve(request, op="paged_attention"))
            self.paged.name = f"{self.name} (prefix pass)"

    @classmethod
    def request_for(cls, q, k_cache, v_cache):
        return extend_attention_request(q, k_cache, v_cache)

    # -- plan ----------------------------------------------------------------------------
    def _workspace(self, out, name, shape, dtype, device):
        if out is None:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = out.get(name)
        if buf is None or buf.shape[0] < shape[0]:
            buf = out[name] = torch.empty(shape, dtype=dtype, device=device)
        return buf[: shape[0]]

    def plan(self, md, out: Optional[dict] = None) -> ExtendPlan:
        """The step's launches (host integers only: no sync)."""
        query, pages = md.query, md.pages
        cu = query.cu_seqlens_q
        num_tokens = query.num_tokens
        batch = cu.shape[0] - 1
        hint_q, hint_k = plan_hints(md)
        max_q = int(hint_q) if hint_q is not None else num_tokens
        max_q = max(1, min(max_q, num_tokens)) if num_tokens else 1
        device = cu.device
        cfg = choose_prefill_config(max_q=max_q, max_k=max_q, head_dim=self.head_dim,
                                    v_head_dim=self.v_head_dim, dtype=self.dtype,
                                    device=device, num_tokens=num_tokens,
                                    q_heads=self.q_heads)
        grid, search = cfg.grid(max_q, num_tokens, self.q_heads, max(batch, 0))
        max_prefix = md.extras.get("max_prefix_len")
        if max_prefix is None:  # no hint: at most the keys' bound minus nothing
            max_prefix = (int(hint_k) if hint_k is not None
                          else pages.block_table.shape[1] * pages.page_size)
        paged_plan = o_p = lse_p = None
        if max_prefix > 0 and num_tokens and batch > 0:
            from ...metadata import PageTable

            q_lens = cu[1:] - cu[:-1]
            pre = self._workspace(out, "triton.extend.prefix_lens", (batch,), torch.int32,
                                  device)
            torch.sub(pages.seqused_k, q_lens, out=pre)
            view = attrs.evolve(
                md, pages=PageTable(block_table=pages.block_table, seqused_k=pre,
                                    max_seqlen_k=int(max_prefix), page_size=pages.page_size),
                extras={**md.extras, "max_seqlen_q_hint": max_q,
                        "max_seqlen_k_hint": int(max_prefix)})
            paged_plan = self.paged.plan(view, out=out)
            o_p = self._workspace(out, "triton.extend.o_prefix",
                                  (num_tokens, self.q_heads, self.v_head_dim), self.dtype, device)
            lse_p = self._workspace(out, "triton.extend.lse_prefix", (num_tokens, self.q_heads),
                                    torch.float32, device)
        return ExtendPlan(num_tokens=num_tokens if batch > 0 else 0, cu_seqlens_q=cu,
                          grid=grid, search=search, dense_cfg=cfg, paged_plan=paged_plan, o_prefix=o_p,
                          lse_prefix=lse_p)

    # -- run -----------------------------------------------------------------------------
    def _params_for_prefix(self, params):
        hit = self._prefix_params.get(id(params))
        if hit is None or hit[0] is not params:
            hit = self._prefix_params[id(params)] = (
                params, attrs.evolve(params, causal=False, sinks=None))
        return hit[1]

    def run(self, q, cache, plan: ExtendPlan, params, out, lse=None, *, k=None, v=None):
        """Launch: the prefix pass (when planned), then the dense pass with the merge.
        ``k``/``v``: the step's new keys/values ``[T, Hkv, D]`` / ``[T, Hkv, Dv]`` (required)."""
        if k is None or v is None:
            raise ValueError(
                f"{self.name}: extend_attention needs the step's new keys and values (k=, v=: "
                "[num_tokens, kv_heads, head_dim]); call paged_attention when only the cache "
                "holds them.")
        if q.shape[0] != plan.num_tokens:
            if plan.num_tokens == 0:
                return out
            raise token_count_error(self.name, q.shape[0], plan)
        if plan.num_tokens == 0:
            return out
        if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            raise ValueError(
                f"{self.name}: k/v hold {k.shape[0]}/{v.shape[0]} tokens but q holds "
                f"{q.shape[0]}; pass this step's new keys and values, one per query token.")
        self._check_new_kv(q, k, v)
        prefix = None
        if plan.paged_plan is not None:
            self.paged.run(q, cache, plan.paged_plan, self._params_for_prefix(params),
                           plan.o_prefix, lse=plan.lse_prefix)
            prefix = (plan.o_prefix, plan.lse_prefix)
        cu = plan.cu_seqlens_q
        return launch_dense(q, k, v, out, cu, cu, params.scale, True, params.window,
                            params.softcap, params.sinks, lse, prefix, plan.dense_cfg,
                            plan.grid, plan.search)

    def _check_new_kv(self, q, k, v):
        """The new keys/values are the bound layer's ``[T, kv_heads, head_dim(_v)]`` in q's
        dtype (the dense pass takes its GQA grouping and head dims from them, the prefix
        pass from the cache: a mismatch would mix two layers)."""
        for name, t, dim in (("k", k, self.head_dim), ("v", v, self.v_head_dim)):
            if t.dim() != 3 or t.shape[1] != self.kv_heads or t.shape[2] != dim:
                raise ValueError(
                    f"{self.name}: {name} is {list(t.shape)} but this layer's new "
                    f"{'keys' if name == 'k' else 'values'} are [num_tokens, {self.kv_heads}, "
                    f"{dim}] (the cache's kv heads and head dim); pass the step's new {name} "
                    "in that shape.")
            if t.dtype != q.dtype:
                raise ValueError(
                    f"{self.name}: {name} is {t.dtype} but q is {q.dtype}; pass the new "
                    f"{'keys' if name == 'k' else 'values'} in q's dtype (they are used as "
                    "computed, before any cache quantisation).")

    def __call__(self, q, k, v, k_cache, v_cache, out, *, cu_seqlens_q, seqused_k, block_table,
                 softmax_scale, causal=True, window_size=(-1, -1), softcap=0.0, sinks=None,
                 k_scale=None, v_scale=None, max_seqlen_q=None, max_seqlen_k=None,
                 max_prefix_len=None, lse=None, k_scale_cache=None, v_scale_cache=None):
        """One functional call: q ``[T, Hq, D]``, the new ``k``/``v`` ``[T, Hkv, D]`` (already
        in the pool too), the paged caches and their index tensors as for
        ``paged_attention`` (``seqused_k`` counts prefix + new tokens); ``max_prefix_len``: a
        host bound of the cached prefixes (``None``: unknown). Causal layers only."""
        if self.request is None:
            return type(self)(self.request_for(q, k_cache, v_cache))(
                q, k, v, k_cache, v_cache, out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                window_size=window_size, softcap=softcap, sinks=sinks, k_scale=k_scale,
                v_scale=v_scale, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                max_prefix_len=max_prefix_len, lse=lse, k_scale_cache=k_scale_cache,
                v_scale_cache=v_scale_cache)
        if not causal or tuple(window_size) != (-1, -1):
            raise ValueError(
                f"{self.name}: extend_attention serves causal layers without a window "
                f"(got causal={causal}, window_size={tuple(window_size)}); use "
                "paged_attention for those.")
        from ..base import LayerParams, _adhoc_metadata
        from ...types import FP8_DTYPES
        from .paged_attention import check_call_tensors

        check_call_tensors(q, k.shape[1], out, sinks=sinks, lse=lse)  # k [T, Hkv, D]
        md = _adhoc_metadata(q, k_cache, cu_seqlens_q, seqused_k, block_table, None, None,
                             max_seqlen_q, max_seqlen_k, "paged_attention")
        if max_prefix_len is not None:
            md.extras["max_prefix_len"] = int(max_prefix_len)
        params = LayerParams.create(
            scale=softmax_scale, device=q.device, window=window_size, softcap=softcap,
            causal=True, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
            fp8=k_cache.dtype in FP8_DTYPES, k_scale_cache=k_scale_cache,
            v_scale_cache=v_scale_cache)
        return self.run(q, (k_cache, v_cache), self.plan(md), params, out, lse=lse, k=k, v=v)
