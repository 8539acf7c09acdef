"""The Triton MLA kernel's q·Kᵀ as two or four independent mma chains (``qk_split=2`` /
``4``): the latent columns in halves / quarters, each part's scores accumulated on its own
(the sm_90 build's longest chain of dependent HMMAs a tile: 36 → 16 → 8,
``tests/test_triton_pipelining.py``), p·V into as many part accumulators put side by side at
the end.

Checked against the float64 oracle (rows and the natural-log LSE) through the pointer loads
and the tensor descriptors, with splits (empty ones too), verify rows, custom masks, page 48,
the in-launch merge, 16-bit partials and padding rows; bit-for-bit equal with the same
launch reordered (a replay); where the plan keeps one chain. On CPU in Triton's interpreter
(float32, float16), on a GPU compiled: DeepSeek shapes and a CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import requires_triton
from .test_triton_mla import (RTOL, MLACase, assert_graph_replay_matches_eager,
                              deepseek_decode, spy_mla_launches)

pytestmark = [requires_triton, pytest.mark.usefixtures("triton_mla_kernel")]


def _spy_qk_split(monkeypatch) -> list:
    """Records each Triton MLA launch's ``QK_SPLIT``."""
    return spy_mla_launches(monkeypatch, lambda args, kw: kw["QK_SPLIT"])


CASES = [
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[70, 3, 130], page=16), 4, {},
                 id="decode-split4-empty-splits"),
    pytest.param(dict(q_lens=[3, 2], kv_lens=[30, 49], page=48), 3, {}, id="verify-p48-split3"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[65, 20], page=64, rank=512, rope=64), 2, {},
                 id="R512-p64-split2"),
    pytest.param(dict(q_lens=[2, 1], kv_lens=[60, 90], page=16, mask_p=0.7), 2, {},
                 id="tree-mask-split2"),
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[70, 3, 130], page=64, heads=20), 1,
                 {"block_h": 16}, id="H20-two-head-blocks-one-split"),
    pytest.param(dict(q_lens=[1, 1, 2], kv_lens=[64, 96, 33], page=32), 3,
                 {"kv_desc": True, "block_n": 16}, id="descriptors-split3"),
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[70, 3, 130], page=16), 3,
                 {"fused_merge": True, "half_partials": True}, id="fused-merge-half-partials"),
]


PARTS = pytest.mark.parametrize("parts", [2, 4], ids=["halves", "quarters"])


@PARTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case_kw,splits,launch", CASES)
def test_qk_split_matches_oracle_and_lse(case_kw, splits, launch, dtype, parts, monkeypatch):
    case = MLACase(**case_kw, dtype=dtype, seed=3)
    seen = _spy_qk_split(monkeypatch)
    case.assert_rows_and_lse(f"qk_split {parts}, {splits} splits", num_kv_splits=splits,
                             qk_split=parts, **launch)
    assert seen and all(k == parts for k in seen), seen


@PARTS
def test_qk_split_close_to_one_chain(parts):
    """Only the order of the score sums changes: the rows agree with one chain's to fp16
    rounding, and differ (the option ran)."""
    case = MLACase([1, 2, 1], [150, 77, 96], page=16, dtype=torch.float16, seed=5)
    a = case.run(num_kv_splits=2, qk_split=1)
    b = case.run(num_kv_splits=2, qk_split=parts)
    assert not torch.equal(a, b), f"{parts} chains changed no bit: the option did nothing"
    assert_close_rel(b, a.double(), 1e-3, f"{parts} chains vs one")


@PARTS
def test_qk_split_padding_row_is_zero(parts):
    pad = MLACase([1, 1, 1], [40, 4, 64], page=16, dtype=torch.float16, seed=2)
    out = pad.run(padding_row=1, num_kv_splits=2, qk_split=parts)
    assert torch.isfinite(out).all() and (out[1] == 0).all()


def test_qk_split_declined_where_it_does_not_apply():
    """One chain for fp8 caches (their value-pair reads), ranks that are not a power of two
    or under 32 (halves) / 64 (quarters), 64-head blocks (wgmma on sm_90); a wrong value is
    refused with the allowed ones."""
    from aiter_attn.kernels.base import _adhoc_metadata
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    def split_of(dtype=torch.float16, kv_dtype=None, rank=64, qk_split=2, block_h=None):
        case = MLACase([1, 1], [40, 70], page=16, rank=rank, dtype=dtype, kv_dtype=kv_dtype,
                       heads=64 if block_h else 16)
        q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
        kw = case.kwargs()
        tuning = {"qk_split": qk_split, **({"block_h": block_h} if block_h else {})}
        k = TritonMLA(mla_request(q, kv, case.rank), tuning)
        md = _adhoc_metadata(q, kv, kw["cu_seqlens_q"], kw["seqused_k"], kw["block_table"],
                             None, None, None, None, "test")
        return k.plan(md).cfg_kw["QK_SPLIT"]

    assert split_of() == 2
    assert split_of(qk_split=1) == 1
    assert split_of(kv_dtype=torch.float8_e4m3fn) == 1
    assert split_of(dtype=torch.float32) == 2
    assert split_of(rank=80) == 1  # padded to 128: not even
    assert split_of(rank=16) == 1
    assert split_of(qk_split=4) == 4
    assert split_of(rank=32, qk_split=4) == 1  # quarters of 8 columns: under an mma's k
    assert split_of(rank=32, qk_split=2) == 2
    assert split_of(kv_dtype=torch.float8_e4m3fn, qk_split=4) == 1
    assert split_of(qk_split=4, block_h=32) == 4
    assert split_of(qk_split=4, block_h=64) == 1  # wgmma: no mma.sync chain
    assert split_of(qk_split=2, block_h=64) == 1
    for wrong in (3, 8, True):
        with pytest.raises(ValueError, match=rf"qk_split={wrong}.*allowed: 1.*2.*or 4"):
            split_of(qk_split=wrong)


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@PARTS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("launch", [{}, {"kv_desc": True, "lazy_rescale": True,
                                         "half_partials": True},
                                    {"lazy_rescale": True, "half_partials": True}],
                         ids=["plain", "desc-lazy-half", "lazy-half"])
@pytest.mark.parametrize("splits", [1, 4, 7])
def test_gpu_qk_split_deepseek(splits, launch, dtype, parts, monkeypatch):
    case = deepseek_decode(dtype)
    seen = _spy_qk_split(monkeypatch)
    case.assert_rows_and_lse(f"qk_split {parts}, {splits} splits", num_kv_splits=splits,
                             qk_split=parts, **launch)
    assert seen and all(k == parts for k in seen), seen


@pytest.mark.gpu
@PARTS
@pytest.mark.parametrize("case_kw,splits,launch", CASES)
def test_gpu_qk_split_cases(case_kw, splits, launch, parts, monkeypatch):
    case = MLACase(**case_kw, dtype=torch.float16, device="cuda", seed=3)
    out = case.run(num_kv_splits=splits, qk_split=parts, **launch)
    assert_close_rel(out, case.expected(), RTOL[torch.float16], f"qk_split {parts}, {splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [dict(qk_split=2, kv_desc=True, lazy_rescale=True,
                                         half_partials=True),
                                    dict(qk_split=4, lazy_rescale=True, half_partials=True)],
                         ids=["desc-lazy-half-split2", "lazy-half-split4"])
def test_gpu_qk_split_graph_replay_matches_eager(launch):
    assert_graph_replay_matches_eager([5 + 60 * i for i in range(8)], replays=3,
                                      num_kv_splits=4, **launch)
