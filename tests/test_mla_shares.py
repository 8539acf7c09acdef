"""The balanced MLA launch with weighted slot shares and slot claims
(:mod:`aiter_attn.kernels.triton.mla_balanced`: ``shares``, ``claim``): every row against the
float64 oracle (relative error), with skewed weights, empty slots, requests across many slots,
and claims whose first choices collide; the slot weights from per-SM rates."""

from __future__ import annotations

import copy

import pytest
import torch

from ._triton_util import INTERPRET, requires_triton
from .test_hunt_mla_balanced import LOG2E, _check, _ws
from .test_triton_mla import MLACase

pytestmark = requires_triton


def _launch(case, programs, shares, *, claim=None, hint=None, part_dtype=torch.float32,
            block_n=16):
    from aiter_attn.kernels.triton.mla_balanced import CLAIM_SCATTER, launch_balanced_mla

    dev = case.device
    n = case.q.shape[0]
    out = torch.full((n, case.heads, case.rank), float("nan"), dtype=case.dtype, device=dev)
    lse = torch.full((n, case.heads), float("nan"), device=dev)
    part_o, part_lse = _ws(programs, case.heads, case.rank, part_dtype, dev)
    launch_balanced_mla(case.q.to(dev), case.kv_cache.to(dev), out, case.seqused.to(dev),
                        case.block_table.to(dev), rank=case.rank,
                        qk_scale_log2=case.softmax_scale * LOG2E, lse=lse, part_o=part_o,
                        part_lse=part_lse, programs=programs, block_n=block_n,
                        num_stages=1 if INTERPRET else 3, ieee=case.dtype == torch.float32,
                        shares=shares.to(dev), claim=claim,
                        claim_hint=CLAIM_SCATTER if hint is None else hint)
    return out, lse


def test_share_weights_follow_the_rates():
    from aiter_attn.kernels.triton.mla_balanced import share_weights

    w = share_weights([1.0, 3.0], 4)  # two slots an SM: 1, 1, 3, 3 of 8
    assert w.dtype == torch.float32 and w.tolist() == [0.0, 0.125, 0.25, 0.625, 1.0]
    w = share_weights([0.3, 0.7, 0.11], 3)
    assert w[0] == 0.0 and w[-1] == 1.0 and bool((w[1:] >= w[:-1]).all())
    with pytest.raises(ValueError, match="multiple of the 2 SMs"):
        share_weights([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="positive, finite"):
        share_weights([1.0, 0.0], 2)
    with pytest.raises(ValueError, match="positive, finite"):
        share_weights([], 2)


def _cum(weights) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    c = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(w, 0) / w.sum()])
    c = c.to(torch.float32)
    c[-1] = 1.0
    return c


SHARES = {
    # equal weights: ⌊total · s / P⌋, the slots 31 or 32 tiles where TW would give 32 / 0
    "equal": [1.0] * 6,
    # skewed: the heavy slot spans several requests, light ones fall inside one
    "skewed": [1.0, 5.0, 0.3, 0.3, 2.0, 1.0],
    # empty slots (zero weight) between live ones and at both ends: the merge skips them
    "empty-slots": [0.0, 1.0, 0.0, 0.0, 2.0, 0.0],
}


@pytest.mark.parametrize("name", list(SHARES))
@pytest.mark.parametrize("lens", [[100, 0, 37, 1, 64], [3, 1000, 5], [16, 16, 16]],
                         ids=["mixed", "one-long", "tile-multiples"])
def test_weighted_shares_match_oracle(name, lens):
    """Weighted slot shares over mixed, one long and tile-multiple batches: rows and LSEs
    against the oracle (the partials' NaN fill shows any slot the merge reads unwritten)."""
    case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=16, seed=9)
    out, lse = _launch(case, len(SHARES[name]), _cum(SHARES[name]))
    _check(case, out, lse, f"{name} {lens}")


@pytest.mark.parametrize("dtype,part", [(torch.float16, torch.float16),
                                        (torch.float32, torch.float32)], ids=["fp16", "fp32"])
def test_claimed_slots_over_several_launches(dtype, part):
    """Claims whose first choices collide in pairs (the scatter hint), three launches on one
    claim state (epochs 1..3: no reset between them), skewed shares: every launch's rows
    match the oracle, and each launch claims every slot exactly once (the claims hold the
    last epoch everywhere; the ticket counts every program)."""
    from aiter_attn.kernels.triton.mla_balanced import claim_state

    lens = [100, 0, 37, 1, 64, 300, 5]
    case = MLACase([1] * len(lens), lens, heads=5, rank=64, rope=16, page=16, dtype=dtype,
                   seed=3)
    programs = 6
    state = claim_state(programs, case.device)
    for launch in range(1, 4):
        out, lse = _launch(case, programs, _cum(SHARES["skewed"]), claim=state,
                           part_dtype=part)
        _check(case, out, lse, f"launch {launch}")
        assert int(state[0]) == programs * launch
        assert state[1].tolist() == [launch] * programs


def test_claim_needs_shares_and_shares_their_shape():
    from aiter_attn.kernels.triton.mla_balanced import claim_state

    case = MLACase([1, 1], [10, 20], heads=4, rank=64, rope=16, page=16, seed=1)
    with pytest.raises(ValueError, match="float32 \\[programs \\+ 1 = 5\\]"):
        _launch(case, 4, torch.zeros(4))
    from aiter_attn.kernels.triton.mla_balanced import launch_balanced_mla
    with pytest.raises(ValueError, match="claim needs shares"):
        launch_balanced_mla(case.q, case.kv_cache, torch.empty(2, 4, 64), case.seqused,
                            case.block_table, rank=64, qk_scale_log2=1.0, part_o=None,
                            part_lse=None, programs=4, claim=claim_state(4, "cpu"))


def test_triton_mla_weighs_its_slots_by_the_rates(monkeypatch):
    """``TritonMLA(tuning={"balanced": True, "balanced_rates": ...})``: the plan passes the
    slot weights of the rates (one per SM: 8 on the CPU) and one claim state kept across
    steps; two steps match the oracle, the second claiming in the next epoch."""
    from aiter_attn.kernels.triton import mla as triton_mla
    from aiter_attn.kernels.triton.mla_balanced import share_weights

    from .test_hunt_mla_balanced import _kernel_obj, _md, _params

    seen = []
    real = triton_mla.launch_balanced_mla

    def spy(*a, **k):
        seen.append(k)
        return real(*a, **k)

    monkeypatch.setattr(triton_mla, "launch_balanced_mla", spy)
    lens = [100, 0, 37, 1, 64, 300, 5]
    case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=16, seed=8)
    rates = (1.0, 1.0, 1.3, 1.3, 0.9, 0.9, 1.1, 1.1)
    kernel = _kernel_obj(case, {"balanced": 16, "balanced_rates": list(rates)})
    assert kernel.tuning["balanced_rates"] == rates  # kept as a tuple
    for step in (1, 2):
        plan = kernel.plan(_md(case))
        out = torch.full((len(lens), 16, 64), float("nan"))
        lse = torch.full((len(lens), 16), float("nan"))
        kernel.run(case.q, (case.kv_cache,), plan, _params(case), out, lse=lse)
        _check(case, out, lse, f"step {step}")
        k = seen[-1]
        assert torch.equal(k["shares"], share_weights(rates, 16))
        assert k["per_sm"] == 2  # 16 slots over the CPU's 8 SMs, as share_weights lays them
        assert k["claim"][1].tolist() == [step] * 16  # every slot claimed, epoch `step`


@pytest.mark.parametrize("tuning,match", [
    ({"balanced": True, "balanced_rates": (1.0, 0.0)}, "balanced_rates=.*positive, finite"),
    ({"balanced": True, "balanced_rates": ()}, "balanced_rates=.*positive, finite"),
    ({"balanced": True, "balanced_rates": "fast"}, "balanced_rates=.*positive, finite"),
    ({"balanced_rates": (1.0,) * 8}, "set balanced=True"),
])
def test_balanced_rates_refused_with_the_fix(tuning, match):
    from aiter_attn.kernels.triton.mla import TritonMLA

    with pytest.raises(ValueError, match=match):
        TritonMLA(None, tuning)


def test_balanced_rates_need_one_rate_per_sm():
    from .test_hunt_mla_balanced import _kernel_obj, _md

    case = MLACase([1, 1], [10, 20], heads=16, rank=64, rope=16, page=16, seed=2)
    kernel = _kernel_obj(case, {"balanced": 16, "balanced_rates": (1.0,) * 7})
    with pytest.raises(ValueError, match="7 rates but cpu has 8 SMs"):
        kernel.plan(_md(case))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_claims_by_sm_over_replays(dtype):
    """On CUDA: the programs claim their SM's slot (``%smid``), weighted by made-up rates
    (every third SM twice as fast), as many programs as the SMs hold, 16 heads, latents
    512 + 64; eager then three CUDA-graph replays, rows against the oracle each time and
    every slot claimed once a launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from aiter_attn.kernels.triton._kvutil import num_sms

    from .test_hunt_mla_balanced import _kernel_obj, _md, _params

    lens = [4096, 77, 1, 2000, 0, 3000, 64, 513] * 4
    case = MLACase([1] * len(lens), lens, heads=16, rank=512, rope=64, page=64,
                   dtype=dtype, device="cuda", seed=21)
    sms = num_sms(torch.device("cuda"))
    rates = tuple(2.0 if i % 3 == 0 else 1.0 for i in range(sms))
    # the case keeps its tensors on the CPU for the oracle; the kernel gets CUDA copies
    on_gpu = copy.copy(case)
    on_gpu.q, on_gpu.kv_cache = case.q.cuda(), case.kv_cache.cuda()
    kernel = _kernel_obj(on_gpu, {"balanced": True, "balanced_rates": rates})
    plan = kernel.plan(_md(on_gpu))
    n = len(lens)
    out = torch.full((n, 16, 512), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((n, 16), float("nan"), device="cuda")
    params = _params(on_gpu)
    kernel.run(on_gpu.q, (on_gpu.kv_cache,), plan, params, out, lse=lse)
    torch.cuda.synchronize()
    _check(case, out, lse, "eager")
    claims = kernel._balanced_shares(plan.balanced[0], on_gpu.q.device)["claim"][1]
    assert claims.tolist() == [1] * claims.numel()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernel.run(on_gpu.q, (on_gpu.kv_cache,), plan, params, out, lse=lse)
    for rep in range(3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(case, out, lse, f"replay {rep}")
    assert claims.tolist() == [4] * claims.numel()  # eager, then three replays (a capture
    # records the launch without running it)


def test_bench_runner_for_rate_weighted_variants(monkeypatch):
    """``bench_attention.py``'s ``balanced-sm`` / ``balanced-planned`` variants run through
    ``make_ours_mla_planned`` (plan once, run per call): on the interpreter both give the
    oracle's rows; ``balanced-sm`` asks this GPU's per-SM rates inside the runner (a CPU
    row reads as missing, not a crash)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_attention as ba
    from _inputs import make_mla
    from _runners import Unavailable, make_ours_mla_planned

    from aiter_attn.kernels.reference import mla_paged_attention_reference
    from aiter_attn.testing.compare import assert_close_rel

    x = make_mla(5, 128, heads=4, rank=64, rope=16, page=16, dtype=torch.float32,
                 device="cpu", seed=1)
    exp = torch.empty(5, 4, 64)
    mla_paged_attention_reference(
        x.q, x.kv_cache, exp, kv_lora_rank=x.rank, cu_seqlens_q=x.cu_seqlens_q,
        seqused_k=x.seqused_k, block_table=x.block_table, softmax_scale=x.scale)
    for name, rates in (("balanced-planned", None), ("balanced-sm", (1.0, 2.0) * 4)):
        lk = ba.MLA_VARIANTS[name]
        monkeypatch.setattr(ba, "_sm_rates", lambda dev, r=rates: r)
        kw = ba._resolve(lk, x)
        assert kw["balanced_rates"] == rates
        fn, result = make_ours_mla_planned(x, **{**kw, "balanced": 16})
        fn()
        assert_close_rel(result(), exp, 1e-4, name)
    monkeypatch.undo()
    with pytest.raises(Unavailable, match="sm_90"):
        ba._resolve(ba.MLA_VARIANTS["balanced-sm"], x)
