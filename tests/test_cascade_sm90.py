"""The cascade kernels (shared pass, merge, the grouping planner) compiled for sm_90 on any host (Triton's wheel carries ptxas): they
compile for every variant the launcher picks, and the shared pass keeps its K/V copies in
flight while a tile computes (the chunked block-table lookup: ``async_wait {num = 2}`` with 3
stages; see ``tests/test_triton_pipelining.py`` for why). In a subprocess without
``TRITON_INTERPRET`` (the interpreter replaces the kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r'''
import json, sys
sys.path.insert(0, "scripts")
import triton.language as tl
from inspect_sm90 import _compile, report
from aiter_attn.kernels.triton import cascade as c

T = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}

def shared(dtype="bf16", window=True, softcap=False, bm=64, bn=64, warps=4, stages=3, heads=4,
           group=4, d=128, page=16, chunk=16):
    tip = page % bn == 0
    chunk = chunk if (tip or bn % page == 0) else 0
    const = dict(GROUP=group, HEADS=heads, BLOCK_T=bm // heads, BLOCK_M=bm, BLOCK_N=bn, D=d,
                 D_PAD=128, DV=d, DV_PAD=128, PAGE_SIZE=page, HAS_SOFTCAP=softcap,
                 HAS_WINDOW=window, HAS_SCALES=False, COMPUTE_DTYPE=T[dtype],
                 DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", NUM_STAGES=stages,
                 PAGE_CHUNK=chunk, TILE_IN_PAGE=tip)
    ptrs = dict(Q=dtype, K=dtype, V=dtype, PartAcc="fp32", PartML="fp32", Tiles="i32",
                QPos="i32", BlockTable="i32", KScale="fp32", VScale="fp32")
    return report(_compile(c._cascade_shared_kernel, ptrs, {"sm_scale", "softcap"},
                           {"left", "num_splits"}, const, warps, stages))

def merge(dtype="bf16", lse=True):
    const = dict(DV=128, DV_PAD=128, BLOCK_H=32, WRITE_LSE=lse)
    ptrs = dict(O=dtype, OwnLse="fp32", PartAcc="fp32", PartML="fp32", TokShared="i32",
                Lse="fp32")
    return report(_compile(c._cascade_merge_kernel, ptrs, set(), {"num_heads", "num_splits"},
                           const, 4, 2))

from aiter_attn.kernels.triton import cascade_index as ci

def index_kernels():
    r = {}
    r["links"] = report(_compile(ci._links_kernel, dict(BT="i32", SeqK="i32", CuQ="i32",
                                 Links="i32"), set(), {"stride_bt", "width"},
                                 dict(PAGE_SIZE=16, BLOCK_W=128), 4, 2))
    r["runs"] = report(_compile(ci._runs_kernel, dict(Links="i32", CuQ="i32",
                                SharedPages="i32", Scratch="i32", Tiles="i32"), set(),
                                {"bs", "num_tiles", "need"},
                                dict(PAGE_SIZE=16, BLOCK_T=16, BLOCK_B=64, BLOCK_TILE=64), 4, 2))
    r["own"] = report(_compile(ci._own_kernel, dict(BT="i32", SeqK="i32", CuQ="i32",
                               SharedPages="i32", OwnBT="i32", OwnLen="i32", QPos="i32",
                               TokShared="i32"), set(), {"stride_bt", "stride_obt", "width"},
                               dict(PAGE_SIZE=16, BLOCK_W=128), 4, 2))
    return r

def _launched(fp32):
    """The library's own shared-pass launch on an H200 (GQA 32/8, d128)."""
    cfg = c.shared_config(group=4, head_dim_pad=128, fp32=fp32, on_gpu=True, num_tokens=64,
                          max_k=4096, num_kv_heads=8, sms=132)
    return dict(bm=cfg["block_m"], bn=cfg["block_n"], warps=cfg["num_warps"],
                stages=cfg["num_stages"])

out = {**index_kernels(),
    "bench": shared(),
    "page1": shared(page=1),
    "page48-gqa5-d80-softcap": shared(page=48, group=5, heads=8, d=80, softcap=True),
    "fp32": shared(dtype="fp32", **_launched(fp32=True)),
    "merge": merge(),
    "merge-fp32-nolse": merge(dtype="fp32", lse=False),
}
print(json.dumps(out))
'''


def test_cascade_kernels_compile_and_pipeline_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    for name, r in rep.items():
        # ptxas spills, from the cubin (the PTX cannot show them)
        assert r["stack bytes (ptxas spills)"] == 0, (name, r)
    # the shared pass's key loop keeps 2 tiles in flight (chunked lookup, 3 stages)
    for name in ("bench", "page1"):
        assert max(int(n) for n in rep[name]["async_wait per loop"]) >= 2, (name, rep[name])
        assert rep[name]["wgmma"] > 0, (name, rep[name])
