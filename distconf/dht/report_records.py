"""The record a client publishes about the servers its spot checks caught: `ClientReport`, parsed strictly.

Stored under a model's `distconf.loader.naming.reports_key` with subkey = the reporting
client's peer id; value ``{"caught": [entry, ...]}`` with 1 to `MAX_CAUGHT` entries
(`CaughtServer`: the culprit's peer id, its span, the largest difference, the kind of
check, how many times, the last time). Parsed from *untrusted* data like server records
(`distconf.dht.records`): a wrong type, a made-up peer id, an empty or inverted span, a
NaN or a time in the future raises `RecordError`. Publishing and reading are
`distconf.dht.reports`; `distconf.dht.validators` refuses invalid reports at the door.

This module imports only pydantic (no torch, no hivemind).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from distconf.dht.peerids import peer_id_problem
from distconf.dht.records import MAX_NUM_BLOCKS, RecordError, _describe, _summarize

__all__ = ["MAX_CAUGHT", "MAX_CLOCK_SKEW", "MAX_REPORT_BYTES", "CaughtServer", "ClientReport", "report_problem"]

MAX_CAUGHT = 8
"""Most servers one client's report names (the most recently caught are kept)."""
MAX_REPORT_BYTES = 2048
"""Largest serialized report accepted (what `MAX_CAUGHT` entries take, with room to spare)."""
MAX_CLOCK_SKEW = 300.0
"""How far in the future a report's ``when`` may lie (peers' clocks differ)."""
_KIND = r"^[a-z_]{1,16}$"  # "inference", "forward", "backward"; newer clients may add kinds


class CaughtServer(BaseModel):
    """One server a client caught: who, which blocks, how wrong, how often, when last."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    peer_id: Annotated[str, Field(strict=True, max_length=64)]
    start: Annotated[int, Field(strict=True, ge=0, lt=MAX_NUM_BLOCKS)]
    end: Annotated[int, Field(strict=True, ge=1, le=MAX_NUM_BLOCKS)]
    difference: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=True)]  # +inf: non-finite results
    kind: Annotated[str, Field(strict=True, pattern=_KIND)] = "inference"
    count: Annotated[int, Field(strict=True, ge=1, le=2**31)] = 1
    when: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]

    @field_validator("peer_id")
    @classmethod
    def _peer(cls, value: str) -> str:
        problem = peer_id_problem(value)
        if problem is not None:
            raise ValueError(f"not a libp2p peer id: {problem}")
        return value

    @field_validator("difference", "when", mode="before")
    @classmethod
    def _float(cls, value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _span(self) -> CaughtServer:
        if self.start >= self.end:
            raise ValueError(f"start={self.start} must be < end={self.end}")
        if self.when > time.time() + MAX_CLOCK_SKEW:
            raise ValueError("when lies in the future")
        return self

    def to_wire(self) -> dict[str, Any]:
        """The entry as stored: a plain dict."""
        return self.model_dump()


class ClientReport(BaseModel):
    """What one client publishes: the servers it caught (1 to `MAX_CAUGHT`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    caught: Annotated[tuple[CaughtServer, ...], Field(max_length=MAX_CAUGHT)]

    def to_wire(self) -> dict[str, Any]:
        """The value stored on the DHT: ``{"caught": [entry, ...]}``."""
        return {"caught": [c.to_wire() for c in self.caught]}

    @classmethod
    def from_wire(cls, value: Any) -> ClientReport:
        """Parse a stored value; raise `RecordError` if it is not a valid report."""
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise RecordError(f"a client report must be a dict with string keys, got {_describe(value)}")
        caught = value.get("caught")
        if not isinstance(caught, (list, tuple)) or not all(isinstance(c, dict) for c in caught):
            raise RecordError(f"a client report's 'caught' must be a list of dicts, got {_describe(caught)}")
        if not 1 <= len(caught) <= MAX_CAUGHT:
            raise RecordError(f"a client report names 1 to {MAX_CAUGHT} servers, this one {len(caught)}")
        try:
            return cls(caught=tuple(caught))
        except ValidationError as e:
            raise RecordError(_summarize(e)) from None


def report_problem(value: Any) -> str | None:
    """Why ``value`` is not a valid client report, or None (for `distconf.dht.validators`)."""
    try:
        ClientReport.from_wire(value)
    except RecordError as e:
        return str(e)
    return None
