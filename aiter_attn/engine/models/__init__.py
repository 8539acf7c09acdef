"""Engine models beyond our own Llama-family decoder, and the factory that picks one.

:func:`build_engine_model` turns a loaded transformers ``*ForCausalLM`` into an ``EngineModel``:
Llama/Mistral/Qwen2 run on :class:`~aiter_attn.engine.model.LlamaFamilyModel` (our decoder);
Gemma-2, gpt-oss and DeepSeek-V2 run the transformers modules with the attention core
replaced by the backend (:class:`~aiter_attn.engine.models.hf_wrapped.HFWrappedModel`).
"""

from __future__ import annotations

from .hf_wrapped import ATTN_IMPLEMENTATION, WRAPPED_MODEL_TYPES, HFWrappedModel

__all__ = ["HFWrappedModel", "WRAPPED_MODEL_TYPES", "ATTN_IMPLEMENTATION", "build_engine_model",
           "ENGINE_MODEL_TYPES"]


def _own_decoder_types() -> dict:
    from ..model import SUPPORTED_MODEL_TYPES

    return SUPPORTED_MODEL_TYPES


def ENGINE_MODEL_TYPES() -> list:  # noqa: N802 (a function so the import stays lazy)
    """Every ``model_type`` the engine serves."""
    return sorted(set(_own_decoder_types()) | set(WRAPPED_MODEL_TYPES))


def build_engine_model(hf_model, *, wrap: bool = False, **kw):
    """An ``EngineModel`` for ``hf_model``.

    Args:
        hf_model: a loaded transformers causal LM.
        wrap: route even a Llama/Mistral/Qwen2 model through :class:`HFWrappedModel`.
        kw: passed to ``LlamaFamilyModel.from_hf`` (``max_positions``, ``progress``, …).
    """
    from ..model import LlamaFamilyModel, UnsupportedArchitectureError

    mtype = getattr(hf_model.config, "model_type", None)
    if not wrap and mtype in _own_decoder_types():
        return LlamaFamilyModel.from_hf(hf_model, **kw)
    if mtype in WRAPPED_MODEL_TYPES:
        return HFWrappedModel.from_hf(hf_model)
    raise UnsupportedArchitectureError(
        f"model_type={mtype!r} is not supported by the engine; supported: "
        f"{', '.join(ENGINE_MODEL_TYPES())}.")
