"""Tokenizers for the engine: a model's own (transformers) or a byte tokenizer for random models.

:func:`encode_prompt` applies the chat template when the tokenizer has one.
"""

from __future__ import annotations

__all__ = ["ByteTokenizer", "encode_prompt", "stop_token_ids"]


class ByteTokenizer:
    """UTF-8 bytes as tokens, for random-weight models that ship no tokenizer.

    Ids: 0 = pad, 1 = bos, 2 = eos, ``3 + b`` = byte ``b``; ids ≥ 259 decode to nothing.
    Needs a vocabulary of at least 259.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    offset = 3
    chat_template = None

    def __init__(self, vocab_size: int):
        if vocab_size < 259:
            raise ValueError(f"vocab_size={vocab_size}: the byte tokenizer needs ≥ 259 ids.")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")


def encode_prompt(tokenizer, text: str, *, chat: bool = True) -> list[int]:
    """Token ids of ``text`` as a user turn (chat template + generation prompt) when ``chat``
    and the tokenizer has a template; otherwise plain encoding (with bos where the tokenizer
    adds it)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def stop_token_ids(hf_model, tokenizer) -> frozenset:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    ids = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple, set)) else [value])
    return frozenset(int(i) for i in ids)
