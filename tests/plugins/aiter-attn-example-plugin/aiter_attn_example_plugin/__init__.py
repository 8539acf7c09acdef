"""A minimal aiter_attn kernel plugin: backend ``example`` for ``paged_attention``.

The kernel is a plan/run object (``aiter_attn.kernels.base.AttentionKernel``): the backend
binds it once per layer group, calls ``plan`` once per step and ``run`` once per layer. Its
run wraps the float32 reference (a vendor would launch its own kernel here). It declares what
it serves: CPU, fp32/fp16/bf16, windows, soft-cap, fp8 caches, custom masks, but *not*
attention sinks, so a request with sinks is routed elsewhere (or, when ``backend="example"``
is forced, rejected with that reason).
"""

import attrs
import torch

from aiter_attn.hookspecs import hookimpl
from aiter_attn.kernels.base import AttentionKernel, KernelPlan, mask_literal
from aiter_attn.kernels.reference import paged_attention_reference
from aiter_attn.kernels.registry import Capabilities
from aiter_attn.types import CGSupport

__all__ = ["ExamplePlan", "ExamplePagedAttention", "CALLS", "aiter_attn_register_kernels"]

#: how often the kernel ran (tests read it to see that selection picked this plugin).
CALLS = {"paged_attention": 0}


@attrs.frozen(kw_only=True)
class ExamplePlan(KernelPlan):
    """One step's indices (a real kernel would also keep its grid and work lists here)."""

    cu_seqlens_q: torch.Tensor = attrs.field(eq=False)
    seqused_k: torch.Tensor = attrs.field(eq=False)
    block_table: torch.Tensor = attrs.field(eq=False)
    custom_mask: object = attrs.field(default=None, eq=False)
    mask_indptr: object = attrs.field(default=None, eq=False)


class ExamplePagedAttention(AttentionKernel):
    """``paged_attention``: q ``[T, Hq, D]``, caches ``[pages, page_size, Hkv, D]``, out
    ``[T, Hq, Dv]``."""

    def plan(self, md, out=None):
        mask = md.mask
        return ExamplePlan(
            num_tokens=md.query.num_tokens, mask_literal=mask_literal(md),
            cu_seqlens_q=md.query.cu_seqlens_q, seqused_k=md.pages.seqused_k,
            block_table=md.pages.block_table,
            custom_mask=None if mask is None else mask.custom_mask,
            mask_indptr=None if mask is None else mask.mask_indptr)

    def run(self, q, cache, plan, params, out, lse=None):
        CALLS["paged_attention"] += 1
        k_cache, v_cache = cache
        return paged_attention_reference(
            q, k_cache, v_cache, out, cu_seqlens_q=plan.cu_seqlens_q,
            seqused_k=plan.seqused_k, block_table=plan.block_table, softmax_scale=params.scale,
            causal=params.causal and not plan.mask_literal, window_size=params.window,
            softcap=params.softcap, k_scale=params.k_scale, v_scale=params.v_scale,
            custom_mask=plan.custom_mask, mask_indptr=plan.mask_indptr)


CAPABILITIES = Capabilities(
    devices={"cpu"},
    dtypes={torch.float32, torch.float16, torch.bfloat16},
    features={"window", "softcap", "fp8", "custom_mask", "v_head_dim_differs", "non_causal"},
    cg_support=CGSupport.NEVER,
)


@hookimpl
def aiter_attn_register_kernels(register):
    # Priority 10 beats the reference (0) wherever both can serve a request.
    register("paged_attention", "example", ExamplePagedAttention, CAPABILITIES, priority=10)
