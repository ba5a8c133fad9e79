"""The versioned JSON schema of ``/api/v1/state``: pydantic models, one per object.

`SwarmStateV1` is what the monitor serves; its JSON Schema (``SwarmStateV1.model_json_schema()``,
served at ``/api/v1/schema``) is the documentation of record. Compatibility rule: within
``schema_version`` 1, fields are only ever added (never renamed, retyped or removed);
anything else bumps the version and the URL (``/api/v2/...``).

Every list is bounded: blocks by `distconf.dht.MAX_NUM_BLOCKS`, servers per model by the
request's page size (``servers_total`` counts them all), models by the monitor's
``max_models``, pings per server by `MAX_PINGS`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MAX_CAUGHT_ROWS", "MAX_PINGS", "SCHEMA_VERSION", "CaughtRowV1", "ModelStateV1", "RouteV1", "ServerRowV1",
           "SwarmStateV1"]

SCHEMA_VERSION = 1
"""Version of the ``/api/v1/state`` schema (see the compatibility rule above)."""
MAX_PINGS = 8
"""Most ``next_pings`` entries listed per server (the fastest ones)."""
MAX_CAUGHT_ROWS = 100
"""Most rows of "caught by clients" listed per model (the most recently reported)."""

_CONFIG = ConfigDict(extra="forbid", frozen=True)


class ServerRowV1(BaseModel):
    """One span of consecutive blocks served by one peer, with what its record says."""

    model_config = _CONFIG

    peer_id: str = Field(description="libp2p peer id (base58)")
    peer_id_short: str = Field(description="the peer id shortened for display: '..' + its last 8 characters")
    public_name: str | None = Field(None, description="name the server announces (untrusted text)")
    start: int = Field(description="first block of the span")
    end: int = Field(description="one past the last block of the span")
    state: Literal["offline", "joining", "online"] = Field(description="announced state")
    throughput: float = Field(description="announced throughput, requests per second")
    inference_rps: float | None = Field(None, description="announced inference throughput (requests/s)")
    network_rps: float | None = Field(None, description="announced network throughput (requests/s)")
    cache_tokens_left: int | None = Field(None, description="attention cache tokens the server has left")
    torch_dtype: str | None = Field(None, description="dtype of the served weights")
    quant_type: str | None = Field(None, description="quantization of the served weights")
    version: str | None = Field(None, description="server software version")
    using_relay: bool | None = Field(None, description="whether the server is reached through a relay")
    next_pings: dict[str, float | None] = Field(
        default_factory=dict,
        description=f"round-trip seconds to next servers (at most {MAX_PINGS}, fastest first; null = failed ping)")


class RouteV1(BaseModel):
    """Whether a client finds a full route through ONLINE servers (as clients route)."""

    model_config = _CONFIG

    exists: bool = Field(description="a chain of online servers covers every block")
    bottleneck_rps: float | None = Field(None, description="throughput of the slowest hop of the route")
    hops: int = Field(0, description="number of servers on the route")
    first_gap: int | None = Field(None, description="first block no online server covers (when no route)")
    message: str = Field("", description="why no route exists, or a one-line summary of the route")


class CaughtRowV1(BaseModel):
    """A server that clients say their spot checks caught computing a span wrong: a CLAIM, not a proof.

    Any peer can publish a report (in Petals-compatible mode even under another peer's
    id), so a row says what clients claim; a client that verifies checks every server itself.
    """

    model_config = _CONFIG

    peer_id: str = Field(description="libp2p peer id of the server the reports name")
    peer_id_short: str = Field(description="the peer id shortened for display")
    start: int = Field(description="first block of the span reported")
    end: int = Field(description="one past the last block of the span reported")
    reports: int = Field(description="distinct clients (reporter peer ids) claiming it")
    detections: int = Field(description="detections those clients count in all")
    last_seen: float = Field(description="unix time of the latest detection reported")
    max_difference: float | None = Field(
        description="largest relative difference reported (null: non-finite results)")
    kinds: list[str] = Field(default_factory=list, description="what was checked: inference, forward, backward")
    reporters: list[str] = Field(default_factory=list, description="the reporting clients' peer ids (at most 8)")


class ModelStateV1(BaseModel):
    """Coverage, servers and route of one model."""

    model_config = _CONFIG

    dht_prefix: str = Field(description="the model's DHT prefix (block uids are '<prefix>.<index>')")
    num_blocks: int = Field(description="block count (from the command line, else the swarm's listing)")
    repository: str | None = Field(None, description="repository named in the model listing (untrusted text)")
    listed: bool = Field(description="listed under _petals.models (false: named on the command line)")
    online_per_block: list[int] = Field(description="per block, the number of ONLINE servers")
    joining_per_block: list[int] = Field(description="per block, the number of JOINING servers")
    blocks_covered: int = Field(description="blocks with at least one ONLINE server")
    servers: list[ServerRowV1] = Field(description="spans, sorted by start block then peer (one page of them)")
    servers_total: int = Field(description="number of spans in all (servers lists servers_offset.. of them)")
    servers_offset: int = Field(0, description="index of servers[0] among all spans")
    peers_total: int = Field(description="distinct peers announcing at least one block")
    peers_by_state: dict[str, int] = Field(
        description="distinct peers per state (a peer counts at the best state of its spans)")
    route: RouteV1 = Field(description="the route a client would take through online servers")
    skipped_records: int = Field(description="records ignored as malformed (as discovery skips them)")
    failed_blocks: int = Field(description="blocks whose DHT search failed or timed out")
    read_at: float = Field(description="unix time when the latest successful read of this model started")
    read_seconds: float = Field(description="how long that read took")
    error: str | None = Field(None, description="why the latest read failed (the data shown is older)")
    caught: list[CaughtRowV1] = Field(
        default_factory=list,
        description=f"servers clients CLAIM their spot checks caught (latest first, at most {MAX_CAUGHT_ROWS})")
    caught_total: int = Field(0, description="rows of caught servers in all (caught lists the latest of them)")
    skipped_reports: int = Field(0, description="client reports ignored as malformed")
    kv_bytes_per_token: int | None = Field(
        None, description="bytes a K/V-keeping block keeps per token, bfloat16 (null: the model's config is unknown)")
    state_bytes_per_sequence: int | None = Field(
        None, description="bytes a state-keeping block keeps per sequence, bfloat16 (0: no block keeps a state; "
                          "null: unknown)")
    kv_blocks: int | None = Field(None, description="blocks keeping K/V (null: unknown)")
    state_blocks: int | None = Field(None, description="blocks keeping a per-sequence state (null: unknown)")


class SwarmStateV1(BaseModel):
    """Everything ``/api/v1/state`` returns: the last good snapshot of the swarm and its age."""

    model_config = _CONFIG

    schema_version: Literal[1] = Field(SCHEMA_VERSION, description="version of this schema")
    read_at: float | None = Field(description="unix time when the read of this snapshot started (null: not read yet)")
    age_seconds: float | None = Field(description="seconds since read_at, when this response was made")
    refresh_seconds: float = Field(description="how often the monitor reads the swarm")
    refreshing: bool = Field(description="a read of the swarm is under way")
    error: str | None = Field(None, description="why the latest read of the model listing failed")
    models: list[ModelStateV1] = Field(description="models, sorted by DHT prefix")
    models_not_read: int = Field(0, description="listed models beyond the monitor's max_models, not read")
    skipped_listings: int = Field(0, description="model listing entries ignored as malformed")
