"""The fp8 K/V write divides with IEEE round-to-nearest on NVIDIA (checked in the sm_90 PTX,
compiled on the CPU with Triton's bundled toolchain, in a subprocess without
``TRITON_INTERPRET``).

Triton lowers a float32 ``/`` to the approximate ``div.full.f32`` (up to 2 ulp) on NVIDIA, so
the per-(token, head) scales it stored differed from the reference's (torch's IEEE division)
in the last bits: ``test_gpu_token_head_write_bytes_equal_reference`` failed on the H200
(2026-12-03 10:05 UTC). The write must use ``tl.math.div_rn`` for every division.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {scripts!r})
    import inspect_sm90 as I
    from aiter_attn.kernels.triton import kv_write as W
    fp8, token_scales = sys.argv[1], sys.argv[2] == "1"
    fn = W._write_kv_kernel
    names = fn.arg_names
    ptrs = {{}}
    for n in names:
        if n.endswith("_ptr"):
            ptrs[n] = ("bf16" if n in ("k_ptr", "v_ptr") else fp8 if n in ("kc_ptr", "vc_ptr")
                       else "i64" if n in ("slots_ptr", "table_ptr") else "fp32")
    vals = dict(PAGE_SIZE=16, HEAD_DIM=128, V_HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128,
                BLOCK_DV=128, K_LAYOUT=0, V_LAYOUT=0, X=1, XV=1, HAS_V=True, TRANSLATE=False,
                FP8=True, FMAX=448.0 if fp8 == "fp8e4nv" else 57344.0, SCALE_FROM_PTR=True,
                TOKEN_SCALES=token_scales, SIGNAL=True)
    missing = [n for n in names if n.isupper() and n not in vals]
    const = {{n: vals[n] for n in names if n in vals}}
    ptx = "" if missing else I._compile(fn, ptrs, {{"k_scale_val", "v_scale_val"}}, set(),
                                        const, 4, 1).asm["ptx"]
    print(json.dumps(dict(missing=missing, full=ptx.count("div.full.f32"),
                          approx=ptx.count("div.approx.f32"), rn=ptx.count("div.rn.f32"),
                          signal=ptx.count("griddepcontrol.launch_dependents"))))
""")


@pytest.mark.parametrize("token_scales", [True, False], ids=["per_token_head", "per_layer"])
@pytest.mark.parametrize("fp8", ["fp8e4nv", "fp8e5"])
def test_fp8_write_divides_with_round_to_nearest(token_scales, fp8):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(scripts=str(ROOT / "scripts")), fp8,
         "1" if token_scales else "0"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert not rep["missing"], f"new constexprs of _write_kv_kernel: {rep['missing']}; add them"
    assert rep["full"] == 0 and rep["approx"] == 0, rep
    assert rep["rn"] > 0, rep
    # on sm_90 the write lets the next launch start at once (PDL; kv_write's docstring)
    assert rep["signal"] >= 1, rep
