"""Conformance suite for kernel implementations (ours and plugins').

Each :class:`ConformanceCase` is one named call of ``ops.paged_attention`` or
``ops.mla_paged_attention`` on random data over a block-permuted paged cache whose null page 0
holds noise, checked against the float64 oracle
(:func:`aiter_attn.testing.oracle.dense_attention`) by relative error with a bound per case.
Running a case through a backend selected *by name* yields a :class:`CaseResult`: ``pass``,
``fail`` (error above the bound, non-finite output, or an exception) or ``unsupported`` (the
backend's declared capabilities do not cover the case; the registry's reason is kept).

From the command line: ``aiter-attn verify --backend NAME [--op OP] [--quick] [--json]``.
From pytest (a plugin's own test suite)::

    import pytest
    from aiter_attn.testing.conformance import conformance_params, run_case

    @pytest.mark.parametrize("case", conformance_params())
    def test_conformance(case):
        run_case(case, backend="myvendor", device="cuda").raise_for_status()
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Optional, Sequence

import attrs
import torch

from .oracle import dense_attention

__all__ = [
    "RTOL",
    "ConformanceCase",
    "CaseResult",
    "ConformanceReport",
    "ConformanceError",
    "CASES",
    "default_cases",
    "conformance_params",
    "build_case_inputs",
    "run_case",
    "run_conformance",
    "with_dtype",
]

#: relative-error bounds by activation dtype (fp8 caches are compared with their dequantised
#: values, so the bound is that of the activation dtype).
RTOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

_E4M3FN = getattr(torch, "float8_e4m3fn", None)
_E4M3FNUZ = getattr(torch, "float8_e4m3fnuz", None)


class ConformanceError(AssertionError):
    """Raised by :meth:`CaseResult.raise_for_status` for a failing case."""


def _tuple(v):
    return tuple(int(x) for x in v)


@attrs.frozen(kw_only=True)
class ConformanceCase:
    """One call and its bound.

    Attributes:
        name: stable id (``decode-page16-gqa5:1-d80``).
        op: ``"paged_attention"`` or ``"mla_paged_attention"``.
        q_lens / kv_lens: query tokens and total keys (this step's included) per request.
        num_q_heads / num_kv_heads / head_dim / v_head_dim: shapes (MLA: one KV head,
            ``head_dim = kv_lora_rank + rope``, ``v_head_dim = kv_lora_rank``).
        page_size: tokens per page.
        dtype / kv_dtype: activation and cache dtypes (``kv_dtype=None``: same as ``dtype``).
        k_scale / v_scale: fp8 dequantisation scales.
        causal, window, softcap, sinks, custom_mask: the op's features.
        rtol: relative-error bound (default from :data:`RTOL`).
        quick: part of the ``--quick`` subset.
    """

    name: str
    op: str = "paged_attention"
    q_lens: tuple = attrs.field(converter=_tuple)
    kv_lens: tuple = attrs.field(converter=_tuple)
    num_q_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 64
    v_head_dim: Optional[int] = None
    page_size: int = 16
    dtype: torch.dtype = torch.float32
    kv_dtype: Optional[torch.dtype] = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    causal: bool = True
    window: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    custom_mask: bool = False
    rtol: Optional[float] = None
    quick: bool = False
    seed: int = 0

    def __attrs_post_init__(self):
        if len(self.q_lens) != len(self.kv_lens) or any(
            q > k for q, k in zip(self.q_lens, self.kv_lens)
        ):
            raise ValueError(f"case {self.name}: q_lens={self.q_lens} must pair with kv_lens="
                             f"{self.kv_lens}, each q_len ≤ its kv_len.")
        if self.op not in ("paged_attention", "mla_paged_attention"):
            raise ValueError(f"case {self.name}: op={self.op!r}; allowed: paged_attention, "
                             "mla_paged_attention.")

    @property
    def bound(self) -> float:
        return self.rtol if self.rtol is not None else RTOL[self.dtype]


@attrs.frozen
class CaseResult:
    """Outcome of one case: ``status`` is ``"pass"``, ``"fail"`` or ``"unsupported"``."""

    name: str
    op: str
    status: str
    rel_err: Optional[float] = None
    bound: Optional[float] = None
    reason: str = ""
    kernel: Optional[str] = None
    seconds: float = 0.0

    def raise_for_status(self, *, allow_unsupported: bool = True) -> "CaseResult":
        """Raise :class:`ConformanceError` for ``fail`` (and ``unsupported`` unless allowed)."""
        if self.status == "fail" or (self.status == "unsupported" and not allow_unsupported):
            raise ConformanceError(f"{self.name}: {self.status}: {self.reason}")
        return self

    def to_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class ConformanceReport:
    """Per-case results of one backend."""

    backend: str
    device: str
    results: tuple

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        """No case failed (unsupported cases are reported, not failures)."""
        return self.count("fail") == 0

    def to_dict(self) -> dict:
        return {"backend": self.backend, "device": self.device, "ok": self.ok,
                "passed": self.count("pass"), "failed": self.count("fail"),
                "unsupported": self.count("unsupported"),
                "results": [r.to_dict() for r in self.results]}

    def format_table(self) -> str:
        lines = [f"conformance of backend {self.backend!r} on {self.device}:",
                 f"  {'case':<34} {'status':<12} {'rel err':>9} {'bound':>8}  detail"]
        for r in self.results:
            err = "-" if r.rel_err is None else f"{r.rel_err:.2e}"
            bound = "-" if r.bound is None else f"{r.bound:.0e}"
            detail = r.reason if r.status != "pass" else f"kernel {r.kernel}"
            lines.append(f"  {r.name:<34} {r.status:<12} {err:>9} {bound:>8}  {detail}")
        lines.append(f"{self.count('pass')} passed, {self.count('fail')} failed, "
                     f"{self.count('unsupported')} unsupported")
        return "\n".join(lines)


def default_cases() -> tuple:
    """The cases our own kernels pass: decode, prefill, extend, mixed; GQA 5:1, head dim 80;
    pages 1/16/48; windows, sinks, soft-cap, fp8, custom masks, non-causal, v dim ≠ qk dim;
    fp16/bf16; MLA (kv_lora 512 + rope 64) with 4/8/16 heads, pages 1 and 64."""
    C = ConformanceCase
    cases = [
        C(name="decode-page1-gqa4:1-d64", q_lens=(1, 1, 1, 1), kv_lens=(1, 7, 33, 64),
          page_size=1, quick=True),
        C(name="decode-page16-gqa5:1-d80", q_lens=(1, 1, 1), kv_lens=(16, 17, 70),
          num_q_heads=10, num_kv_heads=2, head_dim=80),
        C(name="decode-page48-mha-d64", q_lens=(1, 1), kv_lens=(48, 101), num_q_heads=4,
          num_kv_heads=4, page_size=48),
        C(name="prefill-page16-gqa4:1-d64", q_lens=(17, 5, 33), kv_lens=(17, 5, 33)),
        C(name="extend-page16-prefix-crossing", q_lens=(5, 1, 9), kv_lens=(21, 17, 28),
          num_q_heads=8, num_kv_heads=2),
        C(name="mixed-page48-gqa5:1-d80", q_lens=(1, 7, 1, 20), kv_lens=(50, 7, 97, 30),
          num_q_heads=10, num_kv_heads=2, head_dim=80, page_size=48, quick=True),
        C(name="window-page16-w8", q_lens=(1, 6, 3), kv_lens=(40, 20, 8), window=(7, 0)),
        C(name="window-page1-w1", q_lens=(1, 4), kv_lens=(9, 6), page_size=1, window=(0, 0)),
        C(name="sinks-page16", q_lens=(1, 5, 2), kv_lens=(30, 5, 40), sinks=True, quick=True),
        C(name="sinks-window-page16", q_lens=(1, 4), kv_lens=(50, 24), sinks=True,
          window=(15, 0), num_q_heads=8, num_kv_heads=2),
        C(name="softcap-page16", q_lens=(1, 6), kv_lens=(25, 30), softcap=5.0),
        C(name="noncausal-page16", q_lens=(3, 4), kv_lens=(20, 11), causal=False),
        C(name="custom-mask-page16", q_lens=(4, 3), kv_lens=(20, 35), custom_mask=True,
          quick=True),
        C(name="vdim32-qkdim48-page16", q_lens=(1, 5), kv_lens=(19, 12), head_dim=48,
          v_head_dim=32),
        C(name="fp16-decode-page16-gqa4:1", q_lens=(1, 1, 1), kv_lens=(5, 40, 77),
          dtype=torch.float16),
        C(name="bf16-extend-page16-gqa4:1", q_lens=(6, 9), kv_lens=(30, 9), dtype=torch.bfloat16),
    ]
    if _E4M3FN is not None:
        cases.append(C(name="fp8e4m3fn-page16-scales", q_lens=(1, 4), kv_lens=(33, 20),
                       kv_dtype=_E4M3FN, k_scale=0.5, v_scale=2.0, quick=True))
    if _E4M3FNUZ is not None:
        cases.append(C(name="fp8e4m3fnuz-bf16-page16", q_lens=(1, 1), kv_lens=(12, 50),
                       dtype=torch.bfloat16, kv_dtype=_E4M3FNUZ, k_scale=0.25, v_scale=0.5))
    mla = dict(op="mla_paged_attention", num_kv_heads=1, head_dim=576, v_head_dim=512)
    cases += [
        C(name="mla-decode-h16-page1", q_lens=(1, 1, 1), kv_lens=(3, 20, 41), num_q_heads=16,
          page_size=1, quick=True, **mla),
        C(name="mla-decode-h4-page64", q_lens=(1, 1), kv_lens=(64, 90), num_q_heads=4,
          page_size=64, **mla),
        C(name="mla-verify-h8-page1", q_lens=(2, 2), kv_lens=(10, 31), num_q_heads=8,
          page_size=1, **mla),
        C(name="mla-extend-h16-page64", q_lens=(9, 1), kv_lens=(70, 5), num_q_heads=16,
          page_size=64, **mla),
    ]
    if _E4M3FN is not None:
        cases.append(C(name="mla-fp8-decode-h16-page1", q_lens=(1, 1), kv_lens=(17, 9),
                       num_q_heads=16, page_size=1, kv_dtype=_E4M3FN, k_scale=0.5,
                       v_scale=0.5, **mla))
    return tuple(cases)


#: the default case list.
CASES = default_cases()


def _select(cases, *, ops=None, quick=False, names=None):
    out = []
    for c in cases:
        if ops and c.op not in ops:
            continue
        if quick and not c.quick:
            continue
        if names and c.name not in names:
            continue
        out.append(c)
    return out


def conformance_params(*, quick: bool = False, ops: Optional[Sequence[str]] = None) -> list:
    """``pytest.param(case, id=case.name)`` for every selected case."""
    import pytest

    return [pytest.param(c, id=c.name) for c in _select(CASES, ops=ops, quick=quick)]


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: float):
    """(stored, dequantised float32) for a cache dtype; fp8 divides by ``scale`` and saturates."""
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        stored = x.to(dtype)
        return stored, stored.float()
    fmax = torch.finfo(dtype).max
    stored = (x / scale).clamp(-fmax, fmax).to(dtype)
    return stored, stored.float() * scale


def build_case_inputs(case: ConformanceCase, device: str = "cpu") -> dict:
    """Random inputs of ``case``: ``q``, caches, the op's keyword arguments, and the dense
    per-request K/V (dequantised, float32) for the oracle.

    Pages are a random permutation of ``1..num_pages-1``; page 0 (null) and every unused slot
    hold noise so a kernel that reads the wrong page shows.
    """
    g = torch.Generator().manual_seed(1000 + case.seed + sum(map(ord, case.name)))
    kv_dtype = case.kv_dtype or case.dtype
    ps, bs = case.page_size, len(case.q_lens)
    mla = case.op == "mla_paged_attention"
    d, dv = case.head_dim, case.v_head_dim or case.head_dim
    hkv = 1 if mla else case.num_kv_heads
    pages_per = [-(-L // ps) for L in case.kv_lens]
    num_pages = sum(pages_per) + 3
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    width = max(pages_per + [1]) + 1
    block_table = torch.zeros(bs, width, dtype=torch.int32)
    noise = torch.randn(num_pages, ps, hkv, d, generator=g) * 3
    k_store, _ = _quantize(noise, kv_dtype, case.k_scale)
    v_store = None if mla else _quantize(torch.randn(num_pages, ps, hkv, dv, generator=g) * 3,
                                         kv_dtype, case.v_scale)[0]
    dense_k, dense_v = [], []
    kscale = case.k_scale
    for b, L in enumerate(case.kv_lens):
        pages = [perm.pop() for _ in range(pages_per[b])]
        block_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        slots = torch.tensor([pages[j // ps] * ps + j % ps for j in range(L)], dtype=torch.long)
        kst, kdq = _quantize(torch.randn(L, hkv, d, generator=g), kv_dtype, kscale)
        k_store.view(-1, hkv, d)[slots] = kst
        dense_k.append(kdq)
        if mla:
            dense_v.append(kdq[..., :dv])
        else:
            vst, vdq = _quantize(torch.randn(L, hkv, dv, generator=g), kv_dtype, case.v_scale)
            v_store.view(-1, hkv, dv)[slots] = vst
            dense_v.append(vdq)
    q_scale = 3.0 if case.softcap else 1.0  # push logits into the soft-cap's bend
    q = (torch.randn(sum(case.q_lens), case.num_q_heads, d, generator=g) * q_scale).to(case.dtype)
    cu = torch.tensor([0] + list(torch.tensor(case.q_lens).cumsum(0)), dtype=torch.int32)
    kwargs = dict(cu_seqlens_q=cu, seqused_k=torch.tensor(case.kv_lens, dtype=torch.int32),
                  block_table=block_table, softmax_scale=1.0 / math.sqrt(d), causal=case.causal,
                  max_seqlen_q=max(case.q_lens), max_seqlen_k=max(case.kv_lens))
    masks = None
    if case.custom_mask:
        masks, flat, indptr = [], [], [0]
        for n, L in zip(case.q_lens, case.kv_lens):
            m = torch.rand(n, L, generator=g) < 0.6
            m[torch.arange(n), torch.arange(L - n, L)] = True  # a draft token sees itself
            masks.append(m)
            flat.append(m.reshape(-1))
            indptr.append(indptr[-1] + n * L)
        kwargs.update(custom_mask=torch.cat(flat), mask_indptr=torch.tensor(indptr))
    if mla:
        kwargs.update(kv_lora_rank=dv, kv_scale=torch.tensor(case.k_scale)
                      if kv_dtype != case.dtype else None)
        caches = (k_store,)
    else:
        if case.window != (-1, -1):
            kwargs["window_size"] = tuple(case.window)
        if case.softcap:
            kwargs["softcap"] = case.softcap
        if case.sinks:
            kwargs["sinks"] = torch.randn(case.num_q_heads, generator=g).float() + 1.0
        if kv_dtype != case.dtype:
            kwargs.update(k_scale=torch.tensor(case.k_scale), v_scale=torch.tensor(case.v_scale))
        caches = (k_store, v_store)

    def to_dev(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    return {"q": q.to(device), "caches": tuple(c.to(device) for c in caches),
            "kwargs": {k: to_dev(v) for k, v in kwargs.items()},
            "dense_k": dense_k, "dense_v": dense_v, "masks": masks}


def _expected(case: ConformanceCase, inputs: dict) -> torch.Tensor:
    q = inputs["q"].cpu()
    kw = inputs["kwargs"]
    outs, t = [], 0
    for b, n in enumerate(case.q_lens):
        outs.append(dense_attention(
            q[t:t + n], inputs["dense_k"][b], inputs["dense_v"][b],
            scale=kw["softmax_scale"], causal=case.causal, window=tuple(case.window),
            softcap=case.softcap, sinks=kw.get("sinks"),
            mask=None if inputs["masks"] is None else inputs["masks"][b]))
        t += n
    return torch.cat(outs)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a = actual.double().cpu().reshape(expected.shape)
    return float((a - expected).norm() / expected.norm().clamp_min(1e-12))


def run_case(case: ConformanceCase, backend: str, device: str = "cpu") -> CaseResult:
    """Run ``case`` through the op with ``backend=`` forced and compare with the oracle."""
    from .. import ops
    from ..kernels.registry import KernelSelectionError

    t0 = time.perf_counter()
    res = dict(name=case.name, op=case.op, bound=case.bound)
    try:
        inputs = build_case_inputs(case, device)
    except (RuntimeError, TypeError) as exc:  # e.g. an fp8 dtype this torch/device lacks
        return CaseResult(status="unsupported", reason=f"inputs cannot be built here: {exc}",
                          **res)
    fn = ops.paged_attention if case.op == "paged_attention" else ops.mla_paged_attention
    try:
        out = fn(inputs["q"], *inputs["caches"], backend=backend, **inputs["kwargs"])
    except KernelSelectionError as exc:
        return CaseResult(status="unsupported", reason=str(exc), **res,
                          seconds=time.perf_counter() - t0)
    except Exception as exc:  # a kernel that crashes fails the case, with the error
        return CaseResult(status="fail", reason=f"raised {type(exc).__name__}: {exc}",
                          kernel=backend, **res, seconds=time.perf_counter() - t0)
    expected = _expected(case, inputs)
    dt = time.perf_counter() - t0
    if out.dtype != case.dtype:
        return CaseResult(status="fail", reason=f"output dtype {out.dtype}, expected {case.dtype}",
                          kernel=backend, **res, seconds=dt)
    bad = ~torch.isfinite(out.float().cpu())
    if bad.any():
        return CaseResult(status="fail", kernel=backend, seconds=dt, **res,
                          reason=f"{int(bad.sum())} non-finite outputs, first at "
                                 f"{bad.nonzero()[0].tolist()}")
    err = _rel_err(out, expected)
    if not err <= case.bound:
        return CaseResult(status="fail", rel_err=err, kernel=backend, seconds=dt, **res,
                          reason=f"relative error {err:.2e} > bound {case.bound:.0e}")
    return CaseResult(status="pass", rel_err=err, kernel=backend, seconds=dt, **res)


def with_dtype(case: ConformanceCase, dtype: torch.dtype) -> ConformanceCase:
    """``case`` with activations in ``dtype`` (the bound follows :data:`RTOL`); a 16-bit or
    fp32 cache follows too, an fp8 cache stays fp8. For kernels that take no float32."""
    if dtype not in RTOL:
        raise ValueError(f"dtype={dtype}; allowed: {sorted(map(str, RTOL))}.")
    kv = case.kv_dtype if case.kv_dtype not in (None, *RTOL) else None
    return attrs.evolve(case, dtype=dtype, kv_dtype=kv, rtol=None)


def run_conformance(
    backend: str,
    *,
    device: str = "cpu",
    ops: Optional[Iterable[str]] = None,
    quick: bool = False,
    names: Optional[Iterable[str]] = None,
    cases: Optional[Sequence[ConformanceCase]] = None,
    dtype: Optional[torch.dtype] = None,
) -> ConformanceReport:
    """Run the selected cases (default :data:`CASES`) on ``backend``; never raises for a
    failing kernel: every outcome is in the report. ``dtype`` runs every case with that
    activation dtype (see :func:`with_dtype`)."""
    selected = _select(cases if cases is not None else CASES, ops=set(ops or ()), quick=quick,
                       names=set(names or ()))
    if dtype is not None:
        selected = [with_dtype(c, dtype) for c in selected]
    return ConformanceReport(backend, device, tuple(run_case(c, backend, device)
                                                    for c in selected))
