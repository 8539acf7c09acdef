"""The reference engine: continuous batching of requests over one model and paged KV cache.

``Engine.add_request`` queues a prompt; ``Engine.step`` plans and runs one step, samples, and
frees the pages of requests that finished; ``Engine.run`` steps until every request is done.

A step's forwards: a pure decode step is one DECODE forward (CUDA-graph replayed when graphs
are on); a pure prefill step is one EXTEND forward; a *mixed* step (requests decoding while
others prefill) is one EXTEND forward whose decoding requests are extend rows of length 1
(``EngineConfig.mixed_steps``), or a DECODE forward plus an EXTEND forward with
``mixed_steps=False``, with n-gram speculative decoding, or in batch-invariant mode.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Iterable
from typing import Callable, Optional, Sequence

import attrs

from ..types import ForwardMode
from .kv_manager import KVCacheManager
from .graphs import graphs_enabled
from .protocol import EngineModel
from .request import SEED_MAX, SEED_MIN, Request, RequestStatus, SamplingParams, as_int
from .runner import ModelRunner
from .sampler import sample_tokens
from .scheduler import Scheduler
from .spec_decode import make_spec_decoder

__all__ = ["EngineConfig", "EngineStats", "TokenEvent", "Engine"]

log = logging.getLogger(__name__)


def _positive_int(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"EngineConfig: {attribute.name}={value!r} must be an int ≥ 1.")


def _positive_int_or_none(instance, attribute, value):
    # None picks the default; 0 is refused rather than read as "the default"
    if value is not None:
        _positive_int(instance, attribute, value)


def _flag(instance, attribute, value):
    # a str such as "false" or "no" would count as True
    if not isinstance(value, bool):
        raise ValueError(f"EngineConfig: {attribute.name}={value!r} must be True or False.")


def _shuffle_seed(instance, attribute, value):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"EngineConfig: shuffle_pages_seed={value!r} must be None or an int "
                         "in [-2**63, 2**64 - 1] (what torch's generators take).")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Engine settings. Every count is an int ≥ 1 (ValueError otherwise); ``chunk_size`` and
    ``kv_tokens`` may also be ``None`` for their defaults; every on/off setting is a bool.

    Attributes:
        page_size: tokens per KV page.
        max_batch_size: most running requests.
        max_context_len: most tokens (prompt + generated) per request.
        max_tokens_per_step: token budget of one step (prefill chunks + decode tokens).
        chunk_size: most prompt tokens one request feeds per step (``None``: the budget).
        kv_tokens: KV pool capacity in tokens (``None``: ``max_batch_size · max_context_len``).
        prefix_caching: reuse computed whole pages of running requests with the same prefix.
        kernel_backend: force a kernel backend by name; ``None`` = best registered (a name
            nothing registered is refused when the engine is built).
        shuffle_pages_seed: hand out pages in a seeded random order (tests).
        swa_pool: sliding-window layers keep their KV in their own, smaller pool (hybrid SWA;
            a prefix is reused only while its donor still holds the SWA pages of the prefix's
            last window); ``False`` serves windows over the full pool.
        speculative: ``"ngram"`` = draft by prompt lookup and verify with one TARGET_VERIFY
            forward (:mod:`aiter_attn.engine.spec_decode`); ``None`` = plain decoding.
        num_draft_tokens: most draft tokens proposed per request and step.
        cuda_graph: replay DECODE steps (and n-gram chain TARGET_VERIFY steps) through
            captured CUDA graphs of the sizes 1, 2, 4, 8, … ``max_batch_size``
            (:mod:`aiter_attn.engine.graphs`); ``None`` = on when the model is on CUDA and
            known capturable (the engine's own decoder). Forced on for a CPU model it runs the
            same path in no-capture mode (tests).
        mixed_steps: run a step with both decoding requests and prefill chunks as one EXTEND
            forward (decode rows are extend rows of length 1: one attention launch per layer);
            ``False`` = a DECODE forward and an EXTEND forward. Pure decode steps stay DECODE
            either way. Not used with ``speculative`` (verify has its own forward) nor with
            ``batch_invariant`` (a decode row's numerics must not depend on prefills joining).
        debug_checks: run the backend in its checked mode (``BackendConfig.debug_checks``):
            every kernel call checks its index values first (syncs; ``generate --check``).
        batch_invariant: attention in batch-invariant mode (``BackendConfig.batch_invariant``):
            a request's attention output does not depend on what else is in its step's batch
            (``aiter-attn generate --deterministic``). The model's other layers are as they
            are.
        cascade_min_shared_tokens: cascade attention over shared prefix pages
            (``BackendConfig.cascade_min_shared_tokens``): requests reusing ≥ this many
            tokens of another's pages (``prefix_caching``) read them once per step for the
            whole group; ``None`` = off.
    """

    page_size: int = attrs.field(default=16, validator=_positive_int)
    max_batch_size: int = attrs.field(default=8, validator=_positive_int)
    max_context_len: int = attrs.field(default=2048, validator=_positive_int)
    max_tokens_per_step: int = attrs.field(default=512, validator=_positive_int)
    chunk_size: Optional[int] = attrs.field(default=None, validator=_positive_int_or_none)
    kv_tokens: Optional[int] = attrs.field(default=None, validator=_positive_int_or_none)
    prefix_caching: bool = attrs.field(default=True, validator=_flag)
    kernel_backend: Optional[str] = None
    shuffle_pages_seed: Optional[int] = attrs.field(default=None, validator=_shuffle_seed)
    swa_pool: bool = attrs.field(default=True, validator=_flag)
    speculative: Optional[str] = None
    num_draft_tokens: int = attrs.field(default=4, validator=_positive_int)
    cuda_graph: Optional[bool] = None
    debug_checks: bool = attrs.field(default=False, validator=_flag)
    batch_invariant: bool = attrs.field(default=False, validator=_flag)
    mixed_steps: bool = attrs.field(default=True, validator=_flag)
    cascade_min_shared_tokens: Optional[int] = None

    @property
    def num_pages(self) -> int:
        tokens = self.kv_tokens or self.max_batch_size * self.max_context_len
        return -(-tokens // self.page_size) + 1  # + the null page


@attrs.define
class EngineStats:
    """Token counts and wall time per phase (forward + sampling). A one-forward mixed step's
    time is split between the phases by token count; ``mixed_steps`` counts those steps."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    steps: int = 0
    mixed_steps: int = 0
    cached_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict:
        d = attrs.asdict(self)
        d["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


@attrs.frozen
class TokenEvent:
    """A token a request produced in a step (``finished`` once it is its last)."""

    request: Request
    token_id: int
    finished: bool


def _check_positions(model, config: EngineConfig) -> None:
    """Raise unless ``model`` has a position for every token a request may hold (a model
    with a ``max_positions`` attribute, e.g. its RoPE table; others are not limited)."""
    limit = getattr(model, "max_positions", None)
    if limit is not None and config.max_context_len > limit:
        raise ValueError(
            f"EngineConfig: max_context_len={config.max_context_len} but the model has "
            f"{limit} positions (max_positions); lower max_context_len to ≤ {limit} or build "
            f"the model with max_positions ≥ {config.max_context_len}.")


def _prompt_token_ids(prompt_ids, rid: int) -> list[int]:
    """``prompt_ids`` (a sequence of ints, a 1-D integer tensor or array) as a list of ints;
    ValueError for anything else (``int(11.7)`` used to feed token 11 without a word)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError(f"request {rid}: the prompt {prompt_ids[:40]!r} is text; pass its token "
                         "ids (encode it with the model's tokenizer first).")
    import torch

    # a tensor or an array says its rank; any other iterable is read as one prompt's ids
    array = isinstance(prompt_ids, torch.Tensor) or type(prompt_ids).__module__ == "numpy"
    if (array and prompt_ids.ndim != 1) or not isinstance(prompt_ids, Iterable):
        raise ValueError(f"request {rid}: the prompt must be a 1-D sequence of token ids, got "
                         f"{type(prompt_ids).__name__} {prompt_ids!r:.60}; wrap one prompt's ids "
                         "in a list ([ids]) when a list of prompts is expected.")
    values = list(prompt_ids)  # an iterator is read once
    ids = [as_int(v) for v in values]
    bad = [v for v, i in zip(values, ids) if i is None]
    if bad:
        raise ValueError(f"request {rid}: prompt token ids must be ints, got {bad[:5]!r}; "
                         "encode prompts with the model's own tokenizer.")
    return ids


class Engine:
    """Serve requests over ``model`` (any ``EngineModel``).

    Args:
        model: the model; its ``kv_layout`` sizes the pool.
        config: engine settings.
    """

    def __init__(self, model: EngineModel, config: EngineConfig = EngineConfig()):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config={config!r:.60} must be an EngineConfig, e.g. "
                            "EngineConfig(max_batch_size=8).")
        _check_positions(model, config)
        self.config = config
        self.kv = KVCacheManager(
            num_pages=config.num_pages, page_size=config.page_size,
            max_requests=config.max_batch_size, max_context_len=config.max_context_len,
            device=model.device, prefix_caching=config.prefix_caching,
            shuffle_seed=config.shuffle_pages_seed,
        )
        self.scheduler = Scheduler(self.kv, max_batch_size=config.max_batch_size,
                                   max_tokens_per_step=config.max_tokens_per_step,
                                   chunk_size=config.chunk_size or config.max_tokens_per_step)
        self.spec_decoder = make_spec_decoder(config)
        self.runner = ModelRunner(
            model, self.kv, max_batch_size=config.max_batch_size,
            kernel_backend=config.kernel_backend, swa_pool=config.swa_pool,
            batch_invariant=config.batch_invariant,
            cascade_min_shared_tokens=config.cascade_min_shared_tokens,
            chunk_tokens=max(config.chunk_size or config.max_tokens_per_step,
                             config.num_draft_tokens + 1),
            spec=self.spec_decoder.backend_spec if self.spec_decoder else None,
            cuda_graph=graphs_enabled(config.cuda_graph, model),
            debug_checks=config.debug_checks)
        self.requests: list[Request] = []
        self.stats = EngineStats()

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()
                    ) -> Request:
        """Queue a prompt; it joins the running batch at the next step with room for it."""
        req = self._checked_request(prompt_ids, params, rid=len(self.requests))
        self.scheduler.add(req)
        self.requests.append(req)
        return req

    def _checked_request(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                         rid: int) -> Request:
        """A new, not yet queued request; raises ValueError if it could never be served."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {rid}: params={params!r} must be a SamplingParams, e.g. "
                            "SamplingParams(max_new_tokens=16).")
        ids = _prompt_token_ids(prompt_ids, rid)
        vocab = self.runner.model.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}; "
                "encode prompts with the model's own tokenizer.")
        req = Request(rid=rid, prompt_ids=ids, params=params)
        self.kv.check_fits(req)
        return req

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenEvent]:
        """Run one step; return the tokens it produced.

        If the step raises (a kernel, the model, sampling), every request of it left half-way
        (KV slots reserved past its computed tokens, or fed without a sampled token) is
        finished with ``finish_reason="error"`` and its row and pages go back to the pool
        before the exception propagates; the engine's other requests go on unharmed.
        """
        plan = self.scheduler.schedule()
        try:
            return self._run(plan)
        except BaseException:
            self._finish_broken(plan)
            raise

    def _finish_broken(self, plan) -> None:
        """Finish the requests of a failed step that cannot go on: a running request can
        only if the allocator holds exactly its computed tokens and a token is left to feed
        (fed again from where it stood, it would write K/V one slot off and decode garbage)."""
        alloc = self.kv.allocator
        for req in [*plan.decode, *(r for r, _ in plan.prefill)]:
            if req.status is not RequestStatus.RUNNING:
                continue
            if alloc.tokens_held(req.row) != req.num_computed or req.num_pending < 1:
                log.warning("request %d failed mid-step; its pages go back to the pool",
                            req.rid)
                self.scheduler.finish(req, "error")

    def _run(self, plan) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        if plan.decode and plan.prefill and self._one_forward_mixed:
            return self._mixed_step(plan)
        if plan.decode and self.spec_decoder is not None:
            t0 = time.perf_counter()
            per_req = self.spec_decoder.decode_step(self.runner, plan.decode)
            self.stats.decode_seconds += time.perf_counter() - t0
            emitted = self._emit_many(plan.decode, per_req)
            # tokens accepted past a request's stop token are dropped, not counted
            self.stats.decode_tokens += len(emitted)
            events += emitted
        elif plan.decode:
            t0 = time.perf_counter()
            logits = self.runner.forward(ForwardMode.DECODE, [(r, 1) for r in plan.decode])
            tokens = sample_tokens(logits, plan.decode)
            self.stats.decode_seconds += time.perf_counter() - t0
            self.stats.decode_tokens += len(tokens)
            events += self._emit(plan.decode, tokens)
        if plan.prefill:
            t0 = time.perf_counter()
            self._count_cached(plan)
            logits = self.runner.forward(ForwardMode.EXTEND, plan.prefill)
            done = [i for i, (r, _) in enumerate(plan.prefill) if r.num_pending == 0]
            reqs = [plan.prefill[i][0] for i in done]
            tokens = sample_tokens(logits[done], reqs) if done else []
            self.stats.prefill_seconds += time.perf_counter() - t0
            self.stats.prefill_tokens += sum(n for _, n in plan.prefill)
            events += self._emit(reqs, tokens)
        self.stats.steps += 1
        return events

    @property
    def _one_forward_mixed(self) -> bool:
        c = self.config
        return c.mixed_steps and c.speculative is None and not c.batch_invariant

    def _count_cached(self, plan) -> None:
        joined_now = self.scheduler.step_index - 1
        self.stats.cached_tokens += sum(r.cached_tokens for r, _ in plan.prefill
                                        if r.joined_step == joined_now)

    def _mixed_step(self, plan) -> list[TokenEvent]:
        """One EXTEND forward over the decoding requests (rows of length 1, first) and the
        prefill chunks; samples every decode row and each prefill row whose prompt is done."""
        t0 = time.perf_counter()
        self._count_cached(plan)
        items = [(r, 1) for r in plan.decode] + list(plan.prefill)
        logits = self.runner.forward(ForwardMode.EXTEND, items)
        nd = len(plan.decode)
        done = list(range(nd)) + [nd + i for i, (r, _) in enumerate(plan.prefill)
                                  if r.num_pending == 0]
        reqs = [items[i][0] for i in done]
        tokens = sample_tokens(logits[done], reqs)
        dt = time.perf_counter() - t0
        n_pre = sum(n for _, n in plan.prefill)
        self.stats.decode_seconds += dt * nd / (nd + n_pre)
        self.stats.prefill_seconds += dt * n_pre / (nd + n_pre)
        self.stats.decode_tokens += nd
        self.stats.prefill_tokens += n_pre
        self.stats.mixed_steps += 1
        self.stats.steps += 1
        return self._emit(reqs[:nd], tokens[:nd]) + self._emit(reqs[nd:], tokens[nd:])

    def _emit(self, reqs: Iterable[Request], tokens: list[int]) -> list[TokenEvent]:
        out = []
        for req, tok in zip(reqs, tokens):
            req.output_ids.append(tok)
            reason = None
            if tok in req.params.stop_token_ids:
                reason = "stop"
            elif (len(req.output_ids) >= req.params.max_new_tokens
                  or req.num_tokens >= self.config.max_context_len):
                reason = "length"
            if reason is not None:
                self.scheduler.finish(req, reason)
            out.append(TokenEvent(req, tok, reason is not None))
        return out

    def _emit_many(self, reqs: Sequence[Request], tokens: list[list[int]]) -> list[TokenEvent]:
        """Emit each request's tokens in order (speculative steps), up to its finish."""
        out = []
        for req, toks in zip(reqs, tokens):
            for tok in toks:
                out += self._emit([req], [tok])
                if out[-1].finished:
                    break
        return out

    def run(self, on_step: Optional[Callable[[list], None]] = None) -> list[Request]:
        """Step until every queued request finished; ``on_step(events)`` after each step."""
        while self.has_work:
            events = self.step()
            if on_step is not None:
                on_step(events)
        return self.requests

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams()
                 ) -> list[list[int]]:
        """Generated ids for each prompt (all queued at once; none is queued when one of
        them is refused). ``params``: one for every prompt, or a sequence of one per prompt."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
            raise ValueError(f"generate: prompts={prompts!r:.60} must be a list of prompts, "
                             "each a list of token ids.")
        prompts = list(prompts)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, dict)):
            params = list(params)
        else:
            raise TypeError(f"generate: params={params!r:.60} must be a SamplingParams or a "
                            "sequence of one SamplingParams per prompt.")
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} SamplingParams; "
                             "pass one SamplingParams for all, or one per prompt.")
        first = len(self.requests)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self._checked_request(p, sp, rid=first + i)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.run()
        return [r.output_ids for r in reqs]
