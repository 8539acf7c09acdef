"""Triton absorbed-MLA ``mla_paged_attention`` against the float32 reference and a float64 oracle.

On CPU-only hosts the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``scripts/test.sh``) in float32/float16 on small latent sizes; on a GPU the same cases run
compiled, and the ``gpu`` tests add DeepSeek shapes (kv_lora 512 + rope 64, 16 and 128 heads,
page 1 and 64) in bf16/fp16 and fp8 latent caches.

Relative-error bounds (‖out − expected‖ / ‖expected‖; expected = float64 dense attention over
the exact values the cache holds): float32 1e-5; float16 3e-3; bfloat16 1.5e-2 (P and the
output rounded to 8 mantissa bits); fp8 caches: the query dtype's bound, since the oracle sees
the dequantised cache values.
"""

from __future__ import annotations

import math

import pytest
import torch

from aiter_attn.kernels.reference import mla_paged_attention_reference, quantize_to_cache
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.oracle import dense_attention
from aiter_attn.types import FP8_DTYPES

from ._triton_util import DEVICE, requires_triton, spy_launches

pytestmark = requires_triton

RTOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
#: the natural-log LSE against the float64 oracle's (logits in float32, or rounded q)
LSE_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}


def _kernel():
    from aiter_attn.kernels.triton.mla import mla_paged_attention

    return mla_paged_attention


class MLACase:
    """A latent cache ``[pages, page, 1, R + rope]`` over a block-permuted pool whose page 0 is
    a null page full of noise, with ragged query lengths (decode = 1, verify > 1)."""

    def __init__(self, q_lens, kv_lens, *, heads=16, rank=64, rope=16, page=16,
                 dtype=torch.float32, kv_dtype=None, kv_scale=None, mask_p=None, seed=0,
                 device=DEVICE):
        g = torch.Generator().manual_seed(seed)
        kv_dtype = kv_dtype or dtype
        self.q_lens, self.kv_lens = list(q_lens), list(kv_lens)
        self.heads, self.rank, self.dtype, self.kv_scale = heads, rank, dtype, kv_scale
        dim = rank + rope
        n_pages = [-(-L // page) for L in kv_lens]
        total = 1 + sum(n_pages) + 2
        perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
        self.kv_cache = torch.randn(total, page, 1, dim, generator=g).to(kv_dtype)
        bt = torch.zeros(len(q_lens), max(n_pages) + 1, dtype=torch.int32)
        scale = 1.0 if kv_scale is None else float(kv_scale)
        if kv_dtype not in FP8_DTYPES:  # scales dequantise fp8 caches only
            scale = 1.0
        self.dense = []
        for b, L in enumerate(kv_lens):
            pages = [perm.pop() for _ in range(n_pages[b])]
            bt[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            c = quantize_to_cache(torch.randn(L, 1, dim, generator=g) * 2, kv_dtype, scale)
            for i, p in enumerate(pages):
                self.kv_cache[p, : min(page, L - i * page)] = c[i * page:(i + 1) * page]
            self.dense.append(c.float() * scale)
        self.block_table = bt
        self.cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        self.seqused = torch.tensor(kv_lens, dtype=torch.int32)
        self.q = torch.randn(int(self.cu[-1]), heads, dim, generator=g).to(dtype)
        self.masks = None
        self.custom_mask = self.mask_indptr = None
        if mask_p is not None:
            self.masks = [torch.rand(n, L, generator=g) < mask_p for n, L in zip(q_lens, kv_lens)]
            self.custom_mask = torch.cat([m.reshape(-1) for m in self.masks])
            self.mask_indptr = torch.tensor(
                [0] + torch.tensor([m.numel() for m in self.masks]).cumsum(0).tolist(),
                dtype=torch.int64)
        self.softmax_scale = dim ** -0.5
        self.device = device

    def kwargs(self, device=None):
        dev = device or self.device

        def mv(t):
            return None if t is None else t.to(dev)

        scale = self.kv_scale
        if isinstance(scale, float):
            scale = torch.tensor(scale, dtype=torch.float32, device=dev)
        return dict(kv_lora_rank=self.rank, cu_seqlens_q=mv(self.cu),
                    seqused_k=mv(self.seqused), block_table=mv(self.block_table),
                    softmax_scale=self.softmax_scale, kv_scale=scale,
                    custom_mask=mv(self.custom_mask), mask_indptr=mv(self.mask_indptr))

    def run(self, padding_row=None, **extra):
        """The kernel's rows (``out`` NaN-filled first); ``padding_row``: that request is
        made a graph padding row (``seqused_k`` 0), whose output must come out zero."""
        out = torch.full((self.q.shape[0], self.heads, self.rank), float("nan"),
                         dtype=self.dtype, device=self.device)
        kw = self.kwargs()
        if padding_row is not None:
            kw["seqused_k"] = kw["seqused_k"].clone()
            kw["seqused_k"][padding_row] = 0
        _kernel()(self.q.to(self.device), self.kv_cache.to(self.device), out, **kw, **extra)
        return out

    def expected(self, causal=True):
        outs, t = [], 0
        for b, (n, L) in enumerate(zip(self.q_lens, self.kv_lens)):
            c = self.dense[b]
            outs.append(dense_attention(
                self.q[t:t + n].float(), c, c[..., :self.rank], scale=self.softmax_scale,
                causal=causal, mask=None if self.masks is None else self.masks[b]))
            t += n
        return torch.cat(outs)

    def expected_lse(self):
        """Natural-log LSE of the scaled logits per (token, head), float64, causal."""
        rows, t = [], 0
        for b, (n, L) in enumerate(zip(self.q_lens, self.kv_lens)):
            c = self.dense[b].double()[:, 0]  # [L, dim]
            for i in range(n):
                s = self.q[t + i].double() @ c.T * self.softmax_scale  # [H, L]
                visible = torch.arange(L) <= L - n + i
                if self.masks is not None:
                    visible &= self.masks[b][i]
                s = s.masked_fill(~visible, -math.inf)
                rows.append(torch.logsumexp(s, dim=-1))
            t += n
        return torch.stack(rows)

    def assert_rows_and_lse(self, label, **launch):
        """Run with ``launch`` and an LSE output (NaN-filled first): the rows are finite and
        match the oracle (:data:`RTOL`), the LSE the oracle's (:data:`LSE_RTOL`); a row with
        nothing visible (custom masks can hide every key) is exactly zero with an LSE of
        ``-inf``. Returns the rows."""
        lse = torch.full((self.q.shape[0], self.heads), float("nan"), device=self.device)
        out = self.run(lse=lse, **launch)
        assert torch.isfinite(out).all(), label
        assert_close_rel(out, self.expected(), RTOL[self.dtype], label)
        exp_lse, lse = self.expected_lse(), lse.cpu()
        dead = torch.isinf(exp_lse)
        assert torch.equal(torch.isneginf(lse), dead), label + " LSE -inf where nothing is visible"
        assert (out.cpu()[dead] == 0).all(), label + " rows with nothing visible"
        if (~dead).any():
            assert_close_rel(lse[~dead], exp_lse[~dead], LSE_RTOL[self.dtype], label + " LSE")
        return out


def deepseek_decode(dtype, page=64, device="cuda"):
    """Six 16-head DeepSeek decode rows (latents 512 + 64): a long request, a 1000-key one,
    one tile exactly, a 5-key and a 1-key tail past a tile, half a context."""
    return MLACase([1] * 6, [4096, 1000, 64, 5, 129, 2049], rank=512, rope=64, page=page,
                   heads=16, dtype=dtype, device=device, seed=7)


CPU_CASES = [
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[5, 17, 33], page=16), {}, id="decode-B3-p16"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[9, 40], page=1), {"num_kv_splits": 3},
                 id="decode-p1-split3"),
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[70, 3, 130], page=64, heads=20),
                 {"num_kv_splits": 4}, id="decode-H20-p64-split4"),
    pytest.param(dict(q_lens=[3, 2], kv_lens=[30, 49], page=48), {}, id="verify-p48"),
    pytest.param(dict(q_lens=[4, 1, 2], kv_lens=[30, 3, 64], page=7, mask_p=0.7),
                 {"num_kv_splits": 2}, id="tree-mask-p7-split2"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[65, 20], page=64, rank=512, rope=64),
                 {"num_kv_splits": 2}, id="R512-rope64-p64"),
    pytest.param(dict(q_lens=[2, 1], kv_lens=[33, 18], kv_scale=0.37,
                      kv_dtype=torch.float8_e4m3fn), {}, id="kv-scale-tensor-fp8"),
    # chunked page lookup: several chunks of 2 tiles, a partial one, splits starting mid-chunk
    pytest.param(dict(q_lens=[1, 1, 2], kv_lens=[150, 9, 100], page=8),
                 {"block_n": 16, "page_chunk": 2, "num_kv_splits": 2}, id="chunk2-p8-2pages-per-tile"),
    pytest.param(dict(q_lens=[1, 3], kv_lens=[140, 77], page=32),
                 {"block_n": 16, "page_chunk": 2, "num_kv_splits": 3}, id="chunk2-p32-2tiles-per-page"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[70, 33], page=16),
                 {"block_n": 16, "page_chunk": 0}, id="no-chunk-p16"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case_kw,launch", CPU_CASES)
def test_mla_matches_oracle_and_reference(case_kw, launch, dtype):
    case = MLACase(**case_kw, dtype=dtype)
    out = case.run(**launch)
    assert_close_rel(out, case.expected(), RTOL[dtype], "triton vs float64 oracle")
    ref = torch.empty_like(out, device="cpu")
    mla_paged_attention_reference(case.q, case.kv_cache, ref, **case.kwargs("cpu"))
    assert_close_rel(out, ref.float(), RTOL[dtype], "triton vs reference")


def test_fp8_cache_bf16_queries_compute_in_fp16():
    """bf16 queries on an fp8 latent cache run both dots in fp16 (one cvt per fp8 pair);
    only loads and stores are bf16, which the interpreter handles. A query beyond fp16's
    range saturates instead of turning its row into NaN."""
    case = MLACase([1, 3], [70, 21], page=16, dtype=torch.bfloat16,
                   kv_dtype=torch.float8_e4m3fn, kv_scale=0.05, seed=9)
    out = case.run()
    assert_close_rel(out, case.expected(), RTOL[torch.bfloat16], "bf16 q, fp8 e4m3fn cache")
    case.q[0, 0, 0] = 1e6
    assert torch.isfinite(case.run()).all()


def test_mla_128_heads_two_head_blocks():
    """DeepSeek-V3's 128 heads: several head blocks share each latent tile."""
    case = MLACase([1, 2], [40, 64], page=64, heads=128, dtype=torch.float16)
    assert_close_rel(case.run(), case.expected(), RTOL[torch.float16], "H128")


@pytest.mark.parametrize("splits", [1, 3], ids=["nosplit", "split3"])
def test_split_count_does_not_change_results(splits):
    """Split-KV only regroups the same sum: results agree with the unsplit launch."""
    case = MLACase([1, 2], [50, 77], page=8)
    a = case.run(num_kv_splits=1)
    b = case.run(num_kv_splits=splits)
    assert_close_rel(b, a.double(), 1e-6, "split vs unsplit")


def test_non_causal_verify():
    case = MLACase([3, 2], [20, 9], page=4)
    out = torch.empty(5, 16, 64, device=case.device)
    kw = case.kwargs()
    _kernel()(case.q.to(case.device), case.kv_cache.to(case.device), out, causal=False, **kw)
    assert_close_rel(out, case.expected(causal=False), 1e-5, "non-causal")


def test_fully_masked_row_is_zero_not_nan():
    case = MLACase([2, 1], [12, 5], page=4, mask_p=1.0)
    case.masks[0][1] = False  # second query of request 0 sees nothing
    case.custom_mask = torch.cat([m.reshape(-1) for m in case.masks])
    out = case.run(num_kv_splits=2)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all()
    assert_close_rel(out, case.expected(), 1e-5, "masked")


def test_empty_requests_and_zero_length_rows_give_zeros_not_nan():
    """A request with no queries is skipped; a graph padding row (seqused_k = 0, null page)
    outputs zeros."""
    case = MLACase([1, 1, 1], [9, 4, 17], page=4)
    kw = case.kwargs()
    kw["cu_seqlens_q"] = torch.tensor([0, 1, 1, 2, 3], dtype=torch.int32, device=case.device)
    kw["seqused_k"] = torch.tensor([9, 4, 0, 17], dtype=torch.int32, device=case.device)
    bt = case.block_table.to(case.device)
    kw["block_table"] = torch.cat([bt[:2], torch.zeros_like(bt[:1]), bt[2:]])
    out = torch.full((3, 16, 64), float("nan"), device=case.device)
    _kernel()(case.q.to(case.device), case.kv_cache.to(case.device), out, num_kv_splits=2, **kw)
    want = case.expected()
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all()  # the zero-length row
    assert_close_rel(out[[0, 2]], want[[0, 2]], 1e-5, "rows around the padding")


def test_padded_heads_do_not_change_results():
    """Heads beyond a block (20 = 16 + 4) are computed like the others."""
    case = MLACase([1, 1], [21, 40], heads=20, page=8)
    out = case.run()
    sub = MLACase([1, 1], [21, 40], heads=20, page=8)
    sub.q = sub.q[:, :16].contiguous()
    sub.heads = 16
    assert_close_rel(out[:, :16], sub.run().double(), 1e-6, "first 16 heads")


def test_op_dispatch_to_triton_by_name():
    from aiter_attn import ops

    case = MLACase([1, 1], [10, 30], page=16)
    out = ops.mla_paged_attention(case.q.to(case.device), case.kv_cache.to(case.device),
                                  **case.kwargs(), backend="triton")
    assert_close_rel(out, case.expected(), 1e-5, "ops.mla_paged_attention(backend='triton')")


def test_bad_cache_shape_raises_before_launch():
    case = MLACase([1], [4], page=4)
    bad = case.kv_cache.to(case.device).expand(-1, -1, 2, -1)
    out = torch.empty(1, 16, 64, device=case.device)
    with pytest.raises(ValueError, match="one latent head"):
        _kernel()(case.q.to(case.device), bad, out, **case.kwargs())
    with pytest.raises(ValueError, match="kv_lora_rank"):
        kw = case.kwargs()
        kw["kv_lora_rank"] = 200
        _kernel()(case.q.to(case.device), case.kv_cache.to(case.device), out, **kw)


# ---------------------------------------------------------------- GPU (compiled, bf16/fp8)

GPU_SHAPES = [
    pytest.param(dict(q_lens=[1] * 4, kv_lens=[1000, 64, 4097, 300], page=64, heads=16),
                 id="H16-p64-decode"),
    pytest.param(dict(q_lens=[1] * 3, kv_lens=[777, 2048, 5], page=1, heads=128),
                 id="H128-p1-decode"),
    pytest.param(dict(q_lens=[4, 2], kv_lens=[1500, 130], page=64, heads=128),
                 id="H128-p64-verify"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[300, 99], page=48, heads=20), id="H20-p48"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["same", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_deepseek_shapes(shape, dtype, kv):
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else dtype
    scale = 0.05 if kv == "fp8" else None
    case = MLACase(**shape, rank=512, rope=64, dtype=dtype, kv_dtype=kv_dtype, kv_scale=scale,
                   device="cuda")
    out = case.run()
    assert_close_rel(out, case.expected(), RTOL[dtype], f"{dtype} kv={kv}")


def spy_mla_launches(monkeypatch, pick) -> list:
    """Records ``pick(args, kwargs)`` of each Triton MLA kernel launch (the launch itself
    still runs): which constexprs a plan really launched with."""
    from aiter_attn.kernels.triton import mla

    seen, kernel = [], mla._mla_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(pick(args, kw))
                return kernel[grid](*args, **kw)
            return launch

    # the launcher's regular path, so that a compiled key's direct launch cannot skip the spy
    monkeypatch.setattr(mla._MLA_FWD, "fn", Spy())
    monkeypatch.setattr(mla._MLA_FWD, "direct", False)
    return seen


def assert_graph_replay_matches_eager(new_lens, replays=1, **launch):
    """Capture a 16-head bf16 decode of 8 requests (latents 512 + 64, 7 pages of 64 each)
    once with the keywords ``launch``, change the lengths (``new_lens``, within the block
    table's 448 keys) and q in place, replay ``replays`` times: equals a fresh eager call."""
    case = MLACase([1] * 8, [100 + 37 * i for i in range(8)], rank=512, rope=64, page=64,
                   dtype=torch.bfloat16, device="cuda")
    q, kv = case.q.cuda(), case.kv_cache.cuda()
    kw = case.kwargs()
    out = torch.empty(8, 16, 512, dtype=torch.bfloat16, device="cuda")
    fn = _kernel()
    fn(q, kv, out, **kw, max_seqlen_k=1024, **launch)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(q, kv, out, **kw, max_seqlen_k=1024, **launch)
    kw["seqused_k"].copy_(torch.tensor(new_lens, device="cuda"))
    q.copy_(torch.randn_like(q))
    for _ in range(replays):
        graph.replay()
    eager = torch.empty_like(out)
    fn(q, kv, eager, **kw, max_seqlen_k=1024, **launch)
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [{}, {"narrow": False}], ids=["default", "triton"])
def test_gpu_cuda_graph_replay_matches_eager(launch):
    """Capture once, change lengths and tables in place, replay: equals a fresh eager call
    (the default: the narrow kernel on sm_90, its merge launched early; and the Triton
    kernel)."""
    assert_graph_replay_matches_eager([5 + i for i in range(8)], **launch)


# ------------------------------------------------ the warp-specialised Gluon kernel (sm_90)

GLUON_SHAPES = [
    # 64-key tiles: full ones, a 5-key and a 1-key tail, one tile exactly, a long request
    pytest.param(dict(q_lens=[1] * 5, kv_lens=[4096, 1000, 64, 5, 129], page=64, heads=128),
                 {}, id="H128-p64-decode"),
    pytest.param(dict(q_lens=[1] * 3, kv_lens=[777, 2048, 65], page=128, heads=64),
                 {"num_kv_splits": 3}, id="H64-p128-split3"),
    pytest.param(dict(q_lens=[4, 2, 1], kv_lens=[1500, 130, 3], page=64, heads=128),
                 {}, id="H128-p64-verify"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape,extra", GLUON_SHAPES)
def test_gpu_gluon_mla(shape, extra, dtype, monkeypatch):
    """The Gluon kernel (asserted to serve: 64-head blocks, latents 512 + 64, pages of 64k
    keys) against the oracle, with the cache's unwritten slots and its null page filled with
    NaN (a tail tile's rows past the last key are zeroed before use), splits (the partials
    and :mod:`.mla`'s merge), verify rows (causal per token) and the LSE (equal to the
    Triton kernel's)."""
    from aiter_attn.kernels.triton import mla_gluon

    _check_gluon_kernel(monkeypatch, mla_gluon._GLUON_MLA, shape, extra, dtype, {},
                        {"gluon": False}, "gluon")


def _check_gluon_kernel(monkeypatch, launcher, shape, extra, dtype, on: dict, off: dict,
                        what: str):
    """A Gluon MLA kernel (``launcher``, asserted to serve the call with ``on``) against the
    oracle, with the null page and the unwritten slots NaN, and its LSE against the Triton
    kernel's (the call with ``off``, asserted not to launch it)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA kernels are sm_90 only")
    calls = spy_launches(monkeypatch, launcher)
    case = MLACase(**shape, rank=512, rope=64, dtype=dtype, device="cuda")
    page = shape["page"]
    case.kv_cache[0] = float("nan")  # the null page
    for b, L in enumerate(case.kv_lens):
        last = int(case.block_table[b, (L - 1) // page])
        if L % page:
            case.kv_cache[last, L % page:] = float("nan")
    lse = torch.full((case.q.shape[0], case.heads), float("nan"), device="cuda")
    out = case.run(lse=lse, **on, **extra)
    assert calls, f"the {what} kernel did not serve the launch"
    assert not out.isnan().any() and not lse.isnan().any()
    assert_close_rel(out, case.expected(), RTOL[dtype], f"{what} {dtype}")
    n = len(calls)
    lse_t = torch.empty_like(lse)
    case.run(lse=lse_t, **off, **extra)
    assert len(calls) == n  # the Triton kernel
    assert_close_rel(lse, lse_t, 1e-3, "lse against the Triton kernel's")


@pytest.mark.gpu
def test_gpu_gluon_mla_graph_replay_matches_eager():
    """128 heads through the Gluon kernel: capture once, change lengths in place, replay."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA kernel is sm_90 only")
    case = MLACase([1] * 4, [1000, 64, 300, 4000], rank=512, rope=64, page=64, heads=128,
                   dtype=torch.bfloat16, device="cuda")
    q, kv = case.q.cuda(), case.kv_cache.cuda()
    kw = case.kwargs()
    out = torch.empty(4, 128, 512, dtype=torch.bfloat16, device="cuda")
    fn = _kernel()
    fn(q, kv, out, **kw, max_seqlen_k=4096)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(q, kv, out, **kw, max_seqlen_k=4096)
    kw["seqused_k"].copy_(torch.tensor([5, 64, 129, 3000], device="cuda"))
    q.copy_(torch.randn_like(q))
    graph.replay()
    eager = torch.empty_like(out)
    fn(q, kv, eager, **kw, max_seqlen_k=4096)
    assert torch.equal(out, eager)


# ------------------------------------------ the narrow Gluon kernel (up to 16 heads, sm_90)

NARROW_SHAPES = [
    pytest.param(dict(q_lens=[1] * 5, kv_lens=[4096, 1000, 64, 5, 129], page=64, heads=16),
                 {}, id="H16-p64-decode"),
    pytest.param(dict(q_lens=[4, 2, 1], kv_lens=[1500, 130, 3], page=16, heads=16),
                 {}, id="H16-p16-verify"),
    pytest.param(dict(q_lens=[1] * 3, kv_lens=[777, 2048, 65], page=48, heads=8),
                 {"num_kv_splits": 3}, id="H8-p48-split3"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[3000, 17], page=64, heads=1),
                 {}, id="H1-p64"),
    # 2, 2, 4 and 5 tiles: the ring's wrap after the two tiles the program issues itself,
    # the hand-over slot of each count
    pytest.param(dict(q_lens=[1] * 4, kv_lens=[128, 100, 200, 257], page=64, heads=16),
                 {}, id="H16-p64-ring-wrap"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape,extra", NARROW_SHAPES)
def test_gpu_narrow_gluon_mla(shape, extra, dtype, monkeypatch):
    """The narrow Gluon kernel (asserted to serve: at most 16 heads, latents 512 + 64)
    against the oracle with NaN in the null page and the unwritten slots, verify rows
    (causal per token), splits (its own partials, :mod:`.mla`'s merge) and the LSE
    (equal to the Triton kernel's)."""
    from aiter_attn.kernels.triton import mla_narrow_gluon as mn

    _check_gluon_kernel(monkeypatch, mn._NARROW, shape, extra, dtype, {"narrow": True},
                        {"narrow": False}, "narrow gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["reduce", True, "early"],
                         ids=["merge-early", "both-early", "early-keys"])
@pytest.mark.parametrize("shape,extra", [NARROW_SHAPES[0], NARROW_SHAPES[2]])
def test_gpu_narrow_gluon_pdl(shape, extra, pdl, monkeypatch):
    """The narrow kernel letting its split merge start early (``pdl``; the merge waits on
    the device for the kernel's end): the same oracle, NaN tails and LSE checks, and the
    merge launched with ``launch_pdl``."""
    from aiter_attn.kernels.triton import mla
    from aiter_attn.kernels.triton import mla_narrow_gluon as mn

    merges, real_merge = [], mla.merge_splits
    monkeypatch.setattr(mla, "merge_splits",
                        lambda *a, **k: (merges.append(k), real_merge(*a, **k))[1])
    _check_gluon_kernel(monkeypatch, mn._NARROW, shape, {**extra, "pdl": pdl},
                        torch.bfloat16, {"narrow": True}, {"narrow": False}, "narrow pdl")
    assert merges and merges[0].get("launch_pdl") is True, merges


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape,extra", NARROW_SHAPES)
def test_gpu_ring_gluon_mla(shape, extra, dtype, monkeypatch):
    """The ring Gluon kernel (32-key tiles, q in registers) on the narrow kernel's cases:
    NaN in the null page and unwritten slots, verify rows, splits, the LSE."""
    from aiter_attn.kernels.triton import mla_ring_gluon as mr

    _check_gluon_kernel(monkeypatch, mr._RING_LAUNCH, shape, extra, dtype, {"ring": True},
                        {}, "ring gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("one_query", [False, True], ids=["searched", "one-query"])
@pytest.mark.parametrize("heads,dtype,tuning", [
    (16, torch.bfloat16, {}),
    (5, torch.float16, {"pdl": True}),
], ids=["h16-bf16", "h5-fp16-pdl"])
def test_gpu_narrow_gluon_fused_merge(splits, one_query, heads, dtype, tuning, monkeypatch):
    """The narrow Gluon kernel merging its own splits (``fused_merge``): the last split of
    each token merges (no merge launch), NaN tails, the LSE, counters left at zero (three
    calls give the same bits); ``max_seqlen_q=1`` takes token t as request t. Five heads
    (padded to 8: the merge's 8-byte reads, masked heads) in fp16 with the launch itself
    started early (``pdl=True``)."""
    from aiter_attn.kernels.triton import mla
    from aiter_attn.kernels.triton import mla_narrow_gluon as mn

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA kernels are sm_90 only")
    monkeypatch.setattr(mla, "merge_splits",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("merge launch")))
    calls = spy_launches(monkeypatch, mn._NARROW)
    case = MLACase([1] * 5, [4096, 1000, 64, 5, 700], rank=512, rope=64, page=64,
                   heads=heads, dtype=dtype, device="cuda", seed=13)
    case.kv_cache[0] = float("nan")
    for b, L in enumerate(case.kv_lens):
        if L % 64:
            case.kv_cache[int(case.block_table[b, (L - 1) // 64]), L % 64:] = float("nan")
    extra = dict(narrow=True, fused_merge=True, num_kv_splits=splits, **tuning)
    if one_query:
        extra["max_seqlen_q"] = 1
    lse = torch.full((5, heads), float("nan"), device="cuda")
    outs = [case.run(lse=lse, **extra) for _ in range(3)]
    assert calls
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert not outs[0].isnan().any() and not lse.isnan().any()
    assert_close_rel(outs[0], case.expected(), RTOL[dtype], "narrow fused merge")
    lse_t = torch.empty_like(lse)
    monkeypatch.undo()
    case.run(lse=lse_t, num_kv_splits=splits, narrow=False)
    assert_close_rel(lse, lse_t, 1e-3, "fused-merge lse against the Triton kernel's")


def _mla_plan(case, **hints):
    from aiter_attn.kernels.base import _adhoc_metadata
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
    kw = case.kwargs()
    md = _adhoc_metadata(q, kv, kw["cu_seqlens_q"], kw["seqused_k"], kw["block_table"], None,
                         None, hints.get("max_seqlen_q"), None, "test")
    return TritonMLA(mla_request(q, kv, case.rank)).plan(md)


def test_decode_steps_take_token_t_as_request_t():
    """One query per request (tokens == requests, max_seqlen_q 1): the kernel skips the
    cu_seqlens_q search (``ONE_QUERY``); a zero-length padding row still gives zeros."""
    case = MLACase([1, 1, 1, 1], [9, 40, 1, 70], page=16, seed=11)
    assert _mla_plan(case, max_seqlen_q=1).cfg_kw["ONE_QUERY"]
    assert not _mla_plan(case).cfg_kw["ONE_QUERY"]  # no hint: a bound of 4 queries
    verify = MLACase([2, 1], [20, 9], page=4)
    assert not _mla_plan(verify, max_seqlen_q=2).cfg_kw["ONE_QUERY"]
    for splits in (1, 3):
        out = case.run(max_seqlen_q=1, num_kv_splits=splits)
        assert_close_rel(out, case.expected(), 1e-5, f"one query per request, {splits} splits")
    out = case.run(padding_row=1, max_seqlen_q=1)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    want = case.expected()
    assert_close_rel(out[[0, 2, 3]], want[[0, 2, 3]], 1e-5, "rows around the padding")


def test_unknown_tuning_key_is_refused_with_the_allowed_ones():
    """A misspelt option would otherwise be ignored (and a benchmark time the default)."""
    from aiter_attn.kernels.triton.mla import TritonMLA

    with pytest.raises(ValueError, match=r"unknown tuning key\(s\) \['kv_descs'\].*kv_desc"):
        TritonMLA(None, {"kv_descs": True, "num_kv_splits": 2})
