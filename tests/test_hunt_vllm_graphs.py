"""The vLLM builder's CUDA-graph level against the kernel each layer actually runs.

At run time ``ops.paged_attention`` asks the registry with the layer's query and KV head counts
(``extra=(("q_heads", Hq), ("kv_heads", Hkv))``), so a layer whose GQA group is over the Triton
kernel's ``MAX_GROUP`` (or whose head dim is over its ``MAX_HEAD_DIM``) runs the reference,
which cannot be captured. The level the builder reports must come from the same choice: the
weakest over the group's layers, with their query heads read from vLLM's config (vLLM's KV
cache specs carry only the KV heads). Stand-ins mirror vLLM 0.32's fields; no vLLM needed.
"""

from types import SimpleNamespace

import pytest
import torch

from aiter_attn.integrations.vllm import core
from aiter_attn.kernels import reference
from aiter_attn.kernels import triton as triton_kernels
from aiter_attn.kernels.registry import KernelRegistry
from aiter_attn.kernels.triton.paged_attention import MAX_GROUP, MAX_HEAD_DIM
from aiter_attn.types import CGSupport


@pytest.fixture
def gpu_registry(monkeypatch):
    """The built-in reference and Triton registrations with the Triton kernels ranked as on
    a GPU (priority 100 over the reference's 0), whatever this host is."""
    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(register=reg.register)
    triton_kernels.aiter_attn_register_kernels(
        register=lambda op, name, fn, caps, priority=0: reg.register(op, name, fn, caps, 100))
    monkeypatch.setattr(core, "kernel_registry", lambda: reg)
    return reg


def _spec(head_size, num_kv_heads, *, dtype=torch.float16, block_size=16):
    """A stand-in for vLLM's per-layer ``FullAttentionSpec`` (this rank's KV heads)."""
    return SimpleNamespace(block_size=block_size, num_kv_heads=num_kv_heads,
                           head_size=head_size, head_size_v=head_size, dtype=dtype)


def _vllm_config(total_q_heads, *, tp=1, layers=None):
    """A stand-in ``VllmConfig``: ``model_config.get_num_attention_heads(parallel_config)``
    (this rank's query heads) and ``compilation_config.static_forward_context`` (layer name ->
    attention layer with this rank's ``num_heads``)."""
    parallel = SimpleNamespace(tensor_parallel_size=tp)
    model = SimpleNamespace(
        get_num_attention_heads=lambda parallel_config: total_q_heads
        // parallel_config.tensor_parallel_size)
    ctx = {name: SimpleNamespace(num_heads=h) for name, h in (layers or {}).items()}
    return SimpleNamespace(model_config=model, parallel_config=parallel,
                           compilation_config=SimpleNamespace(static_forward_context=ctx))


@pytest.mark.parametrize("q_heads, kv_heads, expected", [
    pytest.param(32, 8, CGSupport.ALWAYS, id="G4-triton"),
    pytest.param(MAX_GROUP, 1, CGSupport.ALWAYS, id="G128-triton"),
    pytest.param(2 * MAX_GROUP, 1, CGSupport.NEVER, id="G256-reference"),
])
def test_group_level_follows_the_gqa_group(gpu_registry, q_heads, kv_heads, expected):
    """A layer whose GQA group is over MAX_GROUP runs the reference: the level is NEVER."""
    spec = _spec(128, kv_heads)
    level = core.group_cudagraph_support(spec, device="cuda", vllm_config=_vllm_config(q_heads))
    assert level == expected
    # the same choice ops.paged_attention makes at run time for this layer
    served = core.paged_attention_support(device="cuda", dtype=spec.dtype, head_size=128,
                                          page_size=16, num_heads=q_heads,
                                          num_kv_heads=kv_heads)
    assert served == (expected, None)


def test_group_level_uses_this_ranks_heads(gpu_registry):
    """Under tensor parallelism the group is this rank's query heads over its KV heads:
    512 query heads over 2 KV heads (group 256) become 128 over 1 on each of 4 ranks."""
    assert core.group_cudagraph_support(_spec(128, 2), device="cuda",
                                        vllm_config=_vllm_config(512)) == CGSupport.NEVER
    assert core.group_cudagraph_support(_spec(128, 1), device="cuda",
                                        vllm_config=_vllm_config(512, tp=4)) == CGSupport.ALWAYS


def test_group_level_follows_head_dim(gpu_registry):
    """Head dims over MAX_HEAD_DIM run the reference: NEVER; up to it, the Triton kernel."""
    cfg = _vllm_config(8)
    assert core.group_cudagraph_support(_spec(MAX_HEAD_DIM, 8), device="cuda",
                                        vllm_config=cfg) == CGSupport.ALWAYS
    assert core.group_cudagraph_support(_spec(2 * MAX_HEAD_DIM, 8), device="cuda",
                                        vllm_config=cfg) == CGSupport.NEVER


def test_uniform_type_group_reads_each_layers_query_heads(gpu_registry):
    """A ``UniformTypeKVCacheSpecs`` group (layer name -> spec) takes each layer's query heads
    from vLLM's forward context: one layer with a group over MAX_GROUP makes the group NEVER."""
    specs = {"l0": _spec(128, 8), "l1": _spec(64, 1)}
    uniform = SimpleNamespace(block_size=16, kv_cache_specs=specs)
    fine = _vllm_config(32, layers={"l0": 32, "l1": 32})
    assert core.group_cudagraph_support(uniform, device="cuda",
                                        vllm_config=fine) == CGSupport.ALWAYS
    wide = _vllm_config(32, layers={"l0": 32, "l1": 2 * MAX_GROUP})
    assert core.group_cudagraph_support(uniform, device="cuda",
                                        vllm_config=wide) == CGSupport.NEVER


def test_builder_reports_the_weakest_level_to_vllm(monkeypatch, gpu_registry):
    """The builder's ``get_cudagraph_support(vllm_config, kv_cache_spec)``, as vLLM's runners
    call it, reports NEVER for a layer the reference will serve (vLLM installed only)."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import AttentionCGSupport

    from aiter_attn.integrations.vllm import backend

    monkeypatch.setattr(backend, "_device_type", lambda: "cuda")
    builder = backend.AiterAttnMetadataBuilder
    assert builder.get_cudagraph_support(_vllm_config(32), _spec(128, 8)) \
        == AttentionCGSupport.ALWAYS
    assert builder.get_cudagraph_support(_vllm_config(2 * MAX_GROUP), _spec(128, 1)) \
        == AttentionCGSupport.NEVER
