"""The direct launch of compiled Triton kernels (``aiter_attn.kernels.triton._launch``): the
specialisation rule it relies on, the compiled-kernel reuse and argument order (with a fake
compiled kernel on the CPU), the fallbacks, and on the GPU bitwise equality with Triton's own
launch path."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from aiter_attn.kernels.triton import _launch
from aiter_attn.kernels.triton._launch import Launcher, tensor_key

from ._triton_util import HAS_CUDA, requires_triton


def _toy(X, Y, n, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):  # pragma: no cover
    pass


class _Compiled:
    """Records direct launches."""

    function = "fn-handle"
    packed_metadata = ("packed",)

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class _Hooks:
    def __init__(self):
        self.calls = []


class _Runtime:
    def __init__(self):
        self.launch_enter_hook = _Hooks()
        self.launch_exit_hook = _Hooks()
        self.debug = False


def _launcher(monkeypatch):
    """A Launcher over a real JITFunction whose JIT launch is faked (records, returns a fake
    compiled kernel) on a fake device/stream: the CPU stand-in of a GPU."""
    fn = JITFunction(_toy)
    compiled = _Compiled()
    jit_calls = []

    def run(*args, grid, warmup, **kw):
        jit_calls.append((grid, args, kw))
        return compiled

    monkeypatch.setattr(fn, "run", run)
    launcher = Launcher(fn)
    launcher.direct = True
    launcher._device = lambda: 0
    launcher._stream = lambda device: 1234
    launcher._rt = _Runtime()
    launcher._pre = fn.pre_run_hooks
    return launcher, compiled, jit_calls


def test_tensor_key_is_tritons_specialisation():
    """tensor_key(t) tells apart exactly the tensors Triton 3.6 specialises differently."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int32):
        base = torch.zeros(64, dtype=dtype)
        views = [base[i:] for i in range(9)]
        ours = [tensor_key(t) for t in views]
        theirs = [native_specialize_impl(BaseBackend, t, False, True, True) for t in views]
        for a in range(len(views)):
            for b in range(len(views)):
                assert (ours[a] == ours[b]) == (theirs[a] == theirs[b]), (dtype, a, b)
    x, y = torch.zeros(8, dtype=torch.float16), torch.zeros(8, dtype=torch.bfloat16)
    assert tensor_key(x) != tensor_key(y)


def test_second_launch_of_a_key_goes_to_the_compiled_kernel(monkeypatch):
    launcher, compiled, jit_calls = _launcher(monkeypatch)
    args = ("x", "y", 7)
    launcher.launch((2, 3, 4), args, {"BLOCK": 64, "num_warps": 4}, key=("k",))
    assert len(jit_calls) == 1 and not compiled.calls  # first: Triton's own path (compiles)
    assert launcher.launch_cached((5, 1, 1), args, ("k",))
    launcher.launch((2, 3, 4), args, {"BLOCK": 64, "num_warps": 4}, key=("k",))
    assert len(jit_calls) == 1
    # JITFunction.run's call: grid, stream, function, packed metadata, launch metadata and
    # hooks (None without hooks), then every parameter in order, constexprs and defaults too
    assert compiled.calls[0] == (5, 1, 1, 1234, "fn-handle", ("packed",), None, None, None,
                                 "x", "y", 7, 64, True)
    assert compiled.calls[1][:3] == (2, 3, 4)
    # another key (e.g. a misaligned q): Triton's path again, then direct
    assert not launcher.launch_cached((1, 1, 1), args, ("other",))
    launcher.launch((1, 1, 1), args, {"BLOCK": 64}, key=("other",))
    assert len(jit_calls) == 2


def test_hooks_and_debug_take_the_regular_path(monkeypatch):
    launcher, compiled, jit_calls = _launcher(monkeypatch)
    launcher.launch((1, 1, 1), (1, 2, 3), {"BLOCK": 16}, key=0)
    launcher._rt.launch_enter_hook.calls.append(print)  # a profiler attached
    assert not launcher.launch_cached((1, 1, 1), (1, 2, 3), 0)
    launcher.launch((1, 1, 1), (1, 2, 3), {"BLOCK": 16}, key=0)
    assert len(jit_calls) == 2 and not compiled.calls
    launcher._rt.launch_enter_hook.calls.clear()
    launcher._rt.debug = True
    assert not launcher.launch_cached((1, 1, 1), (1, 2, 3), 0)
    launcher._rt.debug = False
    launcher.fn.pre_run_hooks.append(lambda *a, **k: None)
    assert not launcher.launch_cached((1, 1, 1), (1, 2, 3), 0)
    launcher.fn.pre_run_hooks.clear()
    assert launcher.launch_cached((1, 1, 1), (1, 2, 3), 0)


def test_direct_launch_is_off_where_unchecked(monkeypatch):
    """Not a JITFunction (the interpreter), no CUDA, another Triton version or the env
    switch: every launch is Triton's own."""
    assert not _launch._direct_supported(lambda: None)
    fn = JITFunction(_toy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert _launch._direct_supported(fn)
    monkeypatch.setenv(_launch.DIRECT_ENV, "0")
    assert not _launch._direct_supported(fn)
    monkeypatch.delenv(_launch.DIRECT_ENV)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not _launch._direct_supported(fn)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(_launch, "DIRECT_VERSIONS", ((9, 9),))
    assert not _launch._direct_supported(fn)


@requires_triton
def test_run_hands_the_compiled_kernel_tritons_argument_list(monkeypatch):
    """TritonPagedAttention.run through the direct path passes exactly the argument list
    Triton's own launch binds (positional args, then every constexpr in order), per layer
    and per call; a misaligned q is a new key."""
    from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
    from aiter_attn.kernels.triton import attention
    from aiter_attn.testing import PagedScenario

    cfg = BackendConfig(page_size=4, max_batch_size=2, max_context_len=40, dtype=torch.float32,
                        kernel_backend="triton")
    layers = [LayerSpec(layer_id=i, num_q_heads=4, num_kv_heads=2, head_dim=16,
                        sliding_window=(8 if i else None), logit_cap=(30.0 if i else 0.0))
              for i in range(2)]
    sc = PagedScenario.make(cfg, layers, [9, 17], seed=3)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    inputs = [sc.step_inputs(layer) for layer in layers]
    for layer, (q, _, _) in zip(layers, inputs):  # bind (and run in the interpreter)
        be.forward(q, None, None, layer, batch, save_kv_cache=False)

    seen_jit = []
    fake = _Compiled()

    class _JIT:
        pre_run_hooks: list = []
        debug = False

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen_jit.append((grid, args, kw))
                return fake
            return launch

    real = attention._ATTN
    launcher = Launcher(attention._paged_attn_kernel)
    launcher.fn = _JIT()
    launcher.direct = True
    launcher._device = lambda: 0
    launcher._stream = lambda device: 99
    launcher._rt = _Runtime()
    launcher._names = real._params()  # the real kernel's parameter list
    monkeypatch.setattr(attention, "_ATTN", launcher)
    # splits make the reduction launch too: stub Triton's path for it
    monkeypatch.setattr(attention._REDUCE, "direct", False)
    monkeypatch.setattr(attention._REDUCE, "fn", _JIT())
    names = [n for n, _, _ in real._params()]
    for rnd in range(2):
        for layer, (q, _, _) in zip(layers, inputs):
            be.forward(q, None, None, layer, batch, save_kv_cache=False)
    attn_jit = [c for c in seen_jit if "GROUP" in c[2]]
    assert len(attn_jit) == 2  # one per layer's key; the second round is direct
    assert len(fake.calls) == 2
    for (grid, args, kw), direct in zip(attn_jit, fake.calls):
        bound = list(args) + [kw[n] for n in names[len(args):]]
        assert direct[:4] == (*grid, 99)
        got = list(direct[9:])
        assert len(got) == len(bound)
        for a, b in zip(got, bound):  # out is a new tensor per call: compare its layout
            if isinstance(b, torch.Tensor):
                assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride())
            else:
                assert type(a) is type(b) and a == b
    # a q 4 bytes off 16-byte alignment: another specialisation, Triton's path first
    q0 = inputs[0][0]
    qm = torch.empty(q0.numel() + 1, dtype=q0.dtype)[1:].view_as(q0).copy_(q0)
    be.forward(qm, None, None, layers[0], batch, save_kv_cache=False)
    assert len([c for c in seen_jit if "GROUP" in c[2]]) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["decode", "split", "features", "lse", "misaligned"])
def test_direct_launch_matches_triton_launch_on_gpu(case, monkeypatch):
    """On the GPU: outputs of the direct path are bitwise those of Triton's own launch, and
    the direct path is the one taken from the second call of a key on."""
    from aiter_attn import ops
    from aiter_attn.kernels.triton import _launch_config as lc
    from aiter_attn.kernels.triton import attention

    assert attention._ATTN.direct in (None, True)
    g = torch.Generator(device="cpu").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    hq, hkv, d, page = 32, 8, 128, 16
    keys = 3000 if case == "split" else 100
    bs = 3
    pages = -(-keys // page)
    kc = torch.randn(bs * pages + 1, page, hkv, d, generator=g).to(dev, dt)
    vc = torch.randn(bs * pages + 1, page, hkv, d, generator=g).to(dev, dt)
    bt = (torch.randperm(bs * pages, generator=g) + 1).view(bs, pages).to(dev, torch.int32)
    cu = torch.arange(bs + 1, dtype=torch.int32, device=dev)
    sk = torch.tensor([keys, keys - 7, keys // 2], dtype=torch.int32, device=dev)
    q = torch.randn(bs, hq, d, generator=g).to(dev, dt)
    if case == "misaligned":
        q = torch.empty(q.numel() + 1, dtype=dt, device=dev)[1:].view_as(q).copy_(q)
    kw = dict(cu_seqlens_q=cu, seqused_k=sk, block_table=bt, softmax_scale=d ** -0.5,
              max_seqlen_q=1, max_seqlen_k=keys, backend="triton")
    if case == "features":
        kw.update(window_size=(63, 0), softcap=30.0,
                  sinks=torch.randn(hq, generator=g).to(dev, torch.float32))
    if case == "lse":
        kw.update(return_lse=True)

    # the Triton kernel's launches (plain decode on sm_90 takes the Gluon kernel otherwise)
    monkeypatch.setitem(lc.TUNING_OVERRIDES, "gluon_decode", False)

    def call():
        return ops.paged_attention(q, kc, vc, **kw)

    def tup(x):
        return x if isinstance(x, tuple) else (x,)

    first = tup(call())     # Triton's path (compiles); the call is memoised
    assert attention._ATTN.direct is True
    n_cached = len(attention._ATTN._cache)
    second = tup(call())    # the direct path
    assert len(attention._ATTN._cache) == n_cached > 0
    monkeypatch.setattr(attention._ATTN, "direct", False)
    monkeypatch.setattr(attention._REDUCE, "direct", False)
    jit = tup(call())       # Triton's own launch, same plan and arguments
    torch.cuda.synchronize()
    for a, b, c in zip(first, second, jit):
        assert torch.equal(a, c) and torch.equal(b, c)


@requires_triton
def test_launch_memos_do_not_outlive_the_backend():
    """The per-layer launch parts live on the bound kernel object, so a discarded backend's
    layer tensors (sinks here; per-token scale buffers alike) are freed with it."""
    import gc
    import weakref

    from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
    from aiter_attn.testing import PagedScenario

    cfg = BackendConfig(page_size=4, max_batch_size=2, max_context_len=40, dtype=torch.float32,
                        kernel_backend="triton")
    sinks = torch.randn(4)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16, sinks=sinks)
    sc = PagedScenario.make(cfg, [layer], [9, 17], seed=3)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    q, _, _ = sc.step_inputs(layer)
    be.forward(q, None, None, layer, batch, save_kv_cache=False)
    ref = weakref.ref(sinks)
    del be, batch, sc, layer, sinks, q
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("grid", [(6,), (6, 5), (6, 5, 1)])
def test_direct_launch_takes_short_grids(monkeypatch, grid):
    """Triton accepts 1-, 2- and 3-D grids; the direct path pads them to three (the split
    reduction's 2-D grid raised IndexError on the H200 at 09:45 UTC, before this)."""
    launcher, compiled, jit_calls = _launcher(monkeypatch)
    args = ("x", "y", 7)
    launcher.launch(grid, args, {"BLOCK": 64}, key=("k",))
    launcher.launch(grid, args, {"BLOCK": 64}, key=("k",))
    assert launcher.launch_cached(grid, args, ("k",))
    want = (grid + (1, 1))[:3]
    assert [c[:3] for c in compiled.calls] == [want, want]


def test_arg_key_separates_what_triton_specialises():
    """arg_key: tensors by dtype/alignment, ints by value class (1, multiple of 16, 32-bit),
    host tensor descriptors by dtype and block shape; equal classes give equal keys."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from aiter_attn.kernels.triton._launch import arg_key

    t = torch.zeros(64, 32, dtype=torch.float16)
    assert arg_key((t, 32, 7, 1.5)) == arg_key((torch.ones_like(t), 48, 9, 2.5))
    assert arg_key((t, 32)) != arg_key((t[:, 1:], 32))       # 16-byte alignment
    assert arg_key((t, 32)) != arg_key((t.bfloat16(), 32))   # dtype
    for a, b in ((1, 2), (16, 17), (5, 1 << 33), (True, False)):
        assert arg_key((a,)) != arg_key((b,)), (a, b)
    da = TensorDescriptor(t, [64, 32], [32, 1], [16, 32])
    db = TensorDescriptor(t, [64, 32], [32, 1], [32, 32])
    assert arg_key((da,)) == arg_key((TensorDescriptor(t.clone(), [64, 32], [32, 1], [16, 32]),))
    assert arg_key((da,)) != arg_key((db,))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["triton", "gluon", "gluon-ws"])
def test_dense_prefill_direct_launch_matches_triton_launch_on_gpu(kind, monkeypatch):
    """The dense prefill (Triton, and Gluon on sm_90, plain and warp-specialised) launched
    directly from a key's second call is bitwise Triton's own launch."""
    from aiter_attn.kernels.triton import prefill, prefill_gluon, prefill_gluon_ws
    from aiter_attn.kernels.triton.prefill import PrefillConfig, dense_prefill

    gluon = kind != "triton"
    if gluon and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is sm_90 only")
    launcher = {"triton": prefill._DENSE, "gluon": prefill_gluon._GLUON,
                "gluon-ws": prefill_gluon_ws._GLUON_WS}[kind]
    g = torch.Generator().manual_seed(1)
    lens = [300, 257, 200]
    cu = torch.tensor([0, 300, 557, 757], dtype=torch.int32, device="cuda")
    q = torch.randn(757, 32, 128, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(757, 8, 128, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(757, 8, 128, generator=g).to("cuda", torch.bfloat16)
    cfg = PrefillConfig(128 if kind == "gluon-ws" else 64, 64, 4, 2, gluon=gluon,
                        warp_specialize=kind == "gluon-ws")

    def call():
        out = torch.empty_like(q)
        lse = torch.empty(757, 32, dtype=torch.float32, device="cuda")
        dense_prefill(q, k, v, out, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                      max_seqlen_k=max(lens), softmax_scale=0.088, lse=lse, config=cfg)
        return out, lse

    first = call()
    assert launcher.direct is True
    n = len(launcher._cache)
    second = call()
    assert len(launcher._cache) == n > 0
    monkeypatch.setattr(launcher, "direct", False)
    jit = call()
    torch.cuda.synchronize()
    for a, b, c in zip(first, second, jit):
        assert torch.equal(a, c) and torch.equal(b, c)
