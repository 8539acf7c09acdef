"""AttentionBackend end to end on MHA/GQA/MQA: extend (prefix 0 / one page / crossing pages,
chunked) and decode, against a dense float64 oracle over block-permuted pools."""

import pytest
import torch

from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
from aiter_attn.testing import PagedScenario

from aiter_attn.testing.compare import assert_close_rel

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _layers(hq, hkv, d, n=2, **kw):
    return [LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, **kw)
            for i in range(n)]


def _run_step(sc: PagedScenario, backend: AttentionBackend, mode, new_lens, dtype):
    batch = sc.next_batch(mode, new_lens)
    backend.init_forward_metadata(batch)
    for layer in sc.layers:
        q, k, v = sc.step_inputs(layer)
        out = backend.forward(q, k, v, layer, batch)
        assert out.dtype == dtype and out.shape == (batch.num_tokens, layer.num_q_heads * layer.v_head_dim)
        assert_close_rel(out, sc.expected(layer, q), RTOL[dtype],
                         f"{mode} layer {layer.layer_id}")
    sc.commit_step()


CASES = [
    pytest.param(1, 8, 2, 64, id="page1-GQA8:2-D64"),
    pytest.param(16, 8, 2, 64, id="page16-GQA8:2-D64"),
    pytest.param(48, 10, 2, 80, id="page48-GQA5:1-D80"),
    pytest.param(16, 4, 1, 32, id="page16-MQA-D32"),
    pytest.param(7, 4, 4, 16, id="page7-MHA-D16"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("page_size,hq,hkv,d", CASES)
def test_extend_then_decode(page_size, hq, hkv, d, dtype):
    cfg = BackendConfig(page_size=page_size, max_batch_size=8, max_context_len=512, dtype=dtype)
    layers = _layers(hq, hkv, d)
    # prefixes: none, exactly one page, crossing page boundaries, long
    prefixes = [0, page_size, page_size + 3, 2 * page_size + 5]
    sc = PagedScenario.make(cfg, layers, prefixes, seed=page_size + hq)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    _run_step(sc, be, ForwardMode.EXTEND, [5, 1, 9, 3], dtype)
    for _ in range(3):
        _run_step(sc, be, ForwardMode.DECODE, [1, 1, 1, 1], dtype)
    # chunked prefill: a later chunk of a long prompt extends again
    _run_step(sc, be, ForwardMode.EXTEND, [page_size + 2, 2, 1, 7], dtype)


def test_v_head_dim_differs():
    cfg = BackendConfig(page_size=16, max_context_len=256, dtype=torch.float32)
    layers = _layers(4, 2, 48, v_head_dim=32)
    sc = PagedScenario.make(cfg, layers, [3, 20], seed=3)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    _run_step(sc, be, "extend", [4, 2], torch.float32)
    _run_step(sc, be, "decode", [1, 1], torch.float32)


def test_idle_returns_empty():
    cfg = BackendConfig(page_size=16, max_context_len=64, dtype=torch.float32)
    layers = _layers(4, 2, 16, n=1)
    sc = PagedScenario.make(cfg, layers, [], seed=0)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.IDLE, [])
    be.init_forward_metadata(batch)
    q = torch.zeros(0, 4 * 16)
    out = be.forward(q, q[:, :32], q[:, :32], layers[0], batch)
    assert out.shape == (0, 64)


def test_kernel_selection_once_per_layer_group(monkeypatch):
    """The kernel is chosen once per layer group (layers of one shape share it): later layers,
    steps and calls build no kernel request at all (the per-layer host cost on the hot path
    is a dict lookup)."""
    from aiter_attn import ops

    built = []
    real = ops.paged_attention_request

    def counting(*a, **kw):
        built.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ops, "paged_attention_request", counting)
    cfg = BackendConfig(page_size=4, max_context_len=128, dtype=torch.float32)
    layers = _layers(4, 2, 16, n=3)
    sc = PagedScenario.make(cfg, layers, [5, 9], seed=2)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    for _ in range(3):
        _run_step(sc, be, ForwardMode.DECODE, [1, 1], torch.float32)
    assert len(built) == 1  # three layers of one shape: one group


def test_extend_of_zero_tokens_then_decode():
    """An EXTEND step whose requests bring no token at all is ``[0, Hq·Dv]``, the oracle's
    too (the scenario's oracle used to raise on it); decoding goes on after it."""
    cfg = BackendConfig(page_size=4, max_batch_size=4, max_context_len=64,
                        dtype=torch.float32)
    sc = PagedScenario.make(cfg, _layers(4, 2, 16), [5, 9], seed=3)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    _run_step(sc, be, ForwardMode.EXTEND, [0, 0], torch.float32)
    _run_step(sc, be, ForwardMode.DECODE, [1, 1], torch.float32)


@pytest.mark.parametrize("kernel_backend", ["reference", "triton"])
@pytest.mark.parametrize("window", [None, 4], ids=["full", "window-4"])
def test_encoder_only_layers_attend_both_ways(kernel_backend, window):
    """``LayerSpec(causal=False)`` (encoder-only layers: BERT-style embedding models): a
    fresh request's tokens each see all of its tokens, a sliding window ``w`` reaching
    ``w - 1`` keys to either side; the dense oracle runs non-causal too, and a causal
    run of the same batch gives other rows (page 48, GQA 5:1, head dim 80, block-permuted
    pool with a null page)."""
    cfg = BackendConfig(page_size=48, max_batch_size=4, max_context_len=256,
                        dtype=torch.float32, kernel_backend=kernel_backend)
    layers = _layers(10, 2, 80, sliding_window=window, causal=False)
    assert not layers[0].is_causal
    assert layers[0].window_size() == ((3, 3) if window else (-1, -1))
    sc = PagedScenario.make(cfg, layers, [0, 0, 0], seed=7)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.EXTEND, [9, 1, 60])
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layers[0])
    out = be.forward(q, k, v, layers[0], batch)
    assert_close_rel(out, sc.expected(layers[0], q), RTOL[torch.float32], "encoder-only")
    causal = sc.expected(layers[0], q, causal=True)
    assert not torch.allclose(out[0].double(), causal[0], rtol=1e-3, atol=1e-3)
