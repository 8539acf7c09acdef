"""Inputs of the functional ops (:mod:`aiter_attn.ops`) that used to slip past their checks:
each now raises a clear error naming the argument before any kernel runs, for the reference
and the Triton kernels alike."""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops

from ._index_case import attn_kwargs, mla_case, paged_case
from ._triton_util import DEVICE, requires_triton

BACKENDS = ["reference", pytest.param("triton", marks=requires_triton)]
N_MASK = 3 * 7 + 2 * 5  # the cases' q_lens (3, 2) x kv_lens (7, 5)


def _dev(backend):
    return DEVICE if backend == "triton" else "cpu"


# ---------------------------------------------------------------------- mla_paged_attention


def _mla(backend, **over):
    c = mla_case(device=_dev(backend))
    kw = attn_kwargs(c, kv_lora_rank=c.kv_lora_rank, causal=False)
    kw.update(over)
    return ops.mla_paged_attention(c.q, c.kv_cache, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,err,match", [
    (lambda d: dict(custom_mask=torch.ones(N_MASK, dtype=torch.bool, device=d)),
     ValueError, "custom_mask and mask_indptr go together"),
    (lambda d: dict(mask_indptr=torch.tensor([0, 21, N_MASK], device=d)),
     ValueError, "custom_mask and mask_indptr go together"),
    (lambda d: dict(custom_mask=torch.ones(N_MASK, device=d),
                    mask_indptr=torch.tensor([0, 21, N_MASK], device=d)),
     TypeError, "custom_mask has dtype"),
    (lambda d: dict(custom_mask=torch.ones(N_MASK, dtype=torch.bool, device=d),
                    mask_indptr=torch.tensor([0.0, 21.0, N_MASK], device=d)),
     TypeError, "mask_indptr has dtype"),
    (lambda d: dict(custom_mask=torch.ones(N_MASK, dtype=torch.bool, device=d),
                    mask_indptr=torch.tensor([0, 21], device=d)),
     ValueError, "mask_indptr has shape"),
    (lambda d: dict(custom_mask=torch.ones(N_MASK, dtype=torch.bool, device="meta"),
                    mask_indptr=torch.tensor([0, 21, N_MASK], device=d)),
     ValueError, "custom_mask is on meta"),
], ids=["mask-alone", "indptr-alone", "mask-float", "indptr-float", "indptr-short",
        "mask-device"])
def test_mla_checks_the_tree_mask(backend, make, err, match):
    with pytest.raises(err, match=match):
        _mla(backend, **make(_dev(backend)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [32.0, True, torch.tensor(32)], ids=["float", "bool", "tensor"])
def test_mla_kv_lora_rank_must_be_an_int(backend, rank):
    with pytest.raises(TypeError, match="kv_lora_rank=.* must be a Python int"):
        _mla(backend, kv_lora_rank=rank)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_kv_lora_rank_of_numpy_is_an_int(backend):
    """An integral rank from a config (numpy's int64) is the same launch as the int."""
    np = pytest.importorskip("numpy")
    c = mla_case(device=_dev(backend))
    want = _mla(backend, kv_lora_rank=int(c.kv_lora_rank))
    got = _mla(backend, kv_lora_rank=np.int64(c.kv_lora_rank))
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_tensor_softmax_scale_is_refused(backend):
    """``float()`` of a device tensor waits for the device (a sync on every call): the op
    asks for a Python float instead. ``meta`` stands for a GPU here."""
    with pytest.raises(TypeError, match=r"softmax_scale is a tensor .* on meta; pass a Python"):
        _paged(backend, softmax_scale=torch.tensor(0.25, device="meta"))
    assert _paged(backend, softmax_scale=torch.tensor(0.25)).isfinite().all()


# ---------------------------------------------------------------------- write_kv


def _write(backend, *, k_cache=None, v_cache="like", slots=None, k=None, v="like",
           k_scale=None):
    d = _dev(backend)
    k_cache = torch.zeros(3, 4, 2, 16, device=d) if k_cache is None else k_cache
    v_cache = torch.zeros(3, 4, 2, 16, device=d) if isinstance(v_cache, str) else v_cache
    slots = torch.tensor([5, 7], device=d) if slots is None else slots
    k = torch.randn(2, 2, 16, device=d) if k is None else k
    v = torch.randn(2, 2, 16, device=d) if isinstance(v, str) else v
    ops.write_kv(k_cache, v_cache, slots, k, v, k_scale=k_scale, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,err,match", [
    (lambda d: dict(k_cache=torch.zeros(12, 2, 16, device=d)), ValueError,
     "k_cache has shape .* expected 4-D"),
    (lambda d: dict(k_cache=torch.zeros(3, 4, 2, 16, dtype=torch.int32, device=d)),
     TypeError, "k_cache has dtype"),
    (lambda d: dict(v_cache=None), ValueError, "v_cache and v go together"),
    (lambda d: dict(v=None), ValueError, "v_cache and v go together"),
    (lambda d: dict(v_cache=torch.zeros(3, 4, 2, 16, dtype=torch.float16, device=d)),
     TypeError, "v_cache has dtype"),
    (lambda d: dict(v_cache=torch.zeros(3, 2, 2, 16, device=d)), ValueError,
     r"v_cache has shape \(3, 2, 2, 16\); expected \(3, 4, \*, \*\)"),
    (lambda d: dict(k=torch.randint(0, 4, (2, 2, 16), device=d)), TypeError, "k has dtype"),
    (lambda d: dict(slots=torch.tensor([5, 7], device="meta")), ValueError,
     "slots is on meta"),
    (lambda d: dict(k=torch.randn(2, 2, 16, device="meta")), ValueError, "k is on meta"),
], ids=["cache-3d", "cache-int", "v-without-cache", "cache-without-v", "v-cache-dtype",
        "v-cache-page-size", "k-int", "slots-device", "k-device"])
def test_write_kv_rejects_bad_arguments(backend, make, err, match):
    with pytest.raises(err, match=match):
        _write(backend, **make(_dev(backend)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_never_writes_past_a_smaller_v_cache(backend):
    """A v_cache with fewer pages than k_cache: slot 10 is k_cache's but past v_cache's 8
    slots. The Triton writer used to store it into whatever memory follows v_cache (here
    the rest of ``pool``, another layer's pages); it is refused before any write now."""
    d = _dev(backend)
    pool = torch.zeros(5, 4, 2, 16, device=d)
    k_cache = torch.zeros(3, 4, 2, 16, device=d)
    with pytest.raises(ValueError, match=r"v_cache has shape \(2, 4, 2, 16\)"):
        _write(backend, k_cache=k_cache, v_cache=pool[:2],
               slots=torch.tensor([5, 10], device=d))
    assert not pool.any() and not k_cache.any()


# ---------------------------------------------------------------------- paged_attention


def _paged(backend, **over):
    c = paged_case(device=_dev(backend))
    kw = attn_kwargs(c)
    kw.update(over)
    return ops.paged_attention(c.q, c.k_cache, c.v_cache, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [(True, 0), (2, False)], ids=["left", "right"])
def test_window_of_bools_is_refused(backend, window):
    """``(True, 0)`` is not a window: the reference kernel crashed on it (bool tensor
    subtraction) while the Triton kernel ran it as ``(1, 0)``."""
    with pytest.raises(ValueError, match=r"window_size=\((True, 0|2, False)\); expected"):
        _paged(backend, window_size=window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_cu_seqlens_q_is_named(backend):
    """An empty ``cu_seqlens_q`` (no leading 0) is named itself, not as a seqused_k of
    expected shape (-1,)."""
    d = _dev(backend)
    c = paged_case(device=d)
    empty = torch.zeros(0, dtype=torch.int32, device=d)
    with pytest.raises(ValueError, match=r"cu_seqlens_q has shape \(0,\); .*batch \+ 1"):
        ops.paged_attention(c.q[:0], c.k_cache, c.v_cache, cu_seqlens_q=empty,
                            seqused_k=empty, block_table=c.block_table[:0],
                            softmax_scale=0.25, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["paged", "mla", "write"])
def test_scale_tensor_on_another_device_is_refused(backend, op):
    """A scale tensor is read by the kernel on q's device (its pointer, no sync): one on
    another device is refused by name before any launch (``meta`` stands for a GPU)."""
    far = torch.tensor([0.5], device="meta")
    with pytest.raises(ValueError, match=r"(k_scale|kv_scale) is on meta"):
        if op == "paged":
            _paged(backend, k_scale=far)
        elif op == "mla":
            _mla(backend, kv_scale=far)
        else:
            _write(backend, k_scale=far)


@pytest.mark.parametrize("causal", [True, False])
def test_mla_request_says_non_causal(monkeypatch, causal):
    """A non-causal MLA call asks for ``non_causal``: a kernel serving causal attention only
    (the aiter MLA kernel) is not selected for it, where it used to be chosen and raise."""
    from aiter_attn.kernels.base import mla_request
    from aiter_attn.kernels.registry import Capabilities, CGSupport

    seen = []
    reg = ops._registry()
    real = reg.select
    monkeypatch.setattr(reg, "select", lambda req, **kw: seen.append(req) or real(req, **kw))
    _mla("reference", causal=causal)
    assert ("non_causal" in seen[-1].features) == (not causal)
    c = mla_case(device="cpu")
    req = mla_request(c.q, c.kv_cache, c.kv_lora_rank, causal=causal)
    causal_only = Capabilities(devices={"cpu"}, cg_support=CGSupport.NEVER)
    assert (causal_only.reject_reason(req) is None) == causal
