"""CPU proxy of the per-call host cost of ``AttentionBackend.forward`` (one decode layer)
and ``ops.paged_attention`` (issue 13 item 5), with the GPU launch replaced by stand-ins, so
that what this library's Python costs can be measured without a GPU and apart from the
launch itself.

Method:

* ``TRITON_INTERPRET=1`` (set here before any import) so the Triton kernel objects are
  registered for CPU tensors and ``backend="triton"`` selects them, exactly as on the GPU;
  no kernel ever runs.
* The attention launches go to a stand-in (``--stub``):

  - ``direct`` (default): the launchers of :mod:`aiter_attn.kernels.triton._launch` take
    their direct path to a fake compiled kernel whose C launcher does nothing: the path
    ``run`` takes on the GPU, minus the C launcher;
  - ``jit``: every launch goes through an emulation of Triton 3.6's ``JITFunction.run`` for
    an already compiled kernel (its knobs, Triton's own argument binder and specialisation,
    cache key, kernel-cache lookup and launch metadata; no device/stream query, no C
    launcher): the path every launch took before the direct launch;
  - ``noop``: ``kernel[grid]`` returns a no-op.

* Rows (µs per call: the minimum, and the median in brackets, over ``--rounds`` rounds of
  ``--n`` back-to-back calls of this thread's CPU time, ``time.thread_time``, which waiting
  for a core on a shared machine does not inflate; ``--clock wall`` for
  ``time.perf_counter``): ``forward``, ``ops.paged_attention``, the bare launches with
  every argument prebuilt (``bare launch (Triton path)``: ``kernel[grid](*args, **kw)``
  through the stand-in; ``bare launch (direct)``: the direct path), and ``torch.empty`` of
  the output as a yardstick of the host's speed (the ``torch.empty units`` column divides
  by it, to compare runs under different load).
* ``function calls``: Python and C function calls per call (``sys.setprofile``): a
  deterministic figure, unmoved by other load.
* ``--cprofile forward|ops`` prints the top functions of a cProfile run instead.

Shape: bs 1, 100 keys, GQA 32/8, head dim 128, page 16 (the H200 host rows'), float32 on the
CPU (the dtype does not change the host path).

Usage::

    python benchmarks/host_profile.py                 # the table (direct path)
    python benchmarks/host_profile.py --stub jit      # every launch through Triton's path
    python benchmarks/host_profile.py --cprofile ops  # where the time goes
    python benchmarks/host_profile.py --gluon         # the Gluon decode kernel's host path

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


class _JITEmulation:
    """Triton 3.6's ``JITFunction.run`` for an already compiled kernel, on the CPU: the same
    Python (option knobs, argument binding and specialisation by Triton's own binder, cache
    key, kernel cache lookup, launch metadata) with the device/stream queries and the C
    launcher left out. What ``kernel[grid](*args, **kw)`` costs the host beyond the C
    launcher (the floor the direct launch removes)."""

    def __init__(self, interpreted):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        self.jit = JITFunction(interpreted.fn)
        backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binder = create_function_from_signature(self.jit.signature, self.jit.params,
                                                     backend)
        self.kernel_cache, self.key_cache = {}, {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, **kwargs)

    def run(self, *args, grid, **kwargs):
        from triton import knobs
        from triton.compiler.compiler import LazyDict
        from triton.runtime.jit import compute_cache_key

        jit = self.jit
        kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        device, stream = 0, 0
        for hook in jit.pre_run_hooks:
            hook(*args, **kwargs)
        bound_args, specialization, options = self.binder(*args, **kwargs)
        key = compute_cache_key(self.key_cache, specialization, options)
        kernel = self.kernel_cache.get(key, None)
        if kernel is None:
            kernel = self.kernel_cache[key] = _FakeCompiled()
        grid_0, grid_1, grid_2 = grid[0], grid[1] if len(grid) > 1 else 1, \
            grid[2] if len(grid) > 2 else 1
        launch_metadata = None  # CompiledKernel.launch_metadata with the default HookChain:
        if knobs.runtime.launch_enter_hook is not None:
            launch_metadata = LazyDict({"name": "k", "function": 0, "stream": stream})
        kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
                   launch_metadata, knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *bound_args.values())
        return kernel


def install_stub(mode: str = "direct"):
    """Replace the Triton attention launches by stubs; returns ``(undo, jit_bare)``.

    ``direct``: the launchers take the direct path to a fake compiled kernel; ``jit``: every
    launch goes through :class:`_JITEmulation` (Triton's own launch path minus the C
    launcher); ``noop``: every launch does nothing. ``jit_bare(args, kw, grid)`` launches
    through the emulation (the bare-launch floor of the Triton path)."""
    from aiter_attn.kernels.triton import attention

    emu = {name: _JITEmulation(getattr(attention, name))
           for name in ("_paged_attn_kernel", "_reduce_splits_kernel")}
    saved = {}
    for name in ("_paged_attn_kernel", "_reduce_splits_kernel"):
        saved[name] = getattr(attention, name)
        setattr(attention, name, _StubJIT() if mode == "noop" else emu[name])
    for name, jit_name in (("_ATTN", "_paged_attn_kernel"),
                           ("_REDUCE", "_reduce_splits_kernel")):
        launcher = getattr(attention, name, None)
        if launcher is None:  # before the direct launch existed
            continue
        saved[name] = (launcher, launcher.__dict__.copy())
        if mode == "direct":
            launcher.force_direct(_FakeCompiled(), stream=lambda: 0)
        else:
            launcher.fn = getattr(attention, jit_name)
            launcher.direct = False

    def undo():
        for name, val in saved.items():
            if isinstance(val, tuple):
                val[0].__dict__.clear()
                val[0].__dict__.update(val[1])
            else:
                setattr(attention, name, val)
    return undo


def force_gluon():
    """The Gluon decode kernel's path (:mod:`aiter_attn.kernels.triton.decode_gluon`) as on
    an sm_90 GPU: its device check passed, 132 SMs, its launchers' direct path stubbed.
    Returns an undo callable."""
    from aiter_attn.kernels.triton import attention
    from aiter_attn.kernels.triton import decode_gluon as dg

    saved = (attention.TritonPagedAttention._gluon_reason, attention.num_sms,
             [(lc, lc.__dict__.copy()) for lc in (dg._GLUON_DECODE, dg._REDUCE)])
    attention.TritonPagedAttention._gluon_reason = lambda self, device: None
    attention.num_sms = lambda device: 132
    for launcher, _ in saved[2]:
        launcher.force_direct(_FakeCompiled(), stream=lambda: 0)

    def undo():
        attention.TritonPagedAttention._gluon_reason, attention.num_sms = saved[0], saved[1]
        for launcher, state in saved[2]:
            launcher.__dict__.clear()
            launcher.__dict__.update(state)
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


def _setup(direct: bool, dtype=torch.float32):
    from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec, ops
    from aiter_attn.testing import PagedScenario

    hq, hkv, d, keys, page = 32, 8, 128, 100, 16
    device = torch.device("cpu")
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
    q3 = q.view(1, hq, d)
    bare = {"bare launch (Triton path)": binding.kernel.bare_launch(
        q3, (k_cache, v_cache), plan, binding.params, out)}
    if direct:
        bare["bare launch (direct)"] = binding.kernel.bare_launch(
            q3, (k_cache, v_cache), plan, binding.params, out, direct=True)

    pages = -(-keys // page)
    g = torch.Generator(device="cpu").manual_seed(0)
    oq = torch.randn(1, hq, d, generator=g).to(dtype)
    kc = torch.randn(pages + 1, page, hkv, d, generator=g).to(dtype)
    vc = torch.randn(pages + 1, page, hkv, d, generator=g).to(dtype)
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

    return {"forward": forward, "ops.paged_attention": op, **bare,
            "torch.empty (yardstick)": empty}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--stub", choices=("direct", "jit", "noop"), default="direct")
    p.add_argument("--cprofile", choices=("forward", "ops"), default=None)
    p.add_argument("--clock", choices=("thread", "wall"), default="thread",
                   help="thread CPU time (default: unmoved by waiting for a core) or wall")
    p.add_argument("--gluon", action="store_true",
                   help="the Gluon decode kernel's host path, as on an sm_90 GPU (direct "
                        "stub only; the bare-launch rows stay the Triton kernel's)")
    args = p.parse_args(argv)
    if args.gluon and args.stub != "direct":
        p.error("--gluon measures the direct launch path: use it with --stub direct")
    torch.set_num_threads(1)
    undo = install_stub(args.stub)
    if args.gluon:
        undo_stub, undo_gluon = undo, force_gluon()

        def undo():
            undo_gluon()
            undo_stub()
    try:
        # the Gluon path's TMA descriptors take fp16/bf16 caches only
        fns = _setup(args.stub == "direct", torch.float16 if args.gluon else torch.float32)
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
        if args.gluon:
            from aiter_attn.kernels.triton import decode_gluon as dg

            keys = len(dg._GLUON_DECODE._cache)
            if not keys:
                raise SystemExit("--gluon: the Gluon decode path was not taken")
            print(f"Gluon decode launch keys: {keys}")
    finally:
        undo()
    jit = res["bare launch (Triton path)"][0]
    direct = res.get("bare launch (direct)", (None,))[0]
    unit = res["torch.empty (yardstick)"][0]
    print(f"CPU proxy ({args.stub} launch stub, {args.clock} clock), {args.rounds} rounds x "
          f"{args.n} calls, µs per call (min over rounds; median in brackets):")
    print("| row | µs/call | beyond bare Triton launch | beyond bare direct launch | "
          "in torch.empty units | function calls |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (lo, med) in res.items():
        own = name in ("forward", "ops.paged_attention")
        e1 = f"{lo - jit:+.2f}" if own else ""
        e2 = f"{lo - direct:+.2f}" if own and direct is not None else ""
        print(f"| {name} | {lo:.2f} ({med:.2f}) | {e1} | {e2} | {lo / unit:.1f} | "
              f"{calls[name]:.0f} |")
    return res


if __name__ == "__main__":
    main()
