"""``benchmarks/bench_dense_extend.py`` and ``bench_variants.py``'s ``planned`` variants run on
the CPU (tiny shapes; timings are the H200's job): the dense-extend row builds both backends
over the same pools and batch, and both paths agree; a ``planned`` variant plans into the
kernel's static workspace and matches the reference."""

import os
import sys

import pytest
import torch

from ._triton_util import requires_triton

pytestmark = requires_triton

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def benches():
    sys.path.insert(0, _BENCH)
    try:
        import bench_dense_extend
        import bench_variants

        yield bench_dense_extend, bench_variants
    finally:
        sys.path.remove(_BENCH)


def test_dense_extend_rows_agree(benches):
    bde, _ = benches
    for reqs in ([(0, 40)], [(20, 1)] * 3 + [(0, 12)], [(9, 17), (30, 5)]):
        rec = bde.run_row(reqs, device="cpu", dtype=torch.float32, hq=4, hkv=2, d=16, page=4,
                          smoke=True)
        assert 0 < rec["rel_err_dense_vs_paged"] < 1e-5, (reqs, rec)


def test_planned_variants_match_the_reference(benches):
    from _inputs import make_mha
    from bench_attention import reference_mha, rel_err

    from aiter_attn.kernels.triton import _launch_config as lc

    _, bv = benches
    x = make_mha(2, 128, hq=8, hkv=2, d=32, dtype=torch.float16, device="cpu")
    expected, sel = reference_mha(x, 2, 1)
    try:
        for variant in ("planned", "planned-fused", "planned-fused-splits128"):
            fn, res = bv._ours(x, variant)
            fn()
            assert rel_err(sel(res()), expected) < 2e-3, variant
        assert lc.TUNING_OVERRIDES == {"fused_reduce": True, "min_split_tokens": 128}
    finally:
        lc.TUNING_OVERRIDES.clear()
