"""Comparison helpers shared by tests and the conformance suite."""

__all__ = ["assert_close_rel"]

import torch


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = ""):
    """Relative error ``‖a − e‖ / ‖e‖`` below ``rtol``; reports NaN/inf (in either) and worst
    entries."""
    a = actual.double().cpu().reshape(expected.shape)
    e = expected.double().cpu()
    bad = ~torch.isfinite(a)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite values at {bad.nonzero()[:5].tolist()}"
    bad = ~torch.isfinite(e)  # a NaN reference makes the error NaN, which no bound rejects
    assert not bad.any(), (f"{what}: expected has {int(bad.sum())} non-finite values at "
                           f"{bad.nonzero()[:5].tolist()}; compare only the finite entries.")
    denom = e.norm().clamp_min(1e-12)
    rel = float((a - e).norm() / denom)
    if rel > rtol:
        diff = (a - e).abs()
        worst = diff.reshape(-1).topk(min(5, diff.numel())).indices.tolist()
        raise AssertionError(
            f"{what}: relative error {rel:.3e} > {rtol:.1e}; "
            f"{int((diff > rtol * e.abs().max()).sum())} entries off; worst flat indices {worst}"
        )
