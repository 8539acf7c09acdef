"""``--check``: the same prompts through ``transformers``' own ``generate`` (greedy), compared
token for token with the engine's output."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

__all__ = ["Divergence", "hf_greedy", "compare_outputs"]


@attrs.frozen
class Divergence:
    """The first difference between the engine's and transformers' ids for one prompt."""

    prompt_index: int
    position: int  # index into the generated ids
    ours: object  # token id, or None when our output ended first
    theirs: object

    def describe(self) -> str:
        return (f"prompt {self.prompt_index}: first divergence at generated token "
                f"{self.position}: engine {self.ours} vs transformers {self.theirs}")


def hf_greedy(hf_model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
              stop_token_ids, device="cpu") -> list[list[int]]:
    """Greedy ids from ``hf_model.generate`` for each prompt, one at a time (no padding).

    Generation stops after one of ``stop_token_ids`` (exactly those; none = only the length).
    """
    from transformers import GenerationConfig

    stop = sorted(stop_token_ids)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                           # [] (not None) so the model's own default eos does not apply
                           eos_token_id=stop,
                           pad_token_id=stop[0] if stop else 0)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([list(ids)], dtype=torch.int64, device=device)
            y = hf_model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                  generation_config=gen)
            outs.append(y[0, x.shape[1]:].tolist())
    return outs


def compare_outputs(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]
                    ) -> list[Divergence]:
    """One :class:`Divergence` per prompt whose ids differ (empty list = identical).

    Raises ``ValueError`` when the two sides hold a different number of prompts (``zip``
    would compare only the shorter and call the rest identical)."""
    ours, theirs = list(ours), list(theirs)
    if len(ours) != len(theirs):
        raise ValueError(f"compare_outputs: {len(ours)} outputs of ours but {len(theirs)} of "
                         "theirs; pass one list of generated ids per prompt on both sides.")
    out = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        a, b = list(a), list(b)
        if a == b:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append(Divergence(i, pos, a[pos] if pos < len(a) else None,
                              b[pos] if pos < len(b) else None))
    return out
