"""Mixed steps: requests decoding while others prefill run as ONE EXTEND forward (decode rows
are extend rows of length 1) — one attention launch per layer — and stay token-identical to
transformers' greedy ``generate`` (float32 random models, block-permuted pages, chunked prefill
under a small budget) on every engine architecture: MHA, the hybrid SWA pool, transformers-
wrapped SWA (gemma2) and MLA (deepseek_v2). ``EngineConfig(mixed_steps=False)`` keeps today's
DECODE + EXTEND pair; pure decode steps are DECODE (and graph-replayed) in both modes."""

import pytest
import torch

from aiter_attn.engine import (Engine, EngineConfig, SamplingParams, build_random_model,
                               compare_outputs, hf_greedy)
from aiter_attn.engine.models import build_engine_model
from aiter_attn.types import ForwardMode

_MAX_NEW = 8
_KW = dict(page_size=4, max_batch_size=4, max_context_len=128, max_tokens_per_step=20,
           shuffle_pages_seed=3)
_MODELS: dict = {}
_WINDOW = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
ARCHS = [
    pytest.param("llama", {}, id="llama-MHA"),
    pytest.param("qwen2", _WINDOW, id="qwen2-window8-SWA-pool"),
    pytest.param("gemma2", {}, id="gemma2-SWA-softcap"),
    pytest.param("deepseek_v2", {}, id="deepseek_v2-MLA"),
]


def _model(name, overrides=None, device="cpu"):
    key = (name, tuple(sorted((overrides or {}).items())), device)
    if key not in _MODELS:
        hf, _ = build_random_model(name, seed=0, overrides=overrides or None)
        hf = hf.to(device)
        _MODELS[key] = (hf, build_engine_model(hf, device=device, max_positions=256))
    return _MODELS[key]


def _prompts(lens, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


class _LaunchSpy:
    """Counts attention calls per forward mode and per step (wraps ``backend.forward``)."""

    def __init__(self, backend):
        self.calls: list = []  # one list of modes per step
        inner = backend.forward

        def forward(q, k, v, layer, batch, *a, **kw):
            self.calls[-1].append(batch.forward_mode)
            return inner(q, k, v, layer, batch, *a, **kw)

        backend.forward = forward


def _run_with_arrivals(eng, prompts, late):
    """Queue ``prompts``; each time a request has decoded 2 more tokens, add the next of
    ``late``. Returns the outputs (``late`` last) and ``(n_decode, n_prefill, modes)`` per
    step."""
    spy = _LaunchSpy(eng.runner.backend)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=_MAX_NEW)) for p in prompts]
    late = list(late)
    schedule = eng.scheduler.schedule
    plans = []

    def spy_schedule():
        plan = schedule()
        plans.append(plan)
        return plan

    eng.scheduler.schedule = spy_schedule
    steps = []
    while eng.has_work or late:
        if late and any(len(r.output_ids) >= 2 * (len(reqs) - len(prompts) + 1) for r in reqs):
            reqs.append(eng.add_request(late.pop(0), SamplingParams(max_new_tokens=_MAX_NEW)))
        spy.calls.append([])
        eng.step()
        steps.append((len(plans[-1].decode), len(plans[-1].prefill), spy.calls[-1]))
    return [r.output_ids for r in reqs], steps


def _assert_same(hf, prompts, ours, device="cpu"):
    theirs = hf_greedy(hf, prompts, max_new_tokens=_MAX_NEW, stop_token_ids=frozenset(),
                       device=device)
    diffs = compare_outputs(ours, theirs)
    assert not diffs, "; ".join(d.describe() for d in diffs)


@pytest.mark.parametrize("mixed", [True, False], ids=["one-forward", "two-forwards"])
@pytest.mark.parametrize("name,overrides", ARCHS)
def test_mixed_steps_match_transformers(name, overrides, mixed):
    """Requests arrive while others decode; mixed steps run as one EXTEND forward (one launch
    per layer) or as DECODE + EXTEND; greedy outputs equal transformers' in both modes."""
    hf, model = _model(name, overrides)
    eng = Engine(model, EngineConfig(mixed_steps=mixed, **_KW))
    layers = len(model.layer_specs)
    prompts = _prompts((23, 9, 17), seed=len(name))
    late = _prompts((30, 5, 12), seed=7)
    ours, steps = _run_with_arrivals(eng, prompts, late)
    mixed_steps = [s for s in steps if s[0] and s[1]]
    assert mixed_steps, steps
    assert eng.stats.mixed_steps == (len(mixed_steps) if mixed else 0)
    for n_dec, n_pre, modes in steps:
        if n_dec and n_pre:
            want = ([ForwardMode.EXTEND] * layers if mixed
                    else [ForwardMode.DECODE] * layers + [ForwardMode.EXTEND] * layers)
        elif n_dec:
            want = [ForwardMode.DECODE] * layers
        else:
            want = [ForwardMode.EXTEND] * layers
        assert modes == want, (n_dec, n_pre, modes)
    _assert_same(hf, prompts + late, ours)
    assert eng.kv.allocator.free_pages == eng.kv.num_pages - 1


def test_mixed_step_samples_each_row_once_and_counts_tokens():
    """A mixed step's decode rows each get one token, a prefill row whose prompt finished gets
    its first token, a half-fed chunk gets none; stats count the tokens of both phases."""
    _, model = _model("llama")
    eng = Engine(model, EngineConfig(**{**_KW, "max_tokens_per_step": 12}))
    a = eng.add_request(_prompts((6,))[0], SamplingParams(max_new_tokens=_MAX_NEW))
    eng.step()  # a prefills and gets its first token
    b = eng.add_request(_prompts((10,), seed=1)[0], SamplingParams(max_new_tokens=_MAX_NEW))
    c = eng.add_request(_prompts((20,), seed=2)[0], SamplingParams(max_new_tokens=_MAX_NEW))
    events = eng.step()  # a decodes (1), b prefills 10 and is done, c gets 1 of 20
    assert [(e.request.rid, e.finished) for e in events] == [(a.rid, False), (b.rid, False)]
    assert len(a.output_ids) == 2 and len(b.output_ids) == 1 and not c.output_ids
    assert c.num_computed == 1
    assert eng.stats.mixed_steps == 1
    assert eng.stats.decode_tokens == 1 and eng.stats.prefill_tokens == 6 + 11


def test_pure_decode_steps_keep_graph_replays():
    """With graphs on (no-capture mode on the CPU), pure decode steps replay DECODE graphs and
    mixed steps run eagerly as one EXTEND forward."""
    hf, model = _model("llama")
    eng = Engine(model, EngineConfig(cuda_graph=True, **_KW))
    prompts = _prompts((23, 9, 17), seed=4)
    late = _prompts((30,), seed=8)
    ours, steps = _run_with_arrivals(eng, prompts, late)
    pure_decode = sum(1 for d, p, _ in steps if d and not p)
    assert pure_decode > 0 and eng.stats.mixed_steps > 0
    assert eng.runner.graphs.replays[ForwardMode.DECODE.name] == pure_decode
    _assert_same(hf, prompts + late, ours)


@pytest.mark.parametrize("kw", [dict(speculative="ngram"), dict(batch_invariant=True)],
                         ids=["ngram", "batch-invariant"])
def test_mixed_steps_off_where_decode_has_its_own_forward(kw):
    """n-gram verify and batch-invariant mode keep a separate decode forward."""
    hf, model = _model("llama")
    eng = Engine(model, EngineConfig(**kw, **_KW))
    prompts = _prompts((23, 9, 17), seed=5)
    late = _prompts((30,), seed=9)
    ours, steps = _run_with_arrivals(eng, prompts, late)
    assert any(d and p for d, p, _ in steps) and eng.stats.mixed_steps == 0
    _assert_same(hf, prompts + late, ours)


@pytest.mark.gpu
@pytest.mark.parametrize("name,overrides", ARCHS[:2])
def test_mixed_steps_on_cuda_with_graphs_match_transformers(name, overrides):
    """float32 on the GPU, real CUDA graphs for pure decode steps, mixed steps as one eager
    EXTEND forward: token-identical to transformers on the same GPU."""
    hf, model = _model(name, overrides, "cuda")
    eng = Engine(model, EngineConfig(**_KW))
    assert eng.runner.graphs is not None and eng.runner.graphs.uses_cuda_graph
    prompts = _prompts((23, 9, 17), seed=6)
    late = _prompts((30, 5, 12), seed=10)
    ours, steps = _run_with_arrivals(eng, prompts, late)
    pure_decode = sum(1 for d, p, _ in steps if d and not p)
    assert eng.stats.mixed_steps == sum(1 for d, p, _ in steps if d and p) > 0
    assert eng.runner.graphs.replays[ForwardMode.DECODE.name] == pure_decode > 0
    _assert_same(hf, prompts + late, ours, "cuda")


def test_mixed_bench_smoke(tmp_path):
    """``bench_attention.py --smoke --only mixed`` runs the mixed workload on the CPU in both
    modes (numbers mean nothing here; the lead runs it on the GPU)."""
    import json
    import os
    import sys

    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        import bench_attention

        rows = bench_attention.main(["--smoke", "--only", "mixed", "--out", str(tmp_path)])
    finally:
        sys.path.remove(bench_dir)
    assert [r["row"].split(" bs=")[0] for r in rows] == [
        "engine mixed one-forward", "engine mixed two-forwards"]
    assert rows[0]["mixed_steps"] > 0 and rows[1]["mixed_steps"] == 0
    assert rows[0]["steps"] == rows[1]["steps"] and rows[0]["vs_two_forwards"] > 0
    assert len(json.loads((tmp_path / "bench_mixed.json").read_text())["rows"]) == 2
    assert "| engine mixed one-forward" in (tmp_path / "bench_mixed.md").read_text()
