"""A negative slot (a padding row) is skipped by every KV writer, the reference included: the
batch writes its own slots and nothing else, byte for byte (issue 11: "a batch never writes KV
slots other than its own"). Before, the reference wrote slot -1, i.e. the pool's last slot."""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops

from ._triton_util import DEVICE

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_negative_slots_are_skipped(backend, dtype):
    g = torch.Generator().manual_seed(3)
    pages, page, heads, d = 6, 16, 2, 80
    k_cache = torch.randn(pages, page, heads, d, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(pages, page, heads, d, generator=g).to(dtype).to(DEVICE)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([37, -1, 18, -1, 90], dtype=torch.int64, device=DEVICE)
    k = torch.randn(5, heads, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(5, heads, d, generator=g).to(dtype).to(DEVICE)
    ops.write_kv(k_cache, v_cache, slots, k, v, backend=backend)
    exp_k, exp_v = before_k.view(-1, heads, d).clone(), before_v.view(-1, heads, d).clone()
    live = slots >= 0
    exp_k[slots[live]] = k[live]
    exp_v[slots[live]] = v[live]
    assert torch.equal(k_cache.view(-1, heads, d), exp_k), "K: a slot outside the batch changed"
    assert torch.equal(v_cache.view(-1, heads, d), exp_v), "V: a slot outside the batch changed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slots", [[0, -1, 18, -1], [-1, 5, 0, -1, -1], [-1, -1], [0]],
                         ids=["live0-then-pad", "pad-live0-pad", "all-pad", "only0"])
def test_live_slot_zero_beside_padding_rows(backend, slots):
    """Slot 0 written by a live row while padding rows are in the batch: the live value
    lands (the reference once sent padding rows to slot 0 with its old bytes, and the later
    duplicate write won: wrong on the CPU for a padding row after the live one, and on CUDA
    whatever the order)."""
    g = torch.Generator().manual_seed(5)
    pages, page, heads, d = 4, 16, 2, 16
    k_cache = torch.randn(pages, page, heads, d, generator=g).to(DEVICE)
    v_cache = torch.randn(pages, page, heads, d, generator=g).to(DEVICE)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    k = torch.randn(slots.shape[0], heads, d, generator=g).to(DEVICE)
    v = torch.randn(slots.shape[0], heads, d, generator=g).to(DEVICE)
    ops.write_kv(k_cache, v_cache, slots, k, v, backend=backend)
    exp_k, exp_v = before_k.view(-1, heads, d).clone(), before_v.view(-1, heads, d).clone()
    live = slots >= 0
    exp_k[slots[live]] = k[live]
    exp_v[slots[live]] = v[live]
    assert torch.equal(k_cache.view(-1, heads, d), exp_k)
    assert torch.equal(v_cache.view(-1, heads, d), exp_v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn],
                         ids=["f32", "f16", "e4m3"])
def test_padded_pages_write_their_slots_only(backend, dtype):
    """Pages strided further apart than their rows (vLLM's ``page_size_padded``: each page's
    bytes padded, the cache a view of a larger buffer) get the bytes the same write puts in
    a contiguous cache, and the padding between pages keeps its bytes. The reference writer
    flattened the cache with ``view`` and raised on such a view."""
    g = torch.Generator().manual_seed(7)
    pages, page, pad, heads, d = 5, 16, 3, 2, 48
    slots = torch.tensor([33, -1, 17, 79, 4], dtype=torch.int64, device=DEVICE)
    k = torch.randn(5, heads, d, generator=g).to(DEVICE)
    v = torch.randn(5, heads, d, generator=g).to(DEVICE)
    if dtype != torch.float8_e4m3fn:
        k, v = k.to(dtype), v.to(dtype)
    bufs = [torch.randn(pages, page + pad, heads, d, generator=g).to(dtype).to(DEVICE)
            for _ in range(2)]
    want = [b.clone() for b in bufs]
    dense = [w[:, :page].contiguous() for w in want]
    ops.write_kv(dense[0], dense[1], slots, k, v, backend=backend)
    for w, dn in zip(want, dense):
        w[:, :page] = dn
    # the caches: views whose page stride is (page + pad) · heads · d
    ops.write_kv(bufs[0][:, :page], bufs[1][:, :page], slots, k, v, backend=backend)
    for name, got, w in zip("KV", bufs, want):
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8)), \
            f"{name}: wrong bytes (a live slot or the padding between pages)"
    if dtype != torch.float8_e4m3fn:  # (fp8 rounding is the writers' own: other tests)
        live = slots >= 0  # and the contiguous write put each row where it belongs
        assert torch.equal(dense[0].view(-1, heads, d)[slots[live]], k[live])
