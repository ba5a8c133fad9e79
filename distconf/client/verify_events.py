"""The evidence a spot check leaves: one `VerificationEvent` per server caught computing wrong."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["VerificationEvent"]


@dataclass(frozen=True)
class VerificationEvent:
    """A server whose results for a span differed from what independent servers agree on.

    :param peer_id: the base58 peer id of the server caught (banned by the client).
    :param start: first block of the span checked.
    :param end: one past its last block.
    :param step: the session's step (0-based) at which the check ran (for a forward or
        backward call: the call's index in the client).
    :param position: the first token position whose result differed.
    :param difference: the largest relative difference of the span's update over the positions
        checked (`distconf.client.verify_compare.update_difference`; ``inf`` for non-finite results).
    :param tolerance: the tolerance it was compared with.
    :param checkers: the independent servers whose results agreed with each other.
    :param kind: what was checked: an inference step, a forward or a backward call.
    :param when: wall-clock time of the detection (seconds since the epoch).
    """

    peer_id: str
    start: int
    end: int
    step: int
    position: int
    difference: float
    tolerance: float
    checkers: tuple[str, ...]
    kind: Literal["inference", "forward", "backward"] = "inference"
    when: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        """The event as JSON-ready values (``difference`` ``inf`` becomes the string ``"inf"``)."""
        data = asdict(self)
        data["checkers"] = list(self.checkers)
        if data["difference"] == float("inf"):
            data["difference"] = "inf"
        return data

    def describe(self) -> str:
        """One line for a log or a terminal."""
        who = ", ".join(f"…{p[-6:]}" for p in self.checkers) or "none"
        return (f"server …{self.peer_id[-6:]} computed blocks {self.start}..{self.end - 1} wrong "
                f"({self.kind} step {self.step}, position {self.position}: difference {self.difference:.3g} "
                f"> tolerance {self.tolerance:.3g}; independent servers {who} agree); banned")
