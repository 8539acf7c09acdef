"""Testing support shipped with the library: oracles, scenario builders, hypothesis strategies,
invariant checkers and the conformance suite for plugin authors."""

from .oracle import dense_attention
from .scenario import PagedScenario

__all__ = ["dense_attention", "PagedScenario"]
