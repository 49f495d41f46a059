"""Shared assertions: relative errors with per-dtype thresholds."""

import torch

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``|a - b| / max(|b|, floor)`` in float64 (absolute error when both norms are 0)."""
    a, b = a.detach().double(), b.detach().double()
    denom = max(float(b.norm()), floor)
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())


def assert_close(a, b, dtype, what="", floor=0.0):
    """``floor`` bounds the denominator for quantities that are ~0 by construction (see the caller)."""
    err = rel_err(a, b, floor)
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.3e} >= {TOLERANCE[dtype]:.0e} ({dtype})"
