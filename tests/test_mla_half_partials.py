"""The Triton MLA kernel's split partials in q's 16-bit dtype (``half_partials``): each split
writes its ``o / l`` row in fp16/bf16 (the LSEs stay float32), the merge reads them into
float32.

Checked against the float64 oracle (rows and the natural-log LSE) with the merge launch and
the in-launch merge, empty splits, verify rows, two head blocks, masks and padding rows; that
the partials really were 16-bit (a spy on the launch); their distance from float32 partials;
the static-buffer path (a 16-bit view of the graph's float32 workspace); where the plan keeps
float32. On CPU in Triton's interpreter (fp16), on a GPU compiled: DeepSeek shapes in bf16 and
fp16 with the descriptor loads and the lazy rescale, and a CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import requires_triton
from .test_triton_mla import (RTOL, MLACase, assert_graph_replay_matches_eager,
                              deepseek_decode, spy_mla_launches)

pytestmark = [requires_triton, pytest.mark.usefixtures("triton_mla_kernel")]


def _spy_partials(monkeypatch) -> list:
    """Records the dtype of each Triton MLA launch's ``part_o`` (its sixth argument)."""
    return spy_mla_launches(monkeypatch, lambda args, kw: args[5].dtype)


CASES = [
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[70, 3, 130], page=16), 4, {},
                 id="decode-split4-empty-splits"),
    pytest.param(dict(q_lens=[3, 2], kv_lens=[30, 49], page=48), 3, {}, id="verify-p48-split3"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[65, 20], page=64, rank=512, rope=64), 2, {},
                 id="R512-p64-split2"),
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[70, 3, 130], page=64, heads=20), 5,
                 {"block_h": 16}, id="H20-two-head-blocks-split5"),
    pytest.param(dict(q_lens=[2, 1], kv_lens=[60, 90], page=16, mask_p=0.7), 2, {},
                 id="tree-mask-split2"),
]


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
@pytest.mark.parametrize("case_kw,splits,launch", CASES)
def test_half_partials_match_oracle_and_lse(case_kw, splits, launch, fused, monkeypatch):
    case = MLACase(**case_kw, dtype=torch.float16, seed=3)
    seen = _spy_partials(monkeypatch)
    case.assert_rows_and_lse(f"half partials, {splits}", num_kv_splits=splits,
                             half_partials=True, fused_merge=fused, **launch)
    assert seen and all(d == torch.float16 for d in seen), f"partials were {seen}"


def test_half_partials_stay_close_to_float32_partials():
    """The only change is the partial rows' rounding (2^-11 in fp16): the two outputs, each
    rounded to fp16 as well, differ by about that much, and do differ."""
    case = MLACase([1, 2, 1], [150, 77, 96], page=16, dtype=torch.float16, seed=5)
    a = case.run(num_kv_splits=4, half_partials=False)
    b = case.run(num_kv_splits=4, half_partials=True)
    assert not torch.equal(a, b), "16-bit partials changed no bit: the option did nothing"
    assert_close_rel(b, a.double(), 1e-3, "16-bit vs float32 partials")


def test_half_partials_padding_and_masked_rows_are_zero():
    pad = MLACase([1, 1, 1], [40, 4, 64], page=16, dtype=torch.float16, seed=2)
    out = pad.run(padding_row=1, num_kv_splits=3, half_partials=True)
    assert torch.isfinite(out).all() and (out[1] == 0).all()

    case = MLACase([2, 1], [12, 5], page=4, mask_p=1.0, dtype=torch.float16, seed=1)
    case.masks[0][1] = False  # the second query of request 0 sees nothing
    case.custom_mask = torch.cat([m.reshape(-1) for m in case.masks])
    out = case.run(num_kv_splits=3, half_partials=True)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert_close_rel(out, case.expected(), RTOL[torch.float16], "masked, half partials")


def _plan(case, tuning, static=None, **req):
    from aiter_attn.kernels.base import _adhoc_metadata
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
    kw = case.kwargs()
    kernel = TritonMLA(mla_request(q, kv, case.rank, **req), tuning)
    md = _adhoc_metadata(q, kv, kw["cu_seqlens_q"], kw["seqused_k"], kw["block_table"], None,
                         None, None, None, "test")
    return kernel, kernel.plan(md, static)


def test_half_partials_view_the_static_float32_workspace():
    """Under a graph's static buffers the 16-bit partials are a view of the float32 workspace
    (one buffer serves either width); a second run on the plan (a replay) gives the same
    rows."""
    from aiter_attn.kernels.base import mla_layer_params

    case = MLACase([1, 1, 2], [40, 90, 33], page=16, dtype=torch.float16, seed=4)
    static: dict = {}
    kernel, plan = _plan(case, {"num_kv_splits": 3, "half_partials": True}, static)
    buf = static[kernel._ws + ".o"]
    assert buf.dtype == torch.float32 and plan.part_o.dtype == torch.float16
    assert plan.part_o.data_ptr() == buf.data_ptr()
    q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
    params = mla_layer_params(scale=case.softmax_scale, device=q.device,
                              kv_lora_rank=case.rank, num_q_heads=case.heads,
                              head_dim=q.shape[2], kv_scale=None, fp8=False, causal=True)
    out1 = torch.empty(4, 16, 64, dtype=torch.float16, device=case.device)
    kernel.run(q, (kv,), plan, params, out1)
    out2 = torch.empty_like(out1)
    kernel.run(q, (kv,), plan, params, out2)
    assert torch.equal(out1, out2)
    assert_close_rel(out1, case.expected(), RTOL[torch.float16], "static half partials")


def test_half_partials_declined_where_they_do_not_apply():
    """float32 queries, batch-invariant launches (their fixed-order merge) and head blocks
    of more than 16 keep float32 partials; so does half_partials=False (the default is on)."""
    def part_dtype(dtype=torch.float16, heads=16, tuning=None, **req):
        case = MLACase([1, 1], [40, 70], page=16, heads=heads, dtype=dtype)
        tuning = {"num_kv_splits": 2, "half_partials": True, **(tuning or {})}
        return _plan(case, tuning, **req)[1].part_o.dtype

    assert part_dtype() == torch.float16
    assert part_dtype(tuning={"half_partials": False}) == torch.float32
    assert part_dtype(dtype=torch.float32) == torch.float32
    assert part_dtype(batch_invariant=True) == torch.float32
    assert part_dtype(heads=64, tuning={"block_h": 64}) == torch.float32


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("launch", [{}, {"kv_desc": True, "lazy_rescale": True},
                                    {"fused_merge": True}, {"fused_merge": "cooperative"}],
                         ids=["plain", "desc-lazy", "fused", "cooperative"])
@pytest.mark.parametrize("splits", [2, 4, 7])
def test_gpu_half_partials_deepseek(splits, launch, dtype, monkeypatch):
    case = deepseek_decode(dtype)
    seen = _spy_partials(monkeypatch)
    case.assert_rows_and_lse(f"half partials {splits} splits", num_kv_splits=splits,
                             half_partials=True, **launch)
    assert seen and all(d == dtype for d in seen), seen


@pytest.mark.gpu
@pytest.mark.parametrize("case_kw,splits,launch", CASES)
def test_gpu_half_partials_cases(case_kw, splits, launch, monkeypatch):
    case = MLACase(**case_kw, dtype=torch.float16, device="cuda", seed=3)
    seen = _spy_partials(monkeypatch)
    out = case.run(num_kv_splits=splits, half_partials=True, **launch)
    assert seen and all(d == torch.float16 for d in seen), seen
    assert_close_rel(out, case.expected(), RTOL[torch.float16], f"half partials {splits}")


@pytest.mark.gpu
def test_gpu_half_partials_graph_replay_matches_eager():
    assert_graph_replay_matches_eager([5 + 60 * i for i in range(8)], replays=3,
                                      num_kv_splits=4, half_partials=True, kv_desc=True,
                                      lazy_rescale=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
@pytest.mark.parametrize("splits", [2, 4])
def test_gpu_narrow_kernel_half_partials(splits, fused, monkeypatch):
    """The narrow Gluon kernel (sm_90) writes its partials in q's dtype too; its own merge
    (``fused_merge``) and the merge launch read them into float32."""
    from aiter_attn.kernels.triton import mla

    seen, launch = [], mla.launch_narrow_mla

    def spy(*args, **kw):
        seen.append(kw["part_o"].dtype)
        return launch(*args, **kw)

    monkeypatch.setattr(mla, "launch_narrow_mla", spy)
    case = deepseek_decode(torch.bfloat16)
    case.assert_rows_and_lse(f"narrow half {splits}", num_kv_splits=splits, narrow=True,
                             half_partials=True, fused_merge=fused)
    assert seen == [torch.bfloat16], seen
