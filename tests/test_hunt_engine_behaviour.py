"""Defects found hunting the engine's behaviour (prefix sharing, chunked prefill, speculative
bookkeeping, stop/length limits, sampling, pool sizing; checked against transformers' greedy
``generate``): each test failed before its fix."""

import pytest

from aiter_attn.engine import (Engine, EngineConfig, LlamaFamilyModel, SamplingParams,
                               build_random_model, hf_greedy)

_PROMPT = [11, 402, 37, 250, 91]


@pytest.fixture(scope="module")
def models():
    hf, _ = build_random_model("llama", seed=0)
    return hf, LlamaFamilyModel.from_hf(hf, max_positions=128)


def test_request_whose_kv_fits_the_pool_exactly_is_served(models):
    """5 prompt tokens + 4 new ones hold K/V for 8 tokens (the last sampled token is never
    fed), i.e. 2 pages of 4: a pool of exactly 2 pages serves it. Admission reserved pages for
    prompt + max_new_tokens = 9 tokens (3 pages) and refused it ("raise the KV pool size")."""
    hf, model = models
    eng = Engine(model, EngineConfig(page_size=4, max_batch_size=1, max_context_len=64,
                                     kv_tokens=8))
    out = eng.generate([_PROMPT], SamplingParams(max_new_tokens=4))
    assert out == hf_greedy(hf, [_PROMPT], max_new_tokens=4, stop_token_ids=frozenset())
    assert eng.kv.allocator.free_pages == eng.kv.num_pages - 1


def test_two_requests_that_fit_together_run_together(models):
    """Two such requests need 2 pages each; a 4-page pool runs them in the same step (the
    over-reservation of 3 pages each made the second wait for the first to finish)."""
    hf, model = models
    prompts = [_PROMPT, _PROMPT[::-1]]
    eng = Engine(model, EngineConfig(page_size=4, max_batch_size=2, max_context_len=64,
                                     kv_tokens=16, prefix_caching=False))
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=4)) for p in prompts]
    eng.run()
    assert [r.joined_step for r in reqs] == [0, 0]
    assert [r.output_ids for r in reqs] == hf_greedy(hf, prompts, max_new_tokens=4,
                                                     stop_token_ids=frozenset())
    assert eng.kv.allocator.free_pages == eng.kv.num_pages - 1
