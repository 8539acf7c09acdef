"""Portable Triton kernels (NVIDIA and AMD), registered as the ``triton`` backend.

This module is the plugin: its hook registers one entry per op, each implemented in a sibling
module. On CPU-only hosts the kernels register only under Triton's interpreter
(``TRITON_INTERPRET=1``, for tests), below the reference so the reference stays the CPU default.
"""

from __future__ import annotations

import os

import attrs

import torch

from ...hookspecs import hookimpl
from ...types import CGSupport
from ..registry import Capabilities

__all__ = ["aiter_attn_register_kernels", "TRITON_DEVICES", "triton_priority"]

_FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: device types the Triton kernels serve here.
TRITON_DEVICES = frozenset({"cuda", "cpu"} if _interpreting() else {"cuda"})


def triton_priority() -> int:
    """100 on GPUs (above the reference's 0); under the CPU interpreter -10 (below it), so
    CPU callers get the reference unless they ask for ``backend="triton"``."""
    return -10 if _interpreting() and not torch.cuda.is_available() else 100


@hookimpl
def aiter_attn_register_kernels(register):
    """Register the Triton ops."""
    from .attention import TritonPagedAttention, TritonPagedAttention5D
    from .paged_attention import MAX_HEAD_DIM, reject_reason

    attn_caps = Capabilities(
        devices=TRITON_DEVICES, dtypes=_FLOAT_DTYPES, max_head_dim=MAX_HEAD_DIM,
        features={"sinks", "softcap", "window", "fp8", "custom_mask", "v_head_dim_differs",
                  "non_causal", "lse", "batch_invariant"},
        cg_support=CGSupport.ALWAYS, predicate=reject_reason,
    )
    # plan/run kernel objects (kernels/triton/attention.py)
    from ...kv_scales import TOKEN_SCALE_FEATURE

    register("paged_attention", "triton", TritonPagedAttention,
             attrs.evolve(attn_caps, features=attn_caps.features | {TOKEN_SCALE_FEATURE}),
             priority=triton_priority())
    # extend/prefill in two passes (dense new tokens + paged prefix, merged by LSE):
    # kernels/triton/extend.py; strategies use it where BackendConfig.dense_extend is on
    from .extend import EXTEND_FEATURES, TritonExtendAttention, extend_reject_reason
    from .prefill import MAX_HEAD_DIM as PREFILL_MAX_HEAD_DIM

    register("extend_attention", "triton", TritonExtendAttention,
             Capabilities(devices=TRITON_DEVICES, dtypes=_FLOAT_DTYPES,
                          max_head_dim=PREFILL_MAX_HEAD_DIM, features=EXTEND_FEATURES,
                          cg_support=CGSupport.ALWAYS, predicate=extend_reject_reason),
             priority=triton_priority())
    # the same kernel over the vectorised 5-D layout (only the cache addressing differs)
    register("paged_attention_5d", "triton", TritonPagedAttention5D, attn_caps,
             priority=triton_priority())
    from .index import (
        build_draft_decode_indices,
        build_page_table,
        build_page_tables_swa,
        build_ragged_kv_indices,
    )
    from .kv_write import write_kv, write_kv_5d, write_kv_translated
    from .mla import TritonMLA

    register(  # plan/run kernel object (kernels/triton/mla.py)
        "mla_paged_attention", "triton", TritonMLA,
        Capabilities(devices=TRITON_DEVICES, dtypes=_FLOAT_DTYPES, max_head_dim=1024,
                     features={"fp8", "custom_mask", "lse", "batch_invariant", "non_causal"},
                     cg_support=CGSupport.ALWAYS),
        priority=triton_priority(),
    )
    index_caps = Capabilities(devices=TRITON_DEVICES, features={"fp8"},
                              cg_support=CGSupport.ALWAYS)
    register("build_page_table", "triton", build_page_table, index_caps, triton_priority())
    register("build_page_tables_swa", "triton", build_page_tables_swa, index_caps,
             triton_priority())
    register("build_draft_decode_indices", "triton", build_draft_decode_indices, index_caps,
             triton_priority())
    register("build_ragged_kv_indices", "triton", build_ragged_kv_indices, index_caps,
             triton_priority())
    write_caps = attrs.evolve(index_caps, features={"fp8", TOKEN_SCALE_FEATURE})
    register("write_kv", "triton", write_kv, write_caps, triton_priority())
    register("write_kv_swa", "triton", write_kv_translated, write_caps, triton_priority())
    register("write_kv_5d", "triton", write_kv_5d, index_caps, triton_priority())
    from .masks import build_tree_mask
    from .merge import merge_attention_states

    register("merge_attention_states", "triton", merge_attention_states,
             Capabilities(devices=TRITON_DEVICES, dtypes=_FLOAT_DTYPES,
                          cg_support=CGSupport.ALWAYS),
             triton_priority())

    register("build_tree_mask", "triton", build_tree_mask,
             Capabilities(devices=TRITON_DEVICES, cg_support=CGSupport.ALWAYS),
             triton_priority())
