"""Install the plugin packages of ``tests/plugins/`` into a temporary folder, the way a user's
``pip install`` would (dist-info with the ``aiter_attn`` entry points), without touching the
environment: the folder only becomes visible when a test puts it on ``sys.path``."""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["PLUGINS_DIR", "install_plugins", "shared_site"]

PLUGINS_DIR = Path(__file__).resolve().parent
PACKAGES = ("aiter-attn-example-plugin", "aiter-attn-test-plugins")


def install_plugins(root: Path) -> Path:
    """``pip install --target root/site`` both packages (offline, from copies so the source
    tree gets no build artefacts); returns the site folder."""
    src, site = root / "src", root / "site"
    for name in PACKAGES:
        shutil.copytree(PLUGINS_DIR / name, src / name,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(site),
         *(str(src / n) for n in PACKAGES)],
        check=True,
    )
    return site


@functools.lru_cache(maxsize=None)
def shared_site() -> Path:
    """One installation per test process (removed at exit), shared by the test modules."""
    root = Path(tempfile.mkdtemp(prefix="aiter_attn_plugins_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return install_plugins(root)
