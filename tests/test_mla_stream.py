"""The persistent stream MLA kernel (:mod:`aiter_attn.kernels.triton.mla_stream_gluon`,
``tuning["stream"]``): one program per SM over shares of the batch's 16-key units that cross
requests, partials merged by the balanced launch's merge. Gluon: its rows run on sm_90 only
(``gpu``), against the float64 oracle (relative error) over block-permuted tables with a
null page 0; on the CPU, its reject reasons and the option's checks."""

from __future__ import annotations

import copy

import pytest
import torch

from ._triton_util import requires_triton
from .test_hunt_mla_balanced import _check
from .test_triton_mla import MLACase

pytestmark = requires_triton


def _serving(monkeypatch):
    """``stream_mla_reject_reason`` with the narrow kernel's checks passing (the CPU has no
    sm_90), so the stream kernel's own reasons show."""
    from aiter_attn.kernels.triton import mla_stream_gluon as ms

    monkeypatch.setattr(ms, "narrow_mla_reject_reason", lambda **kw: None)
    return ms


BASE = dict(heads=16, rank=512, rope=64, dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
            page_size=64, device=torch.device("cpu"), masked=False, batch_invariant=False,
            one_query=True, batch=64)


@pytest.mark.parametrize("change,reason", [
    ({"one_query": False}, "more than one query per request (the stream kernel serves decode)"),
    ({"page_size": 40}, "page size 40 (a multiple of 16)"),
    ({"batch": 4097}, "4097 requests (at most 4096)"),
])
def test_stream_declines_with_a_reason(monkeypatch, change, reason):
    ms = _serving(monkeypatch)
    assert ms.stream_mla_reject_reason(**BASE) is None
    assert ms.stream_mla_reject_reason(**{**BASE, **change}) == reason


def test_stream_declines_where_the_narrow_kernel_does():
    from aiter_attn.kernels.triton.mla_stream_gluon import stream_mla_reject_reason

    from aiter_attn.kernels.triton.mla_narrow_gluon import narrow_mla_reject_reason

    kw = {k: v for k, v in BASE.items() if k not in ("one_query", "batch")}
    why = stream_mla_reject_reason(**BASE)  # the CPU: no sm_90
    assert why is not None and why == narrow_mla_reject_reason(**kw)


@pytest.mark.parametrize("tuning,match", [
    ({"stream": "yes"}, "stream='yes'; allowed: False, True"),
    ({"stream": 0}, "stream=0; allowed: False, True"),
    ({"balanced_rates": (1.0,) * 4}, "set balanced=True .* or stream=True"),
])
def test_stream_option_checked(tuning, match):
    from aiter_attn.kernels.triton.mla import TritonMLA

    with pytest.raises(ValueError, match=match):
        TritonMLA(None, tuning)


def test_stream_takes_rates():
    from aiter_attn.kernels.triton.mla import TritonMLA

    k = TritonMLA(None, {"stream": True, "balanced_rates": [1, 2.5]})
    assert k.tuning["balanced_rates"] == (1.0, 2.5)


def test_stream_q_reason():
    """The loader reads q by TMA as rows ``[T·H, 576]``: a contiguous q passes; heads of a
    wider buffer (tokens not ``H`` rows apart), or rows off 16 bytes, are named."""
    from aiter_attn.kernels.triton.mla_stream_gluon import stream_q_reason

    q = torch.randn(4, 16, 576, dtype=torch.bfloat16)
    assert stream_q_reason(q) is None
    wide = torch.randn(4, 20, 576, dtype=torch.bfloat16)[:, :16]
    assert stream_q_reason(wide) == "q is not rows [T·H, 576] of 16-byte aligned heads"
    odd = torch.randn(4, 16, 580, dtype=torch.bfloat16)[:, :, 1:577]
    assert stream_q_reason(odd) == "q is not rows [T·H, 576] of 16-byte aligned heads"


def test_stream_off_the_gpu_keeps_the_split_launch():
    """On the CPU the stream kernel does not serve: ``stream=True`` gives the oracle's rows
    through the Triton launch (interpreter)."""
    case = MLACase([1, 1, 1], [40, 130, 7], heads=4, rank=64, rope=16, page=16, seed=3)
    case.assert_rows_and_lse("stream off the gpu", stream=True)


# ------------------------------------------------------------------------------ on sm_90

def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from aiter_attn.kernels.triton.mla_stream_gluon import stream_mla_reject_reason

    why = stream_mla_reject_reason(**{**BASE, "device": torch.device("cuda")})
    if why is not None:
        pytest.skip(f"the stream kernel does not serve here: {why}")


@pytest.fixture
def spy(monkeypatch):
    """Counts the stream kernel's launches (a test whose step fell back cannot pass)."""
    from aiter_attn.kernels.triton import mla as triton_mla

    calls = []
    real = triton_mla.launch_stream_mla

    def wrapped(*a, **kw):
        calls.append(kw.get("claim") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(triton_mla, "launch_stream_mla", wrapped)
    return calls


def _on_gpu(case):
    g = copy.copy(case)
    g.q, g.kv_cache = case.q.cuda(), case.kv_cache.cuda()
    return g


def _run_object(case, tuning, lse=True, graph_replays=0, relens=None, index_dtype=None):
    """``TritonMLA`` with ``tuning``: plan once, run (eager), then ``graph_replays`` replays
    of a captured run, each against the oracle; ``relens``: lengths written into the
    plan's ``seqused_k`` before the replays (the device-side partition follows them);
    ``index_dtype``: ``seqused_k`` and the block table in that dtype."""
    from .test_hunt_mla_balanced import _kernel_obj, _md, _params

    g = _on_gpu(case)
    kernel = _kernel_obj(g, tuning, lse=lse)
    kw = g.kwargs()
    md = (_md(g) if index_dtype is None else
          _md(g, seqused=kw["seqused_k"].to(index_dtype),
              block_table=kw["block_table"].to(index_dtype)))
    plan = kernel.plan(md)
    n = len(case.kv_lens)
    out = torch.full((n, case.heads, case.rank), float("nan"), dtype=case.dtype,
                     device="cuda")
    lse_t = torch.full((n, case.heads), float("nan"), device="cuda") if lse else None
    params = _params(g)
    kernel.run(g.q, (g.kv_cache,), plan, params, out, lse=lse_t)
    torch.cuda.synchronize()
    _check(case, out, lse_t, "eager")
    if graph_replays:
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            kernel.run(g.q, (g.kv_cache,), plan, params, out, lse=lse_t)
        if relens is not None:  # fewer keys per request: the same pages, a shorter view
            plan.args[1].copy_(torch.tensor(relens, dtype=plan.args[1].dtype))
            case = copy.copy(case)
            case.kv_lens = list(relens)
            case.dense = [d[:L] for d, L in zip(case.dense, relens)]
        for rep in range(graph_replays):
            out.fill_(float("nan"))
            if lse_t is not None:
                lse_t.fill_(float("nan"))
            gr.replay()
            torch.cuda.synchronize()
            _check(case, out, lse_t, f"replay {rep}")
    return kernel, plan


MIXED = [4096, 77, 1, 2000, 0, 3000, 64, 513] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,page", [(16, 64), (5, 16), (8, 48)])
def test_gpu_stream_rows_and_lse(dtype, heads, page, spy):
    """Mixed lengths (empty, one key, a tile exactly, 4k) over pages of 64, 16 and 48
    rows, 16 / 5 / 8 heads: rows and LSEs against the oracle."""
    _gpu()
    case = MLACase([1] * len(MIXED), MIXED, heads=heads, rank=512, rope=64, page=page,
                   dtype=dtype, device="cuda", seed=31)
    _run_object(case, {"stream": True})
    assert spy == [False]


@pytest.mark.gpu
def test_gpu_stream_without_lse_and_functional(spy):
    """No LSE asked (the rows alone), and ``mla_paged_attention(stream=True)``."""
    _gpu()
    case = MLACase([1] * 6, [4096, 1000, 64, 5, 129, 2049], heads=16, rank=512, rope=64,
                   page=64, dtype=torch.bfloat16, device="cuda", seed=7)
    _run_object(case, {"stream": True}, lse=False)
    case.assert_rows_and_lse("functional", stream=True, max_seqlen_q=1)
    assert spy == [False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [
    [32768],  # one request over every program: a merge of ~132 parts
    [5, 17, 1, 40, 33, 16, 64, 2] * 64,  # 512 short requests: many segments a program
    [1] * 3 + [0] * 5,  # fewer units than programs: empty slots
    [17, 1, 33, 0],  # empty slots inside a request's units: partials of weight 0
], ids=["one-long", "many-short", "tiny", "empty-inside"])
def test_gpu_stream_partitions(lens, spy):
    _gpu()
    case = MLACase([1] * len(lens), lens, heads=16, rank=512, rope=64, page=16,
                   dtype=torch.bfloat16, device="cuda", seed=5)
    _run_object(case, {"stream": True})
    assert spy == [False]


@pytest.mark.gpu
def test_gpu_stream_q_not_rows_takes_the_split_path(spy):
    """A q its loader cannot read as rows (heads of a wider buffer): the step runs, on the
    split path, with the oracle's rows; the stream kernel is not launched."""
    _gpu()
    from .test_hunt_mla_balanced import _kernel_obj, _md, _params

    case = MLACase([1] * 8, [4096, 77, 1, 2000, 0, 3000, 64, 513], heads=16, rank=512,
                   rope=64, page=64, dtype=torch.bfloat16, device="cuda", seed=17)
    g = _on_gpu(case)
    wide = torch.zeros(8, 20, 576, dtype=torch.bfloat16, device="cuda")
    wide[:, :16] = g.q
    g.q = wide[:, :16]
    kernel = _kernel_obj(g, {"stream": True})
    plan = kernel.plan(_md(g))
    assert plan.stream is not None
    out = torch.full((8, 16, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((8, 16), float("nan"), device="cuda")
    kernel.run(g.q, (g.kv_cache,), plan, _params(g), out, lse=lse)
    torch.cuda.synchronize()
    _check(case, out, lse, "split path")
    assert spy == []


@pytest.mark.gpu
def test_gpu_stream_int64_indices(spy):
    """``seqused_k`` and the block table as int64."""
    _gpu()
    case = MLACase([1] * len(MIXED), MIXED, heads=16, rank=512, rope=64, page=64,
                   dtype=torch.bfloat16, device="cuda", seed=13)
    _run_object(case, {"stream": True}, index_dtype=torch.int64)
    assert spy == [False]


@pytest.mark.gpu
def test_gpu_stream_replays_follow_new_lengths(spy):
    """Captured once, replayed after the lengths changed on the device: the partition is
    computed on the device each launch (no host read), rows against the oracle."""
    _gpu()
    lens = [4096, 1000, 2048, 300, 64, 4000, 17, 2500] * 8
    case = MLACase([1] * len(lens), lens, heads=16, rank=512, rope=64, page=64,
                   dtype=torch.bfloat16, device="cuda", seed=9)
    relens = [max(0, L - 37 * (i % 5)) for i, L in enumerate(lens)]
    _run_object(case, {"stream": True}, graph_replays=2, relens=relens)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_stream_weighed_claims_over_replays(dtype, spy):
    """Rates (every third SM twice as fast) weigh the slots; programs claim their SM's
    slot: eager then three replays against the oracle, every slot claimed once a launch."""
    _gpu()
    from aiter_attn.kernels.triton._kvutil import num_sms

    sms = num_sms(torch.device("cuda"))
    rates = tuple(2.0 if i % 3 == 0 else 1.0 for i in range(sms))
    case = MLACase([1] * len(MIXED), MIXED, heads=16, rank=512, rope=64, page=64,
                   dtype=dtype, device="cuda", seed=21)
    kernel, plan = _run_object(case, {"stream": True, "balanced_rates": rates},
                               graph_replays=3)
    claims = kernel._stream_shares(sms, plan.args[0].device)["claim"][1]
    assert claims.tolist() == [4] * sms  # eager, then three replays
    assert spy == [True, True]  # eager and the capture


def test_stream_probe_summary_by_hand():
    """``benchmarks/stream_probe.py``'s summary of hand-made stamps (ns): two steps of three
    slots; slot 2 of step 0 enters after slot 0 ended (a second wave), slot 1 of step 1 is
    empty (no first tile)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    from stream_probe import summarize

    base = 10 ** 12  # global-timer values: large, as on the GPU
    # rows: entry, sm, first tile, end
    step0 = [[0, 3, 2000, 50000], [1000, 7, 4000, 60000], [55000, 3, 58000, 90000]]
    step1 = [[0, 1, 3000, 40000], [500, 2, 0, 1500], [200, 5, 2200, 30200]]
    st = torch.tensor([step0, step1], dtype=torch.int64)
    st[:, :, [0, 3]] += base
    st[:, :, 2] = torch.where(st[:, :, 2] > 0, st[:, :, 2] + base, st[:, :, 2])
    got = summarize(st)
    assert got["late"] == 1  # step 0's third slot; the most of any step
    assert got["sms"] == 2  # step 0 ran on SMs 3 and 7: the fewest of any step
    # entry spread: step 0 55 µs, step 1 0.5 µs: median 27.75
    assert got["entry spread"] == pytest.approx(27.75)
    # first-tile latency: step 0 (2, 3, 3) µs; step 1 (3, 2) µs (the empty slot left out):
    # min median(2, 2) = 2, median median(3, 2.5) = 2.75, max median(3, 3) = 3
    assert got["first"] == pytest.approx([2.0, 2.75, 3.0])
    # stream: step 0 (48, 56, 32) -> (32, 48, 56); step 1 (37, 28) -> (28, 32.5, 37)
    assert got["stream"] == pytest.approx([30.0, 40.25, 46.5])


# ------------------------------------------------- the partition, on the host (invariants)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.one_of(st.just(0), st.integers(1, 40), st.integers(1, 3000)),
                     min_size=1, max_size=30),
       rates=st.lists(st.floats(0.5, 2.0), min_size=1, max_size=24))
def test_stream_partition_invariants(lens, rates):
    """``stream_segments`` (the kernel's arithmetic on the host; it also checks that the
    prologue's vector count of the consumers' iterations equals their walk) over random
    batches and slot weights: every request's keys are covered once, in order; a request
    in one slot is a row, a crossing one a tail then heads; a slot has at most one head
    (its first segment) and one tail (its last); and every slot the balanced merge reads
    for a crossing request holds that request's partial in the slot kind it reads (an
    empty range inside the request: the head slot, written with LSE -inf)."""
    from aiter_attn.kernels.triton.mla_balanced import share_weights
    from aiter_attn.kernels.triton.mla_stream_gluon import STREAM_UNIT, stream_segments

    programs = len(rates)
    w = share_weights(tuple(rates), programs)
    parts = stream_segments(lens, w)
    per_req = {}
    for p, slot in enumerate(parts):
        segs = slot["segments"]
        kinds = [s[4] for s in segs]
        assert kinds.count("head") <= 1 and kinds.count("tail") <= 1, (p, segs)
        if "head" in kinds:
            assert kinds[0] == "head", (p, segs)
        if "tail" in kinds:
            assert kinds[-1] == "tail", (p, segs)
        assert slot["iterations"] >= sum(s[3] for s in segs)
        for r, lo, hi, n, kind in segs:
            assert n == -(-(hi - lo) // 64) and lo < hi, (p, segs)
            per_req.setdefault(r, []).append((p, lo, hi, kind))
    units = [-(-L // STREAM_UNIT) for L in lens]
    starts = [sum(units[:b]) for b in range(len(lens))]
    total = sum(units)
    bounds = [slot["range"][0] for slot in parts] + [total]
    for r, L in enumerate(lens):
        got = per_req.get(r, [])
        if L == 0:
            assert not got, (r, got)
            continue
        assert [g[1] for g in got] == [0] + [g[2] for g in got[:-1]], (r, got)
        assert got[-1][2] == L, (r, got)
        if len(got) == 1:
            assert got[0][3] == "row", (r, got)
            continue
        assert [g[3] for g in got] == ["tail"] + ["head"] * (len(got) - 1), (r, got)
        # the merge: slots p0..p1 from the inner bounds, the kind it reads from each
        cs, ce = starts[r], starts[r] + units[r]
        inner = bounds[1:programs]
        p0 = sum(b <= cs for b in inner)
        p1 = sum(b <= ce - 1 for b in inner)
        written = {g[0]: g[3] for g in got}
        for p in range(p0, p1 + 1):
            reads = "head" if cs < bounds[p] else "tail"
            if p in written:
                assert written[p] == reads, (r, p, got)
            else:  # an empty range inside the request: the kernel writes its head slot
                g0, g1 = parts[p]["range"]
                assert g0 == g1 and cs < g0 < ce and reads == "head", (r, p, got)


def test_stream_rates_from_records_by_hand(monkeypatch):
    """``stream_probe.rates_from_records``: an SM's units over its stream time, summed over
    its records; an SM without records gets the median; and ``bench_attention``'s
    ``stream-own-sm`` variant asks for them (``_sm_rates(..., own=True)``)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_attention as ba
    from stream_probe import rates_from_records

    recs = [{"sm": 0, "units": 100, "stream_us": 50.0}, {"sm": 0, "units": 20, "stream_us": 10.0},
            {"sm": 2, "units": 30, "stream_us": 30.0}, {"sm": 3, "units": 0, "stream_us": 5.0},
            {"sm": 9, "units": 10, "stream_us": 1.0}]
    assert rates_from_records(recs, 4) == pytest.approx((2.0, 1.5, 1.0, 1.5))
    with pytest.raises(ValueError, match="no slot streamed"):
        rates_from_records([{"sm": 1, "units": 5, "stream_us": 0.0}], 4)
    asked = []
    monkeypatch.setattr(ba, "_sm_rates", lambda dev, own=False: asked.append(own) or (1.0,))
    x = type("X", (), {"q": torch.empty(1)})()
    assert ba._resolve(ba.MLA_VARIANTS["stream-own-sm"], x)["balanced_rates"] == (1.0,)
    assert ba._resolve(ba.MLA_VARIANTS["stream-sm"], x)["balanced_rates"] == (1.0,)
    assert asked == [True, False]
