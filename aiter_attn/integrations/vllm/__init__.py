"""aiter_attn inside vLLM (0.32, v1 engine): a ``vllm.general_plugins`` entry point.

``pip install aiter-attn`` next to vLLM and the plugin loads in every vLLM process:

* on GPUs it registers the backend as ``CUSTOM``; serve with
  ``vllm serve MODEL --attention-backend CUSTOM``;
* on the CPU it registers over ``CPU_ATTN`` (vLLM's CPU platform always picks that name).

``AITER_ATTN_VLLM=0`` (or a ``VLLM_PLUGINS`` allow-list without ``aiter_attn``) leaves vLLM
untouched. A plugin that cannot load (vLLM too old or too new, aiter_attn broken) logs a
warning saying why and registers nothing, so vLLM keeps its own backends.

Modules: :mod:`.registration` (names), :mod:`.core` (metadata and KV-cache mapping, no vLLM
import), :mod:`.backend` (vLLM's backend / builder / impl classes). See docs/integrations.md.
"""

from __future__ import annotations

import logging
import os

__all__ = ["register", "ENV_DISABLE"]

#: set to ``0`` to keep the plugin from registering.
ENV_DISABLE = "AITER_ATTN_VLLM"

# Under vLLM's "vllm" logger, so its level and handlers apply once vLLM has configured them
# (plugins load earlier; until then only warnings reach stderr, which is what matters here).
log = logging.getLogger("vllm.plugins.aiter_attn")


def register() -> None:
    """vLLM general-plugin hook: register aiter_attn's attention backend (see module doc).
    Never raises: a failure is logged as a warning and vLLM keeps its own backends."""
    if os.environ.get(ENV_DISABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("aiter_attn: %s=0, not registering the attention backend.", ENV_DISABLE)
        return
    try:
        from .registration import register_backend

        # Import the backend now: an interface mismatch with this vLLM fails here, loudly,
        # instead of later inside model construction.
        from . import backend  # noqa: F401

        name = register_backend()
    except Exception as exc:  # any failure must leave vLLM working with its own backends
        log.warning(
            "aiter_attn: vLLM plugin not registered (%s: %s); vLLM keeps its own attention "
            "backends. Fix: install a vLLM this plugin supports (0.32.x) or set %s=0.",
            type(exc).__name__, exc, ENV_DISABLE, exc_info=log.isEnabledFor(logging.DEBUG))
        return
    log.info("aiter_attn: registered as vLLM attention backend %s%s.", name,
             " (vLLM's CPU platform always uses this name)" if name == "CPU_ATTN"
             else "; select it with --attention-backend CUSTOM")
