"""Defects found hunting the conformance suite and oracles (``aiter_attn.testing.conformance``,
``oracle.py``, ``compare.py``, ``scenario.py``): each test failed before its fix.

The suite passed these deliberately broken kernels, because no case reached their bug:

* a 5-D kernel that ignores the right edge of a two-sided window (only ``paged_attention`` had
  a non-causal two-sided window case);
* a kernel that gives a row seeing no key an LSE of ``-inf`` although it has a sink (no case
  had empty rows and sinks together);
* 5-D and MLA kernels that return NaN (0/0) for rows seeing no key (only ``paged_attention``
  had an empty-rows case);
* kernels that write an output row for a request with no query (vLLM's graph padding:
  ``q_len 0``, ``seqused_k 0``), onto the next request's first row (no case had such a
  request), and a page-table builder that gives an empty request a page;
* graph-capable kernels that keep their first call's lengths, when they serve page size 1
  only (aiter's MLA decode): the second run kept every page-1 length unchanged ("shorter on
  as many pages" is the same length with one token per page), so nothing was stale.
"""

import pytest
import torch

from aiter_attn import plugins
from aiter_attn.kernels.registry import FEATURES, Capabilities
from aiter_attn.testing.conformance import CASES, prepare, run_case, run_conformance
from aiter_attn.testing.conformance.mutants import MUTANTS, register_mutants
from aiter_attn.types import CGSupport

from ._triton_util import requires_triton

#: the mutants added with the cases that catch them
NEW_MUTANTS = ("mutant-5d-window-one-sided", "mutant-empty-rows-drop-sink",
               "mutant-zero-length-clobbers", "mutant-mla-zero-length-clobbers",
               "mutant-5d-nan-on-empty-rows", "mutant-mla-nan-on-empty-rows",
               "mutant-page-table-min-one-page")

#: the cases added
NEW_CASES = ("custom-mask-empty-rows-sinks-lse", "mixed-page16-zero-length-requests",
             "5d-window-two-sided-noncausal", "5d-custom-mask-empty-rows-lse",
             "5d-zero-length-requests", "mla-custom-mask-empty-rows-lse-h16-page1",
             "mla-zero-length-requests-h16-page1", "page_table-zero-length-request")


@pytest.fixture
def fresh_registry():
    plugins.reset_plugins()
    yield plugins.kernel_registry()
    plugins.reset_plugins()


def _mutant(name):
    return next(m for m in MUTANTS if m.name == name)


@pytest.mark.parametrize("name", NEW_MUTANTS)
def test_suite_rejects_the_mutant(fresh_registry, name):
    """The whole suite of the mutant's op fails it, on the cases it names."""
    m = _mutant(name)
    register_mutants()
    report = run_conformance(m.name, ops=[m.op])
    assert not report.ok, f"{m.name} ({m.bug}) passed every {m.op} case"
    missed = [c for c in m.catches if c not in report.failed()]
    assert not missed, (m.name, missed)


@pytest.mark.parametrize("op,stale", [
    ("paged_attention", "mutant-stale-on-replay"),
    ("paged_attention", "mutant-plan-copies-lengths"),
    ("mla_paged_attention", "mutant-mla-plan-copies-lengths"),
])
def test_stale_lengths_fail_a_page1_only_kernel(fresh_registry, op, stale):
    """A graph-capable kernel serving page size 1 only that keeps its first call's lengths
    fails: the second run's requests are shorter on page size 1 too."""
    fresh_registry.register(op, "page1-stale", _mutant(stale).fn,
                            Capabilities(features=FEATURES, page_sizes={1},
                                         cg_support=CGSupport.ALWAYS),
                            priority=-1, source="test")
    # custom-mask cases keep their lengths (the mask's shape depends on them)
    names = {c.name for c in CASES if c.op == op and c.page_size == 1 and not c.custom_mask}
    report = run_conformance("page1-stale", ops=[op], names=names)
    assert len(report.results) == len(names) > 0
    assert report.failed(), [(r.name, r.status) for r in report.results]


def test_page1_second_variant_is_shorter_with_the_same_shapes():
    case = next(c for c in CASES if c.name == "mla-decode-h16-page1")
    a, b = prepare(case).tensors, prepare(case, variant=1).tensors
    assert {n: t.shape for n, t in a.items()} == {n: t.shape for n, t in b.items()}
    assert (b["seqused_k"] <= a["seqused_k"]).all()
    assert not torch.equal(b["seqused_k"], a["seqused_k"])


def test_every_attention_op_has_empty_rows_and_zero_length_requests():
    for op in ("paged_attention", "paged_attention_5d", "mla_paged_attention"):
        cases = [c for c in CASES if c.op == op]
        assert any(c.empty_rows and c.lse for c in cases), op
        requests = [(q, k) for c in cases for q, k in zip(c.q_lens, c.kv_lens)]
        assert (0, 0) in requests, op  # graph padding
        assert any(q == 0 < k for q, k in requests), op  # keys but no query this step
    for op in ("paged_attention", "paged_attention_5d"):
        assert any(c.op == op and not c.causal and min(c.window) > 0 for c in CASES), op
    assert any(c.empty_rows and c.sinks and c.lse for c in CASES)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_real_kernels_pass_the_new_and_page1_cases(backend):
    """Our kernels pass the new cases and every page-1 case (Triton's is graph-capable: it
    also gets the shorter second run)."""
    names = set(NEW_CASES) | {c.name for c in CASES if c.page_size == 1}
    report = run_conformance(backend, names=names)
    assert len(report.results) == len(names)
    bad = [(r.name, r.status, r.reason) for r in report.results if r.status != "pass"]
    assert not bad
