"""One runner per implementation: ``make_<impl>(inputs) -> (fn, result)``; ``fn()`` launches the
attention once (what is timed) and ``result()`` returns its latest output as ``[T, Hq, Dv]``
(what is checked). A runner that cannot serve raises :class:`Unavailable` with the reason."""

from __future__ import annotations

import torch

__all__ = ["Unavailable", "RUNNERS", "make_ours", "make_ours_dense", "make_ours_mla"]


class Unavailable(RuntimeError):
    """This implementation cannot run this case here (the message says why)."""


def make_ours(x, **extra):
    """Our Triton ``paged_attention`` through the public op with ``backend="triton"``."""
    try:
        from aiter_attn import ops
        from aiter_attn.kernels.registry import KernelSelectionError
    except Exception as exc:  # pragma: no cover - the library itself is broken
        raise Unavailable(f"aiter_attn import failed: {exc!r}")
    out = torch.empty(x.q.shape[0], x.hq, x.d, dtype=x.q.dtype, device=x.q.device)
    kw = dict(cu_seqlens_q=x.cu_seqlens_q, seqused_k=x.seqused_k, block_table=x.block_table,
              softmax_scale=x.scale, causal=True, k_scale=x.k_scale, v_scale=x.v_scale,
              out=out, max_seqlen_q=x.q_len, max_seqlen_k=x.ctx, backend="triton", **extra)
    try:
        ops.paged_attention(x.q, x.k_cache, x.v_cache, **kw)
    except KernelSelectionError as exc:
        raise Unavailable(f"no triton paged_attention: {exc}")

    def fn():
        ops.paged_attention(x.q, x.k_cache, x.v_cache, **kw)

    return fn, lambda: out


def make_ours_dense(x):
    """A prefill row through the engine's extend path: the registry's Triton
    ``extend_attention``, planned once, given the step's new K/V contiguous as an engine
    has them at forward time (its ``dense_extend`` runs the dense kernel on them; on an
    H200 the warp-specialised Gluon kernel)."""
    if x.q_len != x.ctx or x.dense_k is None:
        raise Unavailable("dense extend: prefill rows with dense K/V only")
    from aiter_attn.kernels.base import LayerParams, _adhoc_metadata
    from aiter_attn.kernels.triton.extend import extend_attention_request
    from aiter_attn.plugins import kernel_registry

    req = extend_attention_request(x.q, x.k_cache, x.v_cache)
    kernel = kernel_registry().select(req, backend="triton").bind(req)
    md = _adhoc_metadata(x.q, x.k_cache, x.cu_seqlens_q, x.seqused_k, x.block_table, None,
                         None, x.q_len, x.ctx, "paged_attention")
    md.extras["max_prefix_len"] = 0
    plan = kernel.plan(md)
    if getattr(plan, "dense_cfg", None) is None:
        raise Unavailable("the extend plan took the paged kernel (dense_extend off)")
    k_new = x.dense_k.permute(0, 2, 1, 3).reshape(-1, x.hkv, x.d).contiguous()
    v_new = x.dense_v.permute(0, 2, 1, 3).reshape(-1, x.hkv, x.d).contiguous()
    params = LayerParams.create(scale=x.scale, device=x.q.device)
    out = torch.empty(x.q.shape[0], x.hq, x.d, dtype=x.q.dtype, device=x.q.device)
    cache = (x.k_cache, x.v_cache)

    def fn():
        kernel.run(x.q, cache, plan, params, out, k=k_new, v=v_new)

    fn()
    return fn, lambda: out


def _sdpa_layouts(x):
    """Dense q/k/v layouts for SDPA as ``(name, q, causal, enable_gqa)``. Decode has two: the
    GQA group packed into the query axis (each KV head read once by a 4-query problem) and
    ``enable_gqa`` with one query; the faster one is timed. Prefill uses ``enable_gqa``."""
    if x.dense_k is None:
        raise Unavailable("no dense bf16 copy for this row (fp8 cache)")
    full = x.q.view(x.bs, x.q_len, x.hq, x.d).transpose(1, 2)
    if x.q_len == 1:
        packed = x.q.view(x.bs, x.hkv, x.hq // x.hkv, x.d)  # query head h = kv·g + j
        return [("packed", packed, False, False), ("gqa", full, False, True)]
    return [("gqa", full, True, True)]


def _make_sdpa(x, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    import triton.testing as tt

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend]
    holder = {}
    best, errors = None, []
    for name, q, causal, gqa in _sdpa_layouts(x):
        def fn(q=q, causal=causal, gqa=gqa):
            with sdpa_kernel([be]):
                holder["o"] = F.scaled_dot_product_attention(
                    q, x.dense_k, x.dense_v, is_causal=causal, scale=x.scale, enable_gqa=gqa)

        try:
            fn()
            ms = tt.do_bench(fn, warmup=5, rep=15, return_mode="median")
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        if best is None or ms < best[0]:
            best = (ms, name, fn)
    if best is None:
        raise Unavailable(f"SDPA {backend}: " + "; ".join(errors))
    _, layout, fn = best
    fn()

    def result():
        o = holder["o"]
        if x.q_len == 1:
            return o.reshape(x.bs, x.hq, x.d)  # packed [B, Hkv, g, D] or gqa [B, Hq, 1, D]
        return o.transpose(1, 2).reshape(x.bs * x.q_len, x.hq, x.d)

    fn.layout = layout
    return fn, result


def make_cudnn(x):
    return _make_sdpa(x, "cudnn")


def make_fa2(x):
    return _make_sdpa(x, "fa2")


_FLEX = {}


def make_flex(x):
    """``flex_attention`` (compiled, no block mask for decode; causal block mask for prefill)."""
    if x.dense_k is None:
        raise Unavailable("no dense bf16 copy for this row (fp8 cache)")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as exc:
        raise Unavailable(f"flex_attention import: {exc!r}")
    if "fn" not in _FLEX:
        # static shapes (one compile per row): automatic dynamic shapes gave kernels 2-5x
        # slower than PERFORMANCE.md's flex numbers in the 2026-12-02 14:00 run
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    q = x.q.view(x.bs, x.q_len, x.hq, x.d).transpose(1, 2)
    block_mask = None
    if x.q_len > 1:
        def causal(b, h, qi, ki):
            return qi >= ki

        block_mask = create_block_mask(causal, None, None, x.q_len, x.ctx, device=x.q.device)
    holder = {}

    def fn():
        holder["o"] = flex(q, x.dense_k, x.dense_v, block_mask=block_mask, scale=x.scale,
                           enable_gqa=True)

    try:
        fn()
    except Exception as exc:
        raise Unavailable(f"flex_attention: {type(exc).__name__}: {str(exc)[:160]}")
    return fn, lambda: holder["o"].transpose(1, 2).reshape(x.bs * x.q_len, x.hq, x.d)


_AITER = {}


def configure_aiter(wheel):
    _AITER["wheel"] = wheel


def make_aiter(x):
    """The seed's Triton ``unified_attention`` from the ``amd-aiter`` wheel (paged, page 16)."""
    wheel = _AITER.get("wheel")
    if not wheel:
        raise Unavailable("amd-aiter wheel not found (pass --aiter-wheel or put it in .whl/)")
    if "fn" not in _AITER:
        try:
            from aiter_shim import load_unified_attention

            _AITER["fn"] = load_unified_attention(wheel)
        except Exception as exc:
            _AITER["fn"] = exc
    ua = _AITER["fn"]
    if isinstance(ua, Exception):
        raise Unavailable(f"aiter shim: {type(ua).__name__}: {str(ua)[:160]}")
    out = torch.empty(x.q.shape[0], x.hq, x.d, dtype=x.q.dtype, device=x.q.device)
    one = torch.ones((), dtype=torch.float32, device=x.q.device)
    ks = x.k_scale if x.k_scale is not None else one
    vs = x.v_scale if x.v_scale is not None else one

    def fn():
        ua(x.q, x.k_cache, x.v_cache, out, x.cu_seqlens_q, x.q_len, x.seqused_k, x.ctx,
           x.scale, True, (-1, -1), x.block_table, 0.0, None, ks, vs)

    try:
        fn()
    except Exception as exc:
        raise Unavailable(f"aiter unified_attention: {type(exc).__name__}: {str(exc)[:160]}")
    return fn, lambda: out


def make_ours_mla(x, **launch):
    from aiter_attn import ops

    out = torch.empty(x.bs, x.heads, x.rank, dtype=x.q.dtype, device=x.q.device)
    kw = dict(kv_lora_rank=x.rank, cu_seqlens_q=x.cu_seqlens_q, seqused_k=x.seqused_k,
              block_table=x.block_table, softmax_scale=x.scale, kv_scale=x.kv_scale, out=out,
              max_seqlen_q=1, max_seqlen_k=x.ctx)
    if launch:
        from aiter_attn.kernels.triton.mla import mla_paged_attention

        def fn():
            mla_paged_attention(x.q, x.kv_cache, out, **{k: v for k, v in kw.items()
                                                         if k != "out"}, **launch)
    else:
        def fn():
            ops.mla_paged_attention(x.q, x.kv_cache, backend="triton", **kw)
    fn()
    return fn, lambda: out


def planned_mla(x, tuning: dict, buffers=None, name: str = "bench"):
    """``(kernel, params, plan)``: a ``TritonMLA`` built with ``tuning`` over ``x``
    (:func:`_inputs.make_mla`'s decode rows), its layer parameters, and one step's plan
    (``buffers``: the static-buffer dict a graph manager passes ``plan``, or ``None``)."""
    from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    kernel = TritonMLA(mla_request(x.q, x.kv_cache, x.rank), tuning)
    md = _adhoc_metadata(x.q, x.kv_cache, x.cu_seqlens_q, x.seqused_k, x.block_table, None,
                         None, 1, x.ctx, name)
    params = mla_layer_params(scale=x.scale, device=x.q.device, kv_lora_rank=x.rank,
                              num_q_heads=x.heads, head_dim=x.q.shape[2],
                              kv_scale=x.kv_scale, fp8=x.kv_cache.dtype != x.q.dtype)
    return kernel, params, kernel.plan(md, buffers)


def make_ours_mla_planned(x, **tuning):
    """Our MLA as an engine runs it: a ``TritonMLA`` built with ``tuning``, its plan made
    once, each call only ``run`` (what a graph captures). For tunings whose plan keeps
    state across steps (``balanced_rates``: the slot weights and claims, made at plan
    time, outside a capture)."""
    out = torch.empty(x.bs, x.heads, x.rank, dtype=x.q.dtype, device=x.q.device)
    kernel, params, plan = planned_mla(x, tuning)

    def fn():
        kernel.run(x.q, (x.kv_cache,), plan, params, out)
    fn()
    return fn, lambda: out


def capture_steps(step, steps: int, *, warm: bool = True):
    """A CUDA graph of ``step(r)`` for ``r`` in ``0 .. steps - 1`` (each run once first when
    ``warm``: compiles, launch keys), ready to replay."""
    if warm:
        for r in range(steps):
            step(r)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(steps):
            step(r)
    return graph


def make_ours_batch_invariant(x):
    """:func:`make_ours` in batch-invariant mode (``--anchors ours-bi,...``: its cost)."""
    return make_ours(x, batch_invariant=True)


RUNNERS = {
    "ours": make_ours,
    "ours-dense": make_ours_dense,
    "ours-bi": make_ours_batch_invariant,
    "cudnn": make_cudnn,
    "fa2": make_fa2,
    "flex": make_flex,
    "aiter": make_aiter,
}
