"""Kernels as plan/run objects (the FlashInfer ``plan``/``run`` split carried down to kernels).

A kernel object is bound once per (op, :class:`~aiter_attn.kernels.registry.KernelRequest`),
i.e. once per strategy pair and layer group, and then used in three phases::

    kernel = registry.select(request).bind(request)     # once per (mode, layer group)
    params = LayerParams.from_spec(layer, device, fp8)  # once per layer (frozen)
    kplan  = kernel.plan(md, out=static or None)        # once per step (frozen)
    kernel.run(q, cache, kplan, params, out)            # once per layer: launch only

``plan`` holds everything batch-dependent (split counts, grid and launch configuration,
workspaces, index layouts); ``run`` does O(1) shape checks and launches. Under CUDA graphs
``plan`` receives the graph manager's static buffer dict as ``out`` and must place every
tensor it keeps in it (declared up front by :meth:`AttentionKernel.buffer_spec`, or added
once with ``out.setdefault``), so a replay's plan has the capture's addresses.

Plain functions in the keyword convention of
:func:`aiter_attn.kernels.reference.paged_attention_reference` are still accepted by
``register``: :class:`FunctionKernel` adapts them (its plan keeps the metadata's tensors, its
run makes the one keyword call).
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch

from ..types import CGSupport
from ..validation import check_scale, unit_stride

__all__ = [
    "LayerParams",
    "KernelPlan",
    "AttentionKernel",
    "FunctionKernel",
    "MLAKernel",
    "MLAFunctionKernel",
    "mla_layer_params",
    "mla_request",
    "StepPlans",
    "MEMO",
    "ATTENTION_OPS",
    "mask_literal",
    "plan_hints",
    "token_count_error",
]

#: Ops whose implementations are attention kernels (``run(q, cache, plan, params, out)``;
#: ``cache`` is ``(k_cache, v_cache)``, or ``(kv_cache,)`` for ``mla_paged_attention``;
#: ``extend_attention`` also takes the step's new ``k=``/``v=``); every other op stays a
#: plain function.
ATTENTION_OPS = frozenset({"paged_attention", "paged_attention_5d", "mla_paged_attention",
                           "extend_attention"})


def _scale_tensor(value, device) -> torch.Tensor:
    check_scale("scale", value)  # one number: a per-head tensor is refused, never truncated
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(1)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


@attrs.frozen(kw_only=True, slots=True)
class LayerParams:
    """Per-layer constants of an attention call, normalised once (frozen).

    Attributes:
        scale: softmax scale (float).
        window: flash-attn ``(left, right)`` window, ``(-1, -1)`` unbounded.
        softcap: soft-cap (0 disables).
        causal: mask keys after each query (False for cross attention).
        sinks: float32 ``[num_q_heads]`` device tensor or ``None``.
        k_scale / v_scale: the fp8 dequantisation scales as given (floats or tensors), for
            kernels that take them as values.
        k_scale_t / v_scale_t: the same as 1-element float32 device tensors (made once).
        has_scales: the cache is fp8: kernels apply the scales (never on other caches).
        num_q_heads, num_kv_heads, head_dim, v_head_dim: the layer's shape on this rank.
        k_scale_cache / v_scale_cache: per-(token, head) scales of the layer's fp8 cache,
            float32 ``[pages, page_size, kv_heads]`` (the pool's buffers, fixed addresses), or
            ``None``; applied on top of the layer scales (:mod:`aiter_attn.kv_scales`).
    """

    scale: float
    window: tuple = (-1, -1)
    softcap: float = 0.0
    causal: bool = True
    sinks: Optional[torch.Tensor] = attrs.field(default=None, eq=False, repr=False)
    k_scale: Any = 1.0
    v_scale: Any = 1.0
    k_scale_t: Optional[torch.Tensor] = attrs.field(default=None, eq=False, repr=False)
    v_scale_t: Optional[torch.Tensor] = attrs.field(default=None, eq=False, repr=False)
    has_scales: bool = False
    num_q_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    k_scale_cache: Optional[torch.Tensor] = attrs.field(default=None, eq=False, repr=False)
    v_scale_cache: Optional[torch.Tensor] = attrs.field(default=None, eq=False, repr=False)

    @property
    def token_scales(self) -> bool:
        """Per-(token, head) scale caches are attached."""
        return self.k_scale_cache is not None

    def scale_cache_kwargs(self) -> dict:
        """``{"k_scale_cache": …, "v_scale_cache": …}`` when attached, else ``{}`` (functions
        that do not declare the feature never see the keywords)."""
        if self.k_scale_cache is None:
            return {}
        return {"k_scale_cache": self.k_scale_cache, "v_scale_cache": self.v_scale_cache}

    @classmethod
    def create(cls, *, scale, device, window=(-1, -1), softcap=0.0, causal=True, sinks=None,
               k_scale=None, v_scale=None, fp8=False, num_q_heads=0, num_kv_heads=0,
               head_dim=0, v_head_dim=0, k_scale_cache=None,
               v_scale_cache=None) -> "LayerParams":
        """Normalise the constants once: floats, tuples, device scale tensors (k/v scales
        must be single numbers), sinks with unit stride (the kernels index them so). k/v
        scales dequantise fp8 caches only (:func:`aiter_attn.types.kv_dequant_scales`): with
        ``fp8=False`` they are dropped. ``k_scale_cache``/``v_scale_cache``: per-(token,
        head) scales (fp8 only: refused on other caches, where nothing is quantised)."""
        if (k_scale_cache is not None or v_scale_cache is not None) and not fp8:
            raise ValueError(
                "k_scale_cache/v_scale_cache given for a cache that is not fp8: per-(token, "
                "head) scales dequantise fp8 caches only.")
        if (k_scale_cache is None) != (v_scale_cache is None):
            raise ValueError("k_scale_cache and v_scale_cache go together; pass both or neither.")
        check_scale("k_scale", k_scale)
        check_scale("v_scale", v_scale)
        sinks = unit_stride(sinks)
        if not fp8:
            k_scale = v_scale = None
        has_scales = bool(fp8) or any(
            s is not None and (isinstance(s, torch.Tensor) or float(s) != 1.0)
            for s in (k_scale, v_scale))
        ks = 1.0 if k_scale is None else k_scale
        vs = 1.0 if v_scale is None else v_scale
        return cls(
            scale=float(scale), window=(int(window[0]), int(window[1])), softcap=float(softcap),
            causal=bool(causal), sinks=sinks, k_scale=ks, v_scale=vs,
            k_scale_t=_scale_tensor(ks, device) if has_scales else None,
            v_scale_t=_scale_tensor(vs, device) if has_scales else None,
            has_scales=has_scales, num_q_heads=int(num_q_heads),
            num_kv_heads=int(num_kv_heads), head_dim=int(head_dim), v_head_dim=int(v_head_dim),
            k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)

    @classmethod
    def from_spec(cls, layer, device, *, fp8: bool = False, sinks=None, window=None,
                  causal=None, kv_scales=None) -> "LayerParams":
        """The params of a :class:`~aiter_attn.types.LayerSpec` (``sinks``/``window``/
        ``causal`` override the spec's: a strategy folding a window into a tree mask passes
        ``window=(-1, -1)``; ``kv_scales``: the pool's per-(token, head) ``(k_scales,
        v_scales)`` of the layer, or ``None``)."""
        ksc, vsc = kv_scales if kv_scales is not None else (None, None)
        return cls.create(
            scale=layer.scaling, device=device,
            window=layer.window_size() if window is None else window,
            softcap=layer.logit_cap,
            causal=layer.is_causal if causal is None else causal,
            sinks=layer.sinks if sinks is None else sinks,
            k_scale=layer.k_scale, v_scale=layer.v_scale, fp8=fp8,
            num_q_heads=layer.num_q_heads, num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim, v_head_dim=layer.v_head_dim, k_scale_cache=ksc,
            v_scale_cache=vsc)

    def with_sinks(self, sinks) -> "LayerParams":
        return attrs.evolve(self, sinks=unit_stride(sinks))


#: attrs field metadata of a kernel plan's memo (filled lazily by ``run``, never read by a
#: graph): left out of the CUDA-graph replay signature. ``attrs.field(metadata=MEMO)``.
MEMO = {"graph_signature": False}


@attrs.frozen(kw_only=True)
class KernelPlan:
    """The base of every kernel's per-step plan (frozen). Kernels subclass it.

    Attributes:
        num_tokens: query tokens the plan was made for (``run`` checks ``q`` against it).
        mask_literal: a planned tree mask is applied literally (the kernel runs non-causal
            and the mask alone says what each query sees: the strategies' convention); a
            functional call keeps the ``causal`` it was given.
    """

    num_tokens: int
    mask_literal: bool = False


def token_count_error(kernel_name: str, num_tokens: int, plan: "KernelPlan") -> ValueError:
    """The error of a ``run`` whose ``q`` holds ``num_tokens`` tokens while ``plan`` was made
    for ``plan.num_tokens`` (every kernel's O(1) check raises this one)."""
    return ValueError(f"{kernel_name}: q has {num_tokens} tokens but the plan was made for "
                      f"{plan.num_tokens}; plan this step's metadata first.")


class StepPlans:
    """One step's kernel plans by layer-group key (on
    :class:`~aiter_attn.metadata.AttnMetadata`).

    The graph signature (:mod:`aiter_attn.graph.signature`) walks :meth:`frozen_plans`: each
    plan's device tensors are compared by address between capture and replay, so a kernel
    whose plan allocates under ``out=`` (instead of placing its tensors in the static
    buffers) raises :class:`~aiter_attn.graph.GraphMetadataMismatch` at the first replay.

    Attributes:
        out: the static buffer dict under CUDA graphs (the kernels' plans place their
            tensors in it), else ``None`` (eager).
        batch: the batch the step's metadata was planned for.
    """

    __slots__ = ("plans", "out", "batch")

    def __init__(self):
        self.plans: dict = {}
        self.out: Optional[dict] = None
        self.batch = None

    def get(self, key):
        return self.plans.get(key)

    def __setitem__(self, key, value):
        self.plans[key] = value

    def __len__(self):
        return len(self.plans)

    def frozen_plans(self) -> list:
        """The plans in planning order (what a captured graph reads of them)."""
        return list(self.plans.values())


class AttentionKernel:
    """Base of attention kernel objects (op ``paged_attention`` / ``paged_attention_5d``).

    A subclass is registered through the ``aiter_attn_register_kernels`` hook in place of a
    function; the registry calls ``cls(request)`` to bind it (once per layer group). Class
    attributes ``name``/``capabilities`` are set by the registry from the registration.

    Methods:
        buffer_spec(limits): static buffers the kernel's plans need under CUDA graphs
            (``name → (shape, dtype)`` in a :class:`~aiter_attn.strategies.base.BufferSpec`),
            merged by :class:`~aiter_attn.graph.CudaGraphManager` into its static buffers.
        plan(md, out=None): one step's :class:`KernelPlan` from
            :class:`~aiter_attn.metadata.AttnMetadata` (``out``: static buffers or ``None``).
        run(q, cache, plan, params, out, lse=None): launch. ``q`` ``[T, Hq, D]``, ``cache``
            the op's cache tensors (``(k_cache, v_cache)``), ``params`` :class:`LayerParams`,
            ``out`` ``[T, Hq, Dv]``; ``lse`` optional float32 ``[T, Hq]`` (kernels declaring
            the ``lse`` feature). Returns ``out``.
    """

    name: str = "?"
    op: str = "paged_attention"
    capabilities = None  # set by the registry

    def __init__(self, request=None):
        self.request = request

    @property
    def cg_support(self) -> CGSupport:
        caps = self.capabilities
        return caps.cg_support if caps is not None else CGSupport.NEVER

    def buffer_spec(self, limits):
        from ..strategies.base import BufferSpec

        return BufferSpec({})

    def plan(self, md, out: Optional[dict] = None) -> KernelPlan:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, q, cache, plan, params: LayerParams, out,
            lse=None):  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, q, k_cache, v_cache, out, *, cu_seqlens_q, seqused_k, block_table,
                 softmax_scale, causal=True, window_size=(-1, -1), softcap=0.0, sinks=None,
                 k_scale=None, v_scale=None, custom_mask=None, mask_indptr=None,
                 max_seqlen_q=None, max_seqlen_k=None, lse=None, k_scale_cache=None,
                 v_scale_cache=None):
        """The functional keyword convention (one-off calls): plan from the arguments, run.
        ``k_scale_cache``/``v_scale_cache``: per-(token, head) scales (kernels declaring the
        ``kv_scale_per_token_head`` feature; checked here)."""
        md = _adhoc_metadata(q, k_cache, cu_seqlens_q, seqused_k, block_table, custom_mask,
                             mask_indptr, max_seqlen_q, max_seqlen_k, self.op)
        from ..kv_scales import check_token_scale_caches
        from ..types import FP8_DTYPES

        check_token_scale_caches(k_cache, v_cache, k_scale_cache, v_scale_cache)
        params = LayerParams.create(
            scale=softmax_scale, device=q.device, window=window_size, softcap=softcap,
            causal=causal, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
            fp8=k_cache.dtype in FP8_DTYPES, k_scale_cache=k_scale_cache,
            v_scale_cache=v_scale_cache)
        return self.run(q, (k_cache, v_cache), self.plan(md), params, out, lse=lse)


def _page_size_of(k_cache, op: str) -> int:
    return k_cache.shape[3] if op == "paged_attention_5d" else k_cache.shape[1]


def _adhoc_metadata(q, k_cache, cu_seqlens_q, seqused_k, block_table, custom_mask, mask_indptr,
                    max_seqlen_q, max_seqlen_k, op):
    """An :class:`AttnMetadata` around the index tensors of one functional call (host hints
    ``None`` become static bounds: ``num_tokens`` queries, the table's width in keys)."""
    from ..metadata import AttnMetadata, CustomMask, PageTable, QueryLayout
    from ..types import ForwardMode

    page_size = _page_size_of(k_cache, op)
    num_tokens = q.shape[0]
    query = QueryLayout(cu_seqlens_q=cu_seqlens_q,
                        max_seqlen_q=num_tokens if max_seqlen_q is None else int(max_seqlen_q),
                        num_tokens=num_tokens)
    pages = PageTable(block_table=block_table, seqused_k=seqused_k,
                      max_seqlen_k=(block_table.shape[1] * page_size if max_seqlen_k is None
                                    else int(max_seqlen_k)),
                      page_size=page_size)
    mask = None if custom_mask is None else CustomMask(custom_mask=custom_mask,
                                                       mask_indptr=mask_indptr)
    # a functional call passes its host hints exactly as given (None = unknown) and its
    # ``causal`` literally, mask or not (``adhoc``)
    return AttnMetadata(mode=ForwardMode.EXTEND, batch_size=cu_seqlens_q.shape[0] - 1,
                        query=query, pages=pages, mask=mask,
                        extras={"adhoc": True, "max_seqlen_q_hint": max_seqlen_q,
                                "max_seqlen_k_hint": max_seqlen_k})


@attrs.frozen(kw_only=True)
class FunctionPlan(KernelPlan):
    """:class:`FunctionKernel`'s plan: the metadata's tensors and host hints."""

    cu_seqlens_q: torch.Tensor = attrs.field(eq=False, repr=False)
    seqused_k: torch.Tensor = attrs.field(eq=False, repr=False)
    block_table: torch.Tensor = attrs.field(eq=False, repr=False)
    custom_mask: Optional[torch.Tensor] = attrs.field(default=None, eq=False, repr=False)
    mask_indptr: Optional[torch.Tensor] = attrs.field(default=None, eq=False, repr=False)
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None


def mask_literal(md) -> bool:
    """Whether a plan of ``md`` runs its mask literally (non-causal): a strategy's plan with
    a mask; never a functional call's."""
    return md.mask is not None and not md.extras.get("adhoc", False)


def plan_hints(md):
    """``(max_seqlen_q, max_seqlen_k)`` host hints of ``md`` (``None`` where a functional
    call gave none)."""
    ex = md.extras
    if "max_seqlen_q_hint" in ex:
        return ex["max_seqlen_q_hint"], ex["max_seqlen_k_hint"]
    return md.query.max_seqlen_q, md.pages.max_seqlen_k


class FunctionKernel(AttentionKernel):
    """Adapts a function in the 17-keyword convention to plan/run (the reference, and
    plugins that register plain functions). ``plan`` keeps the step's tensors; ``run`` makes
    the keyword call."""

    fn = None  # set per registration

    def plan(self, md, out=None) -> FunctionPlan:
        mq, mk = plan_hints(md)
        mask = md.mask
        return FunctionPlan(
            num_tokens=md.query.num_tokens, mask_literal=mask_literal(md),
            cu_seqlens_q=md.query.cu_seqlens_q, seqused_k=md.pages.seqused_k,
            block_table=md.pages.block_table,
            custom_mask=None if mask is None else mask.custom_mask,
            mask_indptr=None if mask is None else mask.mask_indptr,
            max_seqlen_q=mq, max_seqlen_k=mk)

    def run(self, q, cache, plan, params, out, lse=None):
        if q.shape[0] != plan.num_tokens:  # O(1): a stale plan would index past q or skip rows
            raise token_count_error(self.name, q.shape[0], plan)
        k_cache, v_cache = cache
        causal = params.causal and not plan.mask_literal
        extra = {} if lse is None else {"lse": lse}  # functions without the feature lack it
        extra.update(self._flags())
        extra.update(params.scale_cache_kwargs())
        return type(self).fn(
            q, k_cache, v_cache, out,
            cu_seqlens_q=plan.cu_seqlens_q, seqused_k=plan.seqused_k,
            block_table=plan.block_table, softmax_scale=params.scale, causal=causal,
            window_size=params.window, softcap=params.softcap, sinks=params.sinks,
            k_scale=params.k_scale, v_scale=params.v_scale, custom_mask=plan.custom_mask,
            mask_indptr=plan.mask_indptr, max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k, **extra)

    def __call__(self, q, k_cache, v_cache, out, **kwargs):
        return type(self).fn(q, k_cache, v_cache, out, **kwargs, **self._flags())

    def _flags(self) -> dict:
        """``batch_invariant=True`` when bound to a request with that feature (only functions
        declaring it are selected for such requests); nothing otherwise."""
        req = self.request
        if req is not None and "batch_invariant" in req.features:
            return {"batch_invariant": True}
        return {}


def mla_layer_params(*, scale, device, kv_lora_rank: int, num_q_heads: int = 0,
                     head_dim: int = 0, kv_scale=None, fp8: bool = False,
                     causal: bool = True) -> LayerParams:
    """The :class:`LayerParams` of an absorbed-MLA layer: one latent KV head, values its first
    ``kv_lora_rank`` dims (``v_head_dim``), ``kv_scale`` the fp8 dequantisation scale of keys
    and values alike (``k_scale``/``v_scale``; dropped unless ``fp8``)."""
    return LayerParams.create(scale=scale, device=device, causal=causal, k_scale=kv_scale,
                              v_scale=kv_scale, fp8=fp8, num_q_heads=num_q_heads,
                              num_kv_heads=1, head_dim=head_dim, v_head_dim=kv_lora_rank)


def mla_request(q, kv_cache, kv_lora_rank: int, *, custom_mask: bool = False,
                lse: bool = False, batch_invariant: bool = False, causal: bool = True):
    """The :class:`~aiter_attn.kernels.registry.KernelRequest` of an ``mla_paged_attention``
    call on these tensors (the key :func:`aiter_attn.ops.mla_paged_attention` builds)."""
    from .registry import KernelRequest
    from ..types import FP8_DTYPES

    features = {"fp8"} if kv_cache.dtype in FP8_DTYPES else set()
    for name, on in (("custom_mask", custom_mask), ("lse", lse),
                     ("batch_invariant", batch_invariant), ("non_causal", not causal)):
        if on:
            features.add(name)
    return KernelRequest(
        op="mla_paged_attention", device=q.device.type, dtype=q.dtype, kv_dtype=kv_cache.dtype,
        head_dim=q.shape[2], v_head_dim=kv_lora_rank, page_size=kv_cache.shape[1],
        features=features, extra=(("heads", q.shape[1]),))


class MLAKernel(AttentionKernel):
    """Base of ``mla_paged_attention`` kernel objects (absorbed MLA over a latent cache).

    The plan/run shape of :class:`AttentionKernel`, with ``cache = (kv_cache,)``: kv_cache
    ``[pages, page_size, 1, kv_lora_rank + rope]``; q ``[T, H, kv_lora_rank + rope]``; out
    ``[T, H, kv_lora_rank]``; ``params`` from :func:`mla_layer_params` (``params.k_scale`` /
    ``k_scale_t`` is the latent cache's fp8 scale, ``params.v_head_dim`` the ``kv_lora_rank``).
    ``__call__`` is the op's functional keyword convention (that of
    :func:`aiter_attn.kernels.reference.mla_paged_attention_reference`).
    """

    op = "mla_paged_attention"

    def __call__(self, q, kv_cache, out, *, kv_lora_rank, cu_seqlens_q, seqused_k, block_table,
                 softmax_scale, causal=True, kv_scale=None, custom_mask=None, mask_indptr=None,
                 max_seqlen_q=None, max_seqlen_k=None, lse=None, batch_invariant=False):
        """One functional call: plan from the arguments, run. An unbound kernel (the
        registration's functional convenience, ``Selection.fn``) is first bound to this call's
        request, so ``batch_invariant=True`` (and lse, mask, causality) reach its plan."""
        from ..types import FP8_DTYPES

        if self.request is None:
            req = mla_request(q, kv_cache, kv_lora_rank, custom_mask=custom_mask is not None,
                              lse=lse is not None, batch_invariant=batch_invariant,
                              causal=causal)
            return type(self)(req)(
                q, kv_cache, out, kv_lora_rank=kv_lora_rank, cu_seqlens_q=cu_seqlens_q,
                seqused_k=seqused_k, block_table=block_table, softmax_scale=softmax_scale,
                causal=causal, kv_scale=kv_scale, custom_mask=custom_mask,
                mask_indptr=mask_indptr, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                lse=lse, batch_invariant=batch_invariant)
        md = _adhoc_metadata(q, kv_cache, cu_seqlens_q, seqused_k, block_table, custom_mask,
                             mask_indptr, max_seqlen_q, max_seqlen_k, self.op)
        params = mla_layer_params(scale=softmax_scale, device=q.device,
                                  kv_lora_rank=kv_lora_rank, num_q_heads=q.shape[1],
                                  head_dim=q.shape[2], kv_scale=kv_scale,
                                  fp8=kv_cache.dtype in FP8_DTYPES, causal=causal)
        return self.run(q, (kv_cache,), self.plan(md), params, out, lse=lse)


class MLAFunctionKernel(FunctionKernel):
    """:class:`FunctionKernel` for ``mla_paged_attention``: run makes the MLA keyword call
    (``fn(q, kv_cache, out, kv_lora_rank=…, …)``)."""

    op = "mla_paged_attention"

    def run(self, q, cache, plan, params, out, lse=None):
        if q.shape[0] != plan.num_tokens:
            raise token_count_error(self.name, q.shape[0], plan)
        extra = {} if lse is None else {"lse": lse}
        extra.update(self._flags())
        return type(self).fn(
            q, cache[0], out, kv_lora_rank=out.shape[-1],
            cu_seqlens_q=plan.cu_seqlens_q, seqused_k=plan.seqused_k,
            block_table=plan.block_table, softmax_scale=params.scale,
            causal=params.causal and not plan.mask_literal,
            kv_scale=params.k_scale if params.has_scales else None,
            custom_mask=plan.custom_mask, mask_indptr=plan.mask_indptr,
            max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k, **extra)

    def __call__(self, *args, **kwargs):
        flags = {k: v for k, v in self._flags().items() if k not in kwargs}
        return type(self).fn(*args, **kwargs, **flags)


def function_kernel(fn, op: str) -> type:
    """A :class:`FunctionKernel` subclass around ``fn`` (one per registration;
    :class:`MLAFunctionKernel` for ``mla_paged_attention``)."""
    base = MLAFunctionKernel if op == "mla_paged_attention" else FunctionKernel
    return type(f"{base.__name__}[{getattr(fn, '__name__', 'fn')}]", (base,),
                {"fn": staticmethod(fn), "op": op})
