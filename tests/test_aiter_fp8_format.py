"""Which fp8 cache format the aiter plugin accepts: the running device's native e4m3 only.

aiter's kernels decode fp8 with the GPU's conversion instructions (``pa_common.cuh``:
``__builtin_amdgcn_cvt_pk_f32_fp8``), which read the device's native e4m3: gfx942 (MI300)
``float8_e4m3fnuz``, gfx950 (MI350) ``float8_e4m3fn``, as the wheel's
``aiter/utility/dtypes.py`` says (``defaultDtypes``, chosen by ``get_gfx()``). A cache of
the other e4m3 format would be misread (another exponent bias and NaN encoding), so the
capabilities decline it with a reason naming the format to store, decided once per
registration from aiter's own ``get_gfx``; where aiter cannot tell (no aiter, an unknown
architecture) no fp8 cache is accepted. The device architecture is stubbed as aiter is.
"""

from __future__ import annotations

import ast

import pytest
import torch

import aiter_attn.kernels.aiter as A
from aiter_attn.kernels import aiter_marshal as M
from aiter_attn.kernels.registry import KernelRequest

from .test_aiter_contract import (CHIP_INFO, install_fake_aiter, read_signatures,  # noqa: F401
                                  stub_gfx, wheel)

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
_DTYPES = "aiter/utility/dtypes.py"


def _wheel_native_formats(wheel) -> dict:
    """``{gfx: torch dtype name}`` of the wheel's ``defaultDtypes`` (``"fp8"`` entries)."""
    src = wheel.read(_DTYPES)
    assert src, f"{_DTYPES} is missing from the wheel"
    table = next(n.value for n in ast.parse(src).body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", None) == "defaultDtypes")
    out = {}
    for gfx, entry in zip(table.keys, table.values):
        fp8 = next(v for k, v in zip(entry.keys, entry.values) if k.value == "fp8")
        out[gfx.value] = fp8.attr  # torch.<attr>
    return out


def test_native_formats_are_the_wheels(wheel):  # noqa: F811
    """Our table is aiter's ``defaultDtypes``, whose architecture comes from the ``get_gfx``
    we ask; and the ragged kernel converts fp8 with the hardware instruction."""
    assert {g: str(d).removeprefix("torch.") for g, d in M.NATIVE_FP8.items()} == \
        _wheel_native_formats(wheel)
    src = wheel.read(_DTYPES)
    assert "from ..jit.utils.chip_info import get_gfx" in src and "get_gfx()" in src
    chip = wheel.module_source(CHIP_INFO)
    assert chip and any(isinstance(n, ast.FunctionDef) and n.name == "get_gfx"
                        for n in ast.parse(chip).body)
    assert "__builtin_amdgcn_cvt_pk_f32_fp8" in wheel.read(
        "aiter_meta/csrc/cpp_itfs/pa/pa_common.cuh")


def _req(op, kv_dtype):
    base = dict(op=op, device="cuda", dtype=torch.bfloat16, kv_dtype=kv_dtype,
                head_dim=128, v_head_dim=128, page_size=16,
                features={"fp8"} if kv_dtype in (FN, FNUZ) else set())
    if op == "mla_paged_attention":
        base.update(head_dim=576, v_head_dim=512, extra=(("heads", 16),))
    return KernelRequest(**base)


_OPS = ["paged_attention", "mla_paged_attention", "paged_attention_5d"]


@pytest.mark.parametrize("op", _OPS)
@pytest.mark.parametrize("gfx,native,other", [
    pytest.param("gfx942", FNUZ, FN, id="MI300-gfx942"),
    pytest.param("gfx950", FN, FNUZ, id="MI350-gfx950"),
])
def test_only_the_native_fp8_format_is_accepted(wheel, monkeypatch, op, gfx, native,  # noqa: F811
                                                other):
    install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label, gfx=gfx)
    caps = A.capabilities()[op]
    assert caps.reject_reason(_req(op, native)) is None
    assert caps.reject_reason(_req(op, torch.bfloat16)) is None
    why = caps.reject_reason(_req(op, other))
    assert why is not None
    assert f"kv cache dtype {other}" in why and gfx in why
    assert f"store the cache as {native}" in why


@pytest.mark.parametrize("gfx", [None, "gfx90a"], ids=["no-aiter-answer", "gfx90a"])
def test_no_fp8_where_the_native_format_is_unknown(monkeypatch, gfx):
    """Without aiter's answer (no aiter here, or an architecture aiter has no fp8 format for)
    fp8 caches are declined, as the plugin declines what it cannot confirm; 16-bit ones stay."""
    if gfx is not None:
        stub_gfx(monkeypatch, gfx)
    caps = A.capabilities()["paged_attention"]
    for fp8 in (FN, FNUZ):
        why = caps.reject_reason(_req("paged_attention", fp8))
        assert why is not None and f"kv cache dtype {fp8}" in why
        assert "native fp8 format" in why and "16-bit cache" in why
    if gfx is not None:
        assert gfx in caps.reject_reason(_req("paged_attention", FNUZ))
    assert caps.reject_reason(_req("paged_attention", torch.bfloat16)) is None


def test_format_is_decided_once(monkeypatch):
    """``capabilities()`` asks aiter's ``get_gfx`` once; selections reuse the answer."""
    asked = stub_gfx(monkeypatch, "gfx942")
    caps = A.capabilities()
    assert asked == ["gfx942"]
    for op in _OPS:
        for kv in (FN, FNUZ, torch.bfloat16):
            caps[op].reject_reason(_req(op, kv))
    assert asked == ["gfx942"]


def test_registered_capabilities_follow_the_device(wheel, monkeypatch):  # noqa: F811
    """The hook registers capabilities decided for the running device (gfx950: e4m3fn)."""
    install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label, gfx="gfx950")
    monkeypatch.setattr(A, "availability", lambda: (True, ""))
    got = {}
    A.aiter_attn_register_kernels(lambda op, name, fn, caps, priority=0: got.setdefault(op, caps))
    caps = got["paged_attention"]
    assert caps.reject_reason(_req("paged_attention", FN)) is None
    assert "store the cache as torch.float8_e4m3fn" in caps.reject_reason(
        _req("paged_attention", FNUZ))
