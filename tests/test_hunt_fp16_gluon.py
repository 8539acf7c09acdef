"""fp16 outputs at the edge of fp16's range through the Gluon kernels (NVIDIA sm_90 only; skip
elsewhere): ``tests/test_hunt_fp16_range.py``'s edge keys run on the GPU.

Every visible value is ``±65504`` and the keys come in blocks of 32 (one scoring 0, 31 with
``p`` just past an fp16 rounding midpoint above 0.5), so a row ``Σ p16·v / Σ p`` (``p``
rounded to fp16 for the p·V wgmma/mma) computes to about ``±65526``, which an fp16 store
rounds to ``±inf``; the exact row is ``±65504``. The Gluon kernels clamp an fp16 output to
±65504 at their stores (``prefill_gluon._to_output``; the narrow MLA kernel's fp16 split
partials too), as the Triton kernels do. Checked: dense prefill (plain and warp-specialised,
with the prefix-merging epilogue), paged decode (unsplit; split, whose float32 partials the
Triton reduction merges), MLA decode through the 64-head kernel, the narrow kernel (unsplit,
split, its fused merge) and the ring kernel (unsplit, split).
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.triton.prefill_gluon import HAS_GLUON
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import HAS_CUDA, INTERPRET, spy_launches
from .test_hunt_fp16_range import _edge_keys
from .test_triton_mla import RTOL as MLA_RTOL
from .test_triton_mla import MLACase
from .test_triton_paged_attention import Case
from .test_triton_paged_attention import RTOL as PAGED_RTOL


def _sm90() -> bool:
    return (HAS_GLUON and HAS_CUDA and not INTERPRET
            and torch.cuda.get_device_capability()[0] == 9)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _sm90(), reason="an NVIDIA sm_90 GPU with Gluon")]

FP16_MAX = 65504.0
SIGNS = pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus", "minus"])


def _edge_qk(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [d]`` and ``k [n, d]`` (float32, exact in fp16): key ``j`` scores 0 where
    ``j % 32 == 0``, else the edge score (``p ≈ 0.5 + 2^-12``), at scale 1."""
    c1, c2 = _edge_keys()
    q = torch.zeros(d)
    q[0], q[1] = 1.0, 1.0 / 64
    k = torch.zeros(n, d)
    edge = torch.arange(n) % 32 != 0
    k[edge, 0], k[edge, 1] = c1, c2
    return q, k


def _served(monkeypatch, launcher) -> list:
    """Counts ``launcher``'s launches (the kernel under test must serve the call)."""
    return spy_launches(monkeypatch, launcher)


def _check(out: torch.Tensor, sign: float, rtol: float, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: {out.flatten()[:4].tolist()}"
    assert (out.float() == sign * FP16_MAX).all(), f"{what}: {out.flatten()[:4].tolist()}"
    assert_close_rel(out, torch.full(out.shape, sign * FP16_MAX), rtol, what)


# ---------------------------------------------------------------- dense prefill

PREFILL_CONFIGS = [
    pytest.param(dict(block_m=64, block_n=64, warps=4, stages=2), id="plain"),
    pytest.param(dict(block_m=128, block_n=128, warps=4, stages=2, warp_specialize=True),
                 id="warp-specialised"),
]


@SIGNS
@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix", "prefix-merge"])
@pytest.mark.parametrize("cfg", PREFILL_CONFIGS)
def test_gluon_prefill_at_fp16_max_is_finite(monkeypatch, cfg, prefix, sign):
    """The Gluon prefill kernels' epilogue (``prefill_gluon._epilogue``, shared by the
    warp-specialised form): one query over 64 edge keys (and a prefix row of the same value
    with ``lse_p = 0``) gives ``±65504``."""
    from aiter_attn.kernels.triton import prefill_gluon, prefill_gluon_ws
    from aiter_attn.kernels.triton.prefill import PrefillConfig, dense_prefill

    config = PrefillConfig(cfg["block_m"], cfg["block_n"], cfg["warps"], cfg["stages"],
                           gluon=True, warp_specialize=cfg.get("warp_specialize", False))
    calls = _served(monkeypatch, prefill_gluon_ws._GLUON_WS if config.warp_specialize
                    else prefill_gluon._GLUON)
    hq, hkv, d, n = 8, 2, 128, 64
    q1, k1 = _edge_qk(n, d)
    q = q1.expand(1, hq, d).half().cuda()
    k = k1[:, None].expand(n, hkv, d).half().cuda()
    v = torch.full((n, hkv, d), sign * FP16_MAX).half().cuda()
    out = torch.full((1, hq, d), float("nan"), dtype=torch.float16, device="cuda")
    pre = None
    if prefix:
        pre = (torch.full((1, hq, d), sign * FP16_MAX).half().cuda(),
               torch.zeros(1, hq, device="cuda"))
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    dense_prefill(q, k, v, out, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1,
                  max_seqlen_k=n, softmax_scale=1.0, causal=True, prefix=pre, config=config)
    torch.cuda.synchronize()
    assert calls, "the Gluon prefill kernel did not serve the launch"
    _check(out.cpu(), sign, PAGED_RTOL[torch.float16], f"gluon prefill {cfg}")


# ---------------------------------------------------------------- paged decode

def _decode_edge(sign: float, n: int = 128) -> Case:
    """One decode row (8 query heads over 2 KV heads, d 128, pages of 16) over ``n`` edge
    keys with every value ``sign · 65504``."""
    case = Case([1], [n], hq=8, hkv=2, d=128, page=16, dtype=torch.float16, seed=2)
    q, k = _edge_qk(n, 128)
    case.q = q.expand(1, 8, 128).half().contiguous()
    case.scale = 1.0
    k = k[:, None].expand(n, 2, 128).half()
    v = torch.full((n, 2, 128), sign * FP16_MAX).half()
    bt = case.block_table[0]
    for j in range(n):
        case.k_cache[bt[j // 16], j % 16] = k[j]
        case.v_cache[bt[j // 16], j % 16] = v[j]
    case.dense_k, case.dense_v = [k.float()], [v.float()]
    return case


@SIGNS
@pytest.mark.parametrize("splits", [1, 2], ids=["unsplit", "split"])
def test_gluon_decode_at_fp16_max_is_finite(sign, splits):
    """The Gluon decode kernel's store (``decode_gluon._consume``, unsplit) and its split
    path (float32 partials into the Triton reduction): ``±65504``."""
    from aiter_attn.kernels.triton.decode_gluon import GluonDecodeConfig, gluon_decode

    case = _decode_edge(sign)
    out = torch.full((1, 8, 128), float("nan"), dtype=torch.float16, device="cuda")
    gluon_decode(case.q.cuda(), case.k_cache.cuda(), case.v_cache.cuda(), out, case.cu.cuda(),
                 case.seqused_k.cuda(), case.block_table.cuda(), case.scale, splits=splits,
                 config=GluonDecodeConfig())
    torch.cuda.synchronize()
    _check(out.cpu(), sign, PAGED_RTOL[torch.float16], f"gluon decode, {splits} split(s)")
    assert_close_rel(out, case.expected(), PAGED_RTOL[torch.float16], "against the oracle")


# ---------------------------------------------------------------- MLA decode

def _mla_edge(sign: float, heads: int, n: int = 128) -> MLACase:
    """One decode row of ``heads`` heads over ``n`` edge keys (latents 512 + rope 64, the
    scores in the rope columns, latents ``[:512]`` at ``sign · 65504``), pages of 64."""
    rank, rope = 512, 64
    case = MLACase([1], [n], page=64, heads=heads, rank=rank, rope=rope,
                   dtype=torch.float16, device="cuda", seed=1)
    case.softmax_scale = 1.0
    q1, k = _edge_qk(n, rope)
    lat = torch.zeros(n, rank + rope)
    lat[:, :rank] = sign * FP16_MAX
    lat[:, rank:] = k
    q = torch.zeros(case.q.shape)
    q[..., rank:] = q1
    case.q = q.to(case.q.dtype).to(case.q.device)
    bt = case.block_table[0]
    for j in range(n):
        case.kv_cache[bt[j // 64], j % 64, 0] = lat[j].half().to(case.kv_cache.device)
    case.dense[0] = lat.half().float()[:, None]
    return case


MLA_KERNELS = [
    # (module, launcher attribute, heads, extra)
    pytest.param("mla_gluon", "_GLUON_MLA", 64, {}, id="gluon-64h-unsplit"),
    pytest.param("mla_gluon", "_GLUON_MLA", 64, {"num_kv_splits": 2}, id="gluon-64h-split"),
    pytest.param("mla_narrow_gluon", "_NARROW", 16, {"narrow": True}, id="narrow-unsplit"),
    pytest.param("mla_narrow_gluon", "_NARROW", 16, {"narrow": True, "num_kv_splits": 2},
                 id="narrow-split"),
    pytest.param("mla_narrow_gluon", "_NARROW", 16,
                 {"narrow": True, "num_kv_splits": 2, "fused_merge": True},
                 id="narrow-fused-merge"),
    pytest.param("mla_ring_gluon", "_RING_LAUNCH", 16, {"ring": True}, id="ring-unsplit"),
    pytest.param("mla_ring_gluon", "_RING_LAUNCH", 16, {"ring": True, "num_kv_splits": 2},
                 id="ring-split"),
]


@SIGNS
@pytest.mark.parametrize("module,launcher,heads,extra", MLA_KERNELS)
def test_gluon_mla_at_fp16_max_is_finite(monkeypatch, module, launcher, heads, extra, sign):
    """The Gluon MLA kernels' stores (the 64-head kernel's TMA store of the rows, the narrow
    kernel's rows, fp16 partials and fused merge, the ring kernel's rows and partials), and
    the merges of their partials: ``±65504``."""
    import importlib

    mod = importlib.import_module(f"aiter_attn.kernels.triton.{module}")
    calls = _served(monkeypatch, getattr(mod, launcher))
    case = _mla_edge(sign, heads)
    out = case.run(**extra)
    torch.cuda.synchronize()
    assert calls, f"{module} did not serve the launch"
    _check(out.cpu(), sign, MLA_RTOL[torch.float16], f"{module} {extra}")
    assert_close_rel(out, case.expected(), MLA_RTOL[torch.float16], "against the oracle")
