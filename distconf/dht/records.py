"""Typed models of the records peers keep on the DHT (wire-compatible with Petals 2.x).

Two kinds of record exist, both in Petals 2.x's format:

* a **server record**, stored under the block's uid (``"<dht_prefix>.<index>"``, built by
  `distconf.loader.naming.block_uid`) with subkey = the server's peer id in base58 and
  value ``(state, throughput, extra)``;
* a **model-registry record**, stored under key ``"_petals.models"`` with subkey =
  ``dht_prefix`` and value ``{"num_blocks": n, "repository": str | None}``.

Both are parsed from *untrusted* data (any peer may store anything under any key), so
parsing is strict: a wrong type, an unknown state, a negative or non-finite number or
an absurdly large value raises `RecordError` (a `ValueError`); unknown keys in
``extra`` are ignored, so newer peers can add fields. ``to_wire`` produces exactly what
Petals 2.x stores (same values, same key order, so the same msgpack bytes), and
``from_wire(MSGPackSerializer.loads(MSGPackSerializer.dumps(record.to_wire())))`` equals
the record. Every record a Petals 2.x server writes parses, including ``next_pings``
entries of ``+inf`` (Petals' mark of a failed ping).

This module imports only pydantic (no torch, no hivemind).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from distconf.loader.naming import CHAIN_DELIMITER, UID_DELIMITER, block_uid, dht_prefix_problem, parse_block_uid

__all__ = [
    "CHAIN_DELIMITER",
    "MAX_NUM_BLOCKS",
    "MODELS_REGISTRY_KEY",
    "UID_DELIMITER",
    "ModelInfo",
    "RecordError",
    "ServerInfo",
    "ServerState",
    "block_uid",
    "listing_prefix_problem",
    "parse_block_uid",
]

MODELS_REGISTRY_KEY = "_petals.models"
"""DHT key under which public models are listed (subkey = dht_prefix)."""

MAX_STR_LEN = 1024
"""Longest string accepted in a record (names, versions, dtypes); longer is rejected."""
MAX_ITEMS = 4096
"""Most items accepted in a list or mapping inside a record."""
MAX_INT = 2**63 - 1
"""Largest integer accepted (cache tokens, block indices)."""
MAX_NUM_BLOCKS = 1024
"""Largest block count accepted in a model listing: real models have at most a few
hundred blocks, and a client reads one key per block, so a bigger claim is refused."""


class RecordError(ValueError):
    """A DHT record does not match the expected schema (the message says where)."""


class ServerState(IntEnum):
    """State of a server as announced on the DHT (same numbers as Petals 2.x)."""

    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


_Rps = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
_Ping = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=True)]  # +inf = failed ping (NaN fails ge=0)
_Str = Annotated[str, Field(strict=True, max_length=MAX_STR_LEN)]
_NonNegInt = Annotated[int, Field(strict=True, ge=0, le=MAX_INT)]


def _check_state(value: Any) -> ServerState:
    if isinstance(value, ServerState):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"state must be an integer 0, 1 or 2, got {type(value).__name__}")
    try:
        return ServerState(value)
    except ValueError:
        raise ValueError(f"state must be 0 (offline), 1 (joining) or 2 (online), got {value}") from None


class ServerInfo(BaseModel):
    """What a server announces for each block it serves: ``(state, throughput, extra)``.

    ``throughput`` is in requests per second (finite, >= 0). Every other field lives in
    the ``extra`` dict on the wire and is optional. ``start_block``/``end_block`` give
    the server's whole span (end exclusive). ``next_pings`` maps peer ids to round-trip
    seconds, ``+inf`` for a failed ping (as Petals 2.x stores it); NaN and negatives are
    invalid.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    state: ServerState
    throughput: _Rps

    start_block: _NonNegInt | None = None
    end_block: _NonNegInt | None = None
    public_name: _Str | None = None
    version: _Str | None = None
    network_rps: _Rps | None = None
    forward_rps: _Rps | None = None
    inference_rps: _Rps | None = None
    adapters: Annotated[tuple[_Str, ...], Field(max_length=MAX_ITEMS)] = ()
    torch_dtype: _Str | None = None
    quant_type: _Str | None = None
    using_relay: Annotated[bool, Field(strict=True)] | None = None
    cache_tokens_left: _NonNegInt | None = None
    next_pings: Annotated[dict[_Str, _Ping], Field(max_length=MAX_ITEMS)] | None = None

    @field_validator("state", mode="before")
    @classmethod
    def _state(cls, value: Any) -> ServerState:
        return _check_state(value)

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapters(cls, value: Any) -> Any:
        # msgpack returns tuples as tuples (hivemind's ext type) and lists as lists;
        # accept both, but never a bare string (which would split into characters).
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"adapters must be a list of strings, got {type(value).__name__}")
        return tuple(value)

    @model_validator(mode="after")
    def _span(self) -> ServerInfo:
        if self.start_block is not None and self.end_block is not None and self.start_block >= self.end_block:
            raise ValueError(f"start_block={self.start_block} must be < end_block={self.end_block}")
        return self

    # ------------------------------------------------------------------ wire format
    def to_wire(self) -> tuple[int, float, dict[str, Any]]:
        """The value stored on the DHT: ``(state, throughput, extra)``, exactly as Petals 2.x stores it."""
        extra = self.model_dump(exclude={"state", "throughput"})
        return (int(self.state), float(self.throughput), extra)

    @classmethod
    def from_wire(cls, value: Any) -> ServerInfo:
        """Parse a stored value; raise `RecordError` if it is not a valid server record.

        Accepts a tuple or list ``(state, throughput)`` or ``(state, throughput, extra)``
        where ``extra`` is a dict with string keys; unknown ``extra`` keys are ignored.
        """
        if not isinstance(value, (tuple, list)) or not 2 <= len(value) <= 3:
            raise RecordError(f"server record must be a (state, throughput, extra) tuple, got {_describe(value)}")
        extra = value[2] if len(value) == 3 else {}
        if not isinstance(extra, dict):
            raise RecordError(f"server record extra must be a dict, got {_describe(extra)}")
        if len(extra) > MAX_ITEMS or not all(isinstance(k, str) for k in extra):
            raise RecordError("server record extra must be a dict with at most "
                              f"{MAX_ITEMS} string keys")
        known = {k: v for k, v in extra.items() if k in cls.model_fields and k not in ("state", "throughput")}
        try:
            return cls(state=value[0], throughput=value[1], **known)
        except ValidationError as e:
            raise RecordError(_summarize(e)) from None


class ModelInfo(BaseModel):
    """A model listed under ``_petals.models``: ``{"num_blocks": n, "repository": ...}``.

    ``num_blocks`` is at most `MAX_NUM_BLOCKS`; the listing is a hint written by any
    peer, so a client that knows the model's config trusts the config instead.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    num_blocks: Annotated[int, Field(strict=True, ge=1, le=MAX_NUM_BLOCKS)]
    repository: _Str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The value stored on the DHT (a plain dict, exactly as Petals 2.x stores it)."""
        return {"num_blocks": self.num_blocks, "repository": self.repository}

    @classmethod
    def from_wire(cls, value: Any) -> ModelInfo:
        """Parse a stored value; raise `RecordError` if it is not a valid registry record."""
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value) or len(value) > MAX_ITEMS:
            raise RecordError(f"model record must be a dict with string keys, got {_describe(value)}")
        known = {k: v for k, v in value.items() if k in cls.model_fields}
        try:
            return cls(**known)
        except ValidationError as e:
            raise RecordError(_summarize(e)) from None


MAX_PREFIX_LEN = 256
"""Longest DHT prefix accepted as a model listing's subkey."""


def listing_prefix_problem(subkey: Any) -> str | None:
    """Why ``subkey`` cannot be a model listing's subkey (a DHT prefix), or None if it can."""
    problem = dht_prefix_problem(subkey)
    if problem is None and len(subkey) > MAX_PREFIX_LEN:
        problem = f"it is longer than {MAX_PREFIX_LEN} characters"
    if problem is None and not subkey.isprintable():
        problem = "it holds control characters"
    return problem


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def _summarize(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        loc = ".".join(str(x) for x in item["loc"]) or "record"
        parts.append(f"{loc}: {item['msg']}")
    more = error.error_count() - len(parts)
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


