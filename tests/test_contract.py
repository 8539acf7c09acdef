"""The mode contract is data (aiter_attn.contract) carried by strategy pairs; graph limits,
batches and `aiter-attn info` read it."""

import torch

from aiter_attn import BackendConfig, ForwardMode, StrategyPair
from aiter_attn.batch import ForwardBatch, SpecInfo
from aiter_attn.commands.info import mode_arch_table
from aiter_attn.contract import MODE_CONTRACTS, ModeContract, capturable_modes, contract_of
from aiter_attn.graph.buffers import CAPTURABLE_MODES, GraphLimits
from aiter_attn.strategies.mha import DecodeMetadata, PagedExecution
from aiter_attn.types import CGSupport, SpecDecodeConfig


def test_every_mode_has_a_contract():
    assert set(MODE_CONTRACTS) == set(ForwardMode)
    assert contract_of("decode").q_len() == 1 and not contract_of("decode").kv_slack
    assert contract_of("extend").q_len() is None and not contract_of("extend").capturable
    cfg = BackendConfig(spec=SpecDecodeConfig(num_draft_tokens=3, topk=2))
    tv = contract_of(ForwardMode.TARGET_VERIFY)
    assert tv.q_len(cfg) == 3 and tv.slack(cfg) == 3 and tv.has_mask(cfg)
    assert not contract_of(ForwardMode.DRAFT_EXTEND_V2).has_mask(cfg)
    assert CAPTURABLE_MODES == capturable_modes() == (
        ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)


def test_graph_limits_read_the_pairs_contract():
    """A pair whose contract says 'always a tree mask' gets a mask buffer even with topk 1."""
    cfg = BackendConfig(spec=SpecDecodeConfig(num_draft_tokens=2, topk=1), max_context_len=64)
    tree = ModeContract(mode=ForwardMode.TARGET_VERIFY, tokens="draft", kv_slack=True,
                        mask="tree", capture_needs=CGSupport.UNIFORM_BATCH,
                        graph_mode=ForwardMode.TARGET_VERIFY)
    pair = StrategyPair(name="x.verify", arch="mha", modes={"target_verify"},
                        metadata=DecodeMetadata, execution=PagedExecution,
                        contracts={"target_verify": tree})
    assert pair.contract("target_verify") is tree
    assert pair.contract("decode") is contract_of("decode")
    default = GraphLimits.from_config(cfg, "target_verify", 4)
    own = GraphLimits.from_config(cfg, "target_verify", 4, contract=pair.contract("target_verify"))
    assert default.mask_numel == 0 and own.mask_numel == 8 * (64 + 2)


def test_batch_query_lengths_follow_the_contract():
    b = ForwardBatch.from_lengths(forward_mode="draft_extend_v2", req_pool_indices=[1, 2],
                                  seq_lens=[5, 7], out_cache_loc=torch.arange(6),
                                  spec_info=SpecInfo(num_draft_tokens=3, topk=1))
    assert b.q_lens_cpu.tolist() == [3, 3]


def test_info_rows_show_the_contract_and_the_cells_graph_support():
    rows = {(r["mode"], r["arch"]): r for r in mode_arch_table(device="cpu") if r["strategy"]}
    tree = rows[("TARGET_VERIFY tree", "MHA")]
    assert tree["mask"] == "tree" and tree["tokens_per_request"] == "draft" and tree["kv_slack"]
    dec = rows[("DECODE", "MHA")]
    assert dec["mask"] == "none" and dec["tokens_per_request"] == "one"
    # the CPU's reference kernel cannot be captured: the cell is no stronger than it
    assert dec["cg_support"] == "ALWAYS" and dec["cell_cg_support"] == "NEVER"
