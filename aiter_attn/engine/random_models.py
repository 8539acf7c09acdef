"""Small random-weight transformers models for tests and GPU smoke runs (``--random-config``).

Weights are drawn with a seeded generator (``initializer_range`` larger than usual so logits
are well separated and greedy decoding is a sharp test). No download, no files.
"""

from __future__ import annotations

import torch

from .tokenizer import ByteTokenizer

__all__ = ["RANDOM_CONFIGS", "build_random_model"]

_COMMON = dict(vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6,
               hidden_act="silu", initializer_range=0.3, bos_token_id=1, eos_token_id=2,
               pad_token_id=0)

#: name → transformers config arguments (``model_type`` picks the config class).
RANDOM_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  tie_word_embeddings=False),
    "llama3": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                    "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64},
                   tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", hidden_size=80, intermediate_size=160,
                  num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
                  head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    tie_word_embeddings=False),
    # Served through engine/models/hf_wrapped.py (transformers modules, backend attention).
    "mistral-swa": dict(model_type="mistral", hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, sliding_window=8,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        tie_word_embeddings=False),
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                   attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                     "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 256,
                                     "truncate": False},
                    tie_word_embeddings=False),
    "deepseek_v2": dict(model_type="deepseek_v2", hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_group=1, topk_group=1,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        tie_word_embeddings=False),
}


def build_random_model(name: str, *, seed: int = 0, overrides: dict | None = None):
    """``(hf_model, tokenizer)``: a float32 random ``*ForCausalLM`` and a byte tokenizer.

    Args:
        name: a key of :data:`RANDOM_CONFIGS`.
        seed: weight seed (the global RNG state is left as it was).
        overrides: config fields to change (e.g. ``num_hidden_layers``).
    """
    if name not in RANDOM_CONFIGS:
        raise ValueError(
            f"random_config={name!r} is not known; choose one of {sorted(RANDOM_CONFIGS)}."
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(_COMMON)
    kwargs.update(RANDOM_CONFIGS[name])
    kwargs.update(overrides or {})
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model, ByteTokenizer(config.vocab_size)
