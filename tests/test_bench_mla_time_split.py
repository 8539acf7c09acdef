"""benchmarks/mla_time_split.py's launches run and agree (CPU: Triton's interpreter, a small
row; the H200 times them): the attention launch alone then the merge launch alone give the
step's rows, for the default and for every kernel option the GPU sessions time with it."""

import pytest
import torch

from ._triton_util import requires_triton
from .test_bench_launch_options import _bench

pytestmark = requires_triton


@pytest.fixture
def split_bench():
    return _bench("mla_time_split")


@pytest.mark.parametrize("tuning", [
    {}, {"kv_desc": True, "lazy_rescale": True, "half_partials": True, "qk_split": 2},
    {"fused_merge": True}], ids=["default", "desc-lazy-half-split2", "fused"])
def test_attention_then_merge_equals_the_step(split_bench, tuning):
    x, out, plan, step, attention, merge = split_bench.launches(
        16, 2, 128, 2, tuning, device="cpu", dtype=torch.float16)
    assert plan.use_parts and plan.splits == 2
    step()
    want = out.clone()
    out.fill_(float("nan"))
    attention()
    if merge is not None:
        merge()
    else:
        assert tuning.get("fused_merge"), "only the fused merge has no merge launch"
    assert torch.equal(out, want)
    assert torch.isfinite(out).all()


def test_split_row_record(split_bench):
    rec = split_bench.split_row(16, 2, 128, 2, 1, {"kv_desc": True},
                                timer=lambda fn, rep: (fn(), 10.0)[1], device="cpu",
                                dtype=torch.float16)
    assert rec["splits"] == 2 and rec["attention"] == rec["merge"] == rec["step"] == 10.0
    assert rec["row"] == "16x2x128" and '"kv_desc": true' in rec["tuning"]


def test_launch_floor_runs_every_launch(split_bench):
    """--floor: the three empty launches run (interpreter) and are each timed once."""
    calls = []

    def timer(fn, rep):
        fn()
        calls.append(fn.__name__)
        return float(len(calls))

    rec = split_bench.launch_floor((4, 2), 1, timer, device="cpu")
    assert calls == ["one", "two", "full"]
    assert rec == {"grid": "4x2", "one": 1.0, "two": 2.0, "grid_us": 3.0}


@pytest.mark.parametrize("tuning", [{}, {"half_partials": True}], ids=["float32", "16-bit"])
def test_fixed_order_merge_form_gives_the_step(split_bench, tuning):
    """--merge-fixed times merge(True): the split-by-split form writes the step's rows."""
    x, out, plan, step, attention, merge = split_bench.launches(
        16, 2, 128, 2, tuning, device="cpu", dtype=torch.float16)
    step()
    want = out.clone()
    out.fill_(float("nan"))
    attention()
    merge(True)
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    rec = split_bench.split_row(16, 2, 128, 2, 1, tuning, timer=lambda fn, rep: (fn(), 3.0)[1],
                                merge_fixed=True, device="cpu", dtype=torch.float16)
    assert rec["merge_fixed"] == 3.0
