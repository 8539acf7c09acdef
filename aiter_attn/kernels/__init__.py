"""Kernel implementations and the kernel registry (reference, triton, vendor plugins)."""

from .registry import Capabilities, KernelImpl, KernelRegistry, KernelRequest, KernelSelectionError

__all__ = ["Capabilities", "KernelImpl", "KernelRegistry", "KernelRequest", "KernelSelectionError"]
