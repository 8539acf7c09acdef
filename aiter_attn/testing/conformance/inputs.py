"""Random inputs of a conformance case, and what a correct kernel must produce from them.

:func:`prepare` returns a :class:`Prepared`: every tensor argument of the call by name, the
names the op may write (``out``; a KV write's caches; an index builder's outputs), a
function that calls the op through :mod:`aiter_attn.ops` with a forced backend, and a judge
that compares what the call left in those tensors with the expectation.

Traps for kernels that read where they must not: pages are a random permutation of
``1..num_pages-1``; the null page 0 and every slot of a request's last page past its length
hold NaN; pages no request owns hold large noise. Output buffers start as NaN (attention)
or a sentinel integer (index builders), so a kernel that leaves part of its output unwritten
fails.
"""

from __future__ import annotations

from ._base import SENTINEL, Prepared, gen, lens_of
from .cases import ATTENTION_OPS, WRITE_OPS, ConformanceCase
from .exact import index_inputs, write_inputs
from .numeric import attention_inputs, merge_inputs

__all__ = ["Prepared", "prepare", "SENTINEL"]


def prepare(case: ConformanceCase, device="cpu", variant: int = 0) -> Prepared:
    """The inputs of ``case`` on ``device``; ``variant`` draws other values of the same shapes
    (for the second run of a graph-capturable kernel)."""
    g, lens = gen(case, variant), lens_of(case, variant)
    if case.op == "merge_attention_states":
        return merge_inputs(case, device, g)
    if case.op in ATTENTION_OPS:
        return attention_inputs(case, device, g, lens)
    if case.op in WRITE_OPS:
        return write_inputs(case, device, g, lens)
    return index_inputs(case, device, g, lens)
