"""What an engine author meets first (issue 11 item 7): a pool page size that differs from the
config is refused at construction; MLA set-up is reachable from the top level and its softmax
scale is explicit; chain vs tree verify is chosen by ``BackendConfig.spec.topk`` on every
architecture; dead code is gone."""

import attrs
import pytest
import torch

import aiter_attn
from aiter_attn import (AttentionBackend, BackendConfig, ForwardBatch, LayerSpec, MHAKVPool,
                        MLAKVPool, ReqToTokenPool, SpecDecodeConfig, SpecInfo)


@pytest.mark.parametrize("arch", ["mha", "mla"])
def test_pool_page_size_must_match_config(arch):
    pool = (MHAKVPool(8, 16, 1, 16, 1) if arch == "mha" else MLAKVPool(8, 16, 16, 8, 1))
    cfg = BackendConfig(arch=arch, max_context_len=64)  # page_size defaults to 1
    with pytest.raises(ValueError, match=r"page_size=16 but BackendConfig.page_size=1"):
        AttentionBackend(cfg, ReqToTokenPool(2, 64), pool)
    AttentionBackend(attrs.evolve(cfg, page_size=16), ReqToTokenPool(2, 64), pool)


def test_mla_setup_from_the_top_level():
    for name in ("mla_layer_specs", "HeadPadding", "MLA_PROJECTIONS_KEY", "MLA_HEAD_PADDING_KEY",
                 "kv_b_proj_from_weights", "absorb_q", "apply_w_uv"):
        assert name in aiter_attn.__all__ and hasattr(aiter_attn, name), name
    absorbed, expanded = aiter_attn.mla_layer_specs(
        0, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        scaling=0.123)
    assert absorbed.scaling == expanded.scaling == 0.123


def test_mla_softmax_scale_is_explicit():
    with pytest.raises(TypeError, match="scaling"):
        aiter_attn.mla_layer_specs(0, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                                   qk_rope_head_dim=8, v_head_dim=8)
    with pytest.raises(ValueError, match="without scaling"):
        LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=1, head_dim=24, v_head_dim=16,
                  kv_lora_rank=16, qk_rope_head_dim=8)


def _mla_backend(topk):
    cfg = BackendConfig(arch="mla", page_size=1, max_context_len=32, dtype=torch.float32,
                        spec=SpecDecodeConfig(topk=topk, num_draft_tokens=2))
    r2t = ReqToTokenPool(3, 32)
    r2t.req_to_token[1, :4] = torch.arange(1, 5, dtype=torch.int32)
    return AttentionBackend(cfg, r2t, MLAKVPool(16, 1, 16, 8, 1, dtype=torch.float32))


def test_plain_layer_spec_for_absorbed_mla_is_refused():
    """A plain LayerSpec (no kv_lora_rank, hence the 1/sqrt(lora + rope) default) is refused
    with the fix named, instead of silently using a wrong softmax scale."""
    be = _mla_backend(1)
    batch = ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=[1], seq_lens=[4],
                                      out_cache_loc=torch.tensor([4]))
    be.init_forward_metadata(batch)
    plain = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=1, head_dim=24, v_head_dim=16)
    with pytest.raises(ValueError, match="mla_layer_specs"):
        be.forward(torch.zeros(1, 4 * 24), torch.zeros(1, 24), None, plain, batch)


@pytest.mark.parametrize("config_topk,batch_topk", [(1, 2), (2, 1)])
@pytest.mark.parametrize("arch", ["mha", "mla"])
def test_chain_vs_tree_is_chosen_by_the_config(arch, config_topk, batch_topk):
    """The same rule on MHA and MLA: the config decides; a batch that disagrees is refused."""
    if arch == "mla":
        be = _mla_backend(config_topk)
    else:
        cfg = BackendConfig(page_size=1, max_context_len=32, dtype=torch.float32,
                            spec=SpecDecodeConfig(topk=config_topk, num_draft_tokens=2))
        r2t = ReqToTokenPool(3, 32)
        r2t.req_to_token[1, :4] = torch.arange(1, 5, dtype=torch.int32)
        be = AttentionBackend(cfg, r2t, MHAKVPool(16, 1, 1, 8, 1, dtype=torch.float32))
    mask = torch.ones(2 * 4, dtype=torch.bool)
    batch = ForwardBatch.from_lengths(
        forward_mode="target_verify", req_pool_indices=[1], seq_lens=[4],
        out_cache_loc=torch.tensor([3, 4]),
        spec_info=SpecInfo(num_draft_tokens=2, topk=batch_topk, custom_mask=mask))
    with pytest.raises(ValueError, match=rf"BackendConfig.spec.topk={config_topk}"):
        be.init_forward_metadata(batch)


def test_dead_code_is_gone():
    from aiter_attn import cli
    from aiter_attn.commands import info
    from aiter_attn.metadata import AttnMetadata

    assert "bench" not in cli.SUBCOMMANDS
    assert not hasattr(info, "IMPOSSIBLE")
    assert "ragged" not in {f.name for f in attrs.fields(AttnMetadata)}
