"""MLA (DeepSeek-V2/V3 multi-head latent attention) strategies for every forward mode.

The KV pool is an :class:`~aiter_attn.kvcache.MLAKVPool`: per layer one latent cache
``[num_pages, page_size, 1, kv_lora_rank + rope_dim]`` holding ``[c_kv, k_pe]`` per token.

How a layer hands things in
---------------------------
One attention layer has two :class:`~aiter_attn.LayerSpec` forms with the same ``layer_id``
(build both with :func:`mla_layer_specs`). The form is told apart by ``v``:

* **absorbed** (``v is None``; every mode). Spec: ``num_kv_heads=1``,
  ``head_dim = kv_lora_rank + rope_dim``, ``v_head_dim = kv_lora_rank``. Call
  ``forward(q, k, None, layer, batch)`` with

  - q ``[T, H, kv_lora_rank + rope_dim]`` (or flat ``[T, H * …]``) = ``[q_nope · W_UK, q_pe]``
    (:func:`absorb_q`),
  - k ``[T, 1, kv_lora_rank + rope_dim]`` = the new tokens' ``[c_kv, k_pe]``; written to the
    latent pool at ``out_cache_loc`` (fp8: divided by ``layer.k_scale``) unless
    ``save_kv_cache=False``.

  It returns the latent output ``[T, H * kv_lora_rank]`` through
  :func:`aiter_attn.ops.mla_paged_attention`'s kernel; the caller applies W_UV
  (:func:`apply_w_uv`). Tree verify applies ``spec_info.custom_mask`` literally.
* **expanded** (``v`` given; EXTEND and DRAFT_EXTEND only). Spec: ``num_kv_heads = H``,
  ``head_dim = qk_nope + rope_dim``, ``v_head_dim`` = the model's. Call
  ``forward(q, k, v, layer, batch, save_kv_cache=False)`` with q/k ``[T, H, qk_nope + rope_dim]``
  and v ``[T, H, v_head_dim]`` of the new tokens: ordinary causal attention with qk head dim ≠
  v head dim. Cached prefix tokens are read from the latent pool and expanded through the
  layer's ``kv_b_proj``, which the engine hands in as
  ``AttentionBackend(..., extra={"mla_projections": {layer_id: kv_b_proj}})``
  (``StrategyContext.extra``; LayerSpec is a frozen hashable value, so weights stay out of it):
  a callable ``c_kv [N, kv_lora_rank] → [N, H * (qk_nope + v_head_dim)]``, per head k_nope then v
  (DeepSeek's layout; an SGLang-style ``(out, bias)`` tuple result is accepted;
  :func:`kv_b_proj_from_weights` builds one). The expanded form never writes the pool (it holds
  latents, not per-head K/V): store the step's latent with
  :meth:`~aiter_attn.kvcache.MLAKVPool.write_latent` and pass ``save_kv_cache=False``.
  A batch with a prefix and no projection raises; use the absorbed form there instead.

Head padding
------------
Some MLA kernels need ≥ 16 query heads (aiter's ``mla_decode_fwd``). A kernel says so as data:
its ``Capabilities.predicate`` rejects a request whose ``extra`` ``("heads", H)`` it cannot
serve. :class:`HeadPadding` (``extra={"mla_head_padding": HeadPadding(...)}``) then decides:
heads 4 and 8 are repeat-interleaved to 16 when that reaches a better kernel (``"auto"``), and the
output keeps every ``16 // H``-th head, so padding never changes results.

Planning: decode-like modes reuse :func:`~aiter_attn.strategies.mha.plan_query_layout` and
:func:`~aiter_attn.strategies.mha.plan_page_table`, make no device→host sync and plan into
static buffers with the same ``plan(out=)`` (``buffer_spec`` declares them).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import attrs
import torch

from .. import ops
from ..batch import ForwardBatch
from ..hookspecs import hookimpl
from ..kernels.base import mla_layer_params
from ..kernels.registry import KernelRequest, KernelSelectionError, Selection
from ..metadata import AttnMetadata, PageTable
from ..registry import Cell, register_cells
from ..types import FP8_DTYPES, AttnArch, CGSupport, ForwardMode, LayerSpec, kv_dequant_scales
from .base import BufferSpec, ExecutionStrategy, KernelGroup, MetadataStrategy
from .common import attend_layer
from .mha import (DecodeMetadata, PagedMetadata, plan_page_table, plan_query_layout,
                  write_kv_request)
from .spec import (DraftDecodeStepMetadata, DraftExtendV2Metadata, VerifyTreeMetadata,
                   check_batch_topk, config_topk, resolve_num_draft_tokens)

__all__ = [
    "MLA_PROJECTIONS_KEY",
    "MLA_HEAD_PADDING_KEY",
    "MLA_DENSE_PAGES_KEY",
    "MLA_DRAFT_DECODE_STEP",
    "HeadPadding",
    "MLAPrefixPlan",
    "MLADecodeMetadata",
    "MLAVerifyMetadata",
    "MLADraftExtendV2Metadata",
    "MLAExtendMetadata",
    "MLAExecution",
    "mla_layer_specs",
    "mla_kernel_request",
    "select_mla_kernel",
    "kv_b_proj_from_weights",
    "absorb_q",
    "apply_w_uv",
]

log = logging.getLogger(__name__)

#: ``StrategyContext.extra`` key: ``{layer_id: kv_b_proj}`` for the expanded EXTEND form.
MLA_PROJECTIONS_KEY = "mla_projections"
#: ``AttnMetadata.extras`` key of the expanded form's page table over the dense
#: ``[prefix ; new]`` K/V rows (page size 1; :class:`MLAExtendMetadata`).
MLA_DENSE_PAGES_KEY = "mla_dense_pages"
#: ``StrategyContext.extra`` key: a :class:`HeadPadding` (default ``HeadPadding()``).
MLA_HEAD_PADDING_KEY = "mla_head_padding"
#: Strategy pair for one step of multi-step draft decode on MLA (the MHA one is
#: :data:`aiter_attn.strategies.spec.DRAFT_DECODE_STEP`).
MLA_DRAFT_DECODE_STEP = "mla.draft_decode_step"

_EXTEND_MODES = (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)


# --------------------------------------------------------------------------- layer helpers
def mla_layer_specs(layer_id: int, *, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                    qk_rope_head_dim: int, v_head_dim: int, scaling: float,
                    kv_scale: float = 1.0) -> tuple[LayerSpec, LayerSpec]:
    """``(absorbed, expanded)`` LayerSpecs of one MLA layer (see the module docstring).

    ``scaling`` (required) is the model's softmax scale, the same for both forms (absorption
    changes the dot product's factorisation, not its value): for DeepSeek-V2/V3
    ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale ** 2`` when YaRN rope
    scaling is on (HF's ``DeepseekV3Attention.scaling``, SGLang's ``self.scaling``); never
    ``1 / sqrt(kv_lora_rank + rope)``, the absorbed head dim. ``kv_scale`` is the latent
    cache's fp8 dequantisation scale (``LayerSpec.k_scale``; ignored when the cache is not
    fp8).
    """
    common = dict(layer_id=layer_id, num_q_heads=num_heads, scaling=scaling, k_scale=kv_scale,
                  v_scale=kv_scale, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
    absorbed = LayerSpec(num_kv_heads=1, head_dim=kv_lora_rank + qk_rope_head_dim,
                         v_head_dim=kv_lora_rank, **common)
    expanded = LayerSpec(num_kv_heads=num_heads, head_dim=qk_nope_head_dim + qk_rope_head_dim,
                         v_head_dim=v_head_dim, **common)
    return absorbed, expanded


def kv_b_proj_from_weights(w_uk: torch.Tensor, w_uv: torch.Tensor) -> Callable:
    """A kv_b_proj callable from per-head weights.

    Args:
        w_uk: ``[H, qk_nope, kv_lora_rank]``: ``k_nope[n, h] = w_uk[h] @ c_kv[n]``.
        w_uv: ``[H, v_head_dim, kv_lora_rank]``: ``v[n, h] = w_uv[h] @ c_kv[n]``.

    Returns:
        ``c_kv [N, kv_lora_rank] → [N, H * (qk_nope + v_head_dim)]`` in ``c_kv``'s dtype.
    """
    weight = torch.cat([w_uk, w_uv], dim=1)  # [H, nope + Dv, L]

    def kv_b_proj(c_kv: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("nl,hdl->nhd", c_kv, weight.to(c_kv.dtype))
        return out.reshape(c_kv.shape[0], -1)

    return kv_b_proj


def absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_nope [T, H, qk_nope] · w_uk [H, qk_nope, kv_lora_rank] → [T, H, kv_lora_rank]``."""
    return torch.einsum("thd,hdl->thl", q_nope, w_uk.to(q_nope.dtype))


def apply_w_uv(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``o_latent [T, H, kv_lora_rank]`` through ``w_uv [H, v_head_dim, kv_lora_rank]`` →
    ``[T, H, v_head_dim]`` (the absorbed path's value up-projection)."""
    return torch.einsum("thl,hdl->thd", o_latent, w_uv.to(o_latent.dtype))


# --------------------------------------------------------------------------- head padding
@attrs.frozen(kw_only=True)
class HeadPadding:
    """When absorbed-MLA query heads are padded for a kernel that needs more heads.

    Attributes:
        pad_to: head count to pad to (16: the smallest head count of aiter's MLA decode).
        pad_from: head counts that may be padded (4 and 8, as the seed does); each query head
            is repeated ``pad_to // H`` times and the output keeps every ``pad_to // H``-th head.
        policy: ``"auto"`` pads when the best kernel for ``pad_to`` heads has a higher priority
            than the best for ``H`` heads, or ``H`` cannot be served at all; ``"always"`` pads
            whenever ``H`` is in ``pad_from``; ``"never"`` does not pad.
    """

    pad_to: int = 16
    pad_from: frozenset = attrs.field(default=frozenset({4, 8}), converter=frozenset)
    policy: str = attrs.field(default="auto",
                              validator=attrs.validators.in_(("auto", "always", "never")))

    def __attrs_post_init__(self):
        if type(self.pad_to) is not int or self.pad_to < 1:
            raise ValueError(
                f"HeadPadding.pad_to={self.pad_to!r}; must be a positive int (the head count "
                "the kernel needs, e.g. 16 for aiter's MLA decode). Pass pad_to=16, or "
                "policy='never' to turn padding off."
            )
        bad = sorted(h for h in self.pad_from if h <= 0 or self.pad_to % h)
        if bad:
            raise ValueError(
                f"HeadPadding.pad_from={sorted(self.pad_from)} has {bad}, which do not divide "
                f"pad_to={self.pad_to}; pad only head counts that divide it."
            )

    def factor(self, num_heads: int) -> int:
        """Repeat factor for ``num_heads`` query heads (1 = no padding)."""
        if self.policy == "never" or num_heads not in self.pad_from:
            return 1
        return self.pad_to // num_heads


def mla_kernel_request(*, q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                       num_heads: int, custom_mask: bool = False) -> KernelRequest:
    """The kernel-registry key of an ``mla_paged_attention`` call with ``num_heads`` heads
    (the same key :func:`aiter_attn.ops.mla_paged_attention` builds)."""
    features = {"fp8"} if kv_cache.dtype in FP8_DTYPES else set()
    if custom_mask:
        features.add("custom_mask")
    return KernelRequest(
        op="mla_paged_attention", device=q.device.type, dtype=q.dtype, kv_dtype=kv_cache.dtype,
        head_dim=kv_cache.shape[-1], v_head_dim=kv_lora_rank, page_size=kv_cache.shape[1],
        features=features, extra=(("heads", num_heads),),
    )


def select_mla_kernel(kernels, request_for: Callable[[int], KernelRequest], num_heads: int,
                      padding: HeadPadding, backend: Optional[str] = None) -> tuple[Selection, int]:
    """``(selection, repeat_factor)`` for ``num_heads`` query heads under ``padding``.

    ``request_for(h)`` builds the request for ``h`` heads. Runs once per layer configuration.
    """
    factor = padding.factor(num_heads)
    if factor == 1:
        return kernels.select(request_for(num_heads), backend=backend), 1
    padded_req = request_for(num_heads * factor)
    if padding.policy == "always":
        return kernels.select(padded_req, backend=backend), factor
    real = real_err = padded = None
    try:
        real = kernels.select(request_for(num_heads), backend=backend)
    except KernelSelectionError as exc:
        real_err = exc
    try:
        padded = kernels.select(padded_req, backend=backend)
    except KernelSelectionError:
        padded = None
    if padded is not None and (real is None or padded.impl.priority > real.impl.priority):
        log.debug("MLA: %d heads padded to %d for kernel %s", num_heads, num_heads * factor,
                  padded.impl.name)
        return padded, factor
    if real is None:
        raise real_err
    return real, 1


# --------------------------------------------------------------------------- metadata
@attrs.frozen(kw_only=True)
class MLAPrefixPlan:
    """What the expanded EXTEND form needs to attend over ``[expanded prefix ; new tokens]``.

    Attributes:
        prefix_indptr: int32 ``[batch + 1]``: offsets of each request's prefix tokens.
        prefix_slots: int32 ``[num_prefix_tokens]``: latent-pool slots of the prefix tokens.
        dense_block_table: int32 ``[batch, max_seq_len]``: for request b, key j's row in the
            dense buffer ``cat([prefix K/V of all requests, new K/V of all tokens])`` (a page
            table with page size 1); entries past ``seq_lens[b]`` are 0 and never read.
        num_prefix_tokens: host int.
    """

    prefix_indptr: torch.Tensor = attrs.field(eq=False, repr=False)
    prefix_slots: torch.Tensor = attrs.field(eq=False, repr=False)
    dense_block_table: torch.Tensor = attrs.field(eq=False, repr=False)
    num_prefix_tokens: int


class MLADecodeMetadata(DecodeMetadata):
    """DECODE/IDLE over the latent pool: one query per request, page table over the pool.

    Exactly the MHA decode plan (:class:`~aiter_attn.strategies.mha.DecodeMetadata`): the
    latent pool is a paged cache with one KV head. No device→host sync; graph-capturable.
    """

    cg_support = CGSupport.ALWAYS


class MLAVerifyMetadata(VerifyTreeMetadata):
    """TARGET_VERIFY over the latent pool: ``num_draft_tokens`` queries per request, the last
    ones of its ``seq_lens`` keys (``seq_lens`` includes the drafts).

    The MHA speculative planning (:mod:`aiter_attn.strategies.spec`) reused as is, the latent
    pool being a paged cache with one KV head. Chain vs tree is chosen by
    ``BackendConfig.spec.topk`` as on every architecture (a batch whose ``spec_info.topk``
    differs raises): a chain (``topk == 1``) is causal over the page table; a tree
    (``topk > 1``) adds ``spec_info.custom_mask`` (SGLang's per-request
    ``[q_len, seq_len]`` blocks, or the ``[batch, q_len, q_len]`` tree part, expanded on the
    device; copied into the static ``custom_mask`` buffer under ``out=``) and ``mask_indptr``
    rebuilt on the device. The MLA kernel applies the mask literally. No device→host sync.
    """

    cg_support = CGSupport.UNIFORM_BATCH

    def buffer_spec(self, max_bs: int, max_tokens: int, max_seq_len: int) -> BufferSpec:
        """The tree's ``custom_mask`` / ``mask_indptr`` only when the config verifies trees:
        a chain plans no mask, so its static buffers are the page table's alone."""
        if config_topk(self.ctx.config) > 1:
            return super().buffer_spec(max_bs, max_tokens, max_seq_len)
        return PagedMetadata.buffer_spec(self, max_bs, max_tokens, max_seq_len)

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        resolve_num_draft_tokens(batch, self.ctx.config)  # clear error before any work
        if check_batch_topk(batch, self.ctx.config) > 1:  # the config decides, as on MHA
            return super().plan(batch, out)
        return PagedMetadata.plan(self, batch, out)


class MLADraftExtendV2Metadata(DraftExtendV2Metadata):
    """DRAFT_EXTEND_V2: a fixed ``num_draft_tokens`` queries per request, causal over the latent
    page table (the MHA plan of :mod:`aiter_attn.strategies.spec`); requests whose
    ``extend_seq_lens_cpu`` differ raise. No device→host sync."""

    cg_support = CGSupport.UNIFORM_BATCH


class MLAExtendMetadata(MetadataStrategy):
    """EXTEND / DRAFT_EXTEND: ragged queries; a page table over the latent pool (absorbed form)
    and an :class:`MLAPrefixPlan` in ``extras["mla_prefix"]`` (expanded form). Host sizes come
    from the batch's CPU mirrors; not graph-capturable."""

    cg_support = CGSupport.NEVER

    def buffer_spec(self, max_bs: int, max_tokens: int, max_seq_len: int) -> BufferSpec:
        pages = max(-(-max_seq_len // self.ctx.config.page_size), 1)
        return BufferSpec({
            "cu_seqlens_q": ((max_bs + 1,), torch.int32),
            "block_table": ((max_bs, pages), torch.int32),
            "seqused_k": ((max_bs,), torch.int32),
            "prefix_indptr": ((max_bs + 1,), torch.int32),
            "prefix_slots": ((max(max_bs * max_seq_len, 1),), torch.int32),
            "dense_block_table": ((max_bs, max(max_seq_len, 1)), torch.int32),
        })

    @staticmethod
    def _prefix_total(batch: ForwardBatch) -> int:
        """Cached-prefix tokens in the step (host int from the CPU mirrors)."""
        return int((batch.seq_lens_cpu - batch.extend_seq_lens_cpu.to(torch.int64)).sum())

    def eager_buffers(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """Buffers sized for ``batch``; ``prefix_slots`` exactly its prefix tokens."""
        spec = self.buffer_spec(max(batch.batch_size, 1), max(batch.num_tokens, 1),
                                max(batch.max_seq_len, 1))
        exact = {"prefix_slots": ((max(self._prefix_total(batch), 1),), torch.int32)}
        return BufferSpec({**spec.buffers, **exact}).allocate(batch.device)

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        static = out is not None
        if out is None:
            out = self.eager_buffers(batch)
        bs = batch.batch_size
        total_prefix = self._prefix_total(batch)
        if static:  # host ints: the CPU mirrors against the buffers' shapes
            rows, cap = out["dense_block_table"].shape
            if (bs > rows or batch.max_seq_len > cap
                    or total_prefix > out["prefix_slots"].numel()):
                raise ValueError(
                    f"{bs} requests of up to {batch.max_seq_len} tokens ({total_prefix} cached "
                    f"prefix tokens) do not fit the static buffers, sized for {rows} requests "
                    f"of up to {cap} tokens (max_seq_len); allocate them with buffer_spec("
                    "max_bs, max_tokens, max_seq_len) for the largest batch and longest "
                    "request, or plan eagerly (out=None).")
        cu = out["cu_seqlens_q"][: bs + 1]
        query = plan_query_layout(batch, cu, None)
        pages = plan_page_table(self.ctx, batch, out["block_table"][:bs], out["seqused_k"][:bs],
                                static)
        prefix_lens = batch.seq_lens - batch.extend_seq_lens.to(batch.seq_lens.dtype)
        prefix_indptr = out["prefix_indptr"][: bs + 1]
        prefix_slots = out["prefix_slots"][:total_prefix]
        ops.build_ragged_kv_indices(self.ctx.req_to_token, batch.req_pool_indices, prefix_lens,
                                    prefix_indptr, prefix_slots, total_prefix)
        width = out["dense_block_table"].shape[1] if static else max(batch.max_seq_len, 1)
        dense = out["dense_block_table"][:bs, :width]
        j = torch.arange(width, device=dense.device).unsqueeze(0)
        pre = prefix_lens.to(torch.int64).unsqueeze(1)
        from_prefix = prefix_indptr[:-1].to(torch.int64).unsqueeze(1) + j
        from_new = total_prefix + cu[:-1].to(torch.int64).unsqueeze(1) + (j - pre)
        rows = torch.where(j < pre, from_prefix, from_new)
        rows = torch.where(j < batch.seq_lens.to(torch.int64).unsqueeze(1), rows,
                           torch.zeros_like(rows))
        dense.copy_(rows)
        plan = MLAPrefixPlan(prefix_indptr=prefix_indptr, prefix_slots=prefix_slots,
                             dense_block_table=dense, num_prefix_tokens=total_prefix)
        dense_pages = PageTable(block_table=dense, seqused_k=pages.seqused_k,
                                max_seqlen_k=pages.max_seqlen_k, page_size=1)
        return AttnMetadata(mode=batch.forward_mode, batch_size=bs, query=query, pages=pages,
                            extras={"mla_prefix": plan, MLA_DENSE_PAGES_KEY: dense_pages})


# --------------------------------------------------------------------------- execution
@attrs.define(eq=False, slots=True)
class _MLABinding:
    """An absorbed layer bound to its group: kernel, frozen params, head repeat factor."""

    layer: LayerSpec
    group: tuple
    kernel: object
    params: object
    factor: int


class MLAExecution(ExecutionStrategy):
    """Absorbed form: write the latent, one ``mla_paged_attention`` kernel call (heads padded
    when the kernel needs it). Expanded form (EXTEND/DRAFT_EXTEND): expand the cached prefix
    through the layer's kv_b_proj and run ``paged_attention`` over ``[prefix ; new]`` K/V.

    Both forms go through kernel objects (:mod:`aiter_attn.kernels.base`): the kernel of a
    layer group is chosen once (:meth:`_bind_absorbed`, or ``bind_layer`` for the expanded
    form), planned once per step by :meth:`~ExecutionStrategy.plan_kernels` (the backend and
    the graph manager call it right after the metadata plan) and only launched per layer."""

    def __init__(self, ctx):
        super().__init__(ctx)
        pool = ctx.kv_pool
        if not all(hasattr(pool, a) for a in ("kv_buffer", "kv_lora_rank", "qk_rope_head_dim")):
            raise TypeError(
                f"MLA strategies need an aiter_attn.kvcache.MLAKVPool as kv_pool, got "
                f"{type(pool).__name__}; build the backend with MLAKVPool(...) for arch MLA."
            )
        padding = ctx.extra.get(MLA_HEAD_PADDING_KEY) or HeadPadding()
        if not isinstance(padding, HeadPadding):
            raise TypeError(
                f"extra[{MLA_HEAD_PADDING_KEY!r}] is a {type(padding).__name__}; pass an "
                "aiter_attn.strategies.mla.HeadPadding."
            )
        self.padding = padding
        self._mla_layers: dict = {}  # (id(layer), mask?) -> _MLABinding
        self._factors: dict = {}  # group key -> head repeat factor

    def run(self, q, k, v, layer: LayerSpec, batch: ForwardBatch, metadata: AttnMetadata, *,
            save_kv_cache: bool = True, sinks=None):
        if sinks is not None or layer.sinks is not None:
            raise ValueError(f"layer {layer.layer_id}: MLA has no attention sinks; pass sinks=None.")
        if layer.sliding_window is not None:
            raise ValueError(
                f"layer {layer.layer_id}: sliding_window={layer.sliding_window} is not supported "
                "by MLA (DeepSeek latent attention is full attention); leave it None."
            )
        if v is None:
            return self._run_absorbed(q, k, layer, batch, metadata, save_kv_cache)
        return self._run_expanded(q, k, v, layer, batch, metadata, save_kv_cache)

    def _check_latent_dims(self, layer: LayerSpec, form: str) -> tuple[int, int]:
        """The latent pool's ``(kv_lora_rank, qk_rope_head_dim)``; raises if ``layer``
        (called in the ``form`` MLA form) was built for other ones."""
        pool = self.ctx.kv_pool
        lora, rope = pool.kv_lora_rank, pool.qk_rope_head_dim
        if (layer.kv_lora_rank, layer.qk_rope_head_dim) != (lora, rope):
            raise ValueError(
                f"layer {layer.layer_id} called in the {form} MLA form has kv_lora_rank="
                f"{layer.kv_lora_rank}, qk_rope_head_dim={layer.qk_rope_head_dim}; the latent "
                f"pool has ({lora}, {rope}). Build MLA layers with aiter_attn.mla_layer_specs("
                "..., scaling=...), which sets them and the softmax scale explicitly."
            )
        return lora, rope

    # -- absorbed --------------------------------------------------------------------------
    def _check_absorbed(self, layer: LayerSpec) -> tuple[int, int]:
        lora, rope = self._check_latent_dims(layer, "absorbed")
        if (layer.num_kv_heads, layer.head_dim, layer.v_head_dim) != (1, lora + rope, lora):
            raise ValueError(
                f"layer {layer.layer_id} called in the absorbed MLA form (v=None) has "
                f"num_kv_heads={layer.num_kv_heads}, head_dim={layer.head_dim}, "
                f"v_head_dim={layer.v_head_dim}; the pool needs (1, {lora + rope}, {lora}) "
                "(kv_lora_rank + rope, kv_lora_rank). Build it with mla_layer_specs(...)[0]."
            )
        if layer.logit_cap > 0:
            raise ValueError(
                f"layer {layer.layer_id}: logit_cap={layer.logit_cap}; absorbed MLA "
                "(mla_paged_attention) has no soft-cap. Set logit_cap=0."
            )
        return lora, rope

    def _bind_absorbed(self, layer, md, q, kv_cache) -> "_MLABinding":
        """The layer's binding (a dict lookup after its first call): the group's kernel,
        chosen once per layer group (heads, dims, dtypes, mask or not; head padding decided
        here), and the layer's frozen :class:`~aiter_attn.kernels.base.LayerParams`."""
        has_mask = md.mask is not None
        key = (id(layer), has_mask)
        b = self._mla_layers.get(key)
        if b is not None and b.layer is layer:
            return b
        heads = layer.num_q_heads
        gkey = ("mla", q.dtype, q.device, heads, q.shape[2], kv_cache.dtype,
                tuple(kv_cache.shape[1:]), has_mask)
        group = self.groups.get(gkey)
        if group is None:
            lora = self.ctx.kv_pool.kv_lora_rank

            def request_for(h):
                return mla_kernel_request(q=q, kv_cache=kv_cache, kv_lora_rank=lora,
                                          num_heads=h, custom_mask=has_mask)

            sel, factor = select_mla_kernel(self.ctx.kernels, request_for, heads, self.padding,
                                            backend=self.ctx.config.kernel_backend)
            kernel = sel.bind(request_for(heads * factor))
            group = self.groups[gkey] = KernelGroup(key=gkey, kernel=kernel)
            self._factors[gkey] = factor
        factor = self._factors[gkey]
        params = mla_layer_params(
            scale=layer.scaling, device=q.device, kv_lora_rank=layer.v_head_dim,
            num_q_heads=heads * factor, head_dim=layer.head_dim, kv_scale=layer.k_scale,
            fp8=kv_cache.dtype in FP8_DTYPES, causal=not has_mask)
        b = self._mla_layers[key] = _MLABinding(layer=layer, group=gkey, kernel=group.kernel,
                                                params=params, factor=factor)
        return b

    def _run_absorbed(self, q, k, layer, batch, metadata, save_kv_cache):
        lora, rope = self._check_absorbed(layer)
        num_tokens, heads = q.shape[0], layer.num_q_heads
        q = q.view(num_tokens, heads, lora + rope)
        kv_cache = self.ctx.kv_pool.kv_buffer(layer.layer_id)
        if save_kv_cache and k is not None:
            # chosen once per (cache, input) dtype pair, as on MHA: nothing is validated or
            # selected on later calls
            write = self.kernel_for(("write_kv", kv_cache.dtype, k.dtype),
                                    lambda: write_kv_request(kv_cache, k), fallback=True)
            write.fn(kv_cache, None, batch.out_cache_loc, k.view(num_tokens, 1, lora + rope),
                     None, k_scale=layer.k_scale)
        b = self._bind_absorbed(layer, metadata, q, kv_cache)
        kp = metadata.kernel_plans.plans.get(b.group)
        if kp is None:  # first call of this group in the step (or a group bound just now)
            kp = self.plan_group(self.groups[b.group], metadata, batch)
        factor = b.factor
        q_in = q.repeat_interleave(factor, dim=1) if factor > 1 else q
        out = torch.empty(num_tokens, heads * factor, lora, dtype=q.dtype, device=q.device)
        b.kernel.run(q_in, (kv_cache,), kp, b.params, out)
        if factor > 1:
            out = out[:, ::factor]
        return out.reshape(num_tokens, heads * lora)

    # -- expanded --------------------------------------------------------------------------
    def _projection(self, layer: LayerSpec) -> Callable:
        projections = self.ctx.extra.get(MLA_PROJECTIONS_KEY) or {}
        proj = projections.get(layer.layer_id)
        if proj is None:
            raise ValueError(
                f"layer {layer.layer_id}: EXTEND with a cached prefix in the expanded MLA form "
                f"needs the layer's kv_b_proj in AttentionBackend(extra={{"
                f"{MLA_PROJECTIONS_KEY!r}: {{{layer.layer_id}: kv_b_proj}}}}) (have layers "
                f"{sorted(projections)}); or call the absorbed form (v=None)."
            )
        return proj

    def _expand_prefix(self, layer, plan: MLAPrefixPlan, dtype, nope):
        """Prefix K ``[P, H, nope + rope]`` and V ``[P, H, Dv]`` from the latent cache."""
        pool = self.ctx.kv_pool
        lora, rope = pool.kv_lora_rank, pool.qk_rope_head_dim
        heads, dv, count = layer.num_q_heads, layer.v_head_dim, plan.num_prefix_tokens
        flat = pool.kv_buffer(layer.layer_id).view(-1, lora + rope)
        latent = flat.index_select(0, plan.prefix_slots.long())
        kv_scale, _ = kv_dequant_scales(flat.dtype, layer.k_scale, layer.k_scale)
        if kv_scale is not None:  # the same rule as the absorbed form's kernel
            latent = latent.float() * kv_scale
        latent = latent.to(dtype)
        kv = self._projection(layer)(latent[:, :lora].contiguous())
        if isinstance(kv, (tuple, list)):
            kv = kv[0]
        if tuple(kv.shape) != (count, heads * (nope + dv)):
            raise ValueError(
                f"layer {layer.layer_id}: kv_b_proj returned shape {tuple(kv.shape)}; expected "
                f"({count}, {heads * (nope + dv)}) = [tokens, heads × (qk_nope {nope} + "
                f"v_head_dim {dv})]."
            )
        kv = kv.view(count, heads, nope + dv).to(dtype)
        k_nope, v = kv.split([nope, dv], dim=-1)
        k_pe = latent[:, lora:].unsqueeze(1).expand(count, heads, rope)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def _run_expanded(self, q, k, v, layer, batch, metadata, save_kv_cache):
        mode = batch.forward_mode
        plan = metadata.extras.get("mla_prefix")
        if mode not in _EXTEND_MODES or plan is None:
            raise ValueError(
                f"layer {layer.layer_id}: the expanded MLA form (v given) serves EXTEND and "
                f"DRAFT_EXTEND; {mode.name} takes the absorbed form: q [T, H, kv_lora + rope], "
                "k the new latent [T, 1, kv_lora + rope], v=None."
            )
        if save_kv_cache:
            raise ValueError(
                f"layer {layer.layer_id}: the expanded MLA form cannot write the latent pool "
                "from per-head K/V; write the step's latent with MLAKVPool.write_latent(...) "
                "and call forward(..., save_kv_cache=False)."
            )
        lora, rope = self._check_latent_dims(layer, "expanded")
        heads, dim, dv = layer.num_q_heads, layer.head_dim, layer.v_head_dim
        nope = dim - rope
        if layer.num_kv_heads != heads or nope <= 0:
            raise ValueError(
                f"layer {layer.layer_id} in the expanded MLA form has num_q_heads={heads}, "
                f"num_kv_heads={layer.num_kv_heads}, head_dim={dim}; it needs num_kv_heads == "
                f"num_q_heads and head_dim = qk_nope + rope ({rope}) with qk_nope > 0. Build it "
                "with mla_layer_specs(...)[1]."
            )
        num_tokens = q.shape[0]
        q = q.view(num_tokens, heads, dim)
        keys, values = k.view(num_tokens, heads, dim), v.view(num_tokens, heads, dv)
        if plan.num_prefix_tokens:
            k_pre, v_pre = self._expand_prefix(layer, plan, q.dtype, nope)
            keys = torch.cat([k_pre, keys.to(q.dtype)])
            values = torch.cat([v_pre, values.to(q.dtype)])
        k_cache = keys.reshape(-1, 1, heads, dim)  # page size 1 over the dense rows
        v_cache = values.reshape(-1, 1, heads, dv)
        # ordinary causal paged attention over the dense rows, through the layer group's
        # kernel object (bound once, planned once per step on the dense page table)
        return attend_layer(self, ops.paged_attention_request, q, k_cache, v_cache, layer,
                            batch, metadata, pages_key=MLA_DENSE_PAGES_KEY)


#: The MLA family's cells.
CELLS = (
    Cell(name="mla.decode", modes={ForwardMode.DECODE, ForwardMode.IDLE},
         metadata=MLADecodeMetadata, cg_support=CGSupport.ALWAYS,
         description="absorbed MLA decode over the latent page table (heads 4/8 padded to 16 "
                     "when the kernel needs it)"),
    Cell(name="mla.verify", modes={ForwardMode.TARGET_VERIFY}, metadata=MLAVerifyMetadata,
         cg_support=CGSupport.UNIFORM_BATCH,
         description="absorbed MLA verify: causal chain or literal tree mask"),
    Cell(name="mla.draft_extend_v2", modes={ForwardMode.DRAFT_EXTEND_V2},
         metadata=MLADraftExtendV2Metadata, cg_support=CGSupport.UNIFORM_BATCH,
         description="absorbed MLA draft extend with a fixed token count per request"),
    Cell(name=MLA_DRAFT_DECODE_STEP, modes={ForwardMode.DECODE},
         metadata=DraftDecodeStepMetadata, cg_support=CGSupport.ALWAYS, priority=-10,
         description="one multi-step draft-decode step (absorbed) over tables planned for all "
                     "steps by MultiStepDraftBackend"),
    Cell(name="mla.extend", modes=set(_EXTEND_MODES), metadata=MLAExtendMetadata,
         cg_support=CGSupport.NEVER,
         description="MLA extend: absorbed over the latent pool, or expanded (prefix through "
                     "kv_b_proj) with qk head dim ≠ v head dim"),
)


@hookimpl
def aiter_attn_register_strategies(register):
    register_cells(register, arch=AttnArch.MLA, execution=MLAExecution, cells=CELLS,
                   kernel_op="mla_paged_attention")
