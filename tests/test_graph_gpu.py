"""CUDA graphs on a GPU: real capture and replay.

* The engine's Llama-shaped decoder (``LlamaFamilyModel`` with random bf16 weights: 8 layers,
  hidden 1024, GQA 8:2, head dim 128, page 16)
  captured for the default size ladder up to 256 and replayed for every batch size 1…256:
  logits match eager decoding on the same batch.
* Under ``torch.cuda.set_sync_debug_mode("error")`` replays of decode, verify (chain and tree),
  draft-extend v2 and multi-step draft decode, on MHA, MLA and SWA, raise nothing and match
  eager.
* A measurement (written as JSON to ``$AITER_ATTN_GRAPH_BENCH`` when set): host time per
  replayed step and the share of GPU time spent padding inputs and planning metadata.
"""

import json
import os
import statistics
import time

import pytest
import torch

from aiter_attn import ForwardBatch, SpecDecodeConfig
from aiter_attn.testing.compare import assert_close_rel

from ._graph_helpers import Rig

pytestmark = pytest.mark.gpu

#: Graph and eager run the same kernels; they differ only where a host bound differs (the
#: graph plans with the static ``max_seqlen_k``, so split-KV counts differ) and where cuBLAS
#: picks another algorithm for the padded M. Both change fp32 accumulation order, i.e. about
#: one bf16 ulp (2^-8) per rounded element.
RTOL_BF16 = 8e-3
#: Logits after 8 bf16 layers: those ulp-level differences compound through the residual
#: stream (each layer re-rounds), so the bound is a few ulps.
RTOL_LOGITS = 2e-2


def _replay_sync_free(mgr, batch, inputs) -> list:
    """``mgr.replay`` under ``set_sync_debug_mode("error")`` (any device→host sync raises);
    returns copies of the outputs (the graph's static outputs are overwritten by the next
    replay)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mgr.replay(batch, **inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [o.clone() for o in out]


# -- the engine's decoder ---------------------------------------------------------------------

LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=4096,
             max_position_embeddings=2048)


def _llama_model(seed: int):
    """The engine's :class:`LlamaFamilyModel` with seeded random weights made on the GPU
    (no transformers checkpoint: the dimensions are what matter here)."""
    import torch.nn.functional as F

    from aiter_attn import LayerSpec
    from aiter_attn.engine.model import LlamaFamilyModel, _DecoderLayer
    from aiter_attn.engine.rope import RotaryEmbedding

    g = torch.Generator(device="cuda").manual_seed(seed)
    h, hq, hkv, d = (LLAMA[k] for k in ("hidden_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim"))
    ff, vocab = LLAMA["intermediate_size"], LLAMA["vocab_size"]

    def w(rows, cols):
        return (torch.randn(rows, cols, generator=g, device="cuda") / cols ** 0.5).bfloat16()

    ones = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    layers = [_DecoderLayer(
        spec=LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
        input_norm=ones, post_attn_norm=ones, wq=w(hq * d, h), wk=w(hkv * d, h),
        wv=w(hkv * d, h), wo=w(h, hq * d), bq=None, bk=None, bv=None, bo=None,
        w_gate=w(ff, h), w_up=w(ff, h), w_down=w(h, ff), b_gate=None, b_up=None, b_down=None)
        for i in range(LLAMA["num_hidden_layers"])]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rope = RotaryEmbedding(inv_freq, 1.0, LLAMA["max_position_embeddings"], torch.bfloat16,
                           "cuda")
    embed = torch.randn(vocab, h, generator=g, device="cuda").bfloat16()
    return LlamaFamilyModel(embed=embed, layers=layers, final_norm=ones, lm_head=w(vocab, h),
                            rope=rope, eps=1e-6, act=F.silu, dtype=torch.bfloat16,
                            device="cuda")


class _LlamaRig:
    """The engine's LlamaFamilyModel over a block-permuted paged pool of 256 live requests."""

    def __init__(self, *, max_bs=256, ctx=1024, page=16, seed=0):
        from aiter_attn import AttentionBackend, BackendConfig
        from aiter_attn.kvcache import MHAKVPool, PageAllocator, ReqToTokenPool

        self.model = _llama_model(seed)
        g = torch.Generator().manual_seed(seed)
        self.gen = g
        lay = self.model.kv_layout
        num_pages = max_bs * (ctx // page) + 2
        self.req_pool = ReqToTokenPool(max_bs + 2, ctx, "cuda")
        self.alloc = PageAllocator(num_pages, page, shuffle_seed=seed + 1)
        self.pool = MHAKVPool(num_pages, page, lay.num_kv_heads, lay.head_dim, lay.num_layers,
                              dtype=torch.bfloat16, device="cuda")
        for b in self.pool.k_buffers + self.pool.v_buffers:
            b.normal_()
        self.config = BackendConfig(page_size=page, max_batch_size=max_bs, max_context_len=ctx,
                                    dtype=torch.bfloat16, device="cuda")
        self.backend = AttentionBackend(self.config, self.req_pool, self.pool)
        self.rows = [self.req_pool.alloc() for _ in range(max_bs)]
        for r in self.rows:
            self.alloc.extend(self.req_pool, r, int(torch.randint(1, 600, (1,), generator=g)))

    def batch(self, bs):
        rows = self.rows[:bs]
        locs = [self.alloc.extend(self.req_pool, r, 1) for r in rows]
        seq = [self.alloc.tokens_held(r) for r in rows]
        batch = ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=rows,
                                          seq_lens=seq, out_cache_loc=torch.cat(locs),
                                          device="cuda")
        ids = torch.randint(0, LLAMA["vocab_size"], (bs,), generator=self.gen).to("cuda")
        return batch, ids

    def step(self, batch, inputs):
        return self.model.forward(inputs["input_ids"], batch.positions, batch, self.backend)

    def eager(self, batch, ids):
        self.backend.init_forward_metadata(batch)
        return self.model.forward(ids, batch.positions, batch, self.backend)

    def manager(self):
        from aiter_attn.graph import CudaGraphManager

        return CudaGraphManager(self.backend, max_bs=256,
                                token_inputs={"input_ids": ((), torch.int64)})


@pytest.fixture(scope="module")
def llama():
    rig = _LlamaRig()
    mgr = rig.manager()
    t0 = time.perf_counter()
    mgr.capture(rig.step)
    torch.cuda.synchronize()
    rig.capture_s = time.perf_counter() - t0
    return rig, mgr


def test_engine_decode_every_batch_size_matches_eager(llama):
    rig, mgr = llama
    assert mgr.use_cuda_graph and mgr.capture_sizes[-1] == 256
    worst = 0.0
    for bs in range(1, 257):
        batch, ids = rig.batch(bs)
        graph = mgr.replay(batch, input_ids=ids).clone()
        eager = rig.eager(batch, ids)
        assert graph.shape == eager.shape == (bs, LLAMA["vocab_size"])
        assert torch.isfinite(graph).all(), f"bs={bs}: non-finite logits"
        rel = float((graph - eager).norm() / eager.norm())
        worst = max(worst, rel)
        assert_close_rel(graph, eager, RTOL_LOGITS, f"bs={bs} (padded {mgr.last_entry.bs})")
    print(f"\n[graphs] worst logits rel err over bs 1..256: {worst:.2e}; "
          f"capture of {len(mgr.captured())} sizes took {rig.capture_s:.1f}s")


# -- every capturable mode × architecture, sync-free ------------------------------------------

MATRIX = [
    pytest.param(arch, mode, topk, id=f"{arch}-{mode}-topk{topk}")
    for arch in ("mha", "mla", "swa")
    for mode, topk in (("decode", 1), ("target_verify", 1), ("target_verify", 2),
                       ("draft_extend_v2", 1))
]


@pytest.mark.parametrize("arch,mode,topk", MATRIX)
def test_replays_make_no_host_sync_and_match_eager(arch, mode, topk):
    from aiter_attn.plugins import strategy_registry

    pair, reasons = strategy_registry().candidates(mode, arch)
    assert pair is not None, f"no strategy serves {mode} × {arch.upper()}: {reasons}"
    spec = SpecDecodeConfig(num_steps=3, topk=topk, num_draft_tokens=4)
    rig = Rig.make(arch, page_size=16, hq=16 if arch == "mla" else 8, hkv=2,
                   head_dim=128 if arch != "mla" else 512, num_layers=2, max_context_len=512,
                   max_bs=32, spec=None if mode == "decode" else spec, dtype=torch.bfloat16,
                   device="cuda", seed=7, rope=64)
    mgr = rig.manager(capture_sizes=[1, 4, 8, 16, 32], modes=[mode])
    mgr.capture(rig.step_fn())
    for bs in (3, 16, 9, 32, 1):
        while len(rig.rows) < bs:
            rig.join(int(torch.randint(1, 400, (1,), generator=rig.gen)))
        while len(rig.rows) > bs:
            rig.leave(rig.rows[-1])
        batch = rig.batch(mode)
        inputs = rig.random_inputs(batch)
        out = _replay_sync_free(mgr, batch, inputs)
        eager = rig.eager(batch, inputs, save_kv_cache=False)
        for i, (g, e) in enumerate(zip(out, eager)):
            assert_close_rel(g, e, RTOL_BF16, f"{arch} {mode} bs={bs} layer {i}")


def _inside_static_buffers(md, buffers: dict, device) -> list:
    """Paths of ``md``'s kernel-plan device tensors that lie outside every static buffer."""
    from aiter_attn.graph import describe_signature

    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for t in buffers.values()]
    bad = []
    for path, v in describe_signature(md, device).items():
        if "kernel_plans" in path and isinstance(v, tuple) and v[0] == "tensor":
            if not any(lo <= v[1] < hi for lo, hi in spans):
                bad.append(path)
    return bad


@pytest.mark.parametrize("arch,page,topk", [
    pytest.param("mha", 16, 2, id="mha-page16-topk2"),
    pytest.param("mla", 16, 2, id="mla-page16-topk2"),
    pytest.param("swa", 16, 2, id="swa-page16-topk2"),
    pytest.param("mha", 1, 1, id="mha-page1-chain"),
    pytest.param("swa", 1, 3, id="swa-page1-topk3"),
])
def test_multi_step_draft_decode_replays_sync_free(arch, page, topk):
    """Captured multi-step draft decode (every step through one strategy pair) replays
    without a host sync, matches eager, and every step's kernel plans (Triton split
    workspaces included) read only the manager's static buffers."""
    from aiter_attn import multistep

    spec = SpecDecodeConfig(num_steps=4, topk=topk, num_draft_tokens=9)
    rig = Rig.make(arch, page_size=page, hq=16 if arch == "mla" else 8, hkv=2,
                   head_dim=512 if arch == "mla" else 128, num_layers=2, max_context_len=512,
                   max_bs=16, spec=spec, dtype=torch.bfloat16, device="cuda", seed=9, rope=64)
    ms = multistep.MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool)
    from aiter_attn.graph import CudaGraphManager

    mgr = CudaGraphManager(ms, capture_sizes=[1, 4, 16], token_inputs=rig.token_inputs())
    fn = rig.multistep_step_fn(ms)
    mgr.capture(fn)
    for bs in (3, 16, 1):
        rows, batch = rig.join_drafting(bs, 300)
        inputs = rig.random_inputs(batch, num_tokens=bs * topk)  # one row per branch
        out = _replay_sync_free(mgr, batch, inputs)
        for i, md in enumerate(ms.step_metadata):
            assert not _inside_static_buffers(md, mgr.strategy_buffers("decode"), "cuda"), \
                f"step {i}"
        ms.init_forward_metadata(batch)
        for i, (g, e) in enumerate(zip(out, fn(batch, inputs))):
            assert_close_rel(g, e, RTOL_BF16, f"multi-step {arch} bs={bs} layer {i}")
        for r in rows:
            rig.leave(r)


# -- measurement --------------------------------------------------------------------------

def _kernel_us(prof) -> float:
    """Total device time (µs) of every kernel/memcpy/memset the profiler saw."""
    total = 0.0
    for evt in prof.key_averages():
        total += getattr(evt, "self_device_time_total", None) or getattr(
            evt, "self_cuda_time_total", 0.0)
    return total


def test_replay_host_time_and_metadata_share(llama):
    """Host time per replayed decode step, and the share of its GPU time spent padding the
    inputs and planning metadata (``load``) vs the whole step (``load`` + graph replay)."""
    from torch.profiler import ProfilerActivity, profile

    rig, mgr = llama
    rows = []
    for bs in (1, 16, 64, 256):
        batch, ids = rig.batch(bs)
        for _ in range(5):  # warm
            mgr.replay(batch, input_ids=ids)
        torch.cuda.synchronize()
        host = []
        for _ in range(50):
            t0 = time.perf_counter()
            mgr.replay(batch, input_ids=ids)
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(50):
            mgr.replay(batch, input_ids=ids)
        e1.record()
        torch.cuda.synchronize()
        step_ms = e0.elapsed_time(e1) / 50
        with profile(activities=[ProfilerActivity.CUDA]) as p_load:
            for _ in range(20):
                mgr.load(batch, input_ids=ids)
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p_step:
            for _ in range(20):
                mgr.replay(batch, input_ids=ids)
            torch.cuda.synchronize()
        load_us, step_us = _kernel_us(p_load) / 20, _kernel_us(p_step) / 20
        t0 = time.perf_counter()
        for _ in range(20):
            rig.eager(batch, ids)
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t0) / 20 * 1e3
        rows.append(dict(bs=bs, host_us_median=statistics.median(host) * 1e6,
                         host_us_p90=sorted(host)[int(0.9 * len(host))] * 1e6,
                         step_ms_events=step_ms, load_gpu_us=load_us, step_gpu_us=step_us,
                         metadata_share=load_us / step_us if step_us else float("nan"),
                         eager_step_ms=eager_ms))
    lines = ["bs | host µs/replay (median, p90) | step ms (events) | metadata GPU µs | "
             "step GPU µs | metadata share | eager step ms"]
    for r in rows:
        lines.append(f"{r['bs']} | {r['host_us_median']:.0f}, {r['host_us_p90']:.0f} | "
                     f"{r['step_ms_events']:.3f} | {r['load_gpu_us']:.1f} | "
                     f"{r['step_gpu_us']:.1f} | {100 * r['metadata_share']:.2f}% | "
                     f"{r['eager_step_ms']:.2f}")
    print("\n[graphs] " + "\n[graphs] ".join(lines))
    out = os.environ.get("AITER_ATTN_GRAPH_BENCH")
    if out:
        with open(out, "w") as f:
            json.dump(dict(model=LLAMA, page_size=16, dtype="bfloat16",
                           device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    for r in rows:
        assert r["step_gpu_us"] > r["load_gpu_us"] > 0


@pytest.mark.parametrize("arch", ["mha", "mla"])
def test_capturing_a_cell_whose_kernel_cannot_be_captured_names_it(arch):
    """Issue 13.2 on the real capture path: with the reference kernel forced (cg_support
    NEVER), ``capture`` warms up (binding the layers), then refuses to record, naming the
    kernel and the setting to change; nothing is captured."""
    import attrs

    from aiter_attn import AttentionBackend

    rig = Rig.make(arch, page_size=16, hq=16 if arch == "mla" else 8, hkv=2,
                   head_dim=128 if arch != "mla" else 512, num_layers=2, max_context_len=256,
                   max_bs=4, dtype=torch.bfloat16, device="cuda", seed=3, rope=64)
    rig.backend = AttentionBackend(attrs.evolve(rig.config, kernel_backend="reference"),
                                   rig.req_pool, rig.kv_pool)
    rig.join(40)
    mgr = rig.manager(capture_sizes=[1, 2], modes=["decode"])
    with pytest.raises(ValueError, match=r"kernel 'reference'.*cg_support=NEVER.*kernel_backend"):
        mgr.capture(rig.step_fn())
