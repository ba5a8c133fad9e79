"""Read a swarm into the schema of `distconf.monitor.state_schema`, with discovery's own functions.

`read_models` reads the ``_petals.models`` listing and then each model's blocks with
`distconf.dht.find_servers_by_prefix` (the same batched read and the same record checks
as `distconf.dht.find_block_servers`: a malformed record is skipped, and counted, exactly
as discovery skips it), then the clients' reports of servers they caught
(`distconf.dht.reports.read_reports`, summed per server and span by `caught_rows`: claims,
shown as such). `model_state` turns one `SwarmState` into a `ModelStateV1`.
Everything here is synchronous and blocking: `distconf.monitor.refresher` runs it in a
worker thread, never in the web server's event loop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from distconf.dht import (
    NoRouteError,
    RemoteSpan,
    ServerState,
    SwarmState,
    find_servers_by_prefix,
    make_route,
    read_model_listing,
)
from distconf.dht.report_records import ClientReport
from distconf.dht.reports import read_reports
from distconf.monitor.figures import figures_of_repository
from distconf.monitor.state_schema import MAX_CAUGHT_ROWS, MAX_PINGS, CaughtRowV1, ModelStateV1, RouteV1, ServerRowV1

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT

__all__ = [
    "ListingRead", "ModelWanted", "caught_rows", "describe_error", "model_state", "read_listing", "read_model",
    "route_of", "server_row", "short_peer_id", "with_error",
]

logger = logging.getLogger(__name__)

_STATE_NAMES = {ServerState.OFFLINE: "offline", ServerState.JOINING: "joining", ServerState.ONLINE: "online"}


@dataclass(frozen=True)
class ModelWanted:
    """A model to read: its prefix, block count, listing repository, and whether it is listed."""

    dht_prefix: str
    num_blocks: int
    repository: str | None = None
    listed: bool = True


@dataclass(frozen=True)
class ListingRead:
    """The models to read this round, how many listed ones were left out, and bad listings."""

    models: list[ModelWanted]
    not_read: int
    skipped: int


def read_listing(dht: DHT, extra: Mapping[str, int], *, max_models: int, timeout: float,
                 repositories: Mapping[str, str] | None = None) -> ListingRead:
    """Models listed on the swarm plus ``extra`` ({prefix: num_blocks}, which win), at most ``max_models``.

    An extra model the listing does not name takes its repository from ``repositories`` (the preset
    the operator named), so its cache figures are known.

    Models named in ``extra`` always come first (the operator asked for them); listed ones
    follow in prefix order until ``max_models`` is reached.
    """
    listed, skipped = read_model_listing(dht, timeout=timeout)
    named = repositories or {}
    wanted = [ModelWanted(p, n, listed[p].repository if p in listed else named.get(p), p in listed)
              for p, n in sorted(extra.items())]
    others = [ModelWanted(p, info.num_blocks, info.repository) for p, info in sorted(listed.items())
              if p not in extra]
    room = max(0, max_models - len(wanted))
    return ListingRead(wanted + others[:room], max(0, len(others) - room), len(skipped))


def read_model(dht: DHT, model: ModelWanted, *, timeout: float) -> ModelStateV1:
    """Read one model's blocks and build its state (raises what discovery raises)."""
    began = time.time()
    state = find_servers_by_prefix(dht, model.dht_prefix, model.num_blocks, timeout=timeout)
    caught: list[CaughtRowV1] = []
    total = skipped = 0
    try:
        read = read_reports(dht, model.dht_prefix, num_blocks=model.num_blocks, timeout=timeout)
        caught, total = caught_rows(read.reports)
        skipped = len(read.skipped)
    except Exception as exc:  # the reports are extra: their failure never hides the servers
        logger.warning("reading the client reports of %r failed: %s", model.dht_prefix, describe_error(exc))
    return model_state(state, repository=model.repository, listed=model.listed, read_at=began,
                       read_seconds=time.time() - began).model_copy(
        update={"caught": caught, "caught_total": total, "skipped_reports": skipped})


_REPORTERS_SHOWN = 8


def caught_rows(reports: Mapping[str, ClientReport],
                limit: int = MAX_CAUGHT_ROWS) -> tuple[list[CaughtRowV1], int]:
    """One row per (server, span) the ``reports`` ({reporter: report}) name, latest first; and the rows in all."""
    rows: dict[tuple[str, int, int], dict] = {}
    for reporter, report in sorted(reports.items()):
        for c in report.caught:
            row = rows.setdefault((c.peer_id, c.start, c.end), {"reporters": [], "detections": 0, "last": 0.0,
                                                               "difference": 0.0, "kinds": set()})
            row["reporters"].append(reporter)
            row["detections"] += c.count
            row["last"] = max(row["last"], c.when)
            row["difference"] = max(row["difference"], c.difference)
            row["kinds"].add(c.kind)
    ordered = sorted(rows.items(), key=lambda kv: (-kv[1]["last"], kv[0]))
    out = [CaughtRowV1(peer_id=peer, peer_id_short=short_peer_id(peer), start=start, end=end,
                       reports=len(r["reporters"]), detections=r["detections"], last_seen=r["last"],
                       max_difference=r["difference"] if math.isfinite(r["difference"]) else None,
                       kinds=sorted(r["kinds"]), reporters=r["reporters"][:_REPORTERS_SHOWN])
           for (peer, start, end), r in ordered[:limit]]
    return out, len(rows)


def short_peer_id(peer_id: str) -> str:
    """The last 8 characters of a peer id after '..' (base58 ids share their first characters)."""
    return peer_id if len(peer_id) <= 10 else ".." + peer_id[-8:]


def server_row(span: RemoteSpan) -> ServerRowV1:
    """The row of one span: its peer, blocks and the fields of its record."""
    info = span.info
    pings: list[tuple[str, float | None]] = []
    for peer, rtt in sorted((info.next_pings or {}).items(), key=lambda kv: (kv[1], kv[0]))[:MAX_PINGS]:
        pings.append((peer, rtt if math.isfinite(rtt) else None))  # +inf (failed ping) has no JSON form
    return ServerRowV1(
        peer_id=span.peer_id, peer_id_short=short_peer_id(span.peer_id), public_name=info.public_name,
        start=span.start, end=span.end, state=_STATE_NAMES[span.state], throughput=info.throughput,
        inference_rps=info.inference_rps, network_rps=info.network_rps, cache_tokens_left=info.cache_tokens_left,
        torch_dtype=info.torch_dtype, quant_type=info.quant_type, version=info.version,
        using_relay=info.using_relay, next_pings=dict(pings),
    )


def route_of(state: SwarmState) -> RouteV1:
    """The route a client would take through ONLINE servers, or why there is none."""
    try:
        route = make_route(state, min_state=ServerState.ONLINE)
    except NoRouteError as exc:
        return RouteV1(exists=False, first_gap=exc.block, message=str(exc)[:300])
    bottleneck = min(hop.throughput for hop in route)
    return RouteV1(exists=True, bottleneck_rps=bottleneck, hops=len(route),
                   message=f"{len(route)} hop(s), bottleneck {bottleneck:.2f} requests/s")


def model_state(state: SwarmState, *, repository: str | None = None, listed: bool = True,
                read_at: float | None = None, read_seconds: float = 0.0) -> ModelStateV1:
    """A `ModelStateV1` holding every span of ``state`` (pages are cut when serving), with the cache figures of
    ``repository`` when it names a shipped preset (`figures_of_repository`)."""
    online = [sum(1 for s in block.values() if s.state == ServerState.ONLINE) for block in state.servers]
    joining = [sum(1 for s in block.values() if s.state == ServerState.JOINING) for block in state.servers]
    best: dict[str, ServerState] = {}
    for span in state.spans:
        best[span.peer_id] = max(best.get(span.peer_id, ServerState.OFFLINE), span.state)
    by_state = {name: sum(1 for s in best.values() if s == st) for st, name in _STATE_NAMES.items()}
    figures = figures_of_repository(repository)
    return ModelStateV1(
        **(asdict(figures) if figures is not None else {}),
        dht_prefix=state.dht_prefix, num_blocks=state.num_blocks, repository=repository, listed=listed,
        online_per_block=online, joining_per_block=joining, blocks_covered=sum(1 for k in online if k),
        servers=[server_row(s) for s in state.spans], servers_total=len(state.spans), peers_total=len(best),
        peers_by_state=by_state, route=route_of(state), skipped_records=len(state.skipped),
        failed_blocks=len(state.failed), read_at=time.time() if read_at is None else read_at,
        read_seconds=read_seconds,
    )


def with_error(previous: ModelStateV1 | None, model: ModelWanted, error: str) -> ModelStateV1:
    """``previous`` marked with ``error``; or, for a model never read, an empty state saying so."""
    if previous is not None:
        return previous.model_copy(update={"error": error})
    n = model.num_blocks
    return ModelStateV1(
        dht_prefix=model.dht_prefix, num_blocks=n, repository=model.repository, listed=model.listed,
        online_per_block=[0] * n, joining_per_block=[0] * n, blocks_covered=0, servers=[], servers_total=0,
        peers_total=0, peers_by_state={name: 0 for name in _STATE_NAMES.values()},
        route=RouteV1(exists=False, first_gap=0, message="not read yet"), skipped_records=0, failed_blocks=0,
        read_at=0.0, read_seconds=0.0, error=error,
    )


def describe_error(exc: BaseException) -> str:
    """One line naming an exception (bounded: the text may come from the network)."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
