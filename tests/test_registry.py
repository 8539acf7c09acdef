"""Kernel and strategy registries: priority, capabilities, reasons, explicit choices, env
override, selection cached per request."""

import pytest
import torch

from aiter_attn import AttnArch, BackendConfig, ForwardMode, StrategyPair
from aiter_attn.kernels.registry import (Capabilities, KernelRegistry, KernelRequest,
                                         KernelSelectionError)
from aiter_attn.registry import StrategyRegistry, StrategySelectionError
from aiter_attn.types import CGSupport


def _reg():
    r = KernelRegistry()
    r.register("paged_attention", "slow", lambda: "slow",
               Capabilities(cg_support=CGSupport.NEVER), priority=0)
    r.register("paged_attention", "fast", lambda: "fast",
               Capabilities(devices={"cuda"}, dtypes={torch.float16}, page_sizes={16},
                            features={"softcap"}, cg_support=CGSupport.NEVER), priority=10)
    return r


def test_priority_and_fallback_with_reasons():
    r = _reg()
    sel = r.select(KernelRequest(op="paged_attention", device="cuda", dtype=torch.float16,
                                 page_size=16))
    assert sel.impl.name == "fast"
    sel = r.select(KernelRequest(op="paged_attention", device="cpu", dtype=torch.float16,
                                 page_size=16))
    assert sel.impl.name == "slow"
    assert sel.rejected == (("fast", "device 'cpu' not in ['cuda']"),)


@pytest.mark.parametrize("req,reason", [
    (dict(device="cuda", dtype=torch.float32, page_size=16), "dtype torch.float32"),
    (dict(device="cuda", dtype=torch.float16, page_size=48), "page_size 48"),
    (dict(device="cuda", dtype=torch.float16, page_size=16, features={"sinks"}),
     "missing features \\['sinks'\\]"),
], ids=["dtype", "page", "feature"])
def test_explicit_choice_raises_with_reason(req, reason):
    r = _reg()
    with pytest.raises(KernelSelectionError, match=reason):
        r.select(KernelRequest(op="paged_attention", **req), backend="fast")


def test_env_override(monkeypatch):
    r = _reg()
    monkeypatch.setenv("AITER_ATTN_BACKEND", "slow")
    sel = r.select(KernelRequest(op="paged_attention", device="cuda", dtype=torch.float16,
                                 page_size=16))
    assert sel.impl.name == "slow"


def test_no_candidate_lists_every_reason():
    r = KernelRegistry()
    r.register("op", "a", lambda: 0, Capabilities(devices={"cuda"}, cg_support=CGSupport.NEVER))
    r.register("op", "b", lambda: 0, Capabilities(max_head_dim=64, cg_support=CGSupport.NEVER))
    with pytest.raises(KernelSelectionError, match="a: device .*b: head_dim 128 > max 64"):
        r.select(KernelRequest(op="op", device="cpu", head_dim=128))


def test_duplicate_needs_replace_and_selection_cached():
    r = _reg()
    with pytest.raises(ValueError, match="replace=True"):
        r.register("paged_attention", "slow", lambda: 1, Capabilities(cg_support=CGSupport.NEVER))
    req = KernelRequest(op="paged_attention")
    assert r.select(req) is r.select(req)
    r.register("paged_attention", "slow", lambda: "new", Capabilities(cg_support=CGSupport.NEVER), priority=50,
               replace=True)
    assert r.select(req).fn() == "new"  # registration invalidates the cache


def test_replacing_another_sources_kernel_says_who_replaced_whom(caplog):
    """Two plugins overriding one name: the later in load order wins, and the log names
    both sources (re-registering one's own kernel, or overriding a built-in, says
    nothing)."""
    import logging

    r = KernelRegistry()
    never = Capabilities(cg_support=CGSupport.NEVER)
    r.register("write_kv", "fast", lambda: 1, never, source="plugin_a")
    with caplog.at_level(logging.WARNING, logger="aiter_attn.kernels.registry"):
        r.register("write_kv", "fast", lambda: 2, never, source="plugin_a", replace=True)
        assert not caplog.records
        r.register("write_kv", "fast", lambda: 3, never, source="plugin_b", replace=True)
    (msg,) = [rec.getMessage() for rec in caplog.records]
    assert "'fast' of op 'write_kv' registered by plugin_a is replaced by plugin_b's" in msg
    assert r.implementations("write_kv")[0].source == "plugin_b"
    caplog.clear()
    r.register("write_kv", "reference", lambda: 4, never, source="reference")
    with caplog.at_level(logging.WARNING, logger="aiter_attn.kernels.registry"):
        r.register("write_kv", "reference", lambda: 5, never, source="plugin_c", replace=True)
    assert not caplog.records  # overriding a built-in is what replace=True is for


def test_unknown_feature_rejected():
    with pytest.raises(ValueError, match="unknown features"):
        Capabilities(features={"time-travel"}, cg_support=CGSupport.NEVER)


def _pair(name, modes, arch=AttnArch.MHA, **kw):
    return StrategyPair(name=name, arch=arch, modes=modes, metadata=object, execution=object, **kw)


def test_strategy_selection_and_reasons():
    r = StrategyRegistry()
    r.register(_pair("a", {ForwardMode.DECODE}, priority=1))
    r.register(_pair("b", {"decode", "extend"}, supports=lambda c: None if c.page_size == 1
                       else f"page_size {c.page_size} unsupported", priority=5))
    cfg16 = BackendConfig(page_size=16)
    assert r.select("decode", "mha", BackendConfig(page_size=1)).name == "b"
    assert r.select("decode", "mha", cfg16).name == "a"
    with pytest.raises(StrategySelectionError, match="b: page_size 16 unsupported"):
        r.select("extend", "mha", cfg16)
    with pytest.raises(StrategySelectionError, match="cannot serve EXTEND"):
        r.select("extend", "mha", cfg16, name="a")
    with pytest.raises(StrategySelectionError, match="serves MHA, not MLA"):
        r.select("decode", "mla", cfg16)


def test_builtin_registries_serve_mha():
    from aiter_attn.plugins import kernel_registry, strategy_registry

    assert strategy_registry().select("decode", "mha").cg_support >= CGSupport.UNIFORM_BATCH
    assert strategy_registry().select("extend", "mha").name == "mha.extend"
    sel = kernel_registry().select(KernelRequest(op="paged_attention", device="cpu",
                                                 dtype=torch.float32))
    assert sel.impl.name == "reference"


@pytest.mark.parametrize("field,value,msg", [
    ("devices", "cuda", "devices='cuda' is a str"),
    ("features", "lse", "features='lse' is a str"),
    ("page_sizes", 16, "page_sizes=16"),
    ("dtypes", {"float16"}, "dtypes holds 'float16'"),
    ("kv_dtypes", {torch.float8_e4m3fn, "fp8"}, "kv_dtypes holds 'fp8'"),
    ("head_dims", {64.0}, "head_dims holds 64.0"),
], ids=["str-devices", "str-features", "int-pages", "str-dtype", "str-kv-dtype", "float-dim"])
def test_capability_values_of_the_wrong_type_are_refused(field, value, msg):
    """A plugin author's slip (``devices="cuda"``, ``dtypes={"float16"}``) is a clear error at
    registration, not a kernel that is silently never selected (``"cuda"`` would become the
    set of its letters)."""
    with pytest.raises(TypeError, match=msg):
        Capabilities(cg_support=CGSupport.NEVER, **{field: value})


@pytest.mark.parametrize("answer", [True, False, 1])
def test_predicate_must_return_a_reason_or_none(answer):
    """A predicate returning a bool (``lambda r: r.head_dim <= 256``) is not taken as "serves"
    nor given an obscure reason such as ``True``: the reason says what is wrong."""
    r = KernelRegistry()
    r.register("paged_attention", "pred", lambda: "pred",
               Capabilities(cg_support=CGSupport.NEVER, predicate=lambda req: answer))
    with pytest.raises(KernelSelectionError,
                       match=f"predicate returned {answer!r}; it must return a reason"):
        r.select(KernelRequest(op="paged_attention"), backend="pred")
