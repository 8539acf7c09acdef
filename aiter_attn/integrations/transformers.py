"""transformers integration: ``attn_implementation="aiter_attn"``.

:func:`register` adds one attention function (and its mask function) to transformers'
``AttentionInterface`` / ``AttentionMaskInterface`` under :data:`ATTN_IMPLEMENTATION`. After
it, any model whose class sets ``_supports_attention_backend`` (Llama, Qwen2, Mistral,
Gemma-2, gpt-oss, …) runs its attention through this backend's kernels::

    import aiter_attn.integrations.transformers as aiter_hf
    aiter_hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="aiter_attn")
    model.generate(...)                      # or model.set_attn_implementation("aiter_attn")

The function serves two callers:

* **transformers' own cache** (``model.generate`` with a dynamic or static cache): each layer
  hands over q ``[B, H, T_q, D]`` and the whole cached k/v ``[B, H_kv, T_k, D]``. They are
  laid out as a paged cache of page size 1 (one contiguous copy of k/v per layer) and run
  through :func:`aiter_attn.ops.paged_attention` with the layer's scaling, soft-cap (Gemma-2),
  sliding window (HF convention ``w`` ⇒ ``(w - 1, 0)``) and sinks (gpt-oss ``s_aux``).
  Padding comes from transformers' boolean mask (the ``sdpa`` mask function is registered
  under the same name): key columns that no query of a row may see (left or right padding, a
  static cache's unwritten tail) are dropped from that row's page table, and query rows that
  see nothing give zeros (no real token reads them). A mask this cannot reproduce exactly
  (packed sequences, holes in a row) is refused with a ValueError, never served approximately.
* **the reference engine** (:class:`aiter_attn.engine.models.hf_wrapped.HFWrappedModel`):
  inside :func:`route_to_backend` the same function sends each layer's packed step
  (``[1, T]`` tokens of many requests) to an :class:`~aiter_attn.AttentionBackend` over the
  engine's paged KV pool instead, with the layer's :class:`~aiter_attn.LayerSpec`.

transformers' continuous batching (``generate_batch``) is not served: see
``docs/integrations.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Optional, Sequence

import attrs
import torch

from .. import ops

__all__ = ["ATTN_IMPLEMENTATION", "register", "attention_forward", "mask_forward",
           "EngineRoute", "route_to_backend", "active_route"]

log = logging.getLogger(__name__)

#: The ``attn_implementation`` name :func:`register` adds.
ATTN_IMPLEMENTATION = "aiter_attn"


@attrs.frozen(eq=False)
class EngineRoute:
    """Where the attention of a forward in progress goes instead of transformers' cache.

    Attributes:
        layer_specs: per ``module.layer_idx`` its :class:`~aiter_attn.LayerSpec`.
        batch: the engine's :class:`~aiter_attn.ForwardBatch` of this step.
        backend: the :class:`~aiter_attn.AttentionBackend` holding the paged KV pool.
        owner: the object that opened the route (the engine's model wrapper).
    """

    layer_specs: Sequence
    batch: object
    backend: object
    owner: object = None


_ROUTE: contextvars.ContextVar = contextvars.ContextVar("aiter_attn_hf_route", default=None)


def active_route() -> Optional[EngineRoute]:
    """The :class:`EngineRoute` of the forward in progress, or ``None`` outside one."""
    return _ROUTE.get()


@contextlib.contextmanager
def route_to_backend(layer_specs: Sequence, batch, backend, owner=None):
    """Within the block, :data:`ATTN_IMPLEMENTATION` attention runs on ``backend`` over its
    paged pool for ``batch`` (packed ``[1, T]`` steps) instead of transformers' cache."""
    token = _ROUTE.set(EngineRoute(layer_specs, batch, backend, owner))
    try:
        yield
    finally:
        _ROUTE.reset(token)


def _engine_attention(route: EngineRoute, module, query, key, value):
    spec = route.layer_specs[module.layer_idx]
    if query.shape[0] != 1:
        raise ValueError(f"query batch dim is {query.shape[0]}; the engine runs packed [1, T].")
    t = query.shape[2]
    q = query[0].transpose(0, 1).reshape(t, -1)
    k = key[0].transpose(0, 1).reshape(t, -1)
    v = value[0].transpose(0, 1).reshape(t, -1)
    o = route.backend.forward(q, k, v, spec, route.batch)
    return o.view(1, t, spec.num_q_heads, spec.v_head_dim), None


#: An additive float mask entry at or below this hides its key (transformers fills masked
#: entries with the dtype's minimum or -inf; older models with -10000).
_MASKED_AT = -1e4


def _visible(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int):
    """``(vis, biased)``: vis bool ``[B, H_m, T_q, T_k]``, which key each query may see (bool
    masks as given, additive float masks where 0; a mask broadcast over the batch expanded to
    it); biased bool ``[B]``: rows of a float mask holding entries that are neither 0 nor a
    masked value (an additive bias such as Falcon's ALiBi, which the kernel cannot add), or
    ``None`` for a bool mask."""
    m = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
    if m.dim() != 4 or m.shape[0] not in (1, batch) or tuple(m.shape[2:]) != (q_len, kv_len):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected [B, 1, T_q, T_k] "
            f"= [{batch}, 1, {q_len}, {kv_len}] (or [B, T_q, T_k]) for query [B, H, {q_len}, D] "
            f"and key [B, H_kv, {kv_len}, D].")
    m = m.expand(batch, -1, -1, -1)
    if m.dtype == torch.bool:
        return m, None
    biased = ((m != 0) & (m > _MASKED_AT)).flatten(1).any(dim=1)
    return m == 0, biased


def _kernel_mask(lo, hi, q_lens, q_len: int, kv_len: int, causal: bool, window):
    """bool ``[B, 1, T_q, T_k]``: what the kernel computes for rows laid out as ``keys
    [lo, hi)``, the last ``q_lens`` query rows real, query ``i`` at key column
    ``hi - (T_q - i)``."""
    dev = lo.device
    i = torch.arange(q_len, device=dev)[None, :, None]
    j = torch.arange(kv_len, device=dev)[None, None, :]
    lo, hi, q_lens = lo[:, None, None], hi[:, None, None], q_lens[:, None, None]
    pos = hi - (q_len - i)
    seen = (i >= q_len - q_lens) & (j >= lo) & (j < hi)
    if causal:
        seen &= j <= pos
    if window[0] >= 0:
        seen &= j >= pos - window[0]
    if window[1] >= 0:
        seen &= j <= pos + window[1]
    return seen[:, None]


def _layout(attention_mask, batch: int, q_len: int, kv_len: int, *, causal: bool, window):
    """``(lo [B], hi [B], q_lens [B])`` host ints: each row's key columns ``[lo, hi)`` (key
    columns outside that no query sees: left padding, right padding, a static cache's
    unwritten tail, keys out of every query's window) and its real queries, the last
    ``q_lens`` rows. A mask that this layout, causal order and the window cannot reproduce
    exactly (packed sequences, holes in a row, per-head masks) raises ValueError.

    Without a mask transformers means ``sdpa``'s ``is_causal`` (upper-left alignment): it
    leaves the mask out with ``1 < T_q < T_k`` only for a static cache's first prefill, whose
    key columns after the queries are not written yet."""
    if attention_mask is None:
        hi = q_len if causal and 1 < q_len < kv_len else kv_len
        return [0] * batch, [hi] * batch, [min(q_len, hi)] * batch
    vis, biased = _visible(attention_mask, batch, q_len, kv_len)
    cols = torch.arange(kv_len, device=vis.device)
    rows = torch.arange(q_len, device=vis.device)
    seen = vis.any(dim=2).any(dim=1)  # [B, T_k]
    anything = seen.any(dim=1)
    lo = torch.where(anything, torch.where(seen, cols, kv_len).amin(dim=1), 0)
    hi = torch.where(anything, torch.where(seen, cols, -1).amax(dim=1) + 1, 0)
    real = vis.any(dim=3).any(dim=1)  # [B, T_q]
    first_real = torch.where(real, rows, q_len).amin(dim=1)
    q_lens = q_len - first_real
    if causal or tuple(window) != (-1, -1):
        # query positions matter (causal order, a window): a row's queries are its last keys
        # (a bidirectional window's padding queries that see a key are left to the check);
        # without them every query of a non-causal row sees its whole key range
        q_lens = torch.minimum(q_lens, hi - lo)
    wrong = vis != _kernel_mask(lo, hi, q_lens, q_len, kv_len, causal, window)
    if biased is None:
        biased = torch.zeros_like(anything)
    # one host read for the layout and the checks
    host = torch.stack([lo, hi, q_lens, wrong.flatten(1).any(dim=1).long(),
                        biased.long()]).tolist()
    lo_h, hi_h, q_lens_h, bad, biased_h = host
    if any(biased_h):
        b = biased_h.index(1)
        raise ValueError(
            f"attention_mask is an additive {attention_mask.dtype} mask whose row {b} holds "
            f"values other than 0 (attend) and masked values (<= {_MASKED_AT:g}): a bias on the "
            f"logits (ALiBi, relative positions) that the {ATTN_IMPLEMENTATION!r} attention "
            "cannot add; run this model with attn_implementation='sdpa' or 'eager'.")
    if any(bad):
        b, h, i, j = (int(x) for x in wrong.nonzero()[0].tolist())
        raise ValueError(
            f"attention_mask[{b}, {h}, {i}, {j}] is {bool(vis[b, h, i, j])}, but the "
            f"{ATTN_IMPLEMENTATION!r} attention serves masks of one key range per row (left or "
            f"right padding, a static cache's unwritten tail) with "
            f"{'causal order' if causal else 'every query seeing the range'} and the layer's "
            f"window {tuple(window)}: row {b} would see keys [{lo_h[b]}, {hi_h[b]}) from its "
            f"last {q_lens_h[b]} queries. Packed sequences, holes in a row and per-head masks "
            "are not expressible; run this model with attn_implementation='sdpa' or 'eager'.")
    return lo_h, hi_h, q_lens_h


#: Keywords of transformers' attention calls that change what attention computes and that
#: the kernel cannot reproduce: refused when given (not None) rather than ignored.
_UNSERVED_KWARGS = {
    "position_bias": "an additive position bias on the logits (T5, LongT5, Pix2Struct, MPNet, …)",
    "sinks": "per-token attention sinks",
    "indices": "sparse attention over selected keys",
    "block_indices": "block-sparse attention over selected key blocks",
}


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                      dropout: float = 0.0, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                      **kwargs):
    """The transformers attention function of :data:`ATTN_IMPLEMENTATION`.

    Args:
        module: the calling attention module (``layer_idx``, ``is_causal``).
        query: ``[B, H, T_q, D]``; key / value: ``[B, H_kv, T_k, D(_v)]`` (the cache's whole
            content for this layer, this step's tokens last).
        attention_mask: bool ``[B, 1, T_q, T_k]`` (True = may attend; additive float masks
            where 0, masked at ``<= -1e4``; any other value is a bias and refused) or
            ``None``: no padding, causal in ``sdpa``'s sense (with ``1 < T_q < T_k``, a static
            cache's first prefill, query ``i`` sees keys ``0..i``).
        scaling: softmax scale (default ``D ** -0.5``).
        sliding_window: HF window ``w`` (each query sees its ``w`` latest keys; a
            bidirectional layer also its ``w - 1`` next ones) or ``None``.
        softcap: logit soft-cap (Gemma-2) or ``None``.
        s_aux: float ``[H]`` per-head sink logits (gpt-oss) or ``None``.
        kwargs: ``is_causal`` (overrides ``module.is_causal``, as in transformers' ``sdpa``);
            ``position_bias``, per-token ``sinks``, sparse ``indices`` / ``block_indices``
            raise ValueError (the kernel cannot apply them); others are ignored.

    Returns:
        ``([B, T_q, H, D_v], None)`` in the query's dtype.
    """
    route = _ROUTE.get()
    if route is not None:
        return _engine_attention(route, module, query, key, value)
    if dropout:
        raise ValueError(f"dropout={dropout}: the {ATTN_IMPLEMENTATION!r} attention is "
                         "inference-only; call model.eval() or use another implementation "
                         "for training.")
    for name, what in _UNSERVED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name}= was passed to the {ATTN_IMPLEMENTATION!r} attention: {what}, which "
                "its kernel cannot apply (ignoring it would give wrong outputs); run this model "
                "with attn_implementation='sdpa' or 'eager'.")
    if kwargs.get("output_attentions"):
        raise ValueError(f"output_attentions=True is not available with "
                         f"attn_implementation={ATTN_IMPLEMENTATION!r} (the kernel never forms "
                         "the attention matrix); use 'eager' to get the weights.")
    b, h, tq, d = query.shape
    hkv, tk, dv = key.shape[1], key.shape[2], value.shape[-1]
    device = query.device
    # transformers' own functions take a passed is_causal over the module's (CLIP's text
    # encoder layers are is_causal=False modules called with is_causal=True)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    # HF window w: w - 1 keys to the left; a bidirectional layer (ModernBERT) also sees w - 1
    # to the right (transformers' flash convention, its masks' |i - j| < w)
    w = int(sliding_window) - 1 if sliding_window and sliding_window > 0 else -1
    window = (-1, -1) if w < 0 else (w, 0 if causal else w)
    lo, hi, q_lens = _layout(attention_mask, b, tq, tk, causal=causal, window=window)
    # k/v as pages of one token: row r's keys are pages r*T_k + lo[r] ... r*T_k + hi[r] - 1.
    k_pages = key.transpose(1, 2).reshape(b * tk, 1, hkv, d)
    v_pages = value.transpose(1, 2).reshape(b * tk, 1, hkv, dv)
    kv_lens = [e - s for s, e in zip(lo, hi)]
    width = max(max(kv_lens), 1)
    cols = torch.arange(width, device=device)
    base = (torch.arange(b, device=device) * tk + torch.tensor(lo, device=device))[:, None]
    block_table = torch.where(cols[None] < torch.tensor(kv_lens, device=device)[:, None],
                              base + cols[None], 0).to(torch.int32)
    rows = [torch.arange(tq - n, tq, device=device) + r * tq for r, n in enumerate(q_lens)]
    take = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=device)
    q_flat = query.transpose(1, 2).reshape(b * tq, h, d)
    q_packed = q_flat.index_select(0, take)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    sinks = None if s_aux is None else s_aux.detach().to(device=device, dtype=torch.float32)
    out = torch.zeros(b * tq, h, dv, dtype=query.dtype, device=device)
    if take.numel():
        o = ops.paged_attention(
            q_packed, k_pages, v_pages, cu_seqlens_q=cu,
            seqused_k=torch.tensor(kv_lens, dtype=torch.int32, device=device),
            block_table=block_table,
            softmax_scale=float(scaling if scaling is not None else d ** -0.5),
            causal=causal, window_size=window, softcap=float(softcap or 0.0), sinks=sinks,
            max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens))
        out.index_copy_(0, take, o)
    return out.view(b, tq, h, dv), None


def mask_forward(*args, **kwargs):
    """The mask function of :data:`ATTN_IMPLEMENTATION`: transformers' ``sdpa`` boolean mask
    for its own cache; none inside :func:`route_to_backend` (the engine's batch says it all)."""
    if _ROUTE.get() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register :data:`ATTN_IMPLEMENTATION` with transformers (idempotent); returns the name.

    Raises:
        ImportError: transformers is not installed, or is too old to have an
            ``AttentionInterface`` (transformers ≥ 4.48 has it).
    """
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError(
            f"aiter_attn's transformers integration needs transformers with an "
            f"AttentionInterface (≥ 4.48): {exc}. `pip install -U transformers`."
        ) from exc
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    try:
        from transformers import AttentionMaskInterface
    except ImportError:  # before 4.53 masks were built per implementation name by the model
        log.warning("transformers has no AttentionMaskInterface: %r gets no padding mask; "
                    "left-padded batches need transformers ≥ 4.53", ATTN_IMPLEMENTATION)
    else:
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_forward)
    return ATTN_IMPLEMENTATION
