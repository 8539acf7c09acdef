"""The launch options the H200 calls time are spelt right, before any device time is spent.

``TUNING_OVERRIDES`` is read with ``.get``: a misspelt key is ignored without a word, and a
benchmark would time the default under the option's label. So every variant of
``benchmarks/bench_variants.py``, every ``--variants`` / ``--overrides`` /
``--mla-variants`` / ``--tunings`` value in ``scripts/gpu_session.sh`` and the MLA variants
of ``bench_attention.py`` must name options the kernels know, and a wrong one must stop the
benchmark before it starts.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from aiter_attn.kernels.triton._launch_config import OVERRIDE_KEYS, check_overrides

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCH = os.path.join(_ROOT, "benchmarks")


def _bench(name):
    sys.path.insert(0, _BENCH)
    try:
        return __import__(name)
    finally:
        sys.path.remove(_BENCH)


def _session_text() -> str:
    """The script with continued lines joined and its upper-case shell variables (``A=…``,
    used inside ``--variants`` values) substituted; a variable defined twice must keep its
    value."""
    with open(os.path.join(_ROOT, "scripts", "gpu_session.sh")) as f:
        text = f.read().replace("\\\n", "")  # join continued lines
    defs: dict = {}
    for name, value in re.findall(r"^\s*([A-Z][A-Z0-9]*)=(\S+)$", text, re.M):
        assert defs.setdefault(name, value) == value, (name, value, defs[name])
    for name, value in defs.items():
        text = re.sub(r"\$" + name + r"\b", value, text)
    return text


def test_every_variant_names_known_overrides():
    bv = _bench("bench_variants")
    for name, ov in bv.OVERRIDES.items():
        check_overrides(ov, f"bench_variants.OVERRIDES[{name!r}]")
        assert bv.variant_overrides(name) == ov
        assert bv.variant_overrides("planned-" + name) == ov


def test_session_variants_overrides_and_mla_variants_resolve():
    text = _session_text()
    bv = _bench("bench_variants")
    lines = text.splitlines()
    variants = [v for line in lines if "bench_variants.py" in line
                for m in re.finditer(r"--variants\s+(\S+)", line) for v in m[1].split(",")]
    assert "planned-chunk0-ahead-bn64-s4" in variants  # the parse found the new calls
    for v in variants:
        bv.variant_overrides(v)
    gd = _bench("bench_gluon_decode")
    gluon = [v for line in lines if "bench_gluon_decode.py" in line
             for m in re.finditer(r"--variants\s+(\S+)", line) for v in m[1].split(",")]
    assert "bn64.st4.nc2.r128.s0" in gluon
    for m in re.finditer(r"for V in ([^;]+); do\s+gluon_variant", text):
        gluon += m[1].split()  # the names a loop hands to gluon_variant one at a time
    for v in gluon:
        if v not in ("default", '"$1"'):  # "$1": gluon_variant's argument, checked below
            gd.parse_variant(v)
    overrides = re.findall(r"'(\{[^']*\})'", text)
    assert '{"v_pairs": true}' in overrides
    for ov in overrides:
        check_overrides(json.loads(ov), "gpu_session.sh")
    ba = _bench("bench_attention")
    # a list may be a default: ${MLA_VARIANTS:-a,b}
    mla = [v for m in re.finditer(r"--mla-variants\s+(?:\$\{[A-Z_]+:-)?([^\s}]+)", text)
           for v in m[1].split(",") if v != '"$2"']  # "$2": mla16_rows' argument, below
    # the lists handed to mla16_rows: mla16_rows NAME "${VARIANTS:-a,b}"
    rows = [v for m in re.finditer(r'mla16_rows\s+\S+\s+"\$\{[A-Z_]+:-([^}]+)\}"', text)
            for v in m[1].split(",")]
    assert "narrow-early" in rows, rows  # the parse found them
    mla += rows
    assert mla and set(mla) <= set(ba.MLA_VARIANTS), mla
    from aiter_attn.kernels.triton.mla import TUNING_KEYS

    for name, tuning in ba.MLA_VARIANTS.items():
        assert set(tuning) <= TUNING_KEYS, (name, sorted(set(tuning) - TUNING_KEYS))
    tunings = re.findall(r"--tunings\s+'([^']*)'", text)
    assert tunings, "no mla_time_split.py --tunings call found"
    for t in tunings:
        for tuning in json.loads(t):
            assert set(tuning) <= TUNING_KEYS, (t, sorted(set(tuning) - TUNING_KEYS))
    configs = re.findall(r"--mla-configs\s+(\S+)", text)
    assert configs, "no --mla-configs call found"
    for c in configs:
        ba.mla_configs(c)


def test_unknown_names_and_keys_are_refused_with_the_allowed_ones(tmp_path):
    bv = _bench("bench_variants")
    with pytest.raises(ValueError, match="unknown variant 'planned-chunk0-ahaed'"):
        bv.variant_overrides("planned-chunk0-ahaed")
    with pytest.raises(ValueError, match="unknown variant 'prefetchh'"):
        bv.variant_overrides("prefetchh")
    with pytest.raises(ValueError, match=r"unknown launch override\(s\) \['page_ahaed'\]"):
        check_overrides({"page_ahaed": True}, "test")
    with pytest.raises(ValueError, match=r"unknown launch override\(s\) \['page_ahaed'\]"):
        bv.variant_overrides("planned-ov:page_ahaed=true")
    with pytest.raises(ValueError, match="write key=value"):
        bv.variant_overrides("planned-ov:num_splits")
    assert bv.variant_overrides("planned-ov:num_splits=48+page_ahead=true") == {
        "num_splits": 48, "page_ahead": True}
    ba = _bench("bench_attention")
    with pytest.raises(ValueError, match="--overrides: unknown launch override"):
        ba.main(["--overrides", '{"v_pair": true}', "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # refused before it made anything
    with pytest.raises(ValueError, match="block_h/block_n/warps/stages/splits"):
        ba.mla_configs("16/32/4")
    assert ba.mla_configs("16/32/4/3/x2,16/16/4/4/6/16") == [(16, 32, 4, 3, "x2"),
                                                              (16, 16, 4, 4, 6, 16)]
    assert {"v_pairs", "prefetch_pages", "page_ahead"} <= OVERRIDE_KEYS


def test_the_kernels_read_no_key_outside_the_list():
    """Every ``TUNING_OVERRIDES.get("…")`` / ``ov.get("…")`` / ``"…" in ov`` in the Triton
    kernels' host code names a key of :data:`OVERRIDE_KEYS` (a new option must be listed)."""
    folder = os.path.join(_ROOT, "aiter_attn", "kernels", "triton")
    read = set()
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                src = f.read()
            read |= set(re.findall(r'(?:TUNING_OVERRIDES|\bov)\.get\("(\w+)"', src))
            read |= set(re.findall(r'"(\w+)" (?:not )?in ov\b', src))
    assert read and read <= OVERRIDE_KEYS, sorted(read - OVERRIDE_KEYS)
