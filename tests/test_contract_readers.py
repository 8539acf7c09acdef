"""The mode contract is data on the strategy pair (``aiter_attn/contract.py``) and its readers
do not re-derive it (issue 13, item 3): no module branches on a hand-written set of forward
modes or maps IDLE to DECODE itself, ``graph/`` and the multi-step backend probe no
attributes, and the graph buffers and batch helpers follow a pair's own contract."""

import ast
import pathlib

import pytest
import torch

from aiter_attn.batch import ForwardBatch, SpecInfo
from aiter_attn.contract import MODE_CONTRACTS, ModeContract, contract_of
from aiter_attn.graph import graph_mode
from aiter_attn.graph.buffers import GraphLimits, StaticInputs
from aiter_attn.types import BackendConfig, ForwardMode, SpecDecodeConfig

PKG = pathlib.Path(__file__).resolve().parents[1] / "aiter_attn"

#: Modules allowed to spell out sets of modes: the contract itself, the enum, and the SGLang
#: translation (SGLang's own per-mode ``seq_lens`` conventions, not ours).
_MODE_SETS_ALLOWED = {"contract.py", "types.py", "integrations/sglang/translate.py"}


def _is_mode(node) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "ForwardMode")


def _sources():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        yield rel, ast.parse(path.read_text(), filename=rel)


def test_no_module_spells_out_a_set_of_modes():
    """``mode in (ForwardMode.A, ForwardMode.B)`` re-derives a contract fact (ragged or
    uniform, captured or not); ``mode == ForwardMode.IDLE`` re-derives a graph mode. Read
    ``contract_of(mode)`` / ``pair.contract(mode)`` / ``graph.graph_mode`` instead."""
    found = []
    for rel, tree in _sources():
        if rel in _MODE_SETS_ALLOWED:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.In, ast.NotIn)) and isinstance(
                        right, (ast.Tuple, ast.Set, ast.List)) and \
                        sum(map(_is_mode, right.elts)) >= 2:
                    found.append(f"{rel}:{node.lineno}: membership in a set of modes")
                if _is_mode(right) and right.attr == "IDLE" or \
                        _is_mode(node.left) and node.left.attr == "IDLE":
                    found.append(f"{rel}:{node.lineno}: compares with ForwardMode.IDLE")
    assert not found, "mode contract re-derived outside aiter_attn/contract.py:\n" + \
        "\n".join(found)


#: Attributes ``engine/`` may read optionally, all of objects it does not own: a Hugging Face
#: config (``model_type``, …), transformers modules and tokenizers, and the two optional
#: attributes of a user's model documented in docs/models.md / docs/engine.md and the
#: ``EngineModel`` protocol.
_EXTERNAL_ATTRS = {"model_type", "architectures", "hidden_act", "head_dim",
                   "tie_word_embeddings", "max_position_embeddings", "sliding_window",
                   "layer_types", "rope_parameters", "rope_scaling", "chat_template",
                   "generation_config", "eos_token_id", "sinks", "attn_logit_softcapping",
                   "attn_arch", "cuda_graph_capturable", "max_positions"}


def test_graph_engine_and_multistep_probe_no_attributes():
    """The graph manager, the engine and the multi-step backend call the interfaces of our
    own objects; they never ask one whether it has a method (``hasattr``,
    ``getattr(x, "name", None)``). The one entry point, ``graph.sources.source_for``, asks a
    backend for its ``graph_source()`` and names what it accepts when there is none; the
    engine reads optional attributes of external objects only (:data:`_EXTERNAL_ATTRS`)."""
    found = []
    for rel, tree in _sources():
        if not (rel.startswith(("graph/", "engine/")) or rel == "multistep.py"):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            name = node.func.id
            literal = len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str)
            if name == "hasattr" or name == "getattr" and literal and len(node.args) == 3:
                where = f"{rel}:{node.lineno}"
                if where.startswith("graph/sources.py") and node.args[1].value == "graph_source":
                    continue
                if rel.startswith("engine/") and node.args[1].value in _EXTERNAL_ATTRS:
                    continue
                found.append(f"{where}: {name}({ast.unparse(node.args[1])}, ...)")
    assert not found, "attribute probing:\n" + "\n".join(found)


@pytest.mark.parametrize("mode", list(ForwardMode), ids=lambda m: m.name)
def test_graph_mode_is_the_contracts(mode):
    c = contract_of(mode)
    assert graph_mode(mode) == (c.graph_mode or mode)
    assert mode.is_decode_like == c.uniform


def test_batch_q_lens_follow_the_contract():
    """Per-request query lengths come from the contract: one, the draft count (one without
    spec_info), or extend_seq_lens."""
    slots = torch.zeros(6, dtype=torch.int64)
    verify = ForwardBatch.from_lengths(forward_mode="target_verify", req_pool_indices=[1, 2],
                                       seq_lens=[5, 7], out_cache_loc=slots,
                                       spec_info=SpecInfo(num_draft_tokens=3))
    assert verify.q_lens_cpu.tolist() == [3, 3] == verify.extend_seq_lens_cpu.tolist()
    plain = ForwardBatch.from_lengths(forward_mode="draft_extend_v2", req_pool_indices=[1, 2],
                                      seq_lens=[5, 7], out_cache_loc=slots[:2])
    assert plain.q_lens_cpu.tolist() == [1, 1]
    ext = ForwardBatch.from_lengths(forward_mode="extend", req_pool_indices=[1, 2],
                                    seq_lens=[5, 7], out_cache_loc=slots[:6],
                                    extend_seq_lens=[2, 4])
    assert ext.q_lens_cpu.tolist() == [2, 4]


def test_graph_batch_view_takes_the_mask_from_the_pairs_contract():
    """A pair whose contract always plans a tree mask gets the static mask in its captured
    batches even with ``spec.topk == 1`` (the default contract's ``tree_if_topk`` would not):
    the graph limits and the batch view read the pair's contract, not the mode's default."""
    cfg = BackendConfig(page_size=4, max_batch_size=2, max_context_len=16,
                        spec=SpecDecodeConfig(topk=1, num_draft_tokens=3))
    tree = ModeContract(mode=ForwardMode.TARGET_VERIFY, tokens="draft", kv_slack=True,
                        mask="tree", capture_needs=MODE_CONTRACTS[
                            ForwardMode.TARGET_VERIFY].capture_needs,
                        graph_mode=ForwardMode.TARGET_VERIFY)
    spec = SpecInfo(num_draft_tokens=3, topk=1)
    for contract, has_mask in ((tree, True), (None, False)):
        lim = GraphLimits.from_config(cfg, ForwardMode.TARGET_VERIFY, 2, contract=contract)
        static = StaticInputs.allocate([lim], "cpu")
        view = static.batch_view(ForwardMode.TARGET_VERIFY, 2, lim.q_len, spec,
                                 tree_mask=lim.mask_numel > 0)
        assert (view.spec_info.custom_mask is not None) == has_mask


def test_verify_pairs_carry_their_mask_layout():
    """A chain-verify pair's contract plans no mask and a tree-verify pair's always plans
    one (the data says what the pair's ``supports`` check enforces); MLA's one verify pair
    plans a tree exactly when ``spec.topk > 1``."""
    from aiter_attn.plugins import strategy_registry

    pairs = {p.name: p for p in strategy_registry().pairs()}
    verify = [n for n in pairs if ".verify" in n]
    assert verify
    for name in verify:
        c = pairs[name].contract(ForwardMode.TARGET_VERIFY)
        want = {"chain": "none", "tree": "tree"}.get(name.rsplit(".", 1)[-1], "tree_if_topk")
        assert c.mask == want, (name, c.mask)
        assert (c.tokens, c.kv_slack, c.capture_needs) == ("draft", True, MODE_CONTRACTS[
            ForwardMode.TARGET_VERIFY].capture_needs)


def test_one_registration_path():
    """Every family registers through the plugin hooks: kernel registries are filled only by
    the loader (``plugins.build_registries``) from ``aiter_attn_register_kernels(register)``,
    and strategy pairs are made only by ``registry.register_cells`` from a family's table of
    cells. (A registry's ``register`` called anywhere else would be a second style.)"""
    found = []
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "register" and len(node.args) >= 4 \
                    and rel != "plugins.py":
                found.append(f"{rel}:{node.lineno}: {ast.unparse(f)}(...)")
            if isinstance(f, ast.Name) and f.id == "StrategyPair" and rel != "registry.py":
                found.append(f"{rel}:{node.lineno}: StrategyPair(...)")
    assert not found, "registration outside the hooks:\n" + "\n".join(found)


def test_mutants_register_through_their_hook():
    from aiter_attn.kernels.registry import KernelRegistry
    from aiter_attn.testing.conformance.mutants import MUTANTS, register_mutants

    reg = KernelRegistry()
    register_mutants(reg)
    register_mutants(reg)  # idempotent
    got = sorted((i.op, i.name) for op in reg.ops() for i in reg.implementations(op))
    assert got == sorted((m.op, m.name) for m in MUTANTS)
    assert {i.source for op in reg.ops() for i in reg.implementations(op)} == {"mutants"}


def test_swa_allocator_truncates_like_the_page_allocator():
    """Speculative rewinds call ``allocator.truncate`` on either allocator (no probing for
    the SWA allocator's ``full``)."""
    from aiter_attn.kvcache import ReqToTokenPool, SWAKVPool
    from aiter_attn.kvcache.swa import SWAPageAllocator

    pool = SWAKVPool.create(num_full_pages=8, num_swa_pages=8, page_size=4, num_kv_heads=1,
                            head_dim=8, layer_is_swa=[True, False], dtype=torch.float32,
                            device="cpu")
    alloc = SWAPageAllocator(pool, shuffle_seed=0)
    req = ReqToTokenPool(3, 32, "cpu")
    row = req.alloc()
    alloc.extend(req, row, 7)
    pages = alloc.pages_of(row)
    alloc.truncate(row, 5)
    assert alloc.tokens_held(row) == 5 and alloc.pages_of(row) == pages
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.truncate(row, 6)
