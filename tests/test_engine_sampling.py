"""Sampling settings: values a request cannot be served with are refused when the request is
made (not mid-step, where a crash leaves the other requests of the batch stranded), and a
temperature so small that ``logits / temperature`` overflows still samples (the argmax)."""

import math

import pytest
import torch

from aiter_attn.engine import Request, SamplingParams
from aiter_attn.engine.sampler import sample_tokens


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_temperature_must_be_finite(value):
    with pytest.raises(ValueError, match=r"temperature=.* must be a finite number ≥ 0"):
        SamplingParams(temperature=value)


@pytest.mark.parametrize("value", [2.5, True, "4"], ids=["float", "bool", "str"])
def test_max_new_tokens_must_be_an_int(value):
    """``2.5`` generated three tokens; ``True`` one."""
    with pytest.raises(ValueError, match=r"max_new_tokens=.* must be an int ≥ 1"):
        SamplingParams(max_new_tokens=value)


def test_stop_token_ids_must_be_a_collection():
    with pytest.raises(ValueError, match=r"stop_token_ids=5 must be a collection of token ids"
                                         r".*\{5\}"):
        SamplingParams(stop_token_ids=5)
    assert SamplingParams(stop_token_ids=[2, 3]).stop_token_ids == frozenset({2, 3})


@pytest.mark.parametrize("temperature", [1e-40, 1e-44], ids=["1e-40", "subnormal-1e-44"])
def test_tiny_temperature_samples_the_argmax(temperature):
    """``logits / 1e-40`` is ±inf in float32 and softmax of it NaN (multinomial raised); the
    limit of the distribution is the argmax, which is what comes out."""
    logits = torch.tensor([[0.5, 3.0, -2.0, 2.5], [-1.0, -3.0, -0.5, -4.0]])
    reqs = [Request(rid=i, prompt_ids=[1], params=SamplingParams(temperature=temperature,
                                                                   seed=i))
            for i in range(2)]
    assert sample_tokens(logits, reqs) == [1, 2]
