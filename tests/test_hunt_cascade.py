"""Defects found hunting in cascade (shared-prefix) attention, each pinned by a test that
failed before its fix.

* A page table that is not unit-stride along its last axis (a column-sliced view such as
  ``buf[:, ::2]``, or a column-major copy), which ``ops.paged_attention`` serves: the Triton
  shared pass read the run leader's page ids with stride 1 from the raw table, so every
  grouped query attended to the wrong shared pages and returned numbers (relative error
  ~0.5 against the oracle).
* ``cascade_paged_attention`` skipped checks ``ops.paged_attention`` makes on the same
  arguments: integer sinks, host hints that are negative / bool / float, a ``return_lse``
  that is not a bool (``"no"`` returned the ``(out, lse)`` pair).
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops
from aiter_attn.kernels.cascade import cascade_paged_attention
from aiter_attn.testing.compare import assert_close_rel

from ._cascade_case import SharedCase
from ._triton_util import DEVICE, requires_triton

BACKENDS = ["reference", pytest.param("triton", marks=requires_triton)]


def _case(device):
    # two runs (3 + 2 requests), a member sharing fewer pages, GQA 5:1, page 4, extend rows
    return SharedCase([(3, [(3, 5, 2), (3, 9, 1), (2, 4, 3)]), (2, [(2, 6, 1), (2, 3, 2)])],
                      hq=10, hkv=2, d=32, page=4, seed=11).to(device)


def _strided(bt, kind):
    if kind == "column-slice":
        big = torch.zeros(bt.shape[0], 2 * bt.shape[1], dtype=bt.dtype, device=bt.device)
        big[:, ::2] = bt
        return big[:, ::2]
    return bt.t().contiguous().t()  # column-major: stride (1, batch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["column-slice", "column-major"])
def test_strided_block_table(backend, kind):
    """A block table with a non-unit last-axis stride gives the oracle's result (and LSE),
    with the shared pages grouped (the ordinary kernel serves such a table)."""
    case = _case(DEVICE if backend == "triton" else "cpu")
    exp, exp_lse = case.oracle(lse=True, window_size=(6, 0))
    case.block_table = _strided(case.block_table, kind)
    assert case.block_table.stride(-1) != 1
    out, lse = cascade_paged_attention(
        case.q, case.k_cache, case.v_cache, **case.args(), min_shared_tokens=1,
        backend=backend, return_lse=True, window_size=(6, 0))
    assert_close_rel(out, exp, 1e-5, f"{backend} cascade, {kind} block table")
    assert_close_rel(lse, exp_lse, 1e-5, f"{backend} cascade, {kind} block table (lse)")


@requires_triton
def test_shared_pass_refuses_strided_table():
    """The shared-pass launcher itself refuses a table it would read with the wrong stride
    (an O(1) check) instead of attending to the wrong pages."""
    from aiter_attn.kernels.triton.cascade import cascade_shared_triton, shared_config

    case = _case(DEVICE)
    cfg = shared_config(group=5, head_dim_pad=32, fp32=True, on_gpu=False, num_tokens=9,
                        max_k=64, num_kv_heads=2, sms=1)
    acc = torch.zeros(1, 9, 10, 32, device=DEVICE)
    ml = torch.zeros(1, 9, 10, 2, device=DEVICE)
    tiles = torch.zeros(4, 4, dtype=torch.int32, device=DEVICE)
    q_pos = torch.zeros(9, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_table"):
        cascade_shared_triton(case.q, case.k_cache, case.v_cache, acc, ml, tiles, q_pos,
                              _strided(case.block_table, "column-major"), softmax_scale=0.1,
                              window_left=-1, softcap=0.0, k_scale_t=None, v_scale_t=None,
                              cfg=cfg)


BAD_ARGS = [
    pytest.param("sinks", dict(sinks=torch.arange(10)), id="sinks-int"),
    pytest.param("max_seqlen_q", dict(max_seqlen_q=-1), id="max_seqlen_q-neg"),
    pytest.param("max_seqlen_q", dict(max_seqlen_q=True), id="max_seqlen_q-bool"),
    pytest.param("max_seqlen_q", dict(max_seqlen_q=2.5), id="max_seqlen_q-float"),
    pytest.param("max_seqlen_k", dict(max_seqlen_k=-4), id="max_seqlen_k-neg"),
    pytest.param("return_lse", dict(return_lse="no"), id="return_lse-str"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arg,over", BAD_ARGS)
def test_refuses_bad_arguments_like_paged_attention(backend, arg, over):
    """Arguments ``ops.paged_attention`` refuses by name are refused by the cascade op with
    the same error type, naming the same argument (the Triton path used to serve them)."""
    case = _case(DEVICE if backend == "triton" else "cpu")
    over = {k: v.to(case.device) if isinstance(v, torch.Tensor) else v
            for k, v in over.items()}
    kw = dict(case.args(), backend=backend, **over)
    with pytest.raises((TypeError, ValueError), match=arg) as plain:
        ops.paged_attention(case.q, case.k_cache, case.v_cache, **kw)
    with pytest.raises(type(plain.value), match=arg):
        cascade_paged_attention(case.q, case.k_cache, case.v_cache, min_shared_tokens=1, **kw)
