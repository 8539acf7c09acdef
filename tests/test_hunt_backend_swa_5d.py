"""Defects found hunting the backend and the SWA/5-D/cascade strategies (AttentionBackend's
layer call, SWAExecution, Vec5DExecution): each test failed before its fix."""

from __future__ import annotations

import pytest
import torch

from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec

from ._triton_util import DEVICE, requires_triton
from .test_swa import hybrid_layers, make_swa_scenario
from .test_vec5d import make_5d_scenario


def _backend(arch, kernel=None, *, sinks=None):
    """A 2-layer backend over a block-permuted pool (noise everywhere, null page 0): GQA 5:1,
    page 4, one sliding-window layer; prefixes of 5 and 7 tokens."""
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32, arch=arch,
                        kernel_backend=kernel, device=DEVICE if kernel == "triton" else "cpu")
    if arch == "swa":
        layers = hybrid_layers(10, 2, 16, [3, None], sinks=sinks)
        sc = make_swa_scenario(cfg, layers, [5, 7], seed=1)
    else:
        layers = [LayerSpec(layer_id=i, num_q_heads=10, num_kv_heads=2, head_dim=16,
                            sliding_window=w, sinks=sinks) for i, w in enumerate([3, None])]
        sc = make_5d_scenario(cfg, layers, [5, 7], seed=1, v_layout="hd_page")
    return sc, AttentionBackend(cfg, sc.req_pool, sc.kv_pool)


def _kv_bytes(pool) -> list:
    """Every KV buffer of the pool (both sub-pools of an SWA pool), cloned."""
    subs = (pool.full, pool.swa) if hasattr(pool, "swa") else (pool,)
    return [b.clone() for p in subs for b in p.k_buffers + p.v_buffers]


# ---------------------------------------------------------------------------------------------
# per-call sinks: checked before any KV write or launch
# ---------------------------------------------------------------------------------------------

BAD_SINKS = [
    pytest.param(lambda: torch.zeros(2), ValueError, r"sinks has shape \(2,\); expected \(10,\)",
                 id="too-short"),
    pytest.param(lambda: torch.zeros(2, 5), ValueError, r"sinks has shape \(2, 5\)", id="2-D"),
    pytest.param(lambda: torch.zeros(10, dtype=torch.int64), TypeError, "float32",
                 id="integer"),
    pytest.param(lambda: [0.0] * 10, TypeError, "sinks must be a torch.Tensor", id="list"),
]


@pytest.mark.parametrize("make,exc,match", BAD_SINKS)
@pytest.mark.parametrize("mode,new", [("decode", [1, 1]), ("extend", [2, 3])])
@pytest.mark.parametrize("arch", ["swa", "vec5d"])
def test_per_call_sinks_checked_before_the_kv_write(arch, mode, new, make, exc, match):
    """``forward(..., sinks=)`` overrides ``layer.sinks`` but was never checked: a short
    tensor failed inside the reference kernel *after* the layer's K/V had been written (a
    RuntimeError about a view), a 2-D or integer one ran. Now a clear error, cache untouched."""
    sc, be = _backend(arch)
    batch = sc.next_batch(mode, new)
    be.init_forward_metadata(batch)
    for layer in sc.layers:
        q, k, v = sc.step_inputs(layer)
        before = _kv_bytes(sc.kv_pool)
        with pytest.raises(exc, match=match):
            be.forward(q, k, v, layer, batch, sinks=make())
        after = _kv_bytes(sc.kv_pool)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), \
            "the refused call wrote the KV cache"


@requires_triton
def test_short_sinks_not_read_past_their_end_on_triton():
    """On the Triton kernels a 2-element sinks tensor for 10 query heads ran silently, heads
    2..9 reading past its end (TRITON_INTERPRET or a GPU)."""
    sc, be = _backend("swa", "triton")
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    layer = sc.layers[0]
    q, k, v = sc.step_inputs(layer)
    with pytest.raises(ValueError, match=r"sinks has shape \(2,\); expected \(10,\)"):
        be.forward(q, k, v, layer, batch, sinks=torch.zeros(2, device=DEVICE))


def test_good_per_call_sinks_still_override_the_layer():
    """A valid per-call sinks tensor is used (it differs from the layer's, so the output
    does), and equals the layer carrying the same sinks."""
    sinks = torch.linspace(-1.0, 2.0, 10)
    outs = []
    for layer_sinks, call_sinks in ((None, sinks), (sinks, None)):
        sc, be = _backend("swa", sinks=layer_sinks)
        batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
        be.init_forward_metadata(batch)
        q, k, v = sc.step_inputs(sc.layers[0])
        outs.append(be.forward(q, k, v, sc.layers[0], batch, sinks=call_sinks))
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------
# extra layer-call keywords: refused, not dropped
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["swa", "vec5d"])
def test_layer_call_keywords_with_a_value_are_refused(arch):
    """``forward(**kwargs)`` swallowed every extra keyword: ``k_rope=`` (an MLA-style split
    key), ``sink=`` (a misspelt ``sinks``) or ``logit_cap=`` ran as if never given, the
    output silently missing their effect. A keyword with a value is refused before any KV
    write; ``None`` values (SGLang passes some) still go through."""
    sc, be = _backend(arch)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    be.init_forward_metadata(batch)
    layer = sc.layers[0]
    q, k, v = sc.step_inputs(layer)
    before = _kv_bytes(sc.kv_pool)
    for kw in ({"k_rope": k}, {"sink": torch.zeros(10)}, {"logit_cap": 30.0}):
        with pytest.raises(TypeError, match=rf"\['{next(iter(kw))}'\]"):
            be.forward(q, k, v, layer, batch, **kw)
        with pytest.raises(TypeError, match="does not read"):
            be.forward_decode(q, k, v, layer, batch, **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, _kv_bytes(sc.kv_pool)))
    out = be.forward(q, k, v, layer, batch, q_rope=None, k_rope=None)
    assert out.shape == (2, layer.num_q_heads * layer.v_head_dim)


def test_multistep_draft_checks_per_call_sinks_before_the_kv_write():
    """``MultiStepDraftBackend.forward`` calls the strategies directly: its per-call ``sinks``
    must get the same checks as the backend's layer call, before the step's KV write."""
    import pytest

    from aiter_attn.multistep import MultiStepDraftBackend
    from .test_multistep_draft import _draft_batch, _setup
    from aiter_attn.testing.spec_cases import draft_step_inputs

    cfg, layers, sc, _ = _setup(7, 2, 3, [9, 7])
    ms = MultiStepDraftBackend(cfg, sc.req_pool, sc.kv_pool)
    ms.init_forward_metadata(_draft_batch(sc.rows, [9, 7]))
    layer = layers[0]
    q, k, v = draft_step_inputs(layer, 4, torch.float32, torch.Generator().manual_seed(0))
    before = [t.clone() for t in sc.kv_pool.kv_buffers(layer.layer_id)]
    with pytest.raises(ValueError, match=r"sinks has shape \(2,\); expected \(10,\)"):
        ms.forward(0, q, k, v, layer, sinks=torch.zeros(2))
    after = sc.kv_pool.kv_buffers(layer.layer_id)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
