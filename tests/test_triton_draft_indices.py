"""Triton multi-step draft-decode indices (op ``build_draft_decode_indices``) against the
torch reference: every output equal element for element, over random committed lengths,
page sizes, branch counts and step counts, on a block-permuted ``req_to_token`` with each
branch's slots laid out as :mod:`aiter_attn.multistep` describes."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn.kernels.reference_extra import build_draft_decode_indices_reference
from aiter_attn.multistep import draft_columns_needed

from ._triton_util import DEVICE, requires_triton

pytestmark = requires_triton


def _outputs(bs, topk, steps, width, device, fill):
    rows = bs * topk
    return [torch.full((rows + 1,), fill, dtype=torch.int32, device=device),
            torch.full((rows,), fill, dtype=torch.int64, device=device),
            torch.full((steps, rows), fill, dtype=torch.int32, device=device),
            torch.full((steps, rows), fill, dtype=torch.int64, device=device),
            torch.full((steps, rows), fill, dtype=torch.int64, device=device),
            torch.full((steps, rows, width), fill, dtype=torch.int32, device=device)]


@given(prefixes=st.lists(st.integers(0, 70), min_size=1, max_size=4),
       ps=st.sampled_from([1, 4, 16]), topk=st.integers(1, 3), num_steps=st.integers(2, 4),
       spare=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_draft_indices_equal_reference(prefixes, ps, topk, num_steps, spare, seed):
    from aiter_attn.kernels.triton.index import build_draft_decode_indices

    g = torch.Generator().manual_seed(seed)
    bs = len(prefixes)
    seq_lens = torch.tensor(prefixes, dtype=torch.int32)
    cols = int(draft_columns_needed(seq_lens, ps, topk, num_steps).max())
    n_rows = bs + 2
    # distinct page-aligned slots per request row, pages block-permuted (page 0 = null)
    pages = (torch.randperm(n_rows * (cols // ps + 1), generator=g) + 1)
    r2t = (pages.view(n_rows, -1)[:, : -(-cols // ps)].repeat_interleave(ps, 1) * ps
           + torch.arange(ps).repeat(-(-cols // ps))).to(torch.int32)[:, :cols].contiguous()
    rpi = torch.randperm(n_rows, generator=g)[:bs]
    steps = num_steps - 1
    width = -(-(max(prefixes) + num_steps) // ps) + spare
    want = _outputs(bs, topk, steps, width, "cpu", 77)
    build_draft_decode_indices_reference(r2t, rpi, seq_lens, ps, topk, num_steps, *want)
    got = _outputs(bs, topk, steps, width, DEVICE, -77)
    build_draft_decode_indices(r2t.to(DEVICE), rpi.to(DEVICE), seq_lens.to(DEVICE), ps, topk,
                               num_steps, *got)
    for name, w, x in zip(("cu", "rpi", "seqused_k", "positions", "out_cache_loc", "table"),
                          want, got):
        assert torch.equal(x.cpu(), w), name


def test_registry_offers_triton_and_reference():
    from aiter_attn.plugins import kernel_registry

    names = [i.name for i in kernel_registry().implementations("build_draft_decode_indices")]
    assert "triton" in names and "reference" in names
