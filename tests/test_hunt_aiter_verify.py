"""Defects found hunting the aiter plugin and the CLI (aiter_attn/kernels/aiter.py,
aiter_attn/kernels/aiter_marshal.py, aiter_attn/commands/verify.py): each test failed before
its fix, but ``test_wheel_unified_attention_serves_power_of_two_pages_only``, which binds the
wheel fact the first fix relies on (it runs the wheel's own kernel) and so passes either way.

- ``unified_attention`` (the route of sinks, sliding windows and, on releases whose
  ``mha_batch_prefill_func`` takes no ``k_descale``, fp8 extend) tiles decode steps by the
  page: ``tl.arange(0, block_size)``, which Triton builds for powers of 2 only. The plugin
  declared every page size, so the registry picked aiter for e.g. a sinks layer over pages of
  48 tokens, whose first decode step failed in Triton on the device. The capabilities now
  decline it with the reason, and the call builder refuses it before any aiter call.
- ``aiter-attn verify --backend B --op OP`` for an op ``B`` registers no kernel of reported
  every case "unsupported" and exited 0: nothing verified, read as success. It is now a
  usage error (exit 2) naming the ops ``B`` registers.
- ``verify --strict`` failing on unsupported cases printed a table ending in "0 failed" and
  no FAILED line, so the text output did not say why the exit code was 1.
"""

from __future__ import annotations

import json

import pytest
import torch

import aiter_attn.kernels.aiter as A
from aiter_attn import plugins
from aiter_attn.cli import main
from aiter_attn.kernels import aiter_marshal as M
from aiter_attn.kernels.reference import paged_attention_reference
from aiter_attn.kernels.registry import Capabilities, KernelRequest
from aiter_attn.types import CGSupport

from ._triton_util import INTERPRET
from .test_aiter_contract import (fake_module, install_fake_aiter, read_signatures,  # noqa: F401
                                  stub_gfx, wheel)

_UNIFIED = (("aiter/ops/triton/_triton_kernels/unified_attention.py",
             "aiter.ops.triton._triton_kernels.unified_attention"),
            ("aiter/ops/triton/unified_attention.py", "aiter.ops.triton.unified_attention"))


def _real_unified_attention(wheel, monkeypatch):  # noqa: F811
    """The wheel's own ``unified_attention`` (pure Triton), importable without ROCm: its two
    modules run from the wheel's source over a fake ``aiter`` package (80 compute units)."""
    fake_module(monkeypatch, "aiter.ops.triton.utils.device_info").get_num_sms = lambda: 80
    fake_module(monkeypatch, "aiter.ops.triton.utils.types").e4m3_dtype = torch.float8_e4m3fnuz
    for path, name in _UNIFIED:
        mod = fake_module(monkeypatch, name)
        mod.__file__ = path
        exec(compile(wheel.read(path), path, "exec"), mod.__dict__)
    return mod.unified_attention


def _decode_step(page_size, seed=0):
    """Two decode requests (one query token each), fp16, 8 query / 2 KV heads, with sinks."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = (20, 33)
    width = -(-max(kv_lens) // page_size)
    pages = 2 * width + 1
    k = torch.randn(pages, page_size, 2, 64, generator=g).half()
    v = torch.randn(pages, page_size, 2, 64, generator=g).half()
    q = torch.randn(2, 8, 64, generator=g).half()
    kw = dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
              seqused_k=torch.tensor(kv_lens, dtype=torch.int32),
              block_table=(torch.randperm(2 * width, generator=g) + 1).view(2, width).int(),
              softmax_scale=0.125, sinks=torch.randn(8, generator=g), max_seqlen_q=1)
    return q, k, v, kw


@pytest.mark.skipif(not INTERPRET, reason="runs the wheel's Triton kernel in Triton's CPU "
                                          "interpreter (TRITON_INTERPRET=1, as the suite runs)")
def test_wheel_unified_attention_serves_power_of_two_pages_only(wheel, monkeypatch):  # noqa: F811
    """The fact the capability relies on, from the wheel's kernel itself: a decode step over
    pages of 16 matches the reference; over pages of 48 Triton refuses the kernel."""
    unified = _real_unified_attention(wheel, monkeypatch)

    def run(page_size):
        q, k, v, kw = _decode_step(page_size)
        out = torch.zeros_like(q)
        bt = kw["block_table"]
        unified(q, k, v, out, kw["cu_seqlens_q"], 1, kw["seqused_k"], bt.shape[1] * page_size,
                0.125, True, (-1, -1), bt, 0.0, None, None, None, sinks=kw["sinks"])
        ref = paged_attention_reference(q.float(), k.float(), v.float(),
                                        torch.empty(q.shape), **kw)
        return float((out.float() - ref).norm() / ref.norm())

    assert run(16) < 3e-3
    with pytest.raises(Exception, match="power of 2"):
        run(48)


def _req(**kw):
    base = dict(op="paged_attention", device="cuda", dtype=torch.bfloat16,
                kv_dtype=torch.bfloat16, head_dim=128, v_head_dim=128, page_size=48)
    base.update(kw)
    return KernelRequest(**base)


def test_capabilities_decline_unified_routes_on_pages_not_a_power_of_two(wheel,  # noqa: F811
                                                                        monkeypatch):
    """Sinks and windows (and fp8 on 0.1.7, whose extend runs on unified_attention) over
    pages of 48 are declined with the reason; pages of 16/64 and plain layers stay served."""
    sigs = read_signatures(wheel)
    install_fake_aiter(monkeypatch, sigs, wheel.label)  # on gfx942: e4m3fnuz is native
    caps = A.capabilities()["paged_attention"]
    for features in ({"sinks"}, {"window"}, {"sinks", "window", "softcap"}):
        reason = caps.reject_reason(_req(features=features))
        assert reason and "page_size 48 is not a power of 2" in reason, features
        for ps in (16, 64):
            assert caps.reject_reason(_req(features=features, page_size=ps)) is None
    assert caps.reject_reason(_req()) is None  # ragged / mha_batch_prefill_func: any page
    assert caps.reject_reason(_req(features={"softcap"})) is None
    fp8 = _req(kv_dtype=torch.float8_e4m3fnuz, features={"fp8"})
    if "k_descale" in sigs["mha_batch_prefill_func"][1].parameters:
        assert caps.reject_reason(fp8) is None
    else:  # 0.1.7: fp8 extend goes to unified_attention
        assert "not a power of 2" in (caps.reject_reason(fp8) or "")
        assert caps.reject_reason(_req(kv_dtype=torch.float8_e4m3fnuz, features={"fp8"},
                                       page_size=16)) is None


def test_unified_call_refused_before_aiter_runs(wheel, monkeypatch):  # noqa: F811
    """A direct call (no registry in between) of a sinks layer over pages of 48 raises a
    ValueError naming the fix before any aiter function is called; pages of 16 reach it."""
    calls = install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    q, k, v, kw = _decode_step(48)
    with pytest.raises(ValueError, match="page_size 48 is not a power of 2.*pages of 16"):
        A.aiter_paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                torch.empty(q.shape, dtype=torch.bfloat16), **kw)
    assert calls == []
    q, k, v, kw = _decode_step(16)
    A.aiter_paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                            torch.empty(q.shape, dtype=torch.bfloat16), **kw)
    assert [name for name, _ in calls] == ["unified_attention"]
    assert M.unified_page_size_reason(1) is None and M.unified_page_size_reason(1024) is None


@pytest.fixture
def fresh_registry():
    plugins.reset_plugins()
    yield plugins.kernel_registry()
    plugins.reset_plugins()


def _register_paged_only(registry, name="mine", **caps):
    registry.register("paged_attention", name, paged_attention_reference,
                      Capabilities(cg_support=CGSupport.NEVER, **caps), priority=-1,
                      source="test")


def test_verify_refuses_an_op_the_backend_does_not_register(fresh_registry, capsys):
    """``--op write_kv`` for a backend with only a paged_attention kernel verified nothing
    (every case unsupported) and exited 0; now a usage error naming what it registers."""
    _register_paged_only(fresh_registry)
    assert main(["verify", "--backend", "mine", "--op", "write_kv", "--quick"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("aiter-attn verify: error: ")
    assert "registers no write_kv kernel" in out[0] and "['paged_attention']" in out[0]
    assert main(["verify", "--backend", "mine", "--op", "paged_attention", "--op", "write_kv",
                 "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and "registers no write_kv kernel" in data["error"]
    # an op it does register still runs
    assert main(["verify", "--backend", "mine", "--op", "paged_attention", "--case",
                 "decode-page1-gqa4:1-d64"]) == 0


def test_verify_strict_text_names_the_unsupported_cases(fresh_registry, capsys):
    """With --strict, unsupported cases fail the run: the text report said "0 failed" and
    nothing else; it now names them on a FAILED line."""
    _register_paged_only(fresh_registry, "nosinks")
    cases = ["--case", "sinks-page16", "--case", "decode-page1-gqa4:1-d64"]
    assert main(["verify", "--backend", "nosinks", *cases, "--strict"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == ("FAILED (--strict counts unsupported cases as failures): "
                         "sinks-page16")
    assert main(["verify", "--backend", "nosinks", *cases]) == 0
    assert "FAILED" not in capsys.readouterr().out


def test_verify_with_no_case_passing_fails_without_strict(fresh_registry, capsys):
    """Every selected case unsupported (the backend declines them all) exited 0 without
    --strict: a report with nothing verified read as conformance. It is now exit 1 with a
    line saying nothing was verified, in text and JSON, --strict or not."""
    _register_paged_only(fresh_registry, "nosinks")
    for extra in ([], ["--strict"]):
        assert main(["verify", "--backend", "nosinks", "--case", "sinks-page16", *extra]) == 1
        lines = capsys.readouterr().out.strip().splitlines()
        assert lines[-1].startswith("FAILED: no case passed, so nothing was verified: "
                                    "backend 'nosinks' declined every case (sinks-page16;")
    assert main(["verify", "--backend", "nosinks", "--case", "sinks-page16", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["passed"] == 0
