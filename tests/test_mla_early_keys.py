"""``pdl="early"`` for the narrow Gluon MLA kernel (sm_90): the attention launch starts
while the kernel before it still runs, reads its indices and issues its first tiles of keys
older than the step's new ones before ``griddepcontrol.wait``, and reads q and the new keys
after it (``aiter_attn/kernels/triton/_pdl.py``'s contract).

GPU only (the kernel is Gluon; the CPU checks are the PTX order in
``tests/test_gluon_decode.py`` and the plan wiring in ``tests/test_mla_narrow_default.py``).
The kernel before is a one-program Triton kernel that lets its dependents start at once,
spins 2 ms, then writes what the contract lets it write: q and the step's new key rows,
NaN until then. The rows must match the oracle of the written values (q and the new keys
were read after the wait). In the same window it also rewrites one older key, which the
contract forbids: the kernel must miss that write (proof that the early reads happen
before the wait; otherwise the test of the allowed writes could not fail).
"""

from __future__ import annotations

import copy

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import HAS_CUDA, requires_triton, spy_launches
from .test_triton_mla import MLACase, _kernel

pytestmark = [requires_triton, pytest.mark.gpu,
              pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

_DIM = 576
#: longer than the host's plan and launch of the attention call that follows
_SPIN_NS = 2_000_000

if HAS_CUDA:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                         dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _spin_then_write(q_src, q_dst, q_numel, rows_src, slots, kv_rows, n_rows, spin_ns,
                         BLOCK: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        """Let the next launch start, spin ``spin_ns``, then copy q and the rows
        ``rows_src[r]`` into cache slot rows ``slots[r]`` of ``kv_rows`` ``[slots, D]``."""
        gdc_launch_dependents()
        t0 = _now()
        now = t0
        while now - t0 < spin_ns:
            now = _now()
        offs = tl.arange(0, BLOCK)
        for i in range(0, q_numel, BLOCK):
            m = i + offs < q_numel
            tl.store(q_dst + i + offs, tl.load(q_src + i + offs, mask=m), mask=m)
        d = tl.arange(0, DP)
        for r in range(n_rows):
            slot = tl.load(slots + r).to(tl.int64)
            m = d < D
            tl.store(kv_rows + slot * D + d, tl.load(rows_src + r * D + d, mask=m), mask=m)


def _rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()


def _slot(case: MLACase, b: int, pos: int) -> int:
    page = case.kv_cache.shape[1]
    return int(case.block_table[b, pos // page]) * page + pos % page


def _sm90():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the narrow Gluon MLA kernel is sm_90 only")


@pytest.mark.parametrize("q_lens,kv_lens,page,heads,graphed", [
    pytest.param([1] * 4, [100, 4000, 64, 130], 64, 16, False, id="decode-p64"),
    pytest.param([3, 2, 1], [1500, 130, 3], 16, 16, False, id="verify-p16"),
    pytest.param([1] * 3, [777, 2048, 65], 48, 5, False, id="decode-p48-h5"),
    pytest.param([1] * 4, [100, 4000, 64, 130], 64, 16, True, id="decode-p64-graph"),
])
def test_gpu_early_keys_wait_for_q_and_the_new_keys(q_lens, kv_lens, page, heads, graphed,
                                                    monkeypatch):
    """Eagerly, and (``graphed``) both launches captured in one CUDA graph and replayed."""
    from aiter_attn.kernels.triton import mla_narrow_gluon as mn

    _sm90()
    calls = spy_launches(monkeypatch, mn._NARROW)
    case = MLACase(q_lens, kv_lens, rank=512, rope=64, page=page, heads=heads,
                   dtype=torch.bfloat16, device="cuda", seed=7)
    kv = case.kv_cache.cuda()
    rows = kv.view(-1, _DIM)
    new = [_slot(case, b, pos) for b, (n, L) in enumerate(zip(q_lens, kv_lens))
           for pos in range(L - n, L)]
    # the forbidden write: key 0 of the longest request (its first split's first tile);
    # until then it holds a key every query of that request would attend to alone
    long_b = max(range(len(kv_lens)), key=lambda b: kv_lens[b])
    old = _slot(case, long_b, 0)
    t0 = sum(q_lens[:long_b])
    q_long = case.q[t0:t0 + q_lens[long_b]].float().sum(0).sum(0)  # [576]
    slots = torch.tensor(new + [old], dtype=torch.int32, device="cuda")
    rows_src = rows[slots.long()].clone()  # the values the oracle sees
    rows[torch.tensor(new, device="cuda").long()] = float("nan")
    rows[old] = (torch.sign(q_long) * 8).to(rows.dtype).cuda()
    q_src = case.q.cuda()
    q = torch.full_like(q_src, float("nan"))
    out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    kw = case.kwargs()
    # compile both kernels first: a compile between the two launches would end the window
    for _ in range(2):
        _spin_then_write[(1,)](q_src, q.clone(), q.numel(), rows_src, slots[:0], kv.clone(),
                               0, 0, BLOCK=1024, D=_DIM, DP=1024)
        _kernel()(q_src, kv.clone(), out.clone(), **kw, narrow=True, pdl="early")
    torch.cuda.synchronize()
    expected = case.expected()  # every key as written, the older one included
    missed = copy.copy(case)  # the older key's write missed: it still holds its old value
    missed.dense = list(case.dense)
    missed.dense[long_b] = case.dense[long_b].clone()
    missed.dense[long_b][0, 0] = rows[old].float().cpu()
    expected_missed = missed.expected()
    long_rows = list(range(t0, t0 + q_lens[long_b]))
    others = [t for t in range(q.shape[0]) if t not in long_rows]
    stale = {"q": q.clone(), "kv": kv.clone()}
    def step():
        _spin_then_write[(1,)](q_src, q, q.numel(), rows_src, slots, kv, len(new) + 1,
                               _SPIN_NS, BLOCK=1024, D=_DIM, DP=1024)
        _kernel()(q, kv, out, **kw, narrow=True, pdl="early")

    graph = None
    if graphed:
        step()  # the spinner's specialisation compiled outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    errs = []
    for _ in range(3):  # another process's kernels may time-slice the window away
        q.copy_(stale["q"])
        kv.copy_(stale["kv"])
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        n = len(calls)
        graph.replay() if graphed else step()
        torch.cuda.synchronize()
        assert len(calls) == n + (not graphed), "the narrow kernel did not serve the launch"
        # every attempt: q and the new keys as written (read after the wait)
        assert torch.equal(q, q_src) and not out.isnan().any()
        assert_close_rel(out[others], expected[others], 1.5e-2, "early keys, other requests")
        seen, miss = (_rel(out[long_rows], e[long_rows]) for e in (expected, expected_missed))
        errs.append((seen, miss))
        # the request with the forbidden write: its new keys as written either way
        assert min(seen, miss) < 1.5e-2, errs
        if miss < 1.5e-2 and seen > 0.5:
            break
    # at least once: the forbidden write to the older key missed (read before the wait)
    assert miss < 1.5e-2 and seen > 0.5, (
        "the forbidden write to an older key was seen in every attempt: the first tiles "
        f"were not read before the wait (relative errors against seen / missed: {errs})")


def test_gpu_early_keys_graph_replay_matches_eager(monkeypatch):
    """Captured with ``pdl="early"`` behind a cache write (a copy kernel that signals
    nothing, so the first launch waits for its end), then two more steps back to back
    (each merge lets the next step's launch start before it waits: that launch writes its
    partials, whose memory the capture may reuse, only after its own wait), lengths
    changed in place,
    replayed: each step's rows equal a fresh eager call of the launch without PDL."""
    _sm90()
    case = MLACase([1] * 8, [300 + 500 * i for i in range(8)], rank=512, rope=64, page=64,
                   heads=16, dtype=torch.bfloat16, device="cuda", seed=11)
    q, kv = case.q.cuda(), case.kv_cache.cuda()
    qs = [q, torch.randn_like(q), torch.randn_like(q)]
    staged = kv.clone()
    kw = case.kwargs()
    outs = [torch.empty(8, 16, 512, dtype=torch.bfloat16, device="cuda") for _ in qs]
    fn = _kernel()
    fn(q, kv, outs[0], **kw, max_seqlen_k=4096, narrow=True, pdl="early")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv.copy_(staged)
        for qi, o in zip(qs, outs):
            fn(qi, kv, o, **kw, max_seqlen_k=4096, narrow=True, pdl="early")
    kw["seqused_k"].copy_(torch.tensor([5, 64, 129, 3000, 4000, 1, 700, 2222],
                                       device="cuda"))
    for qi in qs:
        qi.copy_(torch.randn_like(qi))
    staged.copy_(torch.randn_like(staged))
    for _ in range(3):
        graph.replay()
    for qi, o in zip(qs, outs):
        eager = torch.empty_like(o)
        fn(qi, kv, eager, **kw, max_seqlen_k=4096, narrow=True, pdl=False)
        assert torch.equal(o, eager)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_gpu_default_launch_after_our_kv_write(graphed):
    """An engine's decode step: our K/V write of each request's new latent (``write_kv``,
    which lets the next launch start at once on sm_90) right before the default 16-head
    launch (``pdl="early"``), eagerly and replayed after new latents were staged: the rows
    match the oracle of the cache with the new latents (the launch read them after the
    write)."""
    from aiter_attn.kernels.triton.kv_write import write_kv

    _sm90()
    q_lens, kv_lens, page = [1] * 6, [64, 129, 4000, 1, 700, 2222], 64
    case = MLACase(q_lens, kv_lens, rank=512, rope=64, page=page, heads=16,
                   dtype=torch.bfloat16, device="cuda", seed=5)
    kv, q = case.kv_cache.cuda(), case.q.cuda()
    slots = torch.tensor([_slot(case, b, L - 1) for b, L in enumerate(kv_lens)],
                         dtype=torch.int64, device="cuda")
    g = torch.Generator().manual_seed(6)
    fresh = [torch.randn(len(kv_lens), 1, _DIM, generator=g).to(torch.bfloat16)
             for _ in range(2)]
    latents = fresh[0].cuda()
    kv.view(-1, _DIM)[slots] = float("nan")  # what the write replaces
    out = torch.full((len(q_lens), 16, 512), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    kw = case.kwargs()

    def step():
        write_kv(kv, None, slots, latents, None)
        _kernel()(q, kv, out, **kw)

    step()  # compiled, and the eager result
    torch.cuda.synchronize()
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        latents.copy_(fresh[1].cuda())
        kv.view(-1, _DIM)[slots] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
    for b, L in enumerate(kv_lens):
        case.dense[b][L - 1] = (fresh[1] if graphed else fresh[0])[b].float()
    assert not out.isnan().any()
    what = "graph" if graphed else "eager"
    assert_close_rel(out, case.expected(), 1.5e-2, f"after our K/V write ({what})")
