"""Test support for speculative modes: EAGLE tree masks, multi-step draft slot layouts,
invariant checks of verify / draft metadata, hypothesis strategies, and a host-read guard.

Proving "no device→host sync" on a CPU-only box uses two complementary tools:

* :mod:`aiter_attn.testing.nosync` puts every device tensor on ``meta`` (shapes, no data), so
  any read of device data on the host raises inside torch;
* :func:`forbid_device_reads` patches ``Tensor.item/tolist/numpy/cpu``,
  ``__bool__/__int__/__float__/__index__`` and ``__repr__/__format__`` (printing) to raise for
  any tensor not on the CPU, so the error names the offending call. It also works on a GPU
  with real CUDA tensors (pair it with ``torch.cuda.set_sync_debug_mode("error")`` there).
  CPU mirrors (``seq_lens_cpu``) and host integers stay legal.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import attrs
import torch
from hypothesis import strategies as st

from ..batch import ForwardBatch
from ..metadata import AttnMetadata
from ..multistep import draft_columns_needed
from .invariants import InvariantError, check_indptr
from .oracle import dense_attention

__all__ = [
    "HostReadError",
    "forbid_device_reads",
    "tree_mask_from_parents",
    "tree_depths",
    "tree_verify_masks",
    "windowed_tree_masks",
    "random_tree_parents",
    "full_verify_mask",
    "tree_parents",
    "check_verify_mask",
    "DraftLayout",
    "reserve_draft_slots",
    "check_draft_step",
    "draft_step_inputs",
    "draft_branch_expected",
]


class HostReadError(RuntimeError):
    """A planning step read a device tensor back to the host."""


# __repr__ / __format__: printing or formatting a device tensor (an f-string in a log or error
# message) copies it to the host; a meta tensor prints without data, so only this guard sees it
_GUARDED = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
            "__repr__", "__format__")


@contextlib.contextmanager
def forbid_device_reads():
    """Within the block, reading a non-CPU tensor on the host raises :class:`HostReadError`."""
    saved = {name: getattr(torch.Tensor, name) for name in _GUARDED}

    def guard(name, orig):
        def wrapper(self, *args, **kwargs):
            if self.device.type != "cpu":
                raise HostReadError(f"Tensor.{name}() on a {self.device.type} tensor of shape "
                                    f"{tuple(self.shape)}: a device→host sync in planning.")
            return orig(self, *args, **kwargs)

        return wrapper

    try:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, guard(name, orig))
        yield
    finally:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)


# -- EAGLE tree masks -------------------------------------------------------------------------
def tree_mask_from_parents(parents: Sequence[int]) -> torch.Tensor:
    """bool ``[n, n]``: ``mask[i, j]`` iff draft token ``j`` is ``i`` or an ancestor of ``i``.

    ``parents[0] == -1`` (the root, the last verified token); ``parents[i] < i``.
    """
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_depths(parents: Sequence[int]) -> list:
    """Depth of every draft token below the root (``parents[i] < i``; the root has depth 0)."""
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def tree_verify_masks(prefix_lens: Sequence[int], parents: Sequence[int]) -> list:
    """Per request bool ``[n, prefix + n]``: the prefix all visible, then ancestors and self
    (:func:`full_verify_mask` of :func:`tree_mask_from_parents`)."""
    tree = tree_mask_from_parents(parents)
    return [full_verify_mask(tree, p + len(parents)) for p in prefix_lens]


def windowed_tree_masks(prefix_lens: Sequence[int], masks: Sequence[torch.Tensor],
                        depth: torch.Tensor, sliding_window) -> list:
    """The literal per-token masks of a windowed tree verify: ``masks[b][i, j] and
    pos(j) ≥ pos(i) − w + 1`` with draft token ``i`` at ``prefix + depth[i]`` and prefix key
    ``j`` at ``j`` (``depth`` int ``[n]``); ``sliding_window=None`` returns ``masks`` as is."""
    if sliding_window is None:
        return list(masks)
    out = []
    for p, m in zip(prefix_lens, masks):
        qpos = (p + depth).view(-1, 1)
        kpos = torch.cat([torch.arange(p), p + depth]).view(1, -1)
        out.append(m & (kpos >= qpos - (sliding_window - 1)))
    return out


def random_tree_parents(n: int, generator: torch.Generator) -> list:
    """A random tree in EAGLE order (every token after its parent)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]


@st.composite
def tree_parents(draw, n: int) -> list:
    """Hypothesis: a tree of ``n`` draft tokens in EAGLE order."""
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def full_verify_mask(tree: torch.Tensor, seq_len: int) -> torch.Tensor:
    """SGLang's per-request block ``[n, seq_len]``: prefix visible, then the tree part."""
    n = tree.shape[0]
    return torch.cat([torch.ones(n, seq_len - n, dtype=torch.bool), tree.bool()], dim=1)


def check_verify_mask(md: AttnMetadata, batch: ForwardBatch, trees: Sequence[torch.Tensor]):
    """``mask_indptr`` advances by ``q_len · seq_len`` per request and each block equals
    :func:`full_verify_mask` of that request's tree."""
    if md.mask is None:
        raise InvariantError("tree verify planned no custom mask.")
    n = md.query.max_seqlen_q
    lens = batch.seq_lens_cpu.long()
    bs = batch.batch_size
    check_indptr("mask_indptr", md.mask.mask_indptr[: bs + 1], lens * n)
    ip = md.mask.mask_indptr.cpu().tolist()
    flat = md.mask.custom_mask.cpu().bool()
    if flat.numel() < ip[bs]:
        raise InvariantError(f"custom_mask has {flat.numel()} elements < mask_indptr[-1]={ip[bs]}.")
    for b, (tree, L) in enumerate(zip(trees, lens.tolist())):
        got = flat[ip[b]: ip[b + 1]].view(n, L)
        if not torch.equal(got, full_verify_mask(tree, L)):
            raise InvariantError(f"request {b}: planned mask block differs from its tree.")


# -- multi-step draft decode ------------------------------------------------------------------
@attrs.frozen
class DraftLayout:
    """Host-side copy of the draft-slot layout of :mod:`aiter_attn.multistep`."""

    page_size: int
    topk: int
    num_steps: int

    def column(self, prefix_len: int, branch: int, token: int) -> int:
        """``req_to_token`` column of logical token ``token`` of ``branch``."""
        base = prefix_len - prefix_len % self.page_size
        nnp = -(-(prefix_len % self.page_size + self.num_steps) // self.page_size)
        return token if token < base else token + branch * nnp * self.page_size


def reserve_draft_slots(allocator, req_pool, rows: Sequence[int], prefix_lens: Sequence[int],
                        layout: DraftLayout, kv_pool=None) -> None:
    """Reserve every request's draft slots after its committed tokens and, with
    ``page_size > 1`` and ``topk > 1``, copy the prefix's last partial page into each branch's
    first page of every layer of ``kv_pool`` (what SGLang's EAGLE worker does)."""
    need = draft_columns_needed(torch.as_tensor(list(prefix_lens)), layout.page_size,
                                layout.topk, layout.num_steps).tolist()
    r2t = req_pool.req_to_token
    for row, p, end in zip(rows, prefix_lens, need):
        allocator.extend(req_pool, row, end - allocator.tokens_held(row))
        partial = p % layout.page_size
        if kv_pool is None or partial == 0 or layout.topk == 1:
            continue
        base = p - partial
        src = r2t[row, base:p].long()
        for k in range(1, layout.topk):
            dst = r2t[row, [layout.column(p, k, t) for t in range(base, p)]].long()
            for buf in list(kv_pool.k_buffers) + list(kv_pool.v_buffers):
                flat = buf.view(-1, *buf.shape[2:])
                flat[dst] = flat[src]


def check_draft_step(step_batch: ForwardBatch, md: AttnMetadata, step: int,
                     draft_batch: ForwardBatch, req_to_token: torch.Tensor, layout: DraftLayout,
                     allocator=None) -> None:
    """Invariants of draft step ``step`` (row ``r = b·topk + k``): one query per row at
    position ``P + step``; ``seqused_k = P + step + 1``; the page table lists exactly the pages
    of branch ``k``'s tokens (null page past them; pages owned by the request); the written
    slot is branch ``k``'s token ``step`` and lies in the page the table names for it; no two
    rows write the same slot."""
    ps, topk = layout.page_size, layout.topk
    rows = draft_batch.batch_size * topk
    check_indptr("cu_seqlens_q", md.query.cu_seqlens_q[: rows + 1], torch.ones(rows))
    r2t = req_to_token.cpu().long()
    bt = md.pages.block_table.cpu().long()
    seqused = md.pages.seqused_k.cpu().long()
    slots = step_batch.out_cache_loc.cpu().long()
    pos = step_batch.positions.cpu().long()
    req_rows = draft_batch.req_pool_indices.cpu().tolist()
    for b, (row, p) in enumerate(zip(req_rows, draft_batch.seq_lens_cpu.tolist())):
        owned = set(allocator.pages_of(row)) if allocator is not None else None
        for k in range(topk):
            r = b * topk + k
            kv_len = p + step + 1
            if int(seqused[r]) != kv_len or int(pos[r]) != p + step:
                raise InvariantError(f"row {r}: seqused_k {int(seqused[r])} / position "
                                     f"{int(pos[r])}, expected {kv_len} / {p + step}.")
            tok_slots = torch.tensor([int(r2t[row, layout.column(p, k, t)])
                                      for t in range(kv_len)])
            used = -(-kv_len // ps)
            want = tok_slots[::ps] // ps
            if not torch.equal(bt[r, :used], want):
                raise InvariantError(f"row {r}: pages {bt[r, :used].tolist()} != branch pages "
                                     f"{want.tolist()}.")
            if not torch.equal(bt[r, torch.arange(kv_len) // ps], tok_slots // ps):
                raise InvariantError(f"row {r}: a token's slot lies outside its listed page.")
            if bool((bt[r, used:] != 0).any()) or bool((bt[r, :used] <= 0).any()):
                raise InvariantError(f"row {r}: null page inside, or live pages past, its length.")
            if owned is not None and not set(bt[r, :used].tolist()) <= owned:
                raise InvariantError(f"row {r}: lists pages not owned by request row {row}.")
            if int(slots[r]) != int(tok_slots[-1]):
                raise InvariantError(f"row {r}: writes slot {int(slots[r])}, branch token slot "
                                     f"is {int(tok_slots[-1])}.")
    if rows and slots[:rows].unique().numel() != rows:
        raise InvariantError(f"step {step}: two rows write the same KV slot.")



def draft_step_inputs(layer, n: int, dtype: torch.dtype, generator: torch.Generator):
    """Random q ``[n, Hq·D]``, k ``[n, Hkv·D]``, v ``[n, Hkv·Dv]`` in ``dtype`` (drawn in that
    order from ``generator``) for one draft step of ``layer``."""
    q = torch.randn(n, layer.num_q_heads * layer.head_dim, generator=generator).to(dtype)
    k = torch.randn(n, layer.num_kv_heads * layer.head_dim, generator=generator).to(dtype)
    v = torch.randn(n, layer.num_kv_heads * layer.v_head_dim, generator=generator).to(dtype)
    return q, k, v


def draft_branch_expected(scenario, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          rows: Sequence[tuple], branch_kv: dict) -> torch.Tensor:
    """float64 ``[len(rows), Hq·Dv]`` oracle of one draft step: row ``r = (b, branch)`` attends to
    request ``b``'s cached prefix (``scenario.dense_k/v``) plus that branch's draft tokens so
    far, with the layer's window, soft-cap and sinks, the new K/V rounded as the cache stores
    them. Appends this step's ``k[r]``/``v[r]`` to ``branch_kv`` (a dict the caller keeps across
    steps, keyed ``(layer_id, b, branch)``)."""
    hkv, d, dv = layer.num_kv_heads, layer.head_dim, layer.v_head_dim
    # the draft K/V as the cache stores them (fp8 rounding), like PagedScenario.expected
    kc, vc = scenario.kv_pool.kv_buffers(layer.layer_id)
    expected = []
    for r, (b, br) in enumerate(rows):
        ks, vs = branch_kv.setdefault((layer.layer_id, b, br), ([], []))
        ks.append(scenario._roundtrip(k[r].float().view(hkv, d), kc.dtype, layer.k_scale))
        vs.append(scenario._roundtrip(v[r].float().view(hkv, dv), vc.dtype, layer.v_scale))
        kk = torch.cat([scenario.dense_k[(layer.layer_id, b)], torch.stack(ks)])
        vv = torch.cat([scenario.dense_v[(layer.layer_id, b)], torch.stack(vs)])
        # every convention of the layer: window, soft-cap and sinks (the draft kernel applies
        # them all; an oracle without them fails a correct kernel and passes one that drops them)
        expected.append(dense_attention(q[r].view(1, layer.num_q_heads, d), kk, vv,
                                        scale=layer.scaling, window=layer.window_size(),
                                        softcap=layer.logit_cap, sinks=layer.sinks).view(1, -1))
    return torch.cat(expected)
