"""``scripts/gpu_suite_part.py``: the gpu suite split into parts for several device calls."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

COLLECTED = """tests/test_a.py::test_x[1]
tests/test_a.py::test_x[2]
tests/test_a.py::test_y
tests/test_b.py::test_z
tests/test_c.py::TestK::test_w
tests/test_c.py::TestK::test_v

480/3264 tests collected (2784 deselected) in 18.65s
"""


def test_counts_read_node_ids_only():
    from gpu_suite_part import file_counts

    assert file_counts(COLLECTED) == {"tests/test_a.py": 3, "tests/test_b.py": 1,
                                      "tests/test_c.py": 2}


def test_parts_cover_every_file_once_and_balance_the_counts():
    from gpu_suite_part import file_counts, split

    counts = file_counts(COLLECTED)
    two = split(counts, 2)
    assert two == [["tests/test_a.py"], ["tests/test_b.py", "tests/test_c.py"]]
    for n in (1, 2, 3, 5):
        parts = split(counts, n)
        assert len(parts) == n and sorted(sum(parts, [])) == sorted(counts)
    with pytest.raises(ValueError, match="parts=0"):
        split(counts, 0)
