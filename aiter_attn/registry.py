"""Strategy registry: ``(ForwardMode, AttnArch)`` → candidate :class:`StrategyPair`.

A pair names the metadata and execution strategies that serve some modes of one
architecture. Selection walks candidates by priority and keeps a reason for each one it passes
over; an explicit choice that cannot serve raises with all reasons.
"""

from __future__ import annotations

import logging
import numbers
import threading
from typing import TYPE_CHECKING, Callable, Mapping, Optional

import attrs

from .types import AttnArch, BackendConfig, CGSupport, ForwardMode

if TYPE_CHECKING:  # pragma: no cover
    from .contract import ModeContract

__all__ = ["StrategyPair", "StrategyRegistry", "StrategySelectionError", "Cell",
           "register_cells"]

log = logging.getLogger(__name__)


def _modes(value):
    # a str iterates as its letters ('decode' → 'd', 'e', …) and a member does not iterate:
    # name the fix instead of the letter 'd'
    if isinstance(value, (str, ForwardMode)):
        raise TypeError(f"modes={value!r} is a single {type(value).__name__}; pass a set of "
                        f"forward modes, e.g. modes={{{value!r}}}.")
    modes = frozenset(ForwardMode.parse(m) for m in value)
    if not modes:
        raise ValueError("modes is empty: a strategy pair serves at least one forward mode, "
                         "e.g. modes={ForwardMode.DECODE}.")
    return modes


def _contracts(value):
    return {ForwardMode.parse(k): v for k, v in dict(value).items()}


def _check_contracts(inst, attribute, value):
    """Each override is a ModeContract of the mode it is keyed by, for a mode the pair serves:
    ``pair.contract(mode)`` hands it to graph sizing and planning as that mode's contract (a
    DECODE key holding TARGET_VERIFY's contract gave decode batches the draft count)."""
    from .contract import ModeContract

    for mode, contract in value.items():
        if not isinstance(contract, ModeContract):
            raise TypeError(f"StrategyPair({inst.name!r}, contracts={{{mode.name}: "
                            f"{contract!r}}}): a contract is an aiter_attn.contract.ModeContract "
                            "(e.g. aiter_attn.contract.TREE_VERIFY).")
        if contract.mode is not mode:
            raise ValueError(f"StrategyPair({inst.name!r}): contracts[{mode.name}] is the "
                             f"contract of {contract.mode.name}; key each contract by its own "
                             "mode (attrs.evolve(contract_of(mode), ...) makes one).")
        if mode not in inst.modes:
            raise ValueError(f"StrategyPair({inst.name!r}): contracts names {mode.name}, which "
                             f"the pair does not serve (modes: "
                             f"{sorted(m.name for m in inst.modes)}); add it to modes or drop "
                             "the contract.")


def _check_name(inst, attribute, value):
    if not isinstance(value, str) or not value.strip():
        raise TypeError(f"StrategyPair(name={value!r}): name is a non-empty str such as "
                        "'mha.decode' (the name `strategy=` and `aiter-attn info` use).")


def _check_priority(inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"StrategyPair({inst.name!r}, priority={value!r}): priority is an int "
                        "(higher wins among pairs that can serve).")


def _check_cg_support(inst, attribute, value):
    if not isinstance(value, CGSupport):
        raise TypeError(f"StrategyPair({inst.name!r}, cg_support={value!r}): cg_support is a "
                        "CGSupport (NEVER, UNIFORM_SINGLE_TOKEN_DECODE, UNIFORM_BATCH, ALWAYS).")


@attrs.frozen(kw_only=True)
class StrategyPair:
    """A registered (MetadataStrategy, ExecutionStrategy) pair.

    Attributes:
        name: unique name (``"mha.paged"``).
        arch: the architecture served.
        modes: forward modes served.
        metadata: ``factory(ctx: StrategyContext) -> MetadataStrategy``.
        execution: ``factory(ctx: StrategyContext) -> ExecutionStrategy``.
        priority: higher wins among pairs that can serve.
        cg_support: CUDA-graph support of the pair.
        supports: optional ``(config) -> reason | None`` check.
        description: one line for ``aiter-attn info``.
        kernel_op: the kernel op its execution strategy launches (for reports and planning).
        contracts: per-mode :class:`~aiter_attn.contract.ModeContract` overrides (e.g. a
            tree-verify pair always plans a mask); other modes get the default contract.
    """

    name: str = attrs.field(validator=_check_name)
    arch: AttnArch = attrs.field(converter=AttnArch.parse)
    modes: frozenset = attrs.field(converter=_modes)
    metadata: Callable = attrs.field(eq=False)
    execution: Callable = attrs.field(eq=False)
    priority: int = attrs.field(default=0, validator=_check_priority)
    cg_support: CGSupport = attrs.field(default=CGSupport.NEVER, validator=_check_cg_support)
    supports: Optional[Callable] = attrs.field(default=None, eq=False)
    description: str = ""
    kernel_op: str = "paged_attention"
    contracts: Mapping = attrs.field(factory=dict, eq=False, converter=_contracts,
                                     validator=_check_contracts)

    def contract(self, mode) -> "ModeContract":
        """The mode contract this pair serves ``mode`` under (tokens per request and their
        slack, mask layout, what capture needs)."""
        from .contract import contract_of

        mode = ForwardMode.parse(mode)
        return self.contracts.get(mode) or contract_of(mode)

    def reject_reason(self, mode: ForwardMode, arch: AttnArch, config: Optional[BackendConfig]):
        if arch != self.arch:
            return f"serves {self.arch.name}, not {arch.name}"
        if mode not in self.modes:
            return f"does not serve {mode.name} (serves {sorted(m.name for m in self.modes)})"
        if self.supports is not None and config is not None:
            try:
                reason = self.supports(config)
            except Exception as exc:  # one pair's broken check must not stop selection
                log.warning("strategy %s: supports() raised", self.name, exc_info=True)
                return (f"supports() raised {type(exc).__name__}: {exc}; it must return a "
                        "reason (str) or None for every config")
            if reason is not None and not isinstance(reason, str):
                return (f"supports() returned {reason!r}; it must return a reason (str) when "
                        "the pair cannot serve the config and None when it can")
            return reason
        return None


@attrs.frozen(kw_only=True)
class Cell:
    """One row of a family's declarative table of cells: the pair serving ``modes`` (the
    family's architecture, execution strategy and kernel op come from
    :func:`register_cells`)."""

    name: str
    modes: frozenset = attrs.field(converter=_modes)
    metadata: Callable = attrs.field(eq=False)
    cg_support: CGSupport = CGSupport.NEVER
    description: str = ""
    supports: Optional[Callable] = attrs.field(default=None, eq=False)
    priority: int = 10
    contracts: Mapping = attrs.field(factory=dict, eq=False)


def register_cells(register, *, arch, execution, cells, kernel_op: str = "paged_attention"):
    """Register one family's table: a :class:`StrategyPair` per :class:`Cell` (the one
    registration style every family uses)."""
    for c in cells:
        register(StrategyPair(
            name=c.name, arch=arch, modes=c.modes, metadata=c.metadata, execution=execution,
            priority=c.priority, cg_support=c.cg_support, supports=c.supports,
            description=c.description, kernel_op=kernel_op, contracts=c.contracts))


class StrategySelectionError(ValueError):
    """No strategy pair can serve a (mode, arch); the message lists every reason."""


class StrategyRegistry:
    def __init__(self):
        self._pairs: dict[str, tuple[StrategyPair, str]] = {}
        self._lock = threading.Lock()

    def register(self, pair: StrategyPair, *, replace: bool = False, source: str = "builtin"):
        if not isinstance(pair, StrategyPair):
            raise TypeError(f"register() takes a StrategyPair, got {type(pair).__name__}.")
        with self._lock:
            if pair.name in self._pairs and not replace:
                raise ValueError(
                    f"strategy {pair.name!r} is already registered (by "
                    f"{self._pairs[pair.name][1]}); pass replace=True to override it."
                )
            self._pairs[pair.name] = (pair, source)
        return pair

    def pairs(self) -> list[StrategyPair]:
        return sorted((p for p, _ in self._pairs.values()), key=lambda p: (-p.priority, p.name))

    def source_of(self, name: str) -> str:
        return self._pairs[name][1]

    def candidates(self, mode, arch, config=None):
        """``(chosen_or_None, [(name, reason), …])`` without raising."""
        mode, arch = ForwardMode.parse(mode), AttnArch.parse(arch)
        rejected = []
        for pair in self.pairs():
            reason = pair.reject_reason(mode, arch, config)
            if reason is None:
                return pair, rejected
            rejected.append((pair.name, reason))
        return None, rejected

    def select(self, mode, arch, config: Optional[BackendConfig] = None, name: Optional[str] = None):
        """The best pair for ``(mode, arch)``; ``name`` forces one.

        Raises :class:`StrategySelectionError` naming every candidate's reason.
        """
        mode, arch = ForwardMode.parse(mode), AttnArch.parse(arch)
        if name is not None:
            if name not in self._pairs:
                raise StrategySelectionError(
                    f"strategy={name!r} is not registered; registered: {sorted(self._pairs)}."
                )
            pair = self._pairs[name][0]
            reason = pair.reject_reason(mode, arch, config)
            if reason is not None:
                raise StrategySelectionError(
                    f"strategy {name!r} cannot serve {mode.name} × {arch.name}: {reason}."
                )
            return pair
        pair, rejected = self.candidates(mode, arch, config)
        if pair is None:
            detail = "; ".join(f"{n}: {r}" for n, r in rejected) or "none registered"
            raise StrategySelectionError(
                f"no strategy serves {mode.name} × {arch.name}: {detail}. "
                "Install the plugin for this architecture or choose another."
            )
        return pair
