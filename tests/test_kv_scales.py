"""k/v scales follow one rule everywhere: they dequantise fp8 caches and do not apply to any
other cache dtype (:func:`aiter_attn.types.kv_dequant_scales`). Every architecture (MHA, MLA in
both forms, SWA, VEC5D) and kernel (reference, Triton in the interpreter) is checked on the
hand-computed case of issue 11: an extend of two tokens with q = 0, k = 0, v = 1 and
``k_scale=0.5, v_scale=0.25`` on a float32 pool returns 1.0 (uniform weights over values 1),
not 0.25."""

import pytest
import torch

from aiter_attn import (AttentionBackend, BackendConfig, ForwardBatch, LayerSpec, MLAKVPool,
                        MHAKVPool, ReqToTokenPool, SWAKVPool, Vec5DKVPool, ops)
from aiter_attn.types import FP8_DTYPES, kv_dequant_scales

KERNELS = ["reference", "triton"]
PAGE = 4
SLOTS = [4, 5]  # page 1 (page 0 is the null page)


def _rows():
    r2t = ReqToTokenPool(4, 16)
    r2t.req_to_token[1, :2] = torch.tensor(SLOTS, dtype=torch.int32)
    return r2t


def _extend_batch():
    return ForwardBatch.from_lengths(forward_mode="extend", req_pool_indices=[1], seq_lens=[2],
                                     extend_seq_lens=[2],
                                     out_cache_loc=torch.tensor(SLOTS, dtype=torch.int64))


def _config(arch, kernel):
    return BackendConfig(page_size=PAGE, max_context_len=16, max_batch_size=2,
                         dtype=torch.float32, arch=arch, kernel_backend=kernel)


def _pool(arch, layers):
    if arch == "mha":
        return MHAKVPool(4, PAGE, 1, 16, len(layers), dtype=torch.float32)
    if arch == "vec5d":
        return Vec5DKVPool(num_pages=4, page_size=PAGE, num_kv_heads=1, head_dim=16,
                           num_layers=len(layers), dtype=torch.float32)
    pool = SWAKVPool.create(num_full_pages=4, num_swa_pages=4, page_size=PAGE, num_kv_heads=1,
                            head_dim=16, layer_is_swa=[l.sliding_window is not None
                                                        for l in layers],
                            dtype=torch.float32)
    pool.full_to_swa_index_mapping.copy_(torch.arange(pool.full_to_swa_index_mapping.numel()))
    return pool


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["mha", "swa", "vec5d"])
def test_scales_do_not_apply_to_a_float_cache(arch, kernel):
    """q = 0, k = 0, v = 1 ⇒ equal weights over values 1 ⇒ 1.0 in every head and dim."""
    windows = [None, 8] if arch == "swa" else [None]
    layers = [LayerSpec(layer_id=i, num_q_heads=2, num_kv_heads=1, head_dim=16,
                        sliding_window=w, k_scale=0.5, v_scale=0.25)
              for i, w in enumerate(windows)]
    be = AttentionBackend(_config(arch, kernel), _rows(), _pool(arch, layers))
    batch = _extend_batch()
    be.init_forward_metadata(batch)
    for layer in layers:
        q = torch.zeros(2, 2 * 16)
        k = torch.zeros(2, 16)
        v = torch.ones(2, 16)
        out = be.forward(q, k, v, layer, batch)
        assert torch.equal(out, torch.ones_like(out)), (
            f"{arch}/{kernel} layer {layer.layer_id}: {out[0, :4].tolist()} (scales applied "
            "to a float32 cache)")


def _mla_backend(kernel, kv_scale, projections=None):
    lora, rope, heads = 16, 8, 4
    from aiter_attn import mla_layer_specs

    absorbed, expanded = mla_layer_specs(0, num_heads=heads, kv_lora_rank=lora,
                                         qk_nope_head_dim=8, qk_rope_head_dim=rope,
                                         v_head_dim=lora, scaling=0.3, kv_scale=kv_scale)
    pool = MLAKVPool(4, PAGE, lora, rope, 1, dtype=torch.float32)
    extra = {"mla_projections": {0: projections}} if projections is not None else None
    be = AttentionBackend(_config("mla", kernel), _rows(), pool, extra=extra)
    return be, absorbed, expanded, pool


@pytest.mark.parametrize("kernel", KERNELS)
def test_mla_absorbed_scale_does_not_apply_to_a_float_cache(kernel):
    be, absorbed, _, _ = _mla_backend(kernel, kv_scale=0.25)
    batch = _extend_batch()
    be.init_forward_metadata(batch)
    q = torch.zeros(2, 4 * 24)
    latent = torch.ones(2, 1, 24)
    out = be.forward(q, latent, None, absorbed, batch)
    assert torch.equal(out, torch.ones_like(out)), out[0, :4].tolist()


@pytest.mark.parametrize("kernel", KERNELS)
def test_mla_absorbed_and_expanded_forms_agree_with_scales(kernel):
    """One layer, kv_scale = 0.5 on a float32 latent pool, a cached prefix: the absorbed form
    (kernel reads the latent) and the expanded form (prefix expanded through kv_b_proj) give
    the same output after W_UV."""
    from aiter_attn import absorb_q, apply_w_uv, kv_b_proj_from_weights

    g = torch.Generator().manual_seed(0)
    heads, lora, rope, nope, dv = 4, 16, 8, 8, 16
    w_uk = torch.randn(heads, nope, lora, generator=g) / 4
    w_uv = torch.randn(heads, dv, lora, generator=g) / 4
    be, absorbed, expanded, pool = _mla_backend(kernel, 0.5, kv_b_proj_from_weights(w_uk, w_uv))
    prefix = torch.randn(1, lora + rope, generator=g)
    pool.write_latent(0, torch.tensor([SLOTS[0]]), prefix, kv_scale=0.5)  # no-op scale
    assert torch.equal(pool.kv_buffer(0).view(-1, lora + rope)[SLOTS[0]], prefix[0])
    batch = ForwardBatch.from_lengths(forward_mode="extend", req_pool_indices=[1], seq_lens=[2],
                                      extend_seq_lens=[1],
                                      out_cache_loc=torch.tensor(SLOTS[1:], dtype=torch.int64))
    new = torch.randn(1, lora + rope, generator=g)
    q_nope = torch.randn(1, heads, nope, generator=g)
    q_pe = torch.randn(1, heads, rope, generator=g)
    be.init_forward_metadata(batch)
    q_abs = torch.cat([absorb_q(q_nope, w_uk), q_pe], -1)
    o_abs = be.forward(q_abs.reshape(1, -1), new.unsqueeze(1), None, absorbed, batch)
    o_abs = apply_w_uv(o_abs.view(1, heads, lora), w_uv)
    k = torch.cat([torch.einsum("nl,hdl->nhd", new[:, :lora], w_uk),
                   new[:, None, lora:].expand(-1, heads, -1)], -1)
    v = torch.einsum("nl,hdl->nhd", new[:, :lora], w_uv)
    o_exp = be.forward(torch.cat([q_nope, q_pe], -1).reshape(1, -1), k.reshape(1, -1),
                       v.reshape(1, -1), expanded, batch, save_kv_cache=False)
    o_exp = o_exp.view(1, heads, dv)
    err = (o_abs - o_exp).abs().max() / o_exp.abs().max()
    assert err < 1e-5, f"absorbed vs expanded: relative error {err:.2e}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_ops_ignore_scales_on_float_caches(kernel):
    """The ops themselves (any caller, not only the strategies): a float cache with
    ``k_scale=0.5, v_scale=0.25`` gives exactly the unscaled output."""
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(4, PAGE, 1, 16, generator=g)
    vc = torch.randn(4, PAGE, 1, 16, generator=g)
    q = torch.randn(2, 2, 16, generator=g)
    kw = dict(cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
              seqused_k=torch.tensor([6], dtype=torch.int32),
              block_table=torch.tensor([[2, 1]], dtype=torch.int32), softmax_scale=0.25,
              backend=kernel)
    plain = ops.paged_attention(q, kc, vc, **kw)
    scaled = ops.paged_attention(q, kc, vc, k_scale=0.5, v_scale=0.25, **kw)
    assert torch.equal(plain, scaled)
    latent = torch.randn(4, PAGE, 1, 24, generator=g)
    qm = torch.randn(2, 4, 24, generator=g)
    mla = {k: v for k, v in kw.items()}
    plain = ops.mla_paged_attention(qm, latent, kv_lora_rank=16, **mla)
    scaled = ops.mla_paged_attention(qm, latent, kv_lora_rank=16, kv_scale=0.5, **mla)
    assert torch.equal(plain, scaled)


def test_the_rule():
    fp8 = sorted(FP8_DTYPES, key=str)
    for dt in fp8:
        assert kv_dequant_scales(dt, 0.5, 0.25) == (0.5, 0.25)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert kv_dequant_scales(dt, 0.5, 0.25) == (None, None)


@pytest.mark.skipif(not FP8_DTYPES, reason="no fp8 dtype in this torch")
@pytest.mark.parametrize("kernel", KERNELS)
def test_scales_still_dequantise_an_fp8_cache(kernel):
    """The same case on an e4m3fn cache: v = 1 is stored as 1 / 0.25 = 4 and read back as
    4 · 0.25 = 1 (k = 0 stays 0): 1.0 again; the scale round trip is exact here."""
    fp8 = torch.float8_e4m3fn
    layer = LayerSpec(layer_id=0, num_q_heads=2, num_kv_heads=1, head_dim=16, k_scale=0.5,
                      v_scale=0.25)
    cfg = BackendConfig(page_size=PAGE, max_context_len=16, max_batch_size=2,
                        dtype=torch.float32, kv_cache_dtype=fp8, kernel_backend=kernel)
    pool = MHAKVPool(4, PAGE, 1, 16, 1, dtype=fp8)
    be = AttentionBackend(cfg, _rows(), pool)
    batch = _extend_batch()
    be.init_forward_metadata(batch)
    out = be.forward(torch.zeros(2, 32), torch.zeros(2, 16), torch.ones(2, 16), layer, batch)
    assert float(pool.v_buffers[0].view(-1, 16)[SLOTS[0], 0].float()) == 4.0
    assert torch.equal(out, torch.ones_like(out))
