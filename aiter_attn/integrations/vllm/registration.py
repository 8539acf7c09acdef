"""Which vLLM backend name aiter_attn takes, and taking it.

vLLM (0.32) resolves an attention backend by name through ``AttentionBackendEnum``; a plugin
points a name at its class with ``register_backend(name, "module.Class")``. On GPUs we take the
``CUSTOM`` placeholder, so nothing changes until the user asks for it
(``--attention-backend CUSTOM``). vLLM's CPU platform ignores the requested backend and always
returns ``CPU_ATTN``'s class path for non-MLA layers, so on the CPU we register over
``CPU_ATTN``: installing the plugin is what selects it there (disable with
``AITER_ATTN_VLLM=0`` or a ``VLLM_PLUGINS`` list without ``aiter_attn``).
"""

from __future__ import annotations

__all__ = ["BACKEND_PATH", "default_name", "registered_name", "register_backend"]

#: what vLLM imports when our name is resolved (by path, so registering imports nothing heavy).
BACKEND_PATH = "aiter_attn.integrations.vllm.backend.AiterAttnBackend"


def default_name() -> str:
    """``"CPU_ATTN"`` on vLLM's CPU platform, else ``"CUSTOM"``."""
    from vllm.platforms import current_platform

    return "CPU_ATTN" if current_platform.is_cpu() else "CUSTOM"


def registered_name() -> str:
    """The ``AttentionBackendEnum`` name whose override points at our backend (the name
    ``AiterAttnBackend.get_name()`` must return for vLLM's layers to find themselves), or
    :func:`default_name` before registration."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for member in AttentionBackendEnum:
        if member.is_overridden() and member.get_path() == BACKEND_PATH:
            return member.name
    return default_name()


def register_backend(name: str | None = None) -> str:
    """Point vLLM's backend ``name`` (default :func:`default_name`) at our backend; return
    the name. Idempotent (vLLM loads general plugins once in every process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as vllm_register

    name = name or default_name()
    try:
        member = AttentionBackendEnum[name]
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"vLLM has no attention backend named {name!r} to register aiter_attn as; "
            f"valid names: {[m.name for m in AttentionBackendEnum]}.") from exc
    vllm_register(member, BACKEND_PATH)
    return name
