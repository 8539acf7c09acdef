"""The engine's DECODE and n-gram chain TARGET_VERIFY steps through ``CudaGraphManager``.

With ``EngineConfig(cuda_graph=True)`` on the CPU the manager runs in no-capture mode: every
decode batch is padded to the next captured size (1, 2, 4 for ``max_batch_size=4``), planned
into the static buffers and run on the static batch whose CPU mirrors are frozen at capture,
exactly what a CUDA graph would replay. Outputs must be token-identical to transformers'
greedy ``generate`` (float32, random weights) in a continuous batch where requests join while
others decode (batch sizes change, padding rows appear), on the MHA pool and on the hybrid SWA
pool; counters prove the graph path really ran. The ``gpu`` tests repeat this with real
capture on CUDA.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from aiter_attn.cli import main
from aiter_attn.engine import (Engine, EngineConfig, SamplingParams, build_random_model,
                               compare_outputs, hf_greedy)
from aiter_attn.engine.graphs import engine_capture_sizes, graph_capturable, graphs_enabled
from aiter_attn.engine.models import build_engine_model
from aiter_attn.engine.spec_decode import NgramDrafter
from aiter_attn.kvcache import MHAKVPool, SWAKVPool
from aiter_attn.types import ForwardMode

_MAX_NEW = 10
_KW = dict(page_size=4, max_batch_size=4, max_context_len=128, max_tokens_per_step=24,
           shuffle_pages_seed=7)
_MODELS: dict = {}

_WINDOW = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
DECODE_CASES = [
    pytest.param("llama", {}, MHAKVPool, id="llama-MHA-pool"),
    pytest.param("qwen2", _WINDOW, SWAKVPool, id="qwen2-window8-SWA-pool"),
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


def _assert_same(hf, prompts, ours, device="cpu"):
    theirs = hf_greedy(hf, prompts, max_new_tokens=_MAX_NEW, stop_token_ids=frozenset(),
                       device=device)
    diffs = compare_outputs(ours, theirs)
    assert not diffs, "; ".join(d.describe() for d in diffs)


def _run_with_late_join(engine, prompts, late):
    """Queue ``prompts``; once some request has decoded 3 tokens, add ``late``. Returns the
    outputs (in order, ``late`` last) and the decode batch size of every step."""
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=_MAX_NEW)) for p in prompts]
    sizes = []
    schedule = engine.scheduler.schedule

    def spy():
        plan = schedule()
        sizes.append(len(plan.decode))
        return plan

    engine.scheduler.schedule = spy
    late_req = None
    while engine.has_work or late_req is None:
        if late_req is None and any(len(r.output_ids) >= 3 for r in reqs):
            late_req = engine.add_request(late, SamplingParams(max_new_tokens=_MAX_NEW))
            decoding_when_joined = sum(1 for r in reqs if r.output_ids and not r.finished)
            assert decoding_when_joined > 0
        engine.step()
    return [r.output_ids for r in reqs + [late_req]], sizes


def _check_decode_case(name, overrides, pool_cls, device):
    hf, model = _model(name, overrides, device)
    # Two forwards per mixed step, so every step with decoding requests replays a DECODE
    # graph (sizes 1..4, padded); one-forward mixed steps: tests/test_engine_mixed.py.
    eng = Engine(model, EngineConfig(cuda_graph=True if device == "cpu" else None,
                                     mixed_steps=False, **_KW))
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.uses_cuda_graph == (device == "cuda")
    assert isinstance(eng.runner.kv_pool, pool_cls)
    prompts = _prompts((23, 31, 9, 17), seed=len(name))
    late = _prompts((14,), seed=99)[0]
    ours, sizes = _run_with_late_join(eng, prompts, late)
    decode_steps = sum(1 for s in sizes if s)
    assert graphs.replays[ForwardMode.DECODE.name] == decode_steps > 0
    assert graphs.padded[ForwardMode.DECODE.name] > 0, sizes  # bs 3 ran as a padded 4
    assert len({s for s in sizes if s}) >= 3, sizes  # the batch grew and shrank
    assert [bs for _, bs in graphs.manager.captured()] == [1, 2, 4]
    _assert_same(hf, prompts + [late], ours, device)
    assert eng.kv.allocator.free_pages == eng.kv.num_pages - 1
    if pool_cls is SWAKVPool:
        assert eng.kv.allocator.swa_free_pages == eng.runner.kv_pool.swa.num_pages - 1


@pytest.mark.parametrize("name,overrides,pool_cls", DECODE_CASES)
def test_decode_replays_match_transformers(name, overrides, pool_cls):
    _check_decode_case(name, overrides, pool_cls, "cpu")


VERIFY_CASES = DECODE_CASES


class _ReferenceDrafter(NgramDrafter):
    """Drafts ``k`` tokens of transformers' own continuation (so drafts are full length and
    verify batches have the captured shape), with every third call's second token wrong (so
    drafts are also rejected and rewound)."""

    def __init__(self, sequences):
        super().__init__()
        object.__setattr__(self, "seqs", sequences)
        object.__setattr__(self, "calls", [0])

    def propose(self, tokens, k):
        self.calls[0] += 1
        n = len(tokens)
        full = next(s for s in self.seqs if s[:n] == list(tokens))
        draft = full[n:n + k]
        if self.calls[0] % 3 == 0 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % 512
        return draft


def _check_verify_case(name, overrides, pool_cls, device):
    hf, model = _model(name, overrides, device)
    kw = dict(_KW, max_tokens_per_step=64)  # all three prefill at once, then verify together
    eng = Engine(model, EngineConfig(speculative="ngram", num_draft_tokens=3,
                                     cuda_graph=True if device == "cpu" else None, **kw))
    graphs = eng.runner.graphs
    assert isinstance(eng.runner.kv_pool, pool_cls)
    assert graphs.manager.modes == [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]
    prompts = _prompts((23, 31, 9), seed=5)
    theirs = hf_greedy(hf, prompts, max_new_tokens=_MAX_NEW, stop_token_ids=frozenset(),
                       device=device)
    eng.spec_decoder.drafter = _ReferenceDrafter([p + t for p, t in zip(prompts, theirs)])
    ours = eng.generate(prompts, SamplingParams(max_new_tokens=_MAX_NEW))
    stats = eng.spec_decoder.stats
    assert 0 < stats.accepted < stats.proposed, stats
    verify = ForwardMode.TARGET_VERIFY.name
    assert 0 < graphs.replays[verify] < stats.verify_forwards, graphs.replays  # short: eager
    assert graphs.padded[verify] > 0, graphs.padded  # 3 requests ran as a padded 4
    diffs = compare_outputs(ours, theirs)
    assert not diffs, "; ".join(d.describe() for d in diffs)
    assert eng.kv.allocator.free_pages == eng.kv.num_pages - 1


@pytest.mark.parametrize("name,overrides,pool_cls", VERIFY_CASES)
def test_ngram_verify_replays_match_transformers(name, overrides, pool_cls):
    """Chain verifies with the full ``k`` drafts replay TARGET_VERIFY graphs; shorter drafts
    (near ``max_new_tokens``) run eagerly; greedy output unchanged."""
    _check_verify_case(name, overrides, pool_cls, "cpu")


def test_tree_verify_stays_eager_and_decode_replays():
    """``ngram-tree`` verifies through a tree mask of varying size: those forwards stay eager,
    DECODE still replays; the output is still greedy."""
    hf, model = _model("llama")
    eng = Engine(model, EngineConfig(speculative="ngram-tree", num_draft_tokens=3,
                                     cuda_graph=True, **_KW))
    graphs = eng.runner.graphs
    assert graphs.manager.modes == [ForwardMode.DECODE]
    prompts = [list(range(10, 18)) * 4, [7, 8, 9] * 9, _prompts((25,))[0]]
    ours = eng.generate(prompts, SamplingParams(max_new_tokens=_MAX_NEW))
    assert eng.spec_decoder.stats.verify_forwards > 0
    assert graphs.replays[ForwardMode.TARGET_VERIFY.name] == 0
    _assert_same(hf, prompts, ours)


@pytest.mark.parametrize("max_bs,sizes", [
    pytest.param(1, [1], id="bs1"),
    pytest.param(4, [1, 2, 4], id="bs4"),
    pytest.param(12, [1, 2, 4, 8, 12], id="bs12-last-is-max"),
])
def test_capture_sizes_follow_the_batch_size(max_bs, sizes):
    assert engine_capture_sizes(max_bs) == sizes


def test_cuda_graph_setting():
    """``None`` = on for a capturable model on CUDA only; explicit values win."""
    _, model = _model("llama")
    on_cuda = SimpleNamespace(device=torch.device("cuda"))
    assert graph_capturable(model) and not graph_capturable(on_cuda)
    assert graphs_enabled(None, model) is False  # on the CPU
    assert graphs_enabled(None, on_cuda) is False  # not known capturable (e.g. MoE modules)
    assert graphs_enabled(None, SimpleNamespace(device=torch.device("cuda"),
                                                cuda_graph_capturable=True)) is True
    assert graphs_enabled(True, model) is True and graphs_enabled(False, on_cuda) is False
    with pytest.raises(TypeError, match="cuda_graph='yes'"):
        graphs_enabled("yes", model)
    with pytest.raises(ValueError, match="max_batch_size=0"):
        engine_capture_sizes(0)
    assert Engine(model, EngineConfig(**_KW)).runner.graphs is None  # CPU default: off


@pytest.mark.parametrize("flag,enabled", [pytest.param("--cuda-graph", True, id="on"),
                                          pytest.param("--no-cuda-graph", False, id="off")])
def test_generate_cli_flag(capsys, flag, enabled):
    rc = main(["generate", "--no-progress", "--json", "--random-config", "llama", "--check",
               flag, "--batch-size", "3", "--max-new-tokens", "6", "--page-size", "3",
               "--prompt", "hi", "--prompt", "a longer prompt to batch", "--prompt", "third"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["check"]["passed"], out["check"]
    info = out["cuda_graph"]
    assert info["enabled"] is enabled
    if enabled:
        # real capture on a GPU; on the CPU the manager plans statically but captures nothing
        assert info["captured"] is torch.cuda.is_available()
        assert info["capture_sizes"] == [1, 2, 3]
        assert info["replays"]["DECODE"] > 0


# -- CUDA: real capture ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name,overrides,pool_cls", DECODE_CASES)
def test_decode_graphs_on_cuda_match_transformers(name, overrides, pool_cls):
    """float32 on the GPU, graphs on by default there (real capture): same checks."""
    _check_decode_case(name, overrides, pool_cls, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name,overrides,pool_cls", VERIFY_CASES)
def test_ngram_verify_graphs_on_cuda_match_transformers(name, overrides, pool_cls):
    _check_verify_case(name, overrides, pool_cls, "cuda")
