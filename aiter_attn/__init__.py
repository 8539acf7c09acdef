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
]
