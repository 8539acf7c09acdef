"""Launching an already compiled Triton kernel without Triton's per-call argument binding.

``jit_fn[grid](*args, **kw)`` re-derives on every call what the kernel was compiled for: it
binds ~50 arguments, specialises each one (dtype and 16-byte alignment of every tensor, value
classes of every int), hashes the result into the kernel cache and builds launch metadata.
That is most of a decode layer's host time (29 µs of the 46 µs ``AttentionBackend.forward``
took on the H200 host; ``docs/benchmarks.md``). The caller of :meth:`Launcher.launch` knows
which arguments can change between calls that share a cache (the per-call tensors: ``q``,
``out``, ...) and passes their specialisation-relevant properties as a small key; everything
else must be fixed for the cache dict it passes (a plan's, per layer). The first call per
key goes through ``jit_fn[grid]`` (compiling if needed), which returns the
``CompiledKernel``; later calls hand the same argument list to its C launcher directly,
exactly as ``JITFunction.run`` does after its cache hit (Triton 3.6: ``kernel.run(gx, gy, gz,
stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args)``).
Launch options passed as keywords (``launch_pdl``, ``launch_cooperative_grid``) are compile
options: the compiled kernel's metadata carries them and its C launcher reads them there
(``CudaLauncher.__init__``), so a direct launch keeps them; they are part of the key.

The direct path is taken only where it was checked to be equivalent: a plain ``JITFunction``
or Gluon's subclass, which only binds differently (not the interpreter, not an autotuner),
NVIDIA CUDA (ROCm's backend specialises tensors on more than alignment), a Triton version in :data:`DIRECT_VERSIONS`, no launch hooks or
pre-run hooks installed (profilers get the regular path with its launch metadata), Triton's
debug mode off, and ``AITER_ATTN_DIRECT_LAUNCH`` not ``0``. Otherwise every call is the
regular ``jit_fn[grid](*args, **kw)``.

A tensor argument's specialisation in Triton 3.6 is its dtype and whether its address is a
multiple of 16; an int's is its value class (1, multiple of 16, 32/64-bit), so a key holding
the per-call tensors' ``(dtype, data_ptr() % 16 == 0)`` and the per-call ints' values
identifies the compiled kernel (:func:`tensor_key`; ``tests/test_direct_launch.py`` checks the
rule against Triton's own ``native_specialize_impl``).
"""

from __future__ import annotations

import itertools
import os

__all__ = ["Launcher", "DIRECT_VERSIONS", "DIRECT_ENV", "tensor_key", "arg_key", "launch_key",
           "intern_spec"]

#: Triton versions whose launch path was read and the direct launch checked against.
DIRECT_VERSIONS = ((3, 6),)
#: ``AITER_ATTN_DIRECT_LAUNCH=0`` turns the direct launch off (every call through the JIT);
#: read once per launcher, at its first launch.
DIRECT_ENV = "AITER_ATTN_DIRECT_LAUNCH"


def tensor_key(t) -> tuple:
    """What Triton 3.6 specialises a tensor argument on: dtype and 16-byte alignment."""
    return (t.dtype, t.data_ptr() % 16 == 0)


def arg_key(args) -> tuple:
    """A launch key of a whole positional argument list, for launches whose arguments all
    change per call (the dense prefill): every tensor's :func:`tensor_key`, every int's value
    class (1, multiple of 16, 32-bit), floats as one class, host tensor descriptors by their
    base dtype, block shape and shared layout. Pair it with the constexpr keywords."""
    out = []
    for a in args:
        if hasattr(a, "data_ptr"):
            out.append(tensor_key(a))
        elif isinstance(a, bool) or a is None:
            out.append(a)
        elif isinstance(a, int):
            out.append((a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31)))
        elif isinstance(a, float):
            out.append(float)
        elif hasattr(a, "block_shape"):  # triton / gluon host TensorDescriptor
            out.append((type(a), a.base.dtype, tuple(a.block_shape),
                        repr(getattr(a, "layout", None))))
        else:
            out.append((type(a), a))
    return tuple(out)


def launch_key(args, kw: dict) -> tuple:
    """:meth:`Launcher.launch`'s key of a launch whose every argument changes per call:
    :func:`arg_key` of ``args`` and the keywords (constexprs, launch options)."""
    return arg_key(args), tuple(sorted(kw.items()))


def intern_spec(spec) -> int:
    """A small int standing for ``spec`` (hashable; equal specs, equal ints) for cheap launch
    keys: a plan's or a layer's share of what Triton specialises on, made once where it
    stops changing. Ids are never reused (a full table is cleared and counting goes on), so
    a key made with an old id can only miss."""
    sid = _SPECS.get(spec)
    if sid is None:
        if len(_SPECS) >= _SPECS_KEEP:
            _SPECS.clear()
        sid = _SPECS[spec] = next(_SPEC_IDS)
    return sid


#: launch-relevant specs -> small ints (:func:`intern_spec`)
_SPECS: dict = {}
_SPECS_KEEP = 4096
_SPEC_IDS = itertools.count()


def _direct_supported(fn) -> bool:
    if os.environ.get(DIRECT_ENV, "1") in ("0", ""):
        return False
    try:
        import torch
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton is a dependency
        return False
    plain = [JITFunction]
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
        plain.append(GluonJITFunction)
    except ImportError:  # pragma: no cover - a Triton without Gluon
        pass
    if type(fn) not in plain:  # the interpreter, autotuners, heuristics: the regular path
        return False
    version = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())
    if version not in DIRECT_VERSIONS:
        return False
    return bool(torch.cuda.is_available()) and torch.version.hip is None


class Launcher:
    """``fn[grid](*args, **kw)``, with the compiled kernel of a launch key reused.

    Attributes:
        fn: the ``@triton.jit`` function.
        direct: whether the direct launch is used (decided on first launch; see the module
            docstring).
    """

    def __init__(self, fn):
        self.fn = fn
        self.direct = None  # decided lazily (CUDA may not be initialised at import)
        self._device = None
        self._stream = None
        self._names = None
        self._rt = None  # triton.knobs.runtime (launch hooks, debug)
        self._pre = ()  # the JITFunction's pre-run hooks
        self._cache: dict = {}  # (device, key) -> (CompiledKernel, constexpr tail)

    def force_direct(self, compiled, stream=lambda: 0) -> None:
        """Profiling: every launch is a direct one of ``compiled`` on the stream ``stream()``
        (no JIT, no GPU, hooks not read): the CPU host-cost proxy
        (``benchmarks/host_profile.py``) uses it."""
        self.direct = True
        self._device = lambda: 0
        self._stream = lambda device: stream()
        self._first = lambda grid, args, kw: compiled
        self._rt = _NoHooks()
        self._pre = ()

    def _decide(self) -> bool:
        self.direct = _direct_supported(self.fn)
        if self.direct:
            import torch
            from triton import knobs
            from triton.runtime.driver import driver

            active = driver.active
            # torch.cuda.current_device() without its lazy-init check (CUDA is initialised:
            # the tensors being launched on live there)
            self._device = getattr(torch._C, "_cuda_getDevice", active.get_current_device)
            self._stream = active.get_current_stream
            self._rt = knobs.runtime
            self._pre = self.fn.pre_run_hooks  # the live list add_pre_run_hook appends to
            if self.fn.debug:  # a debug kernel: Triton's path (its checks, its options)
                self.direct = False
        return self.direct

    def _hooked(self) -> bool:
        """Launch hooks, pre-run hooks or Triton's debug mode are on: the regular path (with
        its launch metadata) must run. Read per launch (profilers attach at run time)."""
        rt = self._rt
        try:
            return bool(rt.launch_enter_hook.calls or rt.launch_exit_hook.calls or rt.debug
                        or self._pre)
        except AttributeError:  # hooks not in Triton 3.6's shape: take the regular path
            return True

    def _first(self, grid, args, kw):
        """The regular launch; returns the ``CompiledKernel`` it ran (or ``None``)."""
        return self.fn[grid](*args, **kw)

    def _params(self) -> list:
        """``[(name, has_default, default)]`` of the kernel's parameters, in order."""
        if self._names is None:
            params = getattr(self.fn, "params", None)
            if params is not None:  # JITFunction
                self._names = [(p.name, p.has_default, p.default) for p in params]
            else:  # the interpreter's function (profiling with force_direct)
                import inspect

                sig = inspect.signature(getattr(self.fn, "fn", self.fn))
                self._names = [(n, p.default is not inspect.Parameter.empty, p.default)
                               for n, p in sig.parameters.items()]
        return self._names

    def _tail(self, nargs: int, kw: dict) -> tuple:
        """The parameters after the positional ones, in declaration order (constexprs from
        ``kw``, else their defaults): what ``JITFunction.run`` passes after ``args``."""
        tail = []
        for name, has_default, default in self._params()[nargs:]:
            if name in kw:
                tail.append(kw[name])
            elif has_default:
                tail.append(default)
            else:
                raise TypeError(f"{self.fn}: no value for parameter {name!r}")
        return tuple(tail)

    def launch_cached(self, grid, args: tuple, key) -> bool:
        """Launch directly if ``key`` was launched before (see :meth:`launch`); ``False``
        (nothing launched) otherwise: the caller then calls :meth:`launch` with the
        constexprs, which it need not build on the direct path."""
        if not self.direct or self._hooked():  # hooks or debug: the regular path
            return False
        device = self._device()
        hit = self._cache.get((device, key))
        if hit is None:
            return False
        compiled, tail = hit
        g1 = grid[1] if len(grid) > 1 else 1  # Triton's launch takes 1-, 2- or 3-D grids
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, self._stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *tail)
        return True

    def launch(self, grid, args: tuple, kw: dict, key) -> None:
        """Launch ``fn[grid](*args, **kw)``.

        ``key``: hashable, determines everything Triton specialises this launch on (every
        argument's dtype / alignment / int value class and ``kw``): the caller's interned
        ids of its fixed argument groups plus :func:`tensor_key` of each per-call tensor and
        the per-call ints. The grid is not part of it (it is passed on every launch).
        """
        direct = self.direct
        if direct is None:
            direct = self._decide()
        if not direct or self._hooked():
            self.fn[grid](*args, **kw)
            return
        device = self._device()
        hit = self._cache.get((device, key))
        if hit is None:
            compiled = self._first(grid, args, kw)  # launches (compiling on first use)
            if compiled is not None and hasattr(compiled, "packed_metadata"):
                if len(self._cache) >= _KEEP:
                    self._cache.clear()
                self._cache[(device, key)] = (compiled, self._tail(len(args), kw))
            return
        compiled, tail = hit
        g1 = grid[1] if len(grid) > 1 else 1  # Triton's launch takes 1-, 2- or 3-D grids
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, self._stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *tail)


class _NoChain:
    calls = ()


class _NoHooks:
    """A ``triton.knobs.runtime`` stand-in with no hooks (:meth:`Launcher.force_direct`)."""

    launch_enter_hook = _NoChain()
    launch_exit_hook = _NoChain()
    debug = False


#: compiled kernels remembered per launcher (distinct launch keys; cleared when full)
_KEEP = 4096


