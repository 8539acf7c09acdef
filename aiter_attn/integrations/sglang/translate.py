"""SGLang's objects in our terms: forward modes, batches, layers, the runner's config and pool.

Pure functions of duck-typed inputs (nothing here imports SGLang), so the CPU tests drive them
with objects that carry exactly the field names and dtypes of the real wheel
(``tests/test_sglang_contract.py`` checks the names against its source).

Conventions that differ between SGLang and :class:`~aiter_attn.ForwardBatch`:

* ``seq_lens`` is int64 in SGLang, int32 here (converted on the device, no sync).
* CPU mirrors (``seq_lens_cpu``, ``extend_seq_lens_cpu``, ``extend_prefix_lens_cpu``) are lists
  or CPU tensors in SGLang; int64 CPU tensors here.
* TARGET_VERIFY: SGLang's ``seq_lens`` excludes the draft tokens (its kernels take the drafts'
  K/V separately); ours counts them (the drafts' slots are already in ``req_to_token`` at
  ``seq_lens .. seq_lens + draft``), so ``draft_token_num`` is added. A tree's
  ``custom_mask`` covers the real requests only; rows padded in afterwards (graph replay,
  DP attention) get all-visible blocks (:func:`_pad_verify_mask`).
* DRAFT_EXTEND_V2: SGLang's ``seq_lens`` already counts the ``num_draft_tokens`` written
  tokens, which are the last query tokens of each request: the same as ours.
* DP-attention padding (``prepare_mlp_sync_batch``) appends tokens of no request to an
  EXTEND batch (``out_cache_loc`` / ``positions`` padded with zeros, ``extend_seq_lens``
  not): the batch here keeps the requests' tokens only, and the adapter runs the layers on
  those rows and returns zeros for the rest.
* RadixAttention's ``sliding_window_size`` is the flash-attn left window (HF ``w`` − 1);
  :class:`~aiter_attn.LayerSpec` keeps HF's ``w``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...batch import ForwardBatch, SpecInfo
from ...kvcache import MHAKVPool
from ...types import AttnArch, BackendConfig, ForwardMode, LayerSpec, SpecDecodeConfig

__all__ = ["MODE_MAP", "UNSUPPORTED_MODES", "BATCH_FIELDS", "LAYER_FIELDS", "RUNNER_FIELDS",
           "POOL_METHODS", "POOL_FIELDS", "map_mode", "to_forward_batch", "layer_spec", "config_from_runner",
           "SGLangMHAPool"]

#: SGLang ``ForwardMode`` member name → ours (``DRAFT_EXTEND`` is the pre-0.5 ragged one).
MODE_MAP = {
    "EXTEND": ForwardMode.EXTEND,
    "MIXED": ForwardMode.EXTEND,  # chunked prefill + decode rows: ragged extend
    "DECODE": ForwardMode.DECODE,
    "IDLE": ForwardMode.IDLE,
    "TARGET_VERIFY": ForwardMode.TARGET_VERIFY,
    "DRAFT_EXTEND": ForwardMode.DRAFT_EXTEND,
    "DRAFT_EXTEND_V2": ForwardMode.DRAFT_EXTEND_V2,
}

#: SGLang modes this backend does not serve, with why.
UNSUPPORTED_MODES = {
    "PREBUILT": "a disaggregated-decode bookkeeping batch whose KV arrived prebuilt; it runs "
                "no attention",
    "SPLIT_PREFILL": "PD-multiplexing split prefill runs layer ranges on its own streams",
    "DLLM_EXTEND": "diffusion-LLM block extend attends bidirectionally inside a block",
}

#: ``ForwardBatch`` fields the adapter reads (each must be a field of SGLang's dataclass).
BATCH_FIELDS = ("forward_mode", "batch_size", "req_pool_indices", "seq_lens", "seq_lens_cpu",
                "out_cache_loc", "positions", "extend_seq_lens", "extend_seq_lens_cpu",
                "extend_prefix_lens_cpu", "spec_info", "encoder_lens")

#: ``RadixAttention`` attributes the adapter reads (each set in its ``__init__``).
LAYER_FIELDS = ("layer_id", "tp_q_head_num", "tp_k_head_num", "qk_head_dim", "v_head_dim",
                "scaling", "logit_cap", "logit_capping_method", "sliding_window_size",
                "is_cross_attention", "attn_type", "k_scale_float", "v_scale_float",
                "xai_temperature_len")

#: ``ModelRunner`` attributes the adapter reads.
RUNNER_FIELDS = ("req_to_token_pool", "token_to_kv_pool", "page_size", "dtype",
                 "kv_cache_dtype", "device", "use_mla_backend", "is_hybrid_swa")

#: ``MHATokenToKVPool`` methods and attributes the adapter uses.
POOL_METHODS = ("get_key_buffer", "get_value_buffer")
POOL_FIELDS = ("start_layer", "layer_num", "kv_cache_layout", "size", "k_scale_buffer")


def map_mode(mode) -> ForwardMode:
    """Our mode for an SGLang ``ForwardMode`` member (by name; ours pass through)."""
    if isinstance(mode, ForwardMode):
        return mode
    name = getattr(mode, "name", None)
    if name in MODE_MAP:
        return MODE_MAP[name]
    if name in UNSUPPORTED_MODES:
        raise ValueError(f"forward_mode={name}: the aiter_attn SGLang backend does not serve it "
                         f"({UNSUPPORTED_MODES[name]}); choose another --attention-backend for "
                         "this deployment.")
    raise ValueError(f"forward_mode={mode!r} is not an SGLang forward mode this adapter knows "
                     f"(known: {', '.join(sorted(MODE_MAP))}); upgrade aiter_attn.")


def _host_ints(name: str, value, n: int) -> Optional[torch.Tensor]:
    """A list / CPU tensor mirror as an int64 CPU tensor of its first ``n`` entries."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"forward_batch.{name} is on {value.device}; CPU mirrors must live "
                             "on the CPU (reading a device tensor would sync).")
        return value[:n].to(torch.int64)
    return torch.as_tensor(list(value)[:n], dtype=torch.int64)


def _draft_tokens(spec_info, num_tokens: int, bs: int) -> int:
    per_req = int(getattr(spec_info, "num_tokens_per_req", -1) or -1)
    if per_req > 0:
        return per_req
    n = getattr(spec_info, "draft_token_num", None)
    if n:
        return int(n)
    return num_tokens // bs if bs else 1


def _pad_verify_mask(mask: Optional[torch.Tensor], seq_cpu: torch.Tensor, q: int,
                     num_padding) -> Optional[torch.Tensor]:
    """SGLang's verify tree mask for every row of a batch with padding rows.

    SGLang builds ``spec_info.custom_mask`` for the real requests only (per request a
    row-major ``[q, seq_len + q]`` block, ``build_tree_kernel_efficient``'s FULL_MASK, the
    layout of every GPU backend without a verify-mask buffer) and pads the batch with whole
    rows afterwards: CUDA-graph replay (``num_padding`` rows in the replay view) and DP
    attention (``_pad_inputs_to_size``). SGLang's own backends pad the mask with True for those
    rows (``NgramVerifyInput.generate_attn_arg_prefill``); so does this. The real rows are
    ``batch - num_padding`` when the view says so, else the leading rows whose blocks add up to
    the mask's size (``seq_cpu`` counts the drafts and is ≥ 1, so at most one prefix does),
    except that a CPU mask of exactly ``batch · q²`` elements is SGLang's CPU layout
    (``default_tree_mask_mode``: QLEN_ONLY, the tree part only), kept. A mask of any other
    size is left as it is (planning names the sizes it accepts). Host integers only (the CPU
    mirror and the mask's shape); the concatenation is a device op outside any graph
    (planning).
    """
    if mask is None:
        return None
    ends = torch.cumsum(seq_cpu * q, 0)  # int64 CPU: end of each request's block
    full = int(ends[-1]) if ends.numel() else 0
    numel = mask.numel()
    if numel >= full:
        return mask
    bs = int(seq_cpu.numel())
    if isinstance(num_padding, int) and 0 <= num_padding <= bs:
        raw = bs - num_padding
        real = int(ends[raw - 1]) if raw else 0
        if numel < real:
            return mask
    else:
        if mask.device.type == "cpu" and numel == bs * q * q:
            return mask
        if not bool((ends == numel).any()):
            return mask
        real = numel
    flat = mask.reshape(-1)[:real]
    return torch.cat([flat, flat.new_ones(full - real)])


def to_forward_batch(fb, *, out_cache_loc: Optional[torch.Tensor] = None,
                     spec_topk: Optional[int] = None) -> ForwardBatch:
    """Our :class:`~aiter_attn.ForwardBatch` for SGLang's ``fb`` (a ``ForwardBatch`` or the
    replay view SGLang builds). No device→host sync in decode-like modes: host integers come
    from the CPU mirrors, which SGLang fills because ``needs_cpu_seq_lens`` is True.

    Args:
        fb: SGLang's batch: ``seq_lens`` int64 ``[bs]``, ``req_pool_indices`` int64,
            ``out_cache_loc`` int64 ``[num_tokens]``, CPU mirrors as lists or CPU tensors.
        out_cache_loc: use these slots instead of ``fb.out_cache_loc`` (graph planning, where
            the slots are SGLang's static buffer, read by the captured writes).
        spec_topk: the server's ``speculative_eagle_topk`` (the backend's
            ``SpecDecodeConfig.topk``), for a verify ``spec_info`` without ``topk``:
            ``NgramVerifyInput``, whose trie is irregular (``tree_topk`` -1) and whose
            breadth the server sets as ``speculative_eagle_topk``.
    """
    mode = map_mode(fb.forward_mode)
    if getattr(fb, "encoder_lens", None) is not None:
        raise ValueError("forward_batch.encoder_lens is set: encoder-decoder cross attention is "
                         "not served by the aiter_attn SGLang backend; use another backend.")
    bs = getattr(fb, "batch_size", None)
    bs = int(bs) if bs is not None else int(fb.req_pool_indices.shape[0])
    seq_lens = fb.seq_lens[:bs]
    seq_cpu = _host_ints("seq_lens_cpu", getattr(fb, "seq_lens_cpu", None), bs)
    if seq_cpu is None:
        if mode.is_decode_like:
            raise ValueError(
                f"forward_batch.seq_lens_cpu is None in {mode.name}: the aiter_attn backend plans "
                "from the CPU mirror (reading seq_lens back would sync); keep "
                "needs_cpu_seq_lens=True (the default) so SGLang fills it.")
        seq_cpu = seq_lens.to("cpu", torch.int64)  # extend may sync
    loc = fb.out_cache_loc if out_cache_loc is None else out_cache_loc
    num_tokens = int(loc.shape[0])
    positions = getattr(fb, "positions", None)
    ext = ext_cpu = prefix_cpu = spec = None
    if mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND):
        ext_cpu = _host_ints("extend_seq_lens_cpu", getattr(fb, "extend_seq_lens_cpu", None), bs)
        if ext_cpu is None:  # gpu_only batches leave the mirrors unset; extend may sync
            ext_cpu = fb.extend_seq_lens[:bs].to("cpu", torch.int64)
        ext = fb.extend_seq_lens
        ext = (ext_cpu.to(seq_lens.device, torch.int32) if ext is None
               else ext[:bs].to(torch.int32))
        prefix_cpu = _host_ints("extend_prefix_lens_cpu",
                                getattr(fb, "extend_prefix_lens_cpu", None), bs)
        if prefix_cpu is None:
            prefix_cpu = seq_cpu - ext_cpu
        real = int(ext_cpu.sum())
        if num_tokens > real:  # DP-attention padding: trailing slot-0 tokens of no request
            loc, num_tokens = loc[:real], real
            positions = positions[:real] if positions is not None else None
    elif mode == ForwardMode.TARGET_VERIFY:
        info = fb.spec_info
        q = _draft_tokens(info, num_tokens, bs)
        topk = getattr(info, "topk", None)
        topk = int((spec_topk if topk is None else topk) or 1)
        seq_lens = seq_lens + q
        seq_cpu = seq_cpu + q
        mask = None
        if topk > 1:
            mask = _pad_verify_mask(getattr(info, "custom_mask", None), seq_cpu, q,
                                    getattr(fb, "num_padding", None))
        spec = SpecInfo(num_draft_tokens=q, topk=topk, custom_mask=mask)
    elif mode == ForwardMode.DRAFT_EXTEND_V2:
        spec = SpecInfo(num_draft_tokens=num_tokens // bs if bs else 1, topk=1)
    return ForwardBatch(
        forward_mode=mode, req_pool_indices=fb.req_pool_indices[:bs],
        seq_lens=seq_lens.to(torch.int32), seq_lens_cpu=seq_cpu, out_cache_loc=loc,
        positions=positions, extend_seq_lens=ext,
        extend_seq_lens_cpu=ext_cpu, extend_prefix_lens_cpu=prefix_cpu, spec_info=spec)


def layer_spec(layer) -> LayerSpec:
    """Our :class:`~aiter_attn.LayerSpec` of an SGLang ``RadixAttention`` (its TP-local heads):
    a decoder layer, or an encoder-only one (``AttentionType.ENCODER_ONLY``: BERT-style
    embedding models), which attends over its request's keys both ways (``causal=False``)."""
    if getattr(layer, "is_cross_attention", False):
        raise ValueError(f"layer {layer.layer_id} is cross attention; the aiter_attn SGLang "
                         "backend serves decoder self-attention only.")
    attn_type = getattr(getattr(layer, "attn_type", None), "name", "DECODER")
    if attn_type not in ("DECODER", "ENCODER_ONLY"):
        raise ValueError(f"layer {layer.layer_id} has attn_type={attn_type}; the aiter_attn "
                         "SGLang backend serves decoder self-attention and encoder-only "
                         "layers; serve this model with another --attention-backend.")
    cap = float(getattr(layer, "logit_cap", 0.0) or 0.0)
    method = getattr(layer, "logit_capping_method", "tanh")
    if cap > 0 and method != "tanh":
        raise ValueError(f"layer {layer.layer_id} has logit_capping_method={method!r}; only "
                         "'tanh' soft-capping is implemented.")
    temp_len = getattr(layer, "xai_temperature_len", -1)
    if temp_len is not None and temp_len > 0:
        raise ValueError(f"layer {layer.layer_id} has xai_temperature_len={temp_len} (Grok's "
                         "position-dependent query temperature); the aiter_attn SGLang backend "
                         "serves it only at ≤ 0 (off); serve this model with another "
                         "--attention-backend (triton implements it).")
    sws = getattr(layer, "sliding_window_size", -1)
    window = None if sws is None or sws < 0 else int(sws) + 1
    return LayerSpec(
        layer_id=int(layer.layer_id), num_q_heads=int(layer.tp_q_head_num),
        num_kv_heads=int(layer.tp_k_head_num), head_dim=int(layer.qk_head_dim),
        v_head_dim=int(layer.v_head_dim), scaling=float(layer.scaling), logit_cap=cap,
        sliding_window=window, causal=attn_type == "DECODER",
        k_scale=float(getattr(layer, "k_scale_float", None) or 1.0),
        v_scale=float(getattr(layer, "v_scale_float", None) or 1.0))


class SGLangMHAPool(MHAKVPool):
    """SGLang's ``MHATokenToKVPool`` seen as our paged NHD pool, without a copy.

    SGLang keeps per layer K ``[size + page_size, head_num, head_dim]`` indexed by slot
    ``page * page_size + offset``, which is the memory of our ``[num_pages, page_size,
    head_num, head_dim]`` pages. :meth:`kv_buffers` asks SGLang's pool for the layer each time
    (its ``get_key_buffer`` is where layer-wise KV loading waits) and views it.
    """

    def __init__(self, sgl_pool, page_size: int, device):
        layout = getattr(sgl_pool, "kv_cache_layout", "nhd")
        if layout != "nhd":
            raise ValueError(
                f"SGLang's KV pool has kv_cache_layout={layout!r}; the aiter_attn SGLang backend "
                "reads the token-major layout 'nhd' only: unset SGLANG_USE_HND_KVCACHE and "
                "SGLANG_AITER_KV_CACHE_LAYOUT (or set it to 'nhd').")
        if getattr(sgl_pool, "is_quantized_kv_cache", False):
            raise ValueError(
                "SGLang's KV pool is quantized (is_quantized_kv_cache=True, e.g. an FP4 KV "
                "cache): its get_key_buffer returns dequantized copies, which the aiter_attn "
                "backend cannot write; use --kv-cache-dtype auto (or an fp8 dtype).")
        if getattr(sgl_pool, "k_scale_buffer", None) is not None:
            raise ValueError(
                f"SGLang's KV pool ({type(sgl_pool).__name__}) keeps block scale factors beside "
                "its fp8 data (--kv-cache-dtype mxfp8), which the aiter_attn backend neither "
                "writes nor reads; use --kv-cache-dtype fp8_e4m3 (per-tensor k/v scales) or "
                "auto.")
        k0 = sgl_pool.get_key_buffer(sgl_pool.start_layer)
        v0 = sgl_pool.get_value_buffer(sgl_pool.start_layer)
        slots = int(k0.shape[0])
        size = getattr(sgl_pool, "size", None)
        if size is not None and slots < int(size) + page_size:
            raise ValueError(
                f"SGLang's KV pool ({type(sgl_pool).__name__}) holds {slots} slots per layer "
                f"for size={size} tokens (+ {page_size} padding): it stores no KV "
                "(--prefill-only-disable-kv-cache keeps placeholders only), and the aiter_attn "
                "backend writes and reads every token's K/V in the pool; drop "
                "--prefill-only-disable-kv-cache (or serve it with --attention-backend fa3).")
        super().__init__(num_pages=slots // page_size, page_size=page_size,
                         num_kv_heads=int(k0.shape[1]), head_dim=int(k0.shape[2]),
                         num_layers=0, dtype=k0.dtype, device=str(device),
                         v_head_dim=int(v0.shape[2]))
        self.num_layers = int(sgl_pool.start_layer) + int(sgl_pool.layer_num)
        self.sgl_pool = sgl_pool

    def _view(self, buf: torch.Tensor, dim: int) -> torch.Tensor:
        n = self.num_pages * self.page_size
        return buf[:n].view(self.num_pages, self.page_size, self.num_kv_heads, dim)

    def kv_buffers(self, layer_id: int):
        """``(k_cache, v_cache)`` of one layer as NHD page views of SGLang's buffers."""
        return (self._view(self.sgl_pool.get_key_buffer(layer_id), self.head_dim),
                self._view(self.sgl_pool.get_value_buffer(layer_id), self.v_head_dim))


def config_from_runner(runner, spec: Optional[SpecDecodeConfig] = None) -> BackendConfig:
    """Our :class:`~aiter_attn.BackendConfig` for an SGLang ``ModelRunner`` (MHA models)."""
    if getattr(runner, "use_mla_backend", False):
        raise ValueError("this model uses MLA; the aiter_attn SGLang backend serves MHA/GQA/MQA "
                         "models (MLA runs through aiter_attn's own engine); pick another "
                         "--attention-backend.")
    if getattr(runner, "is_hybrid_swa", False):
        raise ValueError("hybrid sliding-window pools (separate SWA KV pool) are not served by "
                         "the aiter_attn SGLang backend; start SGLang with "
                         "--disable-hybrid-swa-memory, so windows run over the full pool.")
    r2t = runner.req_to_token_pool.req_to_token
    return BackendConfig(
        page_size=int(getattr(runner, "page_size", 1) or 1),
        max_batch_size=int(r2t.shape[0]), max_context_len=int(r2t.shape[1]),
        dtype=runner.dtype, kv_cache_dtype=runner.kv_cache_dtype or runner.dtype,
        device=str(runner.device), arch=AttnArch.MHA, spec=spec)
