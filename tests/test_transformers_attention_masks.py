"""transformers integration: the masks transformers hands the ``aiter_attn`` attention.

The function lays each batch row out as one request over a page-size-1 cache; the boolean
mask decides which key columns the row keeps and which query rows are real. These cases go
past left padding: a static cache (trailing key columns not yet written, masked out; or no
mask at all for its first prefill, where ``sdpa``'s ``is_causal`` means upper-left
alignment), bidirectional rows with right padding, and masks the kernel cannot express
(packed sequences), which must be refused by name rather than served wrong. Outputs are
compared with transformers' own ``eager`` / ``sdpa`` attention and a float64 masked softmax.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import (bidirectional_mask_function,  # noqa: E402
                                        causal_mask_function, sdpa_mask)
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

import aiter_attn.integrations.transformers as hf  # noqa: E402
from aiter_attn.engine.random_models import build_random_model  # noqa: E402
from aiter_attn.testing.compare import assert_close_rel  # noqa: E402

from .test_transformers_integration import _batch  # noqa: E402


class _Module(torch.nn.Module):
    """The attributes transformers' attention functions read from the calling layer."""

    def __init__(self, *, causal: bool, groups: int):
        super().__init__()
        self.is_causal, self.layer_idx, self.num_key_value_groups = causal, 0, groups
        self.eval()


def _qkv(b, h, hkv, tq, tk, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, tq, d, generator=g), torch.randn(b, hkv, tk, d, generator=g),
            torch.randn(b, hkv, tk, d, generator=g))


def _dense(q, k, v, mask, scaling):
    """float64 masked softmax; rows that see nothing give zeros. ``[B, T_q, H, D]``."""
    h = q.shape[1]
    kk = k.repeat_interleave(h // k.shape[1], 1).double()
    vv = v.repeat_interleave(h // k.shape[1], 1).double()
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), kk) * scaling
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bqhd", p, vv)


def _additive(mask):
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("name,reference", [
    pytest.param("llama", "sdpa", id="llama-gqa-sdpa"),
    pytest.param("qwen2", "sdpa", id="qwen2-gqa5-head16-sdpa"),
])
@pytest.mark.parametrize("pads", [pytest.param((4, 0, 9), id="left-padded"),
                                  pytest.param((0, 0), id="no-padding")])
def test_static_cache_generate_is_token_identical(name, reference, pads):
    """``cache_implementation="static"``: the cache hands over all ``max_cache_len`` key
    columns, those not yet written masked out (or, on the first prefill without padding, no
    mask: ``sdpa``'s upper-left ``is_causal``)."""
    hf.register()
    model, _ = build_random_model(name)
    ids, mask = _batch(pads=pads)

    def generate(impl):
        model.set_attn_implementation(impl)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                             min_new_tokens=8, do_sample=False, pad_token_id=0,
                             cache_implementation="static")
        return out[:, ids.shape[1]:]

    try:
        ref = generate(reference)
        ours = generate("aiter_attn")
    finally:
        model.set_attn_implementation(reference)
    assert torch.equal(ours, ref), f"{name}: first diff at {(ours != ref).nonzero()[:3].tolist()}"


def test_no_mask_with_fewer_queries_than_keys_is_upper_left_like_sdpa():
    """No mask, ``1 < T_q < T_k``: transformers leaves the mask out there only for a static
    cache's first prefill (``sdpa`` then runs ``is_causal``: query ``i`` sees keys ``0..i``;
    the columns after the queries hold nothing yet)."""
    q, k, v = _qkv(2, 6, 2, 5, 11, 16, seed=3)
    k[:, :, 5:] = 1e3  # unwritten static-cache columns: reading them shows
    module = _Module(causal=True, groups=3)
    ours, _ = hf.attention_forward(module, q, k, v, None, scaling=0.25)
    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25)
    assert_close_rel(ours, ref, 1e-5, "no mask, T_q < T_k")


def test_bidirectional_right_padding_matches_eager():
    """A non-causal layer (an encoder) with right padding: the trailing padding keys of each
    row are dropped; its padding query rows still see the row's real keys (the mask only
    masks keys), as transformers' eager attention computes."""
    b, h, hkv, t, d = 3, 4, 2, 7, 16
    q, k, v = _qkv(b, h, hkv, t, t, d, seed=5)
    real = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5], dtype=torch.bool)
    mask = sdpa_mask(batch_size=b, q_length=t, kv_length=t,
                     mask_function=bidirectional_mask_function, attention_mask=real,
                     allow_is_causal_skip=False)
    module = _Module(causal=False, groups=h // hkv)
    ours, _ = hf.attention_forward(module, q, k, v, mask, scaling=0.3)
    eager, _ = eager_attention_forward(module, q, k, v, _additive(mask), scaling=0.3)
    assert_close_rel(ours, eager, 1e-5, "bidirectional right padding vs eager")
    assert_close_rel(ours, _dense(q, k, v, mask, 0.3), 1e-5, "vs float64")


def test_left_padded_causal_mask_matches_eager():
    """The served case, against transformers' eager attention: left padding, GQA 5:1, head
    dim 80, a decode-like step (``T_q < T_k``)."""
    b, h, hkv, tq, tk, d = 2, 10, 2, 3, 9, 80
    q, k, v = _qkv(b, h, hkv, tq, tk, d, seed=7)
    real = torch.tensor([[0] * 4 + [1] * 5, [1] * 9], dtype=torch.bool)
    mask = sdpa_mask(batch_size=b, q_length=tq, kv_length=tk, q_offset=tk - tq,
                     mask_function=causal_mask_function, attention_mask=real,
                     allow_is_causal_skip=False)
    module = _Module(causal=True, groups=h // hkv)
    ours, _ = hf.attention_forward(module, q, k, v, mask, scaling=d ** -0.5)
    eager, _ = eager_attention_forward(module, q, k, v, _additive(mask), scaling=d ** -0.5)
    assert_close_rel(ours, eager, 1e-5, "left padding vs eager")


def test_masks_the_kernel_cannot_express_are_refused_by_name():
    """Packed sequences (block-diagonal causal) or a hole inside a row would be served as
    plain causal attention over the row's key range: refused, naming the argument and the
    implementations that apply any mask."""
    q, k, v = _qkv(1, 4, 2, 6, 6, 16, seed=9)
    module = _Module(causal=True, groups=2)
    doc = torch.tensor([0, 0, 0, 1, 1, 1])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    packed = (causal & (doc[:, None] == doc[None, :]))[None, None]
    with pytest.raises(ValueError, match=r"attention_mask\[0, 0, \d, \d\] is .*'sdpa' or 'eager'"):
        hf.attention_forward(module, q, k, v, packed, scaling=0.25)
    hole = causal.clone()
    hole[:, 2] = False  # key 2 masked for every query, keys 0-1 and 3-5 seen
    with pytest.raises(ValueError, match=r"attention_mask\[0, 0, \d, \d\] is .*'sdpa' or 'eager'"):
        hf.attention_forward(module, q, k, v, hole[None, None], scaling=0.25)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 1, 6, 5\)"):
        hf.attention_forward(module, q, k, v, causal[None, None, :, :5], scaling=0.25)
