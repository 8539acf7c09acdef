"""Buffers a captured plan reads keep their addresses for the life of the graph manager,
whatever eager batches run in between; the replay check compares addresses on the CPU too.

The case of issue 11 item 4: multi-step draft decode on the SWA architecture, captured for
batch size 2, run eagerly on a batch of 6 (its step SWA tables outgrow the captured ones), then
replayed: the replay must plan into the captured addresses and match eager.
"""

import pytest
import torch

from aiter_attn import SpecDecodeConfig
from aiter_attn.graph import CudaGraphManager, describe_signature, metadata_signature
from aiter_attn.metadata import AttnMetadata, PageTable, QueryLayout
from aiter_attn.types import ForwardMode

from ._graph_helpers import Rig


def _md(block_table):
    return AttnMetadata(
        mode=ForwardMode.DECODE, batch_size=2,
        query=QueryLayout(cu_seqlens_q=torch.arange(3, dtype=torch.int32), max_seqlen_q=1,
                          num_tokens=2),
        pages=PageTable(block_table=block_table, seqused_k=torch.ones(2, dtype=torch.int32),
                        max_seqlen_k=4, page_size=1))


def test_cpu_signature_compares_addresses():
    """Two plans equal in everything but one tensor's storage differ on the CPU; host mirrors
    (``*_cpu`` fields) and tensors off the backend's device are compared by shape only."""
    a = _md(torch.zeros(2, 4, dtype=torch.int32))
    b = _md(torch.zeros(2, 4, dtype=torch.int32))
    cpu = torch.device("cpu")
    assert metadata_signature(a, cpu) != metadata_signature(b, cpu)
    diff = {k for k, v in describe_signature(a, cpu).items()
            if describe_signature(b, cpu)[k] != v}
    assert "metadata.pages.block_table" in diff
    # the same tensors → the same signature
    assert metadata_signature(a, cpu) == metadata_signature(a, cpu)
    # a tensor on another device than the backend's is a host tensor: shape only
    meta = torch.device("meta")
    assert metadata_signature(a, meta) == metadata_signature(b, meta)


def test_cpu_signature_ignores_host_mirrors():
    from aiter_attn import ForwardBatch

    def batch():
        return ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=[1],
                                         seq_lens=[3], out_cache_loc=torch.zeros(1))

    a, b = batch(), batch()
    b.seq_lens, b.req_pool_indices, b.out_cache_loc = a.seq_lens, a.req_pool_indices, \
        a.out_cache_loc
    b.positions, b.extend_seq_lens = a.positions, a.extend_seq_lens
    cpu = torch.device("cpu")
    assert metadata_signature(a, cpu) == metadata_signature(b, cpu)  # only *_cpu differ


def _pointers(mgr, ms) -> dict:
    """Address of every device tensor the captured plan of the step backends reads."""
    out = {}
    for i, be in enumerate(ms.attn_backends):
        sig = describe_signature(be.forward_metadata, mgr.source.device)
        out.update({f"step{i}{k}": v[1] for k, v in sig.items()
                    if isinstance(v, tuple) and v[0] == "tensor"})
    return out


@pytest.mark.parametrize("arch,page", [
    pytest.param("swa", 7, id="swa-page7"),
    pytest.param("swa", 1, id="swa-page1"),
    pytest.param("mha", 16, id="mha-page16"),
    pytest.param("mla", 16, id="mla-page16"),
])
def test_multistep_tables_stay_put_across_larger_eager_batches(arch, page):
    from aiter_attn import multistep

    topk, steps = 2, 3
    spec = SpecDecodeConfig(num_steps=steps, topk=topk, num_draft_tokens=steps * topk + 1)
    rig = Rig.make(arch, page_size=page, hq=4, hkv=2, head_dim=16, spec=spec, seed=3)
    ms = multistep.MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool)
    mgr = CudaGraphManager(ms, capture_sizes=[2], use_cuda_graph=False,
                           token_inputs=rig.token_inputs())
    fn = rig.multistep_step_fn(ms)
    mgr.capture(fn)
    captured = _pointers(mgr, ms)
    assert any("swa_pages" in k for k in captured) == (arch == "swa")

    rows6, batch6 = rig.join_drafting(6, 30)  # eager, larger than anything captured
    ms.init_forward_metadata(batch6)
    fn(batch6, rig.random_inputs(batch6, num_tokens=6 * topk))
    for r in rows6:
        rig.leave(r)

    rows, batch = rig.join_drafting(2, 30)
    inputs = rig.random_inputs(batch, num_tokens=2 * topk)
    out = [o.clone() for o in mgr.replay(batch, **inputs)]  # raises if anything moved
    assert _pointers(mgr, ms) == captured
    ms.init_forward_metadata(batch)
    for i, (g, e) in enumerate(zip(out, fn(batch, inputs))):
        assert torch.equal(g, e), f"layer {i}: replay ≠ eager"


@pytest.mark.gpu
def test_multistep_swa_tables_stay_put_under_real_capture():
    """The same on a GPU with a real CUDA graph: replay after a larger eager batch reads the
    captured tables and matches eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from aiter_attn import multistep
    from aiter_attn.testing.compare import assert_close_rel

    topk, steps = 2, 4
    spec = SpecDecodeConfig(num_steps=steps, topk=topk, num_draft_tokens=9)
    rig = Rig.make("swa", page_size=16, hq=8, hkv=2, head_dim=128, num_layers=2,
                   max_context_len=512, max_bs=16, spec=spec, dtype=torch.bfloat16,
                   device="cuda", seed=5)
    ms = multistep.MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool)
    mgr = CudaGraphManager(ms, capture_sizes=[2], token_inputs=rig.token_inputs())
    fn = rig.multistep_step_fn(ms)
    mgr.capture(fn)
    captured = _pointers(mgr, ms)
    for bs in (6, 12):
        rows_big, big = rig.join_drafting(bs, 300)
        ms.init_forward_metadata(big)
        fn(big, rig.random_inputs(big, num_tokens=bs * topk))
        for r in rows_big:
            rig.leave(r)
        rows, batch = rig.join_drafting(2, 300)
        inputs = rig.random_inputs(batch, num_tokens=2 * topk)
        out = [o.clone() for o in mgr.replay(batch, **inputs)]
        torch.cuda.synchronize()
        assert _pointers(mgr, ms) == captured
        ms.init_forward_metadata(batch)
        for i, (g, e) in enumerate(zip(out, fn(batch, inputs))):
            assert_close_rel(g, e, 8e-3, f"replay after eager bs={bs}, layer {i}")
        for r in rows:
            rig.leave(r)


def test_outgrown_aiter_workspaces_stay_alive():
    """An eager call that outgrows an aiter workspace gets a new one; the old one (which a
    captured graph may read) is kept alive, never freed."""
    from aiter_attn.kernels import aiter as A

    A.reset_api()
    try:
        small = A._workspace(("t", "cpu"), 16, "cpu")
        big = A._workspace(("t", "cpu"), 64, "cpu")
        assert big.numel() == 64 and small.data_ptr() != big.data_ptr()
        assert any(t is small for t in A._retired)
        assert A._workspace(("t", "cpu"), 32, "cpu") is big
    finally:
        A.reset_api()
