"""CPU proxy of the per-call host cost of OUR Python (issue 13 item 5): the Triton launch is
replaced by a stub, so what remains is validation, selection, planning, argument marshalling
and the output allocation: the part of ``AttentionBackend.forward`` / ``ops.paged_attention``
this library controls. No GPU needed (and none used): CPU tensors, Triton's interpreter only
for kernel registration, kernels never run.

Method:

* ``TRITON_INTERPRET=1`` (set here before any import) so the Triton kernel objects are
  registered for CPU tensors and ``backend="triton"`` selects them, exactly as on the GPU.
* The attention kernel's launch is replaced by a stub (``--stub jit``: ``kernel[grid]`` returns
  a no-op; ``--stub direct`` (default): a fake *compiled* kernel behind the direct-launch path
  of :mod:`aiter_attn.kernels.triton._launch`, so the path ``run`` takes on the GPU is what
  is timed, minus the C launcher itself).
* Rows, each the minimum (and median) over ``--rounds`` rounds of ``--n`` back-to-back
  calls (µs per call of this thread's CPU time, ``time.thread_time``; ``--clock wall`` for
  ``time.perf_counter``; the minimum is the least disturbed by other processes on a shared
  machine):
  ``forward`` (one decode layer, no K/V write), ``ops.paged_attention`` and ``stub launch``
  (the stubbed launch alone with prebuilt arguments: the floor). ``overhead`` = row − stub.
  ``torch.empty`` of the output is printed as a yardstick of this host's speed.
* ``function calls``: Python and C function calls per call (``sys.setprofile``): a
  deterministic figure, unmoved by other load on a shared machine.
* ``--cprofile forward|ops`` prints the top functions of a cProfile run instead.

Shape: bs 1, 100 keys, GQA 32/8, head dim 128, page 16 (the H200 host rows'), float32 on the
CPU (the dtype does not change the host path).

Usage::

    python benchmarks/host_profile.py                 # the table
    python benchmarks/host_profile.py --cprofile ops  # where the time goes

These are CPU figures of this machine: a proxy for the H200 host, not a measurement of it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["main", "install_stub", "measure"]


def _noop(*args, **kwargs):
    return None


class _StubJIT:
    """``kernel[grid](*args, **kw)`` does nothing (the JIT launch path, stubbed)."""

    def __getitem__(self, grid):
        return _noop


class _FakeCompiled:
    """A compiled kernel whose C launcher does nothing."""

    function = 0
    packed_metadata = ()
    run = staticmethod(_noop)


def install_stub(mode: str = "direct"):
    """Replace the Triton attention launches by stubs; returns an undo callable."""
    from aiter_attn.kernels.triton import attention

    saved = {}
    if mode == "direct" and hasattr(attention, "_ATTN"):
        # the direct path: a fake compiled kernel behind the real caching logic
        for name in ("_ATTN", "_REDUCE"):
            launcher = getattr(attention, name)
            saved[name] = (launcher, launcher.__dict__.copy())
            launcher.force_direct(_FakeCompiled(), stream=lambda: 0)
    else:
        for name in ("_paged_attn_kernel", "_reduce_splits_kernel"):
            if hasattr(attention, name):
                saved[name] = getattr(attention, name)
                setattr(attention, name, _StubJIT())
        for name in ("_ATTN", "_REDUCE"):
            launcher = getattr(attention, name, None)
            if launcher is not None:
                saved[name] = (launcher, launcher.__dict__.copy())
                launcher.fn = _StubJIT()
                launcher.direct = False

    def undo():
        for name, val in saved.items():
            if isinstance(val, tuple):
                val[0].__dict__.clear()
                val[0].__dict__.update(val[1])
            else:
                setattr(attention, name, val)
    return undo


def measure(fn, n: int, rounds: int, clock=time.thread_time) -> tuple[float, float]:
    """``(min, median)`` over ``rounds`` of the mean µs per call of ``n`` back-to-back calls
    (the minimum is the figure least disturbed by other processes on a shared machine;
    the default clock counts this thread's CPU time only, not time it waited for a core)."""
    for _ in range(min(n, 200)):
        fn()
    per = []
    for _ in range(rounds):
        t0 = clock()
        for _ in range(n):
            fn()
        per.append((clock() - t0) / n * 1e6)
    return min(per), statistics.median(per)


def count_calls(fn, n: int = 200) -> float:
    """Function calls (Python and C, as ``sys.setprofile`` sees them) per call of ``fn``: a
    deterministic companion of the timings, unmoved by other load on the machine."""
    count = [0]

    def prof(frame, event, arg):
        if event == "call" or event == "c_call":
            count[0] += 1

    fn()
    sys.setprofile(prof)
    try:
        for _ in range(n):
            fn()
    finally:
        sys.setprofile(None)
    return count[0] / n


def _setup(direct: bool):
    from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec, ops
    from aiter_attn.testing import PagedScenario

    hq, hkv, d, keys, page = 32, 8, 128, 100, 16
    dtype, device = torch.float32, torch.device("cpu")
    cfg = BackendConfig(page_size=page, max_batch_size=1, max_context_len=keys + 8,
                        dtype=dtype, device=device, kernel_backend="triton")
    layer = LayerSpec(layer_id=0, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    sc = PagedScenario.make(cfg, [layer], [keys - 1], seed=0)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.DECODE, [1])
    be.init_forward_metadata(batch)
    q, _, _ = sc.step_inputs(layer)

    def forward():
        return be.forward(q, None, None, layer, batch, save_kv_cache=False)

    forward()  # binds and plans
    _, executor = be.strategies_for(batch.forward_mode)
    binding = next(iter(executor._layers.values()))
    plan = be.forward_metadata.kernel_plans.get(binding.group)
    k_cache, v_cache = be.ctx.kv_pool.kv_buffers(0)
    out = torch.empty(1, hq, d, dtype=dtype)
    kw = {"direct": True} if direct else {}
    bare = binding.kernel.bare_launch(q.view(1, hq, d), (k_cache, v_cache), plan,
                                      binding.params, out, **kw)

    pages = -(-keys // page)
    g = torch.Generator(device="cpu").manual_seed(0)
    oq = torch.randn(1, hq, d, generator=g)
    kc = torch.randn(pages + 1, page, hkv, d, generator=g)
    vc = torch.randn(pages + 1, page, hkv, d, generator=g)
    bt = torch.arange(1, pages + 1, dtype=torch.int32).view(1, pages)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    sk = torch.tensor([keys], dtype=torch.int32)
    scale = d ** -0.5

    def op():
        return ops.paged_attention(oq, kc, vc, cu_seqlens_q=cu, seqused_k=sk, block_table=bt,
                                   softmax_scale=scale, max_seqlen_q=1, max_seqlen_k=keys,
                                   backend="triton")

    def empty():
        return torch.empty(1, hq, d, dtype=dtype)

    return {"forward": forward, "ops.paged_attention": op, "stub launch": bare,
            "torch.empty (yardstick)": empty}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--stub", choices=("direct", "jit"), default="direct")
    p.add_argument("--cprofile", choices=("forward", "ops"), default=None)
    p.add_argument("--clock", choices=("thread", "wall"), default="thread",
                   help="thread CPU time (default: unmoved by waiting for a core) or wall")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    undo = install_stub(args.stub)
    try:
        fns = _setup(args.stub == "direct")
        if args.cprofile:
            fn = fns["forward" if args.cprofile == "forward" else "ops.paged_attention"]
            measure(fn, 200, 1)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.n):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return {}
        clock = time.thread_time if args.clock == "thread" else time.perf_counter
        res = {name: measure(fn, args.n, args.rounds, clock) for name, fn in fns.items()}
        calls = {name: count_calls(fn) for name, fn in fns.items()}
    finally:
        undo()
    stub = res["stub launch"][0]
    unit = res["torch.empty (yardstick)"][0]
    print(f"CPU proxy (stubbed launch, {args.stub} path, {args.clock} clock), {args.rounds} "
          f"rounds x {args.n} calls, µs per call (min over rounds; median in brackets):")
    print("| row | µs/call | beyond stub launch | in torch.empty units | function calls |")
    print("| --- | --- | --- | --- | --- |")
    for name, (lo, med) in res.items():
        extra = "" if name.startswith(("stub", "torch")) else f"{lo - stub:.2f}"
        print(f"| {name} | {lo:.2f} ({med:.2f}) | {extra} | {lo / unit:.1f} | "
              f"{calls[name]:.0f} |")
    return res


if __name__ == "__main__":
    main()
