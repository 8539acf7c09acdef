"""MLA (DeepSeek latent attention) through AttentionBackend, every mode, against a float64 dense
reference computed from the UN-absorbed math: the latent is expanded through random W_UK/W_UV
into per-head K (nope + rope) and V, ordinary attention runs over them, and the absorbed path's
latent output is compared after applying W_UV. Pools are block-permuted with a noisy null page."""

from __future__ import annotations

import pytest
import torch

from aiter_attn import (AttentionBackend, BackendConfig, ForwardBatch, ForwardMode, MLAKVPool,
                        PageAllocator, ReqToTokenPool, SpecDecodeConfig, SpecInfo)
from aiter_attn.kernels.reference import quantize_to_cache
from aiter_attn.types import kv_dequant_scales
from aiter_attn.strategies.mla import (MLA_HEAD_PADDING_KEY, MLA_PROJECTIONS_KEY, HeadPadding,
                                       absorb_q, apply_w_uv, kv_b_proj_from_weights,
                                       mla_layer_specs)
from aiter_attn.testing import dense_attention
from aiter_attn.testing.compare import assert_close_rel

RTOL = {torch.float32: 1e-5, torch.float16: 3e-3}
FP8 = getattr(torch, "float8_e4m3fn", None)


class MLAScenario:
    """A latent pool holding ``prefix_lens`` cached tokens per request, the dense float32 copy
    of every request's (cache-rounded) latent, and random per-head W_UK / W_UV."""

    def __init__(self, *, page_size, heads, lora=32, rope=16, nope=24, dv=20, prefix_lens,
                 dtype=torch.float32, kv_dtype=None, kv_scale=1.0, seed=0, padding=None,
                 projections=True, kernels=None, max_context_len=512, topk=1):
        g = torch.Generator().manual_seed(seed)
        self.g, self.dtype = g, dtype
        self.heads, self.lora, self.rope, self.nope, self.dv = heads, lora, rope, nope, dv
        self.kv_scale = kv_scale
        kv_dtype = kv_dtype or dtype
        self.config = BackendConfig(page_size=page_size, max_batch_size=8, dtype=dtype,
                                    max_context_len=max_context_len, kv_cache_dtype=kv_dtype,
                                    arch="mla",
                                    spec=SpecDecodeConfig(topk=topk, num_draft_tokens=8))
        need = sum(-(-(p + 40) // page_size) for p in prefix_lens) + 4
        self.req_pool = ReqToTokenPool(len(prefix_lens) + 2, max_context_len)
        self.alloc = PageAllocator(2 * need, page_size, shuffle_seed=seed + 1)
        self.pool = MLAKVPool(2 * need, page_size, lora, rope, 1, dtype=kv_dtype)
        buf = self.pool.kv_buffer(0)
        buf.copy_(torch.randn(buf.shape, generator=g).to(kv_dtype))  # wrong reads show
        self.w_uk = torch.randn(heads, nope, lora, generator=g, dtype=torch.float64) / lora**0.5
        self.w_uv = torch.randn(heads, dv, lora, generator=g, dtype=torch.float64) / lora**0.5
        self.absorbed, self.expanded = mla_layer_specs(
            0, num_heads=heads, kv_lora_rank=lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
            v_head_dim=dv, scaling=(nope + rope) ** -0.5, kv_scale=kv_scale)
        self.rows = [self.req_pool.alloc() for _ in prefix_lens]
        self.latent = []  # per request: float32 [len, lora + rope] as the cache holds it
        for row, plen in zip(self.rows, prefix_lens):
            slots = self.alloc.extend(self.req_pool, row, plen)
            lat = torch.randn(plen, lora + rope, generator=g)
            self.pool.write_latent(0, slots, lat.to(dtype), kv_scale=kv_scale)
            self.latent.append(self._roundtrip(lat.to(dtype).float()))
        extra = {}
        if projections:
            extra[MLA_PROJECTIONS_KEY] = {0: kv_b_proj_from_weights(self.w_uk, self.w_uv)}
        if padding is not None:
            extra[MLA_HEAD_PADDING_KEY] = padding
        self.backend = AttentionBackend(self.config, self.req_pool, self.pool, extra=extra,
                                        kernels=kernels)

    def _roundtrip(self, x):
        cache = self.pool.kv_buffer(0)
        scale, _ = kv_dequant_scales(cache.dtype, self.kv_scale, self.kv_scale)
        return quantize_to_cache(x, cache.dtype, scale).float() * (1.0 if scale is None else scale)

    def next_batch(self, mode, new_lens, spec_info=None) -> ForwardBatch:
        locs, seq = [], []
        for row, n in zip(self.rows, new_lens):
            locs.append(self.alloc.extend(self.req_pool, row, n))
            seq.append(self.alloc.tokens_held(row))
        self.batch = ForwardBatch.from_lengths(
            forward_mode=mode, req_pool_indices=self.rows, seq_lens=seq,
            out_cache_loc=torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64),
            extend_seq_lens=list(new_lens), spec_info=spec_info)
        self.new_lens = list(new_lens)
        # this step's un-absorbed inputs (float64 masters)
        t = sum(new_lens)
        self.new_latent = torch.randn(t, self.lora + self.rope, generator=self.g)
        self.q_nope = torch.randn(t, self.heads, self.nope, generator=self.g, dtype=torch.float64)
        self.q_pe = torch.randn(t, self.heads, self.rope, generator=self.g, dtype=torch.float64)
        return self.batch

    # -- the two ways a layer hands things in ------------------------------------------
    def absorbed_inputs(self):
        q = torch.cat([absorb_q(self.q_nope, self.w_uk), self.q_pe], dim=-1).to(self.dtype)
        return q.reshape(q.shape[0], self.heads * (self.lora + self.rope)), self.new_latent.to(self.dtype).unsqueeze(1)

    def expanded_inputs(self):
        c = self.new_latent.double()
        k_nope = torch.einsum("nl,hdl->nhd", c[:, : self.lora], self.w_uk)
        k_pe = c[:, None, self.lora:].expand(-1, self.heads, -1)
        k = torch.cat([k_nope, k_pe], -1).to(self.dtype)
        v = torch.einsum("nl,hdl->nhd", c[:, : self.lora], self.w_uv).to(self.dtype)
        q = torch.cat([self.q_nope, self.q_pe], -1).to(self.dtype)
        return q, k, v

    def run_absorbed(self, **kw) -> torch.Tensor:
        """Backend output after W_UV, float64 ``[T, H, dv]``."""
        self.backend.init_forward_metadata(self.batch)
        q, k = self.absorbed_inputs()
        out = self.backend.forward(q, k, None, self.absorbed, self.batch, **kw)
        assert out.dtype == self.dtype and out.shape == (q.shape[0], self.heads * self.lora)
        self.new_written = True
        return apply_w_uv(out.view(-1, self.heads, self.lora).double(), self.w_uv)

    def run_expanded(self) -> torch.Tensor:
        self.backend.init_forward_metadata(self.batch)
        self.pool.write_latent(0, self.batch.out_cache_loc, self.new_latent.to(self.dtype),
                               kv_scale=self.kv_scale)
        q, k, v = self.expanded_inputs()
        out = self.backend.forward(q, k, v, self.expanded, self.batch, save_kv_cache=False)
        assert out.dtype == self.dtype and out.shape == (q.shape[0], self.heads * self.dv)
        return out.view(-1, self.heads, self.dv).double()

    # -- reference ----------------------------------------------------------------------
    def expected(self, *, masks=None, exact_new=False) -> torch.Tensor:
        """float64 ``[T, H, dv]``: expand every key through W_UK/W_UV, ordinary attention.

        ``exact_new``: new tokens' K/V unrounded (the expanded form never reads them back)."""
        outs, t = [], 0
        new = self.new_latent if exact_new else self._roundtrip(self.new_latent.to(self.dtype).float())
        for i, n in enumerate(self.new_lens):
            c = torch.cat([self.latent[i], new[t:t + n]]).double()
            k = torch.cat([torch.einsum("nl,hdl->nhd", c[:, : self.lora], self.w_uk),
                           c[:, None, self.lora:].expand(-1, self.heads, -1)], -1)
            v = torch.einsum("nl,hdl->nhd", c[:, : self.lora], self.w_uv)
            q = torch.cat([self.q_nope[t:t + n], self.q_pe[t:t + n]], -1)
            outs.append(dense_attention(q, k, v, scale=self.absorbed.scaling,
                                        causal=masks is None,
                                        mask=None if masks is None else masks[i]))
            t += n
        return torch.cat(outs)

    def commit(self):
        """The step's latents are in the pool now: append them to the dense copies."""
        new = self._roundtrip(self.new_latent.to(self.dtype).float())
        t = 0
        for i, n in enumerate(self.new_lens):
            self.latent[i] = torch.cat([self.latent[i], new[t:t + n]])
            t += n


def _check(sc, got, what, **kw):
    assert_close_rel(got, sc.expected(**kw), RTOL[sc.dtype], what)


GEOMETRY = [
    pytest.param(1, 4, 32, 16, id="page1-H4"),
    pytest.param(64, 8, 32, 16, id="page64-H8"),
    pytest.param(7, 16, 32, 16, id="page7-H16"),
    pytest.param(48, 5, 32, 16, id="page48-H5"),
]


@pytest.mark.parametrize("page_size,heads,lora,rope", GEOMETRY)
def test_absorbed_every_mode(page_size, heads, lora, rope):
    """Absorbed form through EXTEND (prefix 0 / one page / crossing pages) → DECODE → chain
    TARGET_VERIFY → DRAFT_EXTEND_V2 → ragged DRAFT_EXTEND, each step vs the dense reference."""
    prefixes = [0, page_size, page_size + 3, 2 * page_size + 5]
    sc = MLAScenario(page_size=page_size, heads=heads, lora=lora, rope=rope, prefix_lens=prefixes,
                     seed=page_size + heads)
    steps = [
        (ForwardMode.EXTEND, [5, 1, 9, 3], None),
        (ForwardMode.DECODE, [1, 1, 1, 1], None),
        (ForwardMode.DECODE, [1, 1, 1, 1], None),
        (ForwardMode.TARGET_VERIFY, [3] * 4, SpecInfo(num_draft_tokens=3)),
        (ForwardMode.DRAFT_EXTEND_V2, [2] * 4, SpecInfo(num_draft_tokens=2)),
        (ForwardMode.DRAFT_EXTEND, [2, 1, 4, 1], None),
    ]
    for mode, lens, spec in steps:
        sc.next_batch(mode, lens, spec)
        _check(sc, sc.run_absorbed(), f"{mode.name} absorbed")
        sc.commit()


@pytest.mark.parametrize("page_size,heads", [
    pytest.param(1, 4, id="page1-H4"), pytest.param(64, 8, id="page64-H8"),
    pytest.param(7, 16, id="page7-H16"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_expanded_extend_no_prefix_then_prefix(page_size, heads, dtype):
    """Expanded form: first prefill (no prefix: plain causal attention, qk dim 40 ≠ v dim 20),
    then a chunked extend whose prefix is expanded from the latent cache through kv_b_proj."""
    sc = MLAScenario(page_size=page_size, heads=heads, prefix_lens=[0, 0, 0], dtype=dtype,
                     seed=3 + heads)
    sc.next_batch(ForwardMode.EXTEND, [6, page_size + 2, 1])
    _check(sc, sc.run_expanded(), "extend no prefix", exact_new=True)
    sc.commit()
    sc.next_batch(ForwardMode.EXTEND, [3, 1, page_size + 4])
    _check(sc, sc.run_expanded(), "extend with prefix", exact_new=True)
    sc.commit()
    sc.next_batch(ForwardMode.DECODE, [1, 1, 1])  # the expanded extends wrote the latents
    _check(sc, sc.run_absorbed(), "decode after expanded extend")


def test_expanded_and_absorbed_extend_agree():
    """The two forms of one EXTEND step give the same output (after W_UV)."""
    sc = MLAScenario(page_size=16, heads=8, prefix_lens=[5, 17], seed=11)
    sc.next_batch(ForwardMode.DRAFT_EXTEND, [4, 2])
    got_exp = sc.run_expanded()
    got_abs = sc.run_absorbed()
    assert_close_rel(got_abs, got_exp, 1e-5, "absorbed vs expanded")


def _tree_masks(sc, n, generator, literal_noise=False):
    """Per request a bool ``[n, seq_len]``: all prefix keys visible, draft i sees its ancestors
    and itself (random parents). ``literal_noise`` flips random draft entries (still ≥ 1 visible
    per row) so only a literal application of the mask matches."""
    masks, flat = [], []
    for i, length in enumerate(sc.batch.seq_lens_cpu.tolist()):
        prefix = length - n
        m = torch.zeros(n, length, dtype=torch.bool)
        m[:, :prefix] = True
        parent = [-1] + [int(torch.randint(0, j, (1,), generator=generator)) for j in range(1, n)]
        for j in range(n):
            a = j
            while a >= 0:
                m[j, prefix + a] = True
                a = parent[a]
        if literal_noise:
            noise = torch.rand(n, length, generator=generator) < 0.4
            m ^= noise
            m[torch.arange(n), prefix + torch.arange(n)] = True
        masks.append(m)
        flat.append(m.reshape(-1))
    return masks, torch.cat(flat)


@pytest.mark.parametrize("page_size,heads,literal,tree_part", [
    pytest.param(1, 4, False, False, id="page1-H4-tree"),
    pytest.param(64, 8, False, False, id="page64-H8-tree"),
    pytest.param(48, 8, False, True, id="page48-H8-tree-part-layout"),
    pytest.param(7, 16, True, False, id="page7-H16-literal-mask"),
])
def test_tree_verify_applies_mask_literally(page_size, heads, literal, tree_part):
    """TARGET_VERIFY with topk > 1: the custom mask decides visibility token by token; the
    reference applies the same per-token mask (no causal rule) to dense expanded K/V. The mask
    comes in SGLang's full layout or as the ``[batch, q_len, q_len]`` tree part."""
    n = 4
    sc = MLAScenario(page_size=page_size, heads=heads, prefix_lens=[3, page_size + 1, 9],
                     seed=21 + heads, topk=2)
    spec = SpecInfo(num_draft_tokens=n, topk=2)
    sc.next_batch(ForwardMode.TARGET_VERIFY, [n] * 3, spec)
    masks, flat = _tree_masks(sc, n, torch.Generator().manual_seed(page_size), literal)
    spec.custom_mask = torch.stack([m[:, -n:] for m in masks]) if tree_part else flat
    _check(sc, sc.run_absorbed(), "tree verify", masks=masks)


def test_fully_masked_row_is_zero_not_nan():
    """A verify row whose mask hides every key outputs zeros (never NaN)."""
    sc = MLAScenario(page_size=16, heads=4, prefix_lens=[4, 6], seed=5, topk=2)
    spec = SpecInfo(num_draft_tokens=2, topk=2)
    sc.next_batch(ForwardMode.TARGET_VERIFY, [2, 2], spec)
    masks, _ = _tree_masks(sc, 2, torch.Generator().manual_seed(0))
    masks[1][1].zero_()
    spec.custom_mask = torch.cat([m.reshape(-1) for m in masks])
    got = sc.run_absorbed()
    assert torch.isfinite(got).all()
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    _check(sc, got, "fully masked row", masks=masks)


def test_large_latent_512_64():
    """DeepSeek-V3 sizes (kv_lora 512 + rope 64, nope 128, v 128), 16 heads, page 64, few tokens."""
    sc = MLAScenario(page_size=64, heads=16, lora=512, rope=64, nope=128, dv=128,
                     prefix_lens=[3, 70], seed=7)
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    _check(sc, sc.run_absorbed(), "decode 512+64")
    sc.commit()
    sc.next_batch(ForwardMode.EXTEND, [2, 1])
    _check(sc, sc.run_expanded(), "expanded extend 512+64", exact_new=True)


@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("page_size", [pytest.param(1, id="page1"), pytest.param(64, id="page64")])
def test_fp8_latent_cache_with_scale(page_size):
    """fp8 (e4m3fn) latent cache with kv_scale 0.25: written quantised, read dequantised on the
    absorbed (decode, verify) and expanded (prefix) paths; the reference uses the same rounding."""
    sc = MLAScenario(page_size=page_size, heads=8, prefix_lens=[5, page_size + 2],
                     kv_dtype=FP8, kv_scale=0.25, seed=13)
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    _check(sc, sc.run_absorbed(), "fp8 decode")
    sc.commit()
    sc.next_batch(ForwardMode.TARGET_VERIFY, [2, 2], SpecInfo(num_draft_tokens=2))
    _check(sc, sc.run_absorbed(), "fp8 verify")
    sc.commit()
    sc.next_batch(ForwardMode.EXTEND, [3, 2])
    _check(sc, sc.run_expanded(), "fp8 expanded extend", exact_new=True)


def test_draft_decode_step_uses_the_shared_tables():
    """``mla.draft_decode_step`` (multi-step draft decode) runs the absorbed kernel over the
    query layout and page table handed in through ``spec_info`` (as MultiStepDraftBackend
    plans them for all steps), with the same result as a planned decode."""
    from aiter_attn import ops
    from aiter_attn.strategies.mla import MLA_DRAFT_DECODE_STEP

    sc = MLAScenario(page_size=7, heads=8, prefix_lens=[4, 15, 9], seed=31)
    batch = sc.next_batch(ForwardMode.DECODE, [1, 1, 1])
    table = torch.zeros(3, 8, dtype=torch.int32)
    ops.build_page_table(sc.req_pool.req_to_token, batch.req_pool_indices, batch.seq_lens, 7,
                         table)
    batch.spec_info = SpecInfo(num_draft_tokens=1, qo_indptr=torch.arange(4, dtype=torch.int32),
                               block_table=table)
    sc.backend = AttentionBackend(sc.config, sc.req_pool, sc.pool,
                                  strategy=MLA_DRAFT_DECODE_STEP)
    _check(sc, sc.run_absorbed(), "draft decode step")


def test_idle_batch():
    sc = MLAScenario(page_size=16, heads=4, prefix_lens=[], seed=0)
    sc.next_batch(ForwardMode.IDLE, [])
    sc.backend.init_forward_metadata(sc.batch)
    q, k = sc.absorbed_inputs()
    out = sc.backend.forward(q, k, None, sc.absorbed, sc.batch)
    assert out.shape == (0, 4 * 32)


# ----------------------------------------------------------------------------- head padding
def _registry_with_wide_kernel(calls):
    """Reference kernels plus a higher-priority 'wide16' MLA kernel that, like aiter's, serves
    only multiples of 16 heads (declared as data: a capability predicate)."""
    from aiter_attn.kernels import reference
    from aiter_attn.kernels.registry import Capabilities, KernelRegistry
    from aiter_attn.types import CGSupport

    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(register=reg.register)

    def wide16(q, kv_cache, out, **kw):
        calls.append(q.shape[1])
        return reference.mla_paged_attention_reference(q, kv_cache, out, **kw)

    def needs_16(req):
        heads = dict(req.extra).get("heads")
        return None if heads % 16 == 0 else f"heads={heads} is not a multiple of 16"

    reg.register("mla_paged_attention", "wide16", wide16,
                 Capabilities(features={"fp8", "custom_mask"}, predicate=needs_16,
                              cg_support=CGSupport.NEVER), priority=5)
    return reg


@pytest.mark.parametrize("heads", [pytest.param(4, id="H4"), pytest.param(8, id="H8")])
def test_heads_padded_for_a_kernel_that_needs_16(heads):
    """With a ≥16-heads kernel registered, 4/8 heads are padded to 16 (auto policy), the kernel
    sees 16 heads, and the result equals the dense reference."""
    calls = []
    sc = MLAScenario(page_size=64, heads=heads, prefix_lens=[4, 66], seed=heads,
                     kernels=_registry_with_wide_kernel(calls))
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    _check(sc, sc.run_absorbed(), "padded decode")
    sc.commit()
    sc.next_batch(ForwardMode.TARGET_VERIFY, [3, 3], SpecInfo(num_draft_tokens=3))
    _check(sc, sc.run_absorbed(), "padded verify")
    assert calls == [16, 16]


@pytest.mark.parametrize("heads", [pytest.param(4, id="H4"), pytest.param(8, id="H8")])
def test_padding_never_changes_results(heads):
    """The same steps with padding forced on and off give bit-identical outputs."""
    outs = {}
    for policy in ("always", "never"):
        sc = MLAScenario(page_size=1, heads=heads, prefix_lens=[7, 2, 12], seed=99,
                         padding=HeadPadding(policy=policy))
        got = []
        for mode, lens, spec in [(ForwardMode.EXTEND, [3, 1, 2], None),
                                 (ForwardMode.DECODE, [1, 1, 1], None),
                                 (ForwardMode.TARGET_VERIFY, [2] * 3, SpecInfo(num_draft_tokens=2))]:
            sc.next_batch(mode, lens, spec)
            sc.backend.init_forward_metadata(sc.batch)
            q, k = sc.absorbed_inputs()
            got.append(sc.backend.forward(q, k, None, sc.absorbed, sc.batch))
            sc.commit()
        outs[policy] = got
    for a, b in zip(outs["always"], outs["never"]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- errors
def test_errors_are_clear_and_early():
    sc = MLAScenario(page_size=16, heads=4, prefix_lens=[5, 3], seed=1, projections=False)
    # DRAFT_EXTEND_V2 with different lengths per request
    batch = sc.next_batch(ForwardMode.DRAFT_EXTEND, [2, 3])
    batch.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    batch.spec_info = SpecInfo(num_draft_tokens=2)
    planner, _ = sc.backend.strategies_for(ForwardMode.DRAFT_EXTEND_V2)
    with pytest.raises(ValueError, match="fixed 2 tokens per request"):
        planner.plan(batch)
    # tree verify without a mask
    sc2 = MLAScenario(page_size=16, heads=4, prefix_lens=[5, 3], seed=2, topk=2)
    sc2.next_batch(ForwardMode.TARGET_VERIFY, [2, 2], SpecInfo(num_draft_tokens=2, topk=2))
    with pytest.raises(ValueError, match="custom_mask"):
        sc2.backend.init_forward_metadata(sc2.batch)
    # verify without spec_info
    planner, _ = sc2.backend.strategies_for(ForwardMode.TARGET_VERIFY)
    sc2.batch.spec_info = None
    with pytest.raises(ValueError, match="spec_info"):
        planner.plan(sc2.batch)
    # expanded form with a prefix but no projection
    sc.next_batch(ForwardMode.EXTEND, [2, 1])
    with pytest.raises(ValueError, match="mla_projections"):
        sc.run_expanded()
    # expanded form asked to write the pool
    sc.backend.init_forward_metadata(sc.batch)
    q, k, v = sc.expanded_inputs()
    with pytest.raises(ValueError, match="save_kv_cache=False"):
        sc.backend.forward(q, k, v, sc.expanded, sc.batch)
    # expanded form in a decode-like mode
    sc.next_batch(ForwardMode.DECODE, [1, 1])
    sc.backend.init_forward_metadata(sc.batch)
    q, k, v = sc.expanded_inputs()
    with pytest.raises(ValueError, match="absorbed form"):
        sc.backend.forward(q, k, v, sc.expanded, sc.batch, save_kv_cache=False)
    # absorbed call with a layer whose dims do not match the pool
    bad, _ = mla_layer_specs(0, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=32, v_head_dim=8, scaling=0.1)
    q, k = sc.absorbed_inputs()
    with pytest.raises(ValueError, match="mla_layer_specs"):
        sc.backend.forward(q, k, None, bad, sc.batch)


def test_mla_needs_an_mla_pool():
    from aiter_attn import MHAKVPool

    cfg = BackendConfig(page_size=16, max_context_len=64, dtype=torch.float32, arch="mla")
    pool = ReqToTokenPool(3, 64)
    be = AttentionBackend(cfg, pool, MHAKVPool(4, 16, 1, 48, 1, dtype=torch.float32))
    with pytest.raises(TypeError, match="MLAKVPool"):
        be.strategies_for(ForwardMode.DECODE)


def test_head_padding_rejects_non_divisors():
    with pytest.raises(ValueError, match="divide"):
        HeadPadding(pad_to=16, pad_from={4, 6})
