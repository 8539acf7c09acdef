"""Cascade attention in the reference engine (``EngineConfig.cascade_min_shared_tokens``):
prompts sharing a system prefix reuse its pages (prefix caching), decode steps group them
and read the shared pages once, and greedy outputs still match transformers token for token
(eager and the CPU no-capture graph path)."""

import pytest
import torch

from aiter_attn.engine import SamplingParams
from aiter_attn.kernels.cascade import CascadePlan

from .test_engine import _assert_same, _engine, _model


@pytest.mark.parametrize("graphs", [pytest.param(False, id="eager"),
                                    pytest.param(True, id="graph-path")])
def test_shared_system_prompt_matches_transformers(graphs):
    hf, tok, model = _model("llama")
    g = torch.Generator().manual_seed(21)
    system = torch.randint(3, 512, (26,), generator=g).tolist()
    prompts = [system + torch.randint(3, 512, (k,), generator=g).tolist() for k in (3, 8, 5)]
    eng = _engine(model, page_size=4, max_tokens_per_step=64, cascade_min_shared_tokens=8,
                  cuda_graph=graphs)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    shared_seen = []
    while any(not r.finished for r in reqs):
        eng.step()
        md = eng.runner.backend.forward_metadata
        for key in list(md.kernel_plans.plans):
            plan = md.kernel_plans.get(key)
            if isinstance(plan, CascadePlan) and plan.cascade:
                shared_seen.append(plan.index.shared_pages.tolist())
    assert [r.cached_tokens for r in reqs] == [0, 24, 24]
    # decode steps of the three requests grouped them on their 6 shared pages
    assert any(s[:3] == [6, 6, 6] for s in shared_seen), shared_seen
    _assert_same([r.output_ids for r in reqs], hf, prompts, 6, frozenset())
