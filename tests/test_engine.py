"""The reference engine against transformers: greedy token identity on small random Llama,
Qwen2 and Mistral models through continuous batching (requests of different lengths, joins
while others decode, chunked prefill under a small budget, block-permuted pages, shared
prefixes), plus stop tokens and seeded sampling."""

import pytest
import torch

from aiter_attn.engine import (Engine, EngineConfig, LlamaFamilyModel, SamplingParams,
                               build_random_model, compare_outputs, hf_greedy, stop_token_ids)
from aiter_attn.types import ForwardMode

_MODELS: dict = {}


def _model(name, seed=0, **overrides):
    key = (name, seed, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        hf, tok = build_random_model(name, seed=seed, overrides=overrides or None)
        _MODELS[key] = (hf, tok, LlamaFamilyModel.from_hf(hf, max_positions=512))
    return _MODELS[key]


def _prompts(n, seed=0, lo=3, hi=40, vocab=512):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]


def _engine(model, **kw):
    cfg = dict(page_size=4, max_batch_size=3, max_context_len=256, max_tokens_per_step=24,
               shuffle_pages_seed=5)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def _assert_same(ours, hf, prompts, max_new, stops):
    theirs = hf_greedy(hf, prompts, max_new_tokens=max_new, stop_token_ids=stops)
    diffs = compare_outputs(ours, theirs)
    assert not diffs, "; ".join(d.describe() for d in diffs)


def _free_pages_all_back(engine):
    assert engine.kv.allocator.free_pages == engine.kv.num_pages - 1
    assert engine.kv.available_rows == engine.config.max_batch_size


@pytest.mark.parametrize("name,page_size", [
    pytest.param("llama", 4, id="llama-GQA4:2-page4"),
    pytest.param("llama3", 1, id="llama3rope-MQA-page1"),
    pytest.param("qwen2", 7, id="qwen2-bias-tied-GQA5:1-page7"),
    pytest.param("mistral", 16, id="mistral-page16"),
])
def test_continuous_batch_matches_transformers(name, page_size):
    """Five prompts of different lengths, at most three running: later requests join while
    others decode; prefill is chunked under a 24-token budget; outputs equal transformers'."""
    hf, tok, model = _model(name)
    prompts = _prompts(5, seed=1)
    eng = _engine(model, page_size=page_size)
    stops = stop_token_ids(hf, tok)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=12, stop_token_ids=stops))
            for p in prompts]
    mixed_join = False
    while eng.has_work:
        plan_step = eng.scheduler.step_index
        eng.step()
        joined = [r for r in reqs if r.joined_step == plan_step]
        decoding = [r for r in reqs if r.joined_step is not None and r.joined_step < plan_step
                    and r.output_ids]
        mixed_join |= bool(plan_step > 0 and joined and decoding)
    assert mixed_join, "no request joined while others were decoding"
    _assert_same([r.output_ids for r in reqs], hf, prompts, 12, stops)
    _free_pages_all_back(eng)


def test_join_between_steps_matches_transformers():
    """A request added after others have decoded for several steps joins the running batch."""
    hf, tok, model = _model("qwen2")
    p = _prompts(3, seed=2)
    eng = _engine(model, page_size=5)
    a = eng.add_request(p[0], SamplingParams(max_new_tokens=16))
    b = eng.add_request(p[1], SamplingParams(max_new_tokens=16))
    for _ in range(6):
        eng.step()
    assert a.output_ids and b.output_ids and not a.finished
    c = eng.add_request(p[2], SamplingParams(max_new_tokens=16))
    eng.run()
    assert c.joined_step == 6
    _assert_same([a.output_ids, b.output_ids, c.output_ids], hf, p, 16, frozenset())


@pytest.mark.parametrize("donor_finishes_first", [
    pytest.param(False, id="donor-still-running"),
    pytest.param(True, id="donor-finishes-first"),
])
def test_shared_prefix_reuses_pages(donor_finishes_first):
    """A second prompt starting like the first reuses the first's whole computed pages (the
    same page ids, reference counted), computes only the rest, and still matches."""
    hf, tok, model = _model("llama")
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 512, (37,), generator=g).tolist()
    p1 = base
    p2 = base[:30] + torch.randint(3, 512, (9,), generator=g).tolist()
    eng = _engine(model, page_size=8, max_tokens_per_step=64)
    a = eng.add_request(p1, SamplingParams(max_new_tokens=3 if donor_finishes_first else 20))
    eng.step()  # a's whole prompt is computed
    b = eng.add_request(p2, SamplingParams(max_new_tokens=10))
    eng.step()  # b joins and shares a's first 3 whole pages (24 tokens ≤ 30 common)
    assert b.cached_tokens == 24
    a_pages = a.pages if a.finished else eng.kv.allocator.pages_of(a.row)
    assert b.shared_pages == a_pages[:3]
    assert eng.kv.allocator.pages_of(b.row)[:3] == a_pages[:3]
    if not a.finished:
        assert all(eng.kv.page_refcount(pg) == 2 for pg in a_pages[:3])
    eng.run()
    assert eng.stats.prefill_tokens == len(p1) + len(p2) - 24
    _assert_same([a.output_ids], hf, [p1], a.params.max_new_tokens, frozenset())
    _assert_same([b.output_ids], hf, [p2], 10, frozenset())
    _free_pages_all_back(eng)


def test_prefix_caching_off_shares_nothing():
    hf, tok, model = _model("llama")
    p = _prompts(1, seed=4, lo=30, hi=31)[0]
    eng = _engine(model, page_size=8, prefix_caching=False)
    eng.add_request(p, SamplingParams(max_new_tokens=8))
    eng.step()
    eng.step()
    b = eng.add_request(p, SamplingParams(max_new_tokens=8))
    eng.run()
    assert b.cached_tokens == 0 and not b.shared_pages


def test_chunked_prefill_under_small_budget():
    """A 100-token prompt under an 11-token budget prefills in chunks of ≤ 11 tokens and gives
    the same ids as one unchunked prefill and as transformers."""
    hf, tok, model = _model("qwen2")
    p = _prompts(1, seed=5, lo=100, hi=101)[0]
    eng = _engine(model, page_size=6, max_tokens_per_step=11)
    req = eng.add_request(p, SamplingParams(max_new_tokens=8))
    plans = []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    eng.run()
    chunks = [n for plan in plans for _, n in plan.prefill]
    assert chunks == [11] * 9 + [1]
    assert all(sum(n for _, n in plan.prefill) + len(plan.decode) <= 11 for plan in plans)
    whole = _engine(model, page_size=6, max_tokens_per_step=512)
    assert whole.generate([p], SamplingParams(max_new_tokens=8)) == [req.output_ids]
    _assert_same([req.output_ids], hf, [p], 8, frozenset())


def test_logits_match_transformers_forward():
    """One EXTEND forward over a whole prompt gives transformers' float32 logits for every
    token (relative error), through the paged backend with a block-permuted pool."""
    from aiter_attn.engine import EngineModel

    hf, tok, model = _model("qwen2")
    assert isinstance(model, EngineModel)  # the runner's only view of a model
    p = _prompts(1, seed=6, lo=33, hi=34)[0]
    eng = _engine(model, page_size=7)
    req = eng.add_request(p, SamplingParams(max_new_tokens=1))
    eng.scheduler.schedule()
    n = len(p)
    runner = eng.runner
    captured = {}
    orig = model.forward

    def spy(input_ids, positions, batch, backend, logits_indices=None):
        captured["logits"] = orig(input_ids, positions, batch, backend, None)
        return captured["logits"][logits_indices]

    model.forward = spy
    try:
        runner.forward(ForwardMode.EXTEND, [(req, n)])
    finally:
        del model.forward
    with torch.inference_mode():
        ref = hf(torch.tensor([p])).logits[0].double()
    err = (captured["logits"].double() - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative error {err:.2e}"


def test_stop_token_ends_request():
    hf, tok, model = _model("llama")
    p = _prompts(2, seed=7)
    free = _engine(model).generate(p, SamplingParams(max_new_tokens=20))
    out = free[0]
    k = next(i for i in range(2, len(out)) if out[i] not in out[:i])
    stop = frozenset({out[k]})
    eng = _engine(model)
    reqs = [eng.add_request(q, SamplingParams(max_new_tokens=20, stop_token_ids=stop)) for q in p]
    eng.run()
    assert reqs[0].output_ids == out[: k + 1] and reqs[0].finish_reason == "stop"
    assert all(r.finish_reason in ("stop", "length") for r in reqs)
    _assert_same([r.output_ids for r in reqs], hf, p, 20, stop)
    _free_pages_all_back(eng)


def test_seeded_sampling_is_reproducible():
    """Temperature + top-p with a seed gives the same ids alone or inside a busier batch; a
    different seed gives different ids."""
    hf, tok, model = _model("llama")
    p = _prompts(4, seed=8)
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, seed=11)
    alone = _engine(model).generate([p[0]], sp)[0]
    eng = _engine(model)
    r = eng.add_request(p[0], sp)
    for q in p[1:]:
        eng.add_request(q, SamplingParams(max_new_tokens=24, temperature=1.0, seed=3))
    eng.run()
    assert r.output_ids == alone
    other = _engine(model).generate([p[0]], SamplingParams(max_new_tokens=24, temperature=0.9,
                                                            top_p=0.9, seed=12))[0]
    assert other != alone


def test_top_p_filter_hand_computed():
    from aiter_attn.engine.sampler import top_p_filter

    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    torch.testing.assert_close(top_p_filter(probs, 0.7), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(top_p_filter(probs, 0.5), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(top_p_filter(probs, 1.0), probs)


@pytest.mark.parametrize("name,overrides", [
    pytest.param("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                 id="qwen2-window8-on-layer1"),
    pytest.param("mistral", dict(sliding_window=6), id="mistral-window6"),
])
def test_sliding_window_layers_match_transformers(name, overrides):
    """HF ``sliding_window`` layers (served over the full pool with a window mask) match
    transformers; the window changes the output, so it is really applied."""
    hf, tok, model = _model(name, **overrides)
    hf_full, _, _ = _model(name)
    p = _prompts(3, seed=9, lo=20, hi=40)
    ours = _engine(model, page_size=4).generate(p, SamplingParams(max_new_tokens=10))
    _assert_same(ours, hf, p, 10, frozenset())
    assert ours != hf_greedy(hf_full, p, max_new_tokens=10, stop_token_ids=frozenset())


@pytest.mark.parametrize("case,match", [
    pytest.param("empty", "empty prompt", id="empty-prompt"),
    pytest.param("too-long", "max_context_len", id="prompt-over-context"),
    pytest.param("pool", "pages", id="request-over-pool"),
    pytest.param("vocab", "outside the vocabulary", id="token-outside-vocab"),
])
def test_bad_requests_raise_clear_errors(case, match):
    hf, tok, model = _model("llama")
    eng = _engine(model, max_context_len=64, kv_tokens=32)
    prompt, sp = [5] * 10, SamplingParams(max_new_tokens=8)
    if case == "empty":
        prompt = []
    elif case == "too-long":
        prompt = [5] * 64
    elif case == "pool":
        sp = SamplingParams(max_new_tokens=40)
    elif case == "vocab":
        prompt = [5, 512]
    with pytest.raises(ValueError, match=match):
        eng.add_request(prompt, sp)


def test_sampling_params_validate():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [pytest.param("llama", id="llama"),
                                  pytest.param("qwen2", id="qwen2")])
def test_engine_on_cuda_matches_transformers(name):
    """float32 on the GPU with the registry's best kernels: continuous batch, token-identical
    to transformers running on the same GPU."""
    hf, tok = build_random_model(name, seed=0)
    hf = hf.to("cuda")
    model = LlamaFamilyModel.from_hf(hf, device="cuda", max_positions=512)
    p = _prompts(6, seed=10)
    ours = _engine(model, page_size=16, max_tokens_per_step=64).generate(
        p, SamplingParams(max_new_tokens=16))
    theirs = hf_greedy(hf, p, max_new_tokens=16, stop_token_ids=frozenset(), device="cuda")
    diffs = compare_outputs(ours, theirs)
    assert not diffs, "; ".join(d.describe() for d in diffs)


def test_prompts_added_together_share_after_the_first_prefill():
    """Prompts with a common system-prompt-like prefix, queued at once: the first prefills, the
    others wait for its shared pages and reuse them; outputs still match transformers."""
    hf, tok, model = _model("qwen2")
    g = torch.Generator().manual_seed(12)
    system = torch.randint(3, 512, (21,), generator=g).tolist()
    p = [system + torch.randint(3, 512, (k,), generator=g).tolist() for k in (4, 9, 2)]
    eng = _engine(model, page_size=5, max_tokens_per_step=64)
    reqs = [eng.add_request(q, SamplingParams(max_new_tokens=6)) for q in p]
    eng.run()
    assert [r.joined_step for r in reqs] == [0, 1, 1]
    assert [r.cached_tokens for r in reqs] == [0, 20, 20]
    assert reqs[1].shared_pages == reqs[2].shared_pages == reqs[0].pages[:4]
    _assert_same([r.output_ids for r in reqs], hf, p, 6, frozenset())
    _free_pages_all_back(eng)
