"""A generation request and its sampling settings."""

from __future__ import annotations

import enum
import math
import numbers
import operator
from collections.abc import Iterable
from typing import Optional

import attrs

__all__ = ["SamplingParams", "Request", "RequestStatus", "as_int", "as_token_id"]


def _temperature(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature={value!r} must be a finite number ≥ 0; 0 decodes "
                         "greedily.")


def _top_p(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not 0.0 < value <= 1.0:
        raise ValueError(f"top_p={value!r} must be a number in (0, 1]; 1 keeps every token.")


#: seeds ``torch.Generator.manual_seed`` takes
SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 64 - 1


def _seed(instance, attribute, value):
    # checked here: torch's generator refuses it only when the first token is sampled, after
    # the request's prompt went through the model (and its batch with it). A greedy request
    # never seeds a generator, so only a sampling one needs the range (the CLI gives prompt i
    # seed + i whatever the temperature).
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
            instance.temperature > 0 and not SEED_MIN <= value <= SEED_MAX):
        raise ValueError(f"seed={value!r} must be None or an int, in [-2**63, 2**64 - 1] "
                         "(what torch's generators take) when sampling (temperature > 0); "
                         "pick a seed in that range, e.g. seed % 2**64.")


def _max_new_tokens(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"max_new_tokens={value!r} must be an int ≥ 1.")


def as_int(value) -> Optional[int]:
    """``value`` as an int (an int, a NumPy integer, a 0-d integer tensor), or ``None`` when it
    is not an integer (a float, even a whole one, a bool, a str)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_token_id(value) -> Optional[int]:
    """``value`` as an int token id ≥ 0 (see :func:`as_int`), or ``None``."""
    i = as_int(value)
    return i if i is not None and i >= 0 else None


def _token_ids(value) -> frozenset:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"stop_token_ids={value!r} must be a collection of token ids, e.g. "
                         f"{{{value!r}}}.")
    ids = list(value)
    # a str, a float or a tensor never equals a sampled id in a set: the request would run to
    # max_new_tokens instead of stopping
    bad = [i for i in ids if as_token_id(i) is None]
    if bad:
        raise ValueError(f"stop_token_ids={value!r}: {bad[:5]} are not token ids (ints ≥ 0); "
                         "pass the ids the tokenizer gives, e.g. tokenizer.eos_token_id.")
    return frozenset(as_token_id(i) for i in ids)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request picks tokens.

    Attributes:
        max_new_tokens: most tokens to generate (an int ≥ 1).
        temperature: 0 = greedy (argmax); > 0 (finite) samples from
            ``softmax(logits / temperature)``.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability ≥ ``top_p``.
        seed: seeds this request's own generator (reproducible whatever the batch around it);
            ``None`` or an int, in [-2**63, 2**64 - 1] when sampling (greedy requests do not
            use it).
        stop_token_ids: generation stops after emitting one of these (it is kept in the
            output); any collection of ints ≥ 0, stored as a ``frozenset``.
    """

    max_new_tokens: int = attrs.field(default=16, validator=_max_new_tokens)
    temperature: float = attrs.field(default=0.0, validator=_temperature)
    top_p: float = attrs.field(default=1.0, validator=_top_p)
    seed: Optional[int] = attrs.field(default=None, validator=_seed)
    stop_token_ids: frozenset = attrs.field(default=frozenset(), converter=_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """One prompt being served.

    The tokens fed to the model are ``tokens[num_computed:]``: a prefill chunk is a slice of the
    prompt; a decode step feeds the last sampled token. ``num_computed`` counts tokens whose K/V
    sit in the pool (prefix-cached ones included).

    Attributes:
        rid: request id (its index in submission order).
        prompt_ids: prompt token ids.
        params: sampling settings.
        output_ids: generated ids so far.
        row: its ``req_to_token`` row while running.
        num_computed: tokens with K/V in the pool.
        cached_tokens: prompt tokens reused from another request's pages (prefix caching).
        shared_pages: the pages it reused.
        pages: its pages, recorded when it finished (tests and stats).
        finish_reason: ``"stop"`` (stop token), ``"length"`` (max_new_tokens or context),
            ``"error"`` (a step it was part of raised; its pages went back to the pool).
        joined_step: engine step at which it was admitted.
    """

    rid: int
    prompt_ids: list
    params: SamplingParams
    output_ids: list = attrs.field(factory=list)
    status: RequestStatus = RequestStatus.WAITING
    row: Optional[int] = None
    num_computed: int = 0
    cached_tokens: int = 0
    shared_pages: list = attrs.field(factory=list)
    pages: list = attrs.field(factory=list)
    reserved_pages: int = 0
    finish_reason: Optional[str] = None
    joined_step: Optional[int] = None
    generator: object = None

    @property
    def tokens(self) -> list:
        """Prompt followed by the generated ids."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet fed to the model."""
        return self.num_tokens - self.num_computed

    @property
    def prefill_done(self) -> bool:
        """Every prompt token has been fed (it now decodes one token per step)."""
        return self.num_computed >= len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
