"""Engine models beyond our own Llama-family decoder, and the factory that picks one.

:func:`build_engine_model` turns a loaded transformers ``*ForCausalLM`` into an ``EngineModel``:
Llama/Mistral/Qwen2 run on :class:`~aiter_attn.engine.model.LlamaFamilyModel` (our decoder);
Gemma-2, gpt-oss and DeepSeek-V2 run the transformers modules with the attention core
replaced by the backend (:class:`~aiter_attn.engine.models.hf_wrapped.HFWrappedModel`).
"""

from __future__ import annotations

from .hf_wrapped import ATTN_IMPLEMENTATION, WRAPPED_MODEL_TYPES, HFWrappedModel

__all__ = ["HFWrappedModel", "WRAPPED_MODEL_TYPES", "ATTN_IMPLEMENTATION", "build_engine_model",
           "ENGINE_MODEL_TYPES", "check_engine_supported"]


def _own_decoder_types() -> dict:
    from ..model import SUPPORTED_MODEL_TYPES

    return SUPPORTED_MODEL_TYPES


def ENGINE_MODEL_TYPES() -> list:  # noqa: N802 (a function so the import stays lazy)
    """Every ``model_type`` the engine serves."""
    return sorted(set(_own_decoder_types()) | set(WRAPPED_MODEL_TYPES))


def build_engine_model(hf_model, *, wrap: bool = False, dtype=None, device=None, **kw):
    """An ``EngineModel`` for ``hf_model``.

    Args:
        hf_model: a loaded transformers causal LM.
        wrap: route even a Llama/Mistral/Qwen2 model through :class:`HFWrappedModel`.
        dtype / device: of the activations (a wrapped model is moved there in place).
        kw: passed to ``LlamaFamilyModel.from_hf`` (``max_positions``, ``progress``, …).
    """
    from ..model import LlamaFamilyModel, UnsupportedArchitectureError
    from ..rope import check_static_rope

    mtype = getattr(hf_model.config, "model_type", None)
    if not wrap and mtype in _own_decoder_types():
        to = {k: v for k, v in (("dtype", dtype), ("device", device)) if v is not None}
        return LlamaFamilyModel.from_hf(hf_model, **to, **kw)
    if mtype in WRAPPED_MODEL_TYPES:
        check_static_rope(hf_model.config)  # before the model is moved in place
        if dtype is not None or device is not None:
            hf_model.to(device=device, dtype=dtype)
        return HFWrappedModel.from_hf(hf_model)
    raise UnsupportedArchitectureError(
        f"model_type={mtype!r} is not supported by the engine; supported: "
        f"{', '.join(ENGINE_MODEL_TYPES())}.")


def check_engine_supported(config) -> None:
    """Raise ``UnsupportedArchitectureError`` unless the engine serves ``config.model_type``
    (own decoder or wrapped), naming every supported type, and ``ValueError`` for a RoPE type
    whose frequencies depend on the sequence length (config only: before weights load)."""
    from ..model import UnsupportedArchitectureError, check_supported
    from ..rope import check_static_rope

    mtype = getattr(config, "model_type", None)
    if mtype in WRAPPED_MODEL_TYPES and mtype not in _own_decoder_types():
        check_static_rope(config)
        return
    try:
        check_supported(config)
    except UnsupportedArchitectureError as exc:
        raise UnsupportedArchitectureError(
            f"{exc} Through transformers' own modules the engine also serves: "
            f"{', '.join(sorted(set(WRAPPED_MODEL_TYPES) - set(_own_decoder_types())))}."
        ) from exc
    check_static_rope(config)
