"""The planned launch keys of the narrow MLA kernel and of the split merge.

A plan interns what it fixes of a launch's specialisation once
(:func:`.mla_narrow_gluon.narrow_plan_spec`, :func:`.mla_merge.merge_plan_spec`); each
layer call's key is that id and the call's own few values. A key that misses something
Triton specialises on would launch a kernel compiled for other values, so these tests
check the planned key against the full one (every argument's ``tensor_key``, the ints, the
constexprs) over calls that differ in one thing each: two calls that share a planned key
share the full key (the planned key may tell apart more: it keeps ints by value where the
merge's full key keeps their value class), and calls of equal properties on other tensors
share both. Nothing is launched (the launchers are recorders)."""

from __future__ import annotations

import itertools

import pytest
import torch

from aiter_attn.kernels.triton import mla_merge as mm
from aiter_attn.kernels.triton import mla_narrow_gluon as mn


class _Recorder:
    """A launcher that launches nothing: ``launch_cached`` misses, ``launch`` keeps the key."""

    def __init__(self):
        self.keys = []

    def launch_cached(self, grid, args, key):
        return False

    def launch(self, grid, args, kw, key):
        self.keys.append(key)


class _Desc:
    def __init__(self, rows):
        self.block_shape = [rows, 512]


def _narrow_call(v: dict):
    """``launch_narrow_mla`` arguments of the base call (64 tokens, 16 heads, bf16, page 64,
    two splits with bf16 partials) changed as ``v`` says; fresh tensors each time."""
    t = v.get("tokens", 64)
    h = v.get("heads", 16)
    dt = v.get("dtype", torch.bfloat16)
    page = v.get("page", 64)
    splits = v.get("splits", 2)
    q = torch.zeros(t * 576 * h + 8, dtype=dt)
    q = q[1:1 + t * h * 576] if v.get("q_misaligned") else q[:t * h * 576]
    q = q.view(t, h, 576)
    out = torch.zeros(t, h, 512 + v.get("out_pad", 0), dtype=dt)[..., :512]
    kv = torch.zeros(8, page, 1, 576, dtype=dt)
    cu = torch.arange(t + 1, dtype=torch.int32)
    seq = torch.full((t,), 4096, dtype=torch.int32)
    bt = torch.zeros(t, v.get("bt_width", 64), dtype=torch.int32)
    po = pl = None
    if splits > 1:
        po = torch.zeros(t, h, splits, 512, dtype=v.get("part_dtype", dt))
        pl = torch.zeros(t, h, splits)
    counters = torch.zeros(t, dtype=torch.int32) if v.get("fused") else None
    lse = torch.zeros(t, h) if v.get("lse") else None
    stamps = torch.zeros(t * splits, 8, dtype=torch.int64) if v.get("stamps") else None
    plan = dict(splits=splits, batch=v.get("batch", t), cu_q=cu, seqused_k=seq,
                block_table=bt, part_o=po, part_lse=pl, counters=counters,
                one_query=v.get("one_query", True), pdl=v.get("pdl", "reduce"))
    call = dict(causal=v.get("causal", True), lse=lse, stamps=stamps,
                descs=(_Desc(min(page, 64)), _Desc(min(page, 64))))
    return (q, kv, out), plan, call


NARROW_VARIANTS = {
    "base": {}, "same-again": {}, "q-misaligned": {"q_misaligned": True},
    "out-strided": {"out_pad": 16}, "fp16": {"dtype": torch.float16},
    "fp32-partials": {"part_dtype": torch.float32}, "page-32": {"page": 32},
    "8-heads": {"heads": 8}, "3-splits": {"splits": 3}, "1-split": {"splits": 1},
    "batch-63": {"batch": 63, "tokens": 63}, "not-one-query": {"one_query": False},
    "pdl-true": {"pdl": True}, "no-pdl": {"pdl": False}, "pdl-early": {"pdl": "early"}, "fused": {"fused": True},
    "lse": {"lse": True}, "not-causal": {"causal": False}, "stamps": {"stamps": True},
    "bt-width-80": {"bt_width": 80},
}


def _narrow_keys(monkeypatch) -> dict:
    rec = _Recorder()
    monkeypatch.setattr(mn, "_NARROW", rec)
    keys = {}
    for name, v in NARROW_VARIANTS.items():
        (q, kv, out), plan, call = _narrow_call(v)
        full = dict(plan, **call)
        mn.launch_narrow_mla(q, kv, out, full.pop("cu_q"), full.pop("seqused_k"),
                             full.pop("block_table"), 0.1, **full)
        planned = mn.narrow_plan_spec(**plan)
        (q, kv, out), plan, call = _narrow_call(v)  # fresh tensors of the same properties
        full = dict(plan, **call)
        mn.launch_narrow_mla(q, kv, out, full.pop("cu_q"), full.pop("seqused_k"),
                             full.pop("block_table"), 0.1, planned=planned, **full)
        keys[name] = tuple(rec.keys[-2:])
    return keys


def _refines(keys: dict) -> None:
    """``keys``: name -> (full key, planned key). Equal planned keys, equal full keys."""
    for (a, ka), (b, kb) in itertools.combinations(keys.items(), 2):
        if ka[1] == kb[1]:
            assert ka[0] == kb[0], (a, b)


def test_narrow_planned_key_tells_apart_what_the_full_key_does(monkeypatch):
    keys = _narrow_keys(monkeypatch)
    _refines(keys)
    assert keys["base"] == keys["same-again"]  # nothing of the tensors' identity
    distinct = {k[1] for name, k in keys.items() if name != "same-again"}
    assert len(distinct) == len(NARROW_VARIANTS) - 1


def _merge_call(v: dict):
    t, h, s = v.get("tokens", 64), 16, v.get("splits", 2)
    dt = v.get("dtype", torch.bfloat16)
    out = torch.zeros(t, h, 512 + v.get("out_pad", 0), dtype=dt)[..., :512]
    po = torch.zeros(t, h, s, 512, dtype=v.get("part_dtype", dt))
    pl = torch.zeros(t, h, s)
    lse = torch.zeros(t, h) if v.get("lse") else None
    pdl = {"PDL": True, "launch_pdl": True} if v.get("pdl", True) else {}
    return out, po, pl, lse, dict(fixed_order=v.get("fixed_order", False), **pdl)


MERGE_VARIANTS = {
    "base": {}, "same-again": {}, "out-strided": {"out_pad": 16},
    "fp16": {"dtype": torch.float16}, "fp32-partials": {"part_dtype": torch.float32},
    "3-splits": {"splits": 3}, "lse": {"lse": True}, "no-pdl": {"pdl": False},
    "fixed-order-fp32": {"fixed_order": True, "part_dtype": torch.float32},
    "63-tokens": {"tokens": 63},
}


def test_merge_planned_key_tells_apart_what_the_full_key_does(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(mm, "_MERGE", rec)
    keys = {}
    for name, v in MERGE_VARIANTS.items():
        out, po, pl, lse, kw = _merge_call(v)
        mm.merge_splits(out, po, pl, lse, 512, 512, **kw)
        planned = mm.merge_plan_spec(po, pl, 512, 512, **kw)
        out, po, pl, lse, kw = _merge_call(v)
        mm.merge_splits(out, po, pl, lse, 512, 512, planned=planned, **kw)
        keys[name] = tuple(rec.keys[-2:])
    _refines(keys)
    assert keys["base"] == keys["same-again"]
    distinct = {k[1] for name, k in keys.items() if name != "same-again"}
    assert len(distinct) == len(MERGE_VARIANTS) - 1


@pytest.mark.parametrize("launcher,call", [("_NARROW", "narrow"), ("_MERGE", "merge")])
def test_a_launched_planned_key_skips_the_constexprs(monkeypatch, launcher, call):
    """Once a planned key has launched (``launch_cached`` hits), the call builds no
    keywords: the launcher's ``launch`` is not reached."""

    class Hit(_Recorder):
        def launch_cached(self, grid, args, key):
            self.keys.append(("cached", key))
            return True

    rec = Hit()
    monkeypatch.setattr(mn if call == "narrow" else mm, launcher, rec)
    if call == "narrow":
        (q, kv, out), plan, c = _narrow_call({})
        full = dict(plan, **c)
        mn.launch_narrow_mla(q, kv, out, full.pop("cu_q"), full.pop("seqused_k"),
                             full.pop("block_table"), 0.1, planned=mn.narrow_plan_spec(**plan),
                             **full)
    else:
        out, po, pl, lse, kw = _merge_call({})
        mm.merge_splits(out, po, pl, lse, 512, 512,
                        planned=mm.merge_plan_spec(po, pl, 512, 512, **kw), **kw)
    assert [k[0] for k in rec.keys] == ["cached"]
