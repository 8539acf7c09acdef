"""A throwaway plugin registering the conformance suite's deliberately broken kernels
(``mutant-*`` backends, see ``aiter_attn.testing.conformance.mutants``): ``aiter-attn verify``
must fail each of them."""

from aiter_attn.testing.conformance.mutants import aiter_attn_register_kernels  # noqa: F401
