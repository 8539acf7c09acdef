"""A small reference engine that composes aiter_attn the way SGLang would: a Llama-family
decoder whose attention calls ``AttentionBackend``, continuous batching over the paged KV cache
with chunked prefill and prefix sharing, and greedy/seeded sampling. See ``docs/engine.md``."""

from .check import Divergence, compare_outputs, hf_greedy
from .engine import Engine, EngineConfig, EngineStats, TokenEvent
from .kv_manager import KVCacheManager
from .loading import (ContextLengthError, InvalidModelFileError, LoadedModel, ModelNotFoundError,
                      check_prompt_fits, context_limit, default_model_path, load_model)
from .model import SUPPORTED_MODEL_TYPES, LlamaFamilyModel, UnsupportedArchitectureError
from .protocol import EngineModel, KVLayout
from .random_models import RANDOM_CONFIGS, build_random_model
from .request import Request, RequestStatus, SamplingParams
from .scheduler import Scheduler, StepPlan
from .threads import ThreadChoice, apply_threads, choose_threads
from .tokenizer import ByteTokenizer, encode_prompt, stop_token_ids

__all__ = [
    "Engine", "EngineConfig", "EngineStats", "TokenEvent", "KVCacheManager", "LoadedModel",
    "ModelNotFoundError", "InvalidModelFileError", "ContextLengthError", "check_prompt_fits",
    "context_limit", "default_model_path", "load_model", "SUPPORTED_MODEL_TYPES",
    "LlamaFamilyModel", "UnsupportedArchitectureError", "EngineModel", "KVLayout",
    "RANDOM_CONFIGS", "build_random_model", "Request", "RequestStatus", "SamplingParams",
    "Scheduler", "StepPlan", "ByteTokenizer", "encode_prompt", "stop_token_ids",
    "Divergence", "compare_outputs", "hf_greedy", "ThreadChoice", "choose_threads",
    "apply_threads",
]
