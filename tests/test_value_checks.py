"""Values nobody checked (issue 11, item 6).

``cu_seqlens_q`` ending below the token count, a page id of -1 or past the pool,
``seqused_k`` below the query count: the reference kernel, which reads them to the host
anyway, always refuses them with a ``ValueError`` naming the argument, the request and the
value. GPU kernels do the same in the checked mode (``AITER_ATTN_DEBUG=1`` or
``BackendConfig(debug_checks=True)``): the one shared checker
(:func:`aiter_attn.validation.check_paged_index_values`) runs before the kernel, so the bad
id never reaches it (in the interpreter a page id of 2^30 would crash the process).
Non-finite ``softmax_scale``/``softcap`` are refused at the op, always.
"""

from __future__ import annotations

import math

import pytest
import torch

from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec, ops
from aiter_attn.kernels.reference import mla_paged_attention_reference, paged_attention_reference
from aiter_attn.kernels.reference_extra import kv_5d_from_nhd
from aiter_attn.kernels.reference_5d import vec_width
from aiter_attn.plugins import kernel_registry
from aiter_attn.strategies.vec5d import paged_attention_5d
from aiter_attn.testing import PagedScenario
from aiter_attn.validation import DEBUG_ENV, CheckedKernel

from ._index_case import attn_kwargs, mla_case, paged_case
from ._triton_util import DEVICE, requires_triton


def _set(name, index, value):
    def mutate(kw):
        t = kw[name].clone()
        t[index] = value
        kw[name] = t
    return mutate


#: (id, mutation of the call's kwargs, what the error must say). The case has q_lens (3, 2),
#: kv_lens (7, 5), page size 4, a 3-column block table and 7 + 2 spare pages.
BAD = [
    pytest.param(_set("cu_seqlens_q", -1, 4), r"cu_seqlens_q\[-1\]=4 but q has 5 tokens",
                 id="cu-ends-below-tokens"),
    pytest.param(_set("cu_seqlens_q", -1, 6), r"cu_seqlens_q\[-1\]=6 but q has 5 tokens",
                 id="cu-ends-past-tokens"),
    pytest.param(_set("cu_seqlens_q", 0, 1), r"cu_seqlens_q\[0\]=1", id="cu-starts-past-0"),
    pytest.param(_set("cu_seqlens_q", 1, 6), r"cu_seqlens_q decreases at request 1",
                 id="cu-decreases"),
    pytest.param(_set("block_table", (0, 0), -1), r"block_table\[0, 0\]=-1 is not a page",
                 id="page-minus-1"),
    pytest.param(_set("block_table", (1, 1), 9), r"block_table\[1, 1\]=9 is not a page",
                 id="page-past-pool"),
    pytest.param(_set("block_table", (0, 1), 2 ** 30), r"block_table\[0, 1\]=1073741824",
                 id="page-2^30"),
    pytest.param(_set("seqused_k", 1, 1), r"seqused_k\[1\]=1 < request 1's 2 queries",
                 id="seqused-below-q-len"),
    pytest.param(_set("seqused_k", 0, 13), r"seqused_k\[0\]=13 needs 4 pages .* 3 columns",
                 id="seqused-past-table"),
    pytest.param(lambda kw: kw.update(max_seqlen_q=2), r"3 queries but max_seqlen_q=2",
                 id="max-seqlen-q-too-small"),
]

#: unused entries past a request's pages may hold anything (they are never read)
def _garbage_past_pages(kw):
    t = kw["block_table"].clone()
    t[:, -1] = -1
    t[1, 2] = 2 ** 30
    kw["block_table"] = t


def _paged(backend, mutate, device=DEVICE):
    c = paged_case(device=device)
    kw = attn_kwargs(c)
    mutate(kw)
    return lambda: ops.paged_attention(c.q, c.k_cache, c.v_cache, backend=backend, **kw)


@pytest.mark.parametrize("mutate,msg", BAD)
def test_reference_refuses_bad_index_values(mutate, msg):
    with pytest.raises(ValueError, match=msg):
        _paged("reference", mutate, "cpu")()


@pytest.mark.parametrize("mutate,msg", BAD)
def test_reference_kernel_itself_checks(mutate, msg):
    """Called directly (no op in front), the reference kernel still refuses."""
    c = paged_case()
    kw = attn_kwargs(c)
    mutate(kw)
    with pytest.raises(ValueError, match=msg):
        paged_attention_reference(c.q, c.k_cache, c.v_cache, torch.empty_like(c.q), **kw)


@requires_triton
@pytest.mark.parametrize("mutate,msg", BAD)
def test_triton_checked_mode_refuses_bad_index_values(monkeypatch, mutate, msg):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match=msg):
        _paged("triton", mutate)()


@requires_triton
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_unread_table_entries_may_hold_anything(monkeypatch, backend):
    monkeypatch.setenv(DEBUG_ENV, "1")
    c = paged_case(device=DEVICE)
    want = ops.paged_attention(c.q, c.k_cache, c.v_cache, backend=backend, **attn_kwargs(c))
    kw = attn_kwargs(c)
    _garbage_past_pages(kw)
    got = ops.paged_attention(c.q, c.k_cache, c.v_cache, backend=backend, **kw)
    assert torch.equal(got, want)


def test_non_causal_cross_attention_may_have_fewer_keys_than_queries():
    """Without positions (non-causal, no window) queries are not the last keys: allowed."""
    c = paged_case(q_lens=(3, 2), kv_lens=(2, 1))
    ops.paged_attention(c.q, c.k_cache, c.v_cache, causal=False, backend="reference",
                        **attn_kwargs(c))


def test_mask_blocks_outside_custom_mask_are_refused():
    c = paged_case()
    n_elems = 3 * 7 + 2 * 5
    kw = attn_kwargs(c, causal=False, custom_mask=torch.ones(n_elems - 1, dtype=torch.bool),
                     mask_indptr=torch.tensor([0, 21, n_elems], dtype=torch.int64))
    with pytest.raises(ValueError, match=r"request 1's mask block \[21, 31\)"):
        ops.paged_attention(c.q, c.k_cache, c.v_cache, backend="reference", **kw)


# ---------------------------------------------------------------------- MLA and 5-D

MLA_BAD = [BAD[0], BAD[4], BAD[6], BAD[7]]


@pytest.mark.parametrize("mutate,msg", MLA_BAD)
def test_mla_reference_refuses_bad_index_values(mutate, msg):
    c = mla_case()
    kw = attn_kwargs(c, kv_lora_rank=c.kv_lora_rank)
    mutate(kw)
    with pytest.raises(ValueError, match=msg):
        ops.mla_paged_attention(c.q, c.kv_cache, backend="reference", **kw)
    with pytest.raises(ValueError, match=msg):
        mla_paged_attention_reference(c.q, c.kv_cache, torch.empty_like(c.q[..., :32]), **kw)


@requires_triton
@pytest.mark.parametrize("mutate,msg", MLA_BAD)
def test_mla_triton_checked_mode_refuses_bad_index_values(monkeypatch, mutate, msg):
    monkeypatch.setenv(DEBUG_ENV, "1")
    c = mla_case(device=DEVICE)
    kw = attn_kwargs(c, kv_lora_rank=c.kv_lora_rank)
    mutate(kw)
    with pytest.raises(ValueError, match=msg):
        ops.mla_paged_attention(c.q, c.kv_cache, backend="triton", **kw)


@requires_triton
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("mutate,msg", MLA_BAD)
def test_5d_refuses_bad_index_values(monkeypatch, backend, mutate, msg):
    monkeypatch.setenv(DEBUG_ENV, "1")
    c = paged_case(device=DEVICE)
    k5, v5 = kv_5d_from_nhd(c.k_cache, c.v_cache, vec_width(c.k_cache.dtype))
    kw = attn_kwargs(c)
    mutate(kw)
    with pytest.raises(ValueError, match=msg.replace("paged_attention", "paged_attention_5d")):
        paged_attention_5d(c.q, k5, v5, backend=backend, **kw)


@requires_triton
def test_write_checked_mode_refuses_slots_past_the_cache(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    k_cache = torch.zeros(3, 4, 2, 16, device=DEVICE)
    k = torch.ones(2, 2, 16, device=DEVICE)
    slots = torch.tensor([5, 12], dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"slots\[1\]=12 is past the cache's 12 slots"):
        ops.write_kv(k_cache, k_cache.clone(), slots, k, k.clone(), backend="triton")


@requires_triton
@pytest.mark.parametrize("slots,pair", [([5, 7, 5], (0, 2)), ([-1, 9, -1, 3, 9], (1, 4)),
                                        ([0, 4, 0, 11, 4], (1, 4))])
def test_write_checked_mode_refuses_two_tokens_on_one_slot(monkeypatch, slots, pair):
    """Two live tokens on one slot race on the GPU; negative (skipped) slots and the null
    slot 0 (padding) may repeat."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    k_cache = torch.randn(3, 4, 2, 16, device=DEVICE)
    k = torch.randn(len(slots), 2, 16, device=DEVICE)
    slot_t = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    a, b = pair
    with pytest.raises(ValueError, match=rf"slots\[{a}\] and slots\[{b}\] both write slot "
                       rf"{slots[a]}; two tokens"):
        ops.write_kv(k_cache, k_cache.clone(), slot_t, k, k.clone(), backend="triton")


@requires_triton
def test_write_checked_mode_lets_skipped_and_null_slots_repeat(monkeypatch):
    """Negative slots are skipped; the null slot 0 takes the padding tokens' writes (what it
    holds after is not checked: no request reads it)."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    k_cache = torch.randn(3, 4, 2, 16, device=DEVICE)
    v_cache = torch.randn(3, 4, 2, 16, device=DEVICE)
    k, v = torch.randn(6, 2, 16, device=DEVICE), torch.randn(6, 2, 16, device=DEVICE)
    slots = torch.tensor([-1, 6, -1, 1, 0, 0], dtype=torch.int64, device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(12, 2, 16)[[6, 1]] = k[[1, 3]]
    want_v.view(12, 2, 16)[[6, 1]] = v[[1, 3]]
    k_cache.view(12, 2, 16)[0] = want_k.view(12, 2, 16)[0] = 0
    v_cache.view(12, 2, 16)[0] = want_v.view(12, 2, 16)[0] = 0
    ops.write_kv(k_cache, v_cache, slots, k, v, backend="triton")
    k_cache.view(12, 2, 16)[0] = 0
    v_cache.view(12, 2, 16)[0] = 0
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)


# ---------------------------------------------------------------------- the checked mode


def test_checked_mode_is_off_by_default(monkeypatch):
    """Off: the selected kernel is the bare function (no value reads on the hot path)."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    c = paged_case()
    req = ops.paged_attention_request(c.q, c.k_cache, c.v_cache)
    sel = kernel_registry().select(req, backend="reference")
    assert not hasattr(sel.fn, "unchecked")
    monkeypatch.setenv(DEBUG_ENV, "1")
    checked = kernel_registry().select(req, backend="reference")
    assert checked.fn.unchecked is sel.fn and checked.checked() is checked


@requires_triton
@pytest.mark.parametrize("debug_checks", [True, False])
def test_backend_config_debug_checks_engine_path(monkeypatch, debug_checks):
    """``BackendConfig(debug_checks=True)``: a Triton forward whose planned page table was
    corrupted (a page id past the pool) raises before the kernel runs. Without it, the
    backend's kernels are the bare functions."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    cfg = BackendConfig(page_size=4, max_batch_size=4, max_context_len=64, dtype=torch.float32,
                        kernel_backend="triton", debug_checks=debug_checks)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    sc = PagedScenario.make(cfg, [layer], [5, 2], seed=1)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.EXTEND, [3, 2])
    md = be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layer)
    _, executor = be.strategies_for(ForwardMode.EXTEND)
    if not debug_checks:
        be.forward(q, k, v, layer, batch)
        kernels = [g.kernel for g in executor.groups.values()]
        assert kernels and not any(isinstance(k_, CheckedKernel) for k_ in kernels)
        return
    md.pages.block_table[1, 0] = 2 ** 30
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]=1073741824 is not a page"):
        be.forward(q, k, v, layer, batch)
    assert all(isinstance(g.kernel, CheckedKernel) for g in executor.groups.values())


# ---------------------------------------------------------------------- non-finite scalars

NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
def test_non_finite_scalars_are_refused_at_the_op(name, value):
    c = paged_case()
    kw = attn_kwargs(c, **{name: value})
    with pytest.raises(ValueError, match=f"{name}=.*must be a finite number"):
        ops.paged_attention(c.q, c.k_cache, c.v_cache, backend="reference", **kw)
    k5, v5 = kv_5d_from_nhd(c.k_cache, c.v_cache, vec_width(c.k_cache.dtype))
    with pytest.raises(ValueError, match=f"{name}=.*must be a finite number"):
        paged_attention_5d(c.q, k5, v5, backend="reference", **kw)


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_mla_softmax_scale_is_refused(value):
    c = mla_case()
    with pytest.raises(ValueError, match="softmax_scale=.*must be a finite number"):
        ops.mla_paged_attention(c.q, c.kv_cache, backend="reference",
                                **attn_kwargs(c, kv_lora_rank=c.kv_lora_rank,
                                              softmax_scale=value))


@pytest.mark.parametrize("field", ["scaling", "logit_cap"])
def test_layer_spec_refuses_non_finite_scalars(field):
    with pytest.raises(ValueError, match=f"{field}=nan; must be a finite number"):
        LayerSpec(layer_id=0, num_q_heads=2, num_kv_heads=1, head_dim=8, **{field: math.nan})


@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
def test_generate_check_turns_on_the_checked_mode(monkeypatch, capsys, check):
    """``aiter-attn generate --check`` builds its backend with ``debug_checks=True``."""
    import aiter_attn.engine.runner as runner
    from aiter_attn.cli import main

    seen = []

    class Spy(AttentionBackend):
        def __init__(self, config, *a, **kw):
            seen.append(config.debug_checks)
            super().__init__(config, *a, **kw)

    monkeypatch.setattr(runner, "AttentionBackend", Spy)
    argv = ["generate", "--no-progress", "--random-config", "llama", "--max-new-tokens", "3",
            "--prompt", "x"] + (["--check"] if check else [])
    assert main(argv) == 0
    capsys.readouterr()
    assert seen and all(flag is check for flag in seen)
