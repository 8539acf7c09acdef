"""The Triton MLA launches go through :class:`._launch.Launcher` (the direct launch of the
compiled kernel on CUDA; Triton's regular dispatch elsewhere): the split kernel and its
merge, and both balanced launches. Each launcher's ``launch`` is wrapped to record the
grid and keywords and still launch, on CPU in Triton's interpreter; the rows still match
the oracle, and the merge keeps its ``launch_pdl`` keyword when the plan asks for one."""

from __future__ import annotations

import torch

from ._triton_util import requires_triton, spy_launches
from .test_triton_mla import MLACase

pytestmark = requires_triton


def _record(monkeypatch, launcher) -> list:
    return spy_launches(monkeypatch, launcher,
                        lambda grid, args, kw, key: (tuple(grid), dict(kw)))


def test_split_kernel_and_merge_launch_through_their_launchers(monkeypatch, triton_mla_kernel):
    from aiter_attn.kernels.triton import mla, mla_merge

    fwd = _record(monkeypatch, mla._MLA_FWD)
    merge = _record(monkeypatch, mla_merge._MERGE)
    case = MLACase([1, 2, 1], [150, 77, 3], page=16, seed=5)
    case.assert_rows_and_lse("4 splits", num_kv_splits=4)
    assert len(fwd) == 1 and fwd[0][0][-1] == 4, fwd  # one launch, its grid's splits
    assert len(merge) == 1 and merge[0][0] == (4, case.heads), merge  # (tokens, heads)


def test_merge_keeps_its_pdl_keyword(monkeypatch):
    from aiter_attn.kernels.triton import mla_merge

    merge = _record(monkeypatch, mla_merge._MERGE)
    t, h, s, r = 3, 2, 2, 64
    part_o = torch.randn(t, h, s, r)
    part_lse = torch.randn(t, h, s)
    out = torch.empty(t, h, r)
    mla_merge.merge_splits(out, part_o, part_lse, None, r, r, launch_pdl=True)
    assert merge and merge[0][1].get("launch_pdl") is True, merge
    w = torch.softmax(part_lse * 0.6931471805599453, dim=-1)  # log2 LSEs: base-2 weights
    assert torch.allclose(out, (part_o * w[..., None]).sum(2), rtol=1e-5, atol=1e-5)


def test_balanced_launches_go_through_their_launchers(monkeypatch):
    from aiter_attn.kernels.triton import mla_balanced

    attn = _record(monkeypatch, mla_balanced._BALANCED)
    merge = _record(monkeypatch, mla_balanced._BALANCED_MERGE)
    case = MLACase([1] * 5, [0, 150, 3, 64, 31], heads=16, rank=64, rope=16, page=16,
                   seed=21)
    case.assert_rows_and_lse("balanced", balanced=True, max_seqlen_q=1)
    assert len(attn) == 1 and len(merge) == 1, (attn, merge)
    assert merge[0][0] == (5, 16), merge  # (requests, heads)
