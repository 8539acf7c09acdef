"""CUDA graphs: static buffers owned in one place, one planning path for eager and graphs.

See :class:`CudaGraphManager`.
"""

from .buffers import (CAPTURABLE_MODES, DUMMY_SLOT, NULL_REQ_ROW, GraphLimits, StaticInputs,
                      default_capture_sizes)
from .manager import CudaGraphManager, graph_mode
from .padding import GraphLimitError, next_capture_size
from .signature import GraphMetadataMismatch, describe_signature, metadata_signature

__all__ = [
    "CudaGraphManager",
    "GraphLimits",
    "StaticInputs",
    "GraphLimitError",
    "GraphMetadataMismatch",
    "CAPTURABLE_MODES",
    "DUMMY_SLOT",
    "NULL_REQ_ROW",
    "default_capture_sizes",
    "graph_mode",
    "metadata_signature",
    "describe_signature",
    "next_capture_size",
]
