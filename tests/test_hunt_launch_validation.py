"""Launch configuration, input validation and the checked mode: defects found by a hunt.

- ``check_tensor(shape=...)`` without ``ndim`` compared only the leading axes: an output with
  an extra axis passed (``build_draft_decode_indices`` then wrote its rows interleaved) and
  one with fewer axes raised ``IndexError`` instead of naming the argument.
- ``require_unit_stride`` let an expanded output (stride 0 on an axis of several elements)
  through: every program of the Triton page-table kernel wrote the same row, the last one
  winning (the reference refuses such writes).
- A misspelt ``TUNING_OVERRIDES`` key was ignored by ``choose_config``: a tuning run or a test
  measured the default under the option's name.
- The checked mode (``CheckedKernel``) never compared the plan's page size with the cache's:
  a table of other pages passed every index check and the kernel read the wrong tokens.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from aiter_attn import ops
from aiter_attn.kernels.base import LayerParams, _adhoc_metadata
from aiter_attn.kernels.triton import _launch_config as lc
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.validation import check_tensor, require_unit_stride

from ._triton_util import DEVICE, requires_triton
from .test_triton_paged_attention import RTOL, Case

BACKENDS = ["reference", pytest.param("triton", marks=requires_triton)]


# -- check_tensor: a shape fixes the rank ------------------------------------------------------

def test_check_tensor_shape_fixes_the_rank():
    ok = torch.zeros(2, 4, dtype=torch.int32)
    assert check_tensor("seqused_k", ok, shape=(2, None)) is ok
    with pytest.raises(ValueError, match=r"seqused_k has shape \(2, 4, 2\)"):
        check_tensor("seqused_k", torch.zeros(2, 4, 2), shape=(2, 4))
    with pytest.raises(ValueError, match=r"seqused_k has shape \(4,\)"):
        check_tensor("seqused_k", torch.zeros(4), shape=(4, 4))


def _draft_buffers(steps, rows, width, seq_shape):
    dev = DEVICE
    return (torch.zeros(rows + 1, dtype=torch.int32, device=dev),
            torch.zeros(rows, dtype=torch.int64, device=dev),
            torch.zeros(seq_shape, dtype=torch.int32, device=dev),
            torch.zeros(steps, rows, dtype=torch.int64, device=dev),
            torch.zeros(steps, rows, dtype=torch.int64, device=dev),
            torch.zeros(steps, rows, width, dtype=torch.int32, device=dev))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seq_shape", [(1, 4, 2), (4,)], ids=["extra-axis", "missing-axis"])
def test_draft_decode_indices_refuse_outputs_of_another_rank(backend, seq_shape):
    """``seqused_k`` must be ``[steps, rows]``: the Triton kernel wrote a ``[1, 4, 2]`` buffer
    as if it were ``[1, 8]`` (rows interleaved), the reference raised torch's broadcast
    error; both now name the argument."""
    r2t = torch.arange(4 * 64, dtype=torch.int32, device=DEVICE).reshape(4, 64)
    rpi = torch.tensor([2, 0], dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    steps, topk = (4 if seq_shape == (4,) else 1), 2
    bufs = _draft_buffers(steps, 4, 6, seq_shape)
    with pytest.raises(ValueError, match="seqused_k has shape"):
        ops.build_draft_decode_indices(r2t, rpi, seq_lens, 4, topk, steps, *bufs,
                                       backend=backend)


# -- outputs that share memory -----------------------------------------------------------------

def test_require_unit_stride_refuses_outputs_sharing_memory():
    require_unit_stride("out", torch.zeros(3, 8))
    require_unit_stride("out", torch.zeros(1, 8).expand(1, 8))  # one row: nothing shared
    require_unit_stride("out", torch.zeros(0, 8).expand(0, 8))
    with pytest.raises(ValueError, match=r"out has shape \(3, 8\) and strides \(0, 1\)"):
        require_unit_stride("out", torch.zeros(1, 8).expand(3, 8))
    with pytest.raises(ValueError, match="unit stride"):  # the strided-view refusal stays
        require_unit_stride("out", torch.zeros(3, 8)[:, ::2])


@requires_triton
def test_triton_page_table_refuses_an_expanded_out():
    """Before: every request's row of the expanded ``out`` held the last request's pages."""
    r2t = torch.arange(4 * 64, dtype=torch.int32, device=DEVICE).reshape(4, 64)
    rpi = torch.tensor([2, 0, 3], dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([17, 5, 40], dtype=torch.int32, device=DEVICE)
    shared = torch.zeros(1, 8, dtype=torch.int32, device=DEVICE).expand(3, 8)
    with pytest.raises(ValueError, match="out has shape"):
        ops.build_page_table(r2t, rpi, seq_lens, 4, shared, backend="triton")
    got = torch.zeros(3, 8, dtype=torch.int32, device=DEVICE)
    want = torch.zeros(3, 8, dtype=torch.int32, device=DEVICE)
    ops.build_page_table(r2t, rpi, seq_lens, 4, got, backend="triton")
    ops.build_page_table(r2t, rpi, seq_lens, 4, want, backend="reference")
    assert torch.equal(got, want)


# -- launch overrides --------------------------------------------------------------------------

@pytest.mark.parametrize("batch_invariant", [False, True], ids=["plain", "batch-invariant"])
def test_misspelt_launch_override_is_refused(monkeypatch, batch_invariant):
    kw = dict(group=5, max_q=1, max_k=300, head_dim_pad=128, batch=3, num_kv_heads=2,
              device=torch.device(DEVICE), batch_invariant=batch_invariant)
    monkeypatch.setitem(lc.TUNING_OVERRIDES, "block_n", 16)  # a known key still applies
    assert lc.choose_config(**kw).block_n == 16
    monkeypatch.setitem(lc.TUNING_OVERRIDES, "num_split", 3)
    with pytest.raises(ValueError, match=r"unknown launch override\(s\) \['num_split'\]"):
        lc.choose_config(**kw)


@requires_triton
def test_misspelt_override_is_refused_at_the_op(monkeypatch):
    case = Case([1, 3], [40, 17], hq=10, hkv=2, d=80, page=3, seed=5)
    monkeypatch.setitem(lc.TUNING_OVERRIDES, "page_chunks", 4)
    dev = case.device
    with pytest.raises(ValueError, match="page_chunks"):
        ops.paged_attention(case.q.to(dev), case.k_cache.to(dev), case.v_cache.to(dev),
                            cu_seqlens_q=case.cu.to(dev), seqused_k=case.seqused_k.to(dev),
                            block_table=case.block_table.to(dev), softmax_scale=case.scale,
                            backend="triton")


# -- the checked mode compares page sizes ------------------------------------------------------

def _checked_triton(case):
    from aiter_attn.ops import _registry, paged_attention_request

    req = paged_attention_request(case.q.to(case.device), case.k_cache.to(case.device),
                                  case.v_cache.to(case.device))
    return _registry().select(req, backend="triton").checked().bind(req)


@requires_triton
@pytest.mark.parametrize("page_size", [16, 8], ids=["cache-pages", "other-pages"])
def test_checked_mode_compares_the_plans_page_size_with_the_cache(page_size):
    """A plan whose page table speaks of 8-token pages over a 16-token-page cache passed
    every index check and returned rows 94% off; now it is refused (a matching one runs)."""
    case = Case([1, 2], [20, 30], hq=8, hkv=2, d=64, page=16, seed=2)
    dev = case.device
    q, k_cache, v_cache = case.q.to(dev), case.k_cache.to(dev), case.v_cache.to(dev)
    kernel = _checked_triton(case)
    md = _adhoc_metadata(q, k_cache, case.cu.to(dev), case.seqused_k.to(dev),
                         case.block_table.to(dev), None, None, 2, 30, "paged_attention")
    md = attrs.evolve(md, pages=attrs.evolve(md.pages, page_size=page_size), extras={})
    params = LayerParams.create(scale=case.scale, device=q.device)
    out = torch.empty(q.shape[0], case.hq, case.dv, dtype=q.dtype, device=dev)
    plan = kernel.plan(md)
    if page_size != 16:
        with pytest.raises(ValueError, match="page_size=8 but the cache has 16 tokens"):
            kernel.run(q, (k_cache, v_cache), plan, params, out)
        return
    kernel.run(q, (k_cache, v_cache), plan, params, out)
    assert_close_rel(out, case.expected(), RTOL[case.dtype], "rows")


# ---------------------------------------------------------------- attention outputs that share memory


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("which", ["out", "out_lse"])
def test_paged_attention_refuses_expanded_outputs(backend, which):
    """An expanded ``out`` / ``out_lse`` (one row for every token) was accepted on both
    backends and returned garbage: every program wrote the same memory."""
    from aiter_attn import ops

    torch.manual_seed(0)
    t, hq, hkv, d, ps = 3, 4, 2, 16, 4
    q = torch.randn(t, hq, d)
    k = torch.randn(4, ps, hkv, d)
    v = torch.randn(4, ps, hkv, d)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    seq = torch.tensor([3, 5, 2], dtype=torch.int32)
    bt = torch.tensor([[2, 0], [3, 1], [1, 0]], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, seqused_k=seq, block_table=bt, max_seqlen_q=1, max_seqlen_k=5,
              softmax_scale=d ** -0.5, backend=backend)
    if which == "out":
        kw["out"] = torch.zeros(1, hq, d).expand(t, hq, d)
    else:
        kw["out_lse"] = torch.zeros(1, hq).expand(t, hq)
    with pytest.raises(ValueError, match=f"{which} has shape .* one memory location"):
        ops.paged_attention(q, k, v, **kw)


def test_merge_attention_states_refuses_an_expanded_out():
    from aiter_attn import ops

    torch.manual_seed(0)
    o = torch.randn(3, 2, 8)
    lse = torch.randn(3, 2)
    with pytest.raises(ValueError, match="out has shape .* one memory location"):
        ops.merge_attention_states(o, lse, o.clone(), lse.clone(),
                                   out=torch.zeros(1, 2, 8).expand(3, 2, 8))
