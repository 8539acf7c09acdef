"""The MLA kernel's one-launch split merge (``fused_merge``): the last split program of a
(token, head block) to finish merges its partials in the same launch; or (``"cooperative"``,
GPU only) a cooperative launch whose splits wait for each other and each merge a slice of
the columns.

Checked against the float64 oracle (outputs and the natural-log LSE), against the two-launch
merge, with empty splits (keys shorter than the split count), fully masked rows, verify
tokens and graph padding rows; the counters are zero again after each launch, and the second
launch (``merge_splits``) is never made. On CPU-only hosts the kernel runs in Triton's
interpreter, on a GPU compiled (where the splits really run concurrently), plus a CUDA-graph
replay and DeepSeek shapes.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import requires_triton
from .test_triton_mla import (LSE_RTOL, RTOL, MLACase, assert_graph_replay_matches_eager,
                              deepseek_decode)

pytestmark = [requires_triton, pytest.mark.usefixtures("triton_mla_kernel")]


def _no_second_launch(monkeypatch):
    from aiter_attn.kernels.triton import mla

    def fail(*a, **k):
        raise AssertionError("the fused merge made the second (merge_splits) launch")

    monkeypatch.setattr(mla, "merge_splits", fail)


CASES = [
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[70, 3, 130], page=16), 4,
                 id="decode-split4-empty-splits"),
    pytest.param(dict(q_lens=[3, 2], kv_lens=[30, 49], page=48), 3, id="verify-p48-split3"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[65, 20], page=64, rank=512, rope=64), 2,
                 id="R512-p64-split2"),
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[70, 3, 130], page=64, heads=20,
                      launch={"block_h": 16}), 5, id="H20-two-head-blocks-split5"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case_kw,splits", CASES)
def test_fused_merge_matches_oracle_and_lse(case_kw, splits, dtype, monkeypatch):
    case_kw = dict(case_kw)
    launch = case_kw.pop("launch", {})
    case = MLACase(**case_kw, dtype=dtype, seed=3)
    _no_second_launch(monkeypatch)
    case.assert_rows_and_lse(f"fused merge, {splits} splits", num_kv_splits=splits,
                             fused_merge=True, **launch)


def test_fused_merge_equals_two_launch_merge():
    case = MLACase([1, 2, 1], [50, 77, 9], page=8, seed=5)
    a = case.run(num_kv_splits=3, fused_merge=False)
    b = case.run(num_kv_splits=3, fused_merge=True)
    assert_close_rel(b, a.double(), 1e-6, "fused vs two-launch merge")


def test_fully_masked_row_and_padding_row_are_zero(monkeypatch):
    case = MLACase([2, 1], [12, 5], page=4, mask_p=1.0, seed=1)
    case.masks[0][1] = False  # the second query of request 0 sees nothing
    case.custom_mask = torch.cat([m.reshape(-1) for m in case.masks])
    _no_second_launch(monkeypatch)
    out = case.run(num_kv_splits=3, fused_merge=True)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert_close_rel(out, case.expected(), 1e-5, "masked, fused")

    pad = MLACase([1, 1, 1], [9, 4, 17], page=4, seed=2)
    out = pad.run(padding_row=1, num_kv_splits=2, fused_merge=True)
    assert torch.isfinite(out).all() and (out[1] == 0).all()


def test_plan_counters_left_zero_and_reused():
    """Plan/run with a graph's static buffers: the counters start and end at zero, so a second
    run on the same plan (a replay) gives the same rows."""
    from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    case = MLACase([1, 1, 2], [40, 90, 33], page=16, seed=4)
    q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
    kw = case.kwargs()
    kernel = TritonMLA(mla_request(q, kv, case.rank), {"num_kv_splits": 3, "fused_merge": True})
    md = _adhoc_metadata(q, kv, kw["cu_seqlens_q"], kw["seqused_k"], kw["block_table"], None,
                         None, None, None, "test")
    params = mla_layer_params(scale=case.softmax_scale, device=q.device,
                              kv_lora_rank=case.rank, num_q_heads=case.heads,
                              head_dim=q.shape[2], kv_scale=None, fp8=False, causal=True)
    static: dict = {}
    plan = kernel.plan(md, static)
    assert plan.counters is not None and plan.cfg_kw["FUSED_MERGE"]
    cnt = static[kernel._ws + ".cnt"]
    cnt.fill_(0)
    out1 = torch.empty(4, 16, 64, device=case.device)
    kernel.run(q, (kv,), plan, params, out1)
    assert int(cnt.abs().sum()) == 0, "the fused merge left a counter non-zero"
    out2 = torch.empty_like(out1)
    kernel.run(q, (kv,), plan, params, out2)
    assert torch.equal(out1, out2)
    assert_close_rel(out1, case.expected(), 1e-5, "plan/run fused")


def test_fused_merge_only_where_it_applies():
    """Head blocks over 16, batch-invariant mode and unsplit launches keep the two-launch
    form (no counters)."""
    from aiter_attn.kernels.base import _adhoc_metadata
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    def plan_of(heads, tuning, **req):
        case = MLACase([1, 1], [40, 70], heads=heads, page=16)
        q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
        kw = case.kwargs()
        k = TritonMLA(mla_request(q, kv, case.rank, **req), tuning)
        md = _adhoc_metadata(q, kv, kw["cu_seqlens_q"], kw["seqused_k"], kw["block_table"],
                             None, None, None, None, "test")
        return k.plan(md)

    on = {"num_kv_splits": 3, "fused_merge": True}
    assert plan_of(16, on).counters is not None
    assert plan_of(64, dict(on, gluon=False)).counters is None  # 64-head blocks
    assert plan_of(16, dict(on, num_kv_splits=1)).counters is None
    assert plan_of(16, on, batch_invariant=True).counters is None
    assert plan_of(16, dict(on, fused_merge=False)).counters is None


# ---------------------------------------------------------------- GPU (compiled, concurrent)

def test_cooperative_merge_mode_selection():
    """The cooperative form only where every program can be resident: on a GPU, 4-warp
    launches whose programs fit two per SM; never in the interpreter (its programs run one
    after another, so a split waiting for its siblings would wait forever)."""
    from aiter_attn.kernels.triton.mla import COOPERATIVE, LAST_SPLIT, TritonMLA

    mode = TritonMLA._fused_mode
    assert mode(True, 16, 4, 4, 256, 110_592, torch.device("cpu")) == LAST_SPLIT
    assert mode(False, 16, 4, 4, 256, 110_592, torch.device("cpu")) == 0
    assert mode("cooperative", 16, 17, 4, 256, 110_592, torch.device("cpu")) == 0
    assert mode("cooperative", 64, 4, 4, 256, 110_592, torch.device("cpu")) == 0
    with pytest.raises(ValueError, match="fused_merge='last'.*cooperative"):
        mode("last", 16, 4, 4, 256, 110_592, torch.device("cpu"))
    if torch.cuda.is_available():
        from aiter_attn.kernels.triton._kvutil import interpreting, num_sms

        dev = torch.device("cuda")
        sms = num_sms(dev)
        want = 0 if interpreting() else COOPERATIVE
        assert mode("cooperative", 16, 4, 4, 2 * sms, 110_592, dev) == want
        assert mode("cooperative", 16, 4, 4, 2 * sms + 1, 110_592, dev) == 0
        assert mode("cooperative", 16, 4, 8, 64, 110_592, dev) == 0  # 8 warps
        assert mode("cooperative", 16, 4, 4, sms + 1, 200_000, dev) == 0  # one per SM
    else:
        assert mode("cooperative", 16, 4, 4, 256, 110_592, torch.device("cpu")) == 0


# ---------------------------------------------------------------- GPU (compiled, concurrent)

FUSED_MODES = [pytest.param(True, id="last-split"),
               pytest.param("cooperative", id="cooperative")]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", FUSED_MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("splits", [2, 3, 4, 7])
def test_gpu_fused_merge_deepseek(splits, dtype, mode, monkeypatch):
    case = deepseek_decode(dtype)
    _no_second_launch(monkeypatch)
    lse = torch.empty(6, 16, device="cuda")
    for _ in range(3):  # counters left at zero: repeated launches agree
        out = case.run(num_kv_splits=splits, fused_merge=mode, lse=lse)
        assert_close_rel(out, case.expected(), RTOL[dtype], f"fused {splits} splits")
        assert_close_rel(lse.cpu(), case.expected_lse(), LSE_RTOL[dtype], "fused LSE")


@pytest.mark.gpu
@pytest.mark.parametrize("case_kw,splits", CASES)
def test_gpu_cooperative_merge_cases(case_kw, splits, monkeypatch):
    """The CPU cases (empty splits, verify rows, page 48, two head blocks) with every split
    merging a column slice, compiled: the same rows and LSE as the oracle."""
    case_kw = dict(case_kw)
    launch = case_kw.pop("launch", {})
    case = MLACase(**case_kw, dtype=torch.float16, device="cuda", seed=3)
    _no_second_launch(monkeypatch)
    case.assert_rows_and_lse(f"cooperative, {splits} splits", num_kv_splits=splits,
                             fused_merge="cooperative", **launch)


@pytest.mark.gpu
def test_gpu_cooperative_merge_equals_last_split_merge():
    """Both one-launch forms merge the same partials in split order: the same bits."""
    case = MLACase([1] * 8, [3000, 17, 900, 4096, 1, 640, 2222, 64], rank=512, rope=64,
                   page=64, dtype=torch.bfloat16, device="cuda", seed=11)
    a = case.run(num_kv_splits=4, fused_merge=True)
    b = case.run(num_kv_splits=4, fused_merge="cooperative")
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", FUSED_MODES)
def test_gpu_fused_merge_graph_replay_matches_eager(mode):
    assert_graph_replay_matches_eager([5 + 60 * i for i in range(8)], replays=3,
                                      num_kv_splits=4, fused_merge=mode)

