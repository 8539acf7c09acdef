"""Defects found hunting the CUDA-graph manager (``aiter_attn/graph``): each test failed
before its fix. CPU, no-capture mode, reference kernels (fast)."""

from collections import namedtuple

import numpy as np
import pytest
import torch

from aiter_attn import ForwardMode

from ._graph_helpers import Rig


# -- capture sizes and bounds ---------------------------------------------------------------

@pytest.mark.parametrize("sizes", [
    pytest.param([2.5, 4], id="float-truncated-to-2"),
    pytest.param([4.0], id="whole-float"),
    pytest.param(["4"], id="string"),
    pytest.param([True, 2], id="bool-as-1"),
])
def test_capture_sizes_that_are_not_integers_are_refused_not_truncated(sizes):
    """``int(s)`` of every size silently turned 2.5 into a captured size 2 (a size nobody
    asked for, and 3-request batches then padded to 4 instead of 2.5's intent), accepted the
    string "4" and captured ``True`` as size 1."""
    rig = Rig.make("mha")
    with pytest.raises(ValueError, match="capture_sizes"):
        rig.manager(capture_sizes=sizes)


def test_capture_sizes_accept_numpy_integers_and_name_the_values_of_an_iterator():
    """Integer types other than ``int`` (numpy's, as a config file or argparse may give) stay
    accepted; a one-shot iterator was consumed before the error message listed it, which
    then read ``capture_sizes=[]`` for sizes ``[0, 2]``."""
    rig = Rig.make("mha")
    mgr = rig.manager(capture_sizes=np.array([4, 1, 2, 2], dtype=np.int64))
    assert mgr.capture_sizes == [1, 2, 4] and all(type(s) is int for s in mgr.capture_sizes)
    with pytest.raises(ValueError, match=r"capture_sizes=\[0, 2\]"):
        rig.manager(capture_sizes=(s for s in [0, 2]))


@pytest.mark.parametrize("kw,name", [
    pytest.param(dict(capture_sizes=None, max_bs=4.0), "max_bs", id="max_bs-float"),
    pytest.param(dict(capture_sizes=None, max_bs=True), "max_bs", id="max_bs-bool"),
    pytest.param(dict(max_num_tokens=10.5), "max_num_tokens", id="max_num_tokens-float"),
])
def test_bounds_that_are_not_integers_name_the_argument(kw, name):
    """A float ``max_bs`` / ``max_num_tokens`` failed deep in buffer allocation with torch's
    "argument 'size' must be tuple of ints" (or range's TypeError); ``max_bs=True`` sized every
    buffer for one request. Refused up front, naming the argument."""
    rig = Rig.make("mha")
    with pytest.raises(ValueError, match=name):
        rig.manager(**kw)


def test_empty_modes_is_refused_naming_the_argument():
    """``modes=[]`` failed with ``max() arg is an empty sequence`` while allocating."""
    rig = Rig.make("mha")
    with pytest.raises(ValueError, match=r"modes=\[\]"):
        rig.manager(modes=[])


def test_capture_sizes_and_modes_are_checked_and_captured_once():
    """``capture(sizes=[4.0])`` passed the membership check (4.0 == 4) and failed slicing the
    static inputs ("slice indices must be integers"); a size or mode given twice (``"idle"``
    is DECODE's graphs) was captured twice: twice the warm-up and, on a GPU, a second graph
    replacing the first."""
    rig = Rig.make("mha")
    mgr = rig.manager(capture_sizes=[1, 2, 4])
    calls = []
    step = rig.step_fn()

    def fn(batch, inputs):
        calls.append(batch.batch_size)
        return step(batch, inputs)

    with pytest.raises(ValueError, match="sizes"):
        mgr.capture(fn, sizes=[4.0])
    assert calls == [] and mgr.captured() == []
    mgr.capture(fn, sizes=[4, 2, 4], modes=["decode", "idle"])
    assert calls == [4, 2]
    assert mgr.captured() == [(ForwardMode.DECODE, 2), (ForwardMode.DECODE, 4)]


# -- outputs ---------------------------------------------------------------------------------

def test_namedtuple_outputs_are_sliced_to_the_real_rows():
    """``fn`` may return a tuple of per-token tensors; a namedtuple (a model's output record)
    is a tuple, but slicing rebuilt it with ``type(x)(generator)`` and every replay raised
    ``__new__() missing 1 required positional argument``."""
    Out = namedtuple("Out", "first second")
    rig = Rig.make("mha")
    mgr = rig.manager(capture_sizes=[4])
    step = rig.step_fn()
    mgr.capture(lambda batch, inputs: Out(*step(batch, inputs)))
    for p in (3, 20, 7):
        rig.join(p)
    batch = rig.batch("decode")
    inputs = rig.random_inputs(batch)
    out = mgr.replay(batch, **inputs)
    assert type(out) is Out and mgr.last_entry.bs == 4
    eager = rig.eager(batch, inputs, save_kv_cache=False)
    for got, want in zip(out, eager):
        assert got.shape[0] == 3
        assert torch.equal(got, want)


def test_capture_of_an_unprepared_mode_is_refused_before_anything_is_captured():
    """``capture(modes=[DECODE, TARGET_VERIFY])`` on a manager without verify buffers
    captured every DECODE size (warm-ups, graphs) and only then raised for verify, leaving a
    half-captured manager; the modes are now checked first."""
    from aiter_attn import GraphLimitError, SpecDecodeConfig

    rig = Rig.make("mha", spec=SpecDecodeConfig(num_draft_tokens=2))
    mgr = rig.manager(capture_sizes=[1, 2], modes=["decode"])
    calls = []
    step = rig.step_fn()

    def fn(batch, inputs):
        calls.append(batch.batch_size)
        return step(batch, inputs)

    with pytest.raises(GraphLimitError, match="TARGET_VERIFY has no CUDA-graph buffers"):
        mgr.capture(fn, modes=["decode", "target_verify"])
    assert calls == [] and mgr.captured() == []
