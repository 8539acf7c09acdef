"""``aiter-attn verify`` filters that leave nothing to run are usage errors (exit 2, one line
naming why), not an empty report that exits 0 as if the backend conformed; ``--self-test``
refuses the flags it would silently ignore."""

import json

import pytest

from aiter_attn.cli import main


@pytest.mark.parametrize("argv,why", [
    pytest.param(["--op", "write_kv", "--case", "decode-page1-gqa4:1-d64"],
                 "decode-page1-gqa4:1-d64 is a paged_attention case, not one of --op write_kv",
                 id="case-of-another-op"),
    pytest.param(["--quick", "--case", "decode-page48-mha-d64"],
                 "decode-page48-mha-d64 is not in the --quick subset", id="case-not-quick"),
])
def test_filters_that_select_no_case_are_usage_errors(capsys, argv, why):
    assert main(["verify", "--backend", "reference", *argv]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    assert out[0].startswith("aiter-attn verify: error: no case matches the filters: ")
    assert why in out[0] and "Drop or change a filter." in out[0]
    assert main(["verify", "--backend", "reference", "--json", *argv]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and why in data["error"]


@pytest.mark.parametrize("flags", [["--op", "write_kv"], ["--case", "tree_mask-q4"],
                                   ["--dtype", "float16"], ["--strict"]],
                         ids=["op", "case", "dtype", "strict"])
def test_self_test_refuses_filters_it_would_ignore(capsys, flags):
    assert main(["verify", "--self-test", "--quick", *flags]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"drop {flags[0]}" in out[0]
