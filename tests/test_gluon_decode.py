"""The Gluon decode kernel (``aiter_attn/kernels/triton/decode_gluon.py``): compiled for
sm_90 on any host (no spills, the H200's shared memory and registers), and on an sm_90 GPU
against the float32 oracle over block-permuted pages with a null page 0, NaN in the
unwritten slots of every request's last page, odd groups and page sizes, split and
unsplit, with the LSE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiter_attn.kernels.triton.prefill_gluon import HAS_GLUON
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import HAS_CUDA, INTERPRET
from .test_triton_paged_attention import RTOL, Case

ROOT = Path(__file__).resolve().parents[1]
H200_SMEM_OPTIN = 232448

pytestmark = pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon")


def _inspect(const: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(ROOT / "scripts" / "inspect_gluon_decode_sm90.py"),
           json.dumps(const), "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("const", [
    {},
    {"NC": 1, "STAGES": 2, "SPLITS": 4, "WRITE_LSE": True},
    {"G": 5, "GP": 8, "PAGE": 48, "D": 64, "SPLITS": 3},
    {"G": 16, "GP": 16, "BLOCK_N": 128, "BOX": 64, "PAGE": 64, "STAGES": 3, "q": "fp16",
     "maxnreg": 168},
], ids=["gqa4-p16", "one-consumer-splits-lse", "g5-p48-d64", "g16-bn128-p64-fp16"])
def test_gluon_decode_compiles_for_sm90(const):
    """No spills; the ring fits the H200's shared memory; every wgmma keeps N at the padded
    group (m64n8 / m64n16: the keys are the M side)."""
    r = _inspect(const)
    assert r["stack"] == 0, r
    assert r["shared"] <= H200_SMEM_OPTIN, r
    assert r["registers"] * r["warps"] * 32 <= 65536, r
    assert r["wgmma"] > 0, r


def _nan_tails(case: Case):
    """Unwritten slots of each request's last page hold NaN (what a fresh pool may hold)."""
    page = case.k_cache.shape[1]
    for b, L in enumerate(case.kv_lens):
        n_pages = -(-L // page)
        if L % page and n_pages:
            p = int(case.block_table[b, n_pages - 1])
            case.k_cache[p, L % page:] = float("nan")
            case.v_cache[p, L % page:] = float("nan")


def _run(case: Case, splits, config, lse=False):
    from aiter_attn.kernels.triton.decode_gluon import gluon_decode

    dev = "cuda"
    out = torch.full((case.q.shape[0], case.hq, case.dv), float("nan"), dtype=case.dtype,
                     device=dev)
    lse_t = torch.full((case.q.shape[0], case.hq), float("nan"), device=dev) if lse else None
    gluon_decode(case.q.to(dev), case.k_cache.to(dev), case.v_cache.to(dev), out,
                 case.cu.to(dev), case.seqused_k.to(dev), case.block_table.to(dev),
                 case.scale, splits=splits, config=config, lse=lse_t)
    torch.cuda.synchronize()
    return out, lse_t


def _sm90() -> bool:
    return HAS_CUDA and not INTERPRET and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="an NVIDIA sm_90 GPU")
@pytest.mark.parametrize("kv_lens,hq,hkv,d,page,splits,cfg", [
    pytest.param([4096], 32, 8, 128, 16, 16, (64, 4, 2), id="1x4k-16splits"),
    pytest.param([4096] * 3, 32, 8, 128, 16, 1, (64, 4, 2), id="3x4k-unsplit"),
    pytest.param([4100, 33, 1, 700], 32, 8, 128, 16, 1, (64, 4, 2), id="ragged-unsplit"),
    pytest.param([4100, 33, 1, 700], 32, 8, 128, 16, 5, (64, 4, 2), id="ragged-splits"),
    pytest.param([1000, 17], 32, 8, 128, 16, 3, (64, 2, 1), id="one-consumer"),
    pytest.param([777, 96], 40, 8, 128, 48, 2, (64, 3, 2), id="gqa5-page48"),
    pytest.param([513, 1], 16, 16, 64, 16, 1, (64, 4, 2), id="mha-d64"),
    pytest.param([2000, 300], 16, 1, 128, 64, 4, (128, 3, 2), id="g16-bn128-p64"),
    pytest.param([3000], 8, 1, 256, 32, 2, (64, 2, 2), id="d256-p32"),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_gluon_decode_vs_oracle(kv_lens, hq, hkv, d, page, splits, cfg, dtype):
    from aiter_attn.kernels.triton.decode_gluon import GluonDecodeConfig

    case = Case([1] * len(kv_lens), kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype,
                seed=len(kv_lens) + d, device="cuda")
    _nan_tails(case)
    config = GluonDecodeConfig(block_n=cfg[0], stages=cfg[1], consumers=cfg[2])
    out, lse = _run(case, splits, config, lse=True)
    assert_close_rel(out, case.expected(), RTOL[dtype], f"gluon decode {config}")
    # the LSE against the float32 logits of the oracle's inputs
    exp_lse = []
    for b, L in enumerate(kv_lens):
        k = case.dense_k[b].repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        s = torch.einsum("hd,lhd->hl", case.q[b].float(), k) * case.scale
        exp_lse.append(torch.logsumexp(s, dim=1))
    assert_close_rel(lse.cpu(), torch.stack(exp_lse), 1e-3, "gluon decode lse")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="an NVIDIA sm_90 GPU")
def test_gpu_gluon_decode_empty_request_outputs_zeros():
    """A request with no keys (a graph's padding row) gets zeros and LSE -inf, no NaN, and
    its neighbours are unaffected."""
    from aiter_attn.kernels.triton.decode_gluon import GluonDecodeConfig

    case = Case([1, 1], [0, 300], hq=32, hkv=8, d=128, page=16, dtype=torch.bfloat16,
                device="cuda")
    for splits in (1, 3):
        out, lse = _run(case, splits, GluonDecodeConfig(), lse=True)
        assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
        assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()
        assert_close_rel(out[1:], case.expected()[1:], RTOL[torch.bfloat16], "neighbour")
