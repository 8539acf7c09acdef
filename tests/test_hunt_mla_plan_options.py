"""Defect hunt of the Triton MLA kernel object's host-side planning
(:class:`aiter_attn.kernels.triton.mla.TritonMLA`: ``plan`` / ``run`` and the static
workspace of :mod:`aiter_attn.kernels.triton.mla_workspace`) under the option combinations
an engine meets: the narrow Gluon kernel as the 16-head default (forced to serve on this CPU
host, as ``tests/test_mla_narrow_default.py`` does), ``balanced``, ``fused_merge``,
``half_partials``, batch-invariant requests, verify steps and page sizes. No launch runs:
the launches are stubbed where ``run`` is reached."""

from __future__ import annotations

import itertools

import pytest
import torch

from aiter_attn.graph.buffers import GraphLimits
from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params, mla_request
from aiter_attn.kernels.triton import mla
from aiter_attn.kernels.triton.mla import TritonMLA
from aiter_attn.types import ForwardMode

from .test_mla_narrow_default import _step, sm90  # noqa: F401 (a fixture)


def _kernel(tuning, *, page=64, heads=16, batch_invariant=False, kv_dtype=torch.bfloat16):
    """A bound 16-head bf16 kernel (latents 512 + 64) over a cache of ``page``-key pages."""
    q = torch.zeros(1, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, page, 1, 576, dtype=kv_dtype)
    return TritonMLA(mla_request(q, kv, 512, batch_invariant=batch_invariant), tuning)


def _limits(max_bs, q_len, max_seq_len):
    mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    return GraphLimits(mode=mode, max_bs=max_bs, q_len=q_len, max_num_tokens=max_bs * q_len,
                       max_seq_len=max_seq_len)


def _graph_md(kernel, bs, q_len, max_seq_len, page, seqlen=None):
    """The metadata of a captured step as the graph planner makes it: ``bs`` requests of
    ``q_len`` queries over a static block table of ``ceil(max_seq_len / page)`` pages (its
    key bound: the table's width in keys, whole pages)."""
    n = bs * q_len
    q = torch.zeros(n, kernel.heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, page, 1, 576, dtype=kernel.kv_dtype)
    cu = torch.arange(0, n + 1, q_len, dtype=torch.int32)
    seqused = torch.full((bs,), seqlen or max_seq_len, dtype=torch.int32)
    bt = torch.zeros(bs, -(-max_seq_len // page), dtype=torch.int32)
    return _adhoc_metadata(q, kv, cu, seqused, bt, None, None, q_len, None, "test")


def _plan_every_batch(kernel, limits, page):
    """Allocate ``kernel.buffer_spec(limits)`` as the graph manager does, then plan every
    batch size up to the limits into it: each plan must fit the buffers (no fresh tensor
    added to the dict, partials viewing the static buffer from its start)."""
    static = kernel.buffer_spec(limits).allocate("cpu")
    names = set(static)
    for bs in range(1, limits.max_bs + 1):
        plan = kernel.plan(_graph_md(kernel, bs, limits.q_len, limits.max_seq_len, page),
                           static)
        added = set(static) - names
        assert not added, (f"bs={bs}: the plan allocated {sorted(added)} although "
                           "buffer_spec(limits) was built first")
        views = [plan.part_o] + ([plan.narrow[1]] if plan.narrow else []) + (
            [plan.balanced[1]] if plan.balanced else [])
        for v in views:
            if v is not None:
                assert v.data_ptr() == static[kernel._ws + ".o"].data_ptr()
    return static


# ------------------------------------------ defect: the page-rounded key bound of a graph

@pytest.mark.parametrize("max_bs,page,max_seq_len,tuning", [
    (4, 256, 100, {}), (1, 48, 100, {"block_n": 16})], ids=["page256", "page48-bn16"])
def test_static_workspace_covers_the_page_rounded_key_bound(max_bs, page, max_seq_len, tuning,
                                                             monkeypatch):
    """A captured step's key bound is its static block table's width in keys
    (``ceil(max_seq_len / page) · page``), which sets the split count; ``buffer_spec``
    sized the workspace for ``limits.max_seq_len`` itself, so with pages that cross a
    split boundary (256-key pages over 100 keys: 1 split for 100 keys, 2 for 256; 48-key
    pages and 16-key tiles: 2 splits for 100 keys, 3 for 144) the plan found no workspace
    and allocated one during capture, or found one too small and raised."""
    monkeypatch.setattr(mla, "MLA_NARROW", False)
    kernel = _kernel(tuning, page=page)
    limits = _limits(max_bs, 1, max_seq_len)
    _plan_every_batch(kernel, limits, page)


# ------------------------------------------------- defect: option values checked at once

@pytest.mark.parametrize("key,value", [
    ("pdl", "off"), ("pdl", "yes"), ("pdl", 1), ("narrow", "no"), ("narrow", 1),
    ("ring", "yes"), ("fused_merge", "coop"), ("fused_merge", 1), ("balanced", "yes"),
    ("balanced", 0), ("balanced", 2.0)])
def test_bad_option_values_refused_when_built(key, value):
    """A value an option does not take is refused when the kernel object is built, naming
    what is allowed: before, ``pdl="off"`` and ``narrow="no"`` turned the option on (a
    truthiness test), ``fused_merge="coop"`` was read only on steps with 2 to 16 splits and
    ``balanced`` only at the first plan."""
    with pytest.raises(ValueError, match=f"{key}={value!r}; allowed"):
        _kernel({key: value})


@pytest.mark.parametrize("tuning", [{"pdl": False}, {"pdl": True}, {"pdl": "reduce"},
                                    {"pdl": "early"},
                                    {"narrow": True}, {"narrow": False}, {"ring": True},
                                    {"fused_merge": "cooperative"}, {"fused_merge": False},
                                    {"balanced": True}, {"balanced": 96}, {"balanced": False}])
def test_good_option_values_accepted(tuning):
    """(Pins behaviour.) Every documented value is accepted."""
    assert _kernel(tuning).tuning == tuning


# ------------------------------------------------ defect: None is the default, as in the API

def test_none_option_takes_the_default(sm90, monkeypatch):
    """``{"narrow": None, "pdl": None}`` (an engine's unset settings, which
    ``mla_paged_attention(narrow=None, pdl=None)`` reads as the defaults) keeps the narrow
    kernel and its early merge: before, ``tuning.get(key, default)`` returned the None and
    turned both off."""
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    assert _kernel({"narrow": None})._narrow_splits(64, 4096, "cpu", 64, None) == 2
    plan, launched, merged = _step({"narrow": None, "pdl": None, "gluon": None}, monkeypatch)
    assert plan.narrow is not None and launched and launched[0]["pdl"] == "early"
    assert merged == [{"PDL": True, "launch_pdl": True, "RELEASE_FIRST": True}]


# ------------------------------------------------------------------ pins: the workspace

_OPTIONS = [{}, {"balanced": True}, {"balanced": 200}, {"fused_merge": True},
            {"half_partials": False}, {"narrow": True, "balanced": True}, {"ring": True},
            {"narrow": False}]


@pytest.mark.parametrize("narrow_default", [True, False], ids=["narrow-default", "no-narrow"])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["", "bi"])
def test_static_workspace_covers_every_option(narrow_default, q_len, batch_invariant, sm90,
                                              monkeypatch):
    """(Pins behaviour.) With the narrow kernel forced to serve, 132 SMs and an H100's
    shared memory, every batch of decode and verify limits, for each option set, plans
    into the buffers of ``buffer_spec(limits)`` without allocating."""
    monkeypatch.setattr(mla, "MLA_NARROW", narrow_default)
    monkeypatch.setattr(mla, "max_shared_mem", lambda device: 232448)
    for tuning, max_seq_len in itertools.product(_OPTIONS, (100, 1000, 40000)):
        kernel = _kernel(tuning, batch_invariant=batch_invariant)
        _plan_every_batch(kernel, _limits(24, q_len, max_seq_len), 64)


def test_static_workspace_too_small_raises(sm90, monkeypatch):
    """(Pins behaviour.) A dict sized for fewer requests than a plan's batch is refused
    with the fix named, not regrown."""
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    kernel = _kernel({})
    static = kernel.buffer_spec(_limits(1, 1, 4096)).allocate("cpu")
    with pytest.raises(RuntimeError, match="buffer_spec"):
        kernel.plan(_graph_md(kernel, 2, 1, 8192, 64), static)


# ------------------------------------------- pins: one launch per step on the shared buffer

def _run_recorded(kernel, plan, monkeypatch, *, descs=("kn", "kr"), kv_scale=None):
    """Run ``plan`` on a 2-request decode step with every launch recorded: ``(name,
    part_o)`` of the narrow, Triton and merge launches."""
    calls = []
    monkeypatch.setattr(TritonMLA, "_cache_descs", lambda self, kv, *a, **k: descs)
    monkeypatch.setattr(mla, "launch_narrow_mla",
                        lambda *a, **k: calls.append(("narrow", k["part_o"])))
    monkeypatch.setattr(TritonMLA, "_launch_triton",
                        lambda self, *a: calls.append(("triton", a[11])))
    monkeypatch.setattr(mla, "merge_splits", lambda out, po, *a, **k: calls.append(("merge", po)))
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 1, 576, dtype=kernel.kv_dtype)
    params = mla_layer_params(scale=0.1, device=q.device, kv_lora_rank=512, num_q_heads=16,
                              head_dim=576, kv_scale=kv_scale, fp8=kv_scale is not None,
                              causal=True)
    kernel.run(q, (kv,), plan, params, torch.empty(2, 16, 512, dtype=torch.bfloat16))
    return calls


@pytest.mark.parametrize("fallback", [None, "no descriptors", "fp8 scales"])
def test_narrow_or_triton_launch_never_both(fallback, sm90, monkeypatch):
    """(Pins behaviour.) A plan holding both the narrow launch and its Triton fallback,
    whose partials view the same static buffer from offset 0, runs exactly one of them and
    merges that one's partials: the narrow kernel where the cache's descriptors exist, the
    Triton kernel without them or with device-read fp8 scales."""
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    fp8 = fallback == "fp8 scales"
    kernel = _kernel({}, kv_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    static = kernel.buffer_spec(_limits(2, 1, 8192)).allocate("cpu")
    plan = kernel.plan(_graph_md(kernel, 2, 1, 8192, 64), static)
    assert plan.narrow is not None and plan.narrow[0] > 1 and plan.use_parts
    assert plan.narrow[1].data_ptr() == plan.part_o.data_ptr()
    calls = _run_recorded(kernel, plan, monkeypatch,
                          descs=None if fallback == "no descriptors" else ("kn", "kr"),
                          kv_scale=1.0 if fp8 else None)
    want = "narrow" if fallback is None else "triton"
    parts = plan.narrow[1] if fallback is None else plan.part_o
    assert [c[0] for c in calls] == [want, "merge"], calls
    assert all(c[1] is parts for c in calls)


def test_plan_reused_across_steps_keeps_its_views(sm90, monkeypatch):
    """(Pins behaviour.) Re-planning into the same static dict (a captured batch size
    planned again at replay) gives the same views and adds nothing."""
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    kernel = _kernel({"fused_merge": True})
    static = kernel.buffer_spec(_limits(4, 1, 8192)).allocate("cpu")
    md = _graph_md(kernel, 3, 1, 8192, 64)
    a, b = kernel.plan(md, static), kernel.plan(md, static)
    assert a.narrow[1].data_ptr() == b.narrow[1].data_ptr()
    assert a.narrow[4] is not None and a.narrow[4].data_ptr() == b.narrow[4].data_ptr()
    assert int(static[kernel._ws + ".cnt"].abs().sum()) == 0
