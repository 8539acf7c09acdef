"""``aiter-attn generate`` arguments that cannot be served: refused in one line, exit 2, before
the model loads, naming the flag, the value, what is allowed and the fix; and a prompts file
with no prompt in it is refused rather than replaced by the default prompt."""

import pytest

from aiter_attn.cli import main


def _error_line(capsys, argv, monkeypatch=None):
    if monkeypatch is not None:
        import aiter_attn.engine as engine_pkg
        from aiter_attn.engine import loading

        for where in (engine_pkg, loading):
            monkeypatch.setattr(where, "load_model",
                                lambda *a, **k: pytest.fail("model loaded"))
    try:
        rc = main(["generate", "--no-progress", "--random-config", "llama", *argv])
    except SystemExit as exc:  # argparse-level mistakes
        rc = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--temperature", "nan"], "--temperature=nan must be a finite number ≥ 0",
                 id="temperature-nan"),
    pytest.param(["--temperature", "-1"], "--temperature=-1.0 must be a finite number ≥ 0",
                 id="temperature-negative"),
    pytest.param(["--temperature", "0.5", "--top-p", "1.5"], "--top-p=1.5 must be in (0, 1]",
                 id="top-p-above-one"),
    pytest.param(["--temperature", "0.5", "--top-p", "0"], "--top-p=0.0 must be in (0, 1]",
                 id="top-p-zero"),
])
def test_sampling_flags_are_checked_before_loading(capsys, monkeypatch, argv, message):
    """``--temperature nan`` ended in a traceback from ``torch.multinomial`` after the model
    loaded and the prompts were prefilled."""
    assert message in _error_line(capsys, argv, monkeypatch)


def test_prompts_file_without_prompts_is_refused(capsys, tmp_path):
    """A file of blank lines used to serve the built-in default prompt instead."""
    f = tmp_path / "prompts.txt"
    f.write_text("\n   \n\n")
    line = _error_line(capsys, ["--prompts-file", str(f)])
    assert "has no prompt" in line and str(f) in line and "one prompt per line" in line
