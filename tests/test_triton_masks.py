"""Triton tree-mask expansion (op ``build_tree_mask``) against the torch reference: equal
element for element, on random trees and lengths, with a hand-computed case and a padding
row whose tree part lies past the tree tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn.kernels.reference_extra import build_tree_mask_reference

from ._triton_util import DEVICE, requires_triton

pytestmark = requires_triton


def _kernel():
    from aiter_attn.kernels.triton.masks import build_tree_mask

    return build_tree_mask


def _indptr(seq_lens, q_len):
    return torch.cat([torch.zeros(1, dtype=torch.int64),
                      torch.cumsum(seq_lens.long() * q_len, 0)])


@given(q_len=st.integers(1, 5), prefixes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
       seed=st.integers(0, 2**16), as_bool=st.booleans())
def test_tree_mask_equals_reference(q_len, prefixes, seed, as_bool):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor([p + q_len for p in prefixes], dtype=torch.int32)
    tree = torch.rand(len(prefixes), q_len, q_len, generator=g) < 0.5
    if not as_bool:
        tree = tree.to(torch.uint8)
    indptr = _indptr(seq_lens, q_len)
    total = int(indptr[-1])
    want = torch.zeros(total + 3, dtype=torch.bool)
    build_tree_mask_reference(seq_lens, tree, q_len, indptr, want, total)
    got = torch.zeros(total + 3, dtype=torch.bool, device=DEVICE)
    got[total:] = True  # beyond the mask: must stay untouched
    _kernel()(seq_lens.to(DEVICE), tree.to(DEVICE), q_len, indptr.to(DEVICE), got, total)
    assert torch.equal(got[:total].cpu(), want[:total])
    assert bool(got[total:].all())


def test_tree_mask_hand_computed_and_padding_row():
    """Request 0 (L=4, q_len=2): prefix columns 0-1 visible, then the tree rows; request 1
    (L=2): no prefix. A third, padding row (graph replay) reaches past the tree tensor's two
    requests: its tree part reads as not visible instead of faulting."""
    seq_lens = torch.tensor([4, 2, 3], dtype=torch.int32)
    tree = torch.tensor([[[1, 0], [0, 1]], [[0, 0], [1, 0]]], dtype=torch.uint8)
    indptr = _indptr(seq_lens, 2)
    out = torch.zeros(18, dtype=torch.bool, device=DEVICE)
    _kernel()(seq_lens.to(DEVICE), tree.to(DEVICE), 2, indptr.to(DEVICE), out, 18)
    want = [1, 1, 1, 0,
            1, 1, 0, 1,
            0, 0,
            1, 0,
            1, 0, 0,
            1, 0, 0]
    assert out.cpu().tolist() == [bool(x) for x in want]


def test_op_dispatches_to_triton_when_asked_and_rejects_short_out():
    from aiter_attn.kernels.registry import KernelRequest
    from aiter_attn.plugins import kernel_registry

    names = [i.name for i in kernel_registry().implementations("build_tree_mask")]
    assert "triton" in names and "reference" in names
    sel = kernel_registry().select(KernelRequest(op="build_tree_mask", device=DEVICE),
                                   backend="triton")
    seq_lens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    tree = torch.ones(1, 1, 1, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="needs total=3"):
        sel.fn(seq_lens, tree, 1, _indptr(seq_lens.cpu(), 1).to(DEVICE),
               torch.zeros(2, dtype=torch.bool, device=DEVICE), 3)
