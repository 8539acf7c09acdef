"""SGLang serving paths beyond the plain step, each checked against the real 0.5.23 wheel
(``tests/_sglang_wheel.py``) and driven as SGLang drives it:

* the breakable prefill CUDA graph (SGLang's default prefill graph on CUDA,
  ``cuda_graph_config.default_prefill_backend``) plans ``init_forward_metadata(forward_batch)``
  on the live batch but replays each layer's attention (``RadixAttention._eager_attention``)
  on its ``static_forward_batch``: a second ``ForwardBatch`` sharing the live batch's
  ``req_pool_indices`` / ``seq_lens`` with a static, narrowed ``out_cache_loc``;
* ``update_verify_buffers_to_fill_after_draft``, which EAGLE verify calls under
  ``SGLANG_ENABLE_OVERLAP_PLAN_STREAM`` (the wheel's base raises ``NotImplementedError``);
* Grok's ``xai_temperature_len`` query temperature, which SGLang's triton kernels apply;
* MHA pools whose layout is not NHD (``SGLANG_USE_HND_KVCACHE``, AITER's ``vectorized_5d``).
"""

from __future__ import annotations

import re
import types

import pytest
import torch

from . import _sglang_wheel as W
from . import test_sglang_adapter as A
from .test_sglang_adapter import sgl, wheel  # noqa: F401  (fixtures)


def _extend_case(sgl, w):
    rows, prefix, ext = [1, 4, 7], [0, 7, 13], [9, 4, 1]
    for r, p in zip(rows, prefix):
        w.grow(r, p)
    loc = torch.cat([w.grow(r, p + e) for r, p, e in zip(rows, prefix, ext)])
    totals = [p + e for p, e in zip(prefix, ext)]
    fb = sgl.FB(
        forward_mode=sgl.FM.EXTEND, batch_size=3,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor(totals, dtype=torch.int64), seq_lens_sum=sum(totals),
        seq_lens_cpu=torch.tensor(totals, dtype=torch.int64), out_cache_loc=loc,
        extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_seq_lens_cpu=list(ext), extend_prefix_lens_cpu=list(prefix),
        extend_num_tokens=sum(ext), global_num_token_non_padded_cpu=sum(ext),
        positions=torch.cat([torch.arange(p, t) for p, t in zip(prefix, totals)]))
    return fb, rows, totals, ext


def _static_view(sgl, fb, static_num_tokens):
    """``PrefillCudaGraphRunner``'s ``static_forward_batch``: the live batch's request
    tensors, its slots and positions in the runner's static (padded) buffers."""
    n = fb.out_cache_loc.shape[0]
    loc = torch.zeros(static_num_tokens, dtype=torch.int64)
    loc[:n] = fb.out_cache_loc
    pos = torch.zeros(static_num_tokens, dtype=torch.int64)
    pos[:n] = fb.positions
    return sgl.FB(
        forward_mode=fb.forward_mode, batch_size=fb.batch_size,
        req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
        seq_lens_cpu=fb.seq_lens_cpu, out_cache_loc=loc, seq_lens_sum=fb.seq_lens_sum,
        extend_seq_lens=fb.extend_seq_lens, extend_prefix_lens=fb.extend_prefix_lens,
        extend_seq_lens_cpu=fb.extend_seq_lens_cpu,
        extend_prefix_lens_cpu=fb.extend_prefix_lens_cpu,
        extend_num_tokens=fb.extend_num_tokens, positions=pos,
        global_num_token_non_padded_cpu=fb.global_num_token_non_padded_cpu)


def _eager_attention(backend, q, k, v, layer, static, sinks):
    """``RadixAttention._eager_attention`` at replay: the real rows of the padded static
    batch, ``out_cache_loc`` / ``positions`` narrowed on it for the call
    (``graph_utils.attention_input_scope``)."""
    n = static.global_num_token_non_padded_cpu
    loc, pos = static.out_cache_loc, static.positions
    static.out_cache_loc, static.positions = loc[:n], pos[:n]
    try:
        return backend.forward(q[:n], k[:n], v[:n], layer, static, True, sinks=sinks)
    finally:
        static.out_cache_loc, static.positions = loc, pos


def test_breakable_prefill_graph_replays_attention_on_the_static_batch(sgl):
    w = A.World(sgl)
    fb, rows, totals, ext = _extend_case(sgl, w)
    n = sum(ext)
    q, k, v = w.qkv(n)
    pad = 32 - n  # the bucket's padding tokens
    qp, kp, vp = (torch.cat([t, torch.zeros(pad, *t.shape[1:])]) for t in (q, k, v))
    # replay: metadata for the live batch, attention on the static view
    w.backend.init_forward_metadata(fb)
    static = _static_view(sgl, fb, n + pad)
    for layer in w.layers:
        sinks = w.sinks if layer.layer_id == 1 else None
        out = _eager_attention(w.backend, qp, kp, vp, layer, static, sinks)
        torch.testing.assert_close(w.pool.k_buffer[layer.layer_id][fb.out_cache_loc], k)
        torch.testing.assert_close(w.pool.v_buffer[layer.layer_id][fb.out_cache_loc], v)
        start = 0
        for row, total, m in zip(rows, totals, ext):
            want = w.oracle(layer, row, q[start: start + m], total)
            A._assert_close(out[start: start + m], want, f"layer {layer.layer_id} row {row}")
            start += m


def test_a_batch_of_another_step_is_still_refused(sgl):
    """Sharing nothing with the planned batch (its own request tensors), a batch is not
    run with that plan."""
    w = A.World(sgl)
    fb, *_ = _extend_case(sgl, w)
    w.backend.init_forward_metadata(fb)
    other = _static_view(sgl, fb, fb.out_cache_loc.shape[0])
    other.req_pool_indices = fb.req_pool_indices.clone()
    q, k, v = w.qkv(fb.out_cache_loc.shape[0])
    with pytest.raises(RuntimeError, match="not planned"):
        w.backend.forward(q, k, v, w.layers[0], other, True)


def test_overlap_plan_stream_verify_hook(sgl, wheel):
    """EAGLE verify calls ``update_verify_buffers_to_fill_after_draft(spec_info, bs)`` when
    ``SGLANG_ENABLE_OVERLAP_PLAN_STREAM`` is on (``speculative/eagle_worker_common.py``);
    the plan already read the drafts' final mask (the plan stream waits on the draft),
    so there is nothing to patch, as in SGLang's aiter and triton backends."""
    src = wheel.read("sglang/srt/speculative/eagle_worker_common.py")
    assert "update_verify_buffers_to_fill_after_draft(" in src
    assert "plan_stream.wait_stream(fwd_stream)" in src
    w = A.World(sgl)
    info = sgl.Verify(draft_token_num=3, topk=1, num_tokens_per_req=-1)
    assert w.backend.update_verify_buffers_to_fill_after_draft(info, None) is None
    assert w.backend.update_verify_buffers_to_fill_after_draft(info, 4) is None


def test_grok_attention_temperature_is_refused(sgl, wheel):
    """Grok sets ``attn.xai_temperature_len`` (> 0: queries past that position are scaled
    by log2(pos) / log2(len) in SGLang's triton kernels); the adapter has no such scaling,
    so it must refuse, not serve plain attention."""
    assert "xai_temperature_len" in W.self_attributes(W.find_def(
        W.find_class(wheel.tree(W.RADIX), "RadixAttention"), "__init__"))
    from aiter_attn.integrations.sglang.translate import layer_spec

    w = A.World(sgl)
    layer = w.layers[0]
    layer.xai_temperature_len = -1  # RadixAttention's default: served
    assert layer_spec(layer).layer_id == 0
    layer.xai_temperature_len = 1024
    with pytest.raises(ValueError, match=r"xai_temperature_len=1024.*another --attention-backend"):
        layer_spec(layer)


@pytest.mark.parametrize("layout", ["hnd", "vectorized_5d"])
def test_pool_layouts_other_than_nhd_are_refused(sgl, wheel, layout):
    src = wheel.read(W.MEMORY_POOL)
    assert f'"{layout}"' in src and "self.kv_cache_layout" in src
    w = A.World(sgl)
    pool = w.pool
    pool.kv_cache_layout = layout
    if layout == "hnd":  # SGLang's HND pool: [pages, heads, page_size, head_dim]
        pool.k_buffer = [b.view(-1, A.PS, A.HKV, A.D).transpose(1, 2).contiguous()
                         for b in pool.k_buffer]
    with pytest.raises(ValueError, match=rf"kv_cache_layout={layout!r}.*'nhd'"):
        sgl.cls(w.runner)


def test_quantized_pool_is_refused(sgl):
    """An FP4 (quantized) MHA pool hands attention a dequantized copy from
    ``get_key_buffer``: writes into it would be lost."""
    w = A.World(sgl)
    w.pool.is_quantized_kv_cache = True
    with pytest.raises(ValueError, match="quantized"):
        sgl.cls(w.runner)


def test_full_prefill_graph_is_refused_with_the_sglang_setting(sgl, wheel):
    """``--cuda-graph-backend-prefill=full`` (experimental, opt-in) plans its captured
    extend batch through ``init_forward_metadata_out_graph(forward_batch, in_capture=True)``;
    the backend names SGLang's setting to change instead of the graph manager's API."""
    src = wheel.read("sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py")
    assert re.search(r"init_forward_metadata_out_graph\(\s*forward_batch,\s*in_capture=True", src)
    w = A.World(sgl)
    fb, *_ = _extend_case(sgl, w)
    w.backend.init_cuda_graph_state(4, 64)
    with pytest.raises(ValueError, match="--cuda-graph-backend-prefill=breakable"):
        w.backend.init_forward_metadata_out_graph(fb, in_capture=True)
