"""The conformance suite plugin authors run: it passes on the reference, reports the example
plugin's unsupported cases with reasons, and catches wrong kernels (bad math, wrong page,
NaN, exceptions); ``aiter-attn verify`` prints it and sets the exit code. The contract checks
(``out`` written and returned, inputs untouched, NaN traps, varied scales, the second run of
graph-capturable kernels) and the mutation self-test live in ``test_conformance_contract.py``."""

import json
import os
import subprocess
import sys

import pytest

from aiter_attn import plugins
from aiter_attn.cli import main
from aiter_attn.kernels.reference import paged_attention_reference
from aiter_attn.kernels.registry import Capabilities
from aiter_attn.types import CGSupport
from aiter_attn.testing.conformance import (
    CASES,
    ConformanceCase,
    ConformanceError,
    conformance_params,
    run_case,
    run_conformance,
)

from .plugins.install import shared_site


@pytest.fixture
def fresh_registry():
    plugins.reset_plugins()
    yield plugins.kernel_registry()
    plugins.reset_plugins()


def test_reference_passes_every_case():
    report = run_conformance("reference")
    bad = [(r.name, r.status, r.reason) for r in report.results if r.status != "pass"]
    assert not bad
    assert len(report.results) == len(CASES)


def test_cases_cover_the_advertised_shapes_and_features():
    names = " ".join(c.name for c in CASES)
    for needle in ("decode", "prefill", "extend", "mixed", "gqa5:1", "d80", "page1-",
                   "page16", "page48", "window", "sinks", "softcap", "fp8", "custom-mask",
                   "noncausal", "mla-decode-h4", "mla-verify-h8", "mla-extend", "fp16", "bf16",
                   "5d-", "hd_page", "two-sided"):
        assert needle in names, needle
    from aiter_attn.testing.conformance import OPS

    assert {c.op for c in CASES} == set(OPS)
    assert len({c.name for c in CASES}) == len(CASES)
    assert any(c.quick for c in CASES)


def test_pytest_entry_point():
    params = conformance_params(quick=True, ops=["paged_attention"])
    assert params and all(p.values[0].op == "paged_attention" for p in params)
    assert [p.id for p in params] == [p.values[0].name for p in params]


@pytest.mark.parametrize("case", conformance_params(quick=True))
def test_quick_cases_through_pytest_entry(case):
    run_case(case, backend="reference").raise_for_status(allow_unsupported=False)


def test_bad_case_definition_is_rejected():
    with pytest.raises(ValueError, match="each q_len ≤ its kv_len"):
        ConformanceCase(name="bad", q_lens=(3,), kv_lens=(2,))


def _register(registry, name, fn, **caps):
    registry.register("paged_attention", name, fn, Capabilities(**{"cg_support": CGSupport.NEVER, **caps}),
                      priority=-1,
                      source="test")


def _scaled_wrong(q, k, v, out, **kw):
    kw["softmax_scale"] *= 1.01
    return paged_attention_reference(q, k, v, out, **kw)


def _reads_null_page(q, k, v, out, **kw):
    kw["block_table"] = kw["block_table"].clone()
    kw["block_table"][:, 0] = 0
    return paged_attention_reference(q, k, v, out, **kw)


def _nan(q, k, v, out, **kw):
    paged_attention_reference(q, k, v, out, **kw)
    out[0, 0, 0] = float("nan")
    return out


def _raises(q, k, v, out, **kw):
    raise RuntimeError("kernel launch failed")


@pytest.mark.parametrize("fn,reason", [
    pytest.param(_scaled_wrong, "relative error", id="wrong-scale"),
    pytest.param(_reads_null_page, "non-finite", id="null-page"),
    pytest.param(_nan, "non-finite", id="nan"),
    pytest.param(_raises, "kernel launch failed", id="raises"),
])
def test_wrong_kernels_fail(fresh_registry, fn, reason):
    _register(fresh_registry, "broken", fn)
    case = next(c for c in CASES if c.name == "extend-page16-prefix-crossing")
    result = run_case(case, "broken")
    assert result.status == "fail" and reason in result.reason
    with pytest.raises(ConformanceError):
        result.raise_for_status()


def test_unsupported_is_reported_with_the_reason(fresh_registry):
    _register(fresh_registry, "nosinks", paged_attention_reference, features={"window"})
    report = run_conformance("nosinks", names=["sinks-page16", "window-page16-w8",
                                               "mla-decode-h16-page1"])
    by = {r.name: r for r in report.results}
    assert by["window-page16-w8"].status == "pass"
    assert by["sinks-page16"].status == "unsupported"
    assert "missing features ['sinks']" in by["sinks-page16"].reason
    assert "no kernel for op 'mla_paged_attention'" in by["mla-decode-h16-page1"].reason
    assert report.ok  # unsupported is not a failure...
    with pytest.raises(ConformanceError):  # ...unless the caller says so
        by["sinks-page16"].raise_for_status(allow_unsupported=False)


def test_cli_verify_reference_json(capsys):
    assert main(["verify", "--backend", "reference", "--quick", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["failed"] == 0 and data["passed"] == len(data["results"]) > 0


def test_cli_verify_text_and_op_filter(capsys):
    assert main(["verify", "--backend", "reference", "--op", "mla_paged_attention",
                 "--case", "mla-decode-h4-page64"]) == 0
    out = capsys.readouterr().out
    assert "mla-decode-h4-page64" in out and "1 passed, 0 failed, 0 unsupported" in out


def test_cli_verify_dtype_override(capsys):
    assert main(["verify", "--backend", "reference", "--quick", "--dtype", "bfloat16",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    from aiter_attn.testing.conformance import ATTENTION_OPS

    attn = [r for r in data["results"] if r["op"] in ATTENTION_OPS]
    assert data["ok"] and attn and all(r["bound"] == 2e-2 for r in attn)


def test_with_dtype_keeps_fp8_caches():
    import torch

    from aiter_attn.testing.conformance import with_dtype

    fp8 = next(c for c in CASES if c.name == "fp8e4m3fn-page16-scales")
    plain = next(c for c in CASES if c.name == "sinks-page16")
    assert with_dtype(fp8, torch.float16).kv_dtype == fp8.kv_dtype
    assert with_dtype(plain, torch.float16).kv_dtype is None
    assert with_dtype(plain, torch.float16).bound == 3e-3
    with pytest.raises(ValueError, match="allowed"):
        with_dtype(plain, torch.float64)


def test_cli_verify_unusable_device(capsys):
    assert main(["verify", "--backend", "reference", "--device", "nonsense"]) == 2
    out = capsys.readouterr().out
    assert "is not usable here" in out and len(out.strip().splitlines()) == 1


def test_cli_verify_unknown_backend(capsys):
    assert main(["verify", "--backend", "nonexistent"]) == 2
    assert "not registered" in capsys.readouterr().out


def test_cli_verify_exit_code_on_failure(fresh_registry, capsys):
    _register(fresh_registry, "broken", _scaled_wrong)
    assert main(["verify", "--backend", "broken", "--case", "decode-page1-gqa4:1-d64"]) == 1
    assert "fail" in capsys.readouterr().out


def test_cli_verify_strict_counts_unsupported(fresh_registry):
    _register(fresh_registry, "nosinks", paged_attention_reference)
    cases = ["--case", "sinks-page16", "--case", "decode-page1-gqa4:1-d64"]
    assert main(["verify", "--backend", "nosinks", *cases]) == 0
    assert main(["verify", "--backend", "nosinks", *cases, "--strict"]) == 1
    # nothing passing is a failure either way (tests/test_hunt_aiter_verify.py)
    assert main(["verify", "--backend", "nosinks", "--case", "sinks-page16"]) == 1


EXAMPLE_CASES = ("decode-page16-gqa5:1-d80", "mixed-page48-gqa5:1-d80", "custom-mask-page16",
                 "fp8e4m3fn-page16-scales", "sinks-page16", "mla-decode-h16-page1")


def test_example_plugin_verifies():
    """A real installed third-party plugin, run through the CLI in a fresh process."""
    site = shared_site()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH",
                                                                                 "")]),
               AITER_ATTN_PLUGINS="example")
    cases = [arg for name in EXAMPLE_CASES for arg in ("--case", name)]
    proc = subprocess.run(
        [sys.executable, "-m", "aiter_attn.cli", "verify", "--backend", "example", "--json",
         *cases], env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    by = {r["name"]: r for r in data["results"]}
    assert by["decode-page16-gqa5:1-d80"]["status"] == "pass"
    assert by["custom-mask-page16"]["status"] == "pass"
    assert by["sinks-page16"]["status"] == "unsupported"
    assert "missing features ['sinks']" in by["sinks-page16"]["reason"]
    assert by["mla-decode-h16-page1"]["status"] == "unsupported"
    assert (data["passed"], data["failed"], data["unsupported"]) == (4, 0, 2)
