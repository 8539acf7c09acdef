"""The user docs run as printed and name only what exists (README.md and docs/*.md except
docs/benchmarks.md, a measurement log).

``tests/test_docs_plugin.py`` already runs docs/plugins.md's minimal plugin,
``tests/test_docs_features.py`` the README's feature table, ``tests/test_info.py`` the
generated tables of docs/modes.md and ``tests/test_test_command.py`` the README's set-up
command. This file covers the rest:

* the Python snippets: the README's op call, docs/graphs.md's ``CudaGraphManager`` use,
  docs/integrations.md's transformers registration (on a small random Llama saved to a
  temporary folder), docs/plugins.md's function convention (against the references'
  signatures), its ``register`` example, its pytest conformance example and the
  ``aiter-attn verify --backend example`` report it prints;
* every repository path, ``aiter_attn.*`` dotted name, ``ops.*`` function, ``AITER_ATTN_*``
  variable and ``tests/`` function the pages name;
* every flag of every ``aiter-attn`` command line and benchmark/script command line.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pathlib
import re
import sys
import types

import pytest
import torch

from aiter_attn import plugins

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md")
                                     if p.name != "benchmarks.md")
DOC_IDS = [str(p.relative_to(ROOT)) for p in DOCS]


def _text(name: str) -> str:
    return (ROOT / name).read_text()


def _blocks(name: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _text(name), flags=re.S)


def _block(name: str, needle: str, lang: str = "python") -> str:
    found = [b for b in _blocks(name, lang) if needle in b]
    assert len(found) == 1, f"{name}: expected one ```{lang} block with {needle!r}, got {len(found)}"
    return found[0]


def _run(source: str, where: str, **names) -> dict:
    ns = {"__name__": f"docs_snippet_{re.sub(r'[^a-z0-9]+', '_', where.lower())}", **names}
    exec(compile(source, where, "exec"), ns)
    return ns


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# -- the Python snippets ------------------------------------------------------------------


def test_readme_op_call_runs():
    """README "Using the op": the call runs as printed and equals the float32 reference."""
    from aiter_attn.kernels.reference import paged_attention_reference

    ns = _run(_block("README.md", "ops.paged_attention("), "README.md:Using the op")
    out, q = ns["out"], ns["q"]
    assert out.shape == q.shape and torch.isfinite(out).all()
    want = paged_attention_reference(
        q, ns["k_cache"], ns["v_cache"], torch.empty_like(q), cu_seqlens_q=ns["cu"],
        seqused_k=ns["lens"], block_table=ns["pages"], softmax_scale=ns["d"] ** -0.5)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


class _OneLayerModel:
    """The smallest ``EngineModel.forward``: token ids → q/k/v by a fixed table, one
    attention layer through the backend (what docs/graphs.md's ``model`` stands for)."""

    def __init__(self, layer, vocab: int = 64):
        g = torch.Generator().manual_seed(11)
        self.layer = layer
        self.widths = [layer.num_q_heads * layer.head_dim,
                       layer.num_kv_heads * layer.head_dim,
                       layer.num_kv_heads * layer.head_dim]
        self.table = torch.randn(vocab, sum(self.widths), generator=g)

    def forward(self, input_ids, positions, batch, backend, logits_indices=None):
        q, k, v = self.table[input_ids].split(self.widths, dim=-1)
        return backend.forward(q, k, v, self.layer, batch)


def test_graphs_md_manager_use_runs():
    """docs/graphs.md "Use": capture at the printed sizes, replay a 3-request decode batch
    (padded to 4; real rows back), bit-equal to eager on the reference kernels."""
    from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
    from aiter_attn.testing import PagedScenario

    cfg = BackendConfig(page_size=16, max_batch_size=32, max_context_len=256,
                        dtype=torch.float32)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    sc = PagedScenario.make(cfg, [layer], [5, 20, 33], seed=2)
    backend = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    model = _OneLayerModel(layer)
    real_batch = sc.next_batch(ForwardMode.DECODE, [1, 1, 1])
    ids = torch.tensor([3, 17, 42])
    ns = _run(_block("docs/graphs.md", "CudaGraphManager("), "docs/graphs.md:Use",
              backend=backend, model=model, real_batch=real_batch, ids=ids)
    mgr, logits = ns["mgr"], ns["logits"]
    assert mgr.capture_sizes == [1, 2, 4, 8, 16, 32]
    assert mgr.last_entry.bs == 4 and logits.shape == (3, layer.num_q_heads * layer.head_dim)
    got = logits.clone()
    backend.init_forward_metadata(real_batch)
    want = model.forward(ids, real_batch.positions, real_batch, backend)
    assert torch.equal(got, want)


def test_integrations_md_transformers_snippet_runs(tmp_path):
    """docs/integrations.md "transformers": register, load with
    ``attn_implementation="aiter_attn"``, ``generate`` a left-padded batch, switch a loaded
    model; every attention call goes through ``aiter_attn.ops``."""
    pytest.importorskip("transformers")
    from aiter_attn import ops
    from aiter_attn.engine import build_random_model

    hf, _ = build_random_model("llama", seed=0)
    hf.save_pretrained(tmp_path)

    def tok(prompts, return_tensors="pt", padding=True):  # word i → id, left padding
        ids = [[3 + (7 * i + j) % 200 for j in range(len(p.split()))]
               for i, p in enumerate(prompts)]
        n = max(map(len, ids))
        return {"input_ids": torch.tensor([[0] * (n - len(x)) + x for x in ids]),
                "attention_mask": torch.tensor([[0] * (n - len(x)) + [1] * len(x)
                                                for x in ids])}

    calls = []
    real = ops.paged_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    source = _block("docs/integrations.md", 'attn_implementation="aiter_attn"')
    source = source.replace("max_new_tokens=64", "max_new_tokens=4")  # the same call, shorter
    source += "\n" + re.search(r"# or switch a loaded model: (.*)", source).group(1) + "\n"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "paged_attention", counting)
        ns = _run(source, "docs/integrations.md:transformers", path=str(tmp_path), tok=tok,
                  prompts=["a b c", "d e f g h"])
    model = ns["model"]
    assert model.config._attn_implementation == "aiter_attn"
    assert len(calls) >= 4 * model.config.num_hidden_layers


def _params(sig: inspect.Signature) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


#: keywords the references take that a kernel gets only when it declares the feature
_FEATURE_KWARGS = {"lse", "batch_invariant", "k_scale_cache", "v_scale_cache"}


def test_plugins_md_function_convention_is_the_references():
    """docs/plugins.md's plain-function convention for ``paged_attention`` (and the MLA
    signature in its text) are the references' signatures, feature-only keywords aside."""
    from aiter_attn.kernels.reference import (mla_paged_attention_reference,
                                              paged_attention_reference)

    ns = _run(_block("docs/plugins.md", "def my_paged_attention("), "docs/plugins.md:function")
    ref = [p for p in _params(inspect.signature(paged_attention_reference))
           if p[0] not in _FEATURE_KWARGS]
    assert _params(inspect.signature(ns["my_paged_attention"])) == ref

    text = " ".join(_text("docs/plugins.md").split())
    m = re.search(r"`mla_paged_attention_reference\((.*?)\)` for MLA", text)
    assert m, "docs/plugins.md no longer states the MLA reference's signature"
    doc_mla = _run(f"def f({m.group(1)}): pass", "docs/plugins.md:mla")["f"]
    ref = [p for p in _params(inspect.signature(mla_paged_attention_reference))
           if p[0] not in _FEATURE_KWARGS]
    assert _params(inspect.signature(doc_mla)) == ref


def _example_plugin_module():
    path = (ROOT / "tests/plugins/aiter-attn-example-plugin/aiter_attn_example_plugin"
            / "__init__.py")
    spec = importlib.util.spec_from_file_location("docs_example_plugin_src", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plugins_md_register_example_registers():
    """docs/plugins.md "2. Register it": the hook registers the example's kernel class under
    ``example`` at priority 10, so it beats the reference where both serve."""
    from aiter_attn.kernels.registry import KernelRequest

    source = _block("docs/plugins.md", 'register("paged_attention", "example"')
    example = _example_plugin_module()
    mod = types.ModuleType("docs_register_example")
    mod.__dict__["ExamplePagedAttention"] = example.ExamplePagedAttention
    exec(compile(source, "docs/plugins.md:register", "exec"), mod.__dict__)
    pm = plugins.new_plugin_manager()
    plugins.load_plugins(pm, allow=set(), entry_points=False)
    plugins.register_plugin(pm, "example", mod)
    kernels, _ = plugins.build_registries(pm, requested={"example"})
    req = KernelRequest(op="paged_attention", device="cpu", dtype=torch.float32,
                        kv_dtype=torch.float32, head_dim=64, v_head_dim=64, page_size=16,
                        features={"window"})
    sel = kernels.select(req)
    assert (sel.impl.name, sel.impl.priority) == ("example", 10)


@pytest.fixture
def example_installed(monkeypatch):
    """The example plugin pip-installed into a temporary folder (as docs/plugins.md's
    ``pip install ./tests/plugins/aiter-attn-example-plugin``), allowed by name, in the
    process-wide registries (reset around the test)."""
    from .plugins.install import shared_site

    monkeypatch.syspath_prepend(str(shared_site()))
    monkeypatch.setenv(plugins.ENV_ALLOW, "example")
    monkeypatch.delenv("AITER_ATTN_BACKEND", raising=False)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


def test_plugins_md_verify_report_is_what_verify_prints(example_installed):
    """The ``aiter-attn verify --backend example`` report in docs/plugins.md: every row it
    shows has the printed status and kernel, and the summary line is the real one."""
    from aiter_attn.cli import main

    console = _block("docs/plugins.md", "$ aiter-attn verify --backend example", "console")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["verify", "--backend", "example"]) == 0
    got = {line.split()[0]: line for line in buf.getvalue().splitlines()[2:-1]}
    doc_lines = console.splitlines()
    assert doc_lines[2] == buf.getvalue().splitlines()[0]  # the header
    for line in doc_lines[4:-1]:
        if line.strip() == "...":
            continue
        name, status = line.split()[:2]
        assert name in got, f"docs/plugins.md shows case {name!r}, which verify does not run"
        assert got[name].split()[1] == status, (line, got[name])
        if status == "pass":
            assert got[name].endswith(line.split()[-1])  # "kernel example"
    assert doc_lines[-1] == buf.getvalue().splitlines()[-1]


def test_plugins_md_pytest_conformance_example(example_installed):
    """docs/plugins.md's pytest example: parametrised over every conformance case, and its
    body passes for the example backend. It names ``device="cuda"``; without CUDA the cases
    run on the CPU instead (the example plugin serves the CPU only)."""
    from aiter_attn.testing.conformance import conformance_params, run_case

    ns = _run(_block("docs/plugins.md", "conformance_params()"), "docs/plugins.md:pytest")
    test = ns["test_conformance"]
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    assert [p.id for p in mark.args[1]] == [p.id for p in conformance_params()]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ns["run_case"] = lambda case, backend, device_=None, **kw: run_case(
        case, backend=backend, device=device)
    cases = {p.id: p.values[0] for p in conformance_params()}
    for name in ("decode-page16-gqa5:1-d80", "window-page16-w8", "softcap-page16"):
        test(cases[name])  # raise_for_status raises on a failure


def test_plugins_md_features_priorities_and_aiter_functions():
    """docs/plugins.md's lists: the ``features`` a ``Capabilities`` may declare, the built-in
    priorities, and the aiter functions of the AMD plugin's table."""
    from aiter_attn.kernels import aiter as aiter_plugin
    from aiter_attn.kernels.aiter_common import AITER_FUNCTIONS
    from aiter_attn.kernels.registry import FEATURES

    text = _text("docs/plugins.md")
    row = next(line for line in text.splitlines() if line.startswith("| `features` |"))
    listed = re.search(r"subset of `([^`]+)`", row).group(1)
    assert [f.strip() for f in listed.split(",")] == sorted(FEATURES)

    prose = " ".join(text.split())
    assert ("(reference 0, triton 100 — -10 under the CPU interpreter `TRITON_INTERPRET=1` — "
            f"aiter {aiter_plugin.PRIORITY})") in prose
    src = (ROOT / "aiter_attn/kernels/triton/__init__.py").read_text()
    assert "return -10 if _interpreting() and not torch.cuda.is_available() else 100" in src

    table = text.split("| our op | aiter function |", 1)[1].split("\n\n", 1)[0]
    ours = ("paged_attention", "mla_paged", "varlen_attention", "kv_cache_dtype", "fp8_e4m3",
            "auto", "k_descale")  # our ops and argument names; the rest are aiter's functions
    named = {n for n in re.findall(r"`(\w+)`", table) if not n.startswith(ours)}
    assert named and named <= set(AITER_FUNCTIONS), sorted(named - set(AITER_FUNCTIONS))


# -- names the pages use -------------------------------------------------------------------

#: repository paths: from the root, or relative to the package (``kernels/triton/mla.py``)
_PATH = re.compile(r"(?<![\w/.$-])((?:\.\./shared|aiter_attn|tests|scripts|benchmarks|docs|"
                   r"kernels|engine|graph|strategies|integrations|testing|commands|kvcache)"
                   r"/[\w./*-]*\w)")


#: the notes in ``../shared`` (beside the repository) the docs may cite
SHARED_NOTES = {"DESIGN.md", "PERFORMANCE.md", "STYLE.md"}


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_named_paths_exist(doc):
    text = doc.read_text()
    missing = []
    for m in _PATH.finditer(text):
        p = m.group(1)
        if p.startswith("../shared/"):
            # the project's shared notes sit beside the checkout, not in it (a CI clone has
            # none): only the file name is checked, against the notes the docs may cite
            assert p.split("/")[-1] in SHARED_NOTES, f"line {_line(text, m.start())}: {p}"
            continue
        # ``kernels/registry.KernelRegistry``: a module path, then a name in it
        module = re.fullmatch(r"([\w/]+)\.[A-Za-z_]\w*", p)
        tries = [p] + ([module.group(1) + ".py"] if module else [])
        if not any((list(b.glob(t)) if "*" in t else (b / t).exists())
                   for b in (ROOT, ROOT / "aiter_attn") for t in tries):
            missing.append(f"line {_line(text, m.start())}: {p}")
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_named_python_objects_exist(doc):
    """Every ``aiter_attn.x.y`` the page names imports, and every ``ops.name`` exists."""
    from aiter_attn import ops

    text = doc.read_text()
    bad = [f"line {_line(text, m.start())}: {m.group(0)}"
           for m in re.finditer(r"\baiter_attn(?:\.\w+)+", text) if not _resolve(m.group(0))]
    bad += [f"line {_line(text, m.start())}: {m.group(0)}"
            for m in re.finditer(r"(?<![\w.])ops\.(?!py\b)(\w+)", text)
            if not hasattr(ops, m.group(1))]
    assert not bad, f"{doc.name} names Python objects that do not exist: {bad}"


def _source_text(*dirs: str) -> str:
    return "\n".join(p.read_text(errors="replace") for d in dirs
                     for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh") and p.is_file())


@pytest.fixture(scope="module")
def sources():
    return _source_text("aiter_attn", "tests", "scripts", "benchmarks")


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_named_env_vars_exist(doc, sources):
    text = doc.read_text()
    names = set(re.findall(r"\bAITER_ATTN_[A-Z_]*[A-Z]\b", text))
    missing = sorted(n for n in names if n not in sources)
    assert not missing, f"{doc.name} names environment variables nothing reads: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_named_tests_exist(doc):
    text = doc.read_text()
    defined = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    missing = sorted({m.group(1) for m in re.finditer(r"\b(test_\w+)\b(?!\.py|\*)", text)
                      if not re.search(rf"def {m.group(1)}\b", defined)})
    assert not missing, f"{doc.name} names test functions that do not exist: {missing}"


# -- command lines -------------------------------------------------------------------------


def _command_lines(text: str) -> list[tuple[int, str]]:
    """Code spans and fenced-code lines (joined over ``\\`` continuations), with line numbers."""
    out = []
    for m in re.finditer(r"```\w*\n(.*?)```", text, flags=re.S):
        body = m.group(1).replace("\\\n", " ")
        for i, line in enumerate(body.splitlines()):
            out.append((_line(text, m.start()) + 1 + i, line.split(" #")[0]))
    prose = re.sub(r"```\w*\n.*?```", lambda m: "\n" * m.group(0).count("\n"), text,
                   flags=re.S)
    for m in re.finditer(r"`([^`\n]+)`", prose):
        out.append((_line(prose, m.start()), m.group(1)))
    return out


def _flags(tail: str) -> list[str]:
    return [f.split("=")[0] for tok in tail.split() for f in tok.split("/")
            if re.fullmatch(r"--[a-z][\w-]*(=.*)?", f)]


@pytest.fixture(scope="module")
def cli_options():
    from aiter_attn.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {name: {o for a in p._actions for o in a.option_strings}
            for name, p in sub.choices.items()}


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_aiter_attn_command_lines(doc, cli_options):
    """Every ``aiter-attn [-v] SUBCOMMAND --flag ...`` the page shows parses to options that
    subcommand has."""
    bad = []
    for line_no, line in _command_lines(doc.read_text()):
        for m in re.finditer(r"aiter-attn(?: -v)? (\w+)([^|;]*)", line):
            cmd, tail = m.group(1), m.group(2).split("aiter-attn")[0]
            if cmd not in cli_options:
                bad.append(f"line {line_no}: no subcommand {cmd!r}")
                continue
            bad += [f"line {line_no}: aiter-attn {cmd} has no {f}" for f in _flags(tail)
                    if f not in cli_options[cmd]]
    assert not bad, f"{doc.name}: {bad}"


@pytest.mark.parametrize("doc, section, cmd", [
    ("docs/engine.md", "## Options of `aiter-attn generate`", "generate"),
    ("docs/engine.md", "## Errors, context limit and threads", "generate"),
    ("docs/plugins.md", "## 3. Verify it", "verify"),
])
def test_option_sections_name_real_options(doc, section, cmd, cli_options):
    """The sections that document one subcommand's options name only options it has."""
    text = _text(doc)
    assert section in text, f"{doc} has no section {section!r}"
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    missing = sorted({f for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", body)
                      if f not in cli_options[cmd]})
    assert not missing, f"{doc} {section}: aiter-attn {cmd} has no {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_script_command_lines(doc):
    """``python benchmarks/X.py --flag`` / ``scripts/X.py --flag``: the script defines the
    flag (``add_argument("--flag"``)."""
    bad = []
    for line_no, line in _command_lines(doc.read_text()):
        for m in re.finditer(r"((?:benchmarks|scripts)/\w+\.py)([^|;`]*)", line):
            script, tail = m.group(1), re.split(r"\b(?:benchmarks|scripts)/", m.group(2))[0]
            source = (ROOT / script).read_text()
            bad += [f"line {line_no}: {script} has no {f}" for f in _flags(tail)
                    if not re.search(rf"""["']{re.escape(f)}["']""", source)]
    assert not bad, f"{doc.name}: {bad}"


def test_self_check_sees_the_pages():
    """The extraction above finds what it should (a guard against a regex that matches
    nothing and so passes everything)."""
    engine = _text("docs/engine.md")
    lines = [line for _, line in _command_lines(engine)]
    assert any("aiter-attn generate --random-config qwen2 --check" in line for line in lines)
    assert any("bench_attention.py --only mixed" in line for line in lines)
    assert {"--check", "--json", "--max-new-tokens"} <= set(_flags(
        "--random-config qwen2 --check --json --max-new-tokens 8"))
    assert _PATH.search("see `kernels/triton/mla.py: TritonMLA`").group(1) == \
        "kernels/triton/mla.py"
    assert sys.modules.get("aiter_attn") is not None
