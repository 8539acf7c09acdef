"""The contract ``aiter-attn verify`` checks beyond the numbers (issue 12): results are read
from ``out`` and the return value is ``out``; softmax scales, windows, soft-caps and sinks
vary; every input is byte-identical after the call (only ``out`` / a KV write's target slots
/ an index builder's outputs change); NaN traps in the null page and past each request's
length; graph-capturable kernels run twice with the same buffers. Every deliberately broken
kernel of ``aiter_attn.testing.conformance.mutants``, registered by a throwaway plugin found
through its entry point, makes ``verify`` fail with the catching case named."""

import json
import math
import sys

import pytest
import torch

from aiter_attn import plugins
from aiter_attn.cli import main
from aiter_attn.kernels.reference import paged_attention_reference
from aiter_attn.kernels.registry import Capabilities
from aiter_attn.testing.conformance import (
    ATTENTION_OPS,
    CASES,
    INDEX_OPS,
    OPS,
    WRITE_OPS,
    prepare,
    run_case,
)
from aiter_attn.testing.conformance.mutants import MUTANTS, self_test
from aiter_attn.types import CGSupport

from ._triton_util import requires_triton
from .plugins.install import shared_site


@pytest.fixture
def fresh_registry():
    plugins.reset_plugins()
    yield plugins.kernel_registry()
    plugins.reset_plugins()


def _case(name):
    return next(c for c in CASES if c.name == name)


def _register(registry, name, fn, op="paged_attention", cg=CGSupport.NEVER, **caps):
    registry.register(op, name, fn, Capabilities(cg_support=cg, **caps), priority=-1,
                      source="test")


# ----------------------------------------------------------------------------- the cases

def test_scales_windows_softcaps_and_sinks_vary():
    attn = [c for c in CASES if c.op in ATTENTION_OPS]
    odd_scale = [c for c in attn if not math.isclose(c.softmax_scale, c.head_dim ** -0.5)]
    assert len({round(c.softmax_scale, 6) for c in attn}) >= 10
    for op in ATTENTION_OPS:  # every attention op has a case a scale-ignoring kernel fails
        assert any(c.op == op for c in odd_scale), op
    assert len({c.window for c in attn if c.window != (-1, -1)}) >= 4
    assert any(c.window[1] > 0 and not c.causal for c in attn)  # two-sided window
    assert len({c.softcap for c in attn if c.softcap}) >= 2
    assert any(c.sinks and c.op == "paged_attention_5d" for c in attn)
    assert any(c.num_kv_heads > 1 and c.num_q_heads // c.num_kv_heads == 5 for c in attn)


def test_every_op_has_cases_and_lse_is_covered():
    for op in OPS:
        assert any(c.op == op for c in CASES), op
    for op in ATTENTION_OPS:  # return_lse / out_lse on every attention op
        assert any(c.op == op and c.lse for c in CASES), op


def test_traps_sit_where_no_correct_kernel_reads():
    """Null page and every slot past a request's length in its last page are NaN; the
    output starts as NaN; the request's own keys are finite."""
    case = _case("extend-page16-prefix-crossing")
    t = prepare(case).tensors
    k, bt, lens = t["k_cache"], t["block_table"], t["seqused_k"].tolist()
    assert torch.isnan(k[0]).all() and torch.isnan(t["v_cache"][0]).all()
    assert torch.isnan(t["out"]).all()
    for b, L in enumerate(lens):
        pages = bt[b, : -(-L // 16)].long()
        keys = k[pages].reshape(-1, *k.shape[2:])
        assert torch.isfinite(keys[:L]).all()
        assert torch.isnan(keys[L:]).all()
        assert int(bt[b, len(pages)]) == 0  # past its pages: the null page


def test_second_variant_has_the_same_shapes_and_shorter_requests():
    case = _case("decode-page16-gqa5:1-d80")
    a, b = prepare(case).tensors, prepare(case, variant=1).tensors
    assert {n: t.shape for n, t in a.items()} == {n: t.shape for n, t in b.items()}
    assert (b["seqused_k"] <= a["seqused_k"]).all() and not torch.equal(b["seqused_k"],
                                                                        a["seqused_k"])


# ---------------------------------------------------------------------- the contract checks

def _returns_a_copy(q, k, v, out, **kw):
    return paged_attention_reference(q, k, v, out, **kw).clone()


def _returns_a_view(q, k, v, out, **kw):
    return paged_attention_reference(q, k, v, out, **kw)[:]


def _scribbles_on(name):
    def fn(q, k, v, out, **kw):
        paged_attention_reference(q, k, v, out, **kw)
        kw[name].add_(1) if name in kw else q.add_(1)
        return out
    return fn


def test_return_value_must_be_out(fresh_registry):
    case = _case("decode-page1-gqa4:1-d64")
    _register(fresh_registry, "copy", _returns_a_copy)
    _register(fresh_registry, "view", _returns_a_view)
    r = run_case(case, "copy")
    assert r.status == "fail" and "not `out`" in r.reason
    assert run_case(case, "view").status == "pass"  # the same storage is fine


@pytest.mark.parametrize("name", ["q", "block_table", "seqused_k", "cu_seqlens_q", "sinks"])
def test_changed_inputs_fail(fresh_registry, name):
    _register(fresh_registry, "scribbler", _scribbles_on(name), features={"sinks"})
    r = run_case(_case("sinks-page16"), "scribbler")
    assert r.status == "fail" and f"changed input `{name}`" in r.reason


def test_second_run_only_for_graph_capable_kernels(fresh_registry):
    stale = next(m for m in MUTANTS if m.name == "mutant-stale-on-replay")
    case = _case("decode-page16-gqa5:1-d80")
    _register(fresh_registry, "stale-never", stale.fn, cg=CGSupport.NEVER)
    _register(fresh_registry, "stale-always", stale.fn, cg=CGSupport.ALWAYS)
    assert run_case(case, "stale-never").status == "pass"  # one call: nothing to be stale
    r = run_case(case, "stale-always")
    assert r.status == "fail" and "second run with the same buffers" in r.reason


def test_write_op_touching_other_slots_fails(fresh_registry):
    from aiter_attn.kernels.reference import write_kv_reference

    def also_next_slot(k_cache, v_cache, slots, k, v, **kw):
        write_kv_reference(k_cache, v_cache, slots, k, v, **kw)
        write_kv_reference(k_cache, v_cache, slots + 1, k, v, **kw)

    _register(fresh_registry, "sloppy", also_next_slot, op="write_kv")
    r = run_case(_case("write_kv-page16-gqa"), "sloppy")
    assert r.status == "fail" and "`k_cache` differs from the reference" in r.reason


#: what each op's request can ask for: a kernel that declares one of these gets such calls, so
#: the suite must have a case that needs it (otherwise declaring it and ignoring it passes)
REQUESTABLE = {
    "paged_attention": {"sinks", "softcap", "window", "fp8", "custom_mask",
                        "v_head_dim_differs", "non_causal", "lse"},
    "paged_attention_5d": {"sinks", "softcap", "window", "fp8", "custom_mask",
                           "v_head_dim_differs", "non_causal", "lse"},
    "mla_paged_attention": {"fp8", "custom_mask", "lse"},
}


def test_every_requestable_feature_has_a_case():
    from aiter_attn.testing.conformance.runner import _kernel_request

    for op, wanted in REQUESTABLE.items():
        seen = set()
        for c in CASES:
            if c.op == op:
                seen |= _kernel_request(c, prepare(c).tensors).features
        assert wanted <= seen, (op, sorted(wanted - seen))
    for op in WRITE_OPS:  # fp8 caches: values divided by k_scale / v_scale
        assert any(c.op == op and c.kv_dtype is not None and c.k_scale != 1 for c in CASES), op
    # a row that sees nothing (zeros, LSE -inf): a 0/0 normalisation must be caught
    assert any(c.empty_rows and c.lse and c.op == "paged_attention" for c in CASES)


def _drop(feature, mla=False):
    """Arguments that ignoring ``feature`` changes (the kernel declares it but drops it)."""
    if feature == "fp8":
        return {"kv_scale": None} if mla else {"k_scale": None, "v_scale": None}
    return {"sinks": {"sinks": None}, "softcap": {"softcap": 0.0},
            "window": {"window_size": (-1, -1)}, "non_causal": {"causal": True},
            "custom_mask": {"custom_mask": None, "mask_indptr": None}}[feature]


def _ignoring(op, feature):
    from aiter_attn.kernels.reference import mla_paged_attention_reference
    from aiter_attn.kernels.reference_5d import paged_attention_5d_reference

    ref = {"paged_attention": paged_attention_reference,
           "paged_attention_5d": paged_attention_5d_reference,
           "mla_paged_attention": mla_paged_attention_reference}[op]

    def fn(*a, **kw):
        if feature == "lse":
            kw.pop("lse", None)  # never writes out_lse
        elif feature == "v_head_dim_differs":  # loops over the key width's lanes only
            ret = ref(*a, **kw)
            q, out = a[0], a[3]
            if out.shape[-1] != q.shape[-1]:
                out[..., out.shape[-1] // 2:] = 0
            return ret
        else:
            kw.update({k: v for k, v in _drop(feature, op == "mla_paged_attention").items()
                       if k in kw})
        return ref(*a, **kw)
    return fn


@pytest.mark.parametrize("op,feature", [(op, f) for op, fs in REQUESTABLE.items()
                                        for f in sorted(fs)])
def test_declared_but_ignored_feature_fails(fresh_registry, op, feature):
    """A kernel that declares every feature but ignores one fails ``verify`` on its op."""
    from aiter_attn.kernels.registry import FEATURES
    from aiter_attn.testing.conformance import run_conformance

    _register(fresh_registry, "ignores", _ignoring(op, feature), op=op, features=FEATURES)
    report = run_conformance("ignores", ops=[op])
    assert report.failed(), (op, feature)
    assert report.count("unsupported") == 0


# ------------------------------------------------------------------- mutation self-tests

def test_self_test_catches_every_mutant(fresh_registry):
    rows = self_test(quick=True)
    assert len(rows) == len(MUTANTS)
    assert {m.op for m in MUTANTS} == set(OPS)
    for m, report, missed in rows:
        assert not missed, (m.name, [(r.name, r.status) for r in report.results])


@pytest.fixture
def mutant_plugin(monkeypatch):
    """The mutants registered by a throwaway plugin found through its entry point."""
    monkeypatch.syspath_prepend(str(shared_site()))
    monkeypatch.setenv(plugins.ENV_ALLOW, "example_mutants")
    for name in [m for m in sys.modules if m.startswith("aiter_attn_test_plugins")]:
        monkeypatch.delitem(sys.modules, name)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_verify_fails_each_mutant_from_a_plugin(mutant_plugin, capsys, mutant):
    argv = ["verify", "--backend", mutant.name, "--op", mutant.op]
    for c in mutant.catches:
        argv += ["--case", c]
    assert main(argv + ["--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    by = {r["name"]: r for r in data["results"]}
    for c in mutant.catches:
        assert by[c]["status"] == "fail" and by[c]["reason"]
    assert plugins.kernel_registry().implementations(mutant.op)[-1].source == "example_mutants"
    assert main(argv) == 1  # the table names the failing case
    text = capsys.readouterr().out
    assert f"FAILED: {mutant.catches[0]}" in text


def test_cli_self_test(fresh_registry, capsys):
    assert main(["verify", "--self-test", "--quick"]) == 0
    out = capsys.readouterr().out
    assert f"{len(MUTANTS)} of {len(MUTANTS)} broken kernels caught" in out
    assert main(["verify", "--self-test", "--quick", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and all(r["caught"] and r["failed_cases"] for r in data["mutants"])


@pytest.mark.parametrize("argv,msg", [
    pytest.param([], "pass --backend NAME", id="nothing"),
    pytest.param(["--self-test", "--backend", "reference"], "drop --backend", id="both"),
    pytest.param(["--backend", "reference", "--case", "no-such-case"], "unknown case",
                 id="unknown-case"),
])
def test_cli_usage_errors_are_one_line(capsys, argv, msg):
    assert main(["verify", *argv]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and msg in out[0]


# ----------------------------------------------------------------------- our own kernels

@requires_triton
def test_triton_passes_the_quick_suite_with_every_check():
    """The Triton kernels (graph-capable: they also get the second run) pass the quick
    subset: no NaN trap read, no input touched, ``out`` returned."""
    from aiter_attn.testing.conformance import run_conformance

    report = run_conformance("triton", quick=True)
    bad = [(r.name, r.reason) for r in report.results if r.status != "pass"]
    assert not bad


def test_cli_verify_backend_without_a_kernel_for_the_device(fresh_registry, capsys):
    _register(fresh_registry, "gpuonly", paged_attention_reference, devices={"cuda"})
    assert main(["verify", "--backend", "gpuonly"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "runs on ['cuda'], not on 'cpu'" in out[0]


def test_kernel_object_is_driven_like_a_replay(fresh_registry):
    """A kernel object whose plan keeps a private copy of the lengths passes a functional call
    but fails the re-plan + replay of its first plan (cg_support ALWAYS)."""
    m = next(m for m in MUTANTS if m.name == "mutant-plan-copies-lengths")
    _register(fresh_registry, "plan-copy-never", m.fn)
    _register(fresh_registry, "plan-copy-always", m.fn, cg=CGSupport.ALWAYS)
    case = _case("decode-page16-gqa5:1-d80")
    assert run_case(case, "plan-copy-never").status == "pass"
    r = run_case(case, "plan-copy-always")
    assert r.status == "fail" and "re-planned into the same static buffers" in r.reason


@requires_triton
def test_triton_kernel_objects_survive_replan_and_replay():
    """The Triton attention kernels (cg_support ALWAYS) through plan/run with static buffers,
    including split-K decode and the LSE."""
    for name in ("decode-page16-gqa5:1-d80", "lse-extend-page16-gqa5:1-window-sinks",
                 "5d-decode-page16-gqa4:1"):
        r = run_case(_case(name), "triton")
        assert r.status == "pass", (name, r.reason)


#: the CUDA verify split so xdist spreads it (each case compiles its own kernels, 4–20 s on the
#: H200: one test of everything ran past 230 s, the 22 paged cases alone past 180 s), as
#: (id, ops, shard, shards): shard ``i`` of ``n`` takes every ``n``-th case of its ops
_PAGED_SHARDS = 4
_CUDA_GROUPS = [(f"paged{i}", ("paged_attention",), i, _PAGED_SHARDS)
                for i in range(_PAGED_SHARDS)] + [
    ("5d", ("paged_attention_5d",), 0, 1), ("mla", ("mla_paged_attention",), 0, 1),
    ("writes-indices", tuple(op for op in OPS if op not in ATTENTION_OPS), 0, 1)]


def test_cuda_verify_groups_cover_every_case_once():
    """The CUDA verify shards together run each conformance case exactly once."""
    names = [c.name for _, ops, i, n in _CUDA_GROUPS
             for c in [c for c in CASES if c.op in ops][i::n]]
    assert sorted(names) == sorted(c.name for c in CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("group", _CUDA_GROUPS, ids=lambda g: g[0])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_verify_on_cuda_captures_and_replays(backend, group):
    """On a GPU the second run of every graph-capable kernel is a real CUDA-graph capture and
    replay: the Triton and reference kernels pass every case of the group (at most 3
    unsupported, as over the whole suite)."""
    from aiter_attn.testing.conformance import run_conformance

    _, ops, shard, shards = group
    expected = [c for c in CASES if c.op in ops][shard::shards]
    report = run_conformance(backend, device="cuda", ops=ops,
                             names=[c.name for c in expected])
    bad = [(r.name, r.reason) for r in report.results if r.status == "fail"]
    assert not bad, backend
    assert len(report.results) == len(expected) > 0
    assert report.count("pass") >= len(expected) - 3, [(r.name, r.status, r.reason)
                                                       for r in report.results]


@pytest.mark.gpu
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_verify_on_cuda_catches_every_mutant(fresh_registry, mutant):
    """Every deliberately broken kernel still fails ``verify`` on CUDA, on the cases that
    catch it (graph capture and replay included)."""
    from aiter_attn.testing.conformance import run_conformance
    from aiter_attn.testing.conformance.mutants import register_mutants

    register_mutants()
    report = run_conformance(mutant.name, device="cuda", ops=[mutant.op],
                             names=mutant.catches)
    missed = [c for c in mutant.catches if c not in report.failed()]
    assert not missed, mutant.name
