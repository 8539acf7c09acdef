"""Speculative steps that end a request inside the accepted tokens: the tokens past the stop
token are dropped, and ``EngineStats.decode_tokens`` counts only the tokens emitted.

An oracle drafter proposes the greedy continuation itself, so every draft is accepted by a
real TARGET_VERIFY forward and one step emits ``k + 1`` tokens; the stop token is one of the
accepted drafts in the middle of such a step."""

import attrs
import pytest

from aiter_attn.engine import (Engine, EngineConfig, LlamaFamilyModel, SamplingParams,
                               build_random_model)

_KW = dict(page_size=4, max_batch_size=2, max_context_len=96, max_tokens_per_step=32)
_PROMPT = [11, 402, 37, 250, 91, 7, 333]


@attrs.frozen
class _OracleDrafter:
    """Drafts the next ``k`` tokens of ``continuation`` (the greedy output of ``prompt``)."""

    prompt: tuple
    continuation: tuple

    def propose(self, tokens, k):
        done = len(tokens) - len(self.prompt)
        return list(self.continuation[done:done + k]) if k > 0 else []


@pytest.fixture(scope="module")
def model():
    hf, _ = build_random_model("llama", seed=0)
    return LlamaFamilyModel.from_hf(hf, max_positions=128)


def test_tokens_after_a_stop_inside_a_verify_step_are_not_counted(model):
    greedy = Engine(model, EngineConfig(**_KW)).generate(
        [_PROMPT], SamplingParams(max_new_tokens=12))[0]
    # output ids 1..5 come from the first verify step (k=4); the stop token is one of its
    # middle tokens (ids 2..4) not produced before
    stop_at = next(i for i in range(2, 5) if greedy[i] not in greedy[:i])
    stop = greedy[stop_at]

    eng = Engine(model, EngineConfig(speculative="ngram", num_draft_tokens=4, **_KW))
    eng.spec_decoder.drafter = _OracleDrafter(tuple(_PROMPT), tuple(greedy))
    req = eng.add_request(_PROMPT, SamplingParams(max_new_tokens=12, stop_token_ids={stop}))
    steps = []
    while eng.has_work:
        steps.append([ev.token_id for ev in eng.step()])

    assert req.output_ids == greedy[:stop_at + 1] and req.finish_reason == "stop"
    assert steps[1] == greedy[1:stop_at + 1]  # the verify step, cut at the stop token
    assert eng.spec_decoder.stats.accepted == 4  # all four drafts were accepted ...
    assert eng.stats.decode_tokens == stop_at  # ... but only those up to the stop count
    assert eng.stats.prefill_tokens == len(_PROMPT)
