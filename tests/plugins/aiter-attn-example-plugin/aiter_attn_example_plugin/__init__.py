"""A minimal aiter_attn kernel plugin: backend ``example`` for ``paged_attention``.

Its kernel wraps the float32 reference (a vendor would call its own kernel here) and
declares what it serves: CPU, fp32/fp16/bf16, windows, soft-cap, fp8 caches, custom masks,
but *not* attention sinks, so a request with sinks is routed elsewhere (or, when
``backend="example"`` is forced, rejected with that reason).
"""

import torch

from aiter_attn.hookspecs import hookimpl
from aiter_attn.kernels.reference import paged_attention_reference
from aiter_attn.kernels.registry import Capabilities
from aiter_attn.types import CGSupport

__all__ = ["example_paged_attention", "CALLS", "aiter_attn_register_kernels"]

#: how often the kernel ran (tests read it to see that selection picked this plugin).
CALLS = {"paged_attention": 0}


def example_paged_attention(q, k_cache, v_cache, out, **kwargs):
    """Same calling convention as ``paged_attention_reference``: q ``[T, Hq, D]``, caches
    ``[pages, page_size, Hkv, D]``, ``out`` ``[T, Hq, Dv]``; keyword arguments as in
    ``aiter_attn.ops.paged_attention``."""
    CALLS["paged_attention"] += 1
    return paged_attention_reference(q, k_cache, v_cache, out, **kwargs)


CAPABILITIES = Capabilities(
    devices={"cpu"},
    dtypes={torch.float32, torch.float16, torch.bfloat16},
    features={"window", "softcap", "fp8", "custom_mask", "v_head_dim_differs", "non_causal"},
    cg_support=CGSupport.NEVER,
)


@hookimpl
def aiter_attn_register_kernels(register):
    # Priority 10 beats the reference (0) wherever both can serve a request.
    register("paged_attention", "example", example_paged_attention, CAPABILITIES, priority=10)
