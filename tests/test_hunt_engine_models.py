"""Defects found hunting the engine's model path (config fields the decoder reads, RoPE types,
the transformers-wrapped models, `aiter-attn generate` arguments), each checked against the
real transformers model built from the same config with random weights (float32): every test
failed before its fix."""

import pytest
import torch

from aiter_attn.cli import main
from aiter_attn.engine import (Engine, EngineConfig, LlamaFamilyModel, SamplingParams,
                               build_random_model, compare_outputs, hf_greedy)
from aiter_attn.engine.models import build_engine_model, check_engine_supported
from aiter_attn.types import ForwardMode

_WINDOW = 8


def _prompt(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def _engine_logits(model, prompt):
    """Float32 logits of every prompt token from one EXTEND forward through the paged
    backend (block-permuted pages of 4)."""
    eng = Engine(model, EngineConfig(page_size=4, max_batch_size=1, max_context_len=64,
                                     max_tokens_per_step=64, shuffle_pages_seed=3))
    req = eng.add_request(prompt, SamplingParams(max_new_tokens=1))
    eng.scheduler.schedule()
    captured = {}
    orig = model.forward

    def spy(input_ids, positions, batch, backend, logits_indices=None):
        captured["logits"] = orig(input_ids, positions, batch, backend, None)
        return captured["logits"][logits_indices]

    model.forward = spy
    try:
        eng.runner.forward(ForwardMode.EXTEND, [(req, len(prompt))])
    finally:
        del model.forward
    return captured["logits"]


def _assert_logits_match(hf, model, prompt):
    ours = _engine_logits(model, prompt).double()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].double()
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 1e-5, f"relative error {err:.2e} against transformers' forward"


@pytest.mark.parametrize("name,overrides,windows", [
    pytest.param("llama", dict(layer_types=["sliding_attention", "full_attention"],
                               sliding_window=_WINDOW), [None, None],
                 id="llama-layer_types-ignored"),
    pytest.param("mistral", dict(layer_types=["sliding_attention", "full_attention"],
                                 sliding_window=_WINDOW), [_WINDOW, _WINDOW],
                 id="mistral-window-on-every-layer"),
    pytest.param("qwen2", dict(layer_types=["full_attention", "sliding_attention"],
                               use_sliding_window=True, sliding_window=_WINDOW),
                 [None, _WINDOW], id="qwen2-layer_types-honoured"),
])
def test_own_decoder_windows_follow_the_transformers_class(name, overrides, windows):
    """``layer_types`` in a Llama or Mistral config (Ministral-style checkpoints) is ignored by
    ``LlamaAttention`` (no window at all) and ``MistralAttention`` (``config.sliding_window``
    on every layer); the engine's decoder windowed exactly the layers ``layer_types`` marked,
    so its logits differed from transformers (relative error 1.1 and 0.39)."""
    hf, _ = build_random_model(name, overrides=overrides)
    model = LlamaFamilyModel.from_hf(hf, max_positions=64)
    assert [s.sliding_window for s in model.layer_specs] == windows
    _assert_logits_match(hf, model, _prompt())


def test_wrapped_mistral_keeps_its_sliding_window():
    """``MistralAttention`` has no ``sliding_window`` attribute (it passes
    ``config.sliding_window`` to the attention function): the wrapped model read ``None`` off
    the module and served every layer with full attention (relative error 1.09)."""
    hf, _ = build_random_model("mistral-swa")
    model = build_engine_model(hf, wrap=True)
    assert [s.sliding_window for s in model.layer_specs] == [_WINDOW, _WINDOW]
    _assert_logits_match(hf, model, _prompt())


_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
             "long_factor": [4.0] * 8, "original_max_position_embeddings": 16}
_DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}


@pytest.mark.parametrize("name,rope", [
    pytest.param("gemma2", _LONGROPE, id="gemma2-longrope"),
    pytest.param("gpt_oss", _DYNAMIC, id="gpt_oss-dynamic"),
])
def test_wrapped_model_refuses_length_dependent_rope(name, rope):
    """transformers' rotary module recomputes dynamic/longrope frequencies from the longest
    position of each forward; wrapped, the engine's packed step holds several requests, so a
    6-token prompt batched with a 30-token one was rotated with the long factors and its first
    greedy token differed from ``transformers.generate``. Now refused, from the config alone
    (before the weights load) and when wrapping."""
    hf, _ = build_random_model(name, overrides=dict(rope_parameters=rope))
    with pytest.raises(ValueError, match=rf"rope_type='{rope['rope_type']}'.*sequence length"):
        check_engine_supported(hf.config)
    with pytest.raises(ValueError, match=rf"rope_type='{rope['rope_type']}'.*default, linear"):
        build_engine_model(hf)


def test_own_decoder_rope_refused_from_the_config():
    """A Llama folder with dynamic RoPE passed ``check_engine_supported`` and was refused only
    after its weights were loaded (``RotaryEmbedding.from_hf``)."""
    hf, _ = build_random_model("llama", overrides=dict(rope_parameters=_DYNAMIC))
    with pytest.raises(ValueError, match="rope_type='dynamic'.*Use a model with one of those"):
        check_engine_supported(hf.config)


def test_proportional_rope_is_served():
    """``proportional`` RoPE (rotary on a fraction of the head, frequencies fixed at init) was
    refused as if it changed with the sequence length; its frequencies are static, so the
    table built from transformers' ``inv_freq`` reproduces it."""
    rope = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "factor": 2.0}
    hf, _ = build_random_model("llama", overrides=dict(rope_parameters=rope))
    check_engine_supported(hf.config)
    model = LlamaFamilyModel.from_hf(hf, max_positions=64)
    _assert_logits_match(hf, model, _prompt())
    prompts = [_prompt(9, seed=1), _prompt(17, seed=2)]
    ours = Engine(model, EngineConfig(page_size=4, max_batch_size=2, max_context_len=64)
                  ).generate(prompts, SamplingParams(max_new_tokens=6))
    theirs = hf_greedy(hf, prompts, max_new_tokens=6, stop_token_ids=frozenset())
    assert not compare_outputs(ours, theirs)


def _run_cli(capsys, argv):
    try:
        rc = main(["generate", "--no-progress", "--random-config", "llama", *argv])
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr()


def test_cli_seed_past_the_generator_range_is_refused_before_loading(capsys, monkeypatch):
    """``--seed 18446744073709551615 --temperature 1`` with two prompts loaded the model,
    prefilled, then died in a traceback from ``Generator.manual_seed(seed + 1)`` ("Overflow
    when unpacking long long")."""
    import aiter_attn.engine as engine_pkg
    from aiter_attn.engine import loading

    for where in (engine_pkg, loading):
        monkeypatch.setattr(where, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    top = 2 ** 64 - 1
    rc, cap = _run_cli(capsys, ["--seed", str(top), "--temperature", "1", "--prompt", "a",
                                "--prompt", "b", "--max-new-tokens", "2"])
    lines = [ln for ln in cap.err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in cap.err, cap.err
    assert f"--seed={top}" in lines[0] and f"{top - 1}]" in lines[0]
    assert "smaller seed" in lines[0]
    rc, cap = _run_cli(capsys, ["--seed", str(-2 ** 63 - 1), "--max-new-tokens", "2"])
    assert rc == 2 and "--seed=" in cap.err and "Traceback" not in cap.err, cap.err


@pytest.mark.parametrize("argv", [
    pytest.param(["--temperature", "1", "--prompt", "a"], id="one-sampled-prompt"),
    pytest.param(["--prompt", "a", "--prompt", "b"], id="greedy-two-prompts"),
])
def test_cli_seed_at_the_edge_of_the_range_serves(capsys, argv):
    """The largest seed the generators take still serves: sampled with one prompt, and
    greedy with several (greedy requests never seed a generator)."""
    rc, cap = _run_cli(capsys, ["--seed", str(2 ** 64 - 1), *argv, "--max-new-tokens", "2",
                                "--json"])
    assert rc == 0, cap.err


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A random Llama saved as a Hugging Face folder (config.json + model.safetensors)."""
    folder = tmp_path_factory.mktemp("llama")
    hf, _ = build_random_model("llama")
    hf.save_pretrained(folder)
    return folder


def _broken_folder(src, dst, case):
    import json
    import shutil

    shutil.copytree(src, dst)
    weights, config = dst / "model.safetensors", dst / "config.json"
    if case == "no-weights":
        weights.unlink()
    elif case == "config-not-json":
        config.write_text("{")
    elif case == "config-field-type":
        fields = json.loads(config.read_text())
        fields["hidden_size"] = "abc"
        config.write_text(json.dumps(fields))
    elif case == "weights-truncated":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    return dst


@pytest.mark.parametrize("case,message", [
    pytest.param("no-weights", "holds no weights transformers can load", id="no-weights"),
    pytest.param("config-not-json", "config.json'\\: its config cannot be read .*not a valid "
                 "JSON file", id="config-not-json"),
    pytest.param("config-field-type", "its config cannot be read .*'hidden_size' expected int",
                 id="config-field-type"),
    pytest.param("weights-truncated", "weights file is truncated or corrupt .*download the "
                 "model again", id="weights-truncated"),
])
def test_broken_model_folder_is_a_one_line_error(capsys, tmp_path, saved_llama, case, message):
    """A Hugging Face folder whose config.json is not JSON or has a field of the wrong type,
    that holds no weights, or whose safetensors file is cut off ended in a transformers /
    safetensors traceback (OSError, StrictDataclassFieldValidationError, SafetensorError)
    instead of one line naming the folder and what to do."""
    import re

    folder = _broken_folder(saved_llama, tmp_path / "model", case)
    try:
        rc = main(["generate", "--no-progress", "--model", str(folder), "--max-new-tokens",
                   "2"])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines()
             if ln.strip() and not ln.startswith("WARNING")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("aiter-attn generate: error: --model=") and str(folder) in lines[0]
    assert re.search(message, lines[0]), lines[0]


def test_saved_model_folder_still_serves(capsys, saved_llama):
    """The intact folder serves, token-identical to transformers (``--check``)."""
    rc = main(["generate", "--no-progress", "--model", str(saved_llama), "--max-new-tokens",
               "3", "--check", "--json"])
    out = capsys.readouterr().out
    assert rc == 0 and '"passed": true' in out, out


def test_prompts_file_that_is_not_utf8_names_the_flag(capsys, tmp_path, monkeypatch):
    """A Latin-1/UTF-16 prompts file was refused as "'utf-8' codec can't decode byte 0xff in
    position 0", naming neither the flag nor the file."""
    import aiter_attn.engine as engine_pkg
    from aiter_attn.engine import loading

    for where in (engine_pkg, loading):
        monkeypatch.setattr(where, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"\xff\xfeh\x00i\x00\n\x00")
    rc, cap = _run_cli(capsys, ["--prompts-file", str(f)])
    lines = [ln for ln in cap.err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in cap.err, cap.err
    assert f"--prompts-file={str(f)!r} is not UTF-8 text" in lines[0]
    assert "save it as UTF-8" in lines[0]
