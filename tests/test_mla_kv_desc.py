"""The Triton MLA kernel reading whole latent tiles through tensor descriptors (``kv_desc``:
TMA on sm_90, Triton's interpreter on the CPU).

Full tiles of a split come through the descriptors (the cache viewed as rows ``[slots,
R + rope]``); the split's last, partial tile keeps the masked pointer loads, so cache rows
past a request's end (here NaN) never reach the value product. Checked against the float64
oracle with empty splits, verify rows, page 48, padding rows and NaN past the ends; that the
descriptor path really ran; and where the plan declines it (fp8 caches, custom masks,
batch-invariant mode, a rope width that is not a power of two, pages that split tiles).
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import requires_triton
from .test_triton_mla import (RTOL, MLACase, assert_graph_replay_matches_eager,
                              deepseek_decode, spy_mla_launches)

pytestmark = [requires_triton, pytest.mark.usefixtures("triton_mla_kernel")]


def _spy_kv_desc(monkeypatch) -> list:
    """Records each Triton MLA launch's ``KV_DESC``."""
    return spy_mla_launches(monkeypatch, lambda args, kw: kw["KV_DESC"])


def _nan_past_ends(case: MLACase) -> None:
    """Cache rows past each request's length in its last page (and the spare pages) = NaN."""
    page = case.kv_cache.shape[1]
    for b, L in enumerate(case.kv_lens):
        n = -(-L // page)
        if L % page:
            last = int(case.block_table[b, n - 1])
            case.kv_cache[last, L % page:] = float("nan")
    used = set(case.block_table.flatten().tolist())
    for p in range(1, case.kv_cache.shape[0]):
        if p not in used:
            case.kv_cache[p] = float("nan")


CASES = [
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[70, 3, 130], page=16), 4, 16,
                 id="decode-p16-split4-empty-splits"),
    pytest.param(dict(q_lens=[3, 2], kv_lens=[30, 49], page=48), 3, 16, id="verify-p48-split3"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[65, 20], page=64, rank=512, rope=64), 2, 32,
                 id="R512-p64-split2"),
    pytest.param(dict(q_lens=[1, 1, 2], kv_lens=[64, 96, 33], page=32), 1, 32,
                 id="whole-tiles-one-split"),
]


@pytest.mark.parametrize("case_kw,splits,block_n", CASES)
def test_kv_desc_matches_oracle_with_nan_past_ends(case_kw, splits, block_n, monkeypatch):
    case = MLACase(**case_kw, dtype=torch.float16, seed=3)
    _nan_past_ends(case)
    seen = _spy_kv_desc(monkeypatch)
    out = case.run(num_kv_splits=splits, block_n=block_n, kv_desc=True)
    assert seen and all(seen), f"the descriptor path did not run: {seen}"
    assert torch.isfinite(out).all()
    assert_close_rel(out, case.expected(), RTOL[torch.float16], f"kv_desc, {splits} splits")


def test_kv_desc_padding_row_is_zero(monkeypatch):
    pad = MLACase([1, 1, 1], [40, 4, 64], page=16, dtype=torch.float16, seed=2)
    seen = _spy_kv_desc(monkeypatch)
    out = pad.run(padding_row=1, num_kv_splits=2, block_n=16, kv_desc=True)
    assert seen == [True]
    assert torch.isfinite(out).all() and (out[1] == 0).all()


def test_kv_desc_equals_pointer_loads():
    case = MLACase([1, 2, 1], [50, 77, 96], page=16, dtype=torch.float16, seed=5)
    a = case.run(num_kv_splits=3, block_n=16, kv_desc=False)
    b = case.run(num_kv_splits=3, block_n=16, kv_desc=True)
    assert_close_rel(b, a.double(), 2e-3, "descriptors vs pointer loads")


def test_kv_desc_declined_where_it_cannot_serve():
    """The plan keeps the pointer loads for fp32, fp8 caches, custom masks, batch-invariant
    launches, non-power-of-two widths and pages that do not hold whole tiles."""
    from aiter_attn.kernels.base import _adhoc_metadata
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    def plan_of(dtype=torch.float16, kv_dtype=None, page=16, rope=16, mask=False,
                block_n=16, **req):
        case = MLACase([1, 1], [40, 70], page=page, rope=rope, dtype=dtype,
                       kv_dtype=kv_dtype, mask_p=0.5 if mask else None)
        q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
        kw = case.kwargs()
        k = TritonMLA(mla_request(q, kv, case.rank, custom_mask=mask, **req),
                      {"kv_desc": True, "block_n": block_n})
        md = _adhoc_metadata(q, kv, kw["cu_seqlens_q"], kw["seqused_k"], kw["block_table"],
                             kw["custom_mask"], kw["mask_indptr"], None, None, "test")
        return k.plan(md).cfg_kw["KV_DESC"]

    assert plan_of() is True
    assert plan_of(dtype=torch.float32) is False
    assert plan_of(kv_dtype=torch.float8_e4m3fn) is False
    assert plan_of(mask=True) is False
    assert plan_of(batch_invariant=True) is False
    assert plan_of(rope=24) is False  # 64 + 24: the rope block is padded to 32
    assert plan_of(page=24) is False  # 16-key tiles would straddle pages


# ---------------------------------------------------------------- GPU (TMA)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("splits", [1, 2, 4, 7])
@pytest.mark.parametrize("page", [32, 64])
def test_gpu_kv_desc_deepseek(page, splits, dtype, monkeypatch):
    case = deepseek_decode(dtype, page=page)
    _nan_past_ends(case)
    seen = _spy_kv_desc(monkeypatch)
    out = case.run(num_kv_splits=splits, kv_desc=True)
    assert seen and all(seen), seen
    assert torch.isfinite(out).all()
    assert_close_rel(out, case.expected(), RTOL[dtype], f"kv_desc {splits} splits p{page}")


@pytest.mark.gpu
@pytest.mark.parametrize("case_kw,splits,block_n", CASES)
def test_gpu_kv_desc_cases(case_kw, splits, block_n, monkeypatch):
    case = MLACase(**case_kw, dtype=torch.float16, device="cuda", seed=3)
    _nan_past_ends(case)
    seen = _spy_kv_desc(monkeypatch)
    out = case.run(num_kv_splits=splits, block_n=block_n, kv_desc=True)
    assert seen and all(seen), seen
    assert torch.isfinite(out).all()
    assert_close_rel(out, case.expected(), RTOL[torch.float16], f"kv_desc, {splits} splits")


@pytest.mark.gpu
def test_gpu_kv_desc_graph_replay_matches_eager():
    assert_graph_replay_matches_eager([5 + 60 * i for i in range(8)], replays=3,
                                      num_kv_splits=4, kv_desc=True)
