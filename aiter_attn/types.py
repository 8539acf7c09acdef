"""Core value types: forward modes, architectures, CUDA-graph support, layer and backend specs.

Everything here is a frozen attrs value (or an enum) so it can key caches: kernel and
strategy selection happen once per ``(LayerSpec, BackendConfig)``, never per call.
"""

from __future__ import annotations

import enum
import math
from typing import Optional

import attrs
import torch

from .validation import check_finite, check_scale, is_int_at_least

__all__ = [
    "ForwardMode",
    "AttnArch",
    "CGSupport",
    "LayerSpec",
    "SpecDecodeConfig",
    "BackendConfig",
    "FP8_DTYPES",
    "kv_dequant_scales",
]

#: KV-cache dtypes treated as fp8 (dequantised with the layer's k/v scales).
FP8_DTYPES = frozenset(
    d
    for d in (
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e5m2fnuz", None),
    )
    if d is not None
)


def kv_dequant_scales(kv_dtype: torch.dtype, k_scale, v_scale):
    """The one rule for k/v scales, on every path (kernels, KV writes, MLA's two forms).

    ``k_scale``/``v_scale`` are fp8 *dequantisation* scales: an fp8 cache stores
    ``x / scale`` (saturated) and a read yields ``stored · scale``. A cache that is not fp8
    stores K/V as given, so there is nothing to dequantise and the scales do not apply
    (as vLLM and SGLang ignore a checkpoint's kv scales when the cache is not fp8).

    Returns ``(k_scale, v_scale)`` for an fp8 ``kv_dtype``, else ``(None, None)`` (= 1).
    """
    if kv_dtype in FP8_DTYPES:
        return k_scale, v_scale
    return None, None


class ForwardMode(enum.Enum):
    """What one forward step does (SGLang's names)."""

    EXTEND = "extend"  #: prefill, with or without cached prefix; chunked prefill is EXTEND
    DECODE = "decode"  #: one new token per request
    IDLE = "idle"  #: no tokens on this rank (data-parallel padding); a DECODE with batch 0
    TARGET_VERIFY = "target_verify"  #: EAGLE: the target model scores draft tokens
    DRAFT_EXTEND = "draft_extend"  #: draft model extends over accepted tokens (ragged)
    DRAFT_EXTEND_V2 = "draft_extend_v2"  #: draft extend with a fixed token count per request

    @property
    def is_decode_like(self) -> bool:
        """True for modes whose planning must make no device→host synchronisation: those
        whose contract gives every request the same query length
        (:attr:`aiter_attn.contract.ModeContract.uniform`)."""
        from .contract import contract_of

        return contract_of(self).uniform

    @classmethod
    def parse(cls, value: "ForwardMode | str") -> "ForwardMode":
        """Accept a member or its (case-insensitive) name/value; raise a clear error otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for m in cls:
                if key in (m.value, m.name.lower()):
                    return m
        allowed = ", ".join(m.name for m in cls)
        raise ValueError(
            f"forward_mode={value!r} is not a forward mode; allowed: {allowed}. "
            "Pass an aiter_attn.ForwardMode member."
        )


class AttnArch(enum.Enum):
    """Attention architecture a backend serves."""

    MHA = "mha"  #: multi-head attention incl. GQA/MQA, NHD paged cache
    MLA = "mla"  #: DeepSeek multi-head latent attention (absorbed decode)
    SWA = "swa"  #: hybrid sliding-window models: SWA layers keep their own smaller pool
    VEC5D = "vec5d"  #: vectorised/shuffled 5-D KV layout (AMD paged-attention kernels)

    @classmethod
    def parse(cls, value: "AttnArch | str") -> "AttnArch":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for a in cls:
                if key in (a.value, a.name.lower()):
                    return a
        allowed = ", ".join(a.name for a in cls)
        raise ValueError(f"arch={value!r} is not an architecture; allowed: {allowed}.")


class CGSupport(enum.IntEnum):
    """How far a strategy or kernel can run under CUDA-graph capture (ordered: weaker < stronger).

    An engine takes the weakest value across everything it composes.
    """

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  #: decode with exactly one token per request
    UNIFORM_BATCH = 2  #: every request has the same query length (decode, verify, draft v2)
    ALWAYS = 3


def _positive(instance, attribute, value):
    # an int, not a bool (True would be 1) nor a float (a head_dim of 64.0 or 8.5 reached
    # torch's view() as a size, far from the argument that caused it)
    if not is_int_at_least(value, 1):
        raise ValueError(f"{attribute.name}={value!r} must be a positive integer.")


_NON_NEGATIVE_HINTS = {
    "layer_id": "the index of the layer's buffers in the KV pool (True would be layer 1)",
    "kv_lora_rank": "0 for layers that are not MLA",
    "qk_rope_head_dim": "0 for layers that are not MLA",
}


def _non_negative(instance, attribute, value):
    if not is_int_at_least(value, 0):
        raise ValueError(f"{attribute.name}={value!r} must be an integer ≥ 0 "
                         f"({_NON_NEGATIVE_HINTS[attribute.name]}).")


def _scalar_scale(instance, attribute, value):
    check_scale(attribute.name, value)  # one number per layer: per-head tensors are refused


def _window_converter(value):
    if value is None:
        return None
    # int() truncated 2.9 to a 2-token window and took True for a window of 1
    if not is_int_at_least(value, -(2**63)):
        raise ValueError(
            f"sliding_window={value!r} must be an integer (HF convention: each query sees the "
            "w most recent keys, itself included) or None / ≤ 0 for full attention.")
    value = int(value)
    return None if value <= 0 else value


def _is_bool(value) -> bool:
    """A Python or numpy bool (not an int, a float or a str: ``"false"`` is truthy)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy"
                                       and type(value).__name__ in ("bool", "bool_"))


def _optional_bool(instance, attribute, value):
    # read by identity (``is True`` / ``is not False``): a Python bool only
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"BackendConfig.{attribute.name}={value!r}; allowed: None (automatic), True or "
            "False. A 0 or 'false' is not False here (it would select the automatic rule).")


def _bool(instance, attribute, value):
    if not _is_bool(value):
        raise TypeError(f"{attribute.name}={value!r} must be True or False (a str such as "
                        "'false' would count as True).")


@attrs.frozen(kw_only=True)
class LayerSpec:
    """One attention layer as the backend sees it.

    Attributes:
        layer_id: index of the layer's KV buffers in the pool.
        num_q_heads / num_kv_heads: heads on this rank (after tensor-parallel split).
        head_dim: q/k head dim (for MLA: kv_lora_rank + qk_rope_head_dim in absorbed form).
        v_head_dim: value head dim; defaults to ``head_dim``.
        scaling: softmax scale applied to q·k; default ``1 / sqrt(head_dim)``, except for MLA
            layers (``kv_lora_rank > 0``), which must give it (see :func:`mla_layer_specs`).
        logit_cap: soft-cap (``cap * tanh(s / cap)``) when > 0.
        sliding_window: HF convention: each query sees the ``w`` most recent keys, itself
            included; ``None`` (or ≤ 0) means full attention. See :meth:`window_size`.
        sinks: float32 ``[num_q_heads]`` per-head sink logits (gpt-oss) or ``None``.
        k_scale / v_scale: fp8 dequantisation scales: one number per layer (a float or a
            1-element tensor; per-head tensors are refused, see
            :func:`aiter_attn.validation.check_scale`): an fp8 cache stores ``k / k_scale`` and
            reads ``stored · k_scale``. They apply to fp8 caches only; on any other cache dtype
            they are ignored (K/V are stored and read as given), on every architecture and
            kernel (:func:`kv_dequant_scales`).
        is_cross_attention: encoder-decoder cross attention (keys from the encoder cache).
        causal: each query sees the keys up to its own position (decoders); ``False``: every
            key of its request (encoder-only layers, e.g. BERT-style embedding models), a
            sliding window then reaching ``w - 1`` keys to either side. See
            :attr:`is_causal`.
        kv_lora_rank / qk_rope_head_dim: MLA dimensions (0 for non-MLA layers); every MLA
            layer sets them (the MLA strategies refuse a spec whose dimensions differ from
            the latent pool's).
    """

    layer_id: int = attrs.field(validator=_non_negative)
    num_q_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    v_head_dim: Optional[int] = attrs.field(
        default=None, validator=attrs.validators.optional(_positive))
    scaling: Optional[float] = None
    logit_cap: float = 0.0
    sliding_window: Optional[int] = attrs.field(default=None, converter=_window_converter)
    sinks: Optional[torch.Tensor] = attrs.field(default=None, eq=False, hash=False, repr=False)
    k_scale: float = attrs.field(default=1.0, validator=_scalar_scale)
    v_scale: float = attrs.field(default=1.0, validator=_scalar_scale)
    is_cross_attention: bool = attrs.field(default=False, validator=_bool)
    causal: bool = attrs.field(default=True, validator=_bool)
    kv_lora_rank: int = attrs.field(default=0, validator=_non_negative)
    qk_rope_head_dim: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self):
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.kv_lora_rank < 0 or self.qk_rope_head_dim < 0:
            raise ValueError(
                f"kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}; "
                "both are ≥ 0 (0 for layers that are not MLA).")
        if self.scaling is None and self.kv_lora_rank > 0:
            raise ValueError(
                f"layer {self.layer_id} is an MLA layer (kv_lora_rank={self.kv_lora_rank}) "
                "without scaling: its softmax scale is not 1/sqrt(head_dim) (DeepSeek: "
                "(qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times mscale² under YaRN). Pass "
                "the model's scaling, e.g. aiter_attn.mla_layer_specs(..., scaling=attn.scaling).")
        if self.scaling is None:
            object.__setattr__(self, "scaling", 1.0 / math.sqrt(self.head_dim))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}; GQA needs whole groups of query heads per KV head."
            )
        check_finite("scaling", self.scaling, hint="It multiplies q·k (default head_dim ** -0.5).")
        check_finite("logit_cap", self.logit_cap, minimum=0.0, hint="0 disables soft-capping.")
        if self.sinks is not None and tuple(self.sinks.shape) != (self.num_q_heads,):
            raise ValueError(
                f"sinks has shape {tuple(self.sinks.shape)}; expected ({self.num_q_heads},), "
                "one logit per query head on this rank."
            )

    @property
    def has_sinks(self) -> bool:
        return self.sinks is not None

    @property
    def gqa_group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def is_causal(self) -> bool:
        """Whether the layer's attention is causal: a decoder's self-attention (neither
        cross-attention nor ``causal=False``)."""
        return self.causal and not self.is_cross_attention

    def window_size(self) -> tuple[int, int]:
        """Flash-attn ``(left, right)`` window: HF ``sliding_window=w`` ⇒ ``(w - 1, 0)``, or
        ``(w - 1, w - 1)`` on a bidirectional (``causal=False``) layer."""
        if self.sliding_window is None:
            return (-1, -1)
        w = self.sliding_window - 1
        return (w, 0) if self.causal else (w, w)


@attrs.frozen(kw_only=True)
class SpecDecodeConfig:
    """Speculative-decoding settings (EAGLE / n-gram).

    Attributes:
        num_steps: draft steps per round (multi-step draft decode runs one backend per step).
        topk: draft branches per step; 1 = chain (causal verify), > 1 = tree (custom mask).
        num_draft_tokens: tokens verified per request in TARGET_VERIFY (incl. the root).
    """

    num_steps: int = attrs.field(default=1, validator=_positive)
    topk: int = attrs.field(default=1, validator=_positive)
    num_draft_tokens: int = attrs.field(default=2, validator=_positive)


@attrs.frozen(kw_only=True)
class BackendConfig:
    """Static settings of one backend instance; sizes static buffers and keys kernel selection.

    Attributes:
        page_size: tokens per KV page (1..N, need not be a power of two).
        max_batch_size: most requests in one step (also the largest CUDA-graph batch).
        max_context_len: most tokens (prefix + new) one request may hold.
        dtype: activation dtype of q/k/v and the output.
        kv_cache_dtype: storage dtype of the KV cache (may be fp8).
        device: where tensors live.
        arch: the architecture this backend serves.
        spec: speculative-decoding settings or ``None``.
        tp_size: tensor-parallel ranks the model's heads are split over.
        kernel_backend: force a kernel backend by name ("reference", "triton", a plugin's).
        swa_window: largest sliding window among SWA layers (sizes the SWA page table).
        debug_checks: the checked mode for this backend: every kernel call first reads its
            index inputs back and raises a clear ``ValueError`` on bad values (page ids
            outside the pool, ``cu_seqlens_q``/``seqused_k`` that disagree with q). Syncs: for
            debugging
            (``aiter-attn generate --check``); ``AITER_ATTN_DEBUG=1`` does the same
            process-wide. Eager calls only: a captured CUDA graph replays unchecked.
        batch_invariant: a request's attention output is bitwise identical whatever else
            shares its batch, whatever the batch size, eager or replayed from a CUDA graph
            (fixed tiles and split sizes, fixed-order reductions, no atomics); only kernels
            declaring the ``batch_invariant`` feature are selected. Costs speed
            (docs/modes.md).
        kv_scale_granularity: ``"per_layer"`` (default: ``LayerSpec.k_scale``/``v_scale``
            only) or ``"per_token_head"``: the pool keeps a float32 scale per slot and KV head
            next to an fp8 cache, writes quantise each (token, head) vector with its own
            scale and reads dequantise with it (the layer scales on top). fp8 caches on the
            MHA and SWA architectures only; the pool must be built with the same value
            (:mod:`aiter_attn.kv_scales`).
        cascade_min_shared_tokens: cascade (shared-prefix) attention on the MHA and SWA
            cells (causal layers without a tree mask): runs of consecutive requests whose
            page tables start with the same page ids over at least this many tokens (rounded
            up to whole pages) read those pages once for all of the run's queries, merged by
            LSE with each request's own pages (docs/modes.md). ``None`` or 0 disables it.
            The grouping is planned on the device per step (no sync, CUDA-graph safe).
        dense_extend: MHA extend/prefill steps attend to their new tokens with a dense-tile
            kernel over the step's own K/V and to the cached prefix with the paged kernel,
            merged by LSE (op ``extend_attention``, where a backend registers one and the
            layer's features allow: windows, tree masks and non-causal layers keep the
            paged kernel). ``None`` (default): on the steps whose every request brings at
            least ``dense_extend_min_tokens`` new tokens, where it pays (H200: 1.22-1.53x
            the paged kernel on 8k/16k prefills and 8 x 2k, break-even at 4 x 1k over a
            2k prefix, slower on shorter chunks and on mixed steps with decode rows;
            docs/benchmarks.md); ``True``: every EXTEND step it can serve; ``False``: never.
        dense_extend_min_tokens: the fewest new tokens every request of a step must bring for
            ``dense_extend=None`` to take the two-pass path (a host int of the step's plan).
    """

    page_size: int = attrs.field(default=1, validator=_positive)
    max_batch_size: int = attrs.field(default=256, validator=_positive)
    max_context_len: int = attrs.field(default=8192, validator=_positive)
    dtype: torch.dtype = torch.float16
    kv_cache_dtype: Optional[torch.dtype] = None
    device: str = "cpu"
    arch: AttnArch = attrs.field(default=AttnArch.MHA, converter=AttnArch.parse)
    spec: Optional[SpecDecodeConfig] = None
    tp_size: int = attrs.field(default=1, validator=_positive)
    kernel_backend: Optional[str] = None
    swa_window: Optional[int] = None
    debug_checks: bool = attrs.field(default=False, validator=_bool)
    batch_invariant: bool = attrs.field(default=False, validator=_bool)
    kv_scale_granularity: str = "per_layer"
    cascade_min_shared_tokens: Optional[int] = None
    dense_extend: Optional[bool] = attrs.field(default=None, validator=_optional_bool)
    dense_extend_min_tokens: int = attrs.field(default=2048, validator=_positive)

    def __attrs_post_init__(self):
        if self.kv_cache_dtype is None:
            object.__setattr__(self, "kv_cache_dtype", self.dtype)
        c = self.cascade_min_shared_tokens
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ValueError(
                f"cascade_min_shared_tokens={c!r}; expected None (off), 0 (off) or a positive "
                "int: the least tokens of identical leading pages a run of requests must "
                "share for cascade attention, e.g. 1024.")
        from .kv_scales import PER_TOKEN_HEAD, check_granularity

        check_granularity(self.kv_scale_granularity, kv_dtype=self.kv_cache_dtype,
                          where="BackendConfig")
        if self.kv_scale_granularity == PER_TOKEN_HEAD and self.arch not in (AttnArch.MHA,
                                                                             AttnArch.SWA):
            raise ValueError(
                f"BackendConfig.kv_scale_granularity='per_token_head' with arch={self.arch.name}:"
                " per-(token, head) scales are served on the MHA and SWA architectures (NHD "
                "pools); MLA's latent cache and the 5-D layout keep one scale per layer. Use "
                "kv_scale_granularity='per_layer'.")

    @property
    def per_token_head_scales(self) -> bool:
        """The pool keeps per-(token, head) fp8 scales (:mod:`aiter_attn.kv_scales`)."""
        return self.kv_scale_granularity == "per_token_head"

    @property
    def max_pages_per_request(self) -> int:
        """Columns of a full page table: ``ceil(max_context_len / page_size)``."""
        return -(-self.max_context_len // self.page_size)

    @property
    def is_fp8_kv(self) -> bool:
        return self.kv_cache_dtype in FP8_DTYPES

    def local_heads(self, total_heads: int) -> int:
        """Heads on one tensor-parallel rank (KV heads replicate when fewer than ranks)."""
        if total_heads % self.tp_size == 0:
            return total_heads // self.tp_size
        if self.tp_size % total_heads == 0:
            return 1
        raise ValueError(
            f"{total_heads} heads cannot be split over tp_size={self.tp_size}; "
            "choose a tp_size that divides the head count (or a multiple of it)."
        )
