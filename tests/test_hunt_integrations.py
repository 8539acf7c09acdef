"""Defects found hunting the engine integrations (aiter_attn/integrations/vllm and
aiter_attn/integrations/sglang): each test failed before its fix.

The SGLang cases drive the backend built on the real 0.5.23 wheel's base class, with the
SGLang-shaped runner, pool and batches of ``tests/test_sglang_adapter.py``.
"""

from __future__ import annotations

import types

import pytest
import torch

from .test_sglang_adapter import HQ, World, _check, _decode_batch, sgl, wheel  # noqa: F401


def test_sglang_sinks_follow_in_place_weight_updates(sgl):
    """SGLang updates weights in place (gpt-oss's ``load_weights`` does
    ``param.data.copy_(w)`` for the bf16 sinks; ``update_weights_from_tensor`` / ``_from_disk``
    call it on the live model): the next step must attend with the new sinks. The adapter
    cached a float32 copy keyed by the parameter's identity, which never changes, so it kept
    serving the old sinks."""
    w = World(sgl)
    w.sinks = torch.nn.Parameter(w.sinks, requires_grad=False)  # the layer's parameter
    rows = [2, 5]
    for r, t in zip(rows, [6, 13]):
        w.grow(r, t - 1)
    fb = _decode_batch(sgl, w, rows, [6, 13])
    q, k, v = w.qkv(2)
    w.backend.init_forward_metadata(fb)
    _check(w, fb, q, k, v, rows, [6, 13], [1, 1])

    with torch.no_grad():  # SGLang's weight update: same Parameter, new values
        w.sinks.copy_((torch.randn(HQ, generator=w.g) + 3.0).to(w.sinks.dtype))
    fb = _decode_batch(sgl, w, rows, [7, 14])
    q, k, v = w.qkv(2)
    w.backend.init_forward_metadata(fb)
    _check(w, fb, q, k, v, rows, [7, 14], [1, 1])  # the oracle reads the updated sinks


def test_sglang_pool_without_kv_storage_is_refused(sgl):
    """``--prefill-only-disable-kv-cache`` gives SGLang's ``NoOpMHATokenToKVPool``: its
    ``size`` is the admission capacity but each layer's buffers are ``[page_size, H, D]``
    placeholders. The adapter viewed them as one page and would write every token's K/V at its
    slot far past the buffer (out of bounds on a GPU); it must refuse the pool, naming the
    flag."""
    w = World(sgl)
    pool = w.pool
    pool.k_buffer = [b[: pool.page_size].clone() for b in pool.k_buffer]
    pool.v_buffer = [b[: pool.page_size].clone() for b in pool.v_buffer]
    with pytest.raises(ValueError, match="prefill-only-disable-kv-cache"):
        sgl.cls(w.runner)


def test_sglang_block_scaled_fp8_pool_is_refused(sgl):
    """``--kv-cache-dtype mxfp8`` gives SGLang's ``MHATokenToKVPoolMXFP8``: fp8 data plus
    per-32-element UE8M0 scale buffers (``k_scale_buffer`` / ``v_scale_buffer``), and no
    ``quant_method``, so ``is_quantized_kv_cache`` is False. The adapter served it as a
    per-tensor fp8 cache at scale 1, ignoring the scales SGLang's other readers (HiCache, PD
    transfer, FA4) rely on; it must refuse, naming the dtype to use."""
    w = World(sgl)
    w.pool.k_scale_buffer = [torch.zeros(1) for _ in range(w.pool.layer_num)]
    w.pool.v_scale_buffer = [torch.zeros(1) for _ in range(w.pool.layer_num)]
    with pytest.raises(ValueError, match="mxfp8.*fp8_e4m3"):
        sgl.cls(w.runner)
    # SGLang's plain pools set the attribute to None: still served
    w.pool.k_scale_buffer = w.pool.v_scale_buffer = None
    assert isinstance(sgl.cls(w.runner), sgl.cls)
