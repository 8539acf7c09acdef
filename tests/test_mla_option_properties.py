"""Property tests (hypothesis) of the Triton MLA kernel's launch options.

Invariant: whatever mix of ``qk_split``, ``lazy_rescale``, ``half_partials``, ``fused_merge``,
``kv_desc``, split count and key tile a launch asks for, over any page size, ragged decode /
verify rows and custom masks (the plan takes what applies to the shapes and declines the
rest), the rows and the natural-log LSE are the float64 oracle's; a row with nothing visible
is exactly zero with an LSE of ``-inf``; a graph padding row (``seqused_k`` 0) is zero.
CPU: Triton's interpreter (float32, float16); a GPU runs the same properties compiled.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ._triton_util import requires_triton
from .test_mla_lazy_rescale import _shape_logits
from .test_triton_mla import MLACase

pytestmark = requires_triton


@st.composite
def option_launches(draw):
    """``(MLACase keyword arguments, logit profile, launch options, padding row or None)``:
    1–3 requests of 1–140 keys with 1–3 queries each (never more than their keys), latents of
    32–128 + 16/32 rope columns, 1–20 heads, pages of 1–48 slots, a custom mask on a third of
    the cases, an fp8 e4m3 cache on a quarter; logits as drawn or shaped along the keys (``grow``: the running maximum moves
    tile after tile, so every rescale path runs; ``shrink``; ``jump``: one late key far above
    the rest), see :func:`.test_mla_lazy_rescale._shape_logits`."""
    batch = draw(st.integers(1, 3))
    kv_lens = draw(st.lists(st.integers(1, 140), min_size=batch, max_size=batch))
    q_lens = [draw(st.integers(1, min(3, n))) for n in kv_lens]
    case = dict(q_lens=q_lens, kv_lens=kv_lens,
                dtype=draw(st.sampled_from([torch.float32, torch.float16])),
                rank=draw(st.sampled_from([32, 64, 128])), rope=draw(st.sampled_from([16, 32])),
                heads=draw(st.sampled_from([1, 5, 16, 20])),
                page=draw(st.sampled_from([1, 7, 16, 32, 48])),
                mask_p=draw(st.sampled_from([None, None, 0.7])),
                # an fp8 latent cache on a quarter of the cases (value pairs, no split chains)
                kv_dtype=draw(st.sampled_from([None, None, None, torch.float8_e4m3fn])),
                seed=draw(st.integers(0, 2 ** 16)))
    launch = dict(qk_split=draw(st.sampled_from([1, 2, 4])), lazy_rescale=draw(st.booleans()),
                  half_partials=draw(st.booleans()), fused_merge=draw(st.booleans()),
                  kv_desc=draw(st.booleans()))
    splits = draw(st.sampled_from([None, 1, 2, 3, 5]))
    block_n = draw(st.sampled_from([None, 16, 32]))
    launch.update({k: v for k, v in dict(num_kv_splits=splits, block_n=block_n).items()
                   if v is not None})
    pad = draw(st.none() | st.integers(0, batch - 1))
    if pad is not None and q_lens[pad] != 1:
        pad = None  # a padding row is a decode row
    profile = draw(st.sampled_from([None, "grow", "shrink", "jump"]))
    return case, profile, launch, pad


def _check(case_kw, profile, launch, pad):
    case = MLACase(**case_kw)
    if profile is not None:
        _shape_logits(case, profile)
    label = f"{case_kw} {profile} {launch}"
    case.assert_rows_and_lse(label, **launch)
    if pad is not None:
        padded = case.run(padding_row=pad, **launch).cpu()
        row = case.cu[pad].item()
        assert torch.isfinite(padded).all() and (padded[row] == 0).all(), label + " padding"


@given(option_launches())
def test_any_option_mix_matches_the_oracle(drawn):
    _check(*drawn)


@pytest.mark.gpu
@given(option_launches())
def test_gpu_any_option_mix_matches_the_oracle(drawn):
    case_kw, profile, launch, pad = drawn
    _check(dict(case_kw, device="cuda"), profile, launch, pad)
