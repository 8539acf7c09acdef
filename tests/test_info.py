"""``aiter-attn info``: the environment report and the mode × architecture table."""

import json
import pathlib

from aiter_attn.cli import main
from aiter_attn.commands.info import mode_arch_table, table_markdown
from aiter_attn.types import AttnArch

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "modes.md"


def test_every_cell_has_a_strategy():
    """No empty cell: every mode × architecture the seed serves has a strategy and a kernel."""
    rows = mode_arch_table(device="cpu")
    assert len(rows) == 8 * len(AttnArch)
    empty = [(r["mode"], r["arch"], r.get("why")) for r in rows if not r["strategy"]]
    assert not empty, empty
    assert all("none" not in r["kernel"] for r in rows)


def test_docs_table_is_current():
    """docs/modes.md embeds exactly the table the code prints (regenerate with
    `aiter-attn info --markdown --device cpu`)."""
    text = DOCS.read_text()
    embedded = text.split("<!-- table:start -->\n", 1)[1].split("<!-- table:end -->", 1)[0]
    assert embedded.strip() == table_markdown(mode_arch_table(device="cpu")).strip()


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"torch", "triton", "plugins", "kernels", "table"} <= set(info)
    assert any(k["op"] == "paged_attention" and k["name"] == "reference" for k in info["kernels"])
    assert "reference" in info["plugins"]


def test_info_text(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "mode × architecture" in out and "mha.decode" in out


def test_docs_kv_formats_table_is_current():
    """docs/modes.md embeds exactly the KV formats table the code prints (regenerate with
    `aiter-attn info --kv-formats`)."""
    from aiter_attn.commands.info import kv_formats_markdown, kv_formats_table

    text = DOCS.read_text()
    embedded = text.split("<!-- kv-formats:start -->\n", 1)[1].split("<!-- kv-formats:end -->", 1)[0]
    assert embedded.strip() == kv_formats_markdown(kv_formats_table()).strip()
    rows = {r["format"]: r for r in kv_formats_table()}
    assert rows["fp8 e5m2"]["archs"] == ["MHA", "MLA", "SWA", "VEC5D"]
    assert rows["fp8 e5m2, per-(token, head) scales"]["archs"] == ["MHA", "SWA"]
