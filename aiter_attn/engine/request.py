"""A generation request and its sampling settings."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable
from typing import Optional

import attrs

__all__ = ["SamplingParams", "Request", "RequestStatus"]


def _temperature(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature={value!r} must be a finite number ≥ 0; 0 decodes "
                         "greedily.")


def _top_p(instance, attribute, value):
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p={value!r} must be in (0, 1]; 1 keeps every token.")


def _max_new_tokens(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"max_new_tokens={value!r} must be an int ≥ 1.")


def _token_ids(value) -> frozenset:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"stop_token_ids={value!r} must be a collection of token ids, e.g. "
                         f"{{{value!r}}}.")
    return frozenset(value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request picks tokens.

    Attributes:
        max_new_tokens: most tokens to generate (an int ≥ 1).
        temperature: 0 = greedy (argmax); > 0 (finite) samples from
            ``softmax(logits / temperature)``.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability ≥ ``top_p``.
        seed: seeds this request's own generator (reproducible whatever the batch around it).
        stop_token_ids: generation stops after emitting one of these (it is kept in the
            output); any collection of ints, stored as a ``frozenset``.
    """

    max_new_tokens: int = attrs.field(default=16, validator=_max_new_tokens)
    temperature: float = attrs.field(default=0.0, validator=_temperature)
    top_p: float = attrs.field(default=1.0, validator=_top_p)
    seed: Optional[int] = None
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
        finish_reason: ``"stop"`` (stop token), ``"length"`` (max_new_tokens or context).
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
