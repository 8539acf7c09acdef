"""``aiter-attn info`` arguments: the output flags print different documents, so two of them
are a usage error (``--json --markdown`` printed Markdown: not JSON); ``--device`` is honoured
by every output (the JSON and text tables too), a device index selects its type's kernels
(``cuda:1`` is ``cuda``), and a string that is no device is one line on stderr, exit 2."""

import json

import pytest

from aiter_attn.cli import main
from aiter_attn.commands import info


@pytest.mark.parametrize("flags", [["--json", "--markdown"], ["--json", "--kv-formats"],
                                   ["--markdown", "--kv-formats"]],
                         ids=["json-markdown", "json-kv", "markdown-kv"])
def test_output_flags_are_exclusive(capsys, flags):
    with pytest.raises(SystemExit) as exc:
        main(["info", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and len(err.strip().splitlines()) == 1


def test_json_honours_device(capsys, monkeypatch):
    seen = []
    real = info.mode_arch_table

    def spy(device=None, dtype=None):
        seen.append(device)
        return real(device=device, dtype=dtype)

    monkeypatch.setattr(info, "mode_arch_table", spy)
    assert main(["info", "--json", "--device", "cuda:1"]) == 0
    json.loads(capsys.readouterr().out)
    assert seen == ["cuda"]
    seen.clear()
    assert main(["info", "--markdown", "--device", "cuda:1"]) == 0
    assert seen == ["cuda"]


def test_device_index_selects_the_device_type_kernels(capsys):
    """A kernel registered for devices={"cuda"} serves ``cuda:1``: the table asks by type."""
    from aiter_attn import plugins
    from aiter_attn.kernels.registry import Capabilities
    from aiter_attn.types import CGSupport

    plugins.reset_plugins()
    plugins.kernel_registry().register(
        "paged_attention", "cuda_only_info", lambda *a, **k: None,
        Capabilities(devices={"cuda"}, features={"custom_mask"}, cg_support=CGSupport.ALWAYS),
        priority=10**6)
    try:
        assert main(["info", "--markdown", "--device", "cuda:1"]) == 0
        assert "paged_attention:cuda_only_info" in capsys.readouterr().out
    finally:
        plugins.reset_plugins()


def test_unknown_device_is_a_usage_error(capsys):
    assert main(["info", "--device", "bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("aiter-attn info: error: --device 'bogus' is not a device")
    assert "such as cpu or cuda" in err[0]
