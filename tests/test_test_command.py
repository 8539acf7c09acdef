"""The README's test command gets what its tests need by itself (issue 11, item 1).

``.ci/run`` must run exactly the README's test command, and that command
(``scripts/test.sh``) fetches the amd-aiter wheel the contract test reads
(``scripts/fetch_test_deps.sh``): once, idempotently, loudly when it cannot. The behavioural
tests run the real scripts in a scratch copy of the repository layout with a tiny local wheel
and ``PIP_NO_INDEX=1``, so they never touch the network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WHEEL = "amd_aiter-0.1.7.post2.dev18-py3-none-any.whl"
SGLANG_WHEEL = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"

#: the probe suite run by the scratch copy's test.sh: passes only if the wheel is in .whl/
PROBE = '''
from pathlib import Path
def test_wheel_was_fetched():
    whl = sorted((Path(__file__).resolve().parents[1] / ".whl").glob("amd_aiter-*.whl"))
    assert whl, "no amd-aiter wheel in .whl/"
'''


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no ```bash block with the set-up and test commands"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]


def _last_command(script: Path) -> str:
    lines = [ln.strip() for ln in script.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")][-1]


def test_ci_runs_exactly_the_readmes_test_command():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert _last_command(REPO / ".ci" / "run") == commands[1] == "./scripts/test.sh"


def test_ci_does_not_fetch_test_deps_itself():
    """The fetch lives in the test command; a second copy in .ci/run would hide its absence."""
    assert "pip download" not in (REPO / ".ci" / "run").read_text()


def _tiny_wheel(directory: Path, version: str = "0.0.1", dist: str = "amd-aiter") -> Path:
    stem = dist.replace("-", "_")
    path = directory / f"{stem}-{version}-py3-none-any.whl"
    info = f"{stem}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA",
                   f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def scratch(tmp_path):
    """A copy of the repository's scripts with a probe suite in tests/."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("test.sh", "fetch_test_deps.sh"):
        shutil.copy2(REPO / "scripts" / name, root / "scripts" / name)
    (root / "tests").mkdir()
    (root / "tests" / "test_probe.py").write_text(PROBE)
    return root


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("AITER_SPEC", "AITER_ATTN_AITER_WHEEL", "SGLANG_SPEC",
                        "AITER_ATTN_SGLANG_WHEEL", "PYTEST_ADDOPTS",
                        "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")}
    env["PIP_NO_INDEX"] = "1"          # never reach the network from a test
    env["PYTEST_WORKERS"] = "0"
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def _run(cmd, root, env):
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_test_command_fetches_the_wheel_before_the_tests(scratch, tmp_path):
    wheel = _tiny_wheel(tmp_path)
    r = _run(["./scripts/test.sh"], scratch, _env(AITER_SPEC=str(wheel)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (scratch / ".whl" / wheel.name).is_file()


def test_fetch_is_idempotent_when_the_wheel_is_there(scratch):
    """The default wheels already in .whl/: no download is tried (the index is off here)."""
    (scratch / ".whl").mkdir()
    (scratch / ".whl" / DEFAULT_WHEEL).write_bytes(b"placeholder")
    (scratch / ".whl" / SGLANG_WHEEL).write_bytes(b"placeholder")
    r = _run(["./scripts/fetch_test_deps.sh"], scratch, _env())
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (scratch / ".whl" / DEFAULT_WHEEL).read_bytes() == b"placeholder"


def test_fetch_honours_an_aiter_spec_override(scratch, tmp_path):
    """AITER_SPEC naming another release fetches it even when the default wheel is present."""
    (scratch / ".whl").mkdir()
    (scratch / ".whl" / DEFAULT_WHEEL).write_bytes(b"placeholder")
    wheel = _tiny_wheel(tmp_path, "9.9.9")
    r = _run(["./scripts/fetch_test_deps.sh"], scratch, _env(AITER_SPEC=str(wheel)))
    assert r.returncode == 0, r.stderr
    assert (scratch / ".whl" / wheel.name).is_file()


def test_an_impossible_download_is_loud_and_the_needing_test_fails(scratch):
    r = _run(["./scripts/test.sh"], scratch, _env(AITER_SPEC="amd-aiter==0.0.0.dev0"))
    assert "ERROR: could not download amd-aiter==0.0.0.dev0" in r.stderr
    assert "test_aiter_contract.py will FAIL" in r.stderr
    # the suite still ran, and the test that needs the wheel failed (it never skips)
    assert r.returncode != 0
    assert "1 failed" in r.stdout, r.stdout


def test_the_sglang_wheel_is_fetched_too(scratch, tmp_path):
    """The SGLang contract tests' wheel: fetched when absent (SGLANG_SPEC here points at a
    local stand-in), left alone when present or when AITER_ATTN_SGLANG_WHEEL points elsewhere,
    and a failed download is loud and names the tests that will fail."""
    (scratch / ".whl").mkdir()
    (scratch / ".whl" / DEFAULT_WHEEL).write_bytes(b"placeholder")
    wheel = _tiny_wheel(tmp_path, "0.5.23", dist="sglang")
    r = _run(["./scripts/fetch_test_deps.sh"], scratch, _env(SGLANG_SPEC=str(wheel)))
    assert r.returncode == 0, r.stderr
    assert (scratch / ".whl" / wheel.name).is_file()
    r = _run(["./scripts/fetch_test_deps.sh"], scratch, _env())  # sglang==0.5.23 is there now
    assert r.returncode == 0 and r.stderr == "", r.stderr
    (scratch / ".whl" / wheel.name).unlink()
    r = _run(["./scripts/fetch_test_deps.sh"], scratch,
             _env(AITER_ATTN_SGLANG_WHEEL=str(tmp_path)))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = _run(["./scripts/fetch_test_deps.sh"], scratch, _env(SGLANG_SPEC="sglang==0.0.0.dev0"))
    assert r.returncode == 0
    assert "ERROR: could not download sglang==0.0.0.dev0" in r.stderr
    assert "tests/test_sglang_*.py will FAIL" in r.stderr
