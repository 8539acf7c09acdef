"""The mode contract: what a forward mode promises about its batches, as data.

A :class:`ModeContract` says how many query tokens each request brings (one, the draft count,
or ragged), how far KV may run past ``max_context_len`` (the draft slack of speculative
modes), which mask layout is planned, and what CUDA-graph support capturing the mode needs.
:data:`MODE_CONTRACTS` holds the default contract of every mode; a
:class:`~aiter_attn.registry.StrategyPair` carries its own (``pair.contract(mode)``, the
default unless the pair overrides it: tree-verify pairs plan a mask). ``graph/``,
``batch.py`` and ``aiter-attn info`` read these; nothing else derives them.
"""

from __future__ import annotations

from typing import Optional

import attrs

from .types import BackendConfig, CGSupport, ForwardMode

__all__ = ["ModeContract", "MODE_CONTRACTS", "CHAIN_VERIFY", "TREE_VERIFY", "contract_of",
           "capturable_modes"]

#: query tokens per request
ONE, DRAFT, RAGGED = "one", "draft", "ragged"
#: mask layouts: none; a tree mask when ``config.spec.topk > 1``; always a tree mask
NO_MASK, TREE_IF_TOPK, TREE = "none", "tree_if_topk", "tree"


@attrs.frozen(kw_only=True)
class ModeContract:
    """What one forward mode's batches look like.

    Attributes:
        tokens: query tokens per request: ``"one"``, ``"draft"``
            (``spec.num_draft_tokens``, uniform) or ``"ragged"`` (``extend_seq_lens``).
        kv_slack: KV may hold this step's draft tokens beyond ``max_context_len``.
        mask: ``"none"``, ``"tree_if_topk"`` (a tree mask when ``spec.topk > 1``) or
            ``"tree"``.
        capture_needs: the CUDA-graph support capturing this mode needs; ``None``: the mode
            is never captured (ragged query lengths).
        graph_mode: the mode whose graphs serve it (IDLE replays DECODE's).
    """

    mode: ForwardMode
    tokens: str = attrs.field(validator=attrs.validators.in_((ONE, DRAFT, RAGGED)))
    kv_slack: bool = False
    mask: str = attrs.field(default=NO_MASK,
                            validator=attrs.validators.in_((NO_MASK, TREE_IF_TOPK, TREE)))
    capture_needs: Optional[CGSupport] = None
    graph_mode: Optional[ForwardMode] = None

    @property
    def uniform(self) -> bool:
        """Every request brings the same number of query tokens."""
        return self.tokens != RAGGED

    @property
    def capturable(self) -> bool:
        return self.capture_needs is not None

    def q_len(self, config: Optional[BackendConfig] = None, spec_info=None) -> Optional[int]:
        """Query tokens per request (``None`` when ragged). ``"draft"`` reads ``spec_info``
        when given, else ``config.spec`` (raising if neither has it)."""
        if self.tokens == ONE:
            return 1
        if self.tokens == RAGGED:
            return None
        if spec_info is not None:
            return spec_info.num_draft_tokens
        if config is None or config.spec is None:
            raise ValueError(
                f"forward_mode={self.mode.name} needs speculative settings; set "
                "BackendConfig(spec=SpecDecodeConfig(num_draft_tokens=...)).")
        return config.spec.num_draft_tokens

    def slack(self, config: BackendConfig) -> int:
        """KV tokens a request may hold beyond ``max_context_len`` in this mode."""
        return self.q_len(config) if self.kv_slack else 0

    def has_mask(self, config: Optional[BackendConfig] = None, topk: Optional[int] = None) -> bool:
        """Whether this mode's batches carry a custom (tree) mask."""
        if self.mask == NO_MASK:
            return False
        if self.mask == TREE:
            return True
        if topk is None:
            topk = config.spec.topk if config is not None and config.spec is not None else 1
        return topk > 1


def _c(mode, tokens, **kw) -> ModeContract:
    return ModeContract(mode=mode, tokens=tokens, **kw)


_DECODE = CGSupport.UNIFORM_SINGLE_TOKEN_DECODE
#: The default contract of every forward mode.
MODE_CONTRACTS = {
    ForwardMode.DECODE: _c(ForwardMode.DECODE, ONE, capture_needs=_DECODE,
                           graph_mode=ForwardMode.DECODE),
    ForwardMode.IDLE: _c(ForwardMode.IDLE, ONE, capture_needs=_DECODE,
                         graph_mode=ForwardMode.DECODE),
    ForwardMode.EXTEND: _c(ForwardMode.EXTEND, RAGGED),
    ForwardMode.DRAFT_EXTEND: _c(ForwardMode.DRAFT_EXTEND, RAGGED),
    ForwardMode.TARGET_VERIFY: _c(ForwardMode.TARGET_VERIFY, DRAFT, kv_slack=True,
                                  mask=TREE_IF_TOPK, capture_needs=CGSupport.UNIFORM_BATCH,
                                  graph_mode=ForwardMode.TARGET_VERIFY),
    ForwardMode.DRAFT_EXTEND_V2: _c(ForwardMode.DRAFT_EXTEND_V2, DRAFT, kv_slack=True,
                                    capture_needs=CGSupport.UNIFORM_BATCH,
                                    graph_mode=ForwardMode.DRAFT_EXTEND_V2),
}


#: TARGET_VERIFY as a chain pair serves it (``spec.topk == 1``): causal, no mask.
CHAIN_VERIFY = attrs.evolve(MODE_CONTRACTS[ForwardMode.TARGET_VERIFY], mask=NO_MASK)
#: TARGET_VERIFY as a tree pair serves it (``spec.topk > 1``): always a tree mask.
TREE_VERIFY = attrs.evolve(MODE_CONTRACTS[ForwardMode.TARGET_VERIFY], mask=TREE)


def contract_of(mode) -> ModeContract:
    """The default contract of ``mode``."""
    return MODE_CONTRACTS[ForwardMode.parse(mode)]


def capturable_modes() -> tuple:
    """Modes with their own graphs (IDLE replays DECODE's), in declaration order."""
    return tuple(m for m, c in MODE_CONTRACTS.items() if c.capturable and c.graph_mode == m)
