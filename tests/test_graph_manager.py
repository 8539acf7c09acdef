"""CudaGraphManager on the CPU (no-capture mode): capture → replay of padded batches gives the
eager result, padding rows point at the null row / dummy slot and stay finite, KV writes touch
only the batch's slots, limits raise errors that name the setting, and a plan that moves its
frozen parts between capture and replay is caught."""

import pytest
import torch

from aiter_attn import (AttentionBackend, BackendConfig, CGSupport, ForwardMode,
                        GraphLimitError, GraphMetadataMismatch, LayerSpec, SpecDecodeConfig,
                        SpecInfo)
from aiter_attn.graph import (DUMMY_SLOT, NULL_REQ_ROW, CudaGraphManager, GraphLimits,
                              default_capture_sizes, next_capture_size)
from aiter_attn.registry import StrategyPair, StrategyRegistry
from aiter_attn.strategies.mha import DecodeMetadata, PagedExecution
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel

from ._graph_helpers import Rig

DECODE_CASES = [
    pytest.param("mha", 16, 10, 2, 16, id="mha-page16-GQA5:1-D16"),
    pytest.param("mha", 1, 8, 2, 32, id="mha-page1-GQA4:1-D32"),
    pytest.param("mha", 48, 4, 4, 80, id="mha-page48-MHA-D80"),
    pytest.param("mla", 16, 4, 1, 32, id="mla-page16-H4-lora32"),
    pytest.param("mla", 1, 8, 1, 32, id="mla-page1-H8-lora32"),
    pytest.param("swa", 16, 10, 2, 16, id="swa-page16-GQA5:1-D16-w5"),
    pytest.param("swa", 7, 4, 2, 16, id="swa-page7-GQA2:1-D16-w5"),
]


def _assert_same(graph_out, eager_out, what):
    for i, (g, e) in enumerate(zip(graph_out, eager_out)):
        assert g.shape == e.shape, f"{what} layer {i}: shape {tuple(g.shape)} vs {tuple(e.shape)}"
        assert torch.isfinite(g).all(), f"{what} layer {i}: non-finite graph output"
        assert torch.equal(g, e), (f"{what} layer {i}: graph ≠ eager, max |diff| "
                                   f"{(g.float() - e.float()).abs().max():.3e}")


def _check_padding(mgr, batch):
    e = mgr.last_entry
    bs, pbs = batch.batch_size, e.bs
    st = mgr.static
    assert (st.req_pool_indices[bs:pbs] == NULL_REQ_ROW).all()
    assert (st.seq_lens[bs:pbs] == mgr.fill_value(batch.forward_mode)).all()
    assert (st.seq_lens_cpu[bs:pbs] == mgr.fill_value(batch.forward_mode)).all()
    q = mgr.limits(batch.forward_mode).q_len
    assert (st.out_cache_loc[batch.num_tokens:pbs * q] == DUMMY_SLOT).all()
    for out in e.outputs:  # the padded rows too
        assert torch.isfinite(out).all(), "padding rows produced NaN/inf"


def _steps(rig, mgr, mode, sizes):
    """Replay batches of the given sizes (requests join/leave between steps); compare each with
    the eager backend on the same batch and inputs."""
    step = 0
    for want in sizes:
        while len(rig.rows) < want:
            rig.join(int(torch.randint(0, 40, (1,), generator=rig.gen)))
        while len(rig.rows) > want:
            rig.leave(rig.rows[0])
        batch = rig.batch(mode)
        inputs = rig.random_inputs(batch)
        before = rig.snapshot()
        out = mgr.replay(batch, **inputs)
        assert rig.foreign_writes(before, batch) == [], "graph step wrote a slot it does not own"
        _check_padding(mgr, batch)
        eager = rig.eager(batch, inputs, save_kv_cache=False)
        _assert_same(out, eager, f"{mode} step {step} bs={batch.batch_size}")
        step += 1


@pytest.mark.parametrize("arch,page,hq,hkv,d", DECODE_CASES)
def test_decode_replay_equals_eager(arch, page, hq, hkv, d):
    rig = Rig.make(arch, page_size=page, hq=hq, hkv=hkv, head_dim=d, seed=page + hq)
    mgr = rig.manager()
    mgr.capture(rig.step_fn())
    assert mgr.captured() == [(ForwardMode.DECODE, s) for s in (1, 2, 4, 8)]
    # padded (3→4, 5→8), exact (1, 8), growing and shrinking
    _steps(rig, mgr, "decode", [3, 5, 8, 1, 2, 6])


def test_decode_replay_matches_dense_oracle():
    """Graph replay against the float64 dense reference (not only against eager)."""
    cfg = BackendConfig(page_size=48, max_batch_size=8, max_context_len=256, dtype=torch.float32)
    layers = [LayerSpec(layer_id=i, num_q_heads=10, num_kv_heads=2, head_dim=80) for i in range(2)]
    sc = PagedScenario.make(cfg, layers, [0, 48, 51, 101, 7], seed=5)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    tokens = {f"{t}{l.layer_id}": ((l.num_q_heads * 80 if t == "q" else 160,), torch.float32)
              for l in layers for t in "qkv"}
    mgr = CudaGraphManager(be, capture_sizes=[2, 8], use_cuda_graph=False, token_inputs=tokens)
    mgr.capture(lambda b, x: tuple(be.forward(x[f"q{l.layer_id}"], x[f"k{l.layer_id}"],
                                              x[f"v{l.layer_id}"], l, b) for l in layers))
    for _ in range(3):
        batch = sc.next_batch("decode", [1] * 5)
        inputs = {}
        for l in layers:
            q, k, v = sc.step_inputs(l)
            inputs.update({f"q{l.layer_id}": q, f"k{l.layer_id}": k, f"v{l.layer_id}": v})
        outs = mgr.replay(batch, **inputs)
        assert mgr.last_entry.bs == 8
        for l, o in zip(layers, outs):
            assert_close_rel(o, sc.expected(l, inputs[f"q{l.layer_id}"]), 1e-5,
                             f"layer {l.layer_id}")
        sc.commit_step()


SPEC_CASES = [
    pytest.param(arch, mode, topk, id=f"{arch}-{mode.name.lower()}-topk{topk}")
    for arch in ("mha", "mla", "swa")
    for mode, topk in ((ForwardMode.TARGET_VERIFY, 1), (ForwardMode.TARGET_VERIFY, 2),
                       (ForwardMode.DRAFT_EXTEND_V2, 1))
]


def _require_pair(arch, mode):
    from aiter_attn.plugins import strategy_registry

    pair, reasons = strategy_registry().candidates(mode, arch)
    assert pair is not None, f"no strategy serves {mode.name} × {arch.upper()}: {reasons}"


@pytest.mark.parametrize("arch,mode,topk", SPEC_CASES)
def test_spec_modes_replay_equal_eager(arch, mode, topk):
    _require_pair(arch, mode)
    spec = SpecDecodeConfig(num_steps=2, topk=topk, num_draft_tokens=3)
    rig = Rig.make(arch, page_size=16, hq=4, hkv=2, head_dim=16, spec=spec, seed=11)
    mgr = rig.manager()
    assert mode in mgr.modes
    mgr.capture(rig.step_fn(), modes=[mode])
    _steps(rig, mgr, mode, [3, 1, 7, 4])


@pytest.mark.parametrize("arch", ["mha", "mla"])
def test_tree_part_mask_is_expanded_into_the_static_mask(arch):
    """A verify batch may send only the [bs, q, q] tree part; the graph expands it on the
    device and matches eager planning of the full-layout mask."""
    _require_pair(arch, ForwardMode.TARGET_VERIFY)
    spec = SpecDecodeConfig(topk=2, num_draft_tokens=3)
    rig = Rig.make(arch, page_size=7, hq=4, hkv=2, head_dim=16, spec=spec, seed=3)
    mgr = rig.manager()
    mgr.capture(rig.step_fn(), modes=["target_verify"], sizes=[4])
    for p in (0, 6, 20):
        rig.join(p)
    batch = rig.batch("target_verify", tree_part=True)
    assert batch.spec_info.custom_mask.shape == (3, 3, 3)
    inputs = rig.random_inputs(batch)
    out = mgr.replay(batch, **inputs)
    # the expansion equals the full layout whose tree part was sent: prefix columns visible
    seq = [int(x) for x in batch.seq_lens_cpu]
    part = batch.spec_info.custom_mask
    expect = []
    for b, L in enumerate(seq):
        blk = torch.ones(3, L, dtype=torch.bool)
        blk[:, L - 3:] = part[b]
        expect.append(blk.reshape(-1))
    m = 3 * sum(seq)
    assert torch.equal(mgr.static.custom_mask[:m], torch.cat(expect))
    assert mgr.static.custom_mask[m:m + 3 * 3 * mgr.fill_value("target_verify")].all()
    batch.spec_info.custom_mask = torch.cat(expect)
    _assert_same(out, rig.eager(batch, inputs, save_kv_cache=False), "tree part")


def test_idle_replays_an_all_padding_batch():
    rig = Rig.make("mha")
    mgr = rig.manager()
    mgr.capture(rig.step_fn())
    batch = rig.batch("idle", rows=[])
    out = mgr.replay(batch, **rig.random_inputs(batch))
    assert all(o.shape[0] == 0 for o in out)
    assert mgr.last_entry.bs == 1
    _check_padding(mgr, batch)


def test_sglang_hooks_plan_into_the_same_buffers():
    """init_cuda_graph_state / capture hook / replay hook: the engine owns the graph."""
    rig = Rig.make("mha", max_bs=4)
    be = rig.backend
    mgr = be.init_cuda_graph_state(4, 4, capture_sizes=[4], use_cuda_graph=False)
    assert be.graph_manager is mgr
    for p in (3, 17, 30, 45):
        rig.join(p)
    dev = torch.zeros(4, dtype=torch.int64)
    static = be.init_forward_metadata_capture_cuda_graph(
        4, 4, dev, torch.ones(4, dtype=torch.int32), None, ForwardMode.DECODE, None,
        seq_lens_cpu=torch.ones(4, dtype=torch.int64))
    ptrs = mgr.buffer_pointers()
    batch = rig.batch("decode")
    inputs = rig.random_inputs(batch)
    again = be.init_forward_metadata_replay_cuda_graph(
        4, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_sum, None, ForwardMode.DECODE,
        None, batch.seq_lens_cpu, out_cache_loc=batch.out_cache_loc)
    assert again is static and mgr.buffer_pointers() == ptrs
    graph_out = [be.forward(inputs[f"q{l.layer_id}"], inputs[f"k{l.layer_id}"],
                            inputs[f"v{l.layer_id}"], l, static) for l in rig.layers]
    _assert_same(graph_out, rig.eager(batch, inputs, save_kv_cache=False), "hooks")
    with pytest.raises(ValueError, match="out_cache_loc is required"):
        be.init_forward_metadata_replay_cuda_graph(
            4, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_sum, None,
            ForwardMode.DECODE, None, batch.seq_lens_cpu)


def test_sglang_replay_hook_without_seq_lens_cpu_is_refused_not_synced():
    """The replay hook plans from the CPU mirror; without one it would read seq_lens back (a
    device→host sync on the replay path): refused with an error naming the argument."""
    rig = Rig.make("mha", max_bs=4)
    be = rig.backend
    be.init_cuda_graph_state(4, 4, capture_sizes=[4], use_cuda_graph=False)
    be.init_forward_metadata_capture_cuda_graph(
        4, 4, torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int32), None,
        ForwardMode.DECODE, None, seq_lens_cpu=torch.ones(4, dtype=torch.int64))
    for p in (3, 17, 30, 45):
        rig.join(p)
    batch = rig.batch("decode")
    with pytest.raises(ValueError, match="seq_lens_cpu is required on replay"):
        be.init_forward_metadata_replay_cuda_graph(
            4, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_sum, None,
            ForwardMode.DECODE, None, out_cache_loc=batch.out_cache_loc)


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2])
def test_engine_padded_rows_shorter_than_the_draft_are_refused_before_kernels(mode):
    """Rows the engine padded itself (hooks) with a KV length below the step's query tokens put
    queries before position 0: refused naming the row and the fill value, before any kernel."""
    rig = Rig.make("mha", max_bs=4, page_size=4, spec=SpecDecodeConfig(num_draft_tokens=3))
    be = rig.backend
    mgr = be.init_cuda_graph_state(4, 12, capture_sizes=[4], use_cuda_graph=False)
    spec = SpecInfo(num_draft_tokens=3, topk=1)
    with pytest.raises(GraphLimitError, match=r"seq_lens_cpu\[0\]=1 < 3 .*fill"):
        be.init_forward_metadata_capture_cuda_graph(
            4, 12, torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int32), None,
            mode, spec, seq_lens_cpu=torch.ones(4, dtype=torch.int64))
    fill = mgr.fill_value(mode)
    assert fill >= 3
    be.init_forward_metadata_capture_cuda_graph(
        4, 12, torch.zeros(4, dtype=torch.int64), torch.full((4,), fill, dtype=torch.int32),
        None, mode, spec, seq_lens_cpu=torch.full((4,), fill, dtype=torch.int64))


# -- limits and errors ---------------------------------------------------------------------

def test_batch_larger_than_largest_capture_names_the_setting():
    rig = Rig.make("mha", max_bs=8)
    mgr = rig.manager(capture_sizes=[1, 2, 4])
    mgr.capture(rig.step_fn())
    for p in range(5):
        rig.join(p + 1)
    batch = rig.batch("decode")
    with pytest.raises(GraphLimitError, match=r"largest captured .* 4.*max_batch_size"):
        mgr.replay(batch, **rig.random_inputs(batch))


def test_request_longer_than_buffers_names_max_context_len():
    rig = Rig.make("mha", max_context_len=64)
    mgr = rig.manager()
    mgr.capture(rig.step_fn())
    rig.join(63)
    batch = rig.batch("decode")  # 64 tokens: fits exactly
    mgr.replay(batch, **rig.random_inputs(batch))
    # a batch claiming more KV than the buffers hold is refused before any kernel runs
    batch.seq_lens_cpu[0] = 65
    with pytest.raises(ValueError, match="max_context_len"):
        mgr.replay(batch, **rig.random_inputs(batch))


def test_padded_size_below_the_batch_is_refused():
    """load(padded_bs=) smaller than the batch would plan only its first padded_bs rows while
    the rest were copied into the static inputs: refused before anything is written."""
    rig = Rig.make("mha", max_bs=8)
    mgr = rig.manager()
    mgr.capture(rig.step_fn())
    for p in (3, 9, 20, 31):
        rig.join(p)
    batch = rig.batch("decode")
    with pytest.raises(GraphLimitError, match=r"padded_bs=2 < the batch's 4 requests"):
        mgr.load(batch, padded_bs=2, **rig.random_inputs(batch))


def test_spec_mode_without_spec_config_names_the_setting():
    rig = Rig.make("mha")
    with pytest.raises(ValueError, match=r"BackendConfig\(spec="):
        rig.manager(modes=[ForwardMode.TARGET_VERIFY])


def test_uncaptured_mode_and_size_raise():
    rig = Rig.make("mla", spec=SpecDecodeConfig(num_draft_tokens=2))
    mgr = rig.manager()
    mgr.capture(rig.step_fn(), modes=["decode"], sizes=[1, 2])
    rig.join(5)
    batch = rig.batch(ForwardMode.TARGET_VERIFY)
    with pytest.raises(GraphLimitError, match="capture"):
        mgr.replay(batch, **rig.random_inputs(batch))
    for p in (1, 2):
        rig.join(p)
    batch = rig.batch("decode")  # 3 requests → size 4, not captured
    with pytest.raises(GraphLimitError, match="not captured"):
        mgr.replay(batch, **rig.random_inputs(batch))


def test_wrong_draft_token_count_raises():
    rig = Rig.make("mla", spec=SpecDecodeConfig(num_draft_tokens=3))
    mgr = rig.manager()
    mgr.capture(rig.step_fn(), modes=[ForwardMode.TARGET_VERIFY], sizes=[1])
    rig.join(5)
    rig.config = BackendConfig(page_size=16, max_batch_size=8, max_context_len=128,
                               dtype=torch.float32, arch="mla",
                               spec=SpecDecodeConfig(num_draft_tokens=2))
    batch = rig.batch(ForwardMode.TARGET_VERIFY)
    with pytest.raises(GraphLimitError, match="num_draft_tokens"):
        mgr.replay(batch, **rig.random_inputs(batch))


def test_token_inputs_are_checked():
    rig = Rig.make("mha")
    mgr = rig.manager()
    mgr.capture(rig.step_fn())
    rig.join(3)
    batch = rig.batch("decode")
    inputs = rig.random_inputs(batch)
    with pytest.raises(ValueError, match="missing"):
        mgr.replay(batch, **{k: v for k, v in inputs.items() if k != "q0"})
    inputs["q0"] = inputs["q0"][:, :4]
    with pytest.raises(ValueError, match="token input 'q0' has shape"):
        mgr.replay(batch, **inputs)


def test_constructor_errors():
    rig = Rig.make("mha")
    with pytest.raises(ValueError, match="max_bs"):
        rig.manager(capture_sizes=[1, 16], max_bs=8)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        rig.manager(use_cuda_graph=True)
    rig.backend.ctx.req_to_token[0, 0] = 5
    with pytest.raises(ValueError, match="row 0"):
        rig.manager()


def test_never_capturable_strategy_is_refused():
    reg = StrategyRegistry()
    reg.register(StrategyPair(name="mha.decode.nocg", arch="mha", modes={"decode", "idle"},
                              metadata=DecodeMetadata, execution=PagedExecution,
                              cg_support=CGSupport.NEVER))
    rig = Rig.make("mha")
    be = AttentionBackend(rig.config, rig.req_pool, rig.kv_pool, strategies=reg)
    with pytest.raises(ValueError, match="cg_support=NEVER"):
        CudaGraphManager(be, capture_sizes=[1], modes=["decode"], use_cuda_graph=False)


class _HostSizedDecode(DecodeMetadata):
    """A buggy plan: under out= it takes max_seqlen_k from the batch instead of static bounds."""

    def plan(self, batch, out=None):
        import attrs

        md = super().plan(batch, out)
        return attrs.evolve(md, pages=attrs.evolve(md.pages, max_seqlen_k=batch.max_seq_len))


class _AllocatingDecode(DecodeMetadata):
    """A buggy plan: ignores out= and allocates fresh buffers."""

    def plan(self, batch, out=None):
        return super().plan(batch, None)


@pytest.mark.parametrize("planner,field", [
    pytest.param(_HostSizedDecode, "max_seqlen_k", id="host-size-from-batch"),
    pytest.param(_AllocatingDecode, "block_table", id="fresh-allocation"),
])
def test_plan_that_moves_frozen_parts_is_caught(planner, field):
    reg = StrategyRegistry()
    reg.register(StrategyPair(name="buggy", arch="mha", modes={"decode", "idle"},
                              metadata=planner, execution=PagedExecution,
                              cg_support=CGSupport.ALWAYS))
    rig = Rig.make("mha")
    rig.backend = AttentionBackend(rig.config, rig.req_pool, rig.kv_pool, strategies=reg)
    mgr = rig.manager(capture_sizes=[4])
    mgr.capture(rig.step_fn())
    for p in (10, 40):
        rig.join(p)
    batch = rig.batch("decode")
    with pytest.raises(GraphMetadataMismatch, match=field):
        mgr.replay(batch, **rig.random_inputs(batch))


def test_execution_reading_host_values_sees_capture_values():
    """fn gets CPU mirrors frozen at capture, as a real graph would."""
    rig = Rig.make("mha")
    mgr = rig.manager(capture_sizes=[2])
    seen = []

    def fn(batch, inputs):
        seen.append(batch.seq_lens_cpu.tolist())
        return rig.step_fn()(batch, inputs)

    mgr.capture(fn)
    rig.join(20)
    rig.join(30)
    batch = rig.batch("decode")
    mgr.replay(batch, **rig.random_inputs(batch))
    assert seen == [[1, 1], [1, 1]]
    assert mgr.static.seq_lens_cpu[:2].tolist() == [21, 31]  # the plan saw the live values


# -- sizing ------------------------------------------------------------------------------------

def test_limits_include_draft_slack_page_rounding_and_tree_mask():
    cfg = BackendConfig(page_size=48, max_batch_size=16, max_context_len=100, dtype=torch.float32,
                        spec=SpecDecodeConfig(topk=4, num_draft_tokens=6))
    dec = GraphLimits.from_config(cfg, "decode", 16)
    ver = GraphLimits.from_config(cfg, "target_verify", 16)
    dv2 = GraphLimits.from_config(cfg, "draft_extend_v2", 16, max_num_tokens=200)
    assert (dec.q_len, dec.max_num_tokens, dec.max_seq_len, dec.mask_numel) == (1, 16, 100, 0)
    assert (ver.q_len, ver.max_num_tokens, ver.max_seq_len) == (6, 96, 106)
    assert ver.mask_numel == 96 * 106
    assert (dv2.max_num_tokens, dv2.mask_numel) == (200, 0)
    rig = Rig.make("mla", page_size=48, max_context_len=100,
                   spec=SpecDecodeConfig(topk=4, num_draft_tokens=6))
    mgr = rig.manager(capture_sizes=[16], max_bs=16)
    # ceil(106 / 48) = 3 pages per request in the verify page table; 100 → 3 for decode too
    assert mgr.strategy_buffers("target_verify")["block_table"].shape == (16, 3)
    assert mgr.static.custom_mask.numel() == 96 * 106
    assert mgr.static.out_cache_loc.numel() == 96


def test_capture_size_ladder():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(300)[-3:] == [272, 288, 300]
    assert next_capture_size([1, 2, 4, 8], 0) == 1
    assert next_capture_size([1, 2, 4, 8], 5) == 8
    with pytest.raises(ValueError, match="max_bs"):
        default_capture_sizes(0)


# -- multi-step draft decode -------------------------------------------------------------------

@pytest.mark.parametrize("arch,page,topk,steps", [
    pytest.param("mha", 1, 2, 3, id="mha-page1-topk2-steps3"),
    pytest.param("mha", 16, 2, 3, id="mha-page16-topk2-steps3"),
    pytest.param("mha", 7, 1, 4, id="mha-page7-chain-steps4"),
    pytest.param("mla", 16, 2, 3, id="mla-page16-topk2-steps3"),
    pytest.param("swa", 7, 2, 3, id="swa-page7-topk2-steps3"),
])
def test_multi_step_draft_decode_replay_equals_eager(arch, page, topk, steps):
    from aiter_attn import multistep

    spec = SpecDecodeConfig(num_steps=steps, topk=topk, num_draft_tokens=steps * topk + 1)
    rig = Rig.make(arch, page_size=page, hq=4, hkv=2, head_dim=16, spec=spec, seed=page)
    ms = multistep.MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool)
    mgr = CudaGraphManager(ms, capture_sizes=[1, 2, 4], use_cuda_graph=False,
                           token_inputs=rig.token_inputs())
    fn = rig.multistep_step_fn(ms)
    mgr.capture(fn)
    for bs in (3, 1, 4, 2):
        rows, batch = rig.join_drafting(bs, 40)
        inputs = rig.random_inputs(batch, num_tokens=bs * topk)  # one row per branch
        before = rig.snapshot()
        out = mgr.replay(batch, **inputs)
        # padding rows of every step write the dummy slot only
        dloc = mgr.strategy_buffers("decode")["draft_out_cache_loc"]
        pbs = mgr.last_entry.bs
        assert (dloc[:steps - 1, bs * topk:pbs * topk] == DUMMY_SLOT).all()
        written = set(dloc[:steps - 1, :bs * topk].reshape(-1).tolist())
        fake = attrs_batch_with_slots(batch, written)
        assert rig.foreign_writes(before, fake) == []
        for o in out:
            assert o.shape[0] == bs * topk and torch.isfinite(o).all()
        ms.init_forward_metadata(batch)  # eager plan into fresh buffers
        eager = fn(batch, inputs)
        _assert_same(out, eager, f"multi-step bs={bs}")
        for r in rows:
            rig.leave(r)


def attrs_batch_with_slots(batch, slots):
    import attrs

    return attrs.evolve(batch, out_cache_loc=torch.tensor(sorted(slots), dtype=torch.int64))
