"""How two servers' results for one span are compared: the relative difference of the span's update.

A span maps inputs ``x`` to outputs ``y``. Hidden states are dominated by the residual
stream, so comparing ``y`` directly would hide a server that skips its blocks (``y = x``)
or adds noise: the difference is measured against the span's *update* ``y - x`` instead,
per token position:

    difference = ||y_checked - y_reference|| / ||y_reference - x||

(``||.||`` the L2 norm over the hidden dimension; a non-finite result counts as an infinite
difference).

`DEFAULT_TOLERANCES` come from ``benchmarks/bench_verify_tolerance.py``, which measures honest
servers' differences: token-by-token decoding versus one catch-up call over the same
positions (what a check compares), a session alone versus batched with sessions of other
lengths, torch threads 1 versus 2, on every family's tiny blocks and on spans of the real
model with its real hidden states. Largest honest difference measured: float32 2e-6,
float16 7e-3, bfloat16 3e-2 (a wider dtype's result of the same weights, a bound for other
kernels, is within 4e-6 in float32). The defaults sit 3-500x above those: float32 1e-3 (room
for other hardware's kernels), float16 3e-2, bfloat16 1e-1. Liars on the real model differ
far more in float32: 3 % weight noise on one block of 15 by 1.7e-2, one skipped block by 9e-2,
a stale reply by 0.6, skipped compute by 1.0; in the half types a few percent of weight noise
is hidden in honest rounding (float16 catches 10 %, bfloat16 30 %), and only gross lies stand
out (docs/security.md, Threat model). The tolerance holds between servers of the same dtype and
quantization: an int8 server differs from a float32 one by ~1.5e-2, a bfloat16 or float16
result from a float32 one by up to 0.26 or 0.03 on tiny blocks.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DEFAULT_TOLERANCES", "update_difference", "tolerance_for"]

DEFAULT_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-3,
    torch.float16: 3e-2,
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
