"""Engine settings and batches the engine must refuse up front, naming the fix: a context
longer than the model's position table, settings of zero that would silently fall back to a
default, and ``Engine.generate`` calls whose prompts and parameters do not line up (nothing is
queued when one of them is refused)."""

import pytest

from aiter_attn.engine import (Engine, EngineConfig, LlamaFamilyModel, SamplingParams,
                               build_random_model)

_MODELS: dict = {}


def _model(max_positions=64):
    if max_positions not in _MODELS:
        hf, _ = build_random_model("llama", seed=0)
        _MODELS[max_positions] = LlamaFamilyModel.from_hf(hf, max_positions=max_positions)
    return _MODELS[max_positions]


def _config(**kw):
    cfg = dict(page_size=4, max_batch_size=2, max_context_len=64, max_tokens_per_step=16)
    cfg.update(kw)
    return EngineConfig(**cfg)


def test_context_past_the_models_positions_is_refused_when_built():
    """A RoPE table of 64 positions cannot serve max_context_len=128: refused when the engine
    is built (it failed mid-run with an IndexError, or a device assert on CUDA)."""
    with pytest.raises(ValueError, match=r"max_context_len=128.*64 positions.*max_positions"):
        Engine(_model(64), _config(max_context_len=128))


def test_context_equal_to_the_models_positions_runs_to_the_limit():
    eng = Engine(_model(64), _config(max_context_len=64, kv_tokens=64))
    req = eng.add_request(list(range(3, 60)), SamplingParams(max_new_tokens=20))
    eng.run()
    assert req.finish_reason == "length" and req.num_tokens == 64


@pytest.mark.parametrize("field", ["page_size", "max_batch_size", "max_context_len",
                                   "max_tokens_per_step", "chunk_size", "kv_tokens",
                                   "num_draft_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_settings_below_one_are_refused(field, value):
    """``chunk_size=0`` and ``kv_tokens=0`` used to mean "the default" without a word."""
    with pytest.raises(ValueError, match=rf"{field}={value} must be an int ≥ 1"):
        _config(**{field: value})


def test_optional_settings_left_out_keep_their_defaults():
    cfg = _config(chunk_size=None, kv_tokens=None)
    assert cfg.num_pages == -(-2 * 64 // 4) + 1


def test_generate_with_fewer_params_than_prompts_is_refused():
    """Two parameter sets for three prompts silently dropped the third prompt."""
    eng = Engine(_model(), _config())
    with pytest.raises(ValueError, match=r"3 prompts but 2 SamplingParams"):
        eng.generate([[5, 6], [7, 8], [9]], [SamplingParams(max_new_tokens=2)] * 2)
    assert not eng.has_work and not eng.requests


def test_generate_refusing_one_prompt_queues_none():
    """An empty third prompt is refused before the first two are queued: the next call serves
    only its own prompts (the refused call's requests used to run then)."""
    eng = Engine(_model(), _config())
    with pytest.raises(ValueError, match="request 2 has an empty prompt"):
        eng.generate([[5, 6], [7, 8], []], SamplingParams(max_new_tokens=2))
    assert not eng.has_work and not eng.requests
    out = eng.generate([[5, 6]], SamplingParams(max_new_tokens=2))
    assert len(out) == 1 and len(eng.requests) == 1 and eng.requests[0].rid == 0
