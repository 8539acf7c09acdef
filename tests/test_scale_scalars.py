"""k/v scales are one number per layer; anything else is refused, never truncated (issue 11,
item 3).

The issue's example: one request, 2 KV heads, K and V quantised to fp8 per head with the
``[batch, kv_heads]`` descale ``[[0.5, 2.0]]`` that vLLM and flash-attention pass. Every
backend used its first element for both heads (head 1 off by 1.17); MLA with a 2-element
``kv_scale`` behaved like 1.0. Per-head descales are not served (see
:func:`aiter_attn.validation.check_scale` for why), so every op, every kernel and
``LayerSpec`` refuse them with an error that says what is allowed.
"""

from __future__ import annotations

import math

import pytest
import torch

from aiter_attn import LayerSpec, ops
from aiter_attn.kernels import reference as R
from aiter_attn.kernels.reference_5d import paged_attention_5d_reference, vec_width
from aiter_attn.kernels.reference_extra import kv_5d_from_nhd
from aiter_attn.strategies.vec5d import paged_attention_5d

from ._index_case import attn_kwargs, mla_case
from ._triton_util import DEVICE, requires_triton

FP8 = torch.float8_e4m3fn
PER_HEAD = [[0.5, 2.0]]  # [batch=1, kv_heads=2]
REFUSED = r"is a tensor of shape \(1, 2\) \(2 elements\); only a scalar scale is supported"


def _issue_example(device="cpu", scale=None):
    """One request of 6 keys and 2 queries, 2 KV heads (GQA 2:1), page size 4, K/V
    quantised to fp8 with ``scale`` (default: per head, ``[[0.5, 2.0]]``)."""
    g = torch.Generator().manual_seed(0)
    hkv, d, ps, kv_len, n = 2, 16, 4, 6, 2
    k = torch.randn(kv_len, hkv, d, generator=g)
    v = torch.randn(kv_len, hkv, d, generator=g)
    s = torch.tensor(PER_HEAD if scale is None else [[scale] * hkv])
    per_tok = s[0].view(1, hkv, 1)
    k_cache = torch.zeros(3, ps, hkv, d, dtype=FP8)
    v_cache = torch.zeros(3, ps, hkv, d, dtype=FP8)
    slots = torch.tensor([4, 5, 6, 7, 8, 9])  # pages 1 and 2
    k_cache.view(-1, hkv, d)[slots] = (k / per_tok).to(FP8)
    v_cache.view(-1, hkv, d)[slots] = (v / per_tok).to(FP8)
    q = torch.randn(n, 2 * hkv, d, generator=g)
    kw = dict(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
              seqused_k=torch.tensor([kv_len], dtype=torch.int32),
              block_table=torch.tensor([[1, 2]], dtype=torch.int32), softmax_scale=d ** -0.5)
    to = lambda t: t.to(device) if torch.is_tensor(t) else t  # noqa: E731
    return to(q), to(k_cache), to(v_cache), {k_: to(v_) for k_, v_ in kw.items()}, to(s)


@pytest.mark.parametrize("backend", [None, "reference",
                                     pytest.param("triton", marks=requires_triton)])
def test_paged_attention_refuses_per_head_scales(backend):
    q, kc, vc, kw, s = _issue_example(DEVICE if backend == "triton" else "cpu")
    with pytest.raises(ValueError, match="k_scale " + REFUSED):
        ops.paged_attention(q, kc, vc, k_scale=s, v_scale=s, backend=backend, **kw)
    with pytest.raises(ValueError, match="v_scale " + REFUSED):
        ops.paged_attention(q, kc, vc, k_scale=s[0, :1], v_scale=s, backend=backend, **kw)


def test_reference_kernel_refuses_per_head_scales():
    q, kc, vc, kw, s = _issue_example()
    out = torch.empty(q.shape[0], q.shape[1], 16)
    with pytest.raises(ValueError, match=REFUSED):
        R.paged_attention_reference(q, kc, vc, out, k_scale=s, v_scale=s, **kw)
    k5, v5 = kv_5d_from_nhd(kc, vc, vec_width(FP8), v_shuffled=False)
    with pytest.raises(ValueError, match=REFUSED):
        paged_attention_5d_reference(q, k5, v5, out, k_scale=s, v_scale=s, **kw)
    with pytest.raises(ValueError, match=REFUSED):
        paged_attention_5d(q, k5, v5, k_scale=s, v_scale=s, backend="reference", **kw)


@requires_triton
def test_triton_kernels_refuse_per_head_scales():
    from aiter_attn.kernels.triton.paged_attention import (
        paged_attention_5d_triton,
        paged_attention_triton,
    )

    q, kc, vc, kw, s = _issue_example(DEVICE)
    out = torch.empty(q.shape[0], q.shape[1], 16, device=DEVICE)
    with pytest.raises(ValueError, match=REFUSED):
        paged_attention_triton(q, kc, vc, out, k_scale=s, v_scale=s, **kw)
    k5, v5 = kv_5d_from_nhd(kc, vc, vec_width(FP8), v_shuffled=False)
    with pytest.raises(ValueError, match=REFUSED):
        paged_attention_5d_triton(q, k5, v5, out, k_scale=s, v_scale=s, **kw)


def test_aiter_kernels_refuse_per_head_scales():
    """The aiter kernel objects take their scales from LayerParams, which refuses a
    per-head tensor before any plan (and before aiter is resolved)."""
    from aiter_attn.kernels.aiter import aiter_mla_paged_attention, aiter_paged_attention

    fp8 = torch.float8_e4m3fnuz
    q = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    kc = torch.zeros(3, 16, 2, 16).to(fp8)
    idx = dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
               seqused_k=torch.tensor([3, 5], dtype=torch.int32),
               block_table=torch.tensor([[1], [2]], dtype=torch.int32), softmax_scale=0.25,
               max_seqlen_q=1)
    with pytest.raises(ValueError, match=REFUSED):
        aiter_paged_attention(q, kc, kc, torch.empty_like(q), k_scale=torch.tensor(PER_HEAD),
                              v_scale=torch.tensor(PER_HEAD), **idx)
    qm = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(3, 16, 1, 576).to(fp8)
    with pytest.raises(ValueError, match=REFUSED):
        aiter_mla_paged_attention(qm, kv, torch.empty(2, 16, 512, dtype=torch.bfloat16),
                                  kv_lora_rank=512, kv_scale=torch.tensor(PER_HEAD), **idx)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_mla_refuses_a_two_element_kv_scale(backend):
    c = mla_case(device=DEVICE if backend == "triton" else "cpu")
    kv = c.kv_cache.to(FP8)
    two = torch.tensor([0.5, 2.0], device=kv.device)
    kw = attn_kwargs(c, kv_lora_rank=c.kv_lora_rank)
    with pytest.raises(ValueError, match=r"kv_scale is a tensor of shape \(2,\)"):
        ops.mla_paged_attention(c.q, kv, kv_scale=two, backend=backend, **kw)
    out = torch.empty(c.q.shape[0], c.q.shape[1], c.kv_lora_rank, device=kv.device)
    if backend == "reference":
        fn = R.mla_paged_attention_reference
    else:
        from aiter_attn.kernels.triton.mla import mla_paged_attention as fn
    with pytest.raises(ValueError, match=r"shape \(2,\) \(2 elements\)"):
        fn(c.q, kv, out, kv_scale=two, **kw)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_write_kv_refuses_per_head_scales(backend):
    kc = torch.zeros(2, 4, 2, 16, dtype=FP8, device=DEVICE if backend == "triton" else "cpu")
    k = torch.randn(3, 2, 16, device=kc.device)
    slots = torch.tensor([1, 2, 5], device=kc.device)
    s = torch.tensor(PER_HEAD, device=kc.device)
    with pytest.raises(ValueError, match="k_scale " + REFUSED):
        ops.write_kv(kc, kc.clone(), slots, k, k.clone(), k_scale=s, v_scale=1.0,
                     backend=backend)
    if backend == "reference":
        with pytest.raises(ValueError, match=REFUSED):
            R.write_kv_reference(kc, None, slots, k, None, k_scale=s)
    else:
        from aiter_attn.kernels.triton.kv_write import write_kv

        with pytest.raises(ValueError, match=REFUSED):
            write_kv(kc, None, slots, k, None, k_scale=s)


def test_layer_spec_refuses_per_head_scales():
    with pytest.raises(ValueError, match="k_scale " + REFUSED):
        LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  k_scale=torch.tensor(PER_HEAD))
    with pytest.raises(ValueError, match="v_scale " + REFUSED):
        LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  v_scale=torch.tensor(PER_HEAD))
    LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16,
              k_scale=torch.tensor(0.5), v_scale=torch.tensor([2.0]))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, True, "2"],
                         ids=["zero", "negative", "nan", "inf", "bool", "str"])
def test_bad_scalar_scales_are_refused(bad):
    q, kc, vc, kw, _ = _issue_example()
    with pytest.raises((ValueError, TypeError), match="k_scale"):
        ops.paged_attention(q, kc, vc, k_scale=bad, v_scale=1.0, backend="reference", **kw)
    with pytest.raises((ValueError, TypeError), match="k_scale"):
        LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16, k_scale=bad)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_every_scalar_form_gives_the_same_output(backend):
    """A per-layer scale is served in every scalar form, with the same result: a number,
    a 0-d tensor, a ``[1]`` and a ``[1, 1]`` tensor (the example quantised per layer)."""
    q, kc, vc, kw, _ = _issue_example(DEVICE if backend == "triton" else "cpu", scale=2.0)
    outs = [ops.paged_attention(q, kc, vc, k_scale=s, v_scale=s, backend=backend, **kw)
            for s in (2.0, torch.tensor(2.0), torch.tensor([2.0]), torch.tensor([[2.0]]))]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf],
                         ids=["zero", "negative", "nan", "inf"])
def test_bad_host_tensor_scales_are_refused(bad):
    """A scale tensor on the host is read without a device sync, so its value is checked as a
    number's is (NaN used to give NaN outputs); a device tensor's value is the kernel's."""
    q, kc, vc, kw, _ = _issue_example()
    with pytest.raises(ValueError, match="v_scale=tensor"):
        ops.paged_attention(q, kc, vc, k_scale=1.0, v_scale=torch.tensor(bad),
                            backend="reference", **kw)
    with pytest.raises(ValueError, match="k_scale=tensor"):
        LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  k_scale=torch.tensor([bad]))
