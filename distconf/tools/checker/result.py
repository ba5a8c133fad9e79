"""What one checked variant measured, and the tolerance its hidden states must meet."""

from __future__ import annotations

from dataclasses import dataclass, field

from distconf.tools.checker.failures import CheckFailure

__all__ = ["TOLERANCE", "CheckResult"]

TOLERANCE = 1e-5
"""Largest allowed |block - reference| relative to max(1, |reference|), in float32."""


@dataclass
class CheckResult:
    """Outcome of checking one tiny-config variant of one family."""

    family: str
    variant: str
    layers: int = 0
    params_per_block: int = 0
    full_diff: float | None = None
    incremental_diff: float | None = None
    kv_declared: int | None = None
    kv_actual: int | None = None
    cache_unit: str = "token"
    """What kv_declared / kv_actual count bytes of: 'token' (KV cache) or 'sequence' (a recurrent state)."""
    size_declared: int | None = None
    size_actual: int | None = None
    shards: int = 0
    seconds: float = 0.0
    failure: CheckFailure | None = None
    kinds: str | None = None
    """Layer-kind coverage of the family (the same for all its variants), e.g. '8/8 layer kinds of ... covered'."""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every comparison passed."""
        return self.failure is None
