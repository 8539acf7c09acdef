"""Batch-invariant mode: a request's attention output (and LSE) is bitwise identical alone and
inside batches of other sizes and compositions (short and long neighbours, prefill chunks next
to decode rows, with and without the host hints), on the reference and on the Triton kernels
(interpreter on the CPU, compiled under the ``gpu`` marker, graph replay included), and still
matches the float64 oracle.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops
from aiter_attn.kernels.batch_invariant import BatchInvariantKernels
from aiter_attn.kernels.registry import Capabilities, KernelRegistry, KernelRequest
from aiter_attn.kernels.triton import paged_attention as pa_mod
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.types import CGSupport

from ._triton_util import DEVICE, requires_triton
from .test_lse import _mla_oracle, _oracle
from .test_triton_mla import MLACase
from .test_triton_paged_attention import Case

pytestmark = requires_triton

BACKENDS = ["reference", "triton"]


def _sub(case: Case, rows, dev):
    """The tensors of a batch made of ``rows`` of ``case`` (same pool, same pages)."""
    q_lens = [case.q_lens[r] for r in rows]
    starts = case.cu.tolist()
    q = torch.cat([case.q[starts[r]:starts[r + 1]] for r in rows])
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q.to(dev), cu.to(dev), case.seqused_k[rows].to(dev),
            case.block_table[rows].to(dev), q_lens)


def _attend(case: Case, rows, backend, *, hints=True, **kw):
    dev = case.device
    q, cu, seq, bt, q_lens = _sub(case, rows, dev)
    extra = {}
    if hints:
        extra = dict(max_seqlen_q=max(q_lens), max_seqlen_k=int(seq.max()))
    if kw.get("sinks") is not None:
        kw["sinks"] = kw["sinks"].to(dev)
    out, lse = ops.paged_attention(
        q, case.k_cache.to(dev), case.v_cache.to(dev), cu_seqlens_q=cu, seqused_k=seq,
        block_table=bt, softmax_scale=case.scale, k_scale=case._scale(case.k_scale),
        v_scale=case._scale(case.v_scale), backend=backend, return_lse=True,
        batch_invariant=True, **extra, **kw)
    # the rows of the first request of the batch (the one under test)
    return out[: q_lens[0]].cpu(), lse[: q_lens[0]].cpu()


def _batches(target, n):
    """Batches holding ``target`` first, with different neighbours and sizes."""
    others = [r for r in range(n) if r != target]
    return [[target], [target] + others[:1], [target] + others[::-1]]


CASES = [
    # id, q_lens, kv_lens, hq, hkv, d, page, dtype, sinks+softcap+window
    pytest.param([1, 1, 9, 1, 20], [150, 3, 9, 300, 30], 8, 2, 64, 16, torch.float32, False,
                 id="decode-among-long-and-prefill"),
    pytest.param([12, 1, 1, 20], [130, 33, 300, 20], 10, 2, 80, 48, torch.float16, True,
                 id="extend-GQA5:1-D80-page48-fp16-sinks-softcap-window"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page,dtype,features", CASES)
def test_same_bits_in_any_batch(monkeypatch, backend, q_lens, kv_lens, hq, hkv, d, page,
                                dtype, features):
    # small splits so that the interpreter's short contexts span several of them
    monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "split_tokens", 96)
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, seed=d + page)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(3))
    for kw in [dict(sinks=sinks, softcap=5.0, window_size=(100, 0)) if features else {}]:
        base_o, base_l = _attend(case, [0], backend, **kw)
        eo, el = _oracle(case, **kw)
        rtol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
        assert_close_rel(base_o, eo[: q_lens[0]], rtol, f"{backend} batch-invariant vs oracle")
        for i, rows in enumerate(_batches(0, len(q_lens))):
            for hints in (True, False) if i == 2 else (True,):  # static bounds: more splits
                o, lse = _attend(case, rows, backend, hints=hints, **kw)
                assert torch.equal(o, base_o), (backend, rows, hints, kw.keys())
                assert torch.equal(lse, base_l), (backend, rows, hints, kw.keys())


def test_splits_are_fixed_key_counts():
    """The launch config: tiles do not depend on the batch, the split count only on max_k."""
    from aiter_attn.kernels.triton._launch_config import choose_config

    dev = torch.device("cpu")
    cfgs = [choose_config(group=4, max_q=mq, max_k=mk, head_dim_pad=128, batch=b,
                          num_kv_heads=8, device=dev, batch_invariant=True)
            for mq, mk, b in ((1, 4096, 1), (1, 4096, 256), (2048, 4096, 4), (1, 100, 64))]
    shapes = {(c.block_m, c.block_n, c.heads, c.block_q, c.num_warps, c.num_stages,
               c.split_tiles, c.page_chunk) for c in cfgs}
    assert len(shapes) == 1
    per_split = cfgs[0].split_tiles * cfgs[0].block_n
    assert [c.num_splits for c in cfgs] == [-(-4096 // per_split)] * 3 + [1]
    assert all(c.batch_invariant for c in cfgs)


MLA_CASES = [
    pytest.param(dict(q_lens=[1, 1, 3, 1], kv_lens=[100, 9, 40, 200], page=16), id="decode"),
    pytest.param(dict(q_lens=[2, 1, 1], kv_lens=[77, 150, 5], page=48, heads=20),
                 id="verify-H20-p48"),
]


@pytest.mark.parametrize("case_kw", MLA_CASES)
def test_mla_same_bits_in_any_batch(monkeypatch, case_kw):
    from aiter_attn.kernels.triton import mla as mla_mod

    monkeypatch.setattr(mla_mod, "BATCH_INVARIANT_SPLIT_TOKENS", 32)
    case = MLACase(**case_kw, seed=5)
    eo, _ = _mla_oracle(case)
    n = len(case.q_lens)
    for backend in BACKENDS:
        base = None
        for i, rows in enumerate(_batches(0, n)):
            sub = _mla_sub(case, rows)
            for hints in (True, False) if i == 2 else (True,):
                extra = dict(max_seqlen_k=int(sub["seqused_k"].max())) if hints else {}
                out = ops.mla_paged_attention(
                    sub["q"], case.kv_cache.to(DEVICE), kv_lora_rank=case.rank,
                    cu_seqlens_q=sub["cu"], seqused_k=sub["seqused_k"],
                    block_table=sub["block_table"], softmax_scale=case.softmax_scale,
                    backend=backend, batch_invariant=True, **extra)[: case.q_lens[0]].cpu()
                if base is None:
                    base = out
                    assert_close_rel(out, eo[: case.q_lens[0]], 1e-5, f"mla {backend}")
                assert torch.equal(out, base), (backend, rows, hints)


def _mla_sub(case: MLACase, rows):
    starts = case.cu.tolist()
    q_lens = [case.q_lens[r] for r in rows]
    return dict(
        q=torch.cat([case.q[starts[r]:starts[r + 1]] for r in rows]).to(DEVICE),
        cu=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(),
                        dtype=torch.int32).to(DEVICE),
        seqused_k=case.seqused[rows].to(DEVICE), block_table=case.block_table[rows].to(DEVICE))


def test_selection_view_binds_flag_and_rejects_undeclared_kernels():
    NEVER = CGSupport.NEVER
    calls = []

    def fn(name):
        return lambda *a, **k: calls.append((name, k.get("batch_invariant")))

    reg = KernelRegistry()
    reg.register("paged_attention", "fast", fn("fast"), Capabilities(cg_support=NEVER), priority=10)
    reg.register("paged_attention", "steady", fn("steady"),
                 Capabilities(features={"batch_invariant"}, cg_support=NEVER), priority=0)
    reg.register("mla_paged_attention", "mla", fn("mla"),
                 Capabilities(features={"batch_invariant"}, cg_support=NEVER))
    reg.register("write_kv", "w", fn("w"), Capabilities(cg_support=NEVER))
    view = BatchInvariantKernels(reg)
    req = KernelRequest(op="paged_attention")
    sel = view.select(req)
    assert sel.impl.name == "steady"
    assert "missing features ['batch_invariant']" in dict(sel.rejected)["fast"]
    kernel = sel.bind(req)  # bound to the request with the feature: passes the flag on
    assert "batch_invariant" in kernel.request.features
    kernel(None, None, None, None)
    assert calls[-1] == ("steady", True)
    assert view.bound("k", lambda: req).request.features == {"batch_invariant"}
    view.select(KernelRequest(op="mla_paged_attention")).fn(1)  # plain function: flag bound
    assert calls[-1] == ("mla", True)
    view.select(KernelRequest(op="write_kv")).fn(1)  # other ops: unchanged
    assert calls[-1] == ("w", None)
    assert view.ops() == reg.ops()
    # the default registry: the plain bound kernel passes nothing
    reg.select(req).bind(req)(None, None, None, None)
    assert calls[-1] == ("fast", None)


def test_backend_config_threads_the_mode():
    from aiter_attn.backend import AttentionBackend
    from aiter_attn.types import BackendConfig

    cfg = BackendConfig(batch_invariant=True)
    rt = torch.zeros(2, cfg.max_context_len, dtype=torch.int32)
    be = AttentionBackend(cfg, rt, kv_pool=None)
    assert isinstance(be.ctx.kernels, BatchInvariantKernels)
    assert not isinstance(AttentionBackend(BackendConfig(), rt, kv_pool=None).ctx.kernels,
                          BatchInvariantKernels)


def test_generate_deterministic_cli(capsys):
    """``aiter-attn generate --deterministic`` runs the engine with batch-invariant attention
    and still matches transformers (--check)."""
    import json

    from aiter_attn.cli import main

    rc = main(["generate", "--no-progress", "--json", "--deterministic", "--random-config",
               "llama", "--check", "--prompt", "hi", "--prompt", "a longer prompt to batch",
               "--max-new-tokens", "4", "--page-size", "3", "--max-tokens-per-step", "16"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["deterministic"] is True and out["check"]["passed"]


def test_split_structure_changes_bits_in_default_mode(monkeypatch):
    """The check above is sensitive: in the default mode the split count (which on a GPU
    follows the batch size and the longest request) changes a long row's bits; the
    batch-invariant mode's fixed splits do not move with it."""
    case = Case([1, 1], [300, 20], hq=8, hkv=2, d=64, page=16, dtype=torch.float32, seed=2)
    outs = {}
    for splits in (2, 5):
        monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "num_splits", splits)
        q, cu, seq, bt, _ = _sub(case, [0, 1], case.device)
        outs[splits] = ops.paged_attention(
            q, case.k_cache.to(case.device), case.v_cache.to(case.device), cu_seqlens_q=cu,
            seqused_k=seq, block_table=bt, softmax_scale=case.scale, backend="triton")[:1]
    assert not torch.equal(outs[2], outs[5])
    monkeypatch.delitem(pa_mod.TUNING_OVERRIDES, "num_splits")
    monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "split_tokens", 96)
    a, _ = _attend(case, [0], "triton")
    b, _ = _attend(case, [0, 1], "triton", hints=False)  # static bound: more splits launched
    assert torch.equal(a, b)


def _gpu_case(dtype):
    # decode rows of 4k / 1k / 300 keys and a 64-token prefill chunk; GQA 32:8, d128, page 16
    return Case([1, 1, 1, 64], [4000, 1000, 300, 2000], hq=32, hkv=8, d=128, page=16,
                dtype=dtype, device="cuda", seed=21)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_same_bits_eager_batches_and_graph_replay(dtype):
    """Compiled: the first request alone, in batches of 2 / 4 / 64 rows (the default mode's
    split heuristics would change with each), and replayed from a CUDA graph captured for a
    64-row padded batch with static bounds: bitwise the same output and LSE."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    case = _gpu_case(dtype)
    sinks = torch.randn(32, generator=torch.Generator().manual_seed(1))
    kw = dict(sinks=sinks, window_size=(2047, 0))
    base_o, base_l = _attend(case, [0], "triton", **kw)
    eo, _ = _oracle(case, **kw)
    assert_close_rel(base_o, eo[:1], 1.2e-2 if dtype == torch.bfloat16 else 2e-3, "vs oracle")
    for rows in ([0, 1], [0, 3, 1, 2], [0] + [1, 2] * 31 + [3], [0, 2]):
        for hints in (True, False):
            o, lse = _attend(case, rows, "triton", hints=hints, **kw)
            assert torch.equal(o, base_o) and torch.equal(lse, base_l), (rows, hints)

    # graph: capture a 64-request decode batch (static buffers, static bounds), replay with
    # request 0 in row 0 and other requests (and padding rows on the null page) around it
    dev = "cuda"
    bs, width = 64, case.block_table.shape[1]
    q = torch.zeros(bs, 32, 128, dtype=dtype, device=dev)
    cu = torch.arange(bs + 1, dtype=torch.int32, device=dev)
    seq = torch.ones(bs, dtype=torch.int32, device=dev)
    bt = torch.zeros(bs, width, dtype=torch.int32, device=dev)
    out = torch.empty(bs, 32, 128, dtype=dtype, device=dev)
    lse = torch.empty(bs, 32, dtype=torch.float32, device=dev)
    k, v, s = case.k_cache.to(dev), case.v_cache.to(dev), sinks.to(dev)

    def call():
        ops.paged_attention(q, k, v, cu_seqlens_q=cu, seqused_k=seq, block_table=bt,
                            softmax_scale=case.scale, sinks=s, window_size=(2047, 0),
                            max_seqlen_q=1, max_seqlen_k=width * 16, out=out, out_lse=lse,
                            backend="triton", batch_invariant=True)

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for rows in ([0], [0, 1, 2], [0, 2, 1, 1, 2]):
        seq.fill_(1)
        bt.zero_()
        q.zero_()
        for i, r in enumerate(rows):
            q[i] = case.q[int(case.cu[r + 1]) - 1].to(dev)  # each request's last token
            seq[i] = int(case.seqused_k[r])
            bt[i] = case.block_table[r].to(dev)
        graph.replay()
        torch.cuda.synchronize()
        # request 0 is a decode row: its one token is row 0
        assert torch.equal(out[:1].cpu(), base_o) and torch.equal(lse[:1].cpu(), base_l), rows


@pytest.mark.gpu
def test_gpu_mla_same_bits_in_any_batch():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    case = MLACase([1, 1, 1, 2], [3000, 100, 900, 500], rank=512, rope=64, page=64,
                   dtype=torch.bfloat16, device="cuda", seed=3)
    base = None
    for rows in ([0], [0, 1], [0, 3, 2, 1], [0] + [1, 2] * 40):
        sub = _mla_sub(case, rows)
        for hints in (True, False):
            extra = dict(max_seqlen_k=int(sub["seqused_k"].max())) if hints else {}
            out = ops.mla_paged_attention(
                sub["q"], case.kv_cache.cuda(), kv_lora_rank=case.rank,
                cu_seqlens_q=sub["cu"], seqused_k=sub["seqused_k"],
                block_table=sub["block_table"], softmax_scale=case.softmax_scale,
                backend="triton", batch_invariant=True, **extra)[:1].cpu()
            base = out if base is None else base
            assert torch.equal(out, base), (rows, hints)


@pytest.mark.parametrize("arch", ["mha", "swa"])
def test_backend_decode_same_bits_in_any_batch(monkeypatch, arch):
    """Through ``AttentionBackend(BackendConfig(batch_invariant=True, kernel_backend="triton"))``
    (strategies bind the kernel to the invariant request): a decode request's per-layer
    attention output is bitwise the same alone and among other requests."""
    import attrs

    from aiter_attn import AttentionBackend, ForwardBatch, ForwardMode

    from ._graph_helpers import Rig

    monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "split_tokens", 64)
    rig = Rig.make(arch, page_size=16, hq=10, hkv=2, head_dim=16, max_context_len=320,
                   max_bs=4, device=DEVICE)
    cfg = attrs.evolve(rig.config, batch_invariant=True, kernel_backend="triton")
    be = AttentionBackend(cfg, rig.req_pool, rig.kv_pool, extra=rig.backend.ctx.extra)
    rows = [rig.join(n) for n in (150, 300, 9, 70)]
    locs = {r: rig.alloc.extend(rig.req_pool, r, 1) for r in rows}
    seq = {r: rig.alloc.tokens_held(r) for r in rows}
    g = torch.Generator().manual_seed(0)
    qkv = {r: [torch.randn(1, 10 * 16, generator=g), torch.randn(1, 2 * 16, generator=g),
               torch.randn(1, 2 * 16, generator=g)] for r in rows}
    target = rows[0]
    base = None
    for sub in ([target], [target, rows[2]], [target] + rows[1:][::-1]):
        batch = ForwardBatch.from_lengths(
            forward_mode=ForwardMode.DECODE, req_pool_indices=sub, seq_lens=[seq[r] for r in sub],
            out_cache_loc=torch.cat([locs[r] for r in sub]), extend_seq_lens=[1] * len(sub),
            device=DEVICE)
        be.init_forward_metadata(batch)
        outs = []
        for layer in rig.layers:
            q, k, v = (torch.cat([qkv[r][i] for r in sub]).to(DEVICE) for i in range(3))
            outs.append(be.forward(q, k, v, layer, batch)[:1].cpu())
        if base is None:
            base = outs
        for o, b in zip(outs, base):
            assert torch.equal(o, b), sub
    _, execution = be.strategies_for(ForwardMode.DECODE)
    kernels = [g.kernel for g in execution.groups.values()]
    assert kernels and all(k.name == "triton" and k.batch_invariant for k in kernels)
