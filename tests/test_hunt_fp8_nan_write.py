"""fp8 KV writes of non-finite inputs: the Triton write stores what the reference stores.

A NaN in a K/V vector (a broken layer upstream) must stay NaN in an fp8 cache, so the
attention that reads it is NaN too, as the reference's ``clamp`` + cast keeps it. The Triton
write saturated with ``tl.minimum(tl.maximum(y, -FMAX), FMAX)``; PTX ``min``/``max`` return
the non-NaN operand, so on the GPU a NaN was stored as -FMAX (a finite, wrong value). With
per-(token, head) scales, torch's ``amax`` of a vector holding a NaN is NaN and the
reference's scale there is 1 (``NaN > 0`` is false), while the Triton ``tl.max`` skipped the
NaN: the stored scale of that vector differed, and with it every value of the vector.

The interpreter casts float32 to e4m3fn without NaN (NaN becomes 384, small values flush to
zero), so on the CPU the checks are the stored scales and the e5m2 NaN positions; the GPU
tests compare every byte (NaN positions, then the rest bytewise).
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.reference import write_kv_reference

from ._triton_util import HAS_CUDA, INTERPRET, requires_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
P, S, H, D = 8, 16, 4, 32


def _inputs(device, g):
    k = torch.randn(6, H, D, generator=g)
    v = torch.randn(6, H, D, generator=g)
    k[0, 1, 3] = float("nan")     # one NaN in a vector
    k[2, 0, :] = float("nan")     # a whole NaN vector
    v[1, 3, 7] = float("nan")
    k[3, 2, 5] = float("inf")     # saturates (scalar scale); amax inf (per-token scale)
    v[4, 0, 0] = float("-inf")
    slots = torch.tensor([17, 33, 5, 90, 64, -1])
    return k.to(device), v.to(device), slots.to(device)


def _write(fn, fp8, device, token_scales, g):
    k, v, slots = _inputs(device, g)
    kc = torch.zeros(P, S, H, D, dtype=fp8, device=device)
    vc = torch.zeros(P, S, H, D, dtype=fp8, device=device)
    kw = dict(k_scale=0.5, v_scale=torch.tensor(2.0, device=device))
    if token_scales:
        kw["k_scale_cache"] = torch.zeros(P, S, H, device=device)
        kw["v_scale_cache"] = torch.zeros(P, S, H, device=device)
    fn(kc, vc, slots, k, v, **kw)
    return kc, vc, kw.get("k_scale_cache"), kw.get("v_scale_cache")


def _both(fp8, device, token_scales):
    from aiter_attn.kernels.triton.kv_write import write_kv

    ref = _write(write_kv_reference, fp8, device, token_scales, torch.Generator().manual_seed(5))
    got = _write(write_kv, fp8, device, token_scales, torch.Generator().manual_seed(5))
    return ref, got


@requires_triton
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3fn", "e5m2"])
def test_token_head_scales_of_nan_vectors_match_reference(fp8):
    """Per-(token, head) scales: a vector holding a NaN gets the reference's scale (1)."""
    (_, _, rks, rvs), (_, _, gks, gvs) = _both(fp8, "cpu", True)
    assert rks[1, 1, 1] == 1.0 and rks[0, 5, 0] == 1.0  # the reference's convention
    for name, a, b in (("k", rks, gks), ("v", rvs, gvs)):
        same = (a == b) | (a.isnan() & b.isnan())
        assert bool(same.all()), f"{name} scales differ at {(~same).nonzero().tolist()}"


@requires_triton
@pytest.mark.parametrize("token_scales", [False, True], ids=["scalar", "token-head"])
def test_e5m2_nan_positions_kept(token_scales):
    """The interpreter casts e5m2 NaN faithfully: NaN stays NaN where the reference has it,
    and no finite input becomes NaN."""
    (rk, rv, *_), (gk, gv, *_) = _both(E5M2, "cpu", token_scales)
    for name, a, b in (("k", rk, gk), ("v", rv, gv)):
        assert torch.equal(a.float().isnan(), b.float().isnan()), name
        assert int(a.float().isnan().sum()) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("token_scales", [False, True], ids=["scalar", "token-head"])
def test_gpu_nan_and_inf_writes_equal_reference(fp8, token_scales):
    """On the GPU: NaN positions equal, every other byte equal, scales equal."""
    ref, got = _both(fp8, "cuda", token_scales)
    for name, a, b in zip(("k", "v", "k_scales", "v_scales"), ref, got):
        if a is None:
            continue
        na, nb = a.float().isnan(), b.float().isnan()
        assert torch.equal(na, nb), f"{name}: NaN at {na.nonzero().tolist()} vs {nb.nonzero().tolist()}"
        raw_a = a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32)
        raw_b = b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32)
        same = (raw_a == raw_b) | na
        assert bool(same.all()), f"{name}: bytes differ at {(~same).nonzero()[:8].tolist()}"
    assert int(ref[0].float().isnan().sum()) > 0
