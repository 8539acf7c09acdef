"""A hypothesis state machine over the graph manager's lifecycle (CPU, no capture): capture,
then requests join and leave while decode and verify steps replay growing, shrinking and
padded batches; a batch past the largest capture is refused without touching anything.

Invariants after every step: the graph's output equals the eager backend's on the same batch
and inputs; K/V writes touched only the batch's slots (and the dummy slot 0); static buffers
never moved; padding rows point at the null row and the dummy slot.
"""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiter_attn import ForwardMode, GraphLimitError, SpecDecodeConfig
from aiter_attn.graph import DUMMY_SLOT, NULL_REQ_ROW

from ._graph_helpers import Rig

MAX_BS = 6
CONTEXT = 96


class GraphLifecycle(RuleBasedStateMachine):
    @initialize(arch=st.sampled_from(["mha", "mla", "swa"]), page=st.sampled_from([1, 7, 16]),
                seed=st.integers(0, 1000))
    def capture(self, arch, page, seed):
        spec = SpecDecodeConfig(topk=1, num_draft_tokens=2)
        self.rig = Rig.make(arch, page_size=page, hq=4, hkv=2, head_dim=16, num_layers=2,
                            max_context_len=CONTEXT, max_bs=MAX_BS + 2, spec=spec, seed=seed)
        self.mgr = self.rig.manager(capture_sizes=[1, 2, 4, MAX_BS])
        self.modes = [m for m in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
                      if m in self.mgr.modes]
        self.mgr.capture(self.rig.step_fn(), modes=self.modes)
        self.ptrs = self.mgr.buffer_pointers()
        self.steps = 0

    # -- requests ---------------------------------------------------------------------------
    @precondition(lambda self: len(self.rig.rows) < MAX_BS + 1)
    @rule(prefix=st.integers(0, 60))
    def join(self, prefix):
        self.rig.join(prefix)

    @precondition(lambda self: self.rig.rows)
    @rule(data=st.data())
    def leave(self, data):
        self.rig.leave(data.draw(st.sampled_from(self.rig.rows)))

    # -- steps ------------------------------------------------------------------------------
    def _room(self, n):
        return all(self.rig.alloc.tokens_held(r) + n <= CONTEXT for r in self.rig.rows)

    @precondition(lambda self: len(self.rig.rows) <= MAX_BS)
    @rule(verify=st.booleans())
    def step(self, verify):
        mode = ForwardMode.TARGET_VERIFY if verify and self.rig.rows else ForwardMode.DECODE
        if mode not in self.modes or not self._room(self.rig.q_len(mode)):
            return
        rig = self.rig
        batch = rig.batch(mode if rig.rows else ForwardMode.IDLE)
        inputs = rig.random_inputs(batch)
        before = rig.snapshot()
        out = self.mgr.replay(batch, **inputs)
        assert rig.foreign_writes(before, batch) == [], "a graph step wrote a foreign slot"
        e = self.mgr.last_entry
        bs, pbs = batch.batch_size, e.bs
        st_in = self.mgr.static
        assert (st_in.req_pool_indices[bs:pbs] == NULL_REQ_ROW).all()
        assert (st_in.out_cache_loc[batch.num_tokens:pbs * rig.q_len(mode)] == DUMMY_SLOT).all()
        for full in e.outputs:
            assert torch.isfinite(full).all(), "padding rows produced NaN/inf"
        if bs:
            eager = rig.eager(batch, inputs, save_kv_cache=False)
            for g, x in zip(out, eager):
                assert torch.equal(g, x), f"{mode.name} bs={bs} (padded {pbs}): graph ≠ eager"
        self.steps += 1

    @precondition(lambda self: len(self.rig.rows) > MAX_BS)
    @rule()
    def oversize_batch_is_refused(self):
        rig = self.rig
        batch = rig.batch(ForwardMode.DECODE)
        before = rig.snapshot()
        try:
            self.mgr.replay(batch, **rig.random_inputs(batch))
        except GraphLimitError as exc:
            assert "max_batch_size" in str(exc)
        else:
            raise AssertionError(f"a batch of {batch.batch_size} > {MAX_BS} was replayed")
        assert rig.foreign_writes(before, _no_slots(batch)) == [], "a refused step wrote KV"
        # the refused step's slots stay reserved; drop the requests it extended
        rig.leave(rig.rows[-1])

    @invariant()
    def buffers_never_move(self):
        if hasattr(self, "mgr"):
            assert self.mgr.buffer_pointers() == self.ptrs


def _no_slots(batch):
    import attrs

    return attrs.evolve(batch, out_cache_loc=torch.zeros(0, dtype=torch.int64))


GraphLifecycle.TestCase.settings = settings(stateful_step_count=12)  # examples: the profile's
TestGraphLifecycle = GraphLifecycle.TestCase
