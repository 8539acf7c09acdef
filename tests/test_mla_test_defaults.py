"""``AITER_ATTN_TEST_MLA_DEFAULTS`` (tests/conftest.py): a run of the suite with candidate MLA
defaults really plans with them, and a misspelt option stops it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import mla_test_defaults

ROOT = Path(__file__).resolve().parents[1]


def test_names_map_to_the_kernel_module_constants():
    from aiter_attn.kernels.triton import mla

    got = mla_test_defaults('{"kv_desc": true, "qk_split": 2, "half_partials": true, '
                            '"lazy_rescale": true, "fused_merge": false}')
    assert got == {"MLA_KV_DESCRIPTORS": True, "MLA_QK_SPLIT": 2, "MLA_HALF_PARTIALS": True,
                   "MLA_LAZY_RESCALE": True, "MLA_FUSED_MERGE": False}
    assert all(hasattr(mla, name) for name in got)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['kv_descs'\].*kv_desc"):
        mla_test_defaults('{"kv_descs": true}')


def test_a_run_with_candidate_defaults_plans_with_them(tmp_path):
    """A child pytest run under the variable: the plan of a plain call has the options."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import torch\n"
        "from tests.test_triton_mla import MLACase\n"
        "from aiter_attn.kernels.base import _adhoc_metadata\n"
        "from aiter_attn.kernels.triton.mla import TritonMLA, mla_request\n"
        "def test_probe():\n"
        "    case = MLACase([1, 1], [40, 70], page=16, dtype=torch.float16)\n"
        "    q, kv = case.q, case.kv_cache\n"
        "    kw = case.kwargs()\n"
        "    k = TritonMLA(mla_request(q, kv, case.rank), {'num_kv_splits': 2})\n"
        "    md = _adhoc_metadata(q, kv, kw['cu_seqlens_q'], kw['seqused_k'],\n"
        "                         kw['block_table'], None, None, None, None, 'probe')\n"
        "    cfg = k.plan(md).cfg_kw\n"
        "    assert cfg['QK_SPLIT'] == 2 and cfg['LAZY_RESCALE'] is True, cfg\n")
    env = dict(os.environ, AITER_ATTN_TEST_MLA_DEFAULTS=json.dumps(
        {"qk_split": 2, "lazy_rescale": True}), PYTHONPATH=str(ROOT))
    # the probe lives outside tests/: the suite's conftest comes in as a plugin
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "tests.conftest", "--rootdir", str(ROOT),
                          "-c", str(ROOT / "pyproject.toml"), str(probe)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
