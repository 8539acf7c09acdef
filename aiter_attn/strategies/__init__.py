"""Strategy families: one module per family (mha, spec, mla, swa, vec5d)."""

from .base import BufferSpec, ExecutionStrategy, MetadataStrategy, StrategyContext

__all__ = ["BufferSpec", "ExecutionStrategy", "MetadataStrategy", "StrategyContext"]
