"""Conformance cases: one named call of one op, with its shapes, features and error bound.

The default list (:func:`default_cases`) covers every op ``aiter-attn verify`` checks:
attention (``paged_attention``, ``paged_attention_5d``, ``mla_paged_attention``), the KV
writes (``write_kv``, ``write_kv_swa``, ``write_kv_5d``) and the index builders
(``build_page_table``, ``build_page_tables_swa``, ``build_ragged_kv_indices``,
``build_tree_mask``, ``build_draft_decode_indices``). Softmax scales, windows, soft-caps,
sinks and fp8 scales vary across the cases, so a kernel that ignores one of them fails.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

__all__ = [
    "RTOL",
    "ATTENTION_OPS",
    "WRITE_OPS",
    "INDEX_OPS",
    "NUMERIC_OPS",
    "OPS",
    "ConformanceCase",
    "default_cases",
    "with_dtype",
]

#: relative-error bounds by activation dtype (fp8 caches are compared with their dequantised
#: values, so the bound is that of the activation dtype).
RTOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

ATTENTION_OPS = ("paged_attention", "paged_attention_5d", "mla_paged_attention")
#: ops compared with a float64 oracle by relative error (the others compare exactly).
NUMERIC_OPS = ATTENTION_OPS + ("merge_attention_states",)
WRITE_OPS = ("write_kv", "write_kv_swa", "write_kv_5d")
INDEX_OPS = ("build_page_table", "build_page_tables_swa", "build_ragged_kv_indices",
             "build_tree_mask", "build_draft_decode_indices")
#: every op the suite checks.
OPS = NUMERIC_OPS + WRITE_OPS + INDEX_OPS

_E4M3FN = getattr(torch, "float8_e4m3fn", None)
_E4M3FNUZ = getattr(torch, "float8_e4m3fnuz", None)


def _tuple(v):
    return tuple(int(x) for x in v)


@attrs.frozen(kw_only=True)
class ConformanceCase:
    """One call and its bound.

    Attributes:
        name: stable id (``decode-page16-gqa5:1-d80``).
        op: one of :data:`OPS`.
        q_lens / kv_lens: per request, query tokens (KV writes: tokens written; tree mask:
            ignored, see ``q_len``) and total keys, this step's included.
        num_q_heads / num_kv_heads / head_dim / v_head_dim: shapes (MLA: one KV head,
            ``head_dim = kv_lora_rank + rope``, ``v_head_dim = kv_lora_rank``; a KV write with
            ``v_head_dim=0`` writes K only, as MLA's latent cache).
        page_size: tokens per page.
        dtype / kv_dtype: activation and cache dtypes (``kv_dtype=None``: same as ``dtype``).
        scale: ``softmax_scale`` (``None``: ``1/sqrt(head_dim)``).
        k_scale / v_scale: fp8 (de)quantisation scales.
        causal, window, softcap, sinks, custom_mask: the attention features.
        empty_rows: with ``custom_mask``, the first query of each request sees no key at all
            (its output must be zeros and its LSE ``-inf``, not NaN).
        lse: also ask for the log-sum-exp (``out_lse``), compared with the oracle's.
        v_layout: 5-D value layout, ``"shuffled"`` or ``"hd_page"`` (5-D ops).
        q_len / topk / num_steps: tree-mask draft tokens; draft-decode branches and steps.
        rtol: relative-error bound (default from :data:`RTOL`; exact ops compare exactly).
        quick: part of the ``--quick`` subset.
    """

    name: str
    op: str = "paged_attention"
    q_lens: tuple = attrs.field(converter=_tuple)
    kv_lens: tuple = attrs.field(converter=_tuple)
    num_q_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 64
    v_head_dim: Optional[int] = None
    page_size: int = 16
    dtype: torch.dtype = torch.float32
    kv_dtype: Optional[torch.dtype] = None
    scale: Optional[float] = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    causal: bool = True
    window: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    custom_mask: bool = False
    empty_rows: bool = False
    lse: bool = False
    v_layout: str = "shuffled"
    q_len: int = 1
    topk: int = 1
    num_steps: int = 1
    rtol: Optional[float] = None
    quick: bool = False
    seed: int = 0

    def __attrs_post_init__(self):
        if len(self.q_lens) != len(self.kv_lens) or any(
            q > k for q, k in zip(self.q_lens, self.kv_lens)
        ):
            raise ValueError(f"case {self.name}: q_lens={self.q_lens} must pair with kv_lens="
                             f"{self.kv_lens}, each q_len ≤ its kv_len.")
        if self.op not in OPS:
            raise ValueError(f"case {self.name}: op={self.op!r}; allowed: {', '.join(OPS)}.")
        if self.empty_rows and not self.custom_mask:
            raise ValueError(f"case {self.name}: empty_rows needs custom_mask (the mask hides "
                             "every key from those rows).")
        if self.v_layout not in ("shuffled", "hd_page"):
            raise ValueError(f"case {self.name}: v_layout={self.v_layout!r}; allowed: "
                             "shuffled, hd_page.")

    @property
    def bound(self) -> float:
        if self.op not in NUMERIC_OPS:
            return 0.0  # integers and copied bytes: exact
        return self.rtol if self.rtol is not None else RTOL[self.dtype]

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5


def default_cases() -> tuple:
    """The cases our own kernels pass: decode, prefill, extend, mixed; GQA 5:1, head dim 80;
    pages 1/16/48; windows (causal and two-sided), sinks, soft-caps, fp8, custom masks,
    non-causal, v dim ≠ qk dim; fp16/bf16; softmax scales other than 1/√d; the 5-D layout in
    both value layouts; MLA (kv_lora 512 + rope 64) with 4/8/16 heads, pages 1 and 64; on
    every attention op, rows that see no key and requests with no query (graph padding);
    every KV write and index builder."""
    C = ConformanceCase
    cases = [
        C(name="decode-page1-gqa4:1-d64", q_lens=(1, 1, 1, 1), kv_lens=(1, 7, 33, 64),
          page_size=1, quick=True),
        C(name="decode-page16-gqa5:1-d80", q_lens=(1, 1, 1), kv_lens=(16, 17, 70),
          num_q_heads=10, num_kv_heads=2, head_dim=80, scale=0.31, quick=True),
        C(name="decode-page48-mha-d64", q_lens=(1, 1), kv_lens=(48, 101), num_q_heads=4,
          num_kv_heads=4, page_size=48, scale=0.05),
        C(name="prefill-page16-gqa4:1-d64", q_lens=(17, 5, 33), kv_lens=(17, 5, 33),
          scale=0.2),
        C(name="extend-page16-prefix-crossing", q_lens=(5, 1, 9), kv_lens=(21, 17, 28),
          num_q_heads=8, num_kv_heads=2, scale=0.09),
        C(name="mixed-page48-gqa5:1-d80", q_lens=(1, 7, 1, 20), kv_lens=(50, 7, 97, 30),
          num_q_heads=10, num_kv_heads=2, head_dim=80, page_size=48, quick=True),
        C(name="window-page16-w8", q_lens=(1, 6, 3), kv_lens=(40, 20, 8), window=(7, 0),
          num_q_heads=4, num_kv_heads=2, scale=0.25, quick=True),
        C(name="window-page1-w1", q_lens=(1, 4), kv_lens=(9, 6), page_size=1, window=(0, 0)),
        C(name="window-two-sided-noncausal", q_lens=(4, 3), kv_lens=(20, 11), causal=False,
          window=(3, 2), scale=0.3),
        C(name="sinks-page16", q_lens=(1, 5, 2), kv_lens=(30, 5, 40), sinks=True, quick=True,
          scale=0.17),
        C(name="sinks-window-page16", q_lens=(1, 4), kv_lens=(50, 24), sinks=True,
          window=(15, 0), num_q_heads=8, num_kv_heads=2),
        C(name="softcap-page16", q_lens=(1, 6), kv_lens=(25, 30), softcap=5.0),
        C(name="softcap30-gemma-scale", q_lens=(1, 3), kv_lens=(33, 18), softcap=30.0,
          num_q_heads=4, num_kv_heads=2, scale=24 ** -0.5 * 4.0),
        C(name="noncausal-page16", q_lens=(3, 4), kv_lens=(20, 11), causal=False),
        C(name="custom-mask-page16", q_lens=(4, 3), kv_lens=(20, 35), custom_mask=True,
          quick=True, scale=0.3),
        C(name="custom-mask-empty-rows-lse", q_lens=(3, 2), kv_lens=(19, 30), custom_mask=True,
          empty_rows=True, lse=True, num_q_heads=4, num_kv_heads=2, scale=0.3),
        # a row that sees no key but has a sink: zeros out, LSE = the sink (not -inf)
        C(name="custom-mask-empty-rows-sinks-lse", q_lens=(2, 3), kv_lens=(17, 26),
          custom_mask=True, empty_rows=True, sinks=True, lse=True, num_q_heads=4,
          num_kv_heads=2, scale=0.3),
        # requests with no query this step (vLLM's graph padding: q_len 0, seqused_k 0) and
        # one with keys but no query, between requests that have queries
        C(name="mixed-page16-zero-length-requests", q_lens=(1, 0, 4, 0, 1),
          kv_lens=(20, 9, 33, 0, 17), num_q_heads=4, num_kv_heads=2, scale=0.21, quick=True),
        C(name="vdim32-qkdim48-page16", q_lens=(1, 5), kv_lens=(19, 12), head_dim=48,
          v_head_dim=32, scale=0.4),
        C(name="fp16-decode-page16-gqa4:1", q_lens=(1, 1, 1), kv_lens=(5, 40, 77),
          dtype=torch.float16, scale=0.2),
        C(name="bf16-extend-page16-gqa4:1", q_lens=(6, 9), kv_lens=(30, 9), dtype=torch.bfloat16),
    ]
    if _E4M3FN is not None:
        cases.append(C(name="fp8e4m3fn-page16-scales", q_lens=(1, 4), kv_lens=(33, 20),
                       kv_dtype=_E4M3FN, k_scale=0.5, v_scale=2.0, quick=True, scale=0.1))
    if _E4M3FNUZ is not None:
        cases.append(C(name="fp8e4m3fnuz-bf16-page16", q_lens=(1, 1), kv_lens=(12, 50),
                       dtype=torch.bfloat16, kv_dtype=_E4M3FNUZ, k_scale=0.25, v_scale=0.5))
    # the vectorised 5-D layout (x = 16 bytes / element: 4 for fp32, 8 for fp16)
    p5 = dict(op="paged_attention_5d")
    cases += [
        C(name="5d-decode-page16-gqa4:1", q_lens=(1, 1, 1), kv_lens=(16, 3, 45), scale=0.3,
          num_q_heads=8, num_kv_heads=2, quick=True, **p5),
        C(name="5d-extend-page16-hd_page", q_lens=(5, 1), kv_lens=(21, 40), v_layout="hd_page",
          scale=0.07, **p5),
        C(name="5d-fp16-window-sinks", q_lens=(1, 3), kv_lens=(40, 19), dtype=torch.float16,
          window=(9, 0), sinks=True, **p5),
        C(name="5d-softcap-page16", q_lens=(1, 4), kv_lens=(25, 30), softcap=5.0, scale=0.2,
          **p5),
        C(name="5d-noncausal-page16", q_lens=(3, 4), kv_lens=(20, 11), causal=False, **p5),
        C(name="5d-custom-mask-page16", q_lens=(4, 3), kv_lens=(20, 35), custom_mask=True,
          scale=0.3, **p5),
        C(name="5d-vdim32-qkdim48-page16", q_lens=(1, 5), kv_lens=(19, 12), head_dim=48,
          v_head_dim=32, scale=0.4, **p5),
        C(name="5d-window-two-sided-noncausal", q_lens=(4, 3), kv_lens=(20, 11), causal=False,
          window=(3, 2), scale=0.3, **p5),
        C(name="5d-custom-mask-empty-rows-lse", q_lens=(3, 2), kv_lens=(19, 30),
          custom_mask=True, empty_rows=True, lse=True, num_q_heads=4, num_kv_heads=2,
          scale=0.3, **p5),
        C(name="5d-zero-length-requests", q_lens=(1, 0, 3, 0), kv_lens=(20, 9, 21, 0),
          scale=0.23, **p5),
    ]
    if _E4M3FN is not None:
        cases.append(C(name="5d-fp8e4m3fn-page16-scales", q_lens=(1, 4), kv_lens=(33, 20),
                       kv_dtype=_E4M3FN, k_scale=0.5, v_scale=2.0, scale=0.1, **p5))
    mla = dict(op="mla_paged_attention", num_kv_heads=1, head_dim=576, v_head_dim=512)
    cases += [
        C(name="mla-decode-h16-page1", q_lens=(1, 1, 1), kv_lens=(3, 20, 41), num_q_heads=16,
          page_size=1, quick=True, scale=0.1352, **mla),
        C(name="mla-decode-h4-page64", q_lens=(1, 1), kv_lens=(64, 90), num_q_heads=4,
          page_size=64, scale=0.07, **mla),
        C(name="mla-verify-h8-page1", q_lens=(2, 2), kv_lens=(10, 31), num_q_heads=8,
          page_size=1, **mla),
        C(name="mla-extend-h16-page64", q_lens=(9, 1), kv_lens=(70, 5), num_q_heads=16,
          page_size=64, scale=0.1, **mla),
    ]
    cases.append(C(name="mla-custom-mask-h16-page1", q_lens=(3, 2), kv_lens=(12, 25),
                   num_q_heads=16, page_size=1, custom_mask=True, scale=0.1, **mla))
    cases.append(C(name="mla-custom-mask-empty-rows-lse-h16-page1", q_lens=(3, 2),
                   kv_lens=(12, 25), num_q_heads=16, page_size=1, custom_mask=True,
                   empty_rows=True, lse=True, scale=0.1, **mla))
    cases.append(C(name="mla-zero-length-requests-h16-page1", q_lens=(1, 0, 1, 0),
                   kv_lens=(14, 6, 30, 0), num_q_heads=16, page_size=1, scale=0.12, **mla))
    cases.append(C(name="mla-noncausal-h8-page16", q_lens=(4, 2), kv_lens=(21, 6),
                   num_q_heads=8, page_size=16, causal=False, scale=0.1, **mla))
    if _E4M3FN is not None:
        cases.append(C(name="mla-fp8-decode-h16-page1", q_lens=(1, 1), kv_lens=(17, 9),
                       num_q_heads=16, page_size=1, kv_dtype=_E4M3FN, k_scale=0.5,
                       v_scale=0.5, scale=0.12, **mla))
    # log-sum-exp outputs (return_lse / out_lse) and merging two partial states
    cases += [
        C(name="lse-extend-page16-gqa5:1-window-sinks", q_lens=(1, 6, 3), kv_lens=(40, 20, 9),
          num_q_heads=10, num_kv_heads=2, window=(11, 0), sinks=True, scale=0.2, lse=True,
          quick=True),
        C(name="lse-softcap-noncausal", q_lens=(3, 2), kv_lens=(17, 30), causal=False,
          softcap=5.0, lse=True),
        C(name="5d-lse-decode-page16", op="paged_attention_5d", q_lens=(1, 1),
          kv_lens=(33, 7), scale=0.15, lse=True),
        C(name="mla-lse-decode-h16-page1", op="mla_paged_attention", q_lens=(1, 2),
          kv_lens=(12, 30), num_q_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512,
          page_size=1, scale=0.11, lse=True),
        C(name="merge-states-with-empty-parts", op="merge_attention_states", q_lens=(5, 2),
          kv_lens=(5, 2), num_q_heads=6, head_dim=48, quick=True),
        C(name="merge-states-fp16", op="merge_attention_states", q_lens=(3,), kv_lens=(3,),
          num_q_heads=4, head_dim=64, dtype=torch.float16),
    ]
    # KV writes: this step's tokens to their slots; every other byte must stay as it was
    cases += [
        C(name="write_kv-page16-gqa", op="write_kv", q_lens=(3, 1, 7), kv_lens=(19, 16, 7),
          num_kv_heads=2, head_dim=80, quick=True),
        C(name="write_kv-page1-fp16", op="write_kv", q_lens=(2, 1), kv_lens=(5, 9),
          page_size=1, dtype=torch.float16, v_head_dim=32),
        C(name="write_kv-mla-latent-k-only", op="write_kv", q_lens=(1, 2), kv_lens=(30, 3),
          num_kv_heads=1, head_dim=72, v_head_dim=0),
        C(name="write_kv_swa-page16", op="write_kv_swa", q_lens=(4, 1), kv_lens=(20, 33),
          num_kv_heads=2, quick=True),
        C(name="write_kv_5d-shuffled-page16", op="write_kv_5d", q_lens=(2, 5), kv_lens=(17, 5),
          num_kv_heads=2, quick=True),
        C(name="write_kv_5d-hd_page-page16-fp16", op="write_kv_5d", q_lens=(1, 3),
          kv_lens=(40, 3), dtype=torch.float16, v_layout="hd_page"),
    ]
    if _E4M3FN is not None:  # fp8 caches: values divided by k_scale / v_scale
        fp8 = dict(kv_dtype=_E4M3FN, k_scale=0.5, v_scale=2.0, num_kv_heads=2)
        cases += [
            C(name="write_kv-fp8e4m3fn-page16-scales", op="write_kv", q_lens=(3, 1),
              kv_lens=(19, 16), **fp8),
            C(name="write_kv_swa-fp8e4m3fn-page16-scales", op="write_kv_swa", q_lens=(2, 1),
              kv_lens=(20, 33), **fp8),
            C(name="write_kv_5d-fp8e4m3fn-page16-scales", op="write_kv_5d", q_lens=(2, 3),
              kv_lens=(17, 5), **fp8),
        ]
    # index builders: integers, compared exactly
    cases += [
        C(name="page_table-page16", op="build_page_table", q_lens=(1, 1, 1),
          kv_lens=(1, 33, 16), quick=True),
        C(name="page_table-page1", op="build_page_table", q_lens=(1, 1), kv_lens=(5, 2),
          page_size=1),
        C(name="page_table-zero-length-request", op="build_page_table", q_lens=(1, 0, 1),
          kv_lens=(17, 0, 4)),
        C(name="page_tables_swa-page16", op="build_page_tables_swa", q_lens=(1, 1, 1),
          kv_lens=(40, 3, 17), quick=True),
        C(name="ragged_kv_indices", op="build_ragged_kv_indices", q_lens=(1, 1, 1),
          kv_lens=(7, 1, 20), quick=True),
        C(name="tree_mask-q4", op="build_tree_mask", q_lens=(4, 4), kv_lens=(9, 4), q_len=4,
          quick=True),
        C(name="draft_decode_indices-topk2-steps3-page4", op="build_draft_decode_indices",
          q_lens=(1, 1), kv_lens=(6, 9), page_size=4, topk=2, num_steps=3, quick=True),
        C(name="draft_decode_indices-topk1-steps2-page1", op="build_draft_decode_indices",
          q_lens=(1, 1, 1), kv_lens=(1, 4, 2), page_size=1, num_steps=2),
    ]
    return tuple(cases)


def with_dtype(case: ConformanceCase, dtype: torch.dtype) -> ConformanceCase:
    """``case`` with activations in ``dtype`` (the bound follows :data:`RTOL`); a 16-bit or
    fp32 cache follows too, an fp8 cache stays fp8. For kernels that take no float32."""
    if dtype not in RTOL:
        raise ValueError(f"dtype={dtype}; allowed: {sorted(map(str, RTOL))}.")
    kv = case.kv_dtype if case.kv_dtype not in (None, *RTOL) else None
    return attrs.evolve(case, dtype=dtype, kv_dtype=kv, rtol=None)
