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
