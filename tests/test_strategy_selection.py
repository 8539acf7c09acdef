"""Strategy pairs from plugins: a ``supports`` check that returns a bool or raises is a
reason naming what is wrong (never a pair that is silently always rejected, never a crash of
every selection); a priority, name or graph support that would break sorting or the cell's
graph support is refused when the pair is made."""

import logging

import pytest

from aiter_attn import AttnArch, BackendConfig, ForwardMode, StrategyPair
from aiter_attn.registry import StrategyRegistry, StrategySelectionError
from aiter_attn.types import CGSupport


def _pair(name, **kw):
    return StrategyPair(name=name, arch=AttnArch.MHA, modes={ForwardMode.DECODE},
                        metadata=object, execution=object, **kw)


@pytest.mark.parametrize("answer", [True, False, 0])
def test_supports_must_return_a_reason_or_none(answer):
    """``supports=lambda cfg: cfg.page_size == 16`` is neither "serves" nor the reason
    ``True``: the reason says what the check must return."""
    reg = StrategyRegistry()
    reg.register(_pair("fallback"))
    reg.register(_pair("boolish", supports=lambda cfg: answer, priority=5))
    cfg = BackendConfig(page_size=16)
    with pytest.raises(StrategySelectionError,
                       match=f"supports\\(\\) returned {answer!r}; it must return a reason"):
        reg.select("decode", "mha", cfg, name="boolish")
    pair, rejected = reg.candidates("decode", "mha", cfg)
    assert pair.name == "fallback" and rejected[0][0] == "boolish"


def test_supports_that_raises_is_a_rejection_reason(caplog):
    reg = StrategyRegistry()
    reg.register(_pair("fallback"))
    reg.register(_pair("broken", supports=lambda cfg: cfg.no_such_field, priority=5))
    with caplog.at_level(logging.WARNING, logger="aiter_attn.registry"):
        assert reg.select("decode", "mha", BackendConfig()).name == "fallback"
    assert any("supports() raised" in r.getMessage() for r in caplog.records)
    with pytest.raises(StrategySelectionError, match="supports\\(\\) raised AttributeError"):
        reg.select("decode", "mha", BackendConfig(), name="broken")


@pytest.mark.parametrize("kw,match", [
    pytest.param(dict(priority=None), r"priority=None\): priority is an int", id="priority-none"),
    pytest.param(dict(priority="5"), r"priority='5'\): priority is an int", id="priority-str"),
    pytest.param(dict(cg_support="always"), r"cg_support='always'\): cg_support is a CGSupport",
                 id="cg-str"),
])
def test_unusable_pair_fields_are_refused(kw, match):
    with pytest.raises(TypeError, match=match):
        _pair("bad", **kw)


def test_pair_name_must_be_a_non_empty_str():
    with pytest.raises(TypeError, match=r"name=''\): name is a non-empty str"):
        _pair("")
    assert _pair("ok", priority=3, cg_support=CGSupport.ALWAYS).priority == 3
