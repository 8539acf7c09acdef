"""Defects found hunting the engine's runtime (request and sampling values, engine settings,
a step that raises half-way, the transformers comparison, CPU thread choice): each test
failed before its fix. Bad input is refused when the request, the settings or the engine is
made, naming the value and what is allowed, not mid-step; a step that raises leaves no request
half-fed (its KV one slot off) and no page, row or reservation behind."""

import numpy as np
import pytest
import torch

from aiter_attn.engine import (Engine, EngineConfig, LlamaFamilyModel, SamplingParams,
                               build_random_model, choose_threads, compare_outputs, hf_greedy)
from aiter_attn.engine import engine as engine_mod

_PROMPT = [11, 402, 37, 250, 91, 7, 333]
_OTHER = [5, 6, 7, 8, 9, 10, 11, 12, 13]
_KW = dict(page_size=4, max_batch_size=2, max_context_len=64, max_tokens_per_step=16)


@pytest.fixture(scope="module")
def models():
    hf, _ = build_random_model("llama", seed=0)
    return hf, LlamaFamilyModel.from_hf(hf, max_positions=128)


def _greedy(hf, prompts, n):
    return hf_greedy(hf, prompts, max_new_tokens=n, stop_token_ids=frozenset())


def _all_back(eng):
    kv = eng.kv
    assert kv.allocator.free_pages == kv.num_pages - 1
    assert kv.available_rows == eng.config.max_batch_size
    assert kv.available_pages == kv.num_pages - 1  # no reservation left behind
    assert not kv._refs and not kv._live


# -- sampling parameters ----------------------------------------------------------------------

@pytest.mark.parametrize("seed", [2 ** 64, -2 ** 63 - 1, 1.5, "3", True],
                         ids=["2**64", "-2**63-1", "float", "str", "bool"])
def test_seed_outside_what_torch_takes_is_refused_when_made(seed):
    """``SamplingParams(seed=2**64)`` was accepted and failed in the sampler after the prompt's
    forward ("Overflow when unpacking long long"); a float or a str seed the same way."""
    with pytest.raises(ValueError, match=r"seed=.* must be None or an int, in "
                                         r"\[-2\*\*63, 2\*\*64 - 1\].*when sampling"):
        SamplingParams(temperature=1.0, seed=seed)


def test_greedy_request_keeps_any_int_seed():
    """A greedy request never seeds a generator (the CLI gives prompt i ``seed + i`` whatever
    the temperature), so an int past the range is fine there; a non-int is still refused."""
    assert SamplingParams(seed=2 ** 64).seed == 2 ** 64
    with pytest.raises(ValueError, match=r"seed=1.5 must be None or an int"):
        SamplingParams(seed=1.5)


def test_seeds_at_both_ends_of_the_range_sample(models):
    _, model = models
    for seed in (2 ** 64 - 1, -2 ** 63):
        out = Engine(model, EngineConfig(**_KW)).generate(
            [_PROMPT], SamplingParams(temperature=1.0, seed=seed, max_new_tokens=2))
        assert len(out[0]) == 2


@pytest.mark.parametrize("top_p", ["0.5", True], ids=["str", "bool"])
def test_top_p_must_be_a_number_in_range(top_p):
    """``top_p="0.5"`` raised a bare TypeError ('<' not supported); ``True`` was taken as 1."""
    with pytest.raises(ValueError, match=r"top_p=.* must be a number in \(0, 1\]"):
        SamplingParams(top_p=top_p)


@pytest.mark.parametrize("stop", [["a"], [2.5], [-1], [True]],
                         ids=["str", "float", "negative", "bool"])
def test_stop_token_ids_must_be_token_ids(stop):
    """Such entries never equal a sampled id: the request silently ran to max_new_tokens."""
    with pytest.raises(ValueError, match=r"stop_token_ids=.* are not token ids \(ints ≥ 0\)"):
        SamplingParams(stop_token_ids=stop)


@pytest.mark.parametrize("wrap", [torch.tensor, np.int64], ids=["0-d-tensor", "numpy-int"])
def test_stop_token_given_as_tensor_or_numpy_int_stops(models, wrap):
    """A stop id taken from a tensor (``logits.argmax()``) sat in the frozenset as a tensor,
    hashed by identity: generation never stopped on it."""
    hf, model = models
    greedy = _greedy(hf, [_PROMPT], 8)[0]
    at = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[wrap(greedy[at])])
    assert params.stop_token_ids == frozenset({greedy[at]})
    eng = Engine(model, EngineConfig(**_KW))
    req = eng.add_request(_PROMPT, params)
    eng.run()
    assert req.output_ids == greedy[:at + 1] and req.finish_reason == "stop"


# -- prompts and parameters given to the engine -------------------------------------------------

@pytest.mark.parametrize("prompt,match", [
    pytest.param([11.7, 402.2], r"prompt token ids must be ints, got \[11.7, 402.2\]",
                 id="floats-were-truncated"),
    pytest.param([True, False], r"prompt token ids must be ints", id="bools"),
    pytest.param(torch.tensor([1.5, 2.0]), r"prompt token ids must be ints", id="float-tensor"),
    pytest.param("Hello", r"the prompt 'Hello' is text; pass its token ids", id="text"),
    pytest.param(5, r"must be a 1-D sequence of token ids, got int 5", id="one-int"),
    pytest.param(torch.tensor([[1, 2]]), r"must be a 1-D sequence of token ids", id="2-D"),
])
def test_prompt_that_is_not_token_ids_is_refused(models, prompt, match):
    """``[11.7, 402.2]`` was fed as tokens 11 and 402 without a word; text and a bare int
    failed with ``int()``'s or iteration's own messages."""
    _, model = models
    eng = Engine(model, EngineConfig(**_KW))
    with pytest.raises(ValueError, match=match):
        eng.add_request(prompt, SamplingParams(max_new_tokens=2))
    assert not eng.has_work and not eng.requests


def test_flat_list_of_ids_given_to_generate_is_refused(models):
    """``generate([11, 402, 37])`` (one prompt, not wrapped in a list) failed with "'int'
    object is not iterable"; ``generate("Hello")`` with int()'s message."""
    _, model = models
    eng = Engine(model, EngineConfig(**_KW))
    with pytest.raises(ValueError, match=r"request 0: the prompt must be a 1-D sequence.*"
                                         r"wrap one prompt's ids in a list"):
        eng.generate(_PROMPT, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"generate: prompts='Hello' must be a list of prompts"):
        eng.generate("Hello", SamplingParams(max_new_tokens=2))
    assert not eng.has_work and not eng.requests


def test_integer_tensor_and_numpy_prompts_are_served(models):
    hf, model = models
    eng = Engine(model, EngineConfig(**_KW))
    out = eng.generate([torch.tensor(_PROMPT), np.array(_OTHER)], SamplingParams(max_new_tokens=3))
    assert out == _greedy(hf, [_PROMPT, _OTHER], 3)


@pytest.mark.parametrize("params", [None, {"max_new_tokens": 2}], ids=["None", "dict"])
def test_params_that_are_not_sampling_params_are_refused(models, params):
    """``add_request(ids, None)`` and ``generate(prompts, {...})`` raised AttributeError
    ('NoneType' / 'str' object has no attribute 'max_new_tokens')."""
    _, model = models
    eng = Engine(model, EngineConfig(**_KW))
    with pytest.raises(TypeError, match=r"params=.* must be a SamplingParams"):
        eng.add_request(_PROMPT, params)
    with pytest.raises(TypeError, match=r"params=.* must be a SamplingParams"):
        eng.generate([_PROMPT], params)
    assert not eng.has_work and not eng.requests


# -- engine settings ------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("prefix_caching", "no"), ("mixed_steps", "False"),
                                         ("swa_pool", 0), ("debug_checks", "yes")])
def test_on_off_settings_must_be_bools(field, value):
    """``prefix_caching="no"`` or ``mixed_steps="False"`` turned the feature on silently."""
    with pytest.raises(ValueError, match=rf"EngineConfig: {field}={value!r} must be True or "
                                         "False"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("seed", [2 ** 64, "x"], ids=["2**64", "str"])
def test_shuffle_pages_seed_outside_torch_range_is_refused(seed):
    """It failed when the engine was built with torch's "Overflow when unpacking long long"
    or "manual_seed expected a long"."""
    with pytest.raises(ValueError, match=r"shuffle_pages_seed=.* must be None or an int"):
        EngineConfig(shuffle_pages_seed=seed)


@pytest.mark.parametrize("name", ["nope", 3], ids=["unknown-name", "int"])
def test_unregistered_kernel_backend_is_refused_when_built(models, name):
    """The engine was built; the first step raised KernelSelectionError with its requests
    admitted."""
    _, model = models
    with pytest.raises(ValueError, match=r"kernel_backend=.* is not a registered kernel "
                                         r"backend; registered: \[.*'reference'"):
        Engine(model, EngineConfig(kernel_backend=name, **_KW))


def test_engine_config_of_another_type_is_refused(models):
    _, model = models
    with pytest.raises(TypeError, match=r"config=.* must be an EngineConfig"):
        Engine(model, dict(_KW))


# -- a step that raises half-way ---------------------------------------------------------------

def test_failed_forward_frees_its_requests_and_the_others_stay_exact(models, monkeypatch):
    """Request A decodes (DECODE forward) while B's prefill (EXTEND forward) raises. B had
    its slots reserved but was never computed: fed again it wrote K/V one slot off and decoded
    garbage (and a retried decode did the same). Now B finishes with "error" and gives its row
    and pages back; A, whose step completed, goes on token-identical to transformers."""
    hf, model = models
    eng = Engine(model, EngineConfig(mixed_steps=False, **_KW))
    a = eng.add_request(_PROMPT, SamplingParams(max_new_tokens=8))
    eng.step()  # A's prefill
    b = eng.add_request(_OTHER, SamplingParams(max_new_tokens=8))
    real = eng.runner.model.forward

    def failing(input_ids, positions, batch, backend, logits_indices=None):
        if batch.forward_mode.name == "EXTEND":
            raise RuntimeError("kernel failed")
        return real(input_ids, positions, batch, backend, logits_indices=logits_indices)

    monkeypatch.setattr(eng.runner.model, "forward", failing)
    with pytest.raises(RuntimeError, match="kernel failed"):
        eng.step()  # A decodes, B's prefill raises
    monkeypatch.undo()
    assert b.finish_reason == "error" and b.row is None
    assert a.finish_reason is None and len(a.output_ids) == 2
    eng.run()
    assert a.output_ids == _greedy(hf, [_PROMPT], 8)[0]
    _all_back(eng)
    # the engine serves new requests exactly
    assert eng.generate([_OTHER], SamplingParams(max_new_tokens=6)) == _greedy(hf, [_OTHER], 6)
    _all_back(eng)


def test_failed_sampling_frees_the_fed_requests(models, monkeypatch):
    """The forward ran (K/V written, ``num_computed`` advanced), then sampling raised: the
    requests had no token to feed and the next step fed an empty slice as their decode
    token. Now they finish with "error" and every page, row and reservation comes back."""
    hf, model = models
    eng = Engine(model, EngineConfig(**_KW))
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=6)) for p in (_PROMPT, _OTHER)]
    eng.step()
    eng.step()

    def failing(logits, requests):
        raise RuntimeError("sampler failed")

    monkeypatch.setattr(engine_mod, "sample_tokens", failing)
    with pytest.raises(RuntimeError, match="sampler failed"):
        eng.step()
    monkeypatch.undo()
    assert [r.finish_reason for r in reqs] == ["error", "error"]
    assert not eng.has_work
    _all_back(eng)
    assert eng.generate([_PROMPT], SamplingParams(max_new_tokens=5)) == _greedy(hf, [_PROMPT], 5)


class _ConstantDrafter:
    """Always drafts ``k`` tokens (id 3; a second chain of id 4 for trees)."""

    def propose(self, tokens, k):
        return [3] * k if k > 0 else []

    def propose_many(self, tokens, k, n_chains):
        return [[3] * k, [4] * k][:n_chains] if k > 0 else []


@pytest.mark.parametrize("mode", ["ngram", "ngram-tree"])
def test_failed_verify_forward_frees_its_requests(models, monkeypatch, mode):
    """A TARGET_VERIFY forward that raises left its drafts' slots reserved past the request's
    computed tokens."""
    hf, model = models
    prompt = _PROMPT
    eng = Engine(model, EngineConfig(speculative=mode, num_draft_tokens=3, **_KW))
    eng.spec_decoder.drafter = _ConstantDrafter()
    req = eng.add_request(prompt, SamplingParams(max_new_tokens=8))
    eng.step()
    real = eng.runner.model.forward

    def failing(input_ids, positions, batch, backend, logits_indices=None):
        if batch.forward_mode.name == "TARGET_VERIFY":
            raise RuntimeError("verify failed")
        return real(input_ids, positions, batch, backend, logits_indices=logits_indices)

    monkeypatch.setattr(eng.runner.model, "forward", failing)
    with pytest.raises(RuntimeError, match="verify failed"):
        eng.step()
    monkeypatch.undo()
    assert req.finish_reason == "error"
    _all_back(eng)
    assert eng.generate([prompt], SamplingParams(max_new_tokens=8)) == _greedy(hf, [prompt], 8)


# -- the transformers comparison and the CPU thread choice ---------------------------------------

def test_compare_outputs_refuses_different_prompt_counts():
    """Three outputs against two compared only two and reported "identical"."""
    with pytest.raises(ValueError, match=r"3 outputs of ours but 2 of theirs"):
        compare_outputs([[1], [2], [3]], [[1], [2]])
    assert compare_outputs([[1, 2]], [[1, 3]])[0].position == 1


@pytest.mark.parametrize("requested", [2.5, True, "4"], ids=["float", "bool", "str"])
def test_requested_threads_must_be_an_int(requested):
    """``choose_threads(2.5)`` chose 2 threads without a word; ``"4"`` raised TypeError."""
    with pytest.raises(ValueError, match=r"--threads=.* must be an int ≥ 1"):
        choose_threads(requested)


def test_omp_num_threads_with_a_non_ascii_digit_is_refused():
    """``"²".isdigit()`` is True but ``int("²")`` raises: the message was int()'s own."""
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS='²'; must be a positive integer"):
        choose_threads(environ={"OMP_NUM_THREADS": "²"})
