"""Issue 16, item 5: each feature beyond the anchors is in the README's table, in
``docs/modes.md`` and in ``aiter-attn info``; ``aiter-attn generate``'s options (
``--deterministic`` among them) are documented in ``docs/engine.md``."""

import argparse
import json
import pathlib
import re

import pytest

from aiter_attn.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: feature → (a phrase of its README row, what docs/modes.md and `aiter-attn info` must say)
FEATURES = {
    "fp8 e5m2": ("fp8 e5m2 KV cache", "e5m2"),
    "per-(token, head) scales": ("per-(token, head) fp8 KV scales", "per_token_head"),
    "cascade": ("cascade (shared-prefix) attention", "cascade_min_shared_tokens"),
    "batch-invariant": ("batch-invariant (deterministic) attention", "batch_invariant=True"),
    "mixed steps": ("mixed prefill + decode in one forward", "mixed step"),
    "hopper kernels": ("warp-specialised Hopper kernels (Gluon)", "Warp-specialised Hopper"),
}


def _beyond_the_anchors() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Beyond the anchors", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ")][2:]


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_readme_row_with_existing_tests(feature):
    """One row per feature, and the tests it names exist."""
    phrase, _ = FEATURES[feature]
    rows = [r for r in _beyond_the_anchors() if phrase in r]
    assert len(rows) == 1, f"README 'Beyond the anchors' has no row for {feature!r}"
    named = re.findall(r"`(tests/[^`]+)`", rows[0].split("|")[-2])
    assert named, rows[0]
    for pattern in named:
        assert list(ROOT.glob(pattern)), f"{pattern} (README row {feature!r}) matches no file"


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_modes_md_and_info_say_it(feature, capsys):
    _, needle = FEATURES[feature]
    assert needle in (ROOT / "docs" / "modes.md").read_text()
    assert main(["info", "--json"]) == 0
    assert needle in capsys.readouterr().out
    assert main(["info"]) == 0
    assert needle in capsys.readouterr().out


def test_info_reports_batch_invariant_mode(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "--deterministic" in info["batch_invariant"]
    assert "bitwise" in info["batch_invariant"]


def test_every_generate_option_is_documented():
    """``docs/engine.md`` names every option of ``aiter-attn generate``."""
    from aiter_attn.commands.generate import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    parser = sub.choices["generate"]
    text = (ROOT / "docs" / "engine.md").read_text()
    missing = [opt for action in parser._actions for opt in action.option_strings
               if opt.startswith("--") and opt != "--help"
               and not re.search(re.escape(opt) + r"(?![\w-])", text)]
    assert not missing, f"docs/engine.md does not document {missing}"
