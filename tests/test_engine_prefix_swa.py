"""Prefix caching with the hybrid SWA pool, against transformers (float32, random weights).

A request reuses a running donor's whole prefix pages only while the donor still holds the SWA
copies of the pages covering the prefix's last window (window 8, page 4 here); otherwise it
recomputes its prompt. Once shared, a page keeps its SWA copy until it has left the window of
every request holding it: the donor decodes ahead while the sharer prefills one token per
step, so the donor alone would have returned pages the sharer still reads. After every step,
every running request must still hold the SWA pages of its own window (checked directly), and
the generated ids must equal transformers' greedy ``generate``.
"""

import pytest
import torch

from aiter_attn.engine import (Engine, EngineConfig, SamplingParams, build_random_model,
                               compare_outputs, hf_greedy)
from aiter_attn.engine.models import build_engine_model
from aiter_attn.kvcache import SWAKVPool

_WINDOW, _PAGE = 8, 4
_MODELS: dict = {}

_WINDOWED = {
    "qwen2": dict(use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1),
    "mistral-swa": {},  # every layer windowed (sliding_window=8)
}


def _model(name):
    if name not in _MODELS:
        hf, _ = build_random_model(name, seed=0, overrides=_WINDOWED[name] or None)
        _MODELS[name] = (hf, build_engine_model(hf, max_positions=256))
    return _MODELS[name]


def _assert_same(hf, prompts, outputs, max_new):
    theirs = hf_greedy(hf, prompts, max_new_tokens=max_new, stop_token_ids=frozenset())
    diffs = compare_outputs(outputs, theirs)
    assert not diffs, "; ".join(d.describe() for d in diffs)


def _assert_windows_held(engine):
    """Every running request holds the SWA copy of each page its next query can see."""
    alloc = engine.kv.allocator
    for r in engine.requests:
        if r.row is None:
            continue
        swa = alloc.swa_pages_of(r.row)
        first = max(r.num_computed - _WINDOW + 1, 0) // _PAGE
        missing = [i for i in range(first, len(swa)) if swa[i] == 0]
        assert not missing, (f"request {r.rid} (next position {r.num_computed}) lost the SWA "
                             f"pages {missing} of its window")


def _run(engine):
    while engine.has_work:
        engine.step()
        _assert_windows_held(engine)


def _base(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist(), g


@pytest.mark.parametrize("name", [pytest.param("qwen2", id="qwen2-window8-layer1"),
                                  pytest.param("mistral-swa", id="mistral-window8-all-layers")])
@pytest.mark.parametrize("cuda_graph", [pytest.param(False, id="eager"),
                                        pytest.param(True, id="graphs")])
def test_shared_prefix_within_window_is_reused_and_kept(name, cuda_graph):
    """Donor ``a`` computed 37 tokens (SWA pages of tokens < 28 returned); ``b`` shares 36
    tokens, whose last window (tokens 29..35, pages 7-8) ``a`` still holds: ``b`` reuses 9
    pages and prefills its 9-token rest one token per step while ``a`` decodes past them."""
    hf, model = _model(name)
    base, g = _base(37)
    p1 = base
    p2 = base[:36] + torch.randint(3, 512, (9,), generator=g).tolist()
    eng = Engine(model, EngineConfig(page_size=_PAGE, max_batch_size=2, max_context_len=96,
                                     max_tokens_per_step=64, chunk_size=64, shuffle_pages_seed=5,
                                     cuda_graph=cuda_graph))
    assert isinstance(eng.runner.kv_pool, SWAKVPool) and eng.kv.prefix_caching
    a = eng.add_request(p1, SamplingParams(max_new_tokens=16))
    eng.step()
    assert 0 in eng.kv.allocator.swa_pages_of(a.row)  # a returned out-of-window SWA pages
    eng.scheduler.chunk_size = 1  # b prefills token by token while a decodes ahead
    b = eng.add_request(p2, SamplingParams(max_new_tokens=8))
    eng.step()
    assert b.cached_tokens == 36
    assert eng.kv.allocator.pages_of(b.row)[:9] == eng.kv.allocator.pages_of(a.row)[:9]
    _run(eng)
    assert eng.stats.prefill_tokens == len(p1) + len(p2) - 36
    if cuda_graph:
        assert eng.runner.graphs.replays["DECODE"] > 0
    _assert_same(hf, [p1], [a.output_ids], 16)
    _assert_same(hf, [p2], [b.output_ids], 8)
    alloc = eng.kv.allocator
    assert alloc.free_pages == eng.kv.num_pages - 1
    assert alloc.swa_free_pages == eng.runner.kv_pool.swa.num_pages - 1


def test_prefix_whose_window_was_returned_is_recomputed():
    """``b`` shares 30 tokens (28 in whole pages) but ``a`` already returned the SWA pages of
    tokens 21..27: nothing is reused, ``b`` prefills its whole prompt and still matches."""
    hf, model = _model("qwen2")
    base, g = _base(37, seed=4)
    p1 = base
    p2 = base[:30] + torch.randint(3, 512, (9,), generator=g).tolist()
    eng = Engine(model, EngineConfig(page_size=_PAGE, max_batch_size=2, max_context_len=96,
                                     max_tokens_per_step=64, shuffle_pages_seed=6))
    a = eng.add_request(p1, SamplingParams(max_new_tokens=12))
    eng.step()
    b = eng.add_request(p2, SamplingParams(max_new_tokens=12))
    eng.step()
    assert b.cached_tokens == 0 and not b.shared_pages
    _run(eng)
    assert eng.stats.prefill_tokens == len(p1) + len(p2)
    _assert_same(hf, [p1, p2], [a.output_ids, b.output_ids], 12)
