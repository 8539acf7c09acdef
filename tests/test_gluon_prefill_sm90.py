"""The Gluon dense prefill kernels compiled for sm_90 on any host (Triton's wheel carries
ptxas; ``scripts/inspect_gluon_prefill_sm90.py``), in a subprocess without
``TRITON_INTERPRET``: no spills, the shared memory an H200 has, the softmax overlapping the
previous tile's ``p · v`` (a ``wgmma.wait_group 1``), and for the warp-specialised form the
partitions' register split (loader 24, consumers 240) within the SM's 64K registers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiter_attn.kernels.triton.prefill_gluon import HAS_GLUON

ROOT = Path(__file__).resolve().parents[1]
H200_SMEM = 232448 - 2048  # opt-in shared memory per block, less the reserved 2 KB

pytestmark = pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon")


def _inspect(const: dict, ws: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(ROOT / "scripts" / "inspect_gluon_prefill_sm90.py"),
           json.dumps(const), "--json"] + (["--ws"] if ws else [])
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("const", [
    {"BLOCK_N": 64, "STAGES": 2},
    {"BLOCK_N": 128, "STAGES": 2, "HAS_SINKS": True, "HAS_PREFIX": True},
    {"BLOCK_N": 64, "STAGES": 4, "D": 64, "DV": 64, "M_SLOW": True},
], ids=["bn64-s2", "bn128-sinks-prefix", "d64-s4"])
def test_warp_specialised_prefill_compiles_for_sm90(const):
    r = _inspect(const, ws=True)
    assert r["stack"] == 0, r
    assert r["shared"] <= H200_SMEM, r
    assert r["warps"] == 12, r  # two consumer warpgroups and the loader's
    # the compile budget fills the register file exactly; partitions re-balance it
    assert r["registers"] * r["warps"] * 32 <= 65536, r
    assert 24 in r["setmaxnreg"] and 240 in r["setmaxnreg"], r
    assert 1 in r["wait_group"], r


def test_gluon_prefill_fits_two_programs_per_sm():
    r = _inspect({"BLOCK_N": 64, "STAGES": 2}, ws=False)
    assert r["stack"] == 0, r
    assert 2 * r["registers"] * 128 <= 65536 and 2 * r["shared"] <= H200_SMEM + 2048, r
    assert 1 in r["wait_group"], r
