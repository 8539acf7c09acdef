"""The Gluon decode kernel (``aiter_attn/kernels/triton/decode_gluon.py``): compiled for
sm_90 on any host (no spills, the H200's shared memory and registers), and on an sm_90 GPU
against the float32 oracle over block-permuted pages with a null page 0, NaN in the
unwritten slots of every request's last page, odd groups and page sizes, split and
unsplit, with the LSE."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiter_attn.kernels.triton.prefill_gluon import HAS_GLUON
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import HAS_CUDA, INTERPRET
from .test_triton_paged_attention import RTOL, Case

ROOT = Path(__file__).resolve().parents[1]
H200_SMEM_OPTIN = 232448

pytestmark = pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon")


def _inspect(const: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(ROOT / "scripts" / "inspect_gluon_decode_sm90.py"),
           json.dumps(const), "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("const", [
    {},
    {"NC": 1, "STAGES": 2, "SPLITS": 4, "WRITE_LSE": True},
    {"G": 5, "GP": 8, "PAGE": 48, "D": 64, "SPLITS": 3},
    {"G": 16, "GP": 16, "BLOCK_N": 128, "BOX": 64, "PAGE": 64, "STAGES": 3, "q": "fp16",
     "maxnreg": 168},
], ids=["gqa4-p16", "one-consumer-splits-lse", "g5-p48-d64", "g16-bn128-p64-fp16"])
def test_gluon_decode_compiles_for_sm90(const):
    """No spills; the ring fits the H200's shared memory; every wgmma keeps N at the padded
    group (m64n8 / m64n16: the keys are the M side)."""
    r = _inspect(const)
    assert r["stack"] == 0, r
    assert r["shared"] <= H200_SMEM_OPTIN, r
    assert r["registers"] * r["warps"] * 32 <= 65536, r
    assert r["wgmma"] > 0, r


def _nan_tails(case: Case):
    """Unwritten slots of each request's last page hold NaN (what a fresh pool may hold)."""
    page = case.k_cache.shape[1]
    for b, L in enumerate(case.kv_lens):
        n_pages = -(-L // page)
        if L % page and n_pages:
            p = int(case.block_table[b, n_pages - 1])
            case.k_cache[p, L % page:] = float("nan")
            case.v_cache[p, L % page:] = float("nan")


def _run(case: Case, splits, config, lse=False):
    from aiter_attn.kernels.triton.decode_gluon import gluon_decode

    dev = "cuda"
    out = torch.full((case.q.shape[0], case.hq, case.dv), float("nan"), dtype=case.dtype,
                     device=dev)
    lse_t = torch.full((case.q.shape[0], case.hq), float("nan"), device=dev) if lse else None
    gluon_decode(case.q.to(dev), case.k_cache.to(dev), case.v_cache.to(dev), out,
                 case.cu.to(dev), case.seqused_k.to(dev), case.block_table.to(dev),
                 case.scale, splits=splits, config=config, lse=lse_t)
    torch.cuda.synchronize()
    return out, lse_t


def _sm90() -> bool:
    return HAS_CUDA and not INTERPRET and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="an NVIDIA sm_90 GPU")
@pytest.mark.parametrize("kv_lens,hq,hkv,d,page,splits,cfg", [
    pytest.param([4096], 32, 8, 128, 16, 16, (64, 4, 2), id="1x4k-16splits"),
    pytest.param([4096] * 3, 32, 8, 128, 16, 1, (64, 4, 2), id="3x4k-unsplit"),
    pytest.param([4100, 33, 1, 700], 32, 8, 128, 16, 1, (64, 4, 2), id="ragged-unsplit"),
    pytest.param([4100, 33, 1, 700], 32, 8, 128, 16, 5, (64, 4, 2), id="ragged-splits"),
    pytest.param([1000, 17], 32, 8, 128, 16, 3, (64, 2, 1), id="one-consumer"),
    pytest.param([777, 96], 40, 8, 128, 48, 2, (64, 3, 2), id="gqa5-page48"),
    pytest.param([513, 1], 16, 16, 64, 16, 1, (64, 4, 2), id="mha-d64"),
    pytest.param([2000, 300], 16, 1, 128, 64, 4, (128, 3, 2), id="g16-bn128-p64"),
    pytest.param([3000], 8, 1, 256, 32, 2, (64, 2, 2), id="d256-p32"),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_gluon_decode_vs_oracle(kv_lens, hq, hkv, d, page, splits, cfg, dtype):
    from aiter_attn.kernels.triton.decode_gluon import GluonDecodeConfig

    case = Case([1] * len(kv_lens), kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype,
                seed=len(kv_lens) + d, device="cuda")
    _nan_tails(case)
    config = GluonDecodeConfig(block_n=cfg[0], stages=cfg[1], consumers=cfg[2])
    out, lse = _run(case, splits, config, lse=True)
    assert_close_rel(out, case.expected(), RTOL[dtype], f"gluon decode {config}")
    # the LSE against the float32 logits of the oracle's inputs
    exp_lse = []
    for b, L in enumerate(kv_lens):
        k = case.dense_k[b].repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        s = torch.einsum("hd,lhd->hl", case.q[b].float(), k) * case.scale
        exp_lse.append(torch.logsumexp(s, dim=1))
    assert_close_rel(lse.cpu(), torch.stack(exp_lse), 1e-3, "gluon decode lse")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="an NVIDIA sm_90 GPU")
def test_gpu_gluon_decode_empty_request_outputs_zeros():
    """A request with no keys (a graph's padding row) gets zeros and LSE -inf, no NaN, and
    its neighbours are unaffected."""
    from aiter_attn.kernels.triton.decode_gluon import GluonDecodeConfig

    case = Case([1, 1], [0, 300], hq=32, hkv=8, d=128, page=16, dtype=torch.bfloat16,
                device="cuda")
    for splits in (1, 3):
        out, lse = _run(case, splits, GluonDecodeConfig(), lse=True)
        assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
        assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()
        assert_close_rel(out[1:], case.expected()[1:], RTOL[torch.bfloat16], "neighbour")


def test_split_rule():
    """One program per SM of 132, at least four 64-key tiles a split (the H200 rows of
    docs/benchmarks.md: 1x4k 16 splits, 1x32k 16, 8x64k 2, 16x4k none)."""
    from aiter_attn.kernels.triton.decode_gluon import choose_splits

    assert choose_splits(8, 4096, 132) == 16
    assert choose_splits(8, 32768, 132) == 16
    assert choose_splits(64, 65536, 132) == 2
    assert choose_splits(128, 4096, 132) == 1
    assert choose_splits(8, 300, 132) == 2  # short requests: four tiles a split
    assert choose_splits(512, 4096, 132) == 1


def test_not_planned_off_sm90(monkeypatch):
    """On a host without an sm_90 GPU (or with the override off) no plan carries the Gluon
    launch, and the reason is kept once per device."""
    from aiter_attn.kernels.triton import _launch_config as lc
    from aiter_attn.kernels.triton.attention import TritonPagedAttention

    case = Case([1, 1], [40, 70], hq=8, hkv=2, d=64, dtype=torch.float16, device="cpu")
    kernel = TritonPagedAttention(TritonPagedAttention.request_for(
        case.q, case.k_cache, case.v_cache))
    assert kernel._gluon_splits(1, 70, 2, torch.device("cpu"), None) is None
    assert "sm_90" in kernel._gluon_why[torch.device("cpu")] or "Gluon" in \
        kernel._gluon_why[torch.device("cpu")]
    monkeypatch.setitem(lc.TUNING_OVERRIDES, "gluon_decode", False)
    assert kernel._gluon_splits(1, 70, 2, torch.device("cuda"), None) is None


def _spy_gluon(monkeypatch):
    from aiter_attn.kernels.triton import attention as attn

    calls = []
    real = attn.run_planned

    def spy(part, *a, **kw):
        calls.append(part[4])  # the split count
        return real(part, *a, **kw)

    monkeypatch.setattr(attn, "run_planned", spy)
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="an NVIDIA sm_90 GPU")
@pytest.mark.parametrize("kv_lens,page", [
    pytest.param([4100], 16, id="bs1-splits"),
    pytest.param([4100, 33, 1, 700] * 8, 16, id="bs32"),
    pytest.param([1500, 90], 48, id="page48"),
])
def test_gpu_default_decode_runs_gluon(monkeypatch, kv_lens, page):
    """The library's decode on sm_90 (``ops.paged_attention``, the Triton backend's plan)
    launches the Gluon kernel for plain bf16 layers and the Triton kernel for layers it
    does not serve (sinks, soft-cap, window): both against the oracle."""
    from .test_triton_paged_attention import _check

    calls = _spy_gluon(monkeypatch)
    case = Case([1] * len(kv_lens), kv_lens, hq=32, hkv=8, d=128, page=page,
                dtype=torch.bfloat16, seed=page, device="cuda")
    _nan_tails(case)
    _check(case, "default decode (gluon)")
    assert calls, "the Gluon kernel did not run"
    _check(case, "default decode (gluon), the direct launch")  # the second call of its key
    # a q that is not 16-byte aligned is another specialisation (a new launch key)
    from aiter_attn.kernels.triton.paged_attention import paged_attention_triton

    dev = "cuda"
    q = case.q.to(dev)
    q = torch.empty(q.numel() + 1, dtype=q.dtype, device=dev)[1:].view_as(q).copy_(q)
    out = torch.full((q.shape[0], 32, 128), float("nan"), dtype=q.dtype, device=dev)
    paged_attention_triton(q, case.k_cache.to(dev), case.v_cache.to(dev), out,
                           cu_seqlens_q=case.cu.to(dev), seqused_k=case.seqused_k.to(dev),
                           block_table=case.block_table.to(dev), softmax_scale=case.scale,
                           max_seqlen_q=1, max_seqlen_k=max(kv_lens))
    assert_close_rel(out, case.expected(), RTOL[torch.bfloat16], "gluon, misaligned q")
    n = len(calls)
    assert n == 3, calls
    sinks = torch.randn(32, generator=torch.Generator().manual_seed(1))
    _check(case, "decode with sinks + soft-cap + window (Triton)", sinks=sinks,
           softcap=30.0, window_size=(511, -1))
    assert len(calls) == n, "a featured layer took the Gluon kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="an NVIDIA sm_90 GPU")
@pytest.mark.parametrize("bs", [1, 16])
def test_gpu_gluon_decode_under_graph_replay(monkeypatch, bs):
    """Planned into the static workspace (the graph manager's buffers), captured once in a
    CUDA graph, replayed after the batch's lengths and block table change in place: every
    replay matches the oracle (splits at bs 1, none at 16)."""
    from aiter_attn.graph.buffers import GraphLimits
    from aiter_attn.kernels.base import LayerParams, _adhoc_metadata
    from aiter_attn.kernels.triton.attention import TritonPagedAttention
    from aiter_attn.types import ForwardMode

    calls = _spy_gluon(monkeypatch)
    dev = "cuda"
    cases = [Case([1] * bs, [2000 + 37 * i + 300 * r for i in range(bs)], hq=32, hkv=8,
                  d=128, page=16, dtype=torch.bfloat16, seed=r, device=dev) for r in range(2)]
    width = max(c.block_table.shape[1] for c in cases)
    pages = max(c.k_cache.shape[0] for c in cases)
    k_cache = torch.zeros(pages, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    v_cache = torch.zeros_like(k_cache)
    q = torch.empty(bs, 32, 128, dtype=torch.bfloat16, device=dev)
    bt = torch.zeros(bs, width, dtype=torch.int32, device=dev)
    seq = torch.zeros(bs, dtype=torch.int32, device=dev)
    cu = torch.arange(bs + 1, dtype=torch.int32, device=dev)
    out = torch.empty(bs, 32, 128, dtype=torch.bfloat16, device=dev)

    def load(c):
        k_cache.zero_()
        v_cache.zero_()
        k_cache[:c.k_cache.shape[0]] = c.k_cache.to(dev)
        v_cache[:c.v_cache.shape[0]] = c.v_cache.to(dev)
        q.copy_(c.q)
        bt.zero_()
        bt[:, :c.block_table.shape[1]] = c.block_table.to(dev)
        seq.copy_(c.seqused_k)

    kernel = TritonPagedAttention(TritonPagedAttention.request_for(q, k_cache, v_cache))
    limits = GraphLimits(mode=ForwardMode.DECODE, max_bs=bs, q_len=1, max_num_tokens=bs,
                         max_seq_len=width * 16)
    static = kernel.buffer_spec(limits).allocate(q.device)
    md = _adhoc_metadata(q, k_cache, cu, seq, bt, None, None, 1, width * 16, "paged_attention")
    plan = kernel.plan(md, out=static)
    assert plan.gluon is not None
    params = LayerParams.create(scale=cases[0].scale, device=q.device)
    load(cases[0])
    kernel.run(q, (k_cache, v_cache), plan, params, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.run(q, (k_cache, v_cache), plan, params, out)
    for c in cases:
        load(c)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_rel(out, c.expected(), RTOL[torch.bfloat16], f"replay bs={bs}")
    assert calls and (calls[0] > 1) == (bs == 1), calls


def _inspect_mla(const: dict, kernel: str = "--mla", dump=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(ROOT / "scripts" / "inspect_gluon_decode_sm90.py"),
           json.dumps(const), "--json", kernel, *(["--dump", str(dump)] if dump else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("const", [
    {},
    {"HP": 8, "PAGE": 48, "BOX": 16, "SPLITS": 3, "WRITE_LSE": True},
    {"PAGE": 16, "BOX": 16, "WRITE_LSE": True, "q": "fp16"},
    {"SPLITS": 4, "part": "bf16"},
    {"SPLITS": 2, "part": "bf16", "STAMPS": True, "PDL": True, "ONE_QUERY": True},
    {"SPLITS": 2, "part": "bf16", "PDL": True, "EARLY": True, "ONE_QUERY": True},
    {"HP": 8, "PAGE": 16, "BOX": 16, "PDL": True, "EARLY": True, "STAMPS": True},
], ids=["h16-p64", "h8-p48-splits-lse", "h16-p16-fp16", "h16-splits-bf16-partials",
        "timeline", "early-keys", "early-keys-verify-p16"])
def test_narrow_mla_compiles_for_sm90(const):
    """The narrow MLA kernel (``mla_narrow_gluon.py``): 12 warps within the SM's registers
    and the H200's shared memory (two 72 KB latent slots, q, P, the hand-over buffer); 68
    wgmma a consumer (36 for the scores, 32 for the 512 value columns). ptxas spills 8-16
    bytes of scalars at the default register split (the consumers' [512, 16] float32
    accumulators stay in registers): bounded here so that growth is seen."""
    r = _inspect_mla(const)
    assert r["stack"] <= 16, r
    assert r["shared"] <= H200_SMEM_OPTIN, r
    assert r["registers"] * r["warps"] * 32 <= 65536, r
    assert r["wgmma"] == 136, r


def _before_and_after_wait(ptx: str):
    """The parent region's PTX lines before and after its first ``griddepcontrol.wait``."""
    lines = ptx.splitlines()
    at = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    return lines[:at], lines[at + 1:]


@pytest.mark.parametrize("one_query", [True, False], ids=["decode", "verify"])
def test_narrow_mla_early_keys_read_only_indices_and_old_keys_before_the_wait(tmp_path,
                                                                             one_query):
    """``pdl="early"`` (``EARLY``): before ``griddepcontrol.wait`` the program reads only
    32-bit index words (lengths, ``cu_seqlens_q``, page ids) and issues TMA copies of keys
    (the first tiles older than the step's new keys), after an L2 prefetch of q; q itself
    (16-byte vector loads) comes after the wait, as do the remaining first tiles. Without
    ``EARLY`` the wait comes first."""
    const = {"SPLITS": 2, "PDL": True, "ONE_QUERY": one_query}
    _inspect_mla({**const, "EARLY": True}, dump=tmp_path / "early")
    before, after = _before_and_after_wait((tmp_path / "early" / "k.ptx").read_text())
    loads = [line for line in before if "ld.global" in line]
    assert loads and all("ld.global.b32" in line for line in loads), loads
    assert sum("cp.async.bulk.tensor" in line for line in before) >= 3, "no early tile"
    # q's L2 prefetch goes out ahead of the tiles (read after them, q queued behind them)
    first = [next(i for i, line in enumerate(before) if op in line)
             for op in ("prefetch.global.L2", "cp.async.bulk.tensor")]
    assert first[0] < first[1], first
    q_at = next(i for i, line in enumerate(after) if "ld.global.v4" in line)
    assert any("cp.async.bulk.tensor" in line for line in after[q_at:]), "no late tile"
    _inspect_mla(const, dump=tmp_path / "plain")
    before, _ = _before_and_after_wait((tmp_path / "plain" / "k.ptx").read_text())
    assert not [line for line in before if "ld.global" in line or "cp.async" in line]


class _Recorder:
    """A compiled kernel whose C launcher records the grid and the argument list (of the
    direct launches: a key's first launch only returns it)."""

    function = 0
    packed_metadata = ()

    def __init__(self):
        self.calls = []

    def run(self, gx, gy, gz, stream, fn, meta, launch_meta, enter, exit_, *args):
        self.calls.append(((gx, gy, gz), args))


def test_layer_launch_keys_and_argument_list(monkeypatch):
    """The layer launch of a planned step (``run_planned``, on the CPU with the launchers'
    direct path stubbed and the device check forced): its positional arguments plus the
    constexpr tail are exactly the kernel's parameters in order; calls that differ in what
    Triton specialises on get other keys (q's 16-byte alignment), calls that do not share
    one; with splits the LSE is the reduction's output only (its key changes, the
    kernel's does not); every layer call with splits launches the reduction."""
    from aiter_attn.kernels.base import LayerParams, _adhoc_metadata
    from aiter_attn.kernels.triton import attention as attn
    from aiter_attn.kernels.triton import decode_gluon as dg

    monkeypatch.setattr(attn.TritonPagedAttention, "_gluon_reason", lambda self, dev: None)
    monkeypatch.setattr(attn, "num_sms", lambda device: 132)
    kernel_rec, reduce_rec = _Recorder(), _Recorder()
    for launcher, rec in ((dg._GLUON_DECODE, kernel_rec), (dg._REDUCE, reduce_rec)):
        monkeypatch.setattr(launcher, "_cache", {})
        launcher.force_direct(rec)
    keys, rkeys = [], []
    real = dg.run_planned

    def spy(part, sid, descs, q, out, scale, lse=None):
        seen, rseen = set(dg._GLUON_DECODE._cache), set(dg._REDUCE._cache)
        real(part, sid, descs, q, out, scale, lse)
        keys.append((set(dg._GLUON_DECODE._cache) - seen) or None)
        rkeys.append((set(dg._REDUCE._cache) - rseen) or None)

    monkeypatch.setattr(attn, "run_planned", spy)
    case = Case([1, 1], [300, 77], hq=8, hkv=2, d=64, page=16, dtype=torch.float16,
                device="cpu")
    kernel = attn.TritonPagedAttention(attn.TritonPagedAttention.request_for(
        case.q, case.k_cache, case.v_cache))
    md = _adhoc_metadata(case.q, case.k_cache, case.cu, case.seqused_k, case.block_table,
                         None, None, 1, 300, "paged_attention")
    plan = kernel.plan(md)
    assert plan.gluon is not None and plan.gluon[0] == 2  # 132 SMs over 4 programs, 300 keys
    params = LayerParams.create(scale=case.scale, device=case.q.device)
    cache = (case.k_cache, case.v_cache)
    out = torch.empty(2, 8, 64, dtype=torch.float16)
    q_odd = torch.empty(case.q.numel() + 1, dtype=case.q.dtype)[1:].view_as(case.q)
    q_odd.copy_(case.q)
    lse = torch.empty(2, 8)
    for q, lse_t in ((case.q, None), (case.q, None), (q_odd, None), (case.q, lse)):
        kernel.run(q, cache, plan, params, out, lse=lse_t)
    assert keys[1] is None and rkeys[1] is None, "the same call made a new key"
    assert keys[0] and keys[2] and keys[0] != keys[2]  # q aligned / not
    assert keys[3] is None and rkeys[3]  # the LSE: the reduction's output
    names = [n for n, _, _ in dg._GLUON_DECODE._params()]
    for grid, args in kernel_rec.calls:
        assert grid == (2 * 2, 2, 1)
        assert len(args) == len(names)
        assert args[names.index("SPLITS")] == 2 and args[names.index("PAGE")] == 16
    # splits: every layer call reduces (a key's first launch compiles and is not recorded)
    assert len(reduce_rec.calls) + sum(k is not None for k in rkeys) == 4
    assert kernel_rec.calls and len(kernel_rec.calls) + sum(k is not None for k in keys) == 4
    rnames = [n for n, _, _ in dg._REDUCE._params()]
    assert all(len(a) == len(rnames) for _, a in reduce_rec.calls)


@pytest.mark.parametrize("const", [
    {"FUSED": True, "ONE_QUERY": True, "SPLITS": 2, "WRITE_LSE": True},
    {"FUSED": True, "ONE_QUERY": True, "SPLITS": 4, "part": "bf16"},
], ids=["fused-merge-one-query", "fused-merge-bf16-partials"])
def test_narrow_mla_fused_merge_compiles_for_sm90(const):
    """The narrow kernel merging its own splits: one acq_rel count per program, the same
    registers and shared memory as the two-launch form."""
    r = _inspect_mla(const)
    assert r["stack"] <= 16, r
    assert r["shared"] <= H200_SMEM_OPTIN, r


_MEMORY_OPS = re.compile(r"\b(LDG|STG|ATOMG|LDL|STL)(\.[A-Z0-9]+)*")


@pytest.mark.parametrize("const,vec", [
    ({"FUSED": True, "ONE_QUERY": True, "SPLITS": 2, "part": "bf16"}, "128"),
    ({"FUSED": True, "SPLITS": 3, "part": "fp32", "WRITE_LSE": True}, "128"),
    ({"FUSED": True, "SPLITS": 4, "HP": 8, "part": "fp16", "q": "fp16"}, "64"),
], ids=["bf16-partials-2", "fp32-partials-3-lse", "h8-fp16-partials-4"])
def test_narrow_fused_merge_reads_every_partial_before_its_first_store(tmp_path, const, vec):
    """The last split's merge (sm_90 SASS from ptxas, between the arrival count and the
    counter's reset): every read of the partials is issued before the first store to the
    output (a store between two chunks' reads kept each chunk's reads a whole L2 round trip
    behind the last: eight in a row), 16 bytes of a head's row per read (8 bytes at 8
    heads), and nothing spills to local memory."""
    r = _inspect_mla(const, dump=tmp_path)
    assert r["stack"] <= 16, r
    sass = (tmp_path / "k.sass").read_text()
    ops = [m.group(0) for m in _MEMORY_OPS.finditer(sass)]
    start = next(i for i, op in enumerate(ops) if op.startswith("ATOMG.E.ADD"))
    end = next(i for i, op in enumerate(ops) if op.startswith("ATOMG.E.EXCH"))
    merge = ops[start + 1:end]
    first_store = next(i for i, op in enumerate(merge) if op.startswith("STG"))
    reads, stores = merge[:first_store], merge[first_store:]
    splits = const["SPLITS"]
    chunk_reads = [op for op in reads if op.startswith(f"LDG.E.{vec}")]
    per_chunk = 2 if const["part"] == "fp32" else 1  # 8 float32 columns: two 16-byte reads
    assert len(chunk_reads) == 8 * splits * per_chunk, merge
    assert all(op.startswith("STG") for op in stores) and len(stores) in (8, 9), merge
    assert not any(op.startswith(("LDL", "STL")) for op in merge), merge


@pytest.mark.parametrize("const", [
    {},
    {"PAGE": 16, "BOX": 16, "SPLITS": 1, "WRITE_LSE": True, "q": "fp16"},
], ids=["p64-splits4", "p16-fp16-lse"])
def test_ring_mla_compiles_for_sm90(const):
    """The ring MLA kernel (``mla_ring_gluon.py``): two programs per SM, in registers (q in
    registers, eight [64, 16] accumulators: at most 256 a thread for 2 × 128 threads) and in
    shared memory (three 36 KB slots each: within half the SM's 228 KB with the 1 KB each
    program reserves); no spills. Its mma operands come out of the ring by ``ldmatrix``
    (39 for the scores, 18 transposed for the values): with 8-element operand packing
    (``k_width=8``) the scores' operands were 52 ``ld.shared.v4`` reads, which the sixteenth
    session's Nsight Compute found 2-way bank-conflicted, and 16 bytes spilled; the 16 left
    are the last tile's row zeroing."""
    r = _inspect_mla(const, "--ring")
    assert r["stack"] == 0, r
    assert r["ldmatrix"] >= 57 and r["ld.shared.v4"] <= 16, r
    assert 2 * (r["shared"] + 1024) <= 233472, r
    assert r["registers"] <= 256, r
