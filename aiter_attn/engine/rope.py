"""Rotary position embedding as a cos/sin table indexed by absolute position.

The inverse frequencies (and the attention scaling some RoPE variants apply) come from the
``transformers`` rotary module of the source model, so every static RoPE type transformers
knows (default, linear, llama3, yarn, proportional) is served with its exact frequencies.
Position-dependent types (dynamic NTK, longrope) change frequencies with the longest position
of each forward, which in a batch of several requests belongs to another request, so they are
refused (:func:`check_static_rope`), for our decoder and for transformers-wrapped models alike.
"""

from __future__ import annotations

import torch

__all__ = ["RotaryEmbedding", "STATIC_ROPE_TYPES", "rope_type_of", "check_static_rope"]

#: RoPE types whose frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def rope_type_of(config) -> str:
    """The RoPE type named by a transformers config (``rope_parameters`` or ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not params:
        return "default"
    return params.get("rope_type") or params.get("type") or "default"


def check_static_rope(config) -> None:
    """Raise ``ValueError`` unless the RoPE type of ``config`` is one of
    :data:`STATIC_ROPE_TYPES`.

    transformers recomputes dynamic-NTK and longrope frequencies from ``max(position_ids) + 1``
    of each forward; the engine runs several requests' tokens in one forward, so one request's
    rotation would depend on another's length (and on prefill chunking), and the tokens would
    silently differ from ``transformers.generate``. Cheap: it reads the config only, so callers
    check before loading the weights.
    """
    rtype = rope_type_of(config)
    if rtype not in STATIC_ROPE_TYPES:
        why = ("changes its frequencies with the sequence length"
               if rtype in ("dynamic", "longrope") else "is not a RoPE type the engine knows")
        raise ValueError(
            f"rope_type={rtype!r} (the config's rope_parameters) {why}; the engine serves "
            f"{', '.join(STATIC_ROPE_TYPES)}. Use a model with one of those."
        )


class RotaryEmbedding:
    """cos/sin tables ``[max_positions, head_dim]`` (float32, then the model dtype).

    Args:
        inv_freq: float32 ``[head_dim // 2]`` inverse frequencies.
        attention_scaling: factor applied to cos and sin (1.0 for plain RoPE).
        max_positions: table length; positions ≥ it raise.
        dtype / device: of the tables handed to :meth:`apply`.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int,
                 dtype: torch.dtype, device):
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float().cpu()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_scaling).to(device=device, dtype=dtype)
        self.max_positions = max_positions

    @classmethod
    def from_hf(cls, hf_model, max_positions: int, dtype: torch.dtype, device) -> "RotaryEmbedding":
        """Take the frequencies of ``hf_model.model.rotary_emb`` (a transformers model)."""
        check_static_rope(hf_model.config)
        rotary = hf_model.model.rotary_emb
        return cls(rotary.inv_freq, float(rotary.attention_scaling), max_positions, dtype, device)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``positions`` (int64 ``[T]``).

        Half-split convention: ``x·cos + rotate_half(x)·sin``, ``rotate_half(x) = [-x2, x1]``.
        """
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
