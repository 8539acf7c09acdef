"""SGLang plugin: ``--attention-backend aiter_attn``.

Installed with this package, the entry point ``aiter_attn`` in SGLang's general-plugin group
``sglang.srt.plugins`` makes SGLang call :func:`register` early in every process
(``sglang.srt.plugins.load_plugins``; ``SGLANG_PLUGINS=aiter_attn`` allow-lists it when other
plugins are installed). :func:`register` adds ``aiter_attn`` to SGLang's attention-backend
choices and registers a factory through SGLang's ``register_attention_backend``; the factory
builds :class:`~aiter_attn.integrations.sglang.adapter.AiterAttnSGLangBackend` on SGLang's own
``AttentionBackend`` base class::

    python -m sglang.launch_server --model-path MODEL --attention-backend aiter_attn

If SGLang cannot be imported, or its API moved, :func:`register` logs why (a ``WARNING`` from
this logger) and returns ``False``: SGLang keeps serving with its own backends. See
``docs/integrations.md`` for what is served.
"""

from __future__ import annotations

import logging
from typing import Optional

from ...types import SpecDecodeConfig

__all__ = ["BACKEND_NAME", "ENTRY_POINT_GROUP", "register", "create_backend", "spec_from_sglang"]

log = logging.getLogger(__name__)

#: The ``--attention-backend`` choice this plugin adds.
BACKEND_NAME = "aiter_attn"
#: SGLang's entry-point group for general plugins (``GENERAL_PLUGINS_GROUP``).
ENTRY_POINT_GROUP = "sglang.srt.plugins"

_backend_class = None


def spec_from_sglang() -> Optional[SpecDecodeConfig]:
    """Speculative settings of the running SGLang server (``runtime_context.get_spec()``), or
    ``None`` without speculative decoding."""
    from sglang.srt.runtime_context import get_spec

    s = get_spec()
    if not getattr(s, "speculative_algorithm", None):
        return None
    return SpecDecodeConfig(num_steps=int(s.speculative_num_steps or 1),
                            topk=int(s.speculative_eagle_topk or 1),
                            num_draft_tokens=int(s.speculative_num_draft_tokens or 2))


def create_backend(model_runner):
    """SGLang's factory for ``aiter_attn`` (``ATTENTION_BACKENDS[name](model_runner)``)."""
    if _backend_class is None:
        raise RuntimeError("aiter_attn's SGLang plugin was not registered; call "
                           "aiter_attn.integrations.sglang.register() first.")
    return _backend_class(model_runner, spec=spec_from_sglang())


def _add_choice() -> None:
    try:
        from sglang.srt.arg_groups import choices as C
    except ImportError:  # releases before the arg_groups split kept them in server_args
        from sglang.srt import server_args as C
    if BACKEND_NAME not in C.ATTENTION_BACKEND_CHOICES:
        C.add_attention_backend_choices([BACKEND_NAME])


def register() -> bool:
    """Register ``aiter_attn`` with SGLang (idempotent). Never raises: on failure it logs why
    and returns ``False`` so SGLang runs with its own backends."""
    global _backend_class
    try:
        from sglang.srt.layers.attention.attention_registry import register_attention_backend
        from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as SGLBase

        from .adapter import build_backend_class

        _add_choice()
        if _backend_class is None:
            _backend_class = build_backend_class(SGLBase)
        register_attention_backend(BACKEND_NAME)(create_backend)
    except Exception as exc:  # a plugin must never take SGLang down
        log.warning("aiter_attn SGLang plugin not registered (%s: %s); SGLang keeps its own "
                    "attention backends. It needs the SGLang API of 0.5.23 "
                    "(attention_registry.register_attention_backend, "
                    "base_attn_backend.AttentionBackend, add_attention_backend_choices).",
                    type(exc).__name__, exc)
        return False
    log.info("aiter_attn registered as SGLang attention backend %r", BACKEND_NAME)
    return True
