"""Running conformance cases: the contract checks, per-case results and the report.

What one case checks (``run_case``), in order:

1. the call through :mod:`aiter_attn.ops` with the backend forced by name succeeds
   (``KernelSelectionError``: the case is *unsupported*, with the registry's reason);
2. every tensor the op must not write (q, caches, index tensors, sinks, masks, scales, …) is
   byte-identical afterwards; only ``out``, a KV write's caches and an index builder's outputs
   may change;
3. attention: the return value is ``out`` itself (or a view of its storage), ``out`` is
   finite everywhere (it starts as NaN; NaN traps sit in the null page and past every
   request's length) and within the case's relative-error bound of the float64 oracle; with
   ``out_lse`` the return value is ``(out, out_lse)`` and the LSE matches the oracle's
   (exactly ``-inf`` where nothing is visible); ``merge_attention_states`` likewise;
   KV writes and index builders: their outputs equal the torch reference byte for byte (a
   KV write's untouched slots included);
4. a kernel that declares graph support (``cg_support`` other than ``NEVER``) runs a second
   time with the same buffers holding new values (shorter requests where no host size
   depends on them): captured in a CUDA graph and replayed on a CUDA device, called again
   elsewhere; steps 2–3 apply to that run too. Kernel objects (the plan/run ops
   ``paged_attention``, ``paged_attention_5d``) are driven the way the strategies and the
   graph manager drive them: bound once, planned into a static buffer dict and run; then,
   with the new values in the same tensors, planned again into the same dict while the
   *first* plan runs (what a replay does).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Optional, Sequence

import attrs
import torch

from .cases import ConformanceCase, default_cases, with_dtype
from .inputs import prepare

__all__ = [
    "CASES",
    "CaseResult",
    "ConformanceReport",
    "ConformanceError",
    "conformance_params",
    "run_case",
    "run_conformance",
    "select_cases",
]

#: the default case list.
CASES = default_cases()


class ConformanceError(AssertionError):
    """Raised by :meth:`CaseResult.raise_for_status` for a failing case."""


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

    def failed(self) -> list:
        """Names of the failing cases."""
        return [r.name for r in self.results if r.status == "fail"]

    def to_dict(self) -> dict:
        return {"backend": self.backend, "device": self.device, "ok": self.ok,
                "passed": self.count("pass"), "failed": self.count("fail"),
                "unsupported": self.count("unsupported"),
                "results": [r.to_dict() for r in self.results]}

    def format_table(self) -> str:
        lines = [f"conformance of backend {self.backend!r} on {self.device}:",
                 f"  {'case':<40} {'status':<12} {'rel err':>9} {'bound':>8}  detail"]
        for r in self.results:
            err = "-" if r.rel_err is None else f"{r.rel_err:.2e}"
            bound = "-" if not r.bound else f"{r.bound:.0e}"
            detail = r.reason if r.status != "pass" else f"kernel {r.kernel}"
            lines.append(f"  {r.name:<40} {r.status:<12} {err:>9} {bound:>8}  {detail}")
        lines.append(f"{self.count('pass')} passed, {self.count('fail')} failed, "
                     f"{self.count('unsupported')} unsupported")
        if self.failed():
            lines.append(f"FAILED: {', '.join(self.failed())}")
        return "\n".join(lines)


def select_cases(cases, *, ops=None, quick=False, names=None) -> list:
    """The cases of ``ops`` (all if empty), the ``--quick`` subset, or those named."""
    return [c for c in cases if (not ops or c.op in ops) and (not quick or c.quick)
            and (not names or c.name in names)]


def conformance_params(*, quick: bool = False, ops: Optional[Sequence[str]] = None) -> list:
    """``pytest.param(case, id=case.name)`` for every selected case."""
    import pytest

    return [pytest.param(c, id=c.name) for c in select_cases(CASES, ops=ops, quick=quick)]


def _snapshot(prep) -> dict:
    return {n: t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
            for n, t in prep.tensors.items() if n not in prep.outputs}


def _changed(prep, snap) -> str:
    for name, before in snap.items():
        after = prep.tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(after, before):
            n = int((after != before).sum())
            allowed = ", ".join(f"`{o}`" for o in prep.outputs)
            return (f"the call changed input `{name}` ({n} bytes differ); only {allowed} may "
                    "change")
    return ""


def _named_impl(op: str, backend: str):
    from ...plugins import kernel_registry

    return next((i for i in kernel_registry().implementations(op) if i.name == backend), None)


def _graph_rerun(case, prep, backend, device, cg) -> tuple:
    """Second run with the same buffers holding the values of another variant: CUDA-graph
    capture + replay on CUDA, a plain call elsewhere. Returns ``(rel_err, reason)``."""
    from ...types import CGSupport

    second = prepare(case, device, variant=1)
    on_cuda = torch.device(device).type == "cuda"
    uniform = len(set(case.q_lens)) == 1
    if on_cuda and (cg == CGSupport.ALWAYS or uniform):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            prep.invoke(prep.tensors, backend)  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                ret = prep.invoke(prep.tensors, backend)
        except Exception as exc:
            return None, (f"CUDA-graph capture failed although the kernel declares "
                          f"cg_support={cg.name}: {type(exc).__name__}: {exc}")
        for name, t in prep.tensors.items():
            t.copy_(second.tensors[name])
        snap = _snapshot(prep)
        graph.replay()
        torch.cuda.synchronize()
    else:
        for name, t in prep.tensors.items():
            t.copy_(second.tensors[name])
        snap = _snapshot(prep)
        ret = prep.invoke(prep.tensors, backend)
    reason = _changed(prep, snap)
    if reason:
        return None, reason
    return second.judge(prep.tensors, ret)


def _kernel_request(case, t):
    """The registry request of the attention call on the tensors ``t`` (``lse`` included)."""
    if case.op == "mla_paged_attention":
        from ...kernels.base import mla_request

        return mla_request(t["q"], t["kv_cache"], case.v_head_dim or case.head_dim,
                           custom_mask=t.get("custom_mask") is not None, lse=case.lse,
                           causal=case.causal)
    if case.op == "paged_attention_5d":
        from ...strategies.vec5d import paged_attention_5d_request as make
    else:
        from ...ops import paged_attention_request as make
    req = make(t["q"], t["k_cache"], t["v_cache"], window_size=tuple(case.window),
               softcap=case.softcap, sinks=t.get("sinks"), causal=case.causal,
               custom_mask=t.get("custom_mask"))
    return attrs.evolve(req, features=req.features | {"lse"}) if case.lse else req


def _plan_run_rerun(case, prep, impl, device, cg) -> tuple:
    """Step 4 for kernel objects (module docstring). Returns ``(rel_err, reason)``."""
    from ...kernels.base import LayerParams, _adhoc_metadata
    from ...types import FP8_DTYPES, CGSupport

    t = prep.tensors
    kernel = impl.bind(_kernel_request(case, t))
    static: dict = {}
    if case.op == "mla_paged_attention":
        from ...kernels.base import mla_layer_params

        cache = ("kv_cache",)
        params = mla_layer_params(
            scale=case.softmax_scale, device=t["q"].device,
            kv_lora_rank=case.v_head_dim or case.head_dim, num_q_heads=t["q"].shape[1],
            head_dim=t["q"].shape[2], kv_scale=t.get("kv_scale"), causal=case.causal,
            fp8=t["kv_cache"].dtype in FP8_DTYPES)
    else:
        cache = ("k_cache", "v_cache")
        params = LayerParams.create(
            scale=case.softmax_scale, device=t["q"].device, window=tuple(case.window),
            softcap=case.softcap, causal=case.causal, sinks=t.get("sinks"),
            k_scale=t.get("k_scale"), v_scale=t.get("v_scale"),
            fp8=t["k_cache"].dtype in FP8_DTYPES)

    def plan():
        md = _adhoc_metadata(t["q"], t[cache[0]], t["cu_seqlens_q"], t["seqused_k"],
                             t["block_table"], t.get("custom_mask"), t.get("mask_indptr"),
                             max(case.q_lens), max(case.kv_lens), case.op)
        return kernel.plan(md, out=static)

    def run(kp):
        ret = kernel.run(t["q"], tuple(t[c] for c in cache), kp, params, t["out"],
                         lse=t.get("out_lse"))
        return (ret, t["out_lse"]) if "out_lse" in t else ret

    for name in prep.outputs:
        t[name].fill_(float("nan"))
    kp = plan()
    snap = _snapshot(prep)
    ret = run(kp)  # eager (and, on CUDA, the warm-up before capture)
    reason = _changed(prep, snap)
    err, reason = (None, reason) if reason else prep.judge(t, ret)
    if reason:
        return err, f"planned into static buffers and run: {reason}"
    graph = None
    if torch.device(device).type == "cuda" and (cg == CGSupport.ALWAYS
                                                or len(set(case.q_lens)) == 1):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                ret = run(kp)
        except Exception as exc:
            return None, (f"CUDA-graph capture of run() failed although the kernel declares "
                          f"cg_support={cg.name}: {type(exc).__name__}: {exc}")
    second = prepare(case, device, variant=1)
    for name, x in t.items():
        x.copy_(second.tensors[name])
    snap = _snapshot(prep)
    plan()  # re-planned into the same static buffers; the first plan is what runs
    if graph is not None:
        graph.replay()
        torch.cuda.synchronize()
    else:
        ret = run(kp)
    reason = _changed(prep, snap)
    if reason:
        return None, reason
    err, reason = second.judge(t, ret)
    return err, (f"the first plan, re-planned into the same static buffers, run on new "
                 f"values: {reason}" if reason else "")


def run_case(case: ConformanceCase, backend: str, device: str = "cpu") -> CaseResult:
    """Run ``case`` through its op with ``backend=`` forced and check the contract (see the
    module docstring); never raises for a failing kernel."""
    from ...kernels.registry import KernelSelectionError
    from ...types import CGSupport

    t0 = time.perf_counter()
    res = dict(name=case.name, op=case.op, bound=case.bound)

    def done(status, reason="", err=None, kernel=backend):
        return CaseResult(status=status, reason=reason, rel_err=err, kernel=kernel,
                          seconds=time.perf_counter() - t0, **res)

    try:
        prep = prepare(case, device)
    except (RuntimeError, TypeError) as exc:  # e.g. an fp8 dtype this torch/device lacks
        return done("unsupported", f"inputs cannot be built here: {exc}", kernel=None)
    impl = _named_impl(case.op, backend)
    snap = _snapshot(prep)
    try:
        ret = prep.invoke(prep.tensors, backend)
    except KernelSelectionError as exc:
        return done("unsupported", str(exc), kernel=None)
    except Exception as exc:  # a kernel that crashes fails the case, with the error
        return done("fail", f"raised {type(exc).__name__}: {exc}")
    reason = _changed(prep, snap)
    if reason:
        return done("fail", reason)
    err, reason = prep.judge(prep.tensors, ret)
    if reason:
        return done("fail", reason, err)
    cg = impl.capabilities.cg_support if impl is not None else CGSupport.NEVER
    if cg != CGSupport.NEVER:
        try:
            if impl.kernel_cls is not None:
                err2, reason = _plan_run_rerun(case, prep, impl, device, cg)
            else:
                err2, reason = _graph_rerun(case, prep, backend, device, cg)
        except Exception as exc:
            err2, reason = None, f"raised {type(exc).__name__}: {exc}"
        if reason:
            return done("fail", f"second run with the same buffers (the kernel declares "
                                f"cg_support={cg.name}): {reason}", err2)
    return done("pass", "", err)


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
    selected = select_cases(cases if cases is not None else CASES, ops=set(ops or ()),
                            quick=quick, names=set(names or ()))
    if dtype is not None:
        selected = [with_dtype(c, dtype) for c in selected]
    progress = os.environ.get("AITER_ATTN_VERIFY_PROGRESS", "") not in ("", "0")
    results = []
    for c in selected:
        results.append(run_case(c, backend, device))
        if progress:  # a slow device run shows where its time goes (stderr, per case)
            r = results[-1]
            print(f"verify {backend} {device} {r.name}: {r.status} in {r.seconds:.1f} s",
                  file=sys.stderr, flush=True)
    return ConformanceReport(backend, device, tuple(results))
