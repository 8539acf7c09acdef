"""The ``host`` section of benchmarks/bench_attention.py runs (CPU smoke mode: tiny shapes, a
few calls; the numbers mean nothing here, the lead runs it on the H200)."""

import json
import os
import sys

import pytest
import torch

from ._triton_util import DEVICE, requires_triton

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def bench():
    sys.path.insert(0, _BENCH)
    try:
        import bench_attention

        yield bench_attention
    finally:
        sys.path.remove(_BENCH)


def test_smoke_writes_every_host_row(bench, tmp_path):
    rows = bench.main(["--smoke", "--out", str(tmp_path), "--host-calls", "2"])
    names = [r["row"] for r in rows]
    assert names[:3] == ["forward", "forward+write", "ops.paged_attention"]
    assert {"transformers bs=2", "engine eager bs=2", "engine graph bs=2"} <= set(names)
    data = json.loads((tmp_path / "bench_host.json").read_text())
    assert len(data["rows"]) == len(rows)
    assert "| forward |" in (tmp_path / "bench_host.md").read_text()


@requires_triton
def test_bare_launch_matches_forward(bench):
    """The bare-launch floor launches exactly what forward runs (same output)."""
    import _host

    be, layer, batch, q, k, v, _ = _host._decode_setup(torch.device(DEVICE), torch.float32,
                                                       smoke=True, kernel_backend="triton")
    launch = _host._bare_launch(be, layer, batch, q)
    assert launch is not None
    ref = be.forward(q, None, None, layer, batch, save_kv_cache=False)
    _, executor = be.strategies_for(batch.forward_mode)
    binding = next(iter(executor._layers.values()))
    plan = be.forward_metadata.kernel_plans.get(binding.group)
    out = torch.zeros(q.shape[0], layer.num_q_heads, layer.head_dim, device=q.device)
    k_cache, v_cache = be.ctx.kv_pool.kv_buffers(0)
    binding.kernel.bare_launch(q.view(out.shape[0], layer.num_q_heads, -1), (k_cache, v_cache),
                               plan, binding.params, out)()
    torch.testing.assert_close(out.view_as(ref), ref)


def test_host_profile_runs_on_the_cpu():
    """benchmarks/host_profile.py (the CPU proxy of the host cost) runs every stand-in, and
    the Gluon decode kernel's path (``--gluon``)."""
    import subprocess

    root = os.path.dirname(_BENCH)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root, OMP_NUM_THREADS="1")
    for extra in (["--stub", "direct"], ["--stub", "jit"], ["--gluon"]):
        res = subprocess.run([sys.executable, os.path.join(_BENCH, "host_profile.py"), "--n",
                              "20", "--rounds", "1", *extra], env=env, cwd=root,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "| forward |" in res.stdout and "| ops.paged_attention |" in res.stdout
        assert ("Gluon decode launch keys:" in res.stdout) == (extra == ["--gluon"])
