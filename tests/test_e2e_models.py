"""End to end through the engine, token for token against transformers' greedy ``generate``
(float32, random weights): Qwen2 and Mistral with sliding windows, Gemma-2 (soft-cap,
alternating local/global layers, query_pre_attn_scalar), gpt-oss (sinks, alternating windows,
MoE, yarn) and DeepSeek-V2 (MLA, MoE).

Every case runs prompts of 9..40 tokens (windows of 8 tokens, so windows bite) in one
continuous batch with fewer rows than prompts (a request joins while others decode), prefill
chunked under a small token budget, and block-permuted pages. The runner picks the pool from
the model's layer specs: the hybrid SWA pool for windowed models (out-of-window SWA pages are
returned while requests run), the MLA latent pool for DeepSeek-V2.
"""

import copy

import attrs
import pytest
import torch

from aiter_attn.engine import (Engine, EngineConfig, SamplingParams, build_random_model,
                               compare_outputs, hf_greedy)
from aiter_attn.engine.arch import model_arch
from aiter_attn.engine.models import HFWrappedModel, build_engine_model
from aiter_attn.kvcache import MLAKVPool, MHAKVPool, SWAKVPool
from aiter_attn.types import AttnArch

_MODELS: dict = {}
_MAX_NEW = 10


def _model(name, wrap=False, **overrides):
    key = (name, wrap, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        hf, _ = build_random_model(name, seed=0, overrides=overrides or None)
        _MODELS[key] = (hf, build_engine_model(hf, wrap=wrap, max_positions=256))
    return _MODELS[key]


def _prompts(lens, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _assert_same(hf, prompts, ours):
    theirs = hf_greedy(hf, prompts, max_new_tokens=_MAX_NEW, stop_token_ids=frozenset())
    diffs = compare_outputs(ours, theirs)
    assert not diffs, "; ".join(d.describe() for d in diffs)


def _generate(engine_model, prompts, **kw):
    cfg = dict(page_size=4, max_batch_size=3, max_context_len=128, max_tokens_per_step=24,
               shuffle_pages_seed=7)
    cfg.update(kw)
    engine = Engine(engine_model, EngineConfig(**cfg))
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=_MAX_NEW))
    freed = []  # per step: some running request has a page whose SWA copy was returned

    def on_step(events):
        alloc = engine.kv.allocator
        if hasattr(alloc, "swa_pages_of"):
            freed.append(any(0 in alloc.swa_pages_of(r.row) for r in engine.requests
                             if r.row is not None))

    engine.run(on_step=on_step)
    return engine, [r.output_ids for r in engine.requests], freed


_LENS = (23, 31, 9, 40)

CASES = [
    pytest.param("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                 AttnArch.SWA, id="qwen2-window8-layer1-own-decoder"),
    pytest.param("mistral-swa", {}, AttnArch.SWA, id="mistral-window8-own-decoder"),
    pytest.param("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                               wrap=True),
                 AttnArch.SWA, id="qwen2-window8-layer1-transformers-modules"),
    pytest.param("gemma2", {}, AttnArch.SWA, id="gemma2-softcap-alternating-window8"),
    pytest.param("gpt_oss", {}, AttnArch.SWA, id="gpt_oss-sinks-window8-moe-yarn"),
    pytest.param("deepseek_v2", {}, AttnArch.MLA, id="deepseek_v2-mla-moe"),
]


@pytest.mark.parametrize("name,overrides,arch", CASES)
def test_greedy_matches_transformers(name, overrides, arch):
    hf, model = _model(name, **overrides)
    assert model_arch(model) is arch
    prompts = _prompts(_LENS, seed=len(name))
    engine, ours, freed = _generate(model, prompts)
    pool = engine.runner.kv_pool
    if arch is AttnArch.SWA:
        assert isinstance(pool, SWAKVPool) and pool.swa.num_pages < pool.full.num_pages
        assert any(freed)  # out-of-window SWA pages went back while requests were running
        assert engine.kv.allocator.swa_free_pages == pool.swa.num_pages - 1
    else:
        assert isinstance(pool, MLAKVPool)
    assert engine.kv.allocator.free_pages == engine.kv.num_pages - 1
    _assert_same(hf, prompts, ours)


def test_model_features_reach_the_layer_specs():
    """What the wrapped models hand the backend, read off the transformers modules."""
    _, gemma = _model("gemma2")
    assert isinstance(gemma, HFWrappedModel)
    assert [s.sliding_window for s in gemma.layer_specs] == [8, None, 8, None]
    assert all(s.logit_cap == 5.0 for s in gemma.layer_specs)
    assert gemma.layer_specs[0].scaling == pytest.approx(24 ** -0.5)
    _, oss = _model("gpt_oss")
    assert [s.sliding_window for s in oss.layer_specs] == [8, None]
    assert all(s.sinks is not None and s.sinks.shape == (4,) for s in oss.layer_specs)
    _, ds = _model("deepseek_v2")
    s0 = ds.layer_specs[0]
    assert (s0.num_kv_heads, s0.head_dim, s0.v_head_dim, s0.kv_lora_rank) == (1, 40, 32, 32)
    assert s0.scaling == pytest.approx((16 + 8) ** -0.5)


def test_windows_over_the_full_pool_match_too():
    """``swa_pool=False``: gpt-oss windows and sinks applied by the kernel over the MHA pool."""
    hf, model = _model("gpt_oss")
    assert model_arch(model, swa_pool=False) is AttnArch.MHA
    prompts = _prompts((21, 33), seed=3)
    engine, ours, _ = _generate(model, prompts, swa_pool=False, page_size=3)
    assert isinstance(engine.runner.kv_pool, MHAKVPool)
    _assert_same(hf, prompts, ours)


def test_wrapped_model_leaves_transformers_attention_alone():
    """Wrapping switches the backend attention on only inside the engine's forward."""
    hf, _ = _model("gemma2")
    assert hf.config._attn_implementation != "aiter_attn"
    x = torch.tensor([_prompts((12,), seed=1)[0]])
    with torch.inference_mode():
        hf(input_ids=x)  # runs transformers' own attention, no engine needed


@pytest.mark.parametrize("name,drop", [
    pytest.param("gemma2", dict(sliding_window=None), id="gemma2-without-windows"),
    pytest.param("gemma2", dict(logit_cap=0.0), id="gemma2-without-softcap"),
    pytest.param("gpt_oss", dict(sinks=None), id="gpt_oss-without-sinks"),
    pytest.param("gpt_oss", dict(sliding_window=None), id="gpt_oss-without-windows"),
])
def test_each_feature_changes_the_output(name, drop):
    """The matches above are not vacuous: serving the same weights without one feature gives
    other tokens (so windows, soft-cap and sinks really reach the kernels)."""
    _, model = _model(name)
    prompts = _prompts((40,), seed=11)
    _, ours, _ = _generate(model, prompts)
    stripped = copy.copy(model)
    stripped.layer_specs = [attrs.evolve(s, **drop) for s in model.layer_specs]
    _, theirs, _ = _generate(stripped, prompts)
    assert ours != theirs


def test_unsupported_model_type_names_every_supported_one():
    from types import SimpleNamespace

    from aiter_attn.engine import UnsupportedArchitectureError

    fake = SimpleNamespace(config=SimpleNamespace(model_type="bert", architectures=["BertModel"]))
    with pytest.raises(UnsupportedArchitectureError, match="deepseek_v2.*gemma2.*gpt_oss"):
        build_engine_model(fake)
