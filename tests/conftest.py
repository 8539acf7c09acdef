import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=30, deadline=None)
settings.register_profile("dev", max_examples=15, deadline=None)
settings.register_profile("deep", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With ``AITER_ATTN_FAIL_LOG=path``, each failure's report is appended to ``path`` the
    moment it happens: a time-capped GPU run (``scripts/gpu_session.sh``) that is killed
    before pytest's summary still leaves every failure's reason behind."""
    path = os.environ.get("AITER_ATTN_FAIL_LOG")
    if not path or not report.failed or hasattr(report, "node"):  # xdist relays: skip copies
        return
    with open(path, "a") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


#: ``AITER_ATTN_TEST_MLA_DEFAULTS``'s keys: the MLA options whose defaults a run may change
_MLA_DEFAULT_NAMES = {"kv_desc": "MLA_KV_DESCRIPTORS", "lazy_rescale": "MLA_LAZY_RESCALE",
                      "half_partials": "MLA_HALF_PARTIALS", "qk_split": "MLA_QK_SPLIT",
                      "fused_merge": "MLA_FUSED_MERGE", "balanced": "MLA_BALANCED",
                      "narrow": "MLA_NARROW", "narrow_pdl": "MLA_NARROW_PDL"}


def mla_test_defaults(raw: str) -> dict:
    """``{constant name: value}`` from the JSON of ``AITER_ATTN_TEST_MLA_DEFAULTS`` (e.g.
    ``{"kv_desc": true, "qk_split": 2}``); an unknown key is refused with the known ones."""
    import json

    opts = json.loads(raw)
    unknown = sorted(set(opts) - set(_MLA_DEFAULT_NAMES))
    if unknown:
        raise ValueError(f"AITER_ATTN_TEST_MLA_DEFAULTS: unknown option(s) {unknown}; "
                         f"allowed: {sorted(_MLA_DEFAULT_NAMES)}.")
    return {_MLA_DEFAULT_NAMES[k]: v for k, v in opts.items()}


def pytest_configure(config):
    """``AITER_ATTN_TEST_MLA_DEFAULTS='{"kv_desc": true, ...}'`` runs the whole suite with
    those MLA kernel options as the defaults (a GPU session checks candidate defaults with
    every MLA test before the library flips them); unset, nothing changes."""
    raw = os.environ.get("AITER_ATTN_TEST_MLA_DEFAULTS")
    if not raw:
        return
    from aiter_attn.kernels.triton import mla

    for name, value in mla_test_defaults(raw).items():
        setattr(mla, name, value)


@pytest.fixture
def triton_mla_kernel(monkeypatch):
    """The Triton MLA kernel for 16-head steps where the narrow Gluon kernel is the default
    (sm_90): the test files of the Triton kernel's own options (``qk_split``, ``kv_desc``,
    ``half_partials``, ``lazy_rescale``, ``fused_merge``) take this, so that on an H100/H200
    their options are not silently ignored by the narrow kernel. A test that passes
    ``narrow=True`` still gets the narrow kernel."""
    from aiter_attn.kernels.triton import mla

    monkeypatch.setattr(mla, "MLA_NARROW", False)
