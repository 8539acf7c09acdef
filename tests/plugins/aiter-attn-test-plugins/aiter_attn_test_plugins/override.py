"""Replaces the built-in ``reference`` paged-attention kernel (``replace=True``)."""

from aiter_attn.hookspecs import hookimpl
from aiter_attn.kernels.reference import paged_attention_reference
from aiter_attn.kernels.registry import Capabilities
from aiter_attn.types import CGSupport

CALLS = {"paged_attention": 0}


def overriding_reference(q, k_cache, v_cache, out, **kwargs):
    CALLS["paged_attention"] += 1
    return paged_attention_reference(q, k_cache, v_cache, out, **kwargs)


@hookimpl
def aiter_attn_register_kernels(register):
    caps = Capabilities(features={"sinks", "softcap", "window", "fp8", "custom_mask",
                                  "v_head_dim_differs", "non_causal"},
                        cg_support=CGSupport.NEVER)
    register("paged_attention", "reference", overriding_reference, caps, priority=0,
             replace=True)
