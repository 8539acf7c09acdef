"""The Triton MLA kernel's lazy rescale (``lazy_rescale``): the running maximum of each head
moves, and the ``[H, R]`` accumulator is rescaled, only when a tile's maximum exceeds it by
more than 8 (log2 units), so that ``p ≤ 2^8``.

Checked against the float64 oracle (rows and the natural-log LSE) on caches whose logits
grow along the keys (every few tiles a rescale, some tiles without), shrink along them (one
rescale, at the first tile), jump once by far more than 2^8, with splits, verify rows, masks
and padding rows; on CPU in Triton's interpreter, on a GPU compiled (DeepSeek shapes, with
and without the tensor-descriptor loads).
"""

from __future__ import annotations

import math

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import requires_triton
from .test_triton_mla import MLACase, deepseek_decode

pytestmark = [requires_triton, pytest.mark.usefixtures("triton_mla_kernel")]


def _shape_logits(case: MLACase, profile: str) -> None:
    """Scale each request's latent rows by position (cache and oracle alike): ``grow``
    (logits rising along the keys: the maximum moves in steps), ``shrink`` (falling: the first
    tile holds the maximum) or ``jump`` (one key far above the rest, late in the request)."""
    page = case.kv_cache.shape[1]
    for b, L in enumerate(case.kv_lens):
        pos = torch.arange(L, dtype=torch.float32)
        if profile == "grow":
            f = 0.5 + 3.0 * pos / max(L - 1, 1)
        elif profile == "shrink":
            f = 3.5 - 3.0 * pos / max(L - 1, 1)
        else:
            f = torch.full((L,), 0.5)
            f[(3 * L) // 4] = 6.0
        dense = (case.dense[b] * f[:, None, None]).to(case.kv_cache.dtype)
        case.dense[b] = dense.float()
        for i in range(-(-L // page)):
            p = int(case.block_table[b, i])
            case.kv_cache[p, : min(page, L - i * page)] = dense[i * page:(i + 1) * page]


CASES = [
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[300, 3, 130], page=16), 1, "grow",
                 id="decode-grow"),
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[300, 3, 130], page=16), 4, "grow",
                 id="decode-grow-split4"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[250, 77], page=16), 2, "shrink",
                 id="decode-shrink-split2"),
    pytest.param(dict(q_lens=[3, 2], kv_lens=[200, 49], page=48), 3, "jump",
                 id="verify-jump-p48-split3"),
    pytest.param(dict(q_lens=[2, 1], kv_lens=[160, 90], page=16, mask_p=0.7), 2, "grow",
                 id="masked-grow"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case_kw,splits,profile", CASES)
def test_lazy_rescale_matches_oracle_and_lse(case_kw, splits, profile, dtype):
    case = MLACase(**case_kw, dtype=dtype, seed=9)
    _shape_logits(case, profile)
    case.assert_rows_and_lse(f"lazy rescale {profile}", num_kv_splits=splits, block_n=16,
                             lazy_rescale=True)


def test_lazy_rescale_padding_and_masked_rows_are_zero():
    case = MLACase([2, 1], [40, 5], page=4, mask_p=1.0, seed=1)
    case.masks[0][1] = False  # the second query of request 0 sees nothing
    case.custom_mask = torch.cat([m.reshape(-1) for m in case.masks])
    out = case.run(num_kv_splits=2, lazy_rescale=True)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert_close_rel(out, case.expected(), 1e-5, "masked, lazy")

    pad = MLACase([1, 1, 1], [9, 4, 17], page=4, seed=2)
    out = pad.run(padding_row=1, num_kv_splits=2, lazy_rescale=True)
    assert torch.isfinite(out).all() and (out[1] == 0).all()


def test_lazy_rescale_bound_is_two_to_the_eighth():
    """A hand case: two keys whose logits differ by 7.5 (log2 units) share the first maximum
    (no rescale, p = 2^7.5 for the second); a third, 9 above the first, moves it. The
    result is softmax-exact either way."""
    case = MLACase([1], [3], heads=16, rank=64, rope=16, page=4, seed=4)
    q = torch.zeros_like(case.q)
    q[0, :, 0] = 1.0
    case.q = q
    scale = case.softmax_scale
    logits2 = torch.tensor([0.0, 7.5, 16.5])  # log2 units
    rows = torch.zeros(3, 1, 80)
    rows[:, 0, 0] = logits2 / math.log2(math.e) / scale
    case.dense[0] = rows
    p = int(case.block_table[0, 0])
    case.kv_cache[p, :3] = rows
    out = case.run(block_n=16, lazy_rescale=True, num_kv_splits=1)
    w = torch.softmax(logits2.double() / math.log2(math.e), 0)
    want = (w[:, None] * rows[:, 0, :64].double()).sum(0)
    assert_close_rel(out[0, 0].double(), want, 1e-5, "hand case")
    assert_close_rel(out, case.expected(), 1e-5, "hand case, every head")


# ---------------------------------------------------------------- GPU (compiled)

@pytest.mark.gpu
@pytest.mark.parametrize("kv_desc", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("profile", ["grow", "shrink", "jump"])
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_lazy_rescale_deepseek(splits, profile, kv_desc):
    case = deepseek_decode(torch.bfloat16)
    _shape_logits(case, profile)
    case.assert_rows_and_lse(f"lazy {profile}", num_kv_splits=splits, lazy_rescale=True,
                             kv_desc=kv_desc)
