"""The aiter plugin's contract with the real ``amd-aiter`` package, checked on the CPU.

The README's test command downloads the ``amd-aiter`` wheel (pure Python, ~40 MB) without
installing or importing it (``scripts/fetch_test_deps.sh``: ``pip download --no-deps -d
.whl``). This test reads the source of every aiter function the plugin calls straight out of
the wheel with ``ast``, builds an ``inspect.Signature`` from each definition, installs a fake
``aiter`` package whose functions carry those signatures and record their calls, runs the
plugin's kernels on CPU tensors, and binds every recorded call to the real signature. A renamed
or missing parameter fails (see the mutation self-tests at the end). Without the wheel the test
fails; it never skips.

The wheel is found through ``$AITER_ATTN_AITER_WHEEL`` (a ``.whl`` file or an unpacked source
tree) or ``<repo>/.whl/amd_aiter-*.whl``. ``$AITER_ATTN_AITER_EXTRA_SRC`` (``os.pathsep``
separated source trees, e.g. a checkout of ROCm/aiter) adds more releases to bind against.
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import re
import sys
import types
import zipfile
from pathlib import Path
from typing import Optional

import pytest
import torch

import aiter_attn.kernels.aiter as A
from aiter_attn.kernels import aiter_marshal as M
from aiter_attn.kernels.reference import mla_paged_attention_reference

REPO = Path(__file__).resolve().parents[1]
_DEFAULT = object()  # stands for any default value in an ast-derived signature

#: pa_decode_gluon is absent from the amd-aiter 0.1.7 wheel (PyPI's only release); its
#: parameters as of ROCm/aiter e4048607 (aiter/ops/triton/gluon/pa_decode_gluon.py), so the
#: 5-D call is still bound against a real signature. ``=`` marks a default.
PA_DECODE_GLUON_SNAPSHOT = (
    "output query key_cache value_cache context_lengths block_tables softmax_scale "
    "query_length max_context_partition_num context_partition_size= compute_type= "
    "query_scale= key_scale= value_scale= exp_sums= max_logits= temporary_output= "
    "alibi_slopes= sinks= sliding_window= ps="
)


# --------------------------------------------------------------------------------------------
# reading signatures from source


class SourceTree:
    """Python files of one aiter release: a wheel (zip) or a directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.label = self.path.name
        self._zip = zipfile.ZipFile(self.path) if self.path.is_file() else None

    def read(self, relpath: str):
        if self._zip is not None:
            try:
                return self._zip.read(relpath).decode()
            except KeyError:
                return None
        f = self.path / relpath
        return f.read_text() if f.is_file() else None

    def module_source(self, module: str):
        base = module.replace(".", "/")
        return self.read(base + ".py") or self.read(base + "/__init__.py")


def _find_def(tree: ast.Module, name: str):
    """A module-level ``def name`` (also inside top-level ``if``/``try`` blocks)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        if isinstance(node, (ast.If, ast.Try)):
            stack.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for h in getattr(node, "handlers", []):
                stack.extend(h.body)
    return None


def signature_from_ast(fn: ast.FunctionDef) -> inspect.Signature:
    """An ``inspect.Signature`` with the definition's parameter names, kinds and which have
    defaults (the default values themselves do not matter for binding)."""
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


def signature_from_snapshot(spec: str) -> inspect.Signature:
    P = inspect.Parameter
    return inspect.Signature([
        P(tok.rstrip("="), P.POSITIONAL_OR_KEYWORD,
          default=_DEFAULT if tok.endswith("=") else P.empty) for tok in spec.split()])


PYBIND_HEADERS = ("aiter_meta/csrc/include/rocm_ops.hpp", "csrc/include/rocm_ops.hpp")


def pybind_signature(header: str, name: str):
    """The signature pybind gives ``name``: the ``py::arg`` list of its ``m.def`` (``= x``
    marks a default), or ``None`` if the header does not bind it with named arguments."""
    m = re.search(r'm\.def\(\s*"%s"\s*,(.*?)\);' % re.escape(name), header, re.S)
    if m is None:
        return None
    args = re.findall(r'py::arg\("(\w+)"\)\s*(=)?', m.group(1))
    if not args:
        return None
    P = inspect.Parameter
    return inspect.Signature([P(a, P.POSITIONAL_OR_KEYWORD,
                                default=_DEFAULT if eq else P.empty) for a, eq in args])


def _is_compile_ops(node: ast.FunctionDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if getattr(target, "id", getattr(target, "attr", None)) == "compile_ops":
            return True
    return False


def read_signatures(tree: SourceTree) -> dict:
    """``{function: (module, Signature, FunctionDef)}`` for the plugin's aiter functions that
    this release defines (first module of ``AITER_FUNCTIONS`` that has it).

    A ``@compile_ops`` function is only a Python shell: aiter checks the call against, and
    passes it to, the pybind function, so its signature comes from the ``py::arg`` list in
    ``rocm_ops.hpp`` (the shell's own parameter list may differ, as in 0.1.7)."""
    found = {}
    header = next((h for h in map(tree.read, PYBIND_HEADERS) if h), None)
    for name, modules in A.AITER_FUNCTIONS.items():
        for module in modules:
            src = tree.module_source(module)
            node = _find_def(ast.parse(src), name) if src else None
            if node is None:
                continue
            sig = signature_from_ast(node)
            if _is_compile_ops(node):
                sig = pybind_signature(header or "", name)
                assert sig is not None, (
                    f"{name} in aiter {tree.label} is a @compile_ops shell but its pybind "
                    f"binding (py::arg names) was not found in {PYBIND_HEADERS}")
            found[name] = (module, sig, node)
            break
    return found


def _wheel_path():
    env = os.environ.get("AITER_ATTN_AITER_WHEEL")
    if env:
        return Path(env)
    wheels = sorted((REPO / ".whl").glob("amd_aiter-*.whl"))
    return wheels[-1] if wheels else None


@pytest.fixture(scope="module")
def wheel() -> SourceTree:
    path = _wheel_path()
    if path is None or not path.exists():
        pytest.fail(
            "the amd-aiter wheel is required for the aiter contract test (it must not skip): "
            "run `./scripts/fetch_test_deps.sh` in the repository root (./scripts/test.sh "
            "does) or point AITER_ATTN_AITER_WHEEL at a wheel or unpacked source tree.",
            pytrace=False)
    return SourceTree(path)


def _trees(wheel):
    extra = [p for p in os.environ.get("AITER_ATTN_AITER_EXTRA_SRC", "").split(os.pathsep) if p]
    return [wheel] + [SourceTree(Path(p)) for p in extra]


# --------------------------------------------------------------------------------------------
# the fake aiter package


class Recorder:
    """Stands in for one aiter function: binds every call to the real signature (TypeError on
    mismatch, naming the release) and records the bound arguments."""

    def __init__(self, name, signature, label, calls, result=None):
        self.name, self.__signature__, self.label = name, signature, label
        self.calls, self.result = calls, result

    def __call__(self, *args, **kwargs):
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name} of aiter {self.label}: {exc}") from None
        self.calls.append((self.name, bound.arguments))
        return self.result(bound.arguments) if self.result else None


def _info_result(args):
    """What get_mla_metadata_info_v1 returns, from our own sizing formula (cu_num 80)."""
    specs = M.mla_work_buffer_spec(args["batch_size"], args["max_seqlen_qo"], args["num_head_qo"],
                                   args["kv_dtype"], cu_num=80, fast_mode=args["fast_mode"])
    return tuple((s.shape, s.dtype) for s in specs)


def _mla_decode_result(args):
    """Fill each padded output head with its own query (so the unpadding can be checked)."""
    o, q = args["o"], args["q"]
    o.copy_(q[..., : o.shape[-1]])


RESULTS = {"get_mla_metadata_info_v1": _info_result, "mla_decode_fwd": _mla_decode_result}


def fake_module(monkeypatch, path: str) -> types.ModuleType:
    """The fake package ``path`` in ``sys.modules`` (created with its parents, undone by
    ``monkeypatch``); missing submodules of a fake package raise ``ModuleNotFoundError``."""
    mod = sys.modules.get(path)
    if mod is None:
        mod = types.ModuleType(path)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, path, mod)
        parent, _, leaf = path.rpartition(".")
        if parent:
            setattr(fake_module(monkeypatch, parent), leaf, mod)
    return mod


#: where aiter keeps the device architecture its kernels and ``aiter.utility.dtypes.fp8``
#: follow (``get_gfx``; tests/test_aiter_fp8_format.py binds the name to the wheel)
CHIP_INFO = "aiter.jit.utils.chip_info"


def stub_gfx(monkeypatch, gfx: str) -> list:
    """Give the (fake) ``aiter`` package a ``get_gfx()`` answering ``gfx``: the device
    architecture, stubbed as aiter is. Returns the list of its calls."""
    calls: list = []

    def get_gfx():
        calls.append(gfx)
        return gfx

    fake_module(monkeypatch, "aiter")
    monkeypatch.setattr(fake_module(monkeypatch, CHIP_INFO), "get_gfx", get_gfx, raising=False)
    return calls


def install_fake_aiter(monkeypatch, signatures: dict, label: str, *,
                       gfx: Optional[str] = "gfx942") -> list:
    """Put a fake ``aiter`` package with ``signatures`` into ``sys.modules`` (on a ``gfx``
    device: MI300's gfx942 unless told; ``None``: aiter cannot tell); returns the list every
    call is recorded into."""
    calls: list = []
    for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
        monkeypatch.delitem(sys.modules, name)
    for fn, (mod_path, sig, _) in signatures.items():
        setattr(fake_module(monkeypatch, mod_path), fn,
                Recorder(fn, sig, label, calls, RESULTS.get(fn)))
    fake_module(monkeypatch, "aiter")
    if gfx is not None:
        stub_gfx(monkeypatch, gfx)
    return calls


# --------------------------------------------------------------------------------------------
# the plugin's calls, on CPU tensors


def _paged(dtype=torch.bfloat16, kv_dtype=None, q_lens=(1, 1), kv_lens=(20, 33), ps=16,
           hq=8, hkv=2, d=64):
    g = torch.Generator().manual_seed(0)
    kv_dtype = kv_dtype or dtype
    pages = 12
    k = torch.randn(pages, ps, hkv, d, generator=g).to(kv_dtype)
    v = torch.randn(pages, ps, hkv, d, generator=g).to(kv_dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    bt = torch.tensor([[3, 7, 0], [5, 1, 9]], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, seqused_k=torch.tensor(kv_lens, dtype=torch.int32),
              block_table=bt, softmax_scale=0.125, max_seqlen_q=max(q_lens))
    if kv_dtype != dtype:
        kw.update(k_scale=torch.tensor(0.5), v_scale=torch.tensor(2.0))
    return q, k, v, out, kw


def _mla(heads, kv_dtype=torch.bfloat16, q_len=1, ps=1):
    g = torch.Generator().manual_seed(1)
    bs, kv_lens = 2, (9, 30)
    kv = torch.randn(64 // ps + 2, ps, 1, 576, generator=g).to(kv_dtype)
    q = torch.randn(bs * q_len, heads, 576, generator=g).to(torch.bfloat16)
    out = torch.zeros(bs * q_len, heads, 512, dtype=torch.bfloat16)
    width = -(-max(kv_lens) // ps)
    bt = (torch.randperm(bs * width, generator=g) + 1).view(bs, width).to(torch.int32)
    kw = dict(kv_lora_rank=512, cu_seqlens_q=torch.arange(0, bs * q_len + 1, q_len,
                                                          dtype=torch.int32),
              seqused_k=torch.tensor(kv_lens, dtype=torch.int32), block_table=bt,
              softmax_scale=0.07, max_seqlen_q=q_len)
    if kv_dtype != torch.bfloat16:
        kw["kv_scale"] = torch.tensor(0.5)
    return q, kv, out, kw


def run_every_plugin_path(vec5d: bool = True) -> None:
    """Drive each aiter kernel of the plugin through every route it has."""
    fp8 = torch.float8_e4m3fnuz
    q, k, v, out, kw = _paged()
    A.aiter_paged_attention(q, k, v, out, **kw)  # decode → paged_attention_ragged
    q, k, v, out, kw = _paged(kv_dtype=fp8)
    A.aiter_paged_attention(q, k, v, out, softcap=30.0, **kw)  # fp8 decode
    q, k, v, out, kw = _paged(q_lens=(7, 12), kv_lens=(20, 33))
    A.aiter_paged_attention(q, k, v, out, **kw)  # extend → mha_batch_prefill_func
    A.aiter_paged_attention(q, k, v, out, causal=False, **kw)
    q, k, v, out, kw = _paged(q_lens=(7, 12), kv_lens=(20, 33), kv_dtype=fp8)
    A.aiter_paged_attention(q, k, v, out, **kw)  # fp8 extend (descale or unified)
    q, k, v, out, kw = _paged(q_lens=(1, 3))
    A.aiter_paged_attention(q, k, v, out, window_size=(15, 0), **kw)  # SWA → unified
    A.aiter_paged_attention(q, k, v, out, sinks=torch.zeros(8), **kw)  # sinks → unified
    for heads, kv_dtype, q_len in ((16, torch.bfloat16, 1), (4, fp8, 1), (32, torch.bfloat16, 1),
                                   (8, torch.bfloat16, 2), (16, fp8, 2),
                                   (128, torch.bfloat16, 2)):
        q, kv, out, kw = _mla(heads, kv_dtype, q_len)
        A.aiter_mla_paged_attention(q, kv, out, **kw)
        # the fake kernel copies q into o: unpadded outputs must be each head's own query
        torch.testing.assert_close(out, q[..., :512], rtol=0, atol=0)
    # 128 heads on an fp8 cache with bf16 queries: asm_mla.cu has no kernel for it (its
    # 128-head fp8 kernels take fp8 queries): the next registered kernel runs the step
    q, kv, out, kw = _mla(128, fp8, 2)
    A.aiter_mla_paged_attention(q, kv, out, **kw)
    want = mla_paged_attention_reference(q, kv, torch.empty_like(out), **kw)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    q, kv, out, kw = _mla(16, q_len=9, ps=64)
    A.aiter_mla_paged_attention(q, kv, out, **kw)  # extend → mla_prefill_fwd
    qd = torch.randn(10, 4, 192).bfloat16()
    kd, vd = torch.randn(10, 4, 192).bfloat16(), torch.randn(10, 4, 128).bfloat16()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    A.aiter_varlen_attention(qd, kd, vd, torch.empty(10, 4, 128).bfloat16(), cu_seqlens_q=cu,
                             cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6,
                             softmax_scale=0.1)
    if vec5d:
        x = M.vec5d_x(torch.bfloat16)
        k5 = torch.zeros(6, 2, 64 // x, 16, x, dtype=torch.bfloat16)
        v5 = torch.zeros(6, 2, 16 // x, 64, x, dtype=torch.bfloat16)
        q5 = torch.randn(4, 8, 64).bfloat16()
        A.aiter_paged_attention_5d(
            q5, k5, v5, torch.empty_like(q5), cu_seqlens_q=torch.tensor([0, 2, 4],
                                                                        dtype=torch.int32),
            seqused_k=torch.tensor([5, 30], dtype=torch.int32),
            block_table=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), softmax_scale=0.125,
            sinks=torch.zeros(8), max_seqlen_q=2)


# --------------------------------------------------------------------------------------------
# tests


def test_wheel_defines_every_required_function(wheel):
    sigs = read_signatures(wheel)
    missing = set(A.AITER_FUNCTIONS) - set(sigs)
    assert missing <= A.OPTIONAL_FUNCTIONS, (
        f"amd-aiter ({wheel.label}) lacks {sorted(missing - A.OPTIONAL_FUNCTIONS)}")
    for name, (_, sig, _) in sigs.items():
        kinds = {p.kind for p in sig.parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, (
            f"{name} takes **kwargs: binding could not catch a renamed parameter")


def test_compile_ops_functions_bind_to_their_pybind_signature(wheel):
    """0.1.7's get_mla_metadata_v1 stub says (…, work_indptr, work_info, …) but the pybind
    function it forwards to takes (…, work_info_set, work_indptr, …): the contract uses the
    latter, which is what runs."""
    _, sig, node = read_signatures(wheel)["get_mla_metadata_v1"]
    if _is_compile_ops(node):
        names = list(sig.parameters)
        assert "work_info_set" in names and "work_info" not in names
        assert names.index("work_info_set") < names.index("work_indptr")


def _signatures_with_snapshot(tree):
    sigs = read_signatures(tree)
    sigs.setdefault("pa_decode_gluon", ("aiter.ops.triton.gluon.pa_decode_gluon",
                                        signature_from_snapshot(PA_DECODE_GLUON_SNAPSHOT), None))
    return sigs


def test_every_call_binds_to_the_real_signature(wheel, monkeypatch):
    for tree in _trees(wheel):
        _check_calls_bind(tree, monkeypatch)


def _check_calls_bind(tree, monkeypatch):
    sigs = _signatures_with_snapshot(tree)
    calls = install_fake_aiter(monkeypatch, sigs, tree.label)
    run_every_plugin_path()
    called = {name for name, _ in calls}
    assert called == set(A.AITER_FUNCTIONS), f"never called: {set(A.AITER_FUNCTIONS) - called}"
    by = {}
    for name, args in calls:
        by.setdefault(name, []).append(args)
    # a few semantic checks on what was bound
    for args in by["paged_attention_ragged"]:
        assert args["kv_cache_dtype"] in ("auto", "fp8_e4m3")
        assert args["kv_cache_layout"] == "NHD" and args["block_size"] == 1
        assert args["key_cache"].shape[1] == 1 and args["kv_page_indices"].dtype == torch.int32
    assert {a["kv_cache_dtype"] for a in by["paged_attention_ragged"]} == {"auto", "fp8_e4m3"}
    for args in by["unified_attention"]:
        assert args["max_seqlen_k"] == args["block_table"].shape[1] * args["k"].shape[1]
        assert args["causal"] is True
    assert (15, 0) in {tuple(a["window_size"]) for a in by["unified_attention"]}
    assert all(a["q"].shape[1] % 16 == 0 for a in by["mla_decode_fwd"])
    # what asm_mla.cu has kernels for (tests/test_aiter_mla_routing.py binds these facts)
    for a in by["mla_decode_fwd"]:
        if a["kv_buffer"].element_size() == 1 and a["q"].element_size() == 2:
            assert a["q"].shape[1] != 128, "bf16 queries, fp8 cache, 128 heads: no kernel"
    assert all(a["kv_buffer"].dtype == torch.bfloat16 for a in by["mla_prefill_fwd"])
    persistent = [a for a in by["mla_decode_fwd"] if a.get("work_meta_data") is not None]
    assert persistent and all(a["num_kv_splits"] for a in persistent)
    (gluon,) = by["pa_decode_gluon"]
    assert gluon["query_length"] == 2 and gluon["key_cache"].dim() == 5
    assert gluon["max_context_partition_num"] == 1 and gluon["sliding_window"] == 0


def test_fp8_extend_route_follows_the_release(wheel, monkeypatch):
    """0.1.7's mha_batch_prefill_func takes no k_descale: fp8 extend goes to
    unified_attention (which dequantises); releases that take it get the descales."""
    for tree in _trees(wheel):
        sigs = _signatures_with_snapshot(tree)
        calls = install_fake_aiter(monkeypatch, sigs, tree.label)
        q, k, v, out, kw = _paged(q_lens=(7, 12), kv_lens=(20, 33),
                                  kv_dtype=torch.float8_e4m3fnuz)
        A.aiter_paged_attention(q, k, v, out, **kw)
        takes = "k_descale" in sigs["mha_batch_prefill_func"][1].parameters
        (name, args), = calls
        if takes:
            assert name == "mha_batch_prefill_func" and args["k_descale"] is not None
        else:
            assert name == "unified_attention" and args["k_descale"] is not None


def test_registration_with_the_wheel(wheel, monkeypatch):
    """On ROCm with this wheel the plugin registers every kernel whose functions exist."""
    calls = install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    monkeypatch.setattr(A, "availability", lambda: (True, ""))
    got = {}
    A.aiter_attn_register_kernels(lambda op, name, fn, caps, priority=0: got.setdefault(op, fn))
    sigs = read_signatures(wheel)
    expect = {op for op, (_, needs) in A._KERNELS.items() if set(needs) <= set(sigs)}
    assert set(got) == expect and "paged_attention" in expect and "mla_paged_attention" in expect
    assert not calls  # registering calls no kernel


def test_mla_work_sizes_match_the_wheel_formula(wheel):
    """Our CPU sizing of the persistent-MLA work metadata equals what the wheel's own
    get_mla_metadata_info_v1 computes (its body run with a stand-in for the GPU query)."""
    _, _, node = read_signatures(wheel)["get_mla_metadata_info_v1"]
    fn_src = ast.Module(body=[node], type_ignores=[])
    node.decorator_list = []
    for cu_num in (80, 304):
        cuda = types.SimpleNamespace(
            current_device=lambda: 0,
            get_device_properties=lambda i, cu=cu_num: types.SimpleNamespace(
                multi_processor_count=cu))
        fake_torch = types.SimpleNamespace(cuda=cuda, uint64=torch.uint64, int32=torch.int32,
                                           dtype=torch.dtype, Tensor=torch.Tensor)
        ns = {"torch": fake_torch, "math": math,
              "dtypes": types.SimpleNamespace(fp8=torch.float8_e4m3fnuz)}
        exec(compile(ast.fix_missing_locations(fn_src), "get_mla_metadata_info_v1", "exec"), ns)
        for bs, qlen, heads, kv, fast in ((1, 1, 16, torch.bfloat16, False),
                                          (37, 1, 128, torch.float8_e4m3fnuz, True),
                                          (256, 2, 32, torch.bfloat16, False),
                                          (8, 4, 64, torch.float8_e4m3fnuz, True)):
            theirs = ns["get_mla_metadata_info_v1"](bs, qlen, heads, torch.bfloat16, kv, False,
                                                    fast_mode=fast)
            ours = M.mla_work_buffer_spec(bs, qlen, heads, kv, cu_num=cu_num, fast_mode=fast)
            norm = [((s,) if isinstance(s, int) else tuple(s), d) for s, d in theirs]
            assert [(s.shape, s.dtype) for s in ours] == norm, (bs, qlen, heads, kv, fast)


def test_mla_plans_into_graph_manager_buffers(wheel, monkeypatch):
    """The bound MLA kernel's buffer_spec (sized by aiter's info call, once) gives the graph
    manager's static buffers; every step's plan fills the work metadata in them with one
    get_mla_metadata_v1 call and the layer's run hands the same buffers to mla_decode_fwd;
    no sizing call happens per step."""
    from aiter_attn.graph.buffers import GraphLimits
    from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params, mla_request
    from aiter_attn.types import ForwardMode

    calls = install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    fp8 = torch.float8_e4m3fnuz
    q, kv, out, kw = _mla(4, fp8, 1)
    kernel = A.AiterMLA(mla_request(q, kv, 512))
    limits = GraphLimits(mode=ForwardMode.DECODE, max_bs=8, q_len=1, max_num_tokens=8,
                         max_seq_len=64)
    bufs = kernel.buffer_spec(limits).allocate("cpu")
    assert [n for n, _ in calls] == ["get_mla_metadata_info_v1"]
    params = mla_layer_params(scale=kw["softmax_scale"], device=q.device, kv_lora_rank=512,
                              num_q_heads=4, head_dim=576, kv_scale=kw["kv_scale"], fp8=True)
    for step in range(2):
        calls.clear()
        md = _adhoc_metadata(q, kv, kw["cu_seqlens_q"], kw["seqused_k"], kw["block_table"],
                             None, None, 1, 64, "mla_paged_attention")
        plan = kernel.plan(md, out=bufs)
        for _ in range(3):  # three layers
            kernel.run(q, (kv,), plan, params, out)
        names = [n for n, _ in calls]
        assert names == ["get_mla_metadata_v1"] + ["mla_decode_fwd"] * 3, names
        meta, dec = calls[0][1], calls[1][1]
        work = {n: b for n, b in bufs.items() if n.endswith(("work_info_set", "work_metadata",
                                                             "reduce_partial_map"))}
        assert meta["work_info_set"] is plan.work["work_info_set"]
        assert any(meta["work_info_set"] is b for b in work.values())
        assert any(meta["work_metadata_ptrs"] is b for b in work.values())
        assert dec["work_info_set"] is meta["work_info_set"]
        assert any(dec["reduce_partial_map"] is b for b in work.values())
        # padded heads through the plan's static buffers; outputs are each head's own query
        assert dec["q"].data_ptr() == plan.q_pad.data_ptr() and dec["q"].shape[1] == 16
        torch.testing.assert_close(out, q[..., :512], rtol=0, atol=0)


def _mutate(sig: inspect.Signature, param: str, new_name=None) -> inspect.Signature:
    params = [p.replace(name=new_name) if p.name == param and new_name else p
              for p in sig.parameters.values() if new_name or p.name != param]
    return sig.replace(parameters=params)


@pytest.mark.parametrize("fn,param,new_name", [
    pytest.param("mla_decode_fwd", "sm_scale", "softmax_scale", id="renamed-mla-sm_scale"),
    pytest.param("paged_attention_ragged", "kv_cache_layout", None, id="removed-ragged-layout"),
    pytest.param("unified_attention", "seqused_k", "seq_lens_k", id="renamed-unified-seqused_k"),
    pytest.param("get_mla_metadata_v1", "reduce_partial_map", None, id="removed-metadata-param"),
    pytest.param("mha_batch_prefill_func", "kv_page_indices", "kv_indices",
                 id="renamed-prefill-indices"),
])
def test_self_test_a_changed_signature_fails(wheel, monkeypatch, fn, param, new_name):
    """The contract test is only worth something if it catches drift: mutate one real
    signature and the plugin's calls must no longer bind."""
    sigs = _signatures_with_snapshot(wheel)
    module, sig, node = sigs[fn]
    assert param in sig.parameters
    sigs[fn] = (module, _mutate(sig, param, new_name), node)
    install_fake_aiter(monkeypatch, sigs, wheel.label + "-mutated")
    with pytest.raises(TypeError, match=fn):
        run_every_plugin_path()


def test_head_padding_never_changes_results():
    """Reference MLA on heads padded 4→16 / 8→16 and unpadded equals the unpadded run."""
    g = torch.Generator().manual_seed(3)
    for heads in (4, 8):
        padded, repeat = M.mla_head_padding(heads)
        kv = torch.randn(6, 16, 1, 72, generator=g)
        q = torch.randn(3, heads, 72, generator=g)
        kw = dict(kv_lora_rank=64, cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                  seqused_k=torch.tensor([5, 16, 30], dtype=torch.int32),
                  block_table=torch.tensor([[2, 0], [4, 0], [1, 5]], dtype=torch.int32),
                  softmax_scale=0.1)
        plain = mla_paged_attention_reference(q, kv, torch.empty(3, heads, 64), **kw)
        wide = mla_paged_attention_reference(M.pad_heads(q, repeat), kv,
                                             torch.empty(3, padded, 64), **kw)
        torch.testing.assert_close(M.unpad_heads(wide, repeat), plain, rtol=0, atol=0)
