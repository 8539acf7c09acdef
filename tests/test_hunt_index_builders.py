"""Defects found hunting the index-builder ops (``build_page_table``,
``build_ragged_kv_indices``, ``build_tree_mask``): each test failed before its fix.

The ops passed their arguments straight to the selected kernel. The reference silently
accepted float/bool index tensors and float outputs, broadcast a one-row ``req_pool_indices``
over the whole batch; the Triton kernels read past a short ``req_pool_indices`` /
``mask_indptr`` (out-of-bounds reads), took any rank, ignored a negative or non-int
``total`` / ``q_len``; tensors on another device failed deep inside. The ops now check
shapes, dtypes, devices and host scalars up front (no device reads), and in the checked mode
(``AITER_ATTN_DEBUG=1``) the pool rows and lengths the builders read.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops
from aiter_attn.validation import DEBUG_ENV

from ._triton_util import DEVICE, requires_triton

pytestmark = requires_triton

I32, I64 = torch.int32, torch.int64
BACKENDS = ["reference", "triton"]


def _table(**kw):
    """A valid build_page_table / build_ragged_kv_indices call (3 requests, 4 pool rows)."""
    a = dict(r2t=torch.arange(64, dtype=I32, device=DEVICE).reshape(4, 16),
             rpi=torch.tensor([2, 0, 1], dtype=I64, device=DEVICE),
             seq=torch.tensor([5, 9, 3], dtype=I32, device=DEVICE))
    a.update(kw)
    return a


def _page_table(backend, out=None, page_size=4, **kw):
    a = _table(**kw)
    out = torch.full((3, 4), -9, dtype=I32, device=DEVICE) if out is None else out
    return ops.build_page_table(a["r2t"], a["rpi"], a["seq"], page_size, out, backend=backend)


def _ragged(backend, ip=None, idx=None, total=17, **kw):
    a = _table(**kw)
    ip = torch.full((4,), -9, dtype=I32, device=DEVICE) if ip is None else ip
    idx = torch.full((17,), -9, dtype=I32, device=DEVICE) if idx is None else idx
    return ops.build_ragged_kv_indices(a["r2t"], a["rpi"], a["seq"], ip, idx, total,
                                       backend=backend)


def _tree_mask(backend, **kw):
    q_len = 3
    seq = torch.tensor([5, 3, 8], dtype=I32, device=DEVICE)
    a = dict(seq=seq, tree=torch.ones(3, q_len, q_len, dtype=torch.bool, device=DEVICE),
             q_len=q_len,
             ip=torch.tensor([0, 15, 24, 48], dtype=I64, device=DEVICE),
             out=torch.zeros(48, dtype=torch.bool, device=DEVICE), total=48)
    a.update(kw)
    return ops.build_tree_mask(a["seq"], a["tree"], a["q_len"], a["ip"], a["out"], a["total"],
                               backend=backend)


# ------------------------------------------------------------------------ build_page_table


@pytest.mark.parametrize("arg", ["r2t", "rpi", "seq", "out"])
def test_build_page_table_refuses_non_index_dtypes(arg):
    """The reference truncated float indices / wrote a float table silently (bool seq_lens
    gave one page per request)."""
    name = {"r2t": "req_to_token", "rpi": "req_pool_indices", "seq": "seq_lens",
            "out": "out"}[arg]
    kw = {arg: _table()[arg].float()} if arg != "out" else {
        "out": torch.zeros(3, 4, device=DEVICE)}
    with pytest.raises(TypeError, match=f"{name} has dtype torch.float32; allowed: int32"):
        _page_table("reference", **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_build_page_table_refuses_short_req_pool_indices(backend):
    """One pool row for three requests: the reference broadcast it over the batch, the
    Triton kernel read req_pool_indices[1:] out of bounds."""
    rpi = torch.tensor([2, 0, 1], dtype=I64, device=DEVICE)[:1]
    with pytest.raises(ValueError, match=r"req_pool_indices has shape \(1,\); expected \(3,\)"):
        _page_table(backend, rpi=rpi)


@pytest.mark.parametrize("arg,shape,name", [
    ("r2t", (4, 4, 4), "req_to_token"), ("rpi", (3, 1), "req_pool_indices"),
    ("seq", (3, 1), "seq_lens")])
def test_build_page_table_refuses_wrong_rank(arg, shape, name):
    """The Triton kernel read any rank as flat memory (a 3-D req_to_token gave a wrong
    table, no error)."""
    t = _table()[arg]
    with pytest.raises(ValueError, match=f"{name} has shape .*expected {len(t.shape)}-D"):
        _page_table("triton", **{arg: t.reshape(shape)})


@pytest.mark.parametrize("backend", BACKENDS)
def test_build_page_table_refuses_bool_page_size(backend):
    with pytest.raises(ValueError, match=r"page_size=True; must be a positive int"):
        _page_table(backend, page_size=True)


# ------------------------------------------------------------------ build_ragged_kv_indices


@pytest.mark.parametrize("which", ["ip", "idx"])
def test_build_ragged_kv_indices_refuses_float_outputs(which):
    """The reference wrote float offsets / indices silently."""
    kw = {which: torch.zeros(4 if which == "ip" else 17, device=DEVICE)}
    name = {"ip": "kv_indptr", "idx": "kv_indices"}[which]
    with pytest.raises(TypeError, match=f"{name} has dtype torch.float32"):
        _ragged("reference", **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_build_ragged_kv_indices_refuses_short_req_pool_indices(backend):
    """The Triton kernel read req_pool_indices past its end (no error); the reference
    failed with a bare IndexError."""
    rpi = torch.tensor([2, 0, 1], dtype=I64, device=DEVICE)[:2]
    with pytest.raises(ValueError, match=r"req_pool_indices has shape \(2,\); expected \(3,\)"):
        _ragged(backend, rpi=rpi)


@pytest.mark.parametrize("arg,name", [("r2t", "req_to_token"), ("ip", "kv_indptr"),
                                      ("seq", "seq_lens")])
def test_build_ragged_kv_indices_refuses_wrong_rank(arg, name):
    """Triton: a 1-D req_to_token read rows at stride 1 (wrong indices), a [B+1, 1]
    kv_indptr / [B, 1] seq_lens were taken as flat."""
    kw = {"r2t": {"r2t": torch.arange(64, dtype=I32, device=DEVICE)},
          "ip": {"ip": torch.zeros(4, 1, dtype=I32, device=DEVICE)},
          "seq": {"seq": torch.tensor([[5], [9], [3]], dtype=I32, device=DEVICE)}}[arg]
    with pytest.raises(ValueError, match=f"{name} has shape"):
        _ragged("triton", **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("total,err", [(-1, ValueError), (17.0, TypeError),
                                       (True, TypeError)])
def test_build_ragged_kv_indices_refuses_bad_total(backend, total, err):
    """Triton ignored a negative / float total; the reference failed deep in torch."""
    with pytest.raises(err, match=r"total=.*Python int ≥ 0|total=-1; must be ≥ 0"):
        _ragged(backend, total=total)


@pytest.mark.parametrize("seq,total,match", [
    ([5, 20, 3], 28, r"seq_lens\[1\]=20; must be in 0..16"),
    ([5, -2, 3], 6, r"seq_lens\[1\]=-2; must be in 0..16"),
    ([5, 9, 3], 16, r"total=16 but sum\(seq_lens\)=17")])
def test_build_ragged_kv_indices_checked_mode_reads_lengths(monkeypatch, seq, total, match):
    """A length past req_to_token's width made the Triton kernel read the next pool row's
    tokens, a negative one wrote garbage offsets; the checked mode now refuses both."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    idx = torch.zeros(max(total, 1), dtype=I32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        _ragged("triton", seq=torch.tensor(seq, dtype=I32, device=DEVICE), idx=idx, total=total)


def test_build_page_table_checked_mode_reads_pool_rows(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match=r"req_pool_indices\[0\]=7 is not a row"):
        _page_table("triton", rpi=torch.tensor([7, 0, 1], dtype=I64, device=DEVICE))


# ------------------------------------------------------------------------ build_tree_mask


@pytest.mark.parametrize("backend", BACKENDS)
def test_build_tree_mask_refuses_short_mask_indptr(backend):
    """Triton read mask_indptr past its end (no error); the reference's IndexError did not
    name the argument."""
    ip = torch.tensor([0, 15, 24, 48], dtype=I64, device=DEVICE)[:2]
    with pytest.raises(ValueError, match=r"mask_indptr has shape \(2,\); expected \(4,\)"):
        _tree_mask(backend, ip=ip)


@pytest.mark.parametrize("arg,value,name", [
    ("seq", torch.tensor([5., 3., 8.]), "seq_lens"),
    ("ip", torch.tensor([0., 15., 24., 48.]), "mask_indptr"),
    ("tree", torch.ones(3, 3, 3), "tree")])
def test_build_tree_mask_refuses_wrong_dtypes(arg, value, name):
    """Triton read float lengths / offsets / tree bits silently."""
    with pytest.raises(TypeError, match=f"{name} has dtype torch.float32"):
        _tree_mask("triton", **{arg: value.to(DEVICE)})


def test_build_tree_mask_reference_refuses_int_out():
    """The reference wrote an int32 mask buffer silently (the Triton wrapper refused)."""
    with pytest.raises(TypeError, match="out has dtype torch.int32; allowed: bool, uint8"):
        _tree_mask("reference", out=torch.zeros(48, dtype=I32, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw,err,match", [
    ({"q_len": -1}, ValueError, r"q_len=-1; must be ≥ 0"),
    ({"q_len": 3.0}, TypeError, r"q_len=3.0 must be a Python int"),
    ({"total": -5}, ValueError, r"total=-5; must be ≥ 0"),
    ({"seq": torch.tensor([[5], [3], [8]], dtype=I32)}, ValueError, r"seq_lens has shape")])
def test_build_tree_mask_refuses_bad_sizes(backend, kw, err, match):
    """Triton wrote an all-False mask for q_len=-1 and ignored a negative total / a 2-D
    seq_lens; the reference failed deep in torch."""
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    with pytest.raises(err, match=match):
        _tree_mask(backend, **kw)


# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize("op", ["page_table", "ragged", "tree_mask"])
def test_index_builders_refuse_mixed_devices(op):
    """A tensor on another device failed deep inside (a copy error or no kernel for
    ``meta``) instead of naming the argument."""
    seq = torch.tensor([5, 3, 8], dtype=I32, device="meta")
    call = {"page_table": _page_table, "ragged": _ragged, "tree_mask": _tree_mask}[op]
    with pytest.raises(ValueError, match=r"seq_lens is on meta but .* is on .*one device"):
        call("triton", seq=seq)
