"""The reference cascade's rounding: computed in float32, rounded to the output dtype once.

The ordinary torch reference returns the float32 result rounded to q's dtype; the cascade
reference (own pass, shared pass, LSE merge) must be as exact, so that it can stand as the
oracle of the fast paths in fp16 and bf16 too.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.cascade import cascade_paged_attention

from ._cascade_case import SharedCase


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16")])
def test_reference_rounds_once(dtype):
    """The reference cascade (the torch own pass, shared pass and merge) rounds to the output
    dtype once, like the ordinary reference: every entry is as close to the float32 oracle as
    the oracle's own rounding (up to float32 accumulation order), not rounded twice (the own
    pass in the output dtype, then the merge)."""
    case = SharedCase([(3, [(3, 5, 2), (3, 9, 1), (2, 4, 3)]), (2, [(2, 30, 4), (2, 3, 1)])],
                      hq=10, hkv=2, d=80, page=48, seed=1, dtype=dtype)
    exp = case.oracle()
    out = cascade_paged_attention(case.q, case.k_cache, case.v_cache, **case.args(),
                                  min_shared_tokens=1, backend="reference")
    once = (exp.to(dtype).float() - exp).abs()
    err = (out.float() - exp).abs()
    # float32 accumulation order moves a result by a few float32 ulps of its row's scale
    over = err > once + 1e-6 * exp.abs().amax(dim=-1, keepdim=True)
    assert not over.any(), (f"{int(over.sum())} of {over.numel()} entries farther from the "
                            f"float32 oracle than its rounding to {dtype}")
