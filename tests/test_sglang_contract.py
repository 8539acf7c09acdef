"""The SGLang plugin's contract with the real ``sglang`` 0.5.23 wheel, checked on the CPU.

SGLang cannot be imported beside our torch pin, so (as ``test_aiter_contract.py`` does for
aiter) everything is read from the wheel's source with ``ast`` (``tests/_sglang_wheel.py``):

* every override of SGLang's ``AttentionBackend`` accepts every call the base method's
  signature allows, and every call the wheel makes to these methods binds to ours;
* the older capture/replay hooks bind to their pre-0.5.23 signatures and to the wheel's
  remaining legacy call;
* the registry decorator, the factory call, the choices hook, the plugin entry-point group and
  the loader (executed from the wheel) take what we give them;
* every ``ForwardBatch`` field, ``RadixAttention`` / ``ModelRunner`` / KV-pool attribute the
  adapter reads exists in the wheel, every ``ForwardMode`` member is mapped or refused with a
  reason, and the dtypes the adapter tests build batches with are the wheel's.

The mutation self-tests at the end break one thing at a time and expect the check to fail.
"""

from __future__ import annotations

import ast
import inspect
import logging
import tomllib
import types
from importlib.metadata import EntryPoint

import pytest
import torch

import aiter_attn.integrations.sglang as plugin
from aiter_attn.integrations.sglang import translate as T
from aiter_attn.integrations.sglang.adapter import AiterAttnSGLangBackend

from . import _sglang_wheel as W

#: the 0.5.23 contract (methods of the base class this adapter must implement)
CONTRACT = ("init_forward_metadata", "init_forward_metadata_out_graph",
            "init_forward_metadata_in_graph", "init_cuda_graph_state",
            "get_cuda_graph_seq_len_fill_value", "forward_extend", "forward_decode")
LEGACY = ("init_forward_metadata_capture_cuda_graph", "init_forward_metadata_replay_cuda_graph")
#: the legacy hooks as SGLang's ABC declared them before 0.5.23 (removed from the 0.5.23 ABC;
#: ``=`` marks a default)
LEGACY_SNAPSHOT = {
    "init_forward_metadata_capture_cuda_graph":
        "self bs num_tokens req_pool_indices seq_lens encoder_lens forward_mode spec_info",
    "init_forward_metadata_replay_cuda_graph":
        "self bs req_pool_indices seq_lens seq_lens_sum encoder_lens forward_mode spec_info "
        "seq_lens_cpu",
}
#: where the wheel calls attention backends
CALLER_DIRS = ("sglang/srt/model_executor/", "sglang/srt/speculative/",
               "sglang/srt/layers/attention/", "sglang/srt/layers/radix_attention.py",
               "sglang/srt/hardware_backend/", "sglang/srt/managers/")
#: receivers of those method names that are not attention backends
NOT_BACKENDS = {"attention_adapter": "MiniCPM's sparse-attention adapter (its own signature)"}
#: dtypes of the batch SGLang builds (checked against the wheel below; the adapter tests use them)
SGLANG_DTYPES = {"seq_lens": torch.int64, "extend_seq_lens": torch.int32,
                 "extend_prefix_lens": torch.int32, "out_cache_loc": torch.int64}


@pytest.fixture(scope="module")
def wheel():
    return W.load_wheel()


def _snapshot(spec: str) -> inspect.Signature:
    P = inspect.Parameter
    return inspect.Signature([P(t.rstrip("="), P.POSITIONAL_OR_KEYWORD,
                                default=W._DEFAULT if t.endswith("=") else P.empty)
                              for t in spec.split()])


# --------------------------------------------------------------------------------------------
# checkers (each returns a list of problems; the mutation tests feed them broken inputs)


def _calls_of(sig: inspect.Signature):
    """Two calls the signature ``sig`` (self first) accepts: all positional, all keyword."""
    params = list(sig.parameters.values())[1:]
    P = inspect.Parameter
    pos, kw_all, kw_only = [], {}, {}
    for p in params:
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            continue
        if p.kind == P.KEYWORD_ONLY:
            kw_only[p.name] = object()
        else:
            pos.append(object())
        if p.kind != P.POSITIONAL_ONLY:
            kw_all[p.name] = object()
    return [(pos, kw_only), ([], kw_all)]


def check_overrides(cls, base_methods: dict, names) -> list:
    """Every ``names`` method of ``cls`` accepts every call the base signature allows."""
    problems = []
    for name in names:
        if name not in base_methods:
            problems.append(f"the base class has no {name}")
            continue
        ours = inspect.signature(getattr(cls, name))
        base = W.signature_from_ast(base_methods[name])
        for args, kwargs in _calls_of(base):
            try:
                ours.bind(None, *args, **kwargs)
            except TypeError as exc:
                problems.append(f"{name}{ours} refuses a base-signature call: {exc}")
        for kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if any(p.kind == kind for p in base.parameters.values()) and not any(
                    p.kind == kind for p in ours.parameters.values()):
                problems.append(f"{name}{ours} lacks the base's {kind.description} parameter")
    return problems


def check_legacy(cls) -> list:
    problems = []
    for name, spec in LEGACY_SNAPSHOT.items():
        ours = inspect.signature(getattr(cls, name))
        for args, kwargs in _calls_of(_snapshot(spec)):
            try:
                ours.bind(None, *args, **kwargs)
            except TypeError as exc:
                problems.append(f"{name}{ours} refuses the legacy call: {exc}")
    return problems


_CALLS: dict = {}


def wheel_calls(src, names) -> list:
    """``(file, line, method, n_positional, keywords)`` of every call ``x.method(...)`` in the
    caller directories. Left out: calls with ``*``/``**`` splats (nothing to bind),
    ``super().method(...)`` (a backend calling its own base class with its own extras) and the
    receivers of :data:`NOT_BACKENDS`."""
    key = (src.path, tuple(names))
    if key in _CALLS:
        return _CALLS[key]
    found = _CALLS[key] = []
    for rel in src.files():
        if not rel.startswith(CALLER_DIRS):
            continue
        text = src.read(rel)
        if not any(n in text for n in names):
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in names):
                recv = node.func.value
                if any(isinstance(a, ast.Starred) for a in node.args) or any(
                        k.arg is None for k in node.keywords):
                    continue
                if isinstance(recv, ast.Call) and getattr(recv.func, "id", None) == "super":
                    continue
                if getattr(recv, "attr", getattr(recv, "id", None)) in NOT_BACKENDS:
                    continue
                found.append((rel, node.lineno, node.func.attr, len(node.args),
                              [k.arg for k in node.keywords]))
    return found


def check_calls(cls, calls) -> list:
    problems = []
    for rel, line, name, npos, kws in calls:
        sig = inspect.signature(getattr(cls, name))
        try:
            sig.bind(None, *([object()] * npos), **{k: object() for k in kws})
        except TypeError as exc:
            problems.append(f"{rel}:{line} {name}({npos} positional, {kws}): {exc}")
    return problems


def check_fields(src, batch_fields=T.BATCH_FIELDS, layer_fields=T.LAYER_FIELDS,
                 runner_fields=T.RUNNER_FIELDS) -> list:
    problems = []
    fb = set(W.annotated_fields(W.find_class(src.tree(W.BATCH_INFO), "ForwardBatch")))
    problems += [f"ForwardBatch has no field {f}" for f in batch_fields if f not in fb]
    radix = W.self_attributes(W.find_def(W.find_class(src.tree(W.RADIX), "RadixAttention"),
                                         "__init__"))
    problems += [f"RadixAttention sets no {f}" for f in layer_fields if f not in radix]
    runner = W.self_attributes(W.find_class(src.tree(W.MODEL_RUNNER), "ModelRunner"))
    problems += [f"ModelRunner sets no {f}" for f in runner_fields if f not in runner]
    pool_tree = src.tree(W.MEMORY_POOL)
    mha = W.find_class(pool_tree, "MHATokenToKVPool")
    problems += [f"MHATokenToKVPool has no {m}()" for m in T.POOL_METHODS
                 if m not in W.methods(mha)]
    kv = W.self_attributes(W.find_class(pool_tree, "KVCache")) | W.self_attributes(mha)
    problems += [f"MHATokenToKVPool sets no {f}" for f in T.POOL_FIELDS if f not in kv]
    r2t = W.self_attributes(W.find_class(pool_tree, "ReqToTokenPool"))
    problems += [f"ReqToTokenPool sets no {f}" for f in ("req_to_token",) if f not in r2t]
    verify = set(W.annotated_fields(W.find_class(src.tree(W.EAGLE_INFO), "EagleVerifyInput")))
    problems += [f"EagleVerifyInput has no {f}" for f in
                 ("draft_token_num", "topk", "custom_mask", "num_tokens_per_req")
                 if f not in verify]
    spec_text = src.read(W.SPEC_FIELDS)
    problems += [f"server args have no {f}" for f in
                 ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                  "speculative_num_draft_tokens") if f"    {f}:" not in spec_text]
    if W.find_def(src.tree(W.RUNTIME_CONTEXT), "get_spec") is None:
        problems.append("runtime_context has no get_spec()")
    return problems


def check_modes(src, mode_map=T.MODE_MAP, unsupported=T.UNSUPPORTED_MODES) -> list:
    members = list(W.forward_mode_enum(src).__members__)
    return [f"ForwardMode.{m} is neither mapped nor refused" for m in members
            if m not in mode_map and m not in unsupported]


def _pyproject_entry_points() -> dict:
    data = tomllib.loads((W.REPO / "pyproject.toml").read_text())
    return data["project"].get("entry-points", {})


def check_plugin(src, entry_points=None) -> list:
    problems = []
    eps = _pyproject_entry_points() if entry_points is None else entry_points
    tree = src.tree(W.PLUGINS)
    groups = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    group = groups.get("GENERAL_PLUGINS_GROUP")
    if group != plugin.ENTRY_POINT_GROUP:
        problems.append(f"SGLang's general-plugin group is {group!r}, ours "
                        f"{plugin.ENTRY_POINT_GROUP!r}")
    target = eps.get(group or "", {}).get(plugin.BACKEND_NAME)
    if target != "aiter_attn.integrations.sglang:register":
        problems.append(f"pyproject has no entry point {plugin.BACKEND_NAME} in group {group!r} "
                        f"pointing at aiter_attn.integrations.sglang:register (got {target!r})")
    load = W.find_def(tree, "load_plugins")
    calls = [n for n in ast.walk(load) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == "func"]
    if not calls or any(c.args or c.keywords for c in calls):
        problems.append("SGLang's load_plugins no longer calls each plugin as func()")
    return problems


def check_registry(src) -> list:
    problems = []
    reg = W.find_def(src.tree(W.REGISTRY), "register_attention_backend")
    if reg is None or [a.arg for a in reg.args.args] != ["name"]:
        problems.append("register_attention_backend(name) is gone or changed")
    calls = [n for n in ast.walk(src.tree(W.BACKEND_SETUP)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Subscript)
             and getattr(n.func.value, "id", None) == "ATTENTION_BACKENDS"]
    if not calls:
        problems.append("SGLang no longer calls ATTENTION_BACKENDS[name](...)")
    for c in calls:
        try:
            inspect.signature(plugin.create_backend).bind(*([object()] * len(c.args)),
                                                          **{k.arg: 1 for k in c.keywords})
        except TypeError as exc:
            problems.append(f"the factory refuses SGLang's call: {exc}")
    choices = src.tree(W.CHOICES)
    names = {t.id for n in choices.body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}
    for need in ("ATTENTION_BACKEND_CHOICES", "add_attention_backend_choices"):
        if need not in names:
            problems.append(f"arg_groups/choices.py has no {need}")
    return problems


# --------------------------------------------------------------------------------------------
# the tests


def _base_methods(src):
    return W.methods(W.find_class(src.tree(W.BASE), "AttentionBackend"))


def test_overrides_match_the_base_class(wheel):
    assert check_overrides(AiterAttnSGLangBackend, _base_methods(wheel), CONTRACT) == []
    # the legacy hooks left the 0.5.23 ABC; ours keep their older signatures
    assert not set(LEGACY) & set(_base_methods(wheel))
    assert check_legacy(AiterAttnSGLangBackend) == []


def test_every_wheel_call_binds(wheel):
    calls = wheel_calls(wheel, CONTRACT + LEGACY)
    assert check_calls(AiterAttnSGLangBackend, calls) == []
    seen = {c[2] for c in calls}
    # the runners really call the 0.5.23 names, the contract is not vacuous
    assert {"init_forward_metadata", "init_forward_metadata_out_graph",
            "init_forward_metadata_in_graph", "init_cuda_graph_state",
            "get_cuda_graph_seq_len_fill_value", "forward_decode"} <= seen, seen
    assert "init_forward_metadata_replay_cuda_graph" in seen  # the NPU DSv4 child call
    out_graph = [c for c in calls if c[2] == "init_forward_metadata_out_graph"]
    assert any("in_capture" in c[4] for c in out_graph) and len(out_graph) > 5


def test_base_forward_dispatches_to_our_methods(wheel):
    """The base ``forward`` (SGLang's, not overridden) calls ``forward_decode`` /
    ``forward_extend`` with ``save_kv_cache=`` and ``**kwargs``: ours take both."""
    fwd = _base_methods(wheel)["forward"]
    called = {n.func.attr: n for n in ast.walk(fwd) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Attribute) and n.func.attr.startswith("forward_")}
    assert {"forward_decode", "forward_extend"} <= set(called)
    assert "forward" not in vars(AiterAttnSGLangBackend)
    calls = [(W.BASE, n.lineno, name, len(n.args), [k.arg for k in n.keywords if k.arg])
             for name, n in called.items() if name != "forward_mixed"]
    assert check_calls(AiterAttnSGLangBackend, calls) == []


def test_registry_factory_and_choices(wheel):
    assert check_registry(wheel) == []


def test_plugin_entry_point_and_loader(wheel):
    assert check_plugin(wheel) == []


def test_fields_the_adapter_reads_exist(wheel):
    assert check_fields(wheel) == []


def test_every_forward_mode_is_mapped_or_refused(wheel):
    assert check_modes(wheel) == []
    fm = W.forward_mode_enum(wheel)
    for name in T.UNSUPPORTED_MODES:
        with pytest.raises(ValueError, match=name):
            T.map_mode(fm[name])
    assert T.map_mode(fm.MIXED).name == "EXTEND"
    assert T.map_mode(fm.DRAFT_EXTEND_V2).name == "DRAFT_EXTEND_V2"


def test_batch_dtypes_are_the_wheels(wheel):
    """The dtypes SGLang builds its batch with: ``ScheduleBatch.seq_lens`` int64,
    ``out_cache_loc`` int64, ``init_new``'s ``extend_seq_lens`` / ``extend_prefix_lens`` int32."""
    def dtypes_assigned(tree, attr):
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == attr for t in node.targets):
                for call in ast.walk(node.value):
                    for kw in getattr(call, "keywords", []):
                        if (kw.arg == "dtype" and isinstance(kw.value, ast.Attribute)
                                and getattr(kw.value.value, "id", None) == "torch"):
                            out.add(kw.value.attr)
        return out

    sched = wheel.tree(W.SCHEDULE_BATCH)
    info = wheel.tree(W.BATCH_INFO)
    assert dtypes_assigned(sched, "seq_lens") == {"int64"}
    assert dtypes_assigned(sched, "out_cache_loc") == {"int64"}
    assert dtypes_assigned(info, "extend_seq_lens") == {"int32"}
    assert dtypes_assigned(info, "extend_prefix_lens") == {"int32"}
    assert {k: str(v).split(".")[-1] for k, v in SGLANG_DTYPES.items()} == {
        "seq_lens": "int64", "extend_seq_lens": "int32", "extend_prefix_lens": "int32",
        "out_cache_loc": "int64"}


def test_the_wheels_loader_registers_the_plugin(wheel, monkeypatch):
    """SGLang's own ``load_plugins`` (executed from the wheel) loads our pyproject entry point;
    afterwards ``aiter_attn`` is a backend choice and ``ATTENTION_BACKENDS`` builds it."""
    value = _pyproject_entry_points()[plugin.ENTRY_POINT_GROUP][plugin.BACKEND_NAME]
    ep = EntryPoint(name=plugin.BACKEND_NAME, value=value, group=plugin.ENTRY_POINT_GROUP)
    mods = W.install_sglang(wheel, monkeypatch, entry_points=[ep])
    monkeypatch.setattr(plugin, "_backend_class", None)
    mods["sglang.srt.plugins"].load_plugins()
    reg = mods["sglang.srt.layers.attention.attention_registry"]
    assert reg.ATTENTION_BACKENDS[plugin.BACKEND_NAME] is plugin.create_backend
    assert plugin.BACKEND_NAME in mods["sglang.srt.arg_groups.choices"].ATTENTION_BACKEND_CHOICES
    base = mods["sglang.srt.layers.attention.base_attn_backend"].AttentionBackend
    assert issubclass(plugin._backend_class, base)
    assert plugin.register()  # idempotent: no second choice entry
    assert mods["sglang.srt.arg_groups.choices"].ATTENTION_BACKEND_CHOICES.count(
        plugin.BACKEND_NAME) == 1


def test_a_plugin_that_cannot_load_leaves_sglang_working(wheel, monkeypatch, caplog):
    """SGLang's registry without ``register_attention_backend`` (an API move): register()
    logs why and returns False; SGLang's loader goes on to the next plugin."""
    ran = []
    other = types.ModuleType("other_plugin")
    other.register = lambda: ran.append(True)
    monkeypatch.setitem(__import__("sys").modules, "other_plugin", other)
    eps = [EntryPoint(name=plugin.BACKEND_NAME, value="aiter_attn.integrations.sglang:register",
                      group=plugin.ENTRY_POINT_GROUP),
           EntryPoint(name="other", value="other_plugin:register", group=plugin.ENTRY_POINT_GROUP)]
    mods = W.install_sglang(wheel, monkeypatch, entry_points=eps)
    reg = mods["sglang.srt.layers.attention.attention_registry"]
    monkeypatch.delattr(reg, "register_attention_backend")
    monkeypatch.setattr(plugin, "_backend_class", None)
    with caplog.at_level(logging.WARNING, logger="aiter_attn.integrations.sglang"):
        mods["sglang.srt.plugins"].load_plugins()
        assert plugin.register() is False
    assert ran == [True]
    assert plugin.BACKEND_NAME not in reg.ATTENTION_BACKENDS
    msgs = [r.getMessage() for r in caplog.records if r.name == "aiter_attn.integrations.sglang"]
    assert msgs and "register_attention_backend" in msgs[0] and "keeps its own" in msgs[0]


def test_register_without_sglang_says_why(monkeypatch, caplog):
    import sys

    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang → ImportError
    with caplog.at_level(logging.WARNING, logger="aiter_attn.integrations.sglang"):
        assert plugin.register() is False
    assert any("ImportError" in r.getMessage() or "ModuleNotFoundError" in r.getMessage()
               for r in caplog.records)


# --------------------------------------------------------------------------------------------
# mutation self-tests: a deliberately wrong adapter (or plugin) must fail the checks


def _mutant(**methods):
    return type("Mutant", (AiterAttnSGLangBackend,), methods)


MUTANTS = {
    "out_graph-without-in_capture": _mutant(
        init_forward_metadata_out_graph=lambda self, forward_batch: None),
    "forward_decode-without-save_kv_cache": _mutant(
        forward_decode=lambda self, q, k, v, layer, forward_batch: None),
    "forward_extend-without-kwargs": _mutant(
        forward_extend=lambda self, q, k, v, layer, forward_batch, save_kv_cache=True: None),
    "cuda_graph_state-extra-argument": _mutant(
        init_cuda_graph_state=lambda self, max_bs, max_num_tokens, kv_indices_buf: None),
    "in_graph-renamed-argument": _mutant(
        init_forward_metadata_in_graph=lambda self, batch, extra: None),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_self_test_a_wrong_override_fails(wheel, name):
    cls = MUTANTS[name]
    problems = check_overrides(cls, _base_methods(wheel), CONTRACT) + check_calls(
        cls, wheel_calls(wheel, CONTRACT))
    assert problems, f"mutant {name} passed the contract check"


def test_self_test_a_replay_needing_an_extra_keyword_fails(wheel):
    """SGLang passes no out_cache_loc on replay: a replay hook that needs one must fail."""
    cls = _mutant(init_forward_metadata_replay_cuda_graph=(
        lambda self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode,
        spec_info, seq_lens_cpu=None, *, out_cache_loc: None))
    assert check_legacy(cls)
    assert check_calls(cls, wheel_calls(wheel, LEGACY))


def test_self_test_wrong_fields_modes_and_plugin_fail(wheel):
    assert check_fields(wheel, batch_fields=T.BATCH_FIELDS + ("seq_lens_gpu",))
    assert check_fields(wheel, layer_fields=T.LAYER_FIELDS + ("num_heads",))
    assert check_fields(wheel, runner_fields=T.RUNNER_FIELDS + ("kv_pool",))
    assert check_modes(wheel, mode_map={k: v for k, v in T.MODE_MAP.items()
                                        if k != "DRAFT_EXTEND_V2"})
    assert check_plugin(wheel, entry_points={"sglang.plugins": {
        "aiter_attn": "aiter_attn.integrations.sglang:register"}})
    assert check_plugin(wheel, entry_points={"sglang.srt.plugins": {
        "aiter_attn": "aiter_attn.integrations.sglang:create_backend"}})
