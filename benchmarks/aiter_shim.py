"""Load the seed's Triton ``unified_attention`` from the ``amd-aiter`` wheel on an NVIDIA GPU.

Benchmark-only shim (never imported by the library). ``aiter/__init__`` needs ROCm, so the
parent packages are stubbed with empty modules whose ``__path__`` points into the unpacked
wheel; ``arch_info.get_arch`` is made to answer ``"gfx950"`` before anything reads it (so the
OCP fp8 types ``float8_e4m3fn``/``e5m2`` are chosen, as on MI350), and the AMD-only
``waves_per_eu`` key is dropped from the launch configurations. Only pure-Python Triton
modules of the wheel are imported.
"""

from __future__ import annotations

import glob
import os
import sys
import types
import zipfile

__all__ = ["find_wheel", "load_unified_attention"]

_MEMBERS = ("aiter/ops/triton/",)


def find_wheel(path: str | None = None) -> str | None:
    """The ``amd-aiter`` wheel: ``path`` if given, else ``.whl/amd_aiter-*.whl`` in the repo."""
    if path:
        return path if os.path.exists(path) else None
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = sorted(glob.glob(os.path.join(here, ".whl", "amd_aiter-*.whl")))
    return found[-1] if found else None


def _unpack(wheel: str, dest: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith(_MEMBERS) and n.endswith(".py")]
        for n in names:
            zf.extract(n, dest)
    return dest


def _stub(name: str, path: str) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = [path]
    sys.modules[name] = mod


def load_unified_attention(wheel: str, dest: str = "/tmp/aiter_shim"):
    """Return ``aiter.ops.triton.unified_attention.unified_attention`` from ``wheel``."""
    root = _unpack(wheel, dest)
    base = os.path.join(root, "aiter")
    if "aiter" not in sys.modules:
        _stub("aiter", base)
        _stub("aiter.ops", os.path.join(base, "ops"))
        _stub("aiter.ops.triton", os.path.join(base, "ops", "triton"))
    if root not in sys.path:
        sys.path.insert(0, root)
    import importlib

    arch_info = importlib.import_module("aiter.ops.triton.utils._triton.arch_info")
    arch_info.get_arch = lambda: "gfx950"
    ua = importlib.import_module("aiter.ops.triton.unified_attention")

    def _drop_waves(fn):
        def wrapped(*a, **k):
            res = fn(*a, **k)
            if isinstance(res, tuple):
                return tuple({kk: vv for kk, vv in r.items() if kk != "waves_per_eu"} for r in res)
            return {kk: vv for kk, vv in res.items() if kk != "waves_per_eu"}

        return wrapped

    if not getattr(ua, "_aiter_attn_shimmed", False):
        ua.select_2d_config = _drop_waves(ua.select_2d_config)
        ua.select_3d_config = _drop_waves(ua.select_3d_config)
        ua._aiter_attn_shimmed = True
    return ua.unified_attention
