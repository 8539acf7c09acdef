"""Conformance suite for kernel implementations (ours and plugins'): what
``aiter-attn verify`` runs.

Each :class:`ConformanceCase` is one named call of an op (attention, KV write or index
builder; :data:`OPS`) on random data over a block-permuted paged cache with NaN traps where
a correct kernel never reads, checked against the float64 oracle (attention, by relative
error with a bound per case) or the torch reference (KV writes and index builders, byte for
byte), with every input compared byte for byte before and after, and a second run with the
same buffers for kernels that declare graph support (:mod:`.runner` lists the checks).
Running a case through a backend selected *by name* yields a :class:`CaseResult`: ``pass``,
``fail`` (the check that failed, in ``reason``) or ``unsupported`` (the backend's declared
capabilities do not cover the case; the registry's reason is kept).

From the command line: ``aiter-attn verify --backend NAME [--op OP] [--quick] [--json]``;
``aiter-attn verify --self-test`` shows that the suite fails deliberately broken kernels
(:mod:`.mutants`). From pytest (a plugin's own test suite)::

    import pytest
    from aiter_attn.testing.conformance import conformance_params, run_case

    @pytest.mark.parametrize("case", conformance_params())
    def test_conformance(case):
        run_case(case, backend="myvendor", device="cuda").raise_for_status()
"""

from .cases import (
    ATTENTION_OPS,
    INDEX_OPS,
    OPS,
    RTOL,
    WRITE_OPS,
    ConformanceCase,
    default_cases,
    with_dtype,
)
from .inputs import Prepared, prepare
from .runner import (
    CASES,
    CaseResult,
    ConformanceError,
    ConformanceReport,
    conformance_params,
    run_case,
    run_conformance,
    select_cases,
)

__all__ = [
    "RTOL",
    "OPS",
    "ATTENTION_OPS",
    "WRITE_OPS",
    "INDEX_OPS",
    "ConformanceCase",
    "CaseResult",
    "ConformanceReport",
    "ConformanceError",
    "CASES",
    "default_cases",
    "conformance_params",
    "prepare",
    "Prepared",
    "run_case",
    "run_conformance",
    "select_cases",
    "with_dtype",
]
