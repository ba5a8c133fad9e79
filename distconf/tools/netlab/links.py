"""A link's properties, as the lab's wire (`distconf.tools.netlab.wire`) applies them to each direction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LinkSpec"]


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link: one-way delay and jitter (ms), rate (Mbit/s, 0: unlimited), loss (0..1)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float = 0.0
    loss: float = 0.0
    queue_packets: int = 1000

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinkSpec:
        """The spec named by a ``link`` command's fields (unknown fields refused)."""
        fields = {k: v for k, v in data.items() if k not in ("op", "src", "dst")}
        spec = cls(**fields)
        if spec.delay_ms < 0 or spec.jitter_ms < 0 or spec.rate_mbit < 0 or not 0 <= spec.loss <= 1:
            raise ValueError(f"link values out of range: {fields}")
        return spec
