"""The benchmark scripts' byte, FLOP and tokens/s accounting, against numbers worked out by hand
for small shapes (``../shared/PERFORMANCE.md``'s method; ``docs/benchmarks.md``: decode rows of
``bench_attention.py`` count K+V once plus q and out, the variant/Gluon/kv-format scripts K+V
only; causal prefill counts the triangle; MLA reads one 576-wide latent row per token once and
does 2·H·(576 + 512) FLOPs per key), and that ours and the anchors go through one timer.

All on the CPU: only the accounting and the harness plumbing run, no kernel is timed."""

import os
import sys
import types

import pytest
import torch

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _bench(name):
    sys.path.insert(0, _BENCH)
    try:
        return __import__(name)
    finally:
        sys.path.remove(_BENCH)


# --------------------------------------------------------------------------- MHA decode bytes

def test_decode_bytes_bf16_by_hand():
    """bs 2 × ctx 32, 4 q-heads / 2 kv-heads, head dim 8, bf16: K and V each
    2·32·2·8 elements of 2 bytes = 2048 bytes, so 4096 of K+V; q and out 2·4·8·2 = 128 each."""
    inp = _bench("_inputs")
    x = inp.make_mha(2, 32, hq=4, hkv=2, d=8, page=16, device="cpu")
    assert x.kv_bytes == 4096
    assert x.bytes_moved == 4096 + 128 + 128
    # the formula of the method: seq_len × num_kv_heads × head_dim × elem size, K and V
    assert x.kv_bytes == 2 * (2 * 32) * 2 * 8 * 2


def test_decode_bytes_fp8_by_hand():
    """The same row with an e4m3 cache: 1 byte per K/V element (the per-tensor scales are two
    scalars: no per-token bytes), q and out stay bf16."""
    inp = _bench("_inputs")
    x = inp.make_mha(2, 32, hq=4, hkv=2, d=8, page=16, device="cpu",
                     kv_dtype=torch.float8_e4m3fn, dense=False)
    assert x.k_cache.dtype == torch.float8_e4m3fn and x.k_scale.numel() == 1
    assert x.kv_bytes == 2048
    assert x.bytes_moved == 2048 + 256
    # fp8 decode "half the bytes" of its bf16 twin, for the K/V part
    xb = inp.make_mha(2, 32, hq=4, hkv=2, d=8, page=16, device="cpu", dense=False)
    assert 2 * x.kv_bytes == xb.kv_bytes


def test_decode_bytes_count_only_the_requests_tokens():
    """The paged cache has a null page and block-permuted pages; only bs·ctx tokens count."""
    inp = _bench("_inputs")
    x = inp.make_mha(3, 48, hq=2, hkv=1, d=4, page=16, device="cpu")
    assert x.k_cache.shape[0] == 3 * 3 + 1  # one more page than the requests hold
    assert x.kv_bytes == 2 * 3 * 48 * 1 * 4 * 2


def test_decode_flops_by_hand():
    """One query per request: 4·D FLOPs per (query head, key): 4·8·32 keys·4 heads·2 requests."""
    inp = _bench("_inputs")
    x = inp.make_mha(2, 32, hq=4, hkv=2, d=8, page=16, device="cpu")
    assert x.flops == 4 * 8 * 32 * 4 * 2 == 8192


# --------------------------------------------------------------------------- prefill FLOPs

def test_prefill_flops_is_the_methods_triangle():
    """bench_attention's causal prefill: 4·S²·Hq·D/2 per sequence (PERFORMANCE.md): S 32,
    Hq 4, D 8, 2 sequences = 4·1024·4·8/2·2 = 131072."""
    inp = _bench("_inputs")
    x = inp.make_mha(2, 32, q_len=32, hq=4, hkv=2, d=8, page=16, device="cpu")
    assert x.q.shape[0] == 64
    assert x.flops == 4 * 32 * 32 * 4 * 8 / 2 * 2 == 131072


def test_bench_prefill_extend_flops_count_the_prefix_and_the_triangle():
    """bench_prefill's extend row: new query i (0-based) over a ``prefix``-token cache sees
    prefix + i + 1 keys. n 3, prefix 2: 3 + 4 + 5 = 12 pairs; ×4·D·Hq (D 4, Hq 2) = 384.
    The same count as the visible entries of the bottom-right mask the cuDNN anchor gets."""
    bp = _bench("bench_prefill")
    x = bp.Inputs(1, 3, 2, hq=2, hkv=1, d=4, page=16, dtype=torch.float32, device="cpu")
    assert x.flops == 4 * 4 * 2 * 12 == 384
    mask = torch.ones(x.n, x.L, dtype=torch.bool).tril(x.prefix)  # make_cudnn's mask
    assert int(mask.sum()) == 12
    # two requests of the same shape: twice the work
    x2 = bp.Inputs(2, 3, 2, hq=2, hkv=1, d=4, page=16, dtype=torch.float32, device="cpu")
    assert x2.flops == 2 * 384


def test_bench_prefill_plain_rows_count_the_visible_pairs():
    """Without a prefix bench_prefill counts the causal pairs with the diagonal, S(S+1)/2 (its
    docstring: "the visible (query, key) pairs"); bench_attention counts the method's S²/2.
    The two differ by 1/S (0.05% at 2k): pinned here so a change to either is deliberate."""
    bp = _bench("bench_prefill")
    inp = _bench("_inputs")
    x = bp.Inputs(1, 16, 0, hq=2, hkv=1, d=4, page=16, dtype=torch.float32, device="cpu")
    assert x.flops == 4 * 4 * 2 * (16 * 17 / 2)
    y = inp.make_mha(1, 16, q_len=16, hq=2, hkv=1, d=4, page=16, device="cpu")
    assert y.flops == 4 * 4 * 2 * (16 * 16 / 2)
    assert x.flops / y.flops == pytest.approx(17 / 16)


# --------------------------------------------------------------------------- MLA

def test_mla_bytes_read_the_latent_row_once():
    """bs 2 × ctx 64, 4 heads, kv_lora 512 + rope 64, bf16: one 576-wide latent row per token
    read once (not as K and V): 2·64·576·2 = 147456 bytes; q 2·4·576·2 = 9216; out (512
    wide) 2·4·512·2 = 8192."""
    inp = _bench("_inputs")
    x = inp.make_mla(2, 64, heads=4, device="cpu")
    assert x.kv_cache.shape[-2:] == (1, 576)
    assert x.bytes_moved == 147456 + 9216 + 8192


def test_mla_fp8_bytes():
    """The e4m3 latent cache: 1 byte per element, one scalar scale; q/out bf16."""
    inp = _bench("_inputs")
    x = inp.make_mla(2, 64, heads=4, device="cpu", kv_dtype=torch.float8_e4m3fn)
    assert x.kv_cache.element_size() == 1 and x.kv_scale.numel() == 1
    assert x.bytes_moved == 73728 + 9216 + 8192


def test_mla_flops_by_hand():
    """q·Kᵀ over d_qk 576 and P·V over d_v 512: 2·(576 + 512) FLOPs per (head, key):
    2·1088·4 heads·64 keys·2 requests = 1114112 (= 2·H·L·(2·512 + 64) per token)."""
    inp = _bench("_inputs")
    x = inp.make_mla(2, 64, heads=4, device="cpu")
    assert x.flops == 2 * (576 + 512) * 4 * 64 * 2 == 1114112


def test_mla_128_heads_tflops_unit():
    """The 128-head rows report TFLOP/s: FLOPs / seconds / 1e12 (add_rates)."""
    ba = _bench("bench_attention")
    inp = _bench("_inputs")
    x = inp.make_mla(1, 64, heads=128, device="cpu")
    rec = {"graph_ms": 0.001}
    ba.add_rates(rec, x.bytes_moved, x.flops)
    flops = 2 * 1088 * 128 * 64
    assert rec["graph_tflops"] == pytest.approx(flops / 1e-6 / 1e12)


def test_mla_time_split_tbps_is_latent_bytes_over_time():
    """mla_time_split: TB/s = latent bytes (bs·ctx·576·elem) / step µs / 1e6, steady TB/s
    the same over step − prologue. 2 × 128 keys bf16: 294912 bytes; step 10 µs, prologue 4 µs."""
    ts = _bench("mla_time_split")
    times = iter([10.0, 8.0, 2.0, 4.0])  # step, attention, merge, prologue (the call order)
    rec = ts.split_row(16, 2, 128, 2, 1, timer=lambda fn, rep: next(times), device="cpu",
                       dtype=torch.bfloat16)
    assert rec["step"] == 10.0 and rec.get("merge") == 2.0 and rec["prologue"] == 4.0
    nbytes = 2 * 128 * 576 * 2
    assert rec["TB/s"] == pytest.approx(nbytes / 10e-6 / 1e12)
    assert rec["steady TB/s"] == pytest.approx(nbytes / 6e-6 / 1e12)


# --------------------------------------------------------------------------- KV formats

@pytest.mark.parametrize("kv_name,gran,expected", [
    ("act", "per_layer", 20480),  # fp16 in the CPU case: 2 bytes
    ("float8_e4m3fn", "per_layer", 10240),  # 1 byte, two scalar scales
    ("float8_e4m3fn", "per_token_head", 10240 + 1280),  # + an fp32 scale per (token, head), K and V
    ("float8_e5m2", "per_token_head", 10240 + 1280),
])
def test_kv_formats_bytes_by_hand(kv_name, gran, expected):
    """bs 2 × ctx 40 (not a whole number of 16-token pages: only the 80 used tokens count),
    2 kv-heads × 32: K+V = 2·80·2·32 = 10240 elements; per-(token, head) scales 2·80·2·4 bytes."""
    kf = _bench("bench_kv_formats")
    case = kf.make_case(2, 40, kv_name, gran, torch.device("cpu"), act=torch.float16, hq=4,
                        hkv=2, d=32)
    assert kf._bytes(case) == expected


# --------------------------------------------------------------------------- rates and ratios

def test_add_rates_units():
    """TB/s = bytes / s / 1e12 and TFLOP/s = FLOPs / s / 1e12, for both timing modes."""
    ba = _bench("bench_attention")
    rec = {"eager_ms": 2.0, "graph_ms": 0.5}
    ba.add_rates(rec, 4e9, 3e9)
    assert rec["eager_tbps"] == pytest.approx(2.0) and rec["graph_tbps"] == pytest.approx(8.0)
    assert rec["eager_tflops"] == pytest.approx(1.5) and rec["graph_tflops"] == pytest.approx(6.0)


def test_fp8_over_bf16_tokens_per_s_ratio():
    """Same requests, one token each: tokens/s ∝ 1/time, so fp8/bf16 tokens/s = t_bf16 / t_fp8
    (0.5 ms / 0.25 ms = 2.00×), independent of the bytes each row counts."""
    ba = _bench("bench_attention")
    case = {"case": "fp8 1x0k", "kind": "fp8", "bytes": 1, "flops": 1,
            "impls": [{"impl": "ours", "graph_ms": 0.25, "graph_tbps": 1.0},
                      {"impl": "ours-bf16", "graph_ms": 0.5, "graph_tbps": 1.0}]}
    assert "(fp8/bf16 tokens/s 2.00×)" in ba.table([case], "graph")


def test_cascade_tokens_per_s_is_requests_over_step_time():
    """_cascade: a decode step makes one token per request: tokens/s = bs / step seconds, and
    the cascade row's ratio is without / with time."""
    casc = _bench("_cascade")
    rows = casc.run_cascade(smoke=True)
    base, cas = rows[:2]
    for r in (base, cas):
        assert r["eager_tokens_per_s"] == pytest.approx(r["bs"] / (r["eager_ms"] * 1e-3))
    assert cas["eager_speedup"] == pytest.approx(base["eager_ms"] / cas["eager_ms"])


def _fake_matplotlib(monkeypatch):
    """A stand-in for matplotlib that records ``ax.scatter(x, y, marker=...)`` points."""
    points = []

    class _Any:
        def __getattr__(self, name):
            return lambda *a, **k: None

    class _Ax(_Any):
        def scatter(self, x, y, **kw):
            if not isinstance(x, list):
                points.append((x, y, kw.get("marker")))

    plt = types.ModuleType("matplotlib.pyplot")
    plt.subplots = lambda *a, **k: (_Any(), _Ax())
    plt.close = lambda *a, **k: None
    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda *a, **k: None
    mpl.pyplot = plt
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    return points


def test_roofline_places_the_bf16_twin_at_its_own_intensity(monkeypatch, tmp_path):
    """An fp8 row holds its bf16 twin (``ours-bf16``, timed on a bf16 cache: twice the K/V
    bytes). The roofline's x axis is FLOP per byte moved, so the twin's point belongs at
    flops / bf16 bytes, not at the fp8 row's flops / fp8 bytes (which doubles its intensity)."""
    ba = _bench("bench_attention")
    roof = _bench("roofline")
    inp = _bench("_inputs")
    x8 = inp.make_mha(2, 32, hq=4, hkv=2, d=8, page=16, device="cpu",
                      kv_dtype=torch.float8_e4m3fn, dense=False)
    xb = inp.make_mha(2, 32, hq=4, hkv=2, d=8, page=16, device="cpu", dense=False)
    case = {"case": "fp8 2x0k", "kind": "fp8", "bs": 2, "ctx": 32, "bytes": x8.bytes_moved,
            "flops": x8.flops, "impls": []}
    for name, x in (("ours", x8), ("ours-bf16", xb)):  # as run_mha_rows records them
        rec = {"impl": name, "graph_ms": 0.001}
        ba.add_rates(rec, x.bytes_moved, x.flops)
        case["impls"].append(rec)
    points = _fake_matplotlib(monkeypatch)
    roof.plot([case], {"copy_tbps": 4.0, "matmul_tflops": 600.0}, str(tmp_path / "r.png"))
    by_marker = {m: (ai, v) for ai, v, m in points}
    flops = 4 * 8 * 32 * 4 * 2
    assert by_marker["o"][0] == pytest.approx(flops / (2048 + 256))  # ours (fp8)
    assert by_marker["."][0] == pytest.approx(flops / (4096 + 256))  # ours-bf16


# --------------------------------------------------------------------------- timing parity

def _record_timers(monkeypatch):
    import triton.testing as tt

    calls = []
    monkeypatch.setattr(tt, "do_bench", lambda fn, **kw: (calls.append(("eager", kw)), 1.0)[1])
    monkeypatch.setattr(tt, "do_bench_cudagraph",
                        lambda fn, **kw: (calls.append(("graph", kw)), 0.5)[1])
    return calls


def test_bench_attention_times_ours_and_anchors_alike(monkeypatch):
    """Every implementation of a row goes through ``bench_impl`` → ``time_fn``: the same eager
    call (do_bench, L2 flushed by default, same warmup and rep) and the same graph replay."""
    ba = _bench("bench_attention")
    calls = _record_timers(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    out = torch.ones(3)

    def make(_x):
        return (lambda: None), (lambda: out)

    per_impl = {}
    for name in ("ours", "cudnn", "aiter"):
        calls.clear()
        rec = ba.bench_impl(name, make, None, out, lambda o: o, 2e-2, 60, True)
        assert rec["eager_ms"] == 1.0 and rec["graph_ms"] == 0.5
        per_impl[name] = [(m, sorted(kw.items())) for m, kw in calls]
    assert per_impl["ours"] == per_impl["cudnn"] == per_impl["aiter"]
    assert per_impl["ours"][0] == ("eager", sorted({"warmup": 15, "rep": 60,
                                                     "return_mode": "median"}.items()))
    assert per_impl["ours"][1][0] == "graph"


def test_bench_prefill_times_ours_and_cudnn_alike(monkeypatch):
    bp = _bench("bench_prefill")
    calls = _record_timers(monkeypatch)
    for graph in (False, True):
        calls.clear()
        a = bp.time_ms(lambda: None, graph, 40, False)
        b = bp.time_ms(lambda: None, graph, 40, False)
        assert a == b and calls[0] == calls[1]


def test_bench_variants_cudnn_anchor_replayed_like_ours(monkeypatch):
    """bench_variants' cuDNN column: the same K+V bytes and the same graph replay as ours
    (bytes / ms / 1e9 = TB/s)."""
    bv = _bench("bench_variants")
    calls = _record_timers(monkeypatch)
    monkeypatch.setitem(bv.RUNNERS, "cudnn", lambda x: ((lambda: None), None))
    inp = _bench("_inputs")
    x = inp.make_mha(2, 32, hq=4, hkv=2, d=8, page=16, device="cpu")
    tbps = bv.cudnn_tbps(x, x.kv_bytes, 40)
    assert tbps == pytest.approx(4096 / 0.5e-3 / 1e12)
    assert calls == [("graph", {"rep": 40, "return_mode": "median"})]
