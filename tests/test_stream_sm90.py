"""Build guards of the stream MLA kernel (:mod:`aiter_attn.kernels.triton.mla_stream_gluon`)
compiled for sm_90 on any host (Triton's wheel carries ptxas): no register spills to speak of
and shared memory within the SM's. Its first builds spilled 0.9–1.7 KB a thread (constant
wgmma descriptors hoisted out of the tile loop) and ran at half speed on an H100
(docs/benchmarks.md, "Thirtieth session"); these fail if that comes back. They compile in a
subprocess without ``TRITON_INTERPRET`` (the interpreter replaces the kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("triton.experimental.gluon")

#: the sm_90 shared memory a block may take (227 KB)
SMEM_PER_BLOCK = 232448
#: ptxas stack bytes allowed: the builds above take 40 (16 heads) to 80 (8 heads, claims and
#: stamps); the spilling builds took 856
STACK_CEILING = 128


def _inspect(const: dict, q: str = "bf16", index: str = "i32") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "inspect_stream_mla_sm90.py"),
         json.dumps(const), "--q", q, "--index", index, "--json"],
        capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("const,q,index", [
    pytest.param({}, "bf16", "i32", id="16-heads-bf16"),
    pytest.param({"HP": 8, "PAGE": 48, "CLAIM": True, "STAMPS": True}, "fp16", "i64",
                 id="8-heads-fp16-claims-stamps-int64"),
    pytest.param({"WRITE_LSE": False, "PAGE": 16}, "fp16", "i32", id="no-lse-page16"),
])
def test_stream_build_does_not_spill(const, q, index):
    rep = _inspect(const, q, index)
    assert 0 < rep["registers"] <= 128, rep
    assert rep["stack"] <= STACK_CEILING, rep
    assert rep["shared"] <= SMEM_PER_BLOCK, rep
    # two consumers' q·Kᵀ (latent and rope) and p·V per tile, unrolled over k
    assert rep["wgmma"] > 0, rep
