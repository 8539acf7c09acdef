"""Tests found by hand mutation testing of the metadata planners (``aiter_attn/strategies``,
the index builders they call, ``aiter_attn/multistep.py`` and ``aiter_attn/graph/padding.py``):
each test here kills a mutant that the rest of the suite let survive (an off-by-one bound, a
stale static buffer, a host mirror in the wrong order, ...). Numerics are checked against the
float64 dense oracle (``PagedScenario.expected``) on block-permuted pools (null page 0, noise
everywhere); metadata against hand-computed values."""

from __future__ import annotations

import attrs
import pytest
import torch

from aiter_attn import (AttentionBackend, BackendConfig, ForwardMode, LayerSpec,
                        SpecDecodeConfig, SpecInfo)
from aiter_attn.strategies.spec import VerifyTreeMetadata
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.spec_cases import (check_verify_mask, full_verify_mask,
                                           random_tree_parents, tree_mask_from_parents)

VERIFY = ForwardMode.TARGET_VERIFY


def _spec_setup(*, topk=2, n=3, prefixes=(5, 5), page_size=4, seed=0):
    cfg = BackendConfig(page_size=page_size, max_batch_size=8, max_context_len=128,
                        dtype=torch.float32,
                        spec=SpecDecodeConfig(topk=topk, num_draft_tokens=n, num_steps=3))
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    sc = PagedScenario.make(cfg, [layer], list(prefixes), seed=seed)
    return cfg, layer, sc, AttentionBackend(cfg, sc.req_pool, sc.kv_pool)


def _trees(bs, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [tree_mask_from_parents(random_tree_parents(n, g)) for _ in range(bs)]


# ---------------------------------------------------------------------------------------------
# Static tree-mask buffer: a batch whose mask fills the buffer exactly fits
# (mutant: spec.py ``if total > cap`` -> ``if total >= cap`` survived)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["full", "tree"])
def test_tree_verify_mask_exactly_filling_the_static_buffer_is_planned(layout):
    n = 3
    cfg, layer, sc, be = _spec_setup(n=n, prefixes=(5, 5))
    trees = _trees(2, n, seed=3)
    seq = [sc.allocator.tokens_held(r) + n for r in sc.rows]  # 8, 8
    if layout == "tree":
        mask = torch.stack(trees).reshape(-1)
    else:
        mask = torch.cat([full_verify_mask(t, L).reshape(-1) for t, L in zip(trees, seq)])
    batch = sc.next_batch(VERIFY, [n, n], spec_info=SpecInfo(num_draft_tokens=n, topk=2,
                                                              custom_mask=mask))
    planner = VerifyTreeMetadata(be.ctx)
    # max_tokens = 2·n, max_seq_len = 8: the buffer holds n · Σ seq_lens = 3 · 16 = 48 elements
    out = planner.buffer_spec(2, 2 * n, max(seq)).allocate("cpu")
    assert out["custom_mask"].numel() == n * sum(seq)
    md = planner.plan(batch, out=out)
    check_verify_mask(md, batch, trees)
    assert md.mask.custom_mask.data_ptr() == out["custom_mask"].data_ptr()
