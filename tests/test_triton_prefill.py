"""The dense prefill kernel (:mod:`aiter_attn.kernels.triton.prefill`) against the float64
oracle: ragged batches (lengths 1 upward, queries bottom-right aligned over more keys), GQA
5:1, head dim 80 (padded tiles), window, soft-cap, sinks, the LSE, the prefix merge, and the
TMA (tensor-descriptor) and plain-pointer paths. CPU: Triton's interpreter in float32/float16;
bf16 and the sm_90 configurations under the ``gpu`` marker.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from aiter_attn.kernels.triton.prefill import PrefillConfig, dense_prefill
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.oracle import dense_attention

from ._triton_util import DEVICE, HAS_CUDA, requires_triton, spy_launches

pytestmark = requires_triton

RTOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
LSE_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class DenseCase:
    """Ragged q/k/v packed along tokens; request ``b`` has ``q_lens[b]`` queries over
    ``k_lens[b]`` keys (queries are the last positions)."""

    def __init__(self, q_lens, k_lens, *, hq=10, hkv=2, d=80, dv=None, dtype=torch.float32,
                 seed=0, device=DEVICE):
        g = torch.Generator().manual_seed(seed)
        dv = dv or d
        self.q_lens, self.k_lens = list(q_lens), list(k_lens)
        self.hq, self.hkv, self.d, self.dv, self.dtype = hq, hkv, d, dv, dtype
        self.q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
        self.k = torch.randn(sum(k_lens), hkv, d, generator=g).to(dtype)
        self.v = torch.randn(sum(k_lens), hkv, dv, generator=g).to(dtype)
        self.cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        self.cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32)
        self.scale = d ** -0.5
        self.device = device

    def oracle(self, **kw):
        outs, lses = [], []
        for b in range(len(self.q_lens)):
            qs = slice(int(self.cu_q[b]), int(self.cu_q[b + 1]))
            ks = slice(int(self.cu_k[b]), int(self.cu_k[b + 1]))
            o, l = dense_attention(self.q[qs], self.k[ks], self.v[ks], scale=self.scale,
                                   return_lse=True, **kw)
            outs.append(o)
            lses.append(l)
        return torch.cat(outs), torch.cat(lses)

    def run(self, *, config=None, lse=True, prefix=None, causal=True, window=(-1, -1),
            softcap=0.0, sinks=None):
        dev = self.device
        out = torch.full((self.q.shape[0], self.hq, self.dv), float("nan"), dtype=self.dtype,
                         device=dev)
        lse_t = (torch.full((self.q.shape[0], self.hq), float("nan"), dtype=torch.float32,
                            device=dev) if lse else None)
        dense_prefill(
            self.q.to(dev), self.k.to(dev), self.v.to(dev), out, cu_seqlens_q=self.cu_q.to(dev),
            cu_seqlens_k=self.cu_k.to(dev), max_seqlen_q=max(self.q_lens),
            max_seqlen_k=max(self.k_lens), softmax_scale=self.scale, causal=causal,
            window_size=window, softcap=softcap,
            sinks=None if sinks is None else sinks.to(dev), lse=lse_t,
            prefix=None if prefix is None else tuple(t.to(dev) for t in prefix), config=config)
        return out, lse_t


def assert_lse(actual, expected, rtol, what):
    a, e = actual.double().cpu(), expected.double().cpu()
    inf_e = torch.isneginf(e)
    assert torch.equal(torch.isneginf(a), inf_e), f"{what}: -inf rows differ"
    assert not torch.isnan(a).any(), f"{what}: NaN in lse"
    assert_close_rel(a[~inf_e], e[~inf_e], rtol, what + " (lse)")


#: the interpreter's tiles are 16 × 16: these lengths cross every stage boundary
LENS = [([1, 37, 16, 50], [1, 37, 16, 50]),          # prefill, incl. one token
        ([3, 20, 1], [40, 20, 33]),                   # queries over more keys (bottom-right)
        ([33], [33])]
CONFIGS = {"tma": PrefillConfig(16, 16, 4, 1, tma=True),
           "ptr": PrefillConfig(16, 16, 4, 1, tma=False),
           "bm32": PrefillConfig(32, 16, 4, 2, tma=True),
           # one loop, mask only where it cuts
           "one": PrefillConfig(16, 16, 4, 1, tma=True, one_loop=True),
           "one_ptr": PrefillConfig(32, 16, 4, 1, tma=False, one_loop=True),
           "m_slow": PrefillConfig(16, 16, 4, 1, tma=True, m_slow=True),
           # Gluon asked for: sm_90 only, so on the CPU the Triton kernel serves it
           "gluon": PrefillConfig(16, 16, 4, 1, tma=True, gluon=True)}


@pytest.mark.parametrize("lens", LENS, ids=["prefill", "bottom_right", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [80, 64])
def test_dense_causal(lens, dtype, d):
    c = DenseCase(*lens, d=d, dtype=dtype)
    eo, el = c.oracle(causal=True)
    for name, cfg in CONFIGS.items():
        o, l = c.run(config=cfg)
        assert_close_rel(o, eo, RTOL[dtype], f"out {name}")
        assert_lse(l, el, LSE_RTOL[dtype], f"lse {name}")


@pytest.mark.parametrize("cfg", ["tma", "ptr", "one", "m_slow"])
def test_dense_features(cfg):
    """Window (left, and both sides non-causal), soft-cap and sinks, on GQA 5:1."""
    c = DenseCase([1, 45, 21], [30, 45, 50], d=64)
    sinks = torch.randn(c.hq, generator=torch.Generator().manual_seed(3))
    for kw in (dict(window=(7, -1)), dict(window=(20, 0), softcap=5.0),
               dict(causal=False, window=(9, 4)), dict(causal=False),
               dict(sinks=sinks), dict(sinks=sinks, softcap=2.0, window=(16, -1))):
        causal = kw.pop("causal", True)
        window = kw.pop("window", (-1, -1))
        eo, el = c.oracle(causal=causal, window=window, **kw)
        o, l = c.run(config=CONFIGS[cfg], causal=causal, window=window, **kw)
        assert_close_rel(o, eo, RTOL[torch.float32], f"out {kw} {window} {causal}")
        assert_lse(l, el, LSE_RTOL[torch.float32], f"lse {kw} {window} {causal}")


def test_dense_empty_rows_and_no_lse():
    """Rows that see nothing (more queries than keys) output 0 with lse -inf; without
    ``lse`` the output is the same."""
    c = DenseCase([5, 4], [2, 4], d=32, hq=4, hkv=4)
    eo, el = c.oracle(causal=True)
    o, l = c.run(config=CONFIGS["tma"])
    assert_close_rel(o, eo, 2e-5, "out")
    assert_lse(l, el, 1e-5, "lse")
    o2, _ = c.run(config=CONFIGS["ptr"], lse=False)
    assert_close_rel(o2, eo, 2e-5, "out (no lse)")


def test_prefix_merge_in_epilogue():
    """``prefix=(o_p, lse_p)`` merges exactly: the dense pass over the last keys merged with
    the oracle's result over the first keys equals the oracle over all keys (sinks once;
    rows with an empty prefix, lse_p = -inf over a NaN o_p, included)."""
    g = torch.Generator().manual_seed(5)
    q_lens, p_lens = [4, 19, 1], [10, 0, 26]
    full = DenseCase(q_lens, [n + p for n, p in zip(q_lens, p_lens)], d=64, hq=6, hkv=3)
    sinks = torch.randn(full.hq, generator=g)
    # split each request's keys into prefix and new
    new_k, new_v, op, lp = [], [], [], []
    for b, (n, p) in enumerate(zip(q_lens, p_lens)):
        ks = slice(int(full.cu_k[b]), int(full.cu_k[b + 1]))
        k, v = full.k[ks], full.v[ks]
        new_k.append(k[p:])
        new_v.append(v[p:])
        qb = full.q[int(full.cu_q[b]):int(full.cu_q[b + 1])]
        if p:
            o, l = dense_attention(qb, k[:p], v[:p], scale=full.scale, causal=False,
                                   return_lse=True)
            op.append(o.float())
            lp.append(l.float())
        else:
            op.append(torch.full((n, full.hq, full.dv), float("nan")))
            lp.append(torch.full((n, full.hq), float("-inf")))
    dense = DenseCase(q_lens, q_lens, d=64, hq=6, hkv=3)
    dense.q, dense.k, dense.v = full.q, torch.cat(new_k), torch.cat(new_v)
    eo, el = full.oracle(causal=True, sinks=sinks)
    for cfg in ("tma", "ptr", "one"):
        o, l = dense.run(config=CONFIGS[cfg], sinks=sinks, prefix=(torch.cat(op), torch.cat(lp)))
        assert_close_rel(o, eo, 2e-5, f"merged out {cfg}")
        assert_lse(l, el, 1e-5, f"merged lse {cfg}")


GPU_CONFIGS = [
    pytest.param(torch.bfloat16, None, (128, 80), id="bf16-default"),
    pytest.param(torch.float16, None, (128,), id="fp16-default"),
    pytest.param(torch.bfloat16, PrefillConfig(128, 128, 8, 2, one_loop=True), (128,),
                 id="bf16-one-loop"),
    pytest.param(torch.bfloat16, PrefillConfig(64, 64, 4, 3), (128,), id="bf16-m64-4w"),
    pytest.param(torch.bfloat16, PrefillConfig(128, 128, 8, 2, m_slow=True), (128,),
                 id="bf16-m-slow"),
    pytest.param(torch.bfloat16, PrefillConfig(128, 128, 8, 2, tma=False), (128,),
                 id="bf16-ptr"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,cfg,dims", GPU_CONFIGS)
def test_dense_gpu(dtype, cfg, dims):
    """sm_90 configurations (TMA, one key loop, 64-row tiles, grid order, pointer loads),
    GQA 32/8, ragged lengths incl. 1 and queries over more keys; d128 (TMA) and d80
    (pointer path, padded tiles). The benchmark's sweep checks the rest before timing."""
    for d in dims:
        c = DenseCase([1, 300, 1000, 257], [1, 300, 1200, 257], hq=32, hkv=8, d=d, dtype=dtype,
                      device="cuda")
        eo, el = c.oracle(causal=True)
        o, l = c.run(config=cfg)
        assert_close_rel(o, eo, RTOL[dtype], f"out d{d}")
        assert_lse(l, el, LSE_RTOL[dtype], f"lse d{d}")


def test_gluon_declines_with_reasons():
    """The Gluon kernel's host predicate names what it cannot serve."""
    from aiter_attn.kernels.triton.prefill_gluon import gluon_reject_reason

    cfg = PrefillConfig(64, 64, 4, 2, gluon=True)
    q = torch.randn(8, 4, 128, dtype=torch.bfloat16)
    kw = dict(causal=True, window=(-1, -1), softcap=0.0, search=False, config=cfg)
    why = gluon_reject_reason(q, q[:, :2], q[:, :2], **kw)
    assert why is not None and ("sm_90" in why or "Gluon" in why)
    if HAS_CUDA and torch.cuda.get_device_capability()[0] == 9:
        g = q.cuda()
        assert gluon_reject_reason(g, g[:, :2], g[:, :2], **kw) is None
        assert "window" in gluon_reject_reason(g, g[:, :2], g[:, :2],
                                               **dict(kw, window=(8, -1)))
        assert "ragged" in gluon_reject_reason(g, g[:, :2], g[:, :2], **dict(kw, search=True))
        ws = PrefillConfig(128, 128, 4, 2, gluon=True, warp_specialize=True)
        assert gluon_reject_reason(g, g[:, :2], g[:, :2],
                                   **dict(kw, window=(8, -1), config=ws)) is None
        assert "soft-cap" in gluon_reject_reason(g, g[:, :2], g[:, :2],
                                                 **dict(kw, softcap=2.0, config=ws))
        assert "head dims" in gluon_reject_reason(g[..., :80], g[:, :2, :80], g[:, :2, :80],
                                                  **kw)


GLUON_CONFIGS = [
    pytest.param(torch.bfloat16, PrefillConfig(64, 64, 4, 2, gluon=True), id="bf16-s2"),
    pytest.param(torch.bfloat16, PrefillConfig(128, 128, 4, 2, gluon=True,
                                               warp_specialize=True), id="ws-bf16-bn128"),
    pytest.param(torch.float16, PrefillConfig(64, 64, 4, 3, gluon=True, m_slow=True),
                 id="fp16-s3-m-slow"),
    pytest.param(torch.bfloat16, PrefillConfig(64, 128, 4, 2, gluon=True), id="bf16-bn128"),
    # two warpgroups of 64 rows sharing each K/V tile
    pytest.param(torch.bfloat16, PrefillConfig(128, 64, 8, 2, gluon=True), id="bf16-8w"),
    # warp-specialised: a loader warp and two 64-row consumers sharing the K/V rings
    pytest.param(torch.bfloat16, PrefillConfig(128, 64, 4, 2, gluon=True, warp_specialize=True),
                 id="ws-bf16-s2"),
    pytest.param(torch.float16, PrefillConfig(128, 128, 4, 2, gluon=True, warp_specialize=True,
                                              m_slow=True), id="ws-fp16-bn128-m-slow"),
    pytest.param(torch.bfloat16, PrefillConfig(128, 64, 4, 4, gluon=True, warp_specialize=True),
                 id="ws-bf16-s4"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,cfg", GLUON_CONFIGS)
def test_gluon_dense_gpu(dtype, cfg, monkeypatch):
    """The Gluon kernel (asserted to serve these launches: plain grids, d128) against the
    oracle: prefill and queries over more keys (bottom-right, incl. rows past the last key
    tile and a one-token request), LSE, sinks, and the prefix merge in the epilogue. The
    warp-specialised form meets programs whose upper consumer has no rows (the 64- and
    1-row requests: its lower consumer alone reads the K/V rings) and the diagonal, where
    the lower consumer needs fewer key tiles than the upper one."""
    from aiter_attn.kernels.triton import prefill_gluon, prefill_gluon_ws
    from aiter_attn.kernels.triton.prefill_gluon import gluon_reject_reason

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is sm_90 only")
    launches = {name: spy_launches(monkeypatch, getattr(mod, name))
                for mod, name in ((prefill_gluon, "_GLUON"), (prefill_gluon_ws, "_GLUON_WS"))}
    g = torch.Generator().manual_seed(4)
    cases = [(([300, 257, 200], [300, 257, 200]), 128), (([100, 64, 1], [300, 64, 40]), 128)]
    if cfg.warp_specialize:  # the chooser picks it at head dim 64 too
        cases.append((([256, 200, 1], [300, 200, 65]), 64))
    for (q_lens, k_lens), d in cases:
        c = DenseCase(q_lens, k_lens, hq=32, hkv=8, d=d, dtype=dtype, device="cuda")
        grid, search = cfg.grid(max(q_lens), sum(q_lens), c.hq, len(q_lens))
        assert not search
        qd = c.q.cuda()
        kd = c.k.cuda()
        assert gluon_reject_reason(qd, kd, kd, causal=True, window=(-1, -1), softcap=0.0,
                                   search=search, config=cfg) is None
        sinks = torch.randn(c.hq, generator=g)
        cases_kw = [{}, {"sinks": sinks}]
        if cfg.warp_specialize:  # left windows: the lower consumer's tiles start first
            cases_kw += [{"window": (100, 0)}, {"window": (37, -1), "sinks": sinks},
                         {"window": (200, 5)}]
        for kw in cases_kw:
            eo, el = c.oracle(causal=True, **kw)
            o, l = c.run(config=cfg, **kw)
            assert_close_rel(o, eo, RTOL[dtype], f"out {q_lens} {kw.get('window')} {list(kw)}")
            assert_lse(l, el, LSE_RTOL[dtype], f"lse {q_lens} {kw.get('window')} {list(kw)}")
        # prefix merge: an arbitrary (o_p, lse_p) merged exactly, one row with lse_p = -inf
        op = torch.randn(sum(q_lens), c.hq, c.dv, generator=g).to(dtype)
        lp = torch.randn(sum(q_lens), c.hq, generator=g) + 3.0
        lp[0] = float("-inf")
        o, l = c.run(config=cfg, prefix=(op, lp))
        eo, el = c.oracle(causal=True)
        eo, el, lp64 = eo.double().cpu(), el.double().cpu(), lp.double()
        m = torch.maximum(el, lp64)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        w_d, w_p = torch.exp(el - m), torch.exp(lp64 - m)
        exp_o = (eo.double() * w_d[..., None] + torch.nan_to_num(op.double()) * w_p[..., None]) \
            / (w_d + w_p)[..., None]
        assert_close_rel(o, exp_o, RTOL[dtype], f"merged out {q_lens}")
        assert_lse(l, torch.logaddexp(el, lp64), LSE_RTOL[dtype], f"merged lse {q_lens}")
    want = "_GLUON_WS" if cfg.warp_specialize else "_GLUON"
    served = {name for name, calls in launches.items() if calls}
    assert served == {want}, launches


def test_warp_specialised_fallback_covers_the_grid():
    """A warp-specialised launch the Gluon kernel declines runs the Triton kernel with
    64-row programs of 4 warps on a grid covering every query block."""
    ws = PrefillConfig(128, 64, 4, 3, gluon=True, warp_specialize=True)
    grid, search = ws.grid(1000, 1000, 32, 1)
    cfg, g2, s2 = ws.triton_fallback(grid, search, 1000, 1)
    assert (cfg.block_m, cfg.num_warps, cfg.gluon, cfg.warp_specialize) == (64, 4, False, False)
    assert not s2 and g2[0] >= cfg.grid(1000, 1000, 32, 1)[0][0] and g2[1:] == grid[1:]
    slow = attrs.evolve(ws, m_slow=True)
    grid, _ = slow.grid(1000, 2000, 32, 2)
    assert slow.triton_fallback(grid, False, 2000, 2)[1] == (32, 2, 16)
    grid, search = ws.grid(8192, 8192 + 255, 32, 256)
    assert search
    assert ws.triton_fallback(grid, True, 8192 + 255, 256)[1:] == ((132 + 256, 32, 1), True)  # cdiv(8447, 64) + 256
    plain = PrefillConfig(64, 64, 4, 2, gluon=True)
    assert plain.triton_fallback((7, 32, 1), False, 400, 1) == \
        (attrs.evolve(plain, gluon=False), (7, 32, 1), False)


def test_dense_falls_back_from_warp_specialised_config():
    """On a host the Gluon kernel cannot serve (here: the CPU interpreter), a
    warp-specialised configuration still computes the right answer (Triton fallback),
    including a ragged (search) batch."""
    cfg = PrefillConfig(128, 16, 4, 1, tma=True, gluon=True, warp_specialize=True)
    for q_lens, k_lens in (([40, 300], [40, 310]), ([1] * 9 + [40], [5, 1, 17, 2, 1, 30, 1, 1,
                                                                     9, 40])):
        c = DenseCase(q_lens, k_lens, d=32, hq=4, hkv=2)
        eo, el = c.oracle(causal=True)
        o, l = c.run(config=cfg)
        assert_close_rel(o, eo, 2e-5, f"out {q_lens}")
        assert_lse(l, el, 1e-5, f"lse {q_lens}")


def test_grid_searches_on_ragged_batches():
    """Many short rows beside a long one: one program per present query block (search),
    not batch × blocks(max_q)."""
    cfg = PrefillConfig(128, 128, 8, 2)
    assert cfg.grid(8192, 8192, 32, 1) == ((64, 32, 1), False)
    assert cfg.grid(8192, 8192 + 255, 32, 256) == ((66 + 256, 32, 1), True)
    assert PrefillConfig(128, 128, 8, 2, m_slow=True).grid(4096, 8192, 32, 2) == \
        ((32, 2, 32), False)


def test_dense_very_ragged_batch():
    """Nine 1-token rows (over longer keys) and one 40-token row: the search path."""
    c = DenseCase([1] * 9 + [40], [5, 1, 17, 2, 1, 30, 1, 1, 9, 40], d=32, hq=4, hkv=2)
    eo, el = c.oracle(causal=True)
    o, l = c.run(config=CONFIGS["tma"])
    assert_close_rel(o, eo, 2e-5, "out")
    assert_lse(l, el, 1e-5, "lse")


def test_prefill_config_on_an_h200():
    """The chooser's H200 rules (docs/benchmarks.md, eighth to eleventh sessions): the
    warp-specialised Gluon kernel for bf16/fp16 at head dim 64/128 (128-key tiles, 2
    stages; with four waves or fewer of 128-row programs 64-key tiles, 3 stages, every
    head's longest blocks first); elsewhere the Triton kernel (m_slow with few waves, 3
    stages); wider heads, fp32 and devices of unknown size keep their own tiles; the
    device's shared memory caps the pipeline."""
    from aiter_attn.kernels.triton.prefill import _choose_cached, few_waves

    smem = 232448 - 2048

    def pick(max_q, heads, d=128, elem=2, sms=132, budget=smem):
        return _choose_cached(d, d, elem, True, budget, False, (), sms > 0,
                              few_waves(max_q, heads, sms))

    one_2k = pick(2048, 32)  # 1x2k, 32 heads: 512 programs of 128 rows
    assert (one_2k.block_m, one_2k.block_n, one_2k.num_warps, one_2k.num_stages,
            one_2k.m_slow, one_2k.gluon, one_2k.warp_specialize) == \
        (128, 64, 4, 3, True, True, True)
    for tokens in (8192, 8 * 2048, 16384):  # 1x8k, 8x2k, 1x16k
        for d in (64, 128):
            c = pick(tokens, 32, d=d)
            assert (c.block_m, c.block_n, c.num_warps, c.num_stages, c.m_slow, c.gluon,
                    c.warp_specialize) == (128, 128, 4, 2, False, True, True), (tokens, c)
    assert not pick(8192, 32, d=256).gluon  # wider heads: the Triton kernel
    assert not pick(8192, 32, d=96).gluon
    # not NVIDIA sm_90 (ROCm, sm_100): the Triton kernel, its own 3 stages
    other = _choose_cached(128, 128, 2, True, smem, False, (), True, False, False)
    assert not other.gluon and other.num_stages == 3 and other.block_m == 64
    few = _choose_cached(128, 128, 2, True, smem, False, (), True, True, False)
    assert (few.block_m, few.m_slow, few.gluon) == (64, True, False)
    # its fallback (window, soft-cap, ragged) is the Triton launch of 64-row tiles
    fb = one_2k.triton_fallback((16, 32, 1), False, 2048, 1)[0]
    assert (fb.block_m, fb.num_warps, fb.num_stages, fb.m_slow, fb.gluon) == \
        (64, 4, 3, True, False)
    assert not pick(8192, 32, elem=4).gluon
    assert pick(2048, 0).m_slow is False  # heads unknown: launch order as is
    assert pick(2048, 32, sms=0).block_m == 128  # unknown device size
    assert pick(2048, 32, d=256).block_m == 64 and pick(2048, 32, d=256).m_slow is False
    assert pick(2048, 32, elem=4).tma is False
    small = pick(8192, 32, budget=48 * 1024)
    assert (64 * 128 + small.num_stages * small.block_n * 256) * 2 <= 48 * 1024
