"""Defects found hunting the KV writes (``kernels/triton/kv_write.py``), the strategies' shared
helpers (``strategies/base.py``, ``strategies/common.py``) and the transformers integration
(``integrations/transformers.py``): each test failed before its fix.

transformers cases compare with transformers' own ``eager`` / ``sdpa`` attention on random-weight
models built from configs (no download), float32 on the CPU, by relative error.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

transformers = pytest.importorskip("transformers")

import aiter_attn.integrations.transformers as hf  # noqa: E402


class _Module(torch.nn.Module):
    """The attributes transformers' attention functions read from the calling layer."""

    def __init__(self, *, causal: bool, groups: int):
        super().__init__()
        self.is_causal, self.layer_idx, self.num_key_value_groups = causal, 0, groups
        self.eval()


def _qkv(b, h, hkv, tq, tk, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, tq, d, generator=g), torch.randn(b, hkv, tk, d, generator=g),
            torch.randn(b, hkv, tk, d, generator=g))


def _run(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).last_hidden_state


# ------------------------------------------------------------------ transformers integration
def test_hf_is_causal_keyword_overrides_the_module():
    """CLIP's text encoder layers are ``is_causal=False`` modules that transformers calls with
    ``is_causal=True`` (its ``sdpa`` takes the keyword over the module). Without padding the
    mask is skipped (``None``), and the keyword was ignored: every token attended to the
    tokens after it, silently (relative error ~1 against eager)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    hf.register()
    torch.manual_seed(0)
    cfg = CLIPTextConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = CLIPTextModel(cfg).eval()
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    eager = _run(model, "eager", input_ids=ids)
    ours = _run(model, "aiter_attn", input_ids=ids)
    assert_close_rel(ours, eager, 1e-5, "CLIP text (is_causal=True keyword) vs eager")
    # and the unit: a causal keyword on a non-causal module, no mask
    q, k, v = _qkv(1, 4, 2, 5, 5, 16, seed=3)
    module = _Module(causal=False, groups=2)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3, is_causal=True)
    out, _ = hf.attention_forward(module, q, k, v, None, scaling=0.3, is_causal=True)
    assert_close_rel(out, ref, 1e-5, "is_causal=True on an is_causal=False module")
    ref, _ = sdpa_attention_forward(_Module(causal=True, groups=2), q, k, v, None, scaling=0.3,
                                    is_causal=False)
    out, _ = hf.attention_forward(_Module(causal=True, groups=2), q, k, v, None, scaling=0.3,
                                  is_causal=False)
    assert_close_rel(out, ref, 1e-5, "is_causal=False on an is_causal=True module")


def test_hf_bidirectional_sliding_window_is_symmetric():
    """A bidirectional layer with a window (ModernBERT: ``sliding_window = half + 1``, mask
    ``|i - j| <= half``) sees ``w - 1`` keys on each side (transformers' flash convention
    ``(w - 1, w - 1)``). The window was laid out as ``(w - 1, -1)`` (left only), so every
    ModernBERT forward was refused as an inexpressible mask."""
    from transformers import ModernBertConfig, ModernBertModel
    from transformers.masking_utils import sdpa_mask, sliding_window_bidirectional_mask_function
    from transformers.models.llama.modeling_llama import eager_attention_forward

    hf.register()
    torch.manual_seed(0)
    cfg = ModernBertConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=4, local_attention=4,
                           global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, cls_token_id=1, sep_token_id=2)
    model = ModernBertModel(cfg).eval()
    ids = torch.randint(3, 99, (2, 11), generator=torch.Generator().manual_seed(1))
    eager = _run(model, "eager", input_ids=ids)
    ours = _run(model, "aiter_attn", input_ids=ids)
    assert_close_rel(ours, eager, 1e-5, "ModernBERT (bidirectional window 2) vs eager")

    # one call: the mask transformers builds, against eager
    b, h, hkv, t, d, half = 2, 4, 2, 9, 16, 2
    q, k, v = _qkv(b, h, hkv, t, t, d, seed=5)
    module = _Module(causal=False, groups=h // hkv)

    def mask_of(real):
        return sdpa_mask(batch_size=b, q_length=t, kv_length=t,
                         mask_function=sliding_window_bidirectional_mask_function(half),
                         attention_mask=real, allow_is_causal_skip=False)

    mask = mask_of(torch.ones(b, t, dtype=torch.bool))
    out, _ = hf.attention_forward(module, q, k, v, mask, scaling=0.3, sliding_window=half + 1)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    ref, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    assert_close_rel(out, ref, 1e-5, "bidirectional window vs eager")
    # left padding: padding queries see real keys through the window, at positions the kernel
    # cannot give them: refused by name (it failed inside the op with a seqused_k error)
    padded = mask_of(torch.tensor([[1] * 9, [0] * 4 + [1] * 5], dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask\[1, .*'sdpa' or 'eager'"):
        hf.attention_forward(module, q, k, v, padded, scaling=0.3, sliding_window=half + 1)


def test_hf_position_bias_is_refused_not_ignored():
    """T5-family models (and MPNet, LayoutLMv3, …) hand a relative-position bias to the
    attention function as ``position_bias=``; it was dropped, so a T5 encoder ran without its
    position information (relative error ~0.1 against eager), silently."""
    from transformers import T5Config, T5EncoderModel

    hf.register()
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    model = T5EncoderModel(cfg).eval()
    ids = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"position_bias=.*'sdpa' or 'eager'"):
        _run(model, "aiter_attn", input_ids=ids)
    q, k, v = _qkv(1, 4, 2, 3, 3, 16, seed=3)
    module = _Module(causal=True, groups=2)
    for name, value in [("sinks", torch.zeros(1, 4, 3, 1)), ("indices", torch.zeros(1, 3, 2)),
                        ("block_indices", torch.zeros(1, 1))]:
        with pytest.raises(ValueError, match=rf"{name}=.*'sdpa' or 'eager'"):
            hf.attention_forward(module, q, k, v, None, scaling=0.3, **{name: value})
    # keywords that do not change the attention are still ignored
    out, _ = hf.attention_forward(module, q, k, v, None, scaling=0.3, position_bias=None,
                                  position_ids=torch.arange(3)[None], cu_seq_lens_q=None)
    assert out.shape == (1, 3, 4, 16)


def test_hf_additive_mask_with_a_bias_is_refused():
    """A float mask carrying a bias (Falcon's ALiBi is folded into ``attention_mask``) was read
    as "visible where exactly 0": at a decode step only the key whose bias is 0 stayed, and the
    output was that key's value, silently. A 0 / masked float mask is still served."""
    q, k, v = _qkv(2, 4, 2, 1, 6, 16, seed=4)
    module = _Module(causal=True, groups=2)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])[None, :, None, None]
    alibi = slopes * (torch.arange(6.0) - 5.0)  # [1, H, 1, T_k]: 0 at the newest key
    mask = alibi.expand(2, 4, 1, 6).clone()
    mask[1, :, :, :2] = torch.finfo(torch.float32).min  # left padding of row 1
    with pytest.raises(ValueError, match=r"additive .* bias .*'sdpa' or 'eager'"):
        hf.attention_forward(module, q, k, v, mask, scaling=0.25)
    # the same padding as a plain additive mask: served, equal to eager
    from transformers.models.llama.modeling_llama import eager_attention_forward

    plain = torch.zeros(2, 1, 1, 6)
    plain[1, :, :, :2] = torch.finfo(torch.float32).min
    plain[0, :, :, 0] = float("-inf")
    out, _ = hf.attention_forward(module, q, k, v, plain, scaling=0.25)
    ref, _ = eager_attention_forward(module, q, k, v, plain, scaling=0.25)
    assert_close_rel(out, ref, 1e-5, "additive 0 / min mask")


# ------------------------------------------------------------------ strategies/base.py
def test_per_call_sinks_bind_once_and_follow_each_call():
    """``backend.forward(..., sinks=t)`` with a new tensor each step (``module.sinks.float()``,
    a strided view): the layer's binding was keyed by ``id(sinks)``, so every call added a
    binding (kept forever), and once a freed tensor's id was reused by the next one the
    binding made for the old tensor came back with the old sink values (a relative error of a
    few percent, silently). One binding per layer now, re-pointed at each call's sinks."""
    import attrs

    from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
    from aiter_attn.testing import PagedScenario

    cfg = BackendConfig(page_size=16, max_batch_size=4, max_context_len=256,
                        dtype=torch.float32, kernel_backend="reference")
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    sc = PagedScenario.make(cfg, [layer], [5, 20], seed=1)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        mode = ForwardMode.DECODE if step else ForwardMode.EXTEND
        batch = sc.next_batch(mode, [1, 1] if step else [3, 2])
        be.init_forward_metadata(batch)
        q, k, v = sc.step_inputs(layer)
        sinks = (torch.randn(8, generator=g) * 3)[::2]  # a new (strided) tensor each call
        out = be.forward(q, k, v, layer, batch, sinks=sinks)
        want = sc.expected(attrs.evolve(layer, sinks=sinks.contiguous()), q)
        assert_close_rel(out, want, 1e-5, f"step {step}: this call's sinks")
        sc.commit_step()
        del sinks
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        bindings = be.strategies_for(mode)[1]._layers
        assert len(bindings) == 1, f"{mode}: {len(bindings)} bindings for one layer"
