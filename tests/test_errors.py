"""Bad input raises a clear error (argument, value, what is allowed, fix) before any kernel
runs; every check here is structural (no device sync)."""

import pytest
import torch

from aiter_attn import AttentionBackend, BackendConfig, ForwardBatch, ForwardMode, LayerSpec, ops
from aiter_attn.kernels.registry import KernelSelectionError
from aiter_attn.testing import PagedScenario


@pytest.fixture
def setup():
    cfg = BackendConfig(page_size=4, max_batch_size=4, max_context_len=64, dtype=torch.float32)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=8)
    sc = PagedScenario.make(cfg, [layer], [3, 5], seed=1)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    return cfg, layer, sc, be


@pytest.fixture
def op_args():
    q = torch.randn(3, 4, 8)
    kc = torch.randn(5, 4, 2, 8)
    return dict(q=q, k_cache=kc, v_cache=kc.clone(),
                cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                seqused_k=torch.tensor([7], dtype=torch.int32),
                block_table=torch.tensor([[2, 1]], dtype=torch.int32), softmax_scale=0.3)


def _call(op_args, **changes):
    a = dict(op_args, **changes)
    q, kc, vc = a.pop("q"), a.pop("k_cache"), a.pop("v_cache")
    return ops.paged_attention(q, kc, vc, **a)


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.randn(3, 4, 8).to(torch.int32)), "q has dtype"),
    (dict(q=torch.randn(3, 32)), "q has shape .* expected 3-D"),
    (dict(q=torch.randn(3, 3, 8)), "not a multiple of num_kv_heads"),
    (dict(q=torch.randn(3, 4, 16)), "head_dim"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 3.0])), "cu_seqlens_q has dtype"),
    (dict(seqused_k=torch.tensor([7, 7], dtype=torch.int32)), "seqused_k has shape"),
    (dict(block_table=torch.tensor([2, 1], dtype=torch.int32)), "block_table has shape"),
    (dict(window_size=(2,)), "window_size"),
    (dict(window_size=(-3, 0)), "window_size"),
    (dict(softcap=-1.0), "softcap"),
    (dict(sinks=torch.zeros(3)), "sinks has shape"),
    (dict(out=torch.empty(3, 4, 4)), "out has shape"),
    (dict(custom_mask=torch.ones(21, dtype=torch.bool)), "custom_mask and mask_indptr"),
], ids=["q-dtype", "q-rank", "gqa-groups", "head-dim", "cu-dtype", "seqused-shape",
        "table-rank", "window-len", "window-neg", "softcap-neg", "sinks-shape", "out-shape",
        "mask-alone"])
def test_op_rejects_bad_arguments(op_args, change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _call(op_args, **change)


def test_op_rejects_mixed_devices(op_args):
    if not torch.cuda.is_available():
        meta = torch.empty(3, 4, 8, device="meta")
        with pytest.raises(ValueError, match="is on meta"):
            _call(op_args, q=meta)
    # a LayerSpec's sinks left on another device than the queries: named before any kernel
    with pytest.raises(ValueError, match="sinks is on meta"):
        _call(op_args, sinks=torch.zeros(4, device="meta"))


def test_unknown_backend_names_available(op_args):
    with pytest.raises(KernelSelectionError, match="available: .*reference"):
        _call(op_args, backend="no-such-kernel")


def test_unknown_mode():
    with pytest.raises(ValueError, match="not a forward mode; allowed: EXTEND"):
        ForwardMode.parse("prefill-ish")


def test_length_over_max_context(setup):
    cfg, layer, sc, be = setup
    batch = ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=sc.rows,
                                      seq_lens=[3, 65], out_cache_loc=torch.tensor([9, 10]))
    with pytest.raises(ValueError, match="max_context_len=64"):
        be.init_forward_metadata(batch)


def test_allocator_refuses_past_context(setup):
    cfg, layer, sc, be = setup
    with pytest.raises(ValueError, match="max_context_len"):
        sc.allocator.extend(sc.req_pool, sc.rows[0], 100)


def test_allocator_out_of_pages():
    from aiter_attn import PageAllocator, ReqToTokenPool

    pool = ReqToTokenPool(3, 64)
    alloc = PageAllocator(3, 4)  # pages 1, 2 usable
    row = pool.alloc()
    alloc.extend(pool, row, 8)
    with pytest.raises(RuntimeError, match="out of pages"):
        alloc.extend(pool, row, 1)


def test_slot_count_mismatch(setup):
    cfg, layer, sc, be = setup
    batch = sc.next_batch("decode", [1, 1])
    batch.out_cache_loc = batch.out_cache_loc[:1]
    with pytest.raises(ValueError, match="out_cache_loc has 1 slots"):
        be.init_forward_metadata(batch)


def test_wrong_dtypes_in_batch(setup):
    cfg, layer, sc, be = setup
    batch = sc.next_batch("decode", [1, 1])
    batch.seq_lens = batch.seq_lens.to(torch.int64)
    with pytest.raises(TypeError, match="batch.seq_lens has dtype"):
        be.init_forward_metadata(batch)


def test_extend_needs_lengths(setup):
    cfg, layer, sc, be = setup
    batch = sc.next_batch("extend", [2, 1])
    batch.extend_seq_lens_cpu = None
    with pytest.raises(ValueError, match="EXTEND needs extend_seq_lens"):
        be.init_forward_metadata(batch)


def test_forward_checks_q(setup):
    cfg, layer, sc, be = setup
    batch = sc.next_batch("decode", [1, 1])
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layer)
    with pytest.raises(TypeError, match="q has dtype"):
        be.forward(q.half(), k, v, layer, batch)
    with pytest.raises(ValueError, match="q has shape"):
        be.forward(q[:, :8], k, v, layer, batch)
    other = sc.next_batch("decode", [1, 1])
    with pytest.raises(RuntimeError, match="before init_forward_metadata"):
        be.forward(q, k, v, layer, other)


def test_layer_spec_validation():
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        LayerSpec(layer_id=0, num_q_heads=6, num_kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="sinks has shape"):
        LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=8, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="page_size"):
        BackendConfig(page_size=0)


@pytest.mark.parametrize("mode", ["target_verify", "draft_extend_v2"])
def test_uniform_rows_shorter_than_their_draft_are_refused(setup, mode):
    """seq_lens counts this step's draft tokens: a request of 2 KV tokens cannot hold 3 draft
    queries (they would sit before position 0). Refused by name before any kernel runs."""
    from aiter_attn import SpecInfo

    cfg, layer, sc, be = setup
    batch = ForwardBatch.from_lengths(forward_mode=mode, req_pool_indices=sc.rows,
                                      seq_lens=[6, 2], out_cache_loc=torch.arange(9, 15),
                                      spec_info=SpecInfo(num_draft_tokens=3, topk=1))
    with pytest.raises(ValueError, match=r"seq_lens_cpu\[1\]=2 < the 3 query tokens .*"
                                         "includes the draft tokens"):
        be.init_forward_metadata(batch)
