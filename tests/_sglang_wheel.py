"""The real ``sglang`` wheel's source, read without importing SGLang (it cannot be imported on
a CPU host beside our torch pin).

``scripts/test.sh`` downloads the wheel (``pip download --no-deps sglang==0.5.23 -d .whl``);
``$AITER_ATTN_SGLANG_WHEEL`` may point at another wheel or an unpacked source tree. Missing,
the tests that use it FAIL (never skip).

What this module rebuilds from that source, for the contract and adapter tests:

* ``ForwardMode`` (the wheel's ``IntEnum`` with its methods) and SGLang's ``AttentionBackend``
  base class (its whole module executed, with stand-ins only for its four imports);
* ``ForwardBatch`` / ``EagleVerifyInput`` / ``EagleDraftInput`` as dataclasses with exactly the
  wheel's field names (an unknown name is a TypeError);
* SGLang's attention registry (``register_attention_backend``), the backend-choice list
  (``arg_groups/choices.py``, executed whole) and the plugin loader (``plugins/__init__.py``,
  executed whole) as modules of a stand-in ``sglang`` package.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
SGLANG_VERSION = "0.5.23"

BASE = "sglang/srt/layers/attention/base_attn_backend.py"
REGISTRY = "sglang/srt/layers/attention/attention_registry.py"
BACKEND_SETUP = "sglang/srt/model_executor/model_runner_components/attention_backend_setup.py"
CHOICES = "sglang/srt/arg_groups/choices.py"
PLUGINS = "sglang/srt/plugins/__init__.py"
BATCH_INFO = "sglang/srt/model_executor/forward_batch_info.py"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
RADIX = "sglang/srt/layers/radix_attention.py"
MEMORY_POOL = "sglang/srt/mem_cache/memory_pool.py"
MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
EAGLE_INFO = "sglang/srt/speculative/eagle_info.py"
SPEC_FIELDS = "sglang/srt/arg_groups/fields/spec.py"
RUNTIME_CONTEXT = "sglang/srt/runtime_context.py"


class SourceTree:
    """Python files of one SGLang release: a wheel (zip) or a directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.label = self.path.name
        self._zip = zipfile.ZipFile(self.path) if self.path.is_file() else None
        self._cache: dict = {}

    def read(self, relpath: str) -> str:
        if relpath not in self._cache:
            if self._zip is not None:
                try:
                    text = self._zip.read(relpath).decode()
                except KeyError:
                    text = None
            else:
                f = self.path / relpath
                text = f.read_text() if f.is_file() else None
            if text is None:
                raise FileNotFoundError(f"{relpath} is not in sglang {self.label}")
            self._cache[relpath] = text
        return self._cache[relpath]

    def tree(self, relpath: str) -> ast.Module:
        return ast.parse(self.read(relpath))

    def files(self, prefix: str = "sglang/"):
        if self._zip is not None:
            return [n for n in self._zip.namelist() if n.startswith(prefix) and n.endswith(".py")]
        return [str(p.relative_to(self.path)) for p in (self.path / prefix).rglob("*.py")]


def wheel_path() -> Optional[Path]:
    env = os.environ.get("AITER_ATTN_SGLANG_WHEEL")
    if env:
        return Path(env)
    wheels = sorted((REPO / ".whl").glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    return wheels[-1] if wheels else None


def load_wheel() -> SourceTree:
    path = wheel_path()
    if path is None or not path.exists():
        pytest.fail(
            f"the sglang {SGLANG_VERSION} wheel is required for the SGLang contract tests (they "
            f"must not skip): run `pip download --no-deps sglang=={SGLANG_VERSION} -d .whl` in "
            "the repository root (scripts/test.sh does) or point AITER_ATTN_SGLANG_WHEEL at a "
            "wheel or unpacked source tree.", pytrace=False)
    return SourceTree(path)


# --------------------------------------------------------------------------------------------
# reading definitions


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"class {name} not found")


def find_def(tree: ast.AST, name: str):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def methods(cls: ast.ClassDef) -> dict:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def annotated_fields(cls: ast.ClassDef) -> list:
    return [n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def self_attributes(fn: ast.AST) -> set:
    """Names ``x`` of every ``self.x = …`` / ``self.x: T = …`` inside ``fn``."""
    out = set()
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if (isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name)
                        and el.value.id == "self"):
                    out.add(el.attr)
    return out


_DEFAULT = object()


def signature_from_ast(fn: ast.FunctionDef) -> inspect.Signature:
    """Parameter names, kinds and which have defaults, as ``inspect.Signature``."""
    P = inspect.Parameter
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    params = [P(arg.arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                default=_DEFAULT if i >= first_default else P.empty)
              for i, arg in enumerate(positional)]
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else _DEFAULT))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _exec_nodes(nodes, namespace: dict, label: str) -> dict:
    mod = ast.fix_missing_locations(ast.Module(body=list(nodes), type_ignores=[]))
    exec(compile(mod, label, "exec"), namespace)
    return namespace


def forward_mode_enum(src: SourceTree):
    """The wheel's ``ForwardMode`` (IntEnum with its methods), executed from its source."""
    import enum

    cls = find_class(src.tree(BATCH_INFO), "ForwardMode")
    ns = _exec_nodes([cls], {"IntEnum": enum.IntEnum, "auto": enum.auto}, "ForwardMode")
    return ns["ForwardMode"]


def attention_type_enum(src: SourceTree):
    import enum

    cls = find_class(src.tree(RADIX), "AttentionType")
    return _exec_nodes([cls], {"Enum": enum.Enum}, "AttentionType")["AttentionType"]


def dataclass_from(src: SourceTree, relpath: str, name: str):
    """A dataclass named ``name`` with exactly the wheel's annotated fields, all defaulting to
    ``None`` (so tests set what SGLang sets and nothing it does not have)."""
    fields = annotated_fields(find_class(src.tree(relpath), name))
    return dataclasses.make_dataclass(
        name, [(f, Any, dataclasses.field(default=None)) for f in fields])


def batch_padding(src: SourceTree):
    """The wheel's DP-attention padding of a batch, ``ForwardBatch._pad_inputs_to_size`` (with
    its ``_pad_tensor_to_size``), executed from its source on the GPU branch (``_is_cpu`` is
    False): ``pad(fb, model_runner, num_tokens, bs)`` pads ``fb`` in place as
    ``prepare_mlp_sync_batch`` does once it has chosen the padded sizes."""
    body = methods(find_class(src.tree(BATCH_INFO), "ForwardBatch"))
    ns = _exec_nodes([body["_pad_tensor_to_size"], body["_pad_inputs_to_size"]],
                     {"torch": __import__("torch"), "_is_cpu": False}, "ForwardBatch padding")

    def pad(fb, model_runner, num_tokens: int, bs: int):
        fb._pad_tensor_to_size = types.MethodType(ns["_pad_tensor_to_size"], fb)
        ns["_pad_inputs_to_size"](fb, model_runner, num_tokens, bs)

    return pad


# --------------------------------------------------------------------------------------------
# a stand-in ``sglang`` package made of the wheel's modules


class _Env:
    def __init__(self, value=None):
        self.value = value

    def get(self):
        return self.value


def _module(name: str, modules: dict) -> types.ModuleType:
    if name not in modules:
        mod = types.ModuleType(name)
        mod.__path__ = []
        modules[name] = mod
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(_module(parent, modules), leaf, mod)
    return modules[name]


def install_sglang(src: SourceTree, monkeypatch, *, entry_points=(), spec=None) -> dict:
    """Put a stand-in ``sglang`` into ``sys.modules``: the wheel's base class, registry
    function, choices module and plugin loader (real source), plus stand-ins for what those
    import. ``entry_points``: what ``importlib.metadata.entry_points(group=…)`` returns to
    the plugin loader. Returns the modules by name."""
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    modules: dict = {}
    m = lambda name: _module(name, modules)  # noqa: E731
    envs = types.SimpleNamespace(SGLANG_PLUGINS=_Env(), SGLANG_PLATFORM=_Env(),
                                 SGLANG_FORCE_COARSE_WAR_BARRIER=_Env(False),
                                 SGLANG_ENABLE_PREFILL_WAR_READ_DONE=_Env(False))
    m("sglang.srt.environ").envs = envs
    m("sglang.kernels.kernel_api_logging").debug_kernel_api = lambda fn: fn
    m("sglang.srt.utils.common").is_npu = lambda: False
    fm = forward_mode_enum(src)
    m("sglang.srt.model_executor.forward_batch_info").ForwardMode = fm
    spec = spec or types.SimpleNamespace(speculative_algorithm=None, speculative_num_steps=None,
                                         speculative_eagle_topk=None,
                                         speculative_num_draft_tokens=None)
    m("sglang.srt.runtime_context").get_spec = lambda: spec
    hooks = m("sglang.srt.plugins.hook_registry")
    hooks.HookRegistry = types.SimpleNamespace(apply_hooks=lambda: None)
    hooks.HookSource = lambda **kw: types.SimpleNamespace(**kw)
    import contextvars

    hooks._current_plugin_source = contextvars.ContextVar("src", default=None)
    for name in list(modules):
        monkeypatch.setitem(sys.modules, name, modules[name])

    def run_module(name: str, relpath: str, extra: Optional[dict] = None):
        mod = m(name)
        monkeypatch.setitem(sys.modules, name, mod)
        ns = mod.__dict__
        ns.update({"__name__": name, "__file__": relpath})
        exec(compile(src.read(relpath), relpath, "exec"), ns)
        for k, v in (extra or {}).items():
            ns[k] = v
        return mod

    run_module("sglang.srt.layers.attention.base_attn_backend", BASE)
    run_module("sglang.srt.arg_groups.choices", CHOICES)
    plugins = run_module("sglang.srt.plugins", PLUGINS)
    eps = list(entry_points)
    plugins.entry_points = lambda group=None: [e for e in eps if e.group == group]
    # the registry module's own imports are heavy; its registering function and dict are
    # executed from the wheel's source alone
    reg_tree = src.tree(REGISTRY)
    keep = [n for n in reg_tree.body if (
        isinstance(n, ast.FunctionDef) and n.name == "register_attention_backend") or (
        isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "ATTENTION_BACKENDS"
                                          for t in n.targets))]
    reg = m("sglang.srt.layers.attention.attention_registry")
    monkeypatch.setitem(sys.modules, reg.__name__, reg)
    _exec_nodes(keep, reg.__dict__, REGISTRY)
    for name in list(modules):
        monkeypatch.setitem(sys.modules, name, modules[name])
    return modules
