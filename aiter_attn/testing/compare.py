"""Comparison helpers shared by tests and the conformance suite."""

__all__ = ["assert_close_rel"]

import math

import torch


#: A row's own relative error may exceed ``rtol`` by this factor: ``rtol`` bounds the
#: root-mean-square error over all rows and single rows of correct kernels scatter around it
#: (the suite's own cases reach 2.7×: float32 logits near 100 from fp8 per-token scales
#: spanning 10⁴); a row off by more than this is wrong, not rounded.
ROW_SLACK = 8.0
#: Rows whose reference norm is below this fraction of the root-mean-square row norm are held
#: to that floor (a fully masked query's zero row), not to their own norm.
ROW_FLOOR = 1e-3


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = ""):
    """Relative error ``‖a − e‖ / ‖e‖`` below ``rtol`` over all entries, and on every row (the
    last dimension) ``‖a_r − e_r‖ ≤ ROW_SLACK · rtol · max(‖e_r‖, ROW_FLOOR · rms_r ‖e_r‖)``,
    so a wrong row cannot hide in the norm of many right ones, nor a wrong small row in the
    norm of large ones. Reports NaN/inf (in either) and the worst entries or rows; ``actual``
    is reshaped to ``expected``'s shape (same element count)."""
    if not (math.isfinite(float(rtol)) and rtol >= 0):
        raise ValueError(f"{what}: rtol={rtol!r} must be a finite number ≥ 0 (a NaN or "
                         "infinite bound accepts every result).")
    a = actual.double().cpu().reshape(expected.shape)
    e = expected.double().cpu()
    bad = ~torch.isfinite(a)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite values at {bad.nonzero()[:5].tolist()}"
    bad = ~torch.isfinite(e)  # a NaN reference makes the error NaN, which no bound rejects
    assert not bad.any(), (f"{what}: expected has {int(bad.sum())} non-finite values at "
                           f"{bad.nonzero()[:5].tolist()}; compare only the finite entries.")
    denom = e.norm().clamp_min(1e-12)
    rel = float((a - e).norm() / denom)
    diff = (a - e).abs()
    if rel > rtol:
        worst = diff.reshape(-1).topk(min(5, diff.numel())).indices.tolist()
        raise AssertionError(
            f"{what}: relative error {rel:.3e} > {rtol:.1e}; "
            f"{int((diff > rtol * e.abs().max()).sum())} entries off; worst flat indices {worst}"
        )
    if e.dim() < 2 or e.numel() == 0:
        return  # one row: the bound above is the row bound
    # every row (last dimension) within ROW_SLACK·rtol of its own norm, floored at
    # ROW_FLOOR × the root-mean-square row norm (a zero reference row: a fully masked query)
    width = e.shape[-1]
    d_rows = (a - e).reshape(-1, width).norm(dim=-1)
    e_rows = e.reshape(-1, width).norm(dim=-1)
    floor = ROW_FLOOR * denom / math.sqrt(e_rows.numel())
    row_rel = d_rows / torch.maximum(e_rows, floor)
    off = row_rel > ROW_SLACK * rtol
    if off.any():
        idx = torch.nonzero(off).flatten()
        worst = int(row_rel.argmax())
        where = [int(i) for i in torch.unravel_index(torch.tensor(worst), e.shape[:-1])]
        raise AssertionError(
            f"{what}: relative error {rel:.3e} ≤ {rtol:.1e} over all, but {idx.numel()} of "
            f"{e_rows.numel()} rows (last dimension) exceed {ROW_SLACK}×{rtol:.1e} of their own "
            f"norm; worst row {where} (flat {worst}) at {float(row_rel[worst]):.3e} (its norm "
            f"{float(e_rows[worst]):.3e}, rms row norm {float(floor) / ROW_FLOOR:.3e}); rows "
            f"off: {idx[:8].tolist()}"
        )
