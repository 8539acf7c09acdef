"""The reference kernels that declare ``cg_support=ALWAYS`` (writes, index builders, the state
merge) do nothing a CUDA-graph capture forbids, checked on the CPU: they run on the meta device
(any host read of a value raises there) under a dispatch spy that flags host-to-device copies.

A store of a Python scalar into a tensor element (``t[0] = 0``) is such a copy: it builds a
host ``scalar_tensor`` and copies it into the device tensor, which capture refuses ("Cannot
copy between CPU and CUDA tensors during CUDA graph capture"; the reference
``build_ragged_kv_indices`` did this, H200 2026-12-04). The meta device accepts it, hence the
spy."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from aiter_attn.kernels import reference as R

META = torch.device("meta")


class HostCopySpy(TorchDispatchMode):
    """Records every ``copy_`` whose source came from ``aten.scalar_tensor`` (a host scalar
    on CUDA) or lives on the CPU while the destination does not."""

    def __init__(self):
        super().__init__()
        self.host_made: list = []  # weak refs: an id is reused once its tensor dies
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.scalar_tensor.default:
            self.host_made.append(weakref.ref(out))
        elif func in (torch.ops.aten.copy_.default, torch.ops.aten.index_put_.default,
                      torch.ops.aten.index_put.default):
            srcs = [a for a in tree_leaves(args[1:]) if isinstance(a, torch.Tensor)]
            for s in srcs:
                if any(r() is s for r in self.host_made) or (s.device.type == "cpu"
                                                and args[0].device.type != "cpu"):
                    self.copies.append(str(func))
        return out


def _run(fn, *args, **kw):
    spy = HostCopySpy()
    with spy:
        fn(*args, **kw)
    assert not spy.copies, f"{fn.__name__} copies from the host: {spy.copies}"


def test_spy_flags_a_scalar_store():
    """The check can fail: the old ``kv_indptr[0] = 0`` is flagged, ``[:1].zero_()`` is not."""
    t = torch.empty(5, dtype=torch.int32, device=META)

    def scalar_store(x):
        x[0] = 0

    def tensor_op(x):
        x[:1].zero_()

    with pytest.raises(AssertionError, match="copies from the host"):
        _run(scalar_store, t)
    _run(tensor_op, t)


def _index_inputs(bs=3, rows=5, width=8, page=4):
    i32 = dict(dtype=torch.int32, device=META)
    return (torch.empty(rows, width * page, **i32), torch.empty(bs, dtype=torch.int64, device=META),
            torch.empty(bs, **i32))


def test_build_ragged_kv_indices_is_capture_safe():
    r2t, rows, lens = _index_inputs()
    _run(R.build_ragged_kv_indices_reference, r2t, rows, lens,
         torch.empty(4, dtype=torch.int32, device=META),
         torch.empty(64, dtype=torch.int32, device=META), 20)


def test_build_page_tables_are_capture_safe():
    r2t, rows, lens = _index_inputs()
    out = torch.empty(3, 8, dtype=torch.int32, device=META)
    _run(R.build_page_table_reference, r2t, rows, lens, 4, out)
    _run(R.build_page_tables_swa_reference, r2t, rows, lens, 4,
         torch.empty(32, dtype=torch.int64, device=META), out, torch.empty_like(out))


@pytest.mark.parametrize("token_scales", [False, True], ids=["layer-scale", "token-head"])
def test_write_kv_is_capture_safe(token_scales):
    """No host read (indexing with the 0-dim 'last live row' did read it: the CUDA verify of
    the reference writes failed, H200 2026-12-04) and no host copy."""
    dt = torch.float8_e4m3fn if token_scales else torch.float16
    kc = torch.empty(4, 16, 2, 8, dtype=dt, device=META)
    kw = {}
    if token_scales:
        kw = dict(k_scale_cache=torch.empty(4, 16, 2, device=META),
                  v_scale_cache=torch.empty(4, 16, 2, device=META))
    k = torch.empty(5, 2, 8, dtype=torch.float16, device=META)
    _run(R.write_kv_reference, kc, torch.empty_like(kc), torch.empty(5, dtype=torch.int64,
                                                                    device=META), k, k.clone(),
         **kw)


def test_merge_attention_states_is_capture_safe():
    o = torch.empty(6, 4, 16, dtype=torch.float16, device=META)
    lse = torch.empty(6, 4, dtype=torch.float32, device=META)
    _run(R.merge_attention_states_reference, o, lse, o.clone(), lse.clone(), o.clone(),
         lse.clone())
