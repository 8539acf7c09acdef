"""Defects found in the MLA / speculative strategies (aiter_attn/strategies/mla.py, spec.py),
each pinned by a test that failed before its fix."""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ForwardMode, SpecDecodeConfig, SpecInfo
from aiter_attn.strategies.mla import HeadPadding
from aiter_attn.testing.compare import assert_close_rel

from ._graph_helpers import Rig
from .test_mla import MLAScenario, _check


# -- MLA chain verify declared the tree's mask buffers ------------------------------------------

def test_mla_chain_verify_declares_no_tree_mask_buffer():
    """A chain (topk = 1) plans no mask, so its static buffers hold none: before the fix
    ``mla.verify`` declared the tree's ``custom_mask`` (``max_tokens · max_seq_len`` bools,
    hundreds of MB at DeepSeek context lengths) and ``mask_indptr`` for chains too, unlike
    ``mha.verify.chain``. A tree config keeps them."""
    sc = MLAScenario(page_size=7, heads=4, prefix_lens=[3, 9], seed=4, topk=1)
    planner, _ = sc.backend.strategies_for(ForwardMode.TARGET_VERIFY)
    chain = planner.buffer_spec(4, 32, 100).buffers
    assert "custom_mask" not in chain and "mask_indptr" not in chain, sorted(chain)
    tree_sc = MLAScenario(page_size=7, heads=4, prefix_lens=[3, 9], seed=4, topk=2)
    tree_planner, _ = tree_sc.backend.strategies_for(ForwardMode.TARGET_VERIFY)
    tree = tree_planner.buffer_spec(4, 32, 100).buffers
    assert tree["custom_mask"][0] == (32 * 100,) and tree["mask_indptr"][0] == (5,)
    # and what a graph manager allocates for chain verify matches MHA's chain buffers
    got = {}
    for arch in ("mha", "mla"):
        rig = Rig.make(arch, page_size=16, max_context_len=200,
                       spec=SpecDecodeConfig(topk=1, num_draft_tokens=4))
        mgr = rig.manager(capture_sizes=[4], max_bs=4)
        got[arch] = sorted(mgr.strategy_buffers("target_verify"))
    assert got["mla"] == got["mha"]


def test_mla_chain_verify_static_plan_equals_eager():
    """The chain plan into static buffers (now without mask buffers) equals the eager plan and
    runs to the dense reference."""
    sc = MLAScenario(page_size=5, heads=4, prefix_lens=[0, 6, 11], seed=8, topk=1)
    sc.next_batch(ForwardMode.TARGET_VERIFY, [3] * 3, SpecInfo(num_draft_tokens=3))
    planner, _ = sc.backend.strategies_for(ForwardMode.TARGET_VERIFY)
    eager = planner.plan(sc.batch)
    out = planner.buffer_spec(8, 24, 64).allocate("cpu")
    static = planner.plan(sc.batch, out=out)
    assert eager.mask is None and static.mask is None
    w = eager.pages.block_table.shape[1]
    assert torch.equal(static.pages.block_table[:3, :w], eager.pages.block_table)
    assert torch.equal(static.query.cu_seqlens_q, eager.query.cu_seqlens_q)
    _check(sc, sc.run_absorbed(), "chain verify")


# -- HeadPadding accepted pad_to <= 0 -------------------------------------------------------------

@pytest.mark.parametrize("pad_to", [0, -16, 16.0])
def test_head_padding_rejects_a_non_positive_pad_to(pad_to):
    """``pad_to`` must be a positive int: before the fix 0 / -16 were accepted (every head
    count divides 0) and failed deep in the kernel launch with a tensor-size error."""
    with pytest.raises((ValueError, TypeError), match=r"pad_to=.*positive int"):
        HeadPadding(pad_to=pad_to, policy="always")


def test_head_padding_valid_settings_still_work():
    sc = MLAScenario(page_size=4, heads=4, prefix_lens=[3, 5], seed=1,
                     padding=HeadPadding(pad_to=8, pad_from={4}, policy="always"))
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    got = sc.run_absorbed()
    assert_close_rel(got, sc.expected(), 1e-5, "padded to 8")


# -- MLA extend planned into too-small static buffers ---------------------------------------------

def test_mla_extend_static_buffers_too_small_name_the_bound():
    """``init_forward_metadata(batch, out=)`` with MLA extend buffers sized for shorter
    requests: before the fix a bare tensor-size RuntimeError from deep in the index build;
    now a ValueError naming the request length, the buffers' bound and the fix."""
    sc = MLAScenario(page_size=4, heads=4, prefix_lens=[13, 5], seed=1)
    sc.next_batch(ForwardMode.EXTEND, [3, 2])
    planner, _ = sc.backend.strategies_for(ForwardMode.EXTEND)
    small = planner.buffer_spec(2, 8, 8).allocate("cpu")
    with pytest.raises(ValueError, match=r"up to 16 tokens .* static buffers, .* up to 8 "
                                         r"tokens \(max_seq_len\)"):
        sc.backend.init_forward_metadata(sc.batch, out=small)
    fits = planner.buffer_spec(2, 8, 16).allocate("cpu")
    eager = planner.plan(sc.batch)
    static = planner.plan(sc.batch, out=fits)
    n = eager.extras["mla_prefix"].num_prefix_tokens
    assert torch.equal(static.extras["mla_prefix"].prefix_slots[:n],
                       eager.extras["mla_prefix"].prefix_slots[:n])
    w = eager.extras["mla_prefix"].dense_block_table.shape[1]
    assert torch.equal(static.extras["mla_prefix"].dense_block_table[:, :w],
                       eager.extras["mla_prefix"].dense_block_table)
