"""The ``host`` section of ``bench_attention.py``: host cost per call and the engine.

Method (``../shared/PERFORMANCE.md``, "Host cost and the engine"): eager calls of a small shape
(bs 1, 100 keys, GQA 32/8, head dim 128, page 16, bf16), warmed up, then ``rounds`` rounds of
``n`` back-to-back calls (``n`` ≥ 2,000 on the GPU) timed with ``time.perf_counter()`` and one
``torch.cuda.synchronize()`` at each end; per-call time = round time / n; the median round is
reported. Rows:

* ``forward``: ``AttentionBackend.forward`` of one decode layer (K/V write off, so it is the
  same single kernel) against a bare launch of that Triton kernel with every argument
  prebuilt (the launch floor: Triton's own ``kernel[grid](...)``); also against the direct
  launch of the compiled kernel that ``run`` takes where it applies
  (``aiter_attn.kernels.triton._launch``, ``direct_launch_us``; ``direct_launch`` records
  whether it was on); ``forward+write`` with the K/V write, against both bare launches.
  Target: ≤ 15 µs beyond the bare launch.
* ``mla.run``: a planned 16-head MLA decode layer call (:func:`host_mla`) with the plan's
  interned launch-key specs and with keys built per call.
* ``ops``: ``ops.paged_attention`` eager against ``torch.nn.functional.scaled_dot_product_attention``
  of the same shape (dense K/V). Target: ≤ 2× SDPA.
* ``engine``: the engine side by side with transformers ``generate`` (sdpa) on a random-weight
  Llama-3.2-1B-shaped bf16 model, the same prompts (batch 8 and 32, 512 prompt + 128 new
  tokens, greedy, no stop token), eager and CUDA-graph decode. Decode tokens/s =
  ``bs · (new − 1) / (t(new) − t(1))`` for both (prefill and the first token cancel out);
  the engine's own decode-phase rate is recorded too. Targets: eager ≥ 1.0×, graph ≥ 2.5×.

``smoke=True`` runs every row on the CPU with tiny shapes and a few calls (no targets: it
only proves the harness runs; ``tests/test_bench_host.py``).
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["run_host", "time_calls", "HOST_TARGETS"]

#: The issue's targets (host µs beyond a bare launch; ratios).
HOST_TARGETS = {"forward_extra_us": 15.0, "ops_over_sdpa": 2.0, "engine_eager_x": 1.0,
                "engine_graph_x": 2.5}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, n: int, rounds: int, device) -> float:
    """Median over ``rounds`` of the mean µs per call of ``n`` back-to-back ``fn()`` calls."""
    for _ in range(min(n, 50)):  # warm-up (compilation, caches)
        fn()
    _sync(device)
    per_call = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        per_call.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(per_call)


def _decode_setup(device, dtype, smoke: bool, kernel_backend=None):
    """One decode step of one layer over a paged pool: backend, batch, inputs."""
    from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
    from aiter_attn.testing import PagedScenario

    hq, hkv, d, keys, page = (4, 2, 16, 20, 4) if smoke else (32, 8, 128, 100, 16)
    cfg = BackendConfig(page_size=page, max_batch_size=1, max_context_len=keys + 8,
                        dtype=dtype, device=device, kernel_backend=kernel_backend)
    layer = LayerSpec(layer_id=0, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    sc = PagedScenario.make(cfg, [layer], [keys - 1], seed=0)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.DECODE, [1])
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layer)
    return be, layer, batch, q, k, v, sc


def _bare_launch(be, layer, batch, q, direct: bool = False):
    """A zero-argument callable launching the bound Triton kernel with prebuilt arguments
    (``None`` when the bound kernel is not the Triton one): through Triton's own
    ``kernel[grid](...)`` or, with ``direct``, the direct launch of the compiled kernel that
    ``run`` uses where it applies (``aiter_attn.kernels.triton._launch``)."""
    from aiter_attn.kernels.triton.attention import TritonPagedAttention

    be.forward(q, None, None, layer, batch, save_kv_cache=False)  # binds and plans
    _, executor = be.strategies_for(batch.forward_mode)
    binding = next(iter(executor._layers.values()))
    kernel = binding.kernel
    if not isinstance(kernel, TritonPagedAttention):
        return None
    plan = be.forward_metadata.kernel_plans.get(binding.group)
    k_cache, v_cache = be.ctx.kv_pool.kv_buffers(layer.layer_id)
    q3 = q.view(q.shape[0], layer.num_q_heads, layer.head_dim)
    out = torch.empty(q.shape[0], layer.num_q_heads, layer.v_head_dim, dtype=q.dtype,
                      device=q.device)
    return kernel.bare_launch(q3, (k_cache, v_cache), plan, binding.params, out, direct=direct)


def _direct_state():
    """Whether the attention launches went through the direct path (None: never launched)."""
    from aiter_attn.kernels.triton import attention

    return attention._ATTN.direct


def _bare_write(be, layer, batch, k, v):
    _, executor = be.strategies_for(batch.forward_mode)
    k_cache, v_cache = be.ctx.kv_pool.kv_buffers(layer.layer_id)
    write = next(sel for key, sel in executor._kernels.items()
                 if isinstance(key, tuple) and key[0] == "write_kv")
    n = k.shape[0]
    k3 = k.view(n, layer.num_kv_heads, layer.head_dim)
    v3 = v.view(n, layer.num_kv_heads, layer.v_head_dim)
    slots = batch.out_cache_loc
    return lambda: write.fn(k_cache, v_cache, slots, k3, v3, k_scale=1.0, v_scale=1.0)


def host_forward(device, dtype, n, rounds, smoke, kernel_backend=None) -> list[dict]:
    be, layer, batch, q, k, v, _ = _decode_setup(device, dtype, smoke, kernel_backend)
    rows = []
    fwd = time_calls(lambda: be.forward(q, None, None, layer, batch, save_kv_cache=False), n,
                     rounds, device)
    fwd_w = time_calls(lambda: be.forward(q, k, v, layer, batch), n, rounds, device)
    bare = _bare_launch(be, layer, batch, q)
    bare_us = time_calls(bare, n, rounds, device) if bare is not None else None
    direct = _bare_launch(be, layer, batch, q, direct=True)
    direct_us = time_calls(direct, n, rounds, device) if direct is not None else None
    write_us = time_calls(_bare_write(be, layer, batch, k, v), n, rounds, device)
    rows.append({"row": "forward", "us_per_call": fwd, "bare_launch_us": bare_us,
                 "extra_us": None if bare_us is None else fwd - bare_us,
                 "direct_launch_us": direct_us,
                 "extra_over_direct_us": None if direct_us is None else fwd - direct_us,
                 "direct_launch": _direct_state(),
                 "target_extra_us": HOST_TARGETS["forward_extra_us"]})
    rows.append({"row": "forward+write", "us_per_call": fwd_w,
                 "bare_launch_us": None if bare_us is None else bare_us + write_us,
                 "extra_us": None if bare_us is None else fwd_w - bare_us - write_us})
    return rows


def host_ops(device, dtype, n, rounds, smoke) -> list[dict]:
    import torch.nn.functional as F

    from aiter_attn import ops

    hq, hkv, d, keys, page = (4, 2, 16, 20, 4) if smoke else (32, 8, 128, 100, 16)
    pages = -(-keys // page)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, hq, d, generator=g).to(device, dtype)
    kc = torch.randn(pages + 1, page, hkv, d, generator=g).to(device, dtype)
    vc = torch.randn(pages + 1, page, hkv, d, generator=g).to(device, dtype)
    bt = torch.arange(1, pages + 1, dtype=torch.int32, device=device).view(1, pages)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    sk = torch.tensor([keys], dtype=torch.int32, device=device)
    scale = d ** -0.5
    ours = time_calls(lambda: ops.paged_attention(
        q, kc, vc, cu_seqlens_q=cu, seqused_k=sk, block_table=bt, softmax_scale=scale,
        max_seqlen_q=1, max_seqlen_k=keys), n, rounds, device)
    qd = q.view(1, hq, 1, d)
    kd = kc[1:].reshape(-1, hkv, d)[:keys].permute(1, 0, 2).unsqueeze(0).contiguous()
    vd = vc[1:].reshape(-1, hkv, d)[:keys].permute(1, 0, 2).unsqueeze(0).contiguous()
    sdpa = time_calls(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale,
                                                             enable_gqa=True),
                      n, rounds, device)
    return [{"row": "ops.paged_attention", "us_per_call": ours, "sdpa_us": sdpa,
             "ratio": ours / sdpa, "target_ratio": HOST_TARGETS["ops_over_sdpa"]}]


def host_mla(device, dtype, n, rounds, smoke) -> list[dict]:
    """``TritonMLA.run`` per layer call of a planned 16-head decode step (4 requests of 100
    keys, page 64, latent 512 + 64: the narrow Gluon kernel and its split merge where it
    serves, ``narrow``), with the plan's interned launch-key specs (the default) and without
    them (each call's key built from every argument, as before 2026-12-06)."""
    from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params, mla_request
    from aiter_attn.kernels.triton import mla
    from aiter_attn.kernels.triton.mla import TritonMLA

    t, heads, keys, page, rank, rope = ((2, 4, 20, 16, 64, 16) if smoke
                                        else (4, 16, 100, 64, 512, 64))
    pages = -(-keys // page)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(t, heads, rank + rope, generator=g).to(device, dtype)
    kv = torch.randn(t * pages + 1, page, 1, rank + rope, generator=g).to(device, dtype)
    bt = torch.arange(1, t * pages + 1, dtype=torch.int32, device=device).view(t, pages)
    cu = torch.arange(t + 1, dtype=torch.int32, device=device)
    seq = torch.full((t,), keys, dtype=torch.int32, device=device)
    out = torch.empty(t, heads, rank, dtype=dtype, device=device)
    kernel = TritonMLA(mla_request(q, kv, rank), {})
    plan = kernel.plan(_adhoc_metadata(q, kv, cu, seq, bt, None, None, 1, keys, "host"))
    params = mla_layer_params(scale=(rank + rope) ** -0.5, device=device, kv_lora_rank=rank,
                              num_q_heads=heads, head_dim=rank + rope, kv_scale=None,
                              fp8=False, causal=True)
    call = lambda: kernel.run(q, (kv,), plan, params, out)  # noqa: E731
    planned = time_calls(call, n, rounds, device)
    kernel._narrow_specs = lambda plan: (None, None)  # every call's key from its arguments
    plan.kw_cache.pop(mla._NARROW_SPECS, None)
    unplanned = time_calls(call, n, rounds, device)
    return [{"row": f"mla.run {heads} heads", "us_per_call": planned,
             "unplanned_keys_us": unplanned, "narrow": plan.narrow is not None}]


def _engine_model(device, dtype, smoke):
    from aiter_attn.engine.random_models import build_random_model

    over = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
            if smoke else
            dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                 vocab_size=128256, max_position_embeddings=2048,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                  "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192},
                 tie_word_embeddings=True, initializer_range=0.02))
    hf, _ = build_random_model("llama3", seed=0, overrides=over)
    return hf.to(device=device, dtype=dtype).eval()


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def host_engine(device, dtype, smoke, batches=(8, 32), prompt_len=512, new=128,
                modes=("eager", "graph")) -> list[dict]:
    from aiter_attn.engine import Engine, EngineConfig, SamplingParams
    from aiter_attn.engine.models import build_engine_model

    if smoke:
        batches, prompt_len, new = (2,), 8, 4
    hf = _engine_model(device, dtype, smoke)
    vocab = hf.config.vocab_size
    rows = []
    for bs in batches:
        g = torch.Generator(device="cpu").manual_seed(bs)
        prompts = torch.randint(3, vocab, (bs, prompt_len), generator=g)

        def hf_gen(n_new):
            ids = prompts.to(device)
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids),
                                   max_new_tokens=n_new, min_new_tokens=n_new,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)

        hf_gen(2)  # warm-up
        t_hf = _timed(lambda: hf_gen(new), device) - _timed(lambda: hf_gen(1), device)
        hf_tps = bs * (new - 1) / t_hf
        rows.append({"row": f"transformers bs={bs}", "decode_tokens_per_s": hf_tps})
        for mode in modes:
            max_ctx = prompt_len + new
            cfg = EngineConfig(page_size=16, max_batch_size=bs, max_context_len=max_ctx,
                               max_tokens_per_step=bs * prompt_len, kv_tokens=bs * max_ctx,
                               prefix_caching=False,
                               cuda_graph=(mode == "graph") if device.type == "cuda"
                               else (mode == "graph"))
            model = build_engine_model(hf, dtype=dtype, device=device, max_positions=max_ctx)
            engine = Engine(model, cfg)
            lists = [p.tolist() for p in prompts]

            def gen(n_new):
                return engine.generate(lists, SamplingParams(max_new_tokens=n_new))

            gen(2)  # warm-up (compilation, graph capture)
            t = _timed(lambda: gen(new), device) - _timed(lambda: gen(1), device)
            tps = bs * (new - 1) / t
            engine.stats.decode_tokens = 0
            engine.stats.decode_seconds = 0.0
            gen(new)
            rows.append({"row": f"engine {mode} bs={bs}", "decode_tokens_per_s": tps,
                         "engine_decode_phase_tokens_per_s": engine.stats.decode_tokens_per_s,
                         "vs_transformers": tps / hf_tps,
                         "target_x": HOST_TARGETS[f"engine_{mode}_x"]})
            del engine, model
    return rows


def run_host(device=None, dtype=None, *, n: int = 2000, rounds: int = 5, smoke: bool = False,
             engine: bool = True, batches=(8, 32), kernel_backend=None) -> list[dict]:
    """Every host row (see the module docstring); ``smoke`` = tiny CPU shapes.
    ``kernel_backend`` forces the forward row's kernel (the bare-launch floor needs Triton)."""
    device = torch.device(device or ("cpu" if smoke else "cuda"))
    dtype = dtype or (torch.float32 if smoke else torch.bfloat16)
    if smoke:
        n, rounds = min(n, 20), min(rounds, 2)
    rows = host_forward(device, dtype, n, rounds, smoke, kernel_backend)
    rows += host_ops(device, dtype, n, rounds, smoke)
    rows += host_mla(device, dtype, n, rounds, smoke)
    if engine:
        rows += host_engine(device, dtype, smoke, batches=batches)
    return rows


def host_table(rows: list[dict]) -> str:
    """A markdown table of the host rows."""
    lines = ["| row | value | floor / anchor | beyond floor or ratio | target |",
             "| --- | --- | --- | --- | --- |"]

    def f(x, unit=""):
        return "-" if x is None else f"{x:.1f}{unit}"

    for r in rows:
        if "us_per_call" in r and "sdpa_us" in r:
            lines.append(f"| {r['row']} | {f(r['us_per_call'], ' µs')} | SDPA "
                         f"{f(r['sdpa_us'], ' µs')} | {r['ratio']:.2f}× | ≤ "
                         f"{r['target_ratio']:.1f}× |")
        elif "unplanned_keys_us" in r:
            lines.append(f"| {r['row']} ({'narrow' if r['narrow'] else 'Triton'} kernel) | "
                         f"{f(r['us_per_call'], ' µs')} | per-call keys "
                         f"{f(r['unplanned_keys_us'], ' µs')} | "
                         f"{f(r['us_per_call'] - r['unplanned_keys_us'], ' µs')} | |")
        elif "us_per_call" in r:
            direct = ""
            if r.get("direct_launch_us") is not None:
                direct = (f" (direct launch {f(r['direct_launch_us'], ' µs')}: "
                          f"+{f(r['extra_over_direct_us'], ' µs')})")
            lines.append(f"| {r['row']} | {f(r['us_per_call'], ' µs')} | bare "
                         f"{f(r['bare_launch_us'], ' µs')}{direct} | "
                         f"+{f(r['extra_us'], ' µs')} | "
                         f"{'≤ +%.0f µs' % r['target_extra_us'] if 'target_extra_us' in r else ''} |")
        elif "vs_transformers" in r:
            lines.append(f"| {r['row']} | {r['decode_tokens_per_s']:.0f} tok/s | "
                         f"(engine phase {r['engine_decode_phase_tokens_per_s']:.0f}) | "
                         f"{r['vs_transformers']:.2f}× | ≥ {r['target_x']:.1f}× |")
        else:
            lines.append(f"| {r['row']} | {r['decode_tokens_per_s']:.0f} tok/s | | | |")
    return "\n".join(lines)
