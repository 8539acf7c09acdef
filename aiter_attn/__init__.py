"""aiter_attn: a layered attention backend for LLM inference over a paged KV cache."""

from . import ops
from .backend import AttentionBackend
from .batch import ForwardBatch, SpecInfo
from .graph import CudaGraphManager, GraphLimitError, GraphMetadataMismatch
from .kvcache import (
    MHAKVPool,
    MLAKVPool,
    PageAllocator,
    ReqToTokenPool,
    SWAKVPool,
    SWAPageAllocator,
    Vec5DKVPool,
)
from .metadata import AttnMetadata, CustomMask, PageTable, QueryLayout, RaggedKV
from .multistep import MultiStepDraftBackend
from .registry import StrategyPair, StrategyRegistry, StrategySelectionError
from .strategies.mla import (
    MLA_HEAD_PADDING_KEY,
    MLA_PROJECTIONS_KEY,
    HeadPadding,
    absorb_q,
    apply_w_uv,
    kv_b_proj_from_weights,
    mla_layer_specs,
)
from .types import AttnArch, BackendConfig, CGSupport, ForwardMode, LayerSpec, SpecDecodeConfig

__version__ = "0.1.0"

__all__ = [
    "ops",
    "AttentionBackend",
    "MultiStepDraftBackend",
    "ForwardBatch",
    "SpecInfo",
    "CudaGraphManager",
    "GraphLimitError",
    "GraphMetadataMismatch",
    "MHAKVPool",
    "MLAKVPool",
    "PageAllocator",
    "ReqToTokenPool",
    "SWAKVPool",
    "SWAPageAllocator",
    "Vec5DKVPool",
    "AttnMetadata",
    "CustomMask",
    "PageTable",
    "QueryLayout",
    "RaggedKV",
    "StrategyPair",
    "StrategyRegistry",
    "StrategySelectionError",
    "AttnArch",
    "BackendConfig",
    "CGSupport",
    "ForwardMode",
    "LayerSpec",
    "SpecDecodeConfig",
    # MLA set-up (DeepSeek): layer specs, AttentionBackend(extra=...) keys, weight helpers
    "mla_layer_specs",
    "HeadPadding",
    "MLA_PROJECTIONS_KEY",
    "MLA_HEAD_PADDING_KEY",
    "kv_b_proj_from_weights",
    "absorb_q",
    "apply_w_uv",
]
