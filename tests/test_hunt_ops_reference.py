"""Defects found hunting the ops and the reference kernels (ops.py validation, the MLA
reference's index checks): each test failed before its fix."""

import pytest
import torch

from aiter_attn import ops
from aiter_attn.kernels.reference import mla_paged_attention_reference


def _mha_args(n=2, L=5, hq=2, hkv=1, d=4, ps=4):
    g = torch.Generator().manual_seed(0)
    pages = -(-L // ps)
    kc = torch.randn(pages + 1, ps, hkv, d, generator=g)
    vc = torch.randn(pages + 1, ps, hkv, d, generator=g)
    q = torch.randn(n, hq, d, generator=g)
    idx = dict(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
               seqused_k=torch.tensor([L], dtype=torch.int32),
               block_table=torch.arange(1, pages + 1, dtype=torch.int32).view(1, -1))
    return q, kc, vc, idx


def _mla_args(n=3, L=12, heads=2, lora=8, rope=4, ps=4):
    g = torch.Generator().manual_seed(1)
    pages = -(-L // ps)
    kv = torch.randn(pages + 1, ps, 1, lora + rope, generator=g)
    q = torch.randn(n, heads, lora + rope, generator=g)
    idx = dict(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
               seqused_k=torch.tensor([L], dtype=torch.int32),
               block_table=torch.arange(1, pages + 1, dtype=torch.int32).view(1, -1))
    return q, kv, idx


# --- the MLA reference checks its max_seqlen_q hint like the MHA reference --------------------
# Before: mla_paged_attention_reference dropped max_seqlen_q on its way to the NHD reference,
# so an understated hint (3 queries, max_seqlen_q=1: the Triton grid is sized from it) ran
# silently, while paged_attention_reference and the checked mode refuse it.


def test_mla_reference_refuses_an_understated_max_seqlen_q():
    q, kv, idx = _mla_args()
    out = torch.empty(q.shape[0], q.shape[1], 8)
    with pytest.raises(ValueError,
                       match=r"mla_paged_attention: request 0 has 3 queries but max_seqlen_q=1"):
        mla_paged_attention_reference(q, kv, out, kv_lora_rank=8, softmax_scale=0.3,
                                      max_seqlen_q=1, **idx)


def test_mla_op_on_the_reference_refuses_an_understated_max_seqlen_q():
    q, kv, idx = _mla_args()
    with pytest.raises(ValueError, match=r"has 3 queries but max_seqlen_q=1"):
        ops.mla_paged_attention(q, kv, kv_lora_rank=8, softmax_scale=0.3, max_seqlen_q=1,
                                backend="reference", **idx)


def test_mla_reference_index_errors_name_the_mla_op():
    q, kv, idx = _mla_args()
    idx["block_table"] = torch.tensor([[1, 2, 9]], dtype=torch.int32)  # page 9 of 4
    out = torch.empty(q.shape[0], q.shape[1], 8)
    with pytest.raises(ValueError, match=r"^mla_paged_attention: block_table\[0, 2\]=9"):
        mla_paged_attention_reference(q, kv, out, kv_lora_rank=8, softmax_scale=0.3, **idx)


# --- sinks must be floating point ----------------------------------------------------------------
# Before: integer and bool sinks were accepted (the doc says float32 [num_q_heads]): a bool
# tensor of flags ran as logits 0/1.


@pytest.mark.parametrize("sinks", [torch.tensor([1, 2]), torch.tensor([True, False])],
                         ids=["int64", "bool"])
def test_non_float_sinks_are_refused(sinks):
    q, kc, vc, idx = _mha_args()
    with pytest.raises(TypeError, match=r"sinks has dtype torch\.(int64|bool); .*floating"):
        ops.paged_attention(q, kc, vc, softmax_scale=1.0, sinks=sinks, backend="reference",
                            **idx)


def test_half_precision_sinks_stay_accepted():
    q, kc, vc, idx = _mha_args()
    s = torch.tensor([0.5, -1.0])
    ref = ops.paged_attention(q, kc, vc, softmax_scale=1.0, sinks=s, backend="reference", **idx)
    out = ops.paged_attention(q, kc, vc, softmax_scale=1.0, sinks=s.bfloat16(),
                              backend="reference", **idx)
    assert torch.allclose(out, ref, atol=1e-6)  # 0.5 and -1 are exact in bf16


# --- empty cache axes get a named error, not ZeroDivisionError -----------------------------------
# Before: a cache with page_size 0 or 0 KV heads raised ZeroDivisionError ("integer modulo
# by zero") from the op's own checks or the kernel.


@pytest.mark.parametrize("shape,what", [((3, 0, 1, 4), "page_size"), ((3, 4, 0, 4), "num_kv_heads")])
def test_paged_attention_empty_cache_axis_is_named(shape, what):
    q, _, _, idx = _mha_args()
    kc = torch.randn(shape)
    with pytest.raises(ValueError, match=rf"k_cache has shape .*{what}.* must be ≥ 1"):
        ops.paged_attention(q, kc, kc.clone(), softmax_scale=1.0, **idx)


def test_mla_empty_page_size_is_named():
    q, _, idx = _mla_args()
    with pytest.raises(ValueError, match=r"kv_cache has shape .*page_size.* must be ≥ 1"):
        ops.mla_paged_attention(q, torch.randn(4, 0, 1, 12), kv_lora_rank=8, softmax_scale=0.3,
                                **idx)


@pytest.mark.parametrize("shape,what", [((4, 0, 1, 4), "page_size"), ((4, 4, 0, 4), "num_kv_heads")])
def test_write_kv_empty_cache_axis_is_named(shape, what):
    kc = torch.randn(shape)
    k = torch.randn(1, shape[2], 4)
    with pytest.raises(ValueError, match=rf"k_cache has shape .*{what}.* must be ≥ 1"):
        ops.write_kv(kc, None, torch.tensor([0]), k, None)


# --- flags and hints are what they say -----------------------------------------------------------
# Before: causal="False" ran causal attention, return_lse="no" returned (out, lse),
# batch_invariant="no" selected batch-invariant kernels, causal=None ran non-causal, and a
# hint of max_seqlen_k="x" / 2.5 was taken (int()'d or ignored, depending on the kernel).


@pytest.mark.parametrize("flag", ["causal", "return_lse", "batch_invariant"])
@pytest.mark.parametrize("value", ["False", None, 2.0], ids=["str", "None", "float"])
def test_paged_attention_flags_must_be_bools(flag, value):
    q, kc, vc, idx = _mha_args()
    with pytest.raises(TypeError, match=rf"{flag}=.* must be a bool"):
        ops.paged_attention(q, kc, vc, softmax_scale=1.0, **{flag: value}, **idx)


@pytest.mark.parametrize("flag", ["causal", "return_lse", "batch_invariant"])
def test_mla_flags_must_be_bools(flag):
    q, kv, idx = _mla_args()
    with pytest.raises(TypeError, match=rf"{flag}=.* must be a bool"):
        ops.mla_paged_attention(q, kv, kv_lora_rank=8, softmax_scale=0.3, **{flag: "no"}, **idx)


@pytest.mark.parametrize("hint", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("value", ["x", 2.5, True, -1], ids=["str", "float", "bool", "neg"])
def test_length_hints_must_be_non_negative_ints(hint, value):
    q, kc, vc, idx = _mha_args()
    with pytest.raises((TypeError, ValueError), match=rf"{hint}=.* must be None or an int ≥ 0"):
        ops.paged_attention(q, kc, vc, softmax_scale=1.0, **{hint: value}, **idx)
    q, kv, idx = _mla_args()
    with pytest.raises((TypeError, ValueError), match=rf"{hint}=.* must be None or an int ≥ 0"):
        ops.mla_paged_attention(q, kv, kv_lora_rank=8, softmax_scale=0.3, **{hint: value}, **idx)


def test_int_flags_and_numpy_hints_stay_accepted():
    np = pytest.importorskip("numpy")
    q, kc, vc, idx = _mha_args()
    ref = ops.paged_attention(q, kc, vc, softmax_scale=1.0, **idx)
    out = ops.paged_attention(q, kc, vc, softmax_scale=1.0, causal=1, max_seqlen_q=np.int64(2),
                              max_seqlen_k=np.int32(5), batch_invariant=np.bool_(False), **idx)
    assert torch.equal(out, ref)
