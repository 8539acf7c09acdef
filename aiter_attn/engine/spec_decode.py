"""Speculative decoding in the engine: n-gram (prompt lookup) drafts verified with one
TARGET_VERIFY forward.

Each decode step, for every greedy request, :class:`NgramDrafter` looks for the most recent
earlier occurrence of the request's last ``n`` tokens (``n`` from ``max_ngram`` down to
``min_ngram``) and proposes the (at most ``k``) tokens that followed it. A request with a draft
``d_1..d_m`` feeds ``[t, d_1..d_m]`` (``t`` = its last sampled token, not yet in the cache) as
one TARGET_VERIFY chain (``SpecInfo(num_draft_tokens=m + 1, topk=1)``: causal attention over
the page table). With ``p_0..p_m`` the argmax of each fed position's logits, the longest prefix
with ``d_i = p_{i-1}`` is accepted, plus the bonus token ``p_a``: exactly the tokens greedy
decoding would have produced one at a time, so the output is unchanged and only the number of
forwards drops.

``"ngram-tree"`` (``topk = 2``) merges the latest matches with different continuations into a
:class:`DraftTree` verified as a TARGET_VERIFY tree (custom mask: each node sees the prefix
and its own path; positions are depths); the argmax is followed from the root, and an accepted
node off its path position has its KV copied into place (``KVSetup.copy_slots``).

KV of rejected drafts is rewound: the request's length in the page allocator goes back to the
committed tokens (its pages stay with it; the next step overwrites those slots). Requests are
grouped by draft length (TARGET_VERIFY needs a fixed count per request); requests without a
draft, and sampling requests, take an ordinary DECODE forward. Drafts never exceed what the
request may still generate, so the admission-time page reservation always covers them. With
``EngineConfig(cuda_graph=...)`` on, chain groups with the full ``k`` drafts replay captured
TARGET_VERIFY graphs (``runner.run_batch``); shorter groups and trees run eagerly.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Optional, Sequence

import attrs
import torch

from ..batch import ForwardBatch, SpecInfo
from ..types import ForwardMode, SpecDecodeConfig
from .sampler import sample_tokens

__all__ = ["NgramDrafter", "DraftTree", "SpecDecoder", "SpecStats", "make_spec_decoder",
           "SPECULATIVE_MODES"]

log = logging.getLogger(__name__)

#: Values of ``EngineConfig.speculative`` / ``--speculative``.
SPECULATIVE_MODES = ("ngram", "ngram-tree")

#: Draft branches of ``"ngram-tree"``.
TREE_TOPK = 2


@attrs.frozen(kw_only=True)
class NgramDrafter:
    """Prompt-lookup drafts: continue the latest earlier match of the context's tail.

    Attributes:
        max_ngram / min_ngram: tail lengths tried, longest first (≥ 1).
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __attrs_post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 ≤ min_ngram ({self.min_ngram}) ≤ max_ngram "
                             f"({self.max_ngram}).")

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens following ``tokens`` (empty when no tail recurs)."""
        n_tok = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = list(tokens[n_tok - n:])
            # latest start s < n_tok - n whose n tokens equal the tail
            for s in range(n_tok - n - 1, -1, -1):
                if list(tokens[s:s + n]) == tail:
                    return list(tokens[s + n: s + n + k])
        return []

    def propose_many(self, tokens: Sequence[int], k: int, n_chains: int) -> list[list[int]]:
        """Up to ``n_chains`` distinct non-empty continuations (≤ ``k`` tokens each) of the
        context's tail, latest and longest matches first; the first is :meth:`propose`'s."""
        n_tok = len(tokens)
        chains: list = []
        if k <= 0:
            return chains
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = list(tokens[n_tok - n:])
            for s in range(n_tok - n - 1, -1, -1):
                if list(tokens[s:s + n]) == tail:
                    c = list(tokens[s + n: s + n + k])
                    if c and c not in chains:
                        chains.append(c)
                        if len(chains) == n_chains:
                            return chains
        return chains


@attrs.frozen
class DraftTree:
    """A token tree rooted at the request's last token (node 0).

    Attributes:
        tokens: token of every node (``tokens[0]`` = the root).
        parents: parent node of every node (``-1`` for the root); a parent precedes its
            children, and the first chain occupies nodes ``1..len(chain)`` in order.
    """

    tokens: tuple
    parents: tuple

    @classmethod
    def from_chains(cls, root: int, chains: Sequence[Sequence[int]], max_nodes: int
                    ) -> "DraftTree":
        """Merge ``chains`` into a trie of at most ``max_nodes`` draft nodes (+ the root)."""
        tokens, parents = [root], [-1]
        for chain in chains:
            cur = 0
            for tok in chain:
                child = next((i for i in range(1, len(tokens))
                              if parents[i] == cur and tokens[i] == tok), None)
                if child is None:
                    if len(tokens) - 1 == max_nodes:
                        break
                    tokens.append(tok)
                    parents.append(cur)
                    child = len(tokens) - 1
                cur = child
        return cls(tuple(tokens), tuple(parents))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        d = [0] * self.size
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    def ancestor_mask(self) -> torch.Tensor:
        """bool ``[size, size]``: node ``i`` may attend node ``j`` (``j`` on its path)."""
        m = torch.zeros(self.size, self.size, dtype=torch.bool)
        for i in range(self.size):
            j = i
            while j >= 0:
                m[i, j] = True
                j = self.parents[j]
        return m

    def accept(self, preds: Sequence[int]) -> tuple[list[int], int]:
        """Follow the argmax ``preds`` (one per node) from the root: the accepted nodes and
        the bonus token."""
        path, cur = [], 0
        while True:
            nxt = next((i for i in range(1, self.size)
                        if self.parents[i] == cur and self.tokens[i] == preds[cur]), None)
            if nxt is None:
                return path, preds[cur]
            path.append(nxt)
            cur = nxt


@attrs.define
class SpecStats:
    """Counts over the engine's life: verify forwards, drafts proposed and accepted."""

    verify_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    moved: int = 0  # accepted tree nodes whose KV was copied into place

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def _rewind(allocator, row: int, num_tokens: int) -> None:
    """Set ``row``'s held length back to ``num_tokens`` (drops rejected drafts' slots; the
    row keeps its pages). ``PageAllocator`` and ``SWAPageAllocator`` both have ``truncate``."""
    allocator.truncate(row, num_tokens)


class SpecDecoder:
    """Draft + verify decode steps for the engine (``EngineConfig(speculative="ngram")``).

    Args:
        num_draft_tokens: most drafts per request per step (``k`` ≥ 1); the backend is sized
            for ``k + 1`` verified tokens.
        drafter: the proposer (default :class:`NgramDrafter`).
    """

    def __init__(self, num_draft_tokens: int, drafter: Optional[NgramDrafter] = None, *,
                 topk: int = 1):
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={num_draft_tokens!r} must be an int ≥ 1.")
        if not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk={topk!r} must be an int ≥ 1 (1 = chain drafts).")
        self.k = num_draft_tokens
        self.topk = topk
        self.drafter = drafter or NgramDrafter()
        self.stats = SpecStats()

    @property
    def backend_spec(self) -> SpecDecodeConfig:
        """``BackendConfig.spec``: chain verify of up to ``k + 1`` tokens per request."""
        return SpecDecodeConfig(num_steps=1, topk=self.topk, num_draft_tokens=self.k + 1)

    def _draft(self, req, max_context_len: int):
        """A chain (list of tokens) or, with ``topk > 1``, a :class:`DraftTree` (``[]`` when
        nothing is proposed). Drafts never exceed what the request may still generate."""
        if not req.params.greedy:
            return []
        room = min(req.params.max_new_tokens - len(req.output_ids),
                   max_context_len - req.num_tokens) - 1
        budget = min(self.k, room)
        if self.topk == 1:
            return self.drafter.propose(req.tokens, budget)
        chains = self.drafter.propose_many(req.tokens, budget, self.topk)
        tree = DraftTree.from_chains(req.tokens[-1], chains, budget)
        return tree if tree.size > 1 else []

    def decode_step(self, runner, reqs: Sequence) -> list[list[int]]:
        """New tokens (1 … k + 1) of each request in ``reqs``, which are all decoding."""
        out: list = [None] * len(reqs)
        drafts = [self._draft(req, runner.kv.max_context_len) for req in reqs]
        groups: dict = defaultdict(list)
        for i, d in enumerate(drafts):
            groups[d.size - 1 if isinstance(d, DraftTree) else len(d)].append(i)
        plain = groups.pop(0, [])
        if plain:
            rs = [reqs[i] for i in plain]
            logits = runner.forward(ForwardMode.DECODE, [(r, 1) for r in rs])
            for i, tok in zip(plain, sample_tokens(logits, rs)):
                out[i] = [tok]
        verify = self._verify_tree if self.topk > 1 else self._verify
        for _, idx in sorted(groups.items()):
            res = verify(runner, [reqs[i] for i in idx], [drafts[i] for i in idx])
            for i, toks in zip(idx, res):
                out[i] = toks
        return out

    @torch.inference_mode()
    def _verify(self, runner, reqs: Sequence, drafts: Sequence[list]) -> list[list[int]]:
        """One TARGET_VERIFY chain forward over ``reqs`` (all with drafts of one length)."""
        kv, model = runner.kv, runner.model
        q_len = len(drafts[0]) + 1
        ids, slots, seq_lens, starts = [], [], [], []
        for req, draft in zip(reqs, drafts):
            start = req.num_computed
            if start != req.num_tokens - 1:
                raise RuntimeError(f"request {req.rid} is not decoding (computed {start} of "
                                   f"{req.num_tokens} tokens).")
            ids += [req.tokens[-1]] + list(draft)
            slots.append(kv.extend(req, q_len))
            seq_lens.append(start + q_len)
            starts.append(start)
        device = model.device
        batch = ForwardBatch.from_lengths(
            forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=[r.row for r in reqs],
            seq_lens=seq_lens, out_cache_loc=torch.cat(slots),
            spec_info=SpecInfo(num_draft_tokens=q_len, topk=1), device=device)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(device)
        logits = runner.run_batch(batch, input_ids)  # a graph replay when drafts are full
        preds = torch.argmax(logits, dim=-1).view(len(reqs), q_len).tolist()
        results = []
        for req, draft, pred, start in zip(reqs, drafts, preds, starts):
            a = 0
            while a < len(draft) and draft[a] == pred[a]:
                a += 1
            req.num_computed = start + 1 + a
            _rewind(kv.allocator, req.row, req.num_computed)
            results.append(list(draft[:a]) + [pred[a]])
            self.stats.proposed += len(draft)
            self.stats.accepted += a
        self.stats.verify_forwards += 1
        runner.after_step([(r, 0) for r in reqs])
        return results


    @torch.inference_mode()
    def _verify_tree(self, runner, reqs: Sequence, trees: Sequence[DraftTree]
                     ) -> list[list[int]]:
        """One TARGET_VERIFY tree forward (custom mask: each node sees the cached prefix and
        its own path; positions are depths). The accepted path's KV is copied to the slots
        right after the prefix, then the rest is rewound."""
        kv, model, backend = runner.kv, runner.model, runner.backend
        q_len = trees[0].size
        ids, slots, seq_lens, starts, pos, masks = [], [], [], [], [], []
        for req, tree in zip(reqs, trees):
            start = req.num_computed
            if start != req.num_tokens - 1:
                raise RuntimeError(f"request {req.rid} is not decoding (computed {start} of "
                                   f"{req.num_tokens} tokens).")
            ids += list(tree.tokens)
            slots.append(kv.extend(req, q_len))
            seq_lens.append(start + q_len)
            starts.append(start)
            pos += [start + d for d in tree.depths()]
            masks.append(tree.ancestor_mask())
        device = model.device
        batch = ForwardBatch.from_lengths(
            forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=[r.row for r in reqs],
            seq_lens=seq_lens, out_cache_loc=torch.cat(slots),
            spec_info=SpecInfo(num_draft_tokens=q_len, topk=self.topk,
                               custom_mask=torch.stack(masks).reshape(-1).to(device)),
            device=device)
        batch.positions = torch.tensor(pos, dtype=torch.int64).to(device)
        backend.init_forward_metadata(batch)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(device)
        logits = model.forward(input_ids, batch.positions, batch, backend)
        preds = torch.argmax(logits, dim=-1).view(len(reqs), q_len).tolist()
        results, src, dst = [], [], []
        for req, tree, pred, start, sl in zip(reqs, trees, preds, starts, slots):
            path, bonus = tree.accept(pred)
            for j, node in enumerate(path, start=1):
                if node != j:  # node ≥ j always: sources are never overwritten first
                    src.append(sl[node])
                    dst.append(sl[j])
            req.num_computed = start + 1 + len(path)
            _rewind(kv.allocator, req.row, req.num_computed)
            results.append([tree.tokens[i] for i in path] + [bonus])
            self.stats.proposed += tree.size - 1
            self.stats.accepted += len(path)
        if src:
            runner.kv_setup.copy_slots(torch.stack(src), torch.stack(dst))
            self.stats.moved += len(src)
        self.stats.verify_forwards += 1
        runner.after_step([(r, 0) for r in reqs])
        return results


def make_spec_decoder(config) -> Optional[SpecDecoder]:
    """The engine's :class:`SpecDecoder` for ``config.speculative`` (``None`` = off)."""
    mode = config.speculative
    if mode is None:
        return None
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative={mode!r} is not a speculative mode; allowed: "
                         f"{', '.join(SPECULATIVE_MODES)} (or None for plain decoding).")
    return SpecDecoder(config.num_draft_tokens, topk=TREE_TOPK if mode == "ngram-tree" else 1)
