"""Our own Llama-family decoder whose attention layers call :class:`AttentionBackend`.

Covers Llama (1/2/3, incl. llama3-style RoPE scaling), Mistral and Qwen2: RMSNorm, RoPE, GQA,
SwiGLU MLP, optional q/k/v (and o) biases, tied embeddings, per-layer sliding windows in the
HF convention. Weights are taken from a ``transformers`` model's ``state_dict`` (biases are used
exactly where the checkpoint has them). The math follows transformers' float32 order of
operations so that greedy decoding is token-identical to ``transformers`` in float32.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import attrs
import torch
import torch.nn.functional as F

from ..backend import AttentionBackend
from ..batch import ForwardBatch
from ..types import LayerSpec
from .protocol import KVLayout
from .rope import RotaryEmbedding

__all__ = ["LlamaFamilyModel", "SUPPORTED_MODEL_TYPES", "UnsupportedArchitectureError",
           "check_supported"]

log = logging.getLogger(__name__)

#: ``config.model_type`` → the transformers class the engine's decoder reproduces.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


class UnsupportedArchitectureError(ValueError):
    """The model's architecture is not one the engine's decoder implements."""


def check_supported(config) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless ``config`` is a supported decoder."""
    mtype = getattr(config, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        archs = getattr(config, "architectures", None) or [mtype]
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODEL_TYPES.items())
        raise UnsupportedArchitectureError(
            f"model_type={mtype!r} ({', '.join(map(str, archs))}) is not supported by the engine; "
            f"supported: {supported}. Pass --model with one of those, or --random-config."
        )
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedArchitectureError(
            f"hidden_act={act!r}: the engine's MLP is SwiGLU (silu); use a model with silu."
        )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / sqrt(mean(x²) + eps)``, computed in float32 (transformers' order)."""
    dtype = x.dtype
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


@attrs.define(eq=False)
class _DecoderLayer:
    """Weights of one decoder layer (biases ``None`` where the checkpoint has none)."""

    spec: LayerSpec
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: Optional[torch.Tensor]
    bk: Optional[torch.Tensor]
    bv: Optional[torch.Tensor]
    bo: Optional[torch.Tensor]
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    b_gate: Optional[torch.Tensor]
    b_up: Optional[torch.Tensor]
    b_down: Optional[torch.Tensor]


class LlamaFamilyModel:
    """Llama/Mistral/Qwen2 decoder over the paged KV cache (implements ``EngineModel``).

    Build with :meth:`from_hf`. Activations ``[num_tokens, hidden]`` in ``dtype``; logits float32.
    """

    def __init__(self, *, embed: torch.Tensor, layers: list, final_norm: torch.Tensor,
                 lm_head: torch.Tensor, rope: RotaryEmbedding, eps: float, act: Callable,
                 dtype: torch.dtype, device: torch.device, name: str = "llama"):
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.rope = rope
        self.eps = eps
        self.act = act
        self.dtype = dtype
        self.device = torch.device(device)
        self.name = name
        self.vocab_size = int(lm_head.shape[0])
        self.layer_specs = [layer.spec for layer in layers]
        s0 = self.layer_specs[0]
        self.kv_layout = KVLayout(num_layers=len(layers), num_kv_heads=s0.num_kv_heads,
                                  head_dim=s0.head_dim, v_head_dim=s0.v_head_dim, dtype=dtype)

    @property
    def max_positions(self) -> int:
        """Length of the RoPE table: positions must be below it (the engine refuses a longer
        ``max_context_len``)."""
        return self.rope.max_positions

    @classmethod
    def from_hf(cls, hf_model, *, dtype: torch.dtype = torch.float32, device="cpu",
                max_positions: Optional[int] = None, progress=None) -> "LlamaFamilyModel":
        """Copy the weights of a transformers Llama/Mistral/Qwen2 causal LM.

        Args:
            hf_model: a loaded ``*ForCausalLM`` of a supported ``model_type``.
            dtype / device: of our weights and activations.
            max_positions: RoPE table length (default ``config.max_position_embeddings``).
            progress: optional tqdm-like object; ``update(1)`` per layer copied.
        """
        config = hf_model.config
        check_supported(config)
        sd = hf_model.state_dict()

        def w(name: str, required: bool = True) -> Optional[torch.Tensor]:
            t = sd.get(name)
            if t is None:
                if required:
                    raise KeyError(f"checkpoint has no tensor {name!r}; is it a "
                                   f"{config.model_type} causal LM checkpoint?")
                return None
            return t.detach().to(device=device, dtype=dtype).contiguous()

        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
        windows = _sliding_windows(config)
        layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            spec = LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                             scaling=head_dim ** -0.5, sliding_window=windows[i])
            layers.append(_DecoderLayer(
                spec=spec,
                input_norm=w(p + "input_layernorm.weight"),
                post_attn_norm=w(p + "post_attention_layernorm.weight"),
                wq=w(p + "self_attn.q_proj.weight"), wk=w(p + "self_attn.k_proj.weight"),
                wv=w(p + "self_attn.v_proj.weight"), wo=w(p + "self_attn.o_proj.weight"),
                bq=w(p + "self_attn.q_proj.bias", False), bk=w(p + "self_attn.k_proj.bias", False),
                bv=w(p + "self_attn.v_proj.bias", False), bo=w(p + "self_attn.o_proj.bias", False),
                w_gate=w(p + "mlp.gate_proj.weight"), w_up=w(p + "mlp.up_proj.weight"),
                w_down=w(p + "mlp.down_proj.weight"),
                b_gate=w(p + "mlp.gate_proj.bias", False), b_up=w(p + "mlp.up_proj.bias", False),
                b_down=w(p + "mlp.down_proj.bias", False),
            ))
            if progress is not None:
                progress.update(1)
        embed = w("model.embed_tokens.weight")
        lm_head = w("lm_head.weight", required=False)
        if lm_head is None or getattr(config, "tie_word_embeddings", False):
            lm_head = embed
        max_positions = max_positions or getattr(config, "max_position_embeddings", 4096)
        rope = RotaryEmbedding.from_hf(hf_model, max_positions, dtype, device)
        return cls(embed=embed, layers=layers, final_norm=w("model.norm.weight"), lm_head=lm_head,
                   rope=rope, eps=float(config.rms_norm_eps), act=F.silu, dtype=dtype,
                   device=device, name=config.model_type)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend,
                logits_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits float32 ``[len(logits_indices) or num_tokens, vocab]`` (see ``EngineModel``)."""
        h = F.embedding(input_ids, self.embed)
        n = h.shape[0]
        for layer in self.layers:
            s = layer.spec
            x = _rms_norm(h, layer.input_norm, self.eps)
            q = F.linear(x, layer.wq, layer.bq).view(n, s.num_q_heads, s.head_dim)
            k = F.linear(x, layer.wk, layer.bk).view(n, s.num_kv_heads, s.head_dim)
            v = F.linear(x, layer.wv, layer.bv)
            q, k = self.rope.apply(q, k, positions)
            o = backend.forward(q.reshape(n, -1), k.reshape(n, -1), v, s, batch)
            h = h + F.linear(o, layer.wo, layer.bo)
            x = _rms_norm(h, layer.post_attn_norm, self.eps)
            gate = self.act(F.linear(x, layer.w_gate, layer.b_gate))
            h = h + F.linear(gate * F.linear(x, layer.w_up, layer.b_up), layer.w_down, layer.b_down)
        if logits_indices is not None:
            h = h[logits_indices]
        h = _rms_norm(h, self.final_norm, self.eps)
        return F.linear(h, self.lm_head).float()


def _sliding_windows(config) -> list:
    """Per-layer HF ``sliding_window`` (``None`` = full attention), as the transformers class
    of ``config.model_type`` applies it: Qwen2 on the layers its ``layer_types`` mark
    ``"sliding_attention"``; Mistral on every layer (``MistralAttention`` passes
    ``config.sliding_window`` to each layer and ignores ``layer_types``); Llama on none
    (``LlamaAttention`` has no window, whatever ``sliding_window`` or ``layer_types`` say)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return [window] * n
    if config.model_type == "qwen2":
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            return [window if t == "sliding_attention" else None for t in layer_types]
    return [None] * n
