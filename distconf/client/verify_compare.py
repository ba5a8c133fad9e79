"""How two servers' results for one span are compared: the relative difference of the span's update.

A span maps inputs ``x`` to outputs ``y``. Hidden states are dominated by the residual
stream, so comparing ``y`` directly would hide a server that skips its blocks (``y = x``)
or adds noise: the difference is measured against the span's *update* ``y - x`` instead,
per token position:

    difference = ||y_checked - y_reference|| / ||y_reference - x||

(``||.||`` the L2 norm over the hidden dimension; a non-finite result counts as an infinite
difference). Honest servers differ only by floating-point noise (dtype, batch composition,
a prefill versus token-by-token decoding, CPU kernels); `DEFAULT_TOLERANCES` holds the
largest honest difference measured per dtype with a margin (``benchmarks/bench_verify.py
--calibrate`` measures them again).
"""

from __future__ import annotations

import math

import torch

__all__ = ["DEFAULT_TOLERANCES", "update_difference", "tolerance_for"]

DEFAULT_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-3,
    torch.float16: 5e-2,
    torch.bfloat16: 1e-1,
}
"""Default tolerance per compute dtype (see the module docstring); other dtypes use the bfloat16 one."""

_TINY = 1e-6  # relative to the inputs' norm: an update smaller than this counts as this small


def update_difference(inputs: torch.Tensor, reference: torch.Tensor, checked: torch.Tensor) -> torch.Tensor:
    """The relative difference of ``checked`` from ``reference`` per position, ``[batch, positions]``.

    All three are ``[batch, positions, hidden]``: the span's inputs and two results for them.
    Non-finite values give ``inf``.
    """
    x, ref, got = inputs.float(), reference.float(), checked.float()
    scale = (ref - x).norm(dim=-1).maximum(_TINY * x.norm(dim=-1)).clamp_min(torch.finfo(torch.float32).tiny)
    difference = (got - ref).norm(dim=-1) / scale
    finite = torch.isfinite(got).all(dim=-1) & torch.isfinite(ref).all(dim=-1)
    return torch.where(finite & torch.isfinite(difference), difference, torch.full_like(difference, math.inf))


def tolerance_for(dtype: torch.dtype | None, configured: float | None = None) -> float:
    """``configured`` if given, else the default tolerance for results computed in ``dtype``."""
    if configured is not None:
        return float(configured)
    return DEFAULT_TOLERANCES.get(dtype or torch.float32, DEFAULT_TOLERANCES[torch.bfloat16])
