"""The test harness itself (``aiter_attn.testing``): mutants it must reject and correct kernels
it must accept. Each test names the hole it closes: a draft-step oracle that dropped the
layer's soft-cap / sinks / cache rounding, a meta batch that kept the draft step's page
tables real, a host-read guard blind to printing, a relative error that hid a wrong row, and
arguments the oracle and scenario took without using them as given."""

import math

import pytest
import torch

from aiter_attn import BackendConfig, ForwardBatch, ForwardMode, LayerSpec, SpecDecodeConfig
from aiter_attn.multistep import MultiStepDraftBackend
from aiter_attn.strategies.mha import DecodeMetadata
from aiter_attn.strategies.spec import DraftDecodeStepMetadata
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.nosync import meta_context, to_meta_batch
from aiter_attn.testing.oracle import dense_attention
from aiter_attn.testing.spec_cases import (DraftLayout, HostReadError, draft_branch_expected,
                                           draft_step_inputs, forbid_device_reads,
                                           reserve_draft_slots)

E4M3 = torch.float8_e4m3fn
FP32_RTOL = 1e-5  # the suite's float32 bound
FP16_RTOL = 2e-3  # the suite's float16 bound
BF16_RTOL = 1.2e-2  # the suite's bfloat16 bound


# -- multi-step draft: spec_cases.draft_branch_expected ---------------------------------------
def _draft_case(layer, kv_dtype=None, ps=4, topk=2, steps=3, prefixes=(9, 6)):
    """A block-permuted scenario with draft slots reserved, its multi-step backend and step
    batches (reference kernels)."""
    cfg = BackendConfig(page_size=ps, max_batch_size=8, max_context_len=128, dtype=torch.float32,
                        kv_cache_dtype=kv_dtype,
                        spec=SpecDecodeConfig(topk=topk, num_steps=steps, num_draft_tokens=4))
    sc = PagedScenario.make(cfg, [layer], list(prefixes), seed=2, num_pages=64)
    reserve_draft_slots(sc.allocator, sc.req_pool, sc.rows, list(prefixes),
                        DraftLayout(ps, topk, steps), sc.kv_pool)
    ms = MultiStepDraftBackend(cfg, sc.req_pool, sc.kv_pool)
    draft = ForwardBatch.from_lengths(forward_mode=ForwardMode.DECODE, req_pool_indices=sc.rows,
                                      seq_lens=list(prefixes),
                                      out_cache_loc=torch.zeros(len(prefixes), dtype=torch.int64))
    rows = [(b, k) for b in range(len(prefixes)) for k in range(topk)]
    return sc, ms, ms.init_forward_metadata(draft), rows


def _capped_sink_layer():
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3))
    return LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16, logit_cap=2.0,
                     sinks=sinks, sliding_window=5)


@pytest.mark.parametrize("layer,kv_dtype", [
    pytest.param(_capped_sink_layer(), None, id="softcap-sinks-window"),
    pytest.param(LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16, k_scale=0.5,
                           v_scale=2.0), E4M3, id="fp8-e4m3-scaled"),
])
def test_draft_oracle_accepts_the_reference_draft_kernel(layer, kv_dtype):
    """The draft-step oracle applied only the window: on a layer with soft-cap and sinks the
    reference kernel (which applies them) failed it at relative error 0.22, and it compared an
    fp8 cache against unrounded draft K/V. Every step must now match at the float32 bound."""
    sc, ms, step_batches, rows = _draft_case(layer, kv_dtype)
    g, branch_kv = torch.Generator().manual_seed(1), {}
    for i, _ in enumerate(step_batches):
        q, k, v = draft_step_inputs(layer, len(rows), torch.float32, g)
        out = ms.forward(i, q, k, v, layer)
        want = draft_branch_expected(sc, layer, q, k, v, rows, branch_kv)
        assert_close_rel(out, want, FP32_RTOL, f"draft step {i}")


def test_draft_oracle_rejects_a_kernel_that_drops_softcap_and_sinks():
    """Mutant: a draft-step kernel that ignores the layer's soft-cap and sinks (computed here
    by the oracle without them) passed the old draft oracle exactly; it must fail."""
    layer = _capped_sink_layer()
    sc, ms, step_batches, rows = _draft_case(layer)
    q, k, v = draft_step_inputs(layer, len(rows), torch.float32, torch.Generator().manual_seed(1))
    mutant = []
    for r, (b, _) in enumerate(rows):
        kk = torch.cat([sc.dense_k[(0, b)], k[r].view(1, 2, 16)])
        vv = torch.cat([sc.dense_v[(0, b)], v[r].view(1, 2, 16)])
        mutant.append(dense_attention(q[r].view(1, 4, 16), kk, vv, scale=layer.scaling,
                                      window=layer.window_size()).view(1, -1))
    want = draft_branch_expected(sc, layer, q, k, v, rows, {})
    with pytest.raises(AssertionError, match="relative error"):
        assert_close_rel(torch.cat(mutant), want, FP32_RTOL, "mutant without soft-cap/sinks")


# -- nosync.to_meta_batch / spec_cases.forbid_device_reads ------------------------------------
class _ReadsQoIndptr(DraftDecodeStepMetadata):
    """Mutant planner: reads the caller-planned ``qo_indptr`` back to the host (a sync)."""

    def plan(self, batch, out=None):
        total = int(batch.spec_info.qo_indptr[-1])  # device → host
        assert total == batch.batch_size
        return super().plan(batch, out)


def test_meta_batch_moves_the_draft_step_tables():
    """to_meta_batch left ``spec_info.qo_indptr`` / ``block_table`` (the multi-step draft
    step's caller-planned tables) real, so a draft-step planner reading them back passed the
    no-sync check; on meta the mutant must fail while the real planner still plans."""
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    sc, ms, step_batches, _ = _draft_case(layer)
    meta = to_meta_batch(step_batches[0])
    assert meta.spec_info.qo_indptr.device.type == "meta"
    assert meta.spec_info.block_table.device.type == "meta"
    ctx = meta_context(ms.ctx)
    with forbid_device_reads():
        md = DraftDecodeStepMetadata(ctx).plan(meta)
        assert md.pages.block_table.device.type == "meta"
        with pytest.raises((HostReadError, RuntimeError, NotImplementedError)):
            _ReadsQoIndptr(ctx).plan(meta)


class _LogsSeqLens(DecodeMetadata):
    """Mutant planner: formats a device tensor into a message (on a GPU: a copy to the host),
    as an eager f-string in a log call or error would."""

    def plan(self, batch, out=None):
        self.note = f"planning seq_lens={batch.seq_lens}"
        return super().plan(batch, out)


def test_host_read_guard_catches_printing():
    """A meta tensor prints without reading data, so a planner that formats a device tensor
    passed meta + forbid_device_reads; the guard must refuse it (and still print CPU mirrors)."""
    sc = PagedScenario.make(BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32),
                            [LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)],
                            [5, 9], seed=1)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1])
    from aiter_attn.plugins import kernel_registry
    from aiter_attn.strategies.base import StrategyContext

    ctx = meta_context(StrategyContext(config=sc.config, req_to_token=sc.req_pool.req_to_token,
                                       kv_pool=None, kernels=kernel_registry()))
    meta = to_meta_batch(batch)
    with forbid_device_reads():
        DecodeMetadata(ctx).plan(meta)  # the real planner formats nothing
        assert "10" in f"{batch.seq_lens_cpu}"  # CPU mirrors stay printable
        with pytest.raises(HostReadError, match="__format__|__repr__"):
            _LogsSeqLens(ctx).plan(meta)
        with pytest.raises(HostReadError, match="__repr__"):
            repr(meta.seq_lens)
    assert "meta" in repr(meta.seq_lens)  # restored after the block


# -- compare.assert_close_rel -----------------------------------------------------------------
def _two_magnitude_case():
    """Two requests whose values differ by 10⁴ (like per-token fp8 scales spanning 10⁴): the
    oracle of both, and of request 1 over a wrong (shuffled) K/V — a wrong page read."""
    g = torch.Generator().manual_seed(0)
    outs, wrong = [], None
    for mag in (1.0, 1e-4):
        q = torch.randn(16, 4, 32, generator=g)
        k = torch.randn(40, 2, 32, generator=g)
        v = torch.randn(40, 2, 32, generator=g) * mag
        outs.append(dense_attention(q, k, v, scale=32 ** -0.5))
        perm = torch.randperm(40, generator=g)
        wrong = dense_attention(q, k[perm], v[perm], scale=32 ** -0.5)
    return torch.cat(outs), torch.cat([outs[0], wrong])


def test_rel_error_rejects_a_wrong_small_request():
    """Mutant: request 1 (values 10⁴ smaller) read from wrong pages. Its error is 10⁻⁴ of the
    whole norm, under the float16 bound, so the global relative error passed it."""
    expected, mutant = _two_magnitude_case()
    assert float((mutant - expected).norm() / expected.norm()) < FP16_RTOL  # hidden globally
    with pytest.raises(AssertionError, match="rows"):
        assert_close_rel(mutant, expected, FP16_RTOL, "wrong small request")
    assert_close_rel(expected.half(), expected, FP16_RTOL, "float16 rounding of the right one")


def test_rel_error_rejects_one_wrong_row_among_many():
    """Mutant: one (token, head) row of a 512-token, 32-head bf16 output attends through the
    wrong KV head (a GQA mapping slip in one tile): 1 of 16384 rows, under the bf16 bound
    globally."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(512, 32, 16, generator=g)
    k = torch.randn(512, 4, 16, generator=g)
    v = torch.randn(512, 4, 16, generator=g)
    expected = dense_attention(q, k, v, scale=0.25)
    other_head = dense_attention(q[-1:], k.roll(1, 1), v.roll(1, 1), scale=0.25)
    mutant = expected.clone()
    mutant[-1, 5] = other_head[0, 5]
    assert float((mutant - expected).norm() / expected.norm()) < BF16_RTOL  # hidden globally
    with pytest.raises(AssertionError, match=r"rows off: \[16357\]"):
        assert_close_rel(mutant.to(torch.bfloat16), expected, BF16_RTOL, "one wrong row")
    assert_close_rel(expected.to(torch.bfloat16), expected, BF16_RTOL, "bf16 rounding only")


def test_rel_error_keeps_zero_rows_zero():
    """A fully masked query's reference row is zero: a kernel leaking values there must fail
    even when the leak is small against the other rows."""
    g = torch.Generator().manual_seed(2)
    expected = torch.randn(600, 64, generator=g, dtype=torch.float64)
    expected[7] = 0
    mutant = expected.clone()
    mutant[7] = 0.5  # a leak of norm 4 against rows of norm 8: 0.02 of the whole
    assert float((mutant - expected).norm() / expected.norm()) < BF16_RTOL * 2
    with pytest.raises(AssertionError, match=r"rows off: \[7\]"):
        assert_close_rel(mutant, expected, BF16_RTOL * 2, "leak into a masked row")


@pytest.mark.parametrize("rtol", [float("nan"), float("inf"), -1e-3])
def test_rel_error_refuses_a_bound_that_accepts_everything(rtol):
    """``rel > nan`` is False: a NaN bound (e.g. looked up from a table with a missing dtype
    default) accepted any result."""
    with pytest.raises(ValueError, match="rtol"):
        assert_close_rel(torch.ones(3), torch.zeros(3) + 2, rtol, "bound")


def test_rel_error_still_rejects_nan_and_shape_mismatch():
    """NaN in the candidate fails; a candidate of another element count fails."""
    e = torch.randn(4, 8, dtype=torch.float64)
    a = e.clone()
    a[2, 3] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_rel(a, e, 1.0, "nan")
    with pytest.raises(RuntimeError):
        assert_close_rel(e[:3], e, 1.0, "short")


# -- oracle / scenario arguments --------------------------------------------------------------
def test_oracle_refuses_a_broadcasting_mask():
    """A ``[L]`` or ``[1, L]`` mask broadcast over every query row, silently giving all rows
    the first row's mask; the oracle takes ``[n, L]`` only."""
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(3, 2, 8, generator=g), torch.randn(6, 1, 8, generator=g), \
        torch.randn(6, 1, 8, generator=g)
    row = torch.tensor([True, False, True, True, True, True])
    for mask in (row, row.view(1, 6)):
        with pytest.raises(ValueError, match=r"mask has shape .*expected \(3, 6\)"):
            dense_attention(q, k, v, scale=0.3, causal=False, mask=mask)
    full = row.expand(3, 6).clone()
    out = dense_attention(q, k, v, scale=0.3, causal=False, mask=full)
    want = dense_attention(q, k[row], v[row], scale=0.3, causal=False)
    assert torch.allclose(out, want, rtol=1e-12, atol=0)


def test_scenario_refuses_arguments_it_would_ignore():
    """``PagedScenario.make(kv_scale=...)`` was accepted and never used (the cache kept the
    layer's scales: a scaled-cache test tested nothing); ``expected(masks=...)`` with more
    masks than requests dropped the extra ones."""
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32)
    layer = LayerSpec(layer_id=0, num_q_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="kv_scale=0.5"):
        PagedScenario.make(cfg, [layer], [3], kv_scale=0.5)
    sc = PagedScenario.make(cfg, [layer], [3, 5], seed=1)
    sc.next_batch(ForwardMode.EXTEND, [2, 2])
    q, _, _ = sc.step_inputs(layer)
    masks = [torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 7, dtype=torch.bool)]
    sc.expected(layer, q, masks=masks, causal=False)
    with pytest.raises(ValueError, match="masks has 3 entries for 2 requests"):
        sc.expected(layer, q, masks=masks + masks[:1], causal=False)
    assert math.isfinite(float(sc.expected(layer, q).abs().sum()))
