"""The split decode's page-id prefetch (the paged Triton kernel's ``PREFETCH_PAGES``,
``TUNING_OVERRIDES["prefetch_pages"]``, default :data:`~aiter_attn.kernels.triton.
_launch_config.PREFETCH_PAGES`): with splits on the chunked page lookup, each program
reads its first chunk's page ids in its first round trip, guessing that its request is as
long as the plan's ``max_seqlen_k``, and uses them only where the guess holds.

Against the float64 oracle on block-permuted pools whose null page 0 is noise: requests as
long as the hint (the guess holds), shorter ones (it does not), block-table columns past each
request's pages filled with *other requests'* pages (a wrong use of the prefetched ids would
read them), a hint beyond what the table covers (the prefetch stays inside the row), tiles
inside one page and pages inside one tile, fp16 and fp8. A spy confirms the launches took the
path; the sm_90 build's first round trip is guarded in ``test_triton_pipelining.py``.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from aiter_attn.kernels.triton._paging import prefetch_chunk_pages

from ._launch_options import spy_launch_option
from ._triton_util import DEVICE, requires_triton
from .test_triton_paged_attention import Case, _check

pytestmark = requires_triton


@pytest.fixture
def prefetch(monkeypatch):
    """Turns ``prefetch_pages`` on; the ``PREFETCH_PAGES`` constexpr of every launch planned."""
    return spy_launch_option(monkeypatch, "PREFETCH_PAGES", "prefetch_pages")


def _split(monkeypatch, splits, chunk):
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.setitem(pa.TUNING_OVERRIDES, "num_splits", splits)
    monkeypatch.setitem(pa.TUNING_OVERRIDES, "page_chunk", chunk)


def _fill_spare_columns(case: Case):
    """Block-table columns past each request's pages get other requests' live pages."""
    bt = case.block_table
    live = bt[bt > 0]
    g = torch.Generator().manual_seed(5)
    for b, L in enumerate(case.kv_lens):
        used = -(-L // case.k_cache.shape[1])
        spare = bt.shape[1] - used
        bt[b, used:] = live[torch.randint(len(live), (spare,), generator=g)]


@pytest.mark.parametrize("page", [16, 64], ids=["pages-in-tile", "tile-in-page"])
@pytest.mark.parametrize("kv_lens", [
    pytest.param([256, 256, 256], id="all-as-long-as-the-hint"),
    pytest.param([256, 100, 7, 256], id="shorter-requests"),
    pytest.param([250, 33], id="ragged-last-tile"),
])
def test_prefetched_page_ids_vs_oracle(prefetch, monkeypatch, page, kv_lens):
    _split(monkeypatch, 4, 2)
    case = Case([1] * len(kv_lens), kv_lens, hq=8, hkv=2, d=32, page=page,
                dtype=torch.float16, seed=len(kv_lens) + page)
    _fill_spare_columns(case)
    _check(case, "prefetched page ids")
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2))
    _check(case, "prefetched page ids, sinks + soft-cap", sinks=sinks, softcap=5.0)
    assert prefetch and all(prefetch), prefetch


def test_prefetch_stays_inside_a_table_narrower_than_the_hint(prefetch, monkeypatch):
    """``max_seqlen_k`` far beyond the table's columns: the guessed chunks of the later
    splits start past the row's end and read nothing there (chunks of 32 tiles, so that
    the guessed 32 tiles per split still fit one)."""
    _split(monkeypatch, 4, 32)
    case = Case([1, 1], [130, 64], hq=4, hkv=1, d=32, page=16, dtype=torch.float16, seed=9)
    out = case.run(hints=False, max_seqlen_q=1, max_seqlen_k=4096)
    from aiter_attn.testing.compare import assert_close_rel

    from .test_triton_paged_attention import RTOL
    assert_close_rel(out, case.expected(), RTOL[torch.float16], "hint beyond the table")
    assert prefetch and all(prefetch), prefetch


def test_prefetch_with_an_fp8_cache(prefetch, monkeypatch):
    _split(monkeypatch, 3, 2)
    case = Case([1, 1, 1], [192, 192, 40], hq=8, hkv=2, d=64, page=16, dtype=torch.float16,
                kv_dtype=torch.float8_e5m2, k_scale=0.1, v_scale=0.5, seed=3)
    _fill_spare_columns(case)
    _check(case, "prefetched page ids, fp8 e5m2 cache")
    assert prefetch and all(prefetch), prefetch


@pytest.mark.parametrize("why", ["one-split", "per-tile-lookup", "no-hints", "turned-off",
                                 "splits-longer-than-a-chunk"])
def test_no_prefetch_where_it_does_not_apply(prefetch, monkeypatch, why):
    from aiter_attn.kernels.triton import paged_attention as pa

    chunk = {"per-tile-lookup": 0, "splits-longer-than-a-chunk": 1}.get(why, 2)
    _split(monkeypatch, 1 if why == "one-split" else 3, chunk)
    if why == "turned-off":
        monkeypatch.setitem(pa.TUNING_OVERRIDES, "prefetch_pages", False)
    case = Case([1, 1], [200, 50], hq=8, hkv=2, d=32, page=16, dtype=torch.float16, seed=4)
    _fill_spare_columns(case)
    _check(case, f"no prefetch ({why})", hints=why != "no-hints")
    assert prefetch and not any(prefetch), prefetch


@triton.jit
def _probe(bt, out, c0, n_in, width, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
           PAGE_CHUNK: tl.constexpr, TILE_IN_PAGE: tl.constexpr, N_OUT: tl.constexpr):
    ids = prefetch_chunk_pages(bt, c0, n_in, width, BLOCK_N, PAGE_SIZE, PAGE_CHUNK,
                               TILE_IN_PAGE)
    tl.store(out + tl.arange(0, N_OUT), tl.reshape(ids, (N_OUT,)))


@pytest.mark.parametrize("tile_in_page", [True, False], ids=["tile-in-page", "pages-in-tile"])
def test_prefetch_chunk_pages_reads_nothing_past_the_row(tile_in_page):
    """The device helper itself: ids of the guessed chunk's tiles inside the row, 0 for
    slots at or past ``width`` and for tiles past ``n_in``; the table's storage past the row
    holds sentinels (999) that must never come back."""
    block_n, page = (16, 32) if tile_in_page else (32, 16)
    ppt = 1 if tile_in_page else block_n // page
    width, chunk = 10, 4
    buf = torch.full((width + 64,), 999, dtype=torch.int32)
    buf[:width] = torch.arange(1, width + 1, dtype=torch.int32)
    for c0, n_in in ((0, 4), (3, 2), (4, 4), (40, 4)):
        out = torch.full((chunk * ppt,), -1, dtype=torch.int64, device=DEVICE)
        _probe[(1,)](buf.to(DEVICE), out, c0, n_in, width, BLOCK_N=block_n, PAGE_SIZE=page,
                    PAGE_CHUNK=chunk, TILE_IN_PAGE=tile_in_page, N_OUT=chunk * ppt)
        slots = ((c0 + torch.arange(chunk)) * block_n // page)[:, None] + torch.arange(ppt)
        live = (torch.arange(chunk) < n_in)[:, None] & (slots < width)
        want = torch.where(live, slots + 1, 0).flatten()
        assert torch.equal(out.cpu(), want), (c0, n_in, out, want)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="compiled Triton on CUDA")
@pytest.mark.parametrize("kv_lens", [
    pytest.param([4096], id="1x4k"),
    pytest.param([1000, 4096], id="ragged"),  # two requests: still 16 splits of 2 tiles
])
def test_gpu_prefetch_on_the_default_small_batch_launch(prefetch, kv_lens):
    """The library's own 1x4k-shaped launch on the H200 (16 splits of two 128-key tiles, the
    chunked lookup) takes the prefetch; GQA 32/8, head dim 128, page 16, bf16, the spare
    block-table columns holding other requests' pages."""
    case = Case([1] * len(kv_lens), kv_lens, hq=32, hkv=8, d=128, page=16,
                dtype=torch.bfloat16, seed=len(kv_lens), device="cuda")
    _fill_spare_columns(case)
    _check(case, "prefetched page ids on CUDA")
    sinks = torch.randn(32, generator=torch.Generator().manual_seed(3))
    _check(case, "prefetched page ids on CUDA, window + sinks", window_size=(1000, 0),
           sinks=sinks)
    assert prefetch and all(prefetch), prefetch
