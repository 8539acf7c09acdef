"""Serve a ``transformers`` causal LM through the engine by replacing only its attention core.

Everything but attention (embeddings and their scaling, norms, MLP/MoE, rotary embeddings,
yarn, final logit soft-cap) stays the real transformers module, so conventions cannot drift.
The step's tokens run *packed*: one sequence of all the step's new tokens (``[1, T]``) with
each token's own position in ``position_ids``; attention is the only op that mixes tokens,
and it goes to :class:`~aiter_attn.AttentionBackend` over the paged KV cache:

* **standard attention** (Gemma-2, gpt-oss, Qwen2, Mistral, …): the one transformers
  registration of this package, :func:`aiter_attn.integrations.transformers.register`
  (``attn_implementation="aiter_attn"``). Inside
  :func:`~aiter_attn.integrations.transformers.route_to_backend` its attention function
  receives each layer's rotated q ``[1, H, T, D]`` and k/v ``[1, H_kv, T, D]`` and calls
  ``backend.forward`` with the layer's :class:`~aiter_attn.LayerSpec` (scaling, soft-cap,
  sliding window in the HF convention, sinks: read off the module when the model is wrapped),
  and its mask function builds no mask. The implementation is switched on only for the
  duration of :meth:`HFWrappedModel.forward`, so the same ``hf_model`` still runs its own
  attention elsewhere (``--check``).
* **MLA** (DeepSeek-V2): each ``DeepseekV2Attention`` gets an instance ``forward`` that, while
  the engine drives it, computes the latent ``[c_kv, k_pe]`` (norm and rotary as transformers
  does), hands the absorbed query ``[q_nope · W_UK, q_pe]`` and the latent to the backend
  (absorbed form, every mode; the latent is written to the MLA pool) and applies ``W_UV``
  and ``o_proj`` to the latent output; otherwise it defers to the class's own forward.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from typing import Optional

import torch

from ...backend import AttentionBackend
from ...batch import ForwardBatch
from ...strategies.mla import absorb_q, apply_w_uv, mla_layer_specs
from ...integrations import transformers as hf_integration
from ...types import LayerSpec
from ..protocol import KVLayout
from ..rope import check_static_rope

__all__ = ["HFWrappedModel", "WRAPPED_MODEL_TYPES", "ATTN_IMPLEMENTATION"]

log = logging.getLogger(__name__)

#: Name of the transformers attention implementation that calls the backend (the one
#: :func:`aiter_attn.integrations.transformers.register` adds).
ATTN_IMPLEMENTATION = hf_integration.ATTN_IMPLEMENTATION

#: ``config.model_type`` → how its attention is routed (``"standard"`` or ``"mla"``).
WRAPPED_MODEL_TYPES = {
    "gemma2": "standard",
    "gpt_oss": "standard",
    "qwen2": "standard",
    "mistral": "standard",
    "llama": "standard",
    "deepseek_v2": "mla",
}


def _mla_forward(self, hidden_states, attention_mask=None, cache=None, position_embeddings=None,
                 **kwargs):
    """DeepseekV2Attention.forward replacement (bound per instance; see the module docstring)."""
    route = hf_integration.active_route()
    if route is None or not isinstance(route.owner, HFWrappedModel):
        return type(self).forward(self, hidden_states, attention_mask, cache,
                                  position_embeddings, **kwargs)
    wrapper, batch, backend = route.owner, route.batch, route.backend
    spec = wrapper.layer_specs[self.layer_idx]
    w_uk, w_uv = wrapper.mla_weights[self.layer_idx]
    t = hidden_states.shape[1]
    h, nope, rope, rank = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim,
                           self.kv_lora_rank)
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(1, t, h, nope + rope).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    kv_nope, k_pe = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    c_kv = self.kv_a_layernorm(kv_nope).view(1, 1, t, rank)
    k_pe = k_pe.view(1, 1, t, rope)
    rotary = sys.modules[type(self).__module__].apply_rotary_emb
    q_pe, k_pe = rotary(q_pe, k_pe, position_embeddings.to(q_pe.device))
    q_abs = torch.cat([absorb_q(q_nope[0].transpose(0, 1), w_uk), q_pe[0].transpose(0, 1)], -1)
    latent = torch.cat([c_kv[0, 0], k_pe[0, 0]], dim=-1).unsqueeze(1)  # [T, 1, rank + rope]
    o = backend.forward(q_abs.reshape(t, -1), latent, None, spec, batch)  # [T, H * rank]
    o = apply_w_uv(o.view(t, h, rank), w_uv).reshape(1, t, h * self.v_head_dim)
    return self.o_proj(o), None


#: ``model_type``s whose attention modules keep no per-layer ``sliding_window`` but hand
#: ``config.sliding_window`` to the attention function of every layer (``MistralAttention``).
_CONFIG_WIDE_WINDOW_TYPES = ("mistral",)


def _sliding_window_of(module) -> Optional[int]:
    """The HF window ``module`` hands its attention function (``None`` = full attention)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    cfg = module.config
    if cfg.model_type in _CONFIG_WIDE_WINDOW_TYPES:
        return getattr(cfg, "sliding_window", None)
    return None


def _standard_spec(module, layer_id: int) -> LayerSpec:
    cfg = module.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = module.head_dim
    sinks = getattr(module, "sinks", None)
    cap = getattr(module, "attn_logit_softcapping", None)
    return LayerSpec(layer_id=layer_id, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                     scaling=float(module.scaling), logit_cap=float(cap or 0.0),
                     sliding_window=_sliding_window_of(module),
                     sinks=None if sinks is None else sinks.detach().float())


class HFWrappedModel:
    """An ``EngineModel`` running a transformers ``*ForCausalLM`` with backend attention.

    Build with :meth:`from_hf`. The wrapped model is used in place (its weights are not
    copied); activations are in the model's dtype, logits float32.

    Attributes:
        hf_model: the transformers model.
        layer_specs: per layer its LayerSpec (MLA: the absorbed form).
        kv_layout: pool sizes (MLA: one latent "head" of ``kv_lora_rank + rope`` dims).
        mla_weights: per MLA layer ``(w_uk [H, nope, rank], w_uv [H, v_dim, rank])``.
    """

    def __init__(self, hf_model, *, routing: str):
        config = hf_model.config
        self.hf_model = hf_model
        self.name = config.model_type
        self.dtype = next(hf_model.parameters()).dtype
        self.device = next(hf_model.parameters()).device
        self.vocab_size = int(config.vocab_size)
        self.routing = routing
        self.mla_weights: dict = {}
        attn_modules = [layer.self_attn for layer in hf_model.model.layers]
        if routing == "mla":
            self.layer_specs = [self._install_mla(m, i) for i, m in enumerate(attn_modules)]
            s0 = self.layer_specs[0]
            self.kv_layout = KVLayout(num_layers=len(attn_modules), num_kv_heads=1,
                                      head_dim=s0.head_dim, v_head_dim=s0.v_head_dim,
                                      dtype=self.dtype)
        else:
            hf_integration.register()
            self.layer_specs = [_standard_spec(m, i) for i, m in enumerate(attn_modules)]
            s0 = self.layer_specs[0]
            self.kv_layout = KVLayout(num_layers=len(attn_modules), num_kv_heads=s0.num_kv_heads,
                                      head_dim=s0.head_dim, v_head_dim=s0.v_head_dim,
                                      dtype=self.dtype)

    def _install_mla(self, module, layer_id: int) -> LayerSpec:
        h, nope, dv = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
        w = module.kv_b_proj.weight.detach().view(h, nope + dv, module.kv_lora_rank)
        self.mla_weights[layer_id] = (w[:, :nope].contiguous(), w[:, nope:].contiguous())
        module.forward = types.MethodType(_mla_forward, module)
        absorbed, _ = mla_layer_specs(layer_id, num_heads=h, kv_lora_rank=module.kv_lora_rank,
                                      qk_nope_head_dim=nope,
                                      qk_rope_head_dim=module.qk_rope_head_dim, v_head_dim=dv,
                                      scaling=float(module.scaling))
        return absorbed

    @classmethod
    def from_hf(cls, hf_model, **_) -> "HFWrappedModel":
        """Wrap ``hf_model`` (a ``*ForCausalLM`` of a :data:`WRAPPED_MODEL_TYPES` type)."""
        mtype = getattr(hf_model.config, "model_type", None)
        if mtype not in WRAPPED_MODEL_TYPES:
            raise ValueError(f"model_type={mtype!r} cannot be wrapped; supported: "
                             f"{', '.join(sorted(WRAPPED_MODEL_TYPES))}.")
        # transformers' rotary module would take dynamic/longrope frequencies from the longest
        # position of the packed step, i.e. from whichever request in it is longest.
        check_static_rope(hf_model.config)
        return cls(hf_model, routing=WRAPPED_MODEL_TYPES[mtype])

    @contextlib.contextmanager
    def _engine_attention(self):
        config = self.hf_model.config
        if self.routing == "mla":
            yield
            return
        before = config._attn_implementation
        config._attn_implementation_internal = ATTN_IMPLEMENTATION
        try:
            yield
        finally:
            config._attn_implementation_internal = before

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend,
                logits_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits float32 ``[len(logits_indices) or num_tokens, vocab]`` (see ``EngineModel``)."""
        with hf_integration.route_to_backend(self.layer_specs, batch, backend, owner=self), \
                self._engine_attention():
            out = self.hf_model(input_ids=input_ids[None], position_ids=positions[None],
                                use_cache=False,
                                logits_to_keep=0 if logits_indices is None else logits_indices)
        return out.logits[0].float()
